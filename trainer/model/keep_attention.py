"""Recomputed layers that keep their attention output: `--grad-checkpointing --keep-attention`.

A checkpointed decoder layer (`--grad-checkpointing`) runs its forward twice: once in the forward
pass, keeping only its input, and once more in the backward to rebuild what the backward needs. At
long rows most of that second forward is attention's: at 131,072 tokens in one example the 8B's
causal attention forward is about 2.4 times its weights' forward a token, so the recompute is about
a quarter of the step's FLOPs and attention 70% of it. With `--keep-attention` each checkpointed
layer keeps the attention kernel's outputs (its [T, heads, head_dim] output and its log-sum-exp,
which the kernel's backward reads) from the forward pass, and the recompute takes them instead of
calling the kernel again: the layer's projections, norms, rotary embedding and MLP are recomputed as
before, attention's forward is not.

It is torch's selective activation checkpointing (`create_selective_checkpoint_contexts`): a policy
that marks the attention kernels' operators (`ATTENTION_OPS`) MUST_SAVE and everything else
PREFER_RECOMPUTE. The recompute replays the same operators in the same order, so it returns the very
tensors the forward made: the gradients are the plain checkpoint's, bit for bit.

The cost is memory: the kept outputs stay on the GPU (also under `--offload-activations`, which moves
only the layers' inputs), T x hidden x 2 bytes a layer in bf16 plus the log-sum-exp (the 8B: 8 KiB a
token a layer, 32 GiB for 32 layers at 131,072 tokens). pack-train's memory check before the first
step measures it like everything else.

A kernel that computes attention as several operators (the sdpa reference with soft-capping or
sinks, flex uncompiled) has no single output to keep: its layers then recompute attention as they
would without the option, and `KeptAttention.kept` stays 0, which pack-train reports after its first
step.
"""

from __future__ import annotations

from typing import Any

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# The attention kernels' forward operators, by schema name: what each `--attn` kernel dispatches
# (trainer.attention.kernels), and PyTorch's own fused attention on any device.
ATTENTION_OPS = frozenset(
    {
        "aten::_scaled_dot_product_cudnn_attention",  # cudnn
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",  # sdpa on the CPU
        "aten::_flash_attention_forward",  # torch (varlen)
        "aten::_efficient_attention_forward",
        "torch_attn::_varlen_attn",  # torch (varlen, torch >= 2.10)
        "flash_attn::_flash_attn_varlen_forward",  # flash_attn
        "flash_attn::_flash_attn_forward",
        "packlm::fa4_varlen_fwd",  # fa4
    }
)


def op_name(op: Any) -> str:
    """The schema name of a dispatched operator ("aten::mm"), or "" for one that has none."""
    schema = getattr(op, "_schema", None)
    return str(getattr(schema, "name", "")) if schema is not None else ""


class KeptAttention:
    """The selective-checkpoint policy (see the module) and a count of the attention outputs it kept
    in forward passes (`kept`): 0 after a step means the model's attention ran as several operators."""

    def __init__(self) -> None:
        self.kept = 0

        def context_fn() -> Any:
            """What torch.utils.checkpoint's `context_fn` calls for each checkpointed forward: a plain
            function, not a bound method, since torch.compile traces a checkpoint only with a
            function or functools.partial as its `context_fn` (compiled layers, `--compile`)."""
            return create_selective_checkpoint_contexts(self.policy)

        self.context_fn = context_fn

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op_name(op) in ATTENTION_OPS:
            if not ctx.is_recompute:
                self.kept += 1
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(keep: KeptAttention | None) -> dict[str, Any]:
    """torch.utils.checkpoint's keyword arguments for the decoder layers: non-reentrant, and with
    `keep` the policy that keeps attention's outputs."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if keep is not None:
        kwargs["context_fn"] = keep.context_fn
    return kwargs
