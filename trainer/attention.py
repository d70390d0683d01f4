"""Packed (varlen) causal attention backends, plugged into Hugging Face models.

A packed micro-batch is one flat sequence of T tokens holding several examples back to back;
`cu_seqlens` (int32, [n_examples + 1]) marks where each example starts. Every backend here attends
causally *within* each example and never across a boundary:

- "flash_attn": `flash_attn.flash_attn_varlen_func` (the flash-attn package), CUDA only.
- "torch":      PyTorch's built-in FlashAttention varlen kernel (`torch.nn.attention.varlen.varlen_attn`,
                or `torch.ops.aten._flash_attention_forward` on versions without it), CUDA only.
- "sdpa":       the reference: causal `F.scaled_dot_product_attention` on each example alone.
                Runs anywhere (memory for sum(L^2) scores, bounds read on the host); it is the
                correctness oracle for the other two.

`install(model, backend)` registers the chosen backend with `transformers.AttentionInterface` and
switches the model to it; the model then reads example boundaries from the `cu_seq_lens_q` /
`max_length_q` forward kwargs (see `trainer.batch.MicroBatch.model_kwargs`).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.errors import UserError

BACKENDS = ("flash_attn", "torch", "sdpa")

DESCRIPTIONS = {
    "flash_attn": "flash-attn varlen (flash_attn.flash_attn_varlen_func)",
    "torch": "torch varlen (FlashAttention, built into PyTorch)",
    "sdpa": "sdpa reference (causal SDPA per example)",
}


# --------------------------------------------------------------------------- availability


def _flash_attn_importable() -> bool:
    """True when the flash-attn package can be imported (without importing it if it is absent)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:  # a broken build (ABI mismatch) raises ImportError/OSError/RuntimeError
        return False
    return True


def _torch_varlen_fn() -> Callable | None:
    """`torch.nn.attention.varlen.varlen_attn` if this PyTorch has it, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn


def _torch_flash_op() -> Any | None:
    """`torch.ops.aten._flash_attention_forward` if this PyTorch build has it, else None."""
    try:
        return torch.ops.aten._flash_attention_forward
    except (AttributeError, RuntimeError):
        return None


def _torch_varlen_available() -> bool:
    return _torch_varlen_fn() is not None or _torch_flash_op() is not None


def _is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def _why_not(backend: str, device: torch.device | str, dtype: torch.dtype | None) -> str | None:
    """Why `backend` cannot run on `device`/`dtype`, or None when it can."""
    if backend == "sdpa":
        return None
    if not _is_cuda(device):
        return f"needs a CUDA device, but the model is on {torch.device(device).type!r}"
    if not torch.cuda.is_available():
        return "needs CUDA, but torch.cuda.is_available() is False"
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return f"FlashAttention kernels need bfloat16 or float16, not {dtype}"
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major < 8:
        return f"FlashAttention needs an Ampere or newer GPU (sm80+), this one is sm{major}{minor}"
    if backend == "flash_attn" and not _flash_attn_importable():
        return "the flash-attn package is not installed (or does not import)"
    if backend == "torch" and not _torch_varlen_available():
        return f"this PyTorch ({torch.__version__}) has no FlashAttention varlen kernel"
    return None


def select_backend(
    requested: str = "auto",
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> str:
    """Resolve `requested` ("auto" or one of BACKENDS) to a backend that can run on `device`.

    "auto" picks flash_attn, then torch, then sdpa: the first one that can run. An explicit request
    that cannot run raises UserError saying why and what to use instead. Pass `dtype` only when it
    is the dtype attention will compute in (a bf16 model); float32 weights trained under bf16
    autocast still get bf16 attention inputs (see `_half_inputs`), so leave it None then.
    """
    if requested == "auto":
        for backend in BACKENDS:
            if _why_not(backend, device, dtype) is None:
                return backend
        return "sdpa"
    if requested not in BACKENDS:
        raise UserError(
            f"unknown attention backend {requested!r}: choose auto, {', '.join(BACKENDS)}"
        )
    reason = _why_not(requested, device, dtype)
    if reason is not None:
        usable = [b for b in BACKENDS if b != requested and _why_not(b, device, dtype) is None]
        raise UserError(
            f"attention backend {requested!r} cannot run: {reason}; use --attn auto or "
            f"{' / '.join(usable)} instead"
        )
    return requested


# --------------------------------------------------------------------------- kernels


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"varlen attention wants [T, H, D] tensors, got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} do not match")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[T, Hkv, D] -> [T, Hkv * groups, D], query head h using kv head h // groups (as in HF)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def segment_ids(cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Example index of every token of the flat sequence, computed on cu_seqlens' device (no sync)."""
    positions = torch.arange(n_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)


def block_causal_mask(cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Boolean [T, T] mask: True where query i may attend key j (same example, j <= i)."""
    seg = segment_ids(cu_seqlens, n_tokens)
    idx = torch.arange(n_tokens, device=cu_seqlens.device)
    return (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])


def _sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scale):
    """Reference: causal SDPA on each example alone, so it is obviously right and needs memory for
    sum(L^2) scores, not T^2 (the bounds are read on the host: this is the CPU / oracle path)."""
    hq = q.shape[1]
    k = _repeat_kv(k, hq // k.shape[1])
    v = _repeat_kv(v, hq // v.shape[1])
    bounds = cu_seqlens.tolist()
    outs = [
        F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
            is_causal=True, scale=scale,
        ).transpose(0, 1)
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def varlen_signature(fn: Callable) -> dict[str, bool]:
    """Which optional keywords this `varlen_attn` accepts (they differ across PyTorch versions).

    torch 2.13: (..., *, scale, window_size, enable_gqa, ...), causal via window_size=(-1, 0);
    torch ~2.9-2.11: (..., is_causal=False, return_aux=None), no scale, equal head counts.
    """
    params = inspect.signature(fn).parameters
    return {
        "window_size": "window_size" in params,
        "is_causal": "is_causal" in params,
        "scale": "scale" in params,
        "enable_gqa": "enable_gqa" in params,
    }


def _torch_varlen(q, k, v, cu_seqlens, max_seqlen, scale):
    """PyTorch's FlashAttention varlen kernel, whichever entry point this version has."""
    head_dim = q.shape[-1]
    groups = q.shape[1] // k.shape[1]
    fn = _torch_varlen_fn()
    if fn is None:
        op = _torch_flash_op()
        if op is None:
            raise UserError(
                f"this PyTorch ({torch.__version__}) has no FlashAttention varlen kernel; use --attn sdpa"
            )
        # aten._flash_attention_forward(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
        # is_causal, return_debug_mask, *, scale) -> (out, lse, rng_state, unused, debug_mask);
        # FlashAttention-2 handles grouped-query attention natively.
        out = op(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale)
        return out[0]
    sig = varlen_signature(fn)
    kwargs: dict[str, Any] = {}
    if sig["window_size"]:
        kwargs["window_size"] = (-1, 0)  # causal
    elif sig["is_causal"]:
        kwargs["is_causal"] = True
    else:
        raise UserError(
            f"torch.nn.attention.varlen.varlen_attn in PyTorch {torch.__version__} has neither "
            "window_size nor is_causal, so it cannot do causal attention; use --attn sdpa"
        )
    if sig["scale"]:
        kwargs["scale"] = scale
    elif scale is not None and not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
        q = q * (scale * math.sqrt(head_dim))  # the kernel applies 1/sqrt(D); fold the rest into q
    if groups > 1:
        if sig["enable_gqa"]:
            kwargs["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


def _flash_attn_varlen(q, k, v, cu_seqlens, max_seqlen, scale):
    """flash-attn 2: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p,
    softmax_scale, causal); grouped-query attention is native."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        dropout_p=0.0, softmax_scale=scale, causal=True,
    )


_HALF = (torch.bfloat16, torch.float16)


def _half_inputs(q, k, v):
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
    "sdpa": _sdpa_varlen,
    "torch": _torch_varlen,
    "flash_attn": _flash_attn_varlen,
}


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    backend: str,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each example of a packed sequence, never across examples.

    q: [T, Hq, D]; k, v: [T, Hkv, D] with Hq a multiple of Hkv (grouped-query attention);
    cu_seqlens: int32 [n_examples + 1] on q's device, cu_seqlens[-1] == T; max_seqlen: the longest
    example (a Python int). `scale` defaults to 1/sqrt(D). Returns [T, Hq, D].
    """
    _check_shapes(q, k, v)
    if backend not in _KERNELS:
        raise UserError(f"unknown attention backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend != "sdpa":
        q, k, v = _half_inputs(q, k, v)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if cu_seqlens.dtype != torch.int32:
            cu_seqlens = cu_seqlens.to(torch.int32)
        cu_seqlens = cu_seqlens.to(q.device, non_blocking=True)
    return _KERNELS[backend](q, k, v, cu_seqlens, int(max_seqlen), scale)


# --------------------------------------------------------------------------- Hugging Face glue


_HF_NAMES = {"flash_attn": "packlm_fa2", "torch": "packlm_torch", "sdpa": "packlm_reference"}


def attention_name(backend: str) -> str:
    """The name a backend is registered under in transformers' AttentionInterface.

    The names avoid the substrings "flash", "sdpa", "flex" and "eager" on purpose: transformers
    treats any implementation whose name contains them as its own built-in one (e.g. it tries to
    load a flash-attention kernel from the Hub for "*flash*").
    """
    return _HF_NAMES[backend]


def make_hf_attention(backend: str) -> Callable:
    """An attention function with the signature transformers' AttentionInterface expects.

    It receives query [B, Hq, S, D], key/value [B, Hkv, S, D] and the forward kwargs. Example
    boundaries come from `cu_seq_lens_q` / `max_length_q` (a flat packed batch, B == 1). If they
    are absent (someone calls the model on ordinary unpacked rows), every batch row is treated as
    ONE example: plain causal attention over each row, no padding support. Self-attention only:
    `cu_seq_lens_k` / `max_length_k` must equal the query ones (MicroBatch passes the same tensor),
    and a KV cache (generation) is refused.
    """

    def packlm_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if dropout:
            raise UserError(
                f"attention dropout ({dropout}) is not supported by the packed backends; "
                "set attention_dropout=0 in the model config"
            )
        if not getattr(module, "is_causal", True):
            raise UserError("packed attention backends are causal only; this attention layer is not")
        if attention_mask is not None:
            raise UserError(
                "packed attention got a dense attention_mask; pass cu_seq_lens_q/max_length_q "
                "(trainer.batch.MicroBatch.model_kwargs) instead of padding masks"
            )
        batch, n_heads, seq, head_dim = query.shape
        if key.shape[2] != seq:
            raise UserError(
                "packed attention backends do not support a KV cache (generation); switch the "
                "model to eager/sdpa attention for generation"
            )
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        max_seqlen = kwargs.get("max_length_q")
        if cu_seqlens is None:
            cu_seqlens = torch.arange(0, (batch + 1) * seq, seq, device=query.device, dtype=torch.int32)
            max_seqlen = seq
        elif max_seqlen is None:
            raise UserError("cu_seq_lens_q was passed without max_length_q (the longest example)")
        flat = lambda x: x.transpose(1, 2).reshape(batch * seq, x.shape[1], head_dim)  # noqa: E731
        out = varlen_attention(
            flat(query), flat(key), flat(value), cu_seqlens, int(max_seqlen),
            backend=backend, scale=scaling,
        )
        return out.view(batch, seq, n_heads, head_dim), None

    packlm_attention.__name__ = attention_name(backend)
    return packlm_attention


def _no_dense_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function for AttentionMaskInterface: boundaries come from cu_seq_lens, so no mask."""
    return None


def _mask_preprocessing_skips_unregistered() -> bool:
    """True when transformers skips mask creation for attention names without a mask function.

    Then registering no mask function is strictly better: registering one makes transformers scan
    position_ids for packing on every forward (a device-to-host sync) only to get None back.
    """
    try:
        from transformers import masking_utils

        source = inspect.getsource(masking_utils._preprocess_mask_arguments)
    except Exception:
        return False
    return "ALL_MASK_ATTENTION_FUNCTIONS._global_mapping" in source


def register(backend: str) -> str:
    """Register `backend` with transformers (attention function, and a None mask function only
    where this transformers version needs one). Returns the registered name."""
    from transformers import AttentionInterface

    name = attention_name(backend)
    AttentionInterface.register(name, make_hf_attention(backend))
    if not _mask_preprocessing_skips_unregistered():
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(name, _no_dense_mask)
    return name


def install(model: torch.nn.Module, backend: str) -> str:
    """Switch a Hugging Face model's attention to the packed `backend`; returns the registered name.

    After this, call the model (or its decoder) with `cu_seq_lens_q`, `cu_seq_lens_k`,
    `max_length_q`, `max_length_k` and restarting `position_ids` (MicroBatch.model_kwargs()).
    Without cu_seq_lens_q every row is one causal example. No dense [T, T] mask is ever built
    except inside the "sdpa" reference backend.
    """
    if backend not in BACKENDS:
        raise UserError(f"unknown attention backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    name = register(backend)
    setter = getattr(model, "set_attn_implementation", None)
    try:
        if setter is None:
            raise AttributeError("no set_attn_implementation")
        setter(name)
    except (AttributeError, ValueError, KeyError, ImportError):
        # older transformers validate names against their own list; the config attribute is what
        # the attention layers actually read (the decoder shares the top-level config)
        model.config._attn_implementation = name
    if getattr(model.config, "_attn_implementation", name) != name:
        raise UserError(
            f"{type(model).__name__} did not accept attention implementation {name!r}; "
            "it does not use transformers' AttentionInterface"
        )
    return name
