"""Memory for long rows: the MLP in tiles of the sequence, and activation checkpoints in CPU memory.

At long rows the largest activations of a decoder layer are its MLP's: an 8B Llama's MLP keeps
several [T, 14,336] tensors for the backward (the gate's and up projection's outputs, their
product), 28 KB a token each in bf16, 3.5 GiB each at 131,072 tokens, even in a layer that is
recomputed (its backward needs them all at once). `tile_mlp(model, tokens)` runs each decoder
layer's MLP over the sequence `tokens` at a time, each tile under activation checkpointing, so the
backward recomputes one tile's intermediates at a time: the layer then keeps only the MLP's input
and output. The MLP works token by token, so the tiles compute exactly what the whole does. In a
compiled layer (`--compile`) the tiled MLP runs eagerly, a graph break between the attention's
graph and the rest: dynamo (torch 2.11) cannot trace a checkpoint called inside a checkpointed
layer ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer").

`offload_activations()` moves every tensor the forward saves for the backward to pinned CPU memory
and back when the backward needs it (`HostOffload`, torch's `save_on_cpu` with a byte count). With
every layer recomputed (`--grad-checkpointing`) those are the layers' inputs, [T, hidden] each (8B
in bf16: 8 KiB a token a layer, 32 GiB for 32 layers at 131,072 tokens), the checkpoints ALST (Arctic
Long Sequence Training) offloads too; the recomputation during the backward runs outside it and
stays on the GPU. `HostOffload.moved` counts the bytes moved, which is what the memory check before
the first step (`trainer.run.fit_check`) reads: the allocator's own statistics would count its
power-of-two rounding and its cache, not what a row needs.

Blocks of at least `EXACT_PIN_BYTES` are pinned at their exact size (`pinned_exact`) rather than
by torch's pinned allocator, which rounds every block up to a power of two: an 8B layer input at
327,680 tokens (2.5 GiB) would take 4 GiB there, and 32 of them 128 GiB instead of 80, more than a
128 GiB host holds. Page-locking is slow (cudaHostRegister and cudaHostUnregister walk every page
on the host while the GPU waits), so a block the backward has copied back goes to a pool
(`PinnedBlocks`) and the next step's forward copies into it: a run registers its blocks once; a
block is handed out again only after the copy out of it has ended.

On a GPU the copies run on a stream of their own (`copy_stream`), beside the compute: the forward's
copy of a saved tensor to the host starts once the compute stream has produced it (the allocator
keeps the tensor's memory until the copy has read it), and in the backward, as one saved tensor is
copied back, the ones saved just before it (as many bytes as it holds: the previous layer's input,
when it is a layer's input) start their copy back too, so that they are on the GPU when the backward
reaches them. The compute stream waits only for the copy of the tensor it asks for. That read-ahead
holds one more layer input on the GPU while a layer's backward runs (8B at 524,288 tokens: 4 GiB);
where the GPU has no room for it the memory check turns it off (`HostOffload.prefetch = False`) and
each saved tensor is copied back when the backward asks for it, the compute waiting for that copy
(one a layer, beside the layer's seconds of backward at such lengths). A parameter
(or a view of one, such as the transposed output head a matmul saves) stays where it is: it lives
on the GPU anyway, and copying it out and back would only cost time.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from pipeline.contract import UserError

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
            raise UserError(
                f"--tile-mlp: {type(layer).__name__} has no MLP module ({' or '.join(MLP_NAMES)}) "
                "to run in tiles; train this model without --tile-mlp"
            )
        if getattr(mlp, _TILED, False):
            continue
        whole = mlp.forward

        @torch.compiler.disable
        def tiled(self: torch.nn.Module, hidden: torch.Tensor, *args: Any, _whole=whole, **kwargs: Any):
            if args or kwargs or hidden.shape[-2] <= tokens:
                return _whole(hidden, *args, **kwargs)
            pieces = [checkpoint(_whole, tile, use_reentrant=False) for tile in hidden.split(tokens, dim=-2)]
            if not all(isinstance(p, torch.Tensor) for p in pieces):
                raise UserError(
                    f"--tile-mlp: {type(self).__name__} returns more than its hidden states (a "
                    "mixture-of-experts block?), which cannot be joined from tiles; train without "
                    "--tile-mlp"
                )
            return torch.cat(pieces, dim=-2)

        mlp.forward = types.MethodType(tiled, mlp)
        setattr(mlp, _TILED, True)


EXACT_PIN_BYTES = 1 << 30  # blocks this large are pinned at their own size (`pinned_exact`)


def pinned_exact(size: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A host tensor of `size` page-locked at exactly its bytes (cudaHostRegister on ordinary memory,
    cudaHostUnregister when the tensor is freed), and whether it is page-locked: where the driver
    refuses, the tensor stays pageable (its copies are then synchronous, nothing else changes)."""
    tensor = torch.empty(size, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    cudart = torch.cuda.cudart()
    if nbytes == 0 or int(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0)) != 0:
        return tensor, False
    # runs as the tensor is freed, before its memory goes back to the host's allocator
    weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())
    return tensor, True


class _Block:
    """A page-locked host block (`raw`, bytes) and the event after the last copy out of it."""

    def __init__(self, raw: torch.Tensor) -> None:
        self.raw, self.event = raw, None

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


class PinnedBlocks:
    """Page-locked blocks kept for reuse (see the module): `take(n)` hands out the smallest free block
    of at least n bytes, else page-locks a new one (first letting go of the free blocks smaller than
    n: they were a shorter row's); a block comes back when the host tensor viewing it is freed.
    `clear()` lets go of the free ones (the end of a run). Host memory held is then at most what the
    longest step's forward moved into blocks of this size.

    For example, two steps of a 131,072-token row of the 8B shape: the first registers 32 blocks of
    1 GiB, the second copies into the same 32."""

    def __init__(self) -> None:
        self.free: list[_Block] = []

    def take(self, size: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        """A host tensor of `size` and `dtype` in a pooled page-locked block, or None where the driver
        refuses to page-lock (then use pageable memory)."""
        nbytes = torch.Size(size).numel() * dtype.itemsize
        fits = [b for b in self.free if b.nbytes >= nbytes]
        if fits:
            block = min(fits, key=lambda b: b.nbytes)
            self.free.remove(block)
            if block.event is not None:
                block.event.synchronize()  # the backward's copy out of it has ended
                block.event = None
        else:
            self._let_go([b for b in self.free if b.nbytes < nbytes])
            raw, locked = pinned_exact(torch.Size([nbytes]), torch.uint8)
            if not locked:
                return None
            block = _Block(raw)
        view = block.raw[:nbytes].view(dtype).view(size)
        view._packlm_block = block  # unpack records its copy's event here
        weakref.finalize(view, self.free.append, block)
        return view

    def clear(self) -> None:
        """Let go of the free blocks."""
        self._let_go(list(self.free))

    def _let_go(self, blocks: list[_Block]) -> None:
        """Drop `blocks` from the pool once their copies have ended: `pinned_exact` unregisters each as
        its memory is freed."""
        for block in blocks:
            if block.event is not None:
                block.event.synchronize()
            self.free.remove(block)


PINNED = PinnedBlocks()  # the process's pool: HostOffload takes from it, the end of a run clears it


_COPY_STREAMS: dict[torch.device, Any] = {}


def copy_stream(device: torch.device) -> Any:
    """The stream the offload's copies to and from `device` (a GPU) run on, one a device."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


class _Saved:
    """A tensor the forward saved, waiting in host memory: `host`, where it goes back (`device`),
    whether its copies are asynchronous (pinned host memory, a GPU), its place in the forward's order
    (`order`: weak references to every `_Saved` of that forward, `index` its own) and, once its copy
    back has started, `back`: (the tensor on the device, the event after its copy or None)."""

    __slots__ = ("host", "device", "asynchronous", "order", "index", "back", "used", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, asynchronous: bool, order: list) -> None:
        self.host, self.device, self.asynchronous = host, device, asynchronous
        self.order, self.index = order, len(order)
        self.back: tuple[torch.Tensor, Any] | None = None
        self.used = False
        order.append(weakref.ref(self))

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def fetch(self) -> None:
        """Start the copy back (on the copy stream where asynchronous); `back` holds it."""
        if not self.asynchronous:
            self.back = (self.host.to(self.device), None)
            return
        # allocated from the compute stream's memory, as the tensor it replaces was; the copy waits
        # for the compute queued so far, which may still read that memory's earlier contents
        tensor = torch.empty_like(self.host, device=self.device)
        stream = copy_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            tensor.copy_(self.host, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        tensor.record_stream(stream)
        block = getattr(self.host, "_packlm_block", None)
        if block is not None:  # the pool hands the block out again only after this copy
            block.event = event
        self.back = (tensor, event)

    def earlier(self, budget: int) -> list[_Saved]:
        """The tensors saved before this one, nearest first, that are to start their copy back so
        that `budget` bytes of them are on their way (those on their way already count): at most
        about `budget` bytes wait on the device ahead of the backward."""
        found: list[_Saved] = []
        for i in range(self.index - 1, -1, -1):  # no copy of the list: a backward asks once a tensor
            if budget <= 0:
                break
            saved = self.order[i]()
            if saved is None or saved.used:
                continue
            if saved.back is None:
                found.append(saved)
            budget -= saved.nbytes
        return found


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """While active: each tensor the forward saves for the backward is copied to host memory (pinned
    with `pin`, so that the copies are asynchronous) and copied back to its device when the backward
    needs it, as `torch.autograd.graph.save_on_cpu` does, on a GPU beside the compute and ahead of
    the backward (see the module). `HostOffload.moved` adds up the bytes of every copy made (by any
    offload, since it was last set to 0): all of them wait in host memory until the backward, so
    after a forward it is what that forward holds there. `HostOffload.prefetch` (True unless the
    memory check found no room): whether copying a tensor back starts the copy of as many bytes saved
    before it (see the module); `HostOffload.ahead`, the most bytes those copies have held on the
    device ahead of the backward since it was last set to 0 (what turning them off gives back).

    For example, an 8B Llama in bf16 with every layer recomputed saves each layer's [T, 4096] input:
    a 1,024-token forward moves 32 x 1,024 x 4,096 x 2 bytes = 256 MiB of them (plus the few
    tensors the loss and the final norm save)."""

    moved = 0
    ahead = 0
    prefetch = True

    def __init__(self, pin: bool) -> None:
        order: list = []  # this forward's saved tensors, in the order saved
        waiting = [0]  # bytes of them copied back ahead of need and not yet taken

        def pack(tensor: torch.Tensor) -> _Saved | torch.Tensor:
            if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
                return tensor  # lives on its device anyway
            nbytes = tensor.numel() * tensor.element_size()
            pinned = pin and not tensor.is_sparse
            if pinned and nbytes >= EXACT_PIN_BYTES:
                host = PINNED.take(tensor.size(), tensor.dtype)
                if host is None:  # the driver refused to page-lock: ordinary memory, synchronous copies
                    host, pinned = torch.empty(tensor.size(), dtype=tensor.dtype), False
            else:
                host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
            asynchronous = pinned and tensor.device.type == "cuda"
            if asynchronous:
                stream = copy_stream(tensor.device)
                stream.wait_stream(torch.cuda.current_stream(tensor.device))  # once it is computed
                with torch.cuda.stream(stream):
                    host.copy_(tensor, non_blocking=True)
                tensor.record_stream(stream)  # its memory is not reused before the copy has read it
            else:
                host.copy_(tensor)
            HostOffload.moved += nbytes
            return _Saved(host, tensor.device, asynchronous, order)

        def unpack(saved: _Saved | torch.Tensor) -> torch.Tensor:
            if isinstance(saved, torch.Tensor):
                return saved
            if saved.back is None:
                saved.fetch()
            else:  # copied back ahead of need
                waiting[0] -= saved.nbytes
            tensor, event = saved.back
            saved.back, saved.used = None, True
            if HostOffload.prefetch:
                for earlier in saved.earlier(saved.nbytes):  # the backward needs these next
                    earlier.fetch()
                    waiting[0] += earlier.nbytes
                HostOffload.ahead = max(HostOffload.ahead, waiting[0])
            if event is not None:
                torch.cuda.current_stream(saved.device).wait_event(event)
            return tensor

        super().__init__(pack, unpack)


def offload_activations(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager:
    """While the forward runs: what it saves for the backward goes to CPU memory (pinned where the
    model is on a GPU, so the copies are asynchronous); a null context when not `enabled`."""
    if not enabled:
        return contextlib.nullcontext()
    return HostOffload(pin=device.type == "cuda")
