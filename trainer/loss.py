"""Chunked cross-entropy for packed batches: token-loss sum + count, never full fp32 logits.

The decoder runs once over the flat batch; only the positions that carry a loss (targets != -100)
are gathered, and the output embedding + cross-entropy run over them `chunk_tokens` at a time.
Each chunk is wrapped in activation checkpointing, so neither the forward nor the backward keeps
more than one chunk of logits alive: peak extra memory is chunk_tokens x vocab fp32 instead of
T x vocab.

The loss is a SUM plus a token count so the training loop can normalise across micro-batches and
ranks by the global number of loss tokens (the only normalisation under which packing changes
nothing compared with unpacked training).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pipeline.errors import UserError
from pipeline.shards import IGNORE_INDEX
from trainer.attention import segment_ids
from trainer.batch import MicroBatch


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    getter = getattr(model, "get_decoder", None)
    decoder = getter() if getter is not None else getattr(model, "model", None)
    if decoder is None:
        raise UserError(f"{type(model).__name__} has no decoder (get_decoder() / .model) to run")
    return decoder


def _check_plain_head(model: torch.nn.Module) -> None:
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, attr, None) not in (None, 1.0):
            raise UserError(
                f"{type(model).__name__} post-processes its logits ({attr}); the chunked loss "
                "only supports a plain linear output head"
            )


def hidden_states(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """Final decoder hidden states of the flat batch, [T, hidden]."""
    out = _decoder(model)(**batch.model_kwargs(), use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden.reshape(-1, hidden.shape[-1])


def loss_positions(batch: MicroBatch) -> torch.Tensor:
    """Flat indices of the tokens that carry a loss, without a device sync where possible
    (the count is known on the host: batch.n_loss_tokens)."""
    mask = batch.targets.reshape(-1) != IGNORE_INDEX
    if hasattr(torch, "nonzero_static"):
        try:
            return torch.nonzero_static(mask, size=batch.n_loss_tokens).reshape(-1)
        except (RuntimeError, NotImplementedError):
            pass
    return torch.nonzero(mask).reshape(-1)


def _chunk_token_losses(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, reduction="none")


def token_losses(
    model: torch.nn.Module, batch: MicroBatch, chunk_tokens: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 cross-entropy of every loss token [n_loss], their flat positions [n_loss])."""
    if chunk_tokens < 1:
        raise UserError(f"chunk_tokens must be positive, got {chunk_tokens}")
    _check_plain_head(model)
    head = model.get_output_embeddings()
    hidden = hidden_states(model, batch)
    positions = loss_positions(batch)
    targets = batch.targets.reshape(-1).index_select(0, positions)
    selected = hidden.index_select(0, positions)
    pieces = []
    for start in range(0, batch.n_loss_tokens, chunk_tokens):
        h = selected[start : start + chunk_tokens]
        t = targets[start : start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            pieces.append(checkpoint(_chunk_token_losses, head, h, t, use_reentrant=False))
        else:
            pieces.append(_chunk_token_losses(head, h, t))
    if not pieces:  # no loss token at all: keep the graph connected so backward still works
        return hidden.sum().float() * 0.0 + torch.zeros(0, device=hidden.device), positions
    return torch.cat(pieces), positions


def packed_loss(
    model: torch.nn.Module, batch: MicroBatch, chunk_tokens: int = 4096
) -> tuple[torch.Tensor, int]:
    """(sum of token cross-entropies as a 0-d fp32 tensor, number of loss tokens).

    Divide the sum by the global loss-token count of the optimizer step (not per micro-batch) to
    get the mean token loss.
    """
    losses, _ = token_losses(model, batch, chunk_tokens)
    return losses.sum(), batch.n_loss_tokens


def per_example_losses(model: torch.nn.Module, batch: MicroBatch, chunk_tokens: int = 4096) -> torch.Tensor:
    """Mean token loss of each example of the batch, fp32 [n_examples] (NaN for an example that
    has no loss token). Differentiable; meant for tests and evaluation."""
    losses, positions = token_losses(model, batch, chunk_tokens)
    cu = batch.cu_seqlens.to(positions.device)
    example = segment_ids(cu, batch.n_tokens).index_select(0, positions).long()
    sums = torch.zeros(batch.n_examples, dtype=torch.float32, device=losses.device)
    sums = sums.index_add(0, example, losses)
    counts = torch.bincount(example, minlength=batch.n_examples).to(torch.float32)
    return sums / counts
