"""`--dtype bf16-weights`: the model computes with bf16 weights, the optimizer updates fp32 masters.

Under `--dtype bf16` (autocast) the weights stay fp32. Every matmul casts its weight to bf16 again,
forward and backward, each bf16 weight gradient is cast back to add into an fp32 `.grad`, and the
residual stream between layers stays fp32. With `bf16-weights` the trainable parameters themselves
are bf16 (buffers such as RoPE's inverse frequencies stay as they are), so the residual stream is
bf16 too and those casts are gone. Precision is kept where it matters, as in Megatron's bf16
training and FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)`:

- gradients: after each micro-batch's backward, `collect_grads` adds the bf16 gradients into fp32
  gradients of the masters and drops them, so accumulation over micro-batches happens in fp32;
- the update: the optimizer (and gradient clipping) works on the fp32 masters, and `publish` copies
  them, rounded to bf16, back into the model;
- checkpoints: `full_precision()` puts the masters into the model while it is saved, so a checkpoint
  (or a merged model) holds the fp32 weights, and a resumed run starts from them exactly.

Example, one step (what `trainer.loop` does)::

    masters = MasterWeights(model)          # model's trainable weights now bf16
    optimizer = torch.optim.AdamW(masters.params)
    loss = model(batch); loss.backward()    # bf16 gradients on the model
    masters.collect_grads()                 # -> fp32 .grad on the masters, none left on the model
    optimizer.step(); optimizer.zero_grad(); masters.publish()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class MasterWeights:
    """fp32 master copies of a model's trainable parameters, which become bf16 (see the module)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        # clone: .float() of an fp32 tensor is the tensor itself
        self.params = [torch.nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        for param in self.model_params:
            param.data = param.data.to(torch.bfloat16)

    @torch.no_grad()
    def collect_grads(self) -> None:
        """Add the model's bf16 gradients into the masters' fp32 gradients and drop them."""
        for param, master in zip(self.model_params, self.params):
            if param.grad is None:
                continue
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """Copy the (updated) masters into the model's bf16 weights."""
        torch._foreach_copy_(self.model_params, self.params)

    @contextlib.contextmanager
    def full_precision(self) -> Iterator[None]:
        """The model holds the fp32 masters meanwhile (to save it); its bf16 weights come back after."""
        compute = [p.data for p in self.model_params]
        for param, master in zip(self.model_params, self.params):
            param.data = master.data
        try:
            yield
        finally:
            for param, data in zip(self.model_params, compute):
                param.data = data
