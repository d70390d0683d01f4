"""The attention of the ring-flash-attn peer (`ring_peer`): ring-flash-attn's Hugging Face adapter
installed in transformers' flash_attention_2 slot (`install_ring`, importable under transformers 5:
`import_adapter`), the padded row's boundaries handed to it (`set_ring_row`), its kernel's calls
counted (`RingCalls`); and, for the CPU, an exact reference in the sdpa slot (`fake_ring`: K and V
all-gathered over the group, each example's causal mask at positions on the whole row)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


class RingCalls:
    """Counts the calls of the ring attention function, and stops a run whose first forward did not
    call it once per decoder layer."""

    def __init__(self) -> None:
        self.n = 0

    def wrap(self, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.n += 1
            return fn(*args, **kwargs)

        return counted

    def check(self, layers: int, what: str) -> None:
        if self.n != layers:
            raise SystemExit(
                f"{what} was called {self.n} times in the first forward, not once per decoder layer "
                f"({layers}): the patch does not reach this transformers release's attention; "
                "no numbers are reported"
            )


def import_adapter() -> Any:
    """`ring_flash_attn.adapters.hf_adapter`, importable under transformers 5.

    ring-flash-attn 0.1.8's adapter imports `is_flash_attn_greater_or_equal_2_10` from
    `transformers.modeling_flash_attention_utils`, which transformers 5 no longer defines there
    (zhuzilin/ring-flash-attention PR #88, unreleased), so `import ring_flash_attn` fails; the
    adapter only tests that name for truth, and the flash-attn it runs with (2.8) is >= 2.10, so a
    function answering True is put in its place first."""
    import transformers.modeling_flash_attention_utils as fa_utils

    if not hasattr(fa_utils, "is_flash_attn_greater_or_equal_2_10"):
        fa_utils.is_flash_attn_greater_or_equal_2_10 = lambda: True
    from ring_flash_attn.adapters import hf_adapter

    return hf_adapter


def install_ring(group: Any, heads_k_stride: int, calls: RingCalls) -> str:
    """Route transformers' flash_attention_2 through ring-flash-attn's HF adapter; returns how.

    The adapter replaces `modeling_flash_attention_utils._flash_attention_forward` with the ring
    form whose parameter count matches this release's, and registers its own flash_attention_2
    interface (which looks that name up at call time; transformers' own interface imported it by
    name). Where no form matches (a release newer than the adapter knows), its transformers>=4.53
    form, which takes **kwargs, is installed the same way by hand; the call count then shows
    whether it is used. The ring kernel itself (`llama3_flash_attn_varlen_func`, a global of the
    adapter's module) is wrapped by `calls`."""
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    hf_adapter = import_adapter()

    try:
        hf_adapter.substitute_hf_flash_attn(group, heads_k_stride)
        how = "substitute_hf_flash_attn"
    except ValueError:
        fa_utils._flash_attention_forward = hf_adapter.create_ring_flash_attention_forward(group, heads_k_stride)[-1]
        ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = hf_adapter.flash_attention_forward
        how = "adapter's transformers>=4.53 forward installed by hand (its signature check refused this release)"
    hf_adapter.llama3_flash_attn_varlen_func = calls.wrap(hf_adapter.llama3_flash_attn_varlen_func)
    return how


def set_ring_row(cu_seqlens: torch.Tensor, group: Any) -> None:
    """The ring adapter's per-row state: the padded row's example boundaries."""
    import_adapter().update_ring_flash_attn_params(cu_seqlens, group)


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence (dim 2 of [batch, heads, tokens, dim]); the backward sums the
    gradient over the group and keeps this rank's part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # noqa: D102
        ctx.group, ctx.n = group, x.shape[2]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad.narrow(2, rank * ctx.n, ctx.n), None


@dataclass
class ReferenceRing:
    """The state of `reference_attention`: the group and the padded row's boundaries."""

    group: Any = None
    cu_seqlens: torch.Tensor | None = None


def reference_attention(state: ReferenceRing, calls: RingCalls) -> Any:
    """An attention interface (transformers' signature) computing exactly what the ring computes:
    this rank's queries against the whole row's keys and values, each query seeing the earlier
    tokens of its own example only (positions on the whole row)."""

    def attend(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        calls.n += 1
        key, value = _GatherSeq.apply(key, state.group), _GatherSeq.apply(value, state.group)
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        local, total = query.shape[2], key.shape[2]
        q_pos = dist.get_rank(state.group) * local + torch.arange(local)
        k_pos = torch.arange(total)
        example = torch.searchsorted(state.cu_seqlens[1:].long(), torch.arange(total), right=True)
        mask = (example[q_pos][:, None] == example[None, :]) & (k_pos[None, :] <= q_pos[:, None])
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask.to(query.device), scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return attend


@contextlib.contextmanager
def fake_ring(state: ReferenceRing, calls: RingCalls) -> Iterator[None]:
    """`reference_attention` in the sdpa slot of transformers' attention interfaces, for the block."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS["sdpa"] = reference_attention(state, calls)
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]  # the library's own again
