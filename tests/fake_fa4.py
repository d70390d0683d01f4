"""A stand-in for FlashAttention-4's kernels on a machine without a GPU: `fake_fa4` puts
`flash_attn.cute.interface` in `sys.modules` with `_flash_attn_fwd` / `_flash_attn_bwd` computing what
FlashAttention documents (`flash_semantics`, float64), so the "fa4" backend's custom ops
(`trainer.attention.fa4_ops`) run on the CPU, eager or compiled, and each forward call is recorded
(its window, soft-cap, head dims, query and key boundaries and longest lengths)."""

from __future__ import annotations

import sys
import types

import torch


def flash_semantics(q, k, v, cu, scale, window_size=(-1, -1), softcap=0.0, cu_k=None):
    """What flash-attn documents for causal=True: query i sees keys j with i - left <= j <= i
    (left = window_size[0], -1 for no limit), scores soft-capped as softcap * tanh(s / softcap).
    With key boundaries of their own (`cu_k`), sequence n's queries cu[n]:cu[n+1] attend its keys
    cu_k[n]:cu_k[n+1] with the mask aligned to the bottom right: query i sees key j when
    j <= i + len_k - len_q."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    bounds = cu.tolist()
    key_bounds = bounds if cu_k is None else cu_k.tolist()
    for s, e, ks, ke in zip(bounds[:-1], bounds[1:], key_bounds[:-1], key_bounds[1:]):
        scores = torch.einsum("ihd,jhd->hij", q[s:e], k[ks:ke]) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        i = torch.arange(e - s)[:, None] + (ke - ks) - (e - s)  # each query's place among the keys
        j = torch.arange(ke - ks)[None, :]
        keep = j <= i
        if window_size[0] >= 0:
            keep &= j >= i - window_size[0]
        scores = scores.masked_fill(~keep, float("-inf"))
        out[s:e] = torch.einsum("hij,jhd->ihd", torch.softmax(scores, -1), v[ks:ke])
    return out


def fake_fa4(monkeypatch, calls: list) -> None:
    """Stand in for flash_attn.cute.interface with FlashAttention's documented semantics (float64):
    the forward returns (out, lse, ...), the backward the gradients of that same function."""

    def window_of(left, right):
        assert (left is None) == (right is None) and right in (None, 0)
        return (-1 if left is None else left, 0)

    def _flash_attn_fwd(
        q,
        k,
        v,
        *,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        return_lse,
    ):
        assert causal and return_lse and cu_seqlens_q.shape == cu_seqlens_k.shape
        calls.append(
            dict(
                window=window_of(window_size_left, window_size_right),
                softcap=softcap,
                dims={q.shape[-1], k.shape[-1], v.shape[-1]},
                cu=cu_seqlens_q.tolist(),
                cu_k=cu_seqlens_k.tolist(),
                max=(max_seqlen_q, max_seqlen_k),
            )
        )
        out = flash_semantics(q, k, v, cu_seqlens_q, softmax_scale, calls[-1]["window"], softcap, cu_seqlens_k)
        lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
        return out.to(q.dtype), lse, None, None, None

    def _flash_attn_bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        softmax_scale,
        causal,
        softcap,
        *,
        window_size_left,
        window_size_right,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
    ):
        assert causal and lse.shape == (q.shape[1], q.shape[0]) and out.shape == dout.shape
        window = window_of(window_size_left, window_size_right)
        _, vjp = torch.func.vjp(
            lambda a, b, c: flash_semantics(a, b, c, cu_seqlens_q, softmax_scale, window, softcap, cu_seqlens_k),
            q.double(),
            k.double(),
            v.double(),
        )  # (autograd is off inside a custom op)
        return tuple(g.to(x.dtype) for g, x in zip(vjp(dout.double()), (q, k, v)))

    monkeypatch.setitem(
        sys.modules, "flash_attn.cute.interface", types.SimpleNamespace(_flash_attn_fwd=_flash_attn_fwd, _flash_attn_bwd=_flash_attn_bwd)
    )
