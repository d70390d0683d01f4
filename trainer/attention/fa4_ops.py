"""FlashAttention-4 (the flash-attn-4 package, `flash_attn.cute`) as two torch custom ops,
`packlm::fa4_varlen_fwd` and `packlm::fa4_varlen_bwd`, and the "fa4" kernel over them
(`trainer.attention.kernels` chooses and checks it).
"""

from __future__ import annotations

import torch

from trainer.attention.features import Features, pad_last


def _fa4_window(window: int) -> dict[str, int | None]:
    """FlashAttention-4's window keywords (the same for forward and backward): none for -1, else
    `window` keys to the left and none to the right."""
    return {"window_size_left": None if window < 0 else window, "window_size_right": None if window < 0 else 0}


# FlashAttention-4 as two custom ops: torch.compile sees each as one opaque call with a known output
# shape (the fake implementations), instead of tracing into flash_attn.cute's Python. `window` is
# the number of keys to the left (-1: none), `softcap` 0.0 for none, as FlashAttention counts them.
# Queries and keys have boundaries of their own (`cu_q`, `cu_k`): the same on one GPU; under context
# parallelism a piece's queries are the last tokens of its keys, and FlashAttention aligns the causal
# mask to the bottom right (query i of a piece sees key j when j <= i + len_k - len_q).
@torch.library.custom_op(
    "packlm::fa4_varlen_fwd",
    mutates_args=(),
    schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, SymInt max_q, SymInt max_k, float scale, "
        "SymInt window, float softcap) -> (Tensor, Tensor)"
    ),
)
def _fa4_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, window, softcap):
    """out [Tq, Hq, D] and the softmax's log-sum-exp [Hq, Tq] (float32), which the backward needs."""
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        softmax_scale=scale,
        causal=True,
        softcap=softcap,
        return_lse=True,
        **_fa4_window(window),
    )
    return out, lse


@_fa4_fwd.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, window, softcap):
    return q.new_empty((*q.shape[:2], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op(
    "packlm::fa4_varlen_bwd",
    mutates_args=(),
    schema=(
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_q, Tensor cu_k, SymInt max_q, "
        "SymInt max_k, float scale, SymInt window, float softcap) -> (Tensor, Tensor, Tensor)"
    ),
)
def _fa4_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window, softcap):
    """dq, dk, dv of `_fa4_fwd` given the output's gradient."""
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        scale,
        True,
        softcap,
        **_fa4_window(window),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
    )
    return dq, dk, dv


@_fa4_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, window, softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fa4_save(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, window, softcap = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.args = (max_q, max_k, scale, window, softcap)


def _fa4_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _fa4_bwd(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


_fa4_fwd.register_autograd(_fa4_backward, setup_context=_fa4_save)


FA4_HEAD_DIMS = (64, 96, 128, 192, 256)  # FlashAttention-3's Hopper head dims, which FA4's tiles follow


def fa4_varlen(q, k, v, cu_seqlens, max_seqlen, scale, feats: Features, sinks, cu_seqlens_k=None, max_seqlen_k=None):
    """FlashAttention-4 through the custom ops above; grouped-query attention is native; keys with
    boundaries of their own (`cu_seqlens_k`, context parallelism) as the ops above take them. Head dims
    are zero-padded to the next of FA4_HEAD_DIMS (zeros add nothing to scores or outputs) and the
    output sliced back: FA4 accepts any multiple of 8 up to 256, but on an H100 its backward gave
    wrong gradients at head dim 16 (forward right), so only the dims its tiles are tuned for run."""
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    padded = next(h for h in FA4_HEAD_DIMS if h >= d)
    q, k, v = (pad_last(x, padded) for x in (q, k, v))
    window = -1 if feats.window is None else feats.window - 1
    softcap = 0.0 if feats.softcap is None else float(feats.softcap)
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    max_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
    out, _ = torch.ops.packlm.fa4_varlen_fwd(q, k, v, cu_seqlens, cu_k, max_seqlen, max_k, scale, window, softcap)
    return out[..., :d]
