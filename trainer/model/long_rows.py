"""Memory for long rows: the MLP in tiles of the sequence, and activation checkpoints in CPU memory.

At long rows the largest activations of a decoder layer are its MLP's: an 8B Llama's MLP keeps
several [T, 14,336] tensors for the backward (the gate's and up projection's outputs, their
product), 28 KB a token each in bf16, 3.5 GiB each at 131,072 tokens, even in a layer that is
recomputed (its backward needs them all at once). `tile_mlp(model, tokens)` runs each decoder
layer's MLP over the sequence `tokens` at a time, each tile under activation checkpointing, so the
backward recomputes one tile's intermediates at a time: the layer then keeps only the MLP's input
and output. The MLP works token by token, so the tiles compute exactly what the whole does.

`offload_activations()` moves every tensor the forward saves for the backward to pinned CPU memory
and back when the backward needs it (`torch.autograd.graph.save_on_cpu`). With every layer
recomputed (`--grad-checkpointing`) those are the layers' inputs, [T, hidden] each (8B: 8 KB a token
a layer, 32 GB for 32 layers at 131,072 tokens), the checkpoints ALST (Arctic Long Sequence
Training) offloads too; the recomputation during the backward runs outside it and stays on the GPU.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from pipeline.errors import UserError

MLP_NAMES = ("mlp", "feed_forward")  # the MLP's attribute on a decoder layer (Llama, Llama 4 ...)
_TILED = "_packlm_tiled"


def layer_mlp(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The MLP of a decoder layer, or None."""
    for name in MLP_NAMES:
        found = getattr(layer, name, None)
        if isinstance(found, torch.nn.Module):
            return found
    return None


def tile_mlp(layers: list[torch.nn.Module], tokens: int) -> None:
    """Run the MLP of each of `layers` over the sequence `tokens` at a time (see the module).
    A layer without an MLP module, or an MLP that returns more than its hidden states (a
    mixture-of-experts block with router logits), is refused in one line when found."""
    if tokens < 1:
        raise UserError(f"--tile-mlp {tokens}: give the tile's length in tokens (e.g. 8192), or 0 for off")
    for layer in layers:
        mlp = layer_mlp(layer)
        if mlp is None:
            raise UserError(f"--tile-mlp: {type(layer).__name__} has no MLP module ({' or '.join(MLP_NAMES)}) "
                            "to run in tiles; train this model without --tile-mlp")
        if getattr(mlp, _TILED, False):
            continue
        whole = mlp.forward

        def tiled(self: torch.nn.Module, hidden: torch.Tensor, *args: Any, _whole=whole, **kwargs: Any):
            if args or kwargs or hidden.shape[-2] <= tokens:
                return _whole(hidden, *args, **kwargs)
            pieces = [checkpoint(_whole, tile, use_reentrant=False) for tile in hidden.split(tokens, dim=-2)]
            if not all(isinstance(p, torch.Tensor) for p in pieces):
                raise UserError(f"--tile-mlp: {type(self).__name__} returns more than its hidden states (a "
                                "mixture-of-experts block?), which cannot be joined from tiles; train without "
                                "--tile-mlp")
            return torch.cat(pieces, dim=-2)

        mlp.forward = types.MethodType(tiled, mlp)
        setattr(mlp, _TILED, True)


def offload_activations(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager:
    """While the forward runs: what it saves for the backward goes to CPU memory (pinned where the
    model is on a GPU, so the copies are asynchronous); a null context when not `enabled`."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
