"""Packed (varlen) causal attention kernels, with the attention features Hugging Face models use.

A packed micro-batch is one flat sequence of T tokens holding several examples back to back;
`cu_seqlens` (int32, [n_examples + 1]) marks where each example starts. Every kernel attends
causally *within* each example and never across a boundary, and reproduces these features of a
layer exactly as transformers' eager attention computes them (see `Features`):

| feature   | sdpa (reference) | flex              | fa4, flash_attn   | torch                      | cudnn            |
|-----------|------------------|-------------------|-------------------|----------------------------|------------------|
| window    | mask             | mask_mod          | window_size       | window_size (torch >= 2.10)| -                |
| chunk     | mask             | mask_mod          | cu_seqlens split  | cu_seqlens split           | cu_seqlens split |
| softcap   | tanh on scores   | score_mod         | softcap           | -                          | -                |
| sinks     | extra logit      | rescaled by LSE   | -                 | -                          | -                |
| value_dim | native           | native            | v zero-padded     | v zero-padded              | v zero-padded    |
| wide_head | native           | native            | -                 | -                          | -                |

- "sdpa":       the reference: each example attended alone (examples of similar length batched,
                padded after their last token), through `F.scaled_dot_product_attention` (PyTorch's
                fused kernel on the CPU) or, with soft-capping or sinks, scores, mask and softmax
                written out; runs anywhere and is the oracle for the others. Bounds are read on the host.
- "flex":       `torch.nn.attention.flex_attention` with a document-causal block mask, built once
                per batch outside any compiled graph. Fused only where it is compiled: pack-train
                compiles the decoder layers on CUDA, and flex with them; uncompiled it materialises
                the scores. PyTorch has no flex backward on the CPU, so there it runs without gradients.
- "fa4":        FlashAttention-4 (the flash-attn-4 package, `flash_attn.cute`: CuTe DSL kernels for
                Hopper and Blackwell, compiled on first use), through the custom ops
                `packlm::fa4_varlen_fwd` / `packlm::fa4_varlen_bwd` so that torch.compile keeps it
                whole. Head dims are zero-padded to 64, 96, 128, 192 or 256 (`trainer.attention.fa4_ops.FA4_HEAD_DIMS`).
- "flash_attn": `flash_attn.flash_attn_varlen_func` (the flash-attn package, FlashAttention-2), CUDA only.
- "torch":      PyTorch's built-in FlashAttention varlen kernel, CUDA only.
- "cudnn":      cuDNN's fused attention through PyTorch, each example alone (`trainer.attention.cudnn_kernel`),
                CUDA only; the fastest on long examples. A pair "flash_attn+cudnn" (auto's choice on a
                Hopper GPU) runs cudnn on rows whose examples average 4,096 tokens or more, flash_attn
                on the others (`trainer.attention.features.row_kernel`).

"sdpa" and "flex" live in `trainer.attention.reference_kernels`, "fa4" in `trainer.attention.fa4_ops`, "torch" and
"flash_attn" here; `Features` and the helpers they share in `trainer.attention.features`. This module
checks what a kernel can reproduce and dispatches (`varlen_attention`). Under context parallelism a
share's queries attend keys with boundaries of their own: "fa4", "flash_attn" and "sdpa" take them
(`PIECE_KERNELS`).

Windows: transformers' window `w` lets query i see keys i-w+1 .. i (w keys, `kv > q - w`); the
FlashAttention kernels count the keys to the left instead, so they get `window_size=(w - 1, 0)`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from pipeline.contract import UserError
from trainer.attention.cudnn_kernel import cudnn_varlen
from trainer.attention.fa4_ops import fa4_varlen
from trainer.attention.features import (
    EVERY_FEATURE,
    FEATURE_NAMES,
    KERNELS,
    PIECE_KERNELS,
    Features,
    pad_last,
    repeat_kv,
    row_kernel,
    split_chunks,
    with_tensors,
)
from trainer.attention.reference_kernels import flex_varlen, sdpa_varlen

# --------------------------------------------------------------------------- availability


def fa4_importable() -> bool:
    """True when FlashAttention-4 imports: the flash-attn-4 distribution and its `flash_attn.cute`
    (flash-attn 2.8 ships an older `flash_attn.cute` of its own, hence the distribution check)."""
    try:
        from importlib.metadata import version

        version("flash-attn-4")
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd  # noqa: F401
    except Exception:
        return False
    return True


def flash_attn_importable() -> bool:
    """True when the flash-attn package imports (a broken build raises ImportError/OSError)."""
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:
        return False
    return True


def torch_varlen_fn() -> Callable | None:
    """`torch.nn.attention.varlen.varlen_attn` if this PyTorch has it, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn


def torch_flash_op() -> Any | None:
    """`torch.ops.aten._flash_attention_forward` if this PyTorch build has it, else None."""
    try:
        return torch.ops.aten._flash_attention_forward
    except (AttributeError, RuntimeError):
        return None


def varlen_signature(fn: Callable) -> dict[str, bool]:
    """Which optional keywords this `varlen_attn` accepts (they differ across PyTorch versions).

    torch 2.13: (..., *, scale, window_size, enable_gqa, ...), causal via window_size=(-1, 0);
    torch ~2.9-2.11: (..., is_causal=False, return_aux=None), no scale, equal head counts.
    """
    params = inspect.signature(fn).parameters
    return {name: name in params for name in ("window_size", "is_causal", "scale", "enable_gqa")}


def supported(kernel: str) -> set[str]:
    """The features `kernel` reproduces exactly (with this PyTorch / flash-attn)."""
    if kernel in ("sdpa", "flex"):
        return set(EVERY_FEATURE)
    if kernel in ("fa4", "flash_attn"):
        return EVERY_FEATURE - {"sinks", "wide_head"}
    if kernel == "cudnn":
        return {"chunk", "value_dim"}
    fn = torch_varlen_fn()
    window = fn is not None and varlen_signature(fn)["window_size"]
    return {"chunk", "value_dim"} | ({"window"} if window else set())


# --------------------------------------------------------------------------- FlashAttention kernels


def _same_head_dims(q, k, v, scale):
    """FlashAttention needs one head dim for q, k and v: zero-pad the smaller side (zeros add
    nothing to scores or outputs); the caller slices the output back to v's head dim."""
    d = max(q.shape[-1], v.shape[-1])
    if d == q.shape[-1] == v.shape[-1]:
        return q, k, v, scale
    scale = q.shape[-1] ** -0.5 if scale is None else scale  # the unpadded default
    return pad_last(q, d), pad_last(k, d), pad_last(v, d), scale


def _torch_varlen(q, k, v, cu_seqlens, max_seqlen, scale, feats: Features, sinks):
    """PyTorch's FlashAttention varlen kernel, whichever entry point this version has."""
    groups = q.shape[1] // k.shape[1]
    fn = torch_varlen_fn()
    if fn is None:
        op = torch_flash_op()
        if op is None:
            raise UserError(f"this PyTorch ({torch.__version__}) has no FlashAttention varlen kernel; use --attn sdpa")
        # aten._flash_attention_forward(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
        # is_causal, return_debug_mask, *, scale) -> (out, lse, rng_state, unused, debug_mask);
        # FlashAttention-2 handles grouped-query attention natively.
        out = op(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale)
        return out[0]
    sig = varlen_signature(fn)
    kwargs: dict[str, Any] = {}
    if sig["window_size"]:
        kwargs["window_size"] = (-1 if feats.window is None else feats.window - 1, 0)  # causal
    elif sig["is_causal"]:
        kwargs["is_causal"] = True
    else:
        raise UserError(
            f"torch.nn.attention.varlen.varlen_attn in PyTorch {torch.__version__} has neither "
            "window_size nor is_causal, so it cannot do causal attention; use --attn sdpa"
        )
    head_dim = q.shape[-1]
    if sig["scale"]:
        kwargs["scale"] = scale
    elif scale is not None and not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
        q = q * (scale * math.sqrt(head_dim))  # the kernel applies 1/sqrt(D); fold the rest into q
    if groups > 1:
        if sig["enable_gqa"]:
            kwargs["enable_gqa"] = True
        else:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


def _flash_attn_varlen(q, k, v, cu_seqlens, max_seqlen, scale, feats: Features, sinks, cu_seqlens_k=None, max_seqlen_k=None):
    """flash-attn 2: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p,
    softmax_scale, causal, window_size, softcap); grouped-query attention is native. Key boundaries
    of their own (`cu_seqlens_k`) align the causal mask to the bottom right, as flash-attn >= 2.1 does."""
    from flash_attn import flash_attn_varlen_func

    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    max_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_k,
        max_seqlen,
        max_k,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=True,
        window_size=(-1 if feats.window is None else feats.window - 1, 0),
        softcap=0.0 if feats.softcap is None else feats.softcap,
    )


# --------------------------------------------------------------------------- dispatch


_HALF = (torch.bfloat16, torch.float16)


def half_inputs(q, k, v):
    """q, k, v in one 16-bit dtype, as the FlashAttention kernels require.

    Under autocast with float32 weights, HF's RoPE multiplies bf16 projections by float32 cos/sin,
    so q/k arrive in float32 while v is bf16: cast all three to the autocast dtype (what
    transformers' own flash-attention integration does). Genuine float32 activations (no autocast)
    are an error rather than a silent precision change.
    """
    if q.dtype in _HALF and k.dtype == q.dtype and v.dtype == q.dtype:
        return q, k, v
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        target = torch.get_autocast_dtype(device_type)
    elif q.dtype in _HALF:
        target = q.dtype
    else:
        raise UserError(
            f"FlashAttention kernels need bfloat16/float16 activations, got {q.dtype}: train in "
            "bf16 (autocast or a bf16 model) or use --attn sdpa"
        )
    return q.to(target), k.to(target), v.to(target)


_KERNELS: dict[str, Callable] = {
    "sdpa": sdpa_varlen,
    "flex": flex_varlen,
    "torch": _torch_varlen,
    "flash_attn": _flash_attn_varlen,
    "fa4": fa4_varlen,
    "cudnn": cudnn_varlen,
}


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, same_length: bool = True) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"varlen attention wants [T, H, D] tensors, got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[:2] != v.shape[:2] or (same_length and q.shape[0] != k.shape[0]) or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} do not match")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    backend: str,
    scale: float | None = None,
    features: Features = Features(),
    sinks: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Causal attention within each example of a packed sequence, never across examples.

    q, k: [T, Hq, D] / [T, Hkv, D] with Hq a multiple of Hkv (grouped-query attention); v:
    [T, Hkv, Dv]; cu_seqlens: int32 [n_examples + 1], cu_seqlens[-1] == T; max_seqlen: the
    longest example (a Python int). `scale` defaults to 1/sqrt(D); `features` are the layer's
    window / chunk / softcap, `sinks` its per-head sink logits [Hq] when it has them (the sinks and
    value_dim flags are taken from the tensors). Returns [T, Hq, Dv]. A feature `backend` cannot
    reproduce raises UserError naming it.

    `cu_seqlens_k` / `max_seqlen_k` (context parallelism: "sdpa", "fa4" and "flash_attn"): k and v
    hold pieces of keys of their own ([Tk, Hkv, D]), each piece's queries being the last tokens of
    its keys (`trainer.data.row_split` builds them); chunks must be cut by the caller.
    """
    n_examples = cu_seqlens.shape[0] - 1
    backend = row_kernel(backend, q.shape[0], n_examples, q.shape[-1]) if cu_seqlens_k is None else backend.partition("+")[0]
    if cu_seqlens_k is not None:
        if backend not in PIECE_KERNELS:
            raise UserError(
                f"attention backend {backend!r} cannot attend a piece of an example to its earlier "
                "keys (context parallelism); use --attn fa4 or flash_attn (GPU), or sdpa"
            )
        if features.chunk is not None:
            raise ValueError("cut chunked attention into pieces before passing cu_seqlens_k")
        cu_seqlens_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32, non_blocking=True)
    _check_shapes(q, k, v, same_length=cu_seqlens_k is None)
    if backend not in _KERNELS:
        raise UserError(f"unknown attention backend {backend!r}: choose one of {', '.join(KERNELS)}")
    feats = with_tensors(features, q, v, sinks)
    missing = feats.used() - supported(backend)
    if missing:
        names = ", ".join(FEATURE_NAMES[m] for m in sorted(missing))
        raise UserError(f"attention backend {backend!r} cannot reproduce {names}; use --attn auto")
    if cu_seqlens.dtype != torch.int32:
        cu_seqlens = cu_seqlens.to(torch.int32)
    cu_seqlens = cu_seqlens.to(q.device, non_blocking=True)
    if backend == "sdpa":
        return sdpa_varlen(q, k, v, cu_seqlens, int(max_seqlen), scale, feats, sinks, cu_seqlens_k)
    if backend == "flex":  # one dtype: under autocast RoPE hands over float32 q/k and a bf16 v
        device = q.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
        return flex_varlen(q.to(dtype), k.to(dtype), v.to(dtype), cu_seqlens, int(max_seqlen), scale, feats, sinks)
    # FlashAttention kernels: 16-bit, contiguous, one head dim, chunks as separate sequences
    q, k, v = half_inputs(q, k, v)
    value_dim = v.shape[-1]
    q, k, v, scale = _same_head_dims(q, k, v, scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if feats.chunk is not None:
        cu_seqlens, max_seqlen = split_chunks(cu_seqlens, feats.chunk)
    if cu_seqlens_k is not None:
        out = _KERNELS[backend](q, k, v, cu_seqlens, int(max_seqlen), scale, feats, sinks, cu_seqlens_k, int(max_seqlen_k))
    else:
        out = _KERNELS[backend](q, k, v, cu_seqlens, int(max_seqlen), scale, feats, sinks)
    return out[..., :value_dim]
