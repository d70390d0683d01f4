"""`--dtype bf16-weights`: the model computes with bf16 weights, AdamW updates fp32 masters.

Under `--dtype bf16` (autocast) the weights stay fp32. Every matmul casts its weight to bf16 again,
forward and backward, each bf16 weight gradient is cast back to add into an fp32 `.grad`, and the
residual stream between layers stays fp32. With `bf16-weights` the trainable parameters themselves
are bf16 (buffers such as RoPE's inverse frequencies stay as they are), so the residual stream is
bf16 too and those casts are gone. Precision is kept where it matters, as in Megatron's bf16
training and FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)`:

- gradients: with several micro-batches per step, `collect_grads` adds each one's bf16 gradients
  into fp32 gradients of the masters right after its backward, so accumulation happens in fp32.
  With one micro-batch the bf16 gradients are used as they are (every bf16 number is an fp32 one,
  so that is the same gradient);
- the update: `MasterAdamW.step` is AdamW on the fp32 masters, and it also writes each updated
  master, rounded to bf16, into the model. On CUDA it is compiled: a kernel per parameter reads
  the gradient, master and moments once and writes them once, gradient clipping included
  (`clip_grad_norm_` only computes the coefficient), instead of separate passes to clip, to step
  and to copy back. The compiled function is called on chunks of up to `CHUNK_TENSORS` parameters
  of one shape (`signature_chunks`), so its graphs are one per shape, whatever the number of
  layers. A graph's compile time grows with the parameters it updates, and an 8B LoRA model has
  448 adapter matrices in five shapes: five graphs of 8 matrices, not one of 448;
- checkpoints: `full_precision()` puts the masters into the model while it is saved, so a checkpoint
  (or a merged model) holds the fp32 weights, and a resumed run starts from them exactly.

Example, one step (what `trainer.run.loop` does)::

    optimizer = MasterAdamW(param_groups(model.parameters(), 0.1), lr=3e-4)  # model's weights now bf16
    loss = model(batch); loss.backward()                       # bf16 gradients on the model
    norm = optimizer.clip_grad_norm_(1.0)                      # fp32 norm; the scaling waits for step
    optimizer.step()                                           # fp32 masters and bf16 weights updated
    optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainer.model.load import allow_recompiles

CHUNK_TENSORS = 8  # parameters per call of the compiled update (see signature_chunks)


def signature_chunks(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], size: int = CHUNK_TENSORS
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """`pairs` of (master, gradient) split into chunks of at most `size` pairs that share a
    signature (the master's shape and dtype, the gradient's dtype), in order of first appearance.

    A compiled function specialises on its inputs' shapes, so a call on one chunk reuses the graph
    of any earlier chunk with the same signature and length. A Llama decoder's parameters have a
    handful of shapes repeated in every layer: its update compiles a handful of graphs of `size`
    tensors, however many layers there are. For example, with `size=2` and the masters' shapes
    [(4, 8), (8, 4), (4, 8), (8, 4), (4, 8)] (gradients of one dtype) the chunks are
    [[0, 2], [4], [1, 3]] by position.
    """
    by_signature: dict[tuple[Any, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for master, grad in pairs:
        by_signature.setdefault((tuple(master.shape), master.dtype, grad.dtype), []).append((master, grad))
    return [same[i : i + size] for same in by_signature.values() for i in range(0, len(same), size)]


def adamw_update(
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    weights: list[torch.Tensor],
    clip: torch.Tensor,
    hyper: torch.Tensor,
) -> None:
    """One AdamW step (torch.optim.AdamW's arithmetic) of each fp32 master of one group, in place.

    Each gradient is bf16 or fp32 and is scaled by `clip` (the clipping coefficient, a 0-d tensor)
    as it is read; each `weights` entry (the model's bf16 parameter) receives its new master.
    `steps` are the masters' step counts and `hyper` the group's [lr, weight_decay, beta1, beta2,
    eps], all on the masters' device, so neither a new learning rate nor a new step recompiles the
    compiled form: one graph per chunk signature (`signature_chunks`) for a whole run.
    """
    lr, weight_decay, beta1, beta2, eps = hyper.unbind()
    for master, grad, exp_avg, exp_avg_sq, step, weight in zip(masters, grads, exp_avgs, exp_avg_sqs, steps, weights):
        step.add_(1)
        g = grad.float() * clip
        master.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).add_(g * g * (1 - beta2))
        denom = exp_avg_sq.sqrt() / (1 - beta2**step).sqrt() + eps
        master.sub_(exp_avg / denom * (lr / (1 - beta1**step)))
        weight.copy_(master)


class MasterAdamW(torch.optim.Optimizer):
    """AdamW over fp32 master copies of a model's trainable parameters, which become bf16 (see the
    module). Its parameters (in `param_groups`) are the masters; its state per master
    is AdamW's (`exp_avg`, `exp_avg_sq`, `step`, the latter on the device like AdamW's capturable
    mode), so it saves and resumes through the usual `state_dict`."""

    def __init__(
        self, groups: list[dict[str, Any]], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
    ) -> None:
        """`groups`: parameter groups of the model's trainable parameters (each with its
        `weight_decay`); those parameters become bf16, and the groups hold their fp32 masters."""
        self.weight_of: dict[torch.nn.Parameter, torch.nn.Parameter] = {}  # master -> model's parameter
        master_groups = []
        for group in groups:
            masters = []
            for param in group["params"]:
                # clone: .float() of an fp32 tensor is the tensor itself
                master = torch.nn.Parameter(param.detach().float().clone())
                param.data = param.data.to(torch.bfloat16)
                self.weight_of[master] = param
                masters.append(master)
            master_groups.append({**group, "params": masters})
        super().__init__(master_groups, {"lr": lr, "betas": betas, "eps": eps, "capturable": True})
        self._clip: torch.Tensor | None = None
        self._update: Callable[..., None] = adamw_update
        if any(master.is_cuda for master in self.weight_of):
            # static shapes: each step calls it with the same chunks (a kernel per parameter); a
            # graph per shape for its full chunks and one for the rest, with either gradient dtype
            allow_recompiles(4 * len({master.shape for master in self.weight_of}))
            self._update = torch.compile(adamw_update, dynamic=False, fullgraph=True)

    def _grad(self, master: torch.Tensor) -> torch.Tensor | None:
        """The step's gradient of `master`: collected in fp32, or the model's bf16 one."""
        return master.grad if master.grad is not None else self.weight_of[master].grad

    @torch.no_grad()
    def collect_grads(self) -> None:
        """Add the model's bf16 gradients into the masters' fp32 gradients and drop them."""
        for master, param in self.weight_of.items():
            if param.grad is None:
                continue
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The gradients' total L2 norm (computed in fp32), as `torch.nn.utils.clip_grad_norm_`
        returns it; the scaling by min(1, max_norm / (norm + 1e-6)) happens inside `step`."""
        grads = [g for g in map(self._grad, self.weight_of) if g is not None]
        if not grads:
            self._clip = None
            return torch.zeros(())
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))
        self._clip = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        return norm

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """AdamW on every master with a gradient; the model's bf16 weights follow."""
        for group in self.param_groups:
            live = [(m, g) for m in group["params"] if (g := self._grad(m)) is not None]
            if not live:
                continue
            device = live[0][0].device
            beta1, beta2 = group["betas"]
            values = [group["lr"], group["weight_decay"], beta1, beta2, group["eps"]]
            hyper = torch.tensor(values, dtype=torch.float32)
            hyper = hyper.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else hyper
            clip = self._clip if self._clip is not None else torch.ones((), device=device)
            for chunk in signature_chunks(live):
                states = []
                for master, _ in chunk:
                    state = self.state[master]
                    if not state:
                        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                        state["exp_avg"] = torch.zeros_like(master)
                        state["exp_avg_sq"] = torch.zeros_like(master)
                    states.append(state)
                self._update(
                    [m.detach() for m, _ in chunk],
                    [g for _, g in chunk],
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    [s["step"] for s in states],
                    [self.weight_of[m].detach() for m, _ in chunk],
                    clip,
                    hyper,
                )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the step's gradients: the masters' fp32 ones and the model's bf16 ones."""
        for master, param in self.weight_of.items():
            master.grad = None
            param.grad = None
        self._clip = None

    @contextlib.contextmanager
    def full_precision(self) -> Iterator[None]:
        """The model holds the fp32 masters meanwhile (to save it); its bf16 weights come back after."""
        compute = {param: param.data for param in self.weight_of.values()}
        for master, param in self.weight_of.items():
            param.data = master.data
        try:
            yield
        finally:
            for param, data in compute.items():
                param.data = data
