"""Packed (varlen) causal attention kernels, with the attention features Hugging Face models use.

A packed micro-batch is one flat sequence of T tokens holding several examples back to back;
`cu_seqlens` (int32, [n_examples + 1]) marks where each example starts. Every kernel attends
causally *within* each example and never across a boundary, and reproduces these features of a
layer exactly as transformers' eager attention computes them (see `Features`):

| feature   | sdpa (reference) | flex              | fa4, flash_attn   | torch                      |
|-----------|------------------|-------------------|-------------------|----------------------------|
| window    | mask             | mask_mod          | window_size       | window_size (torch >= 2.10)|
| chunk     | mask             | mask_mod          | cu_seqlens split  | cu_seqlens split           |
| softcap   | tanh on scores   | score_mod         | softcap           | -                          |
| sinks     | extra logit      | rescaled by LSE   | -                 | -                          |
| value_dim | native           | native            | v zero-padded     | v zero-padded              |
| wide_head | native           | native            | -                 | -                          |

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
                whole. Head dims are zero-padded to 64, 96, 128, 192 or 256 (`FA4_HEAD_DIMS`).
- "flash_attn": `flash_attn.flash_attn_varlen_func` (the flash-attn package, FlashAttention-2), CUDA only.
- "torch":      PyTorch's built-in FlashAttention varlen kernel, CUDA only.

Windows: transformers' window `w` lets query i see keys i-w+1 .. i (w keys, `kv > q - w`); the
FlashAttention kernels count the keys to the left instead, so they get `window_size=(w - 1, 0)`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from pipeline.errors import UserError

KERNELS = ("fa4", "flash_attn", "torch", "flex", "sdpa")


@dataclass(frozen=True)
class Features:
    """What one attention layer computes beyond plain causal softmax attention.

    window:    query i attends to keys i-window+1 .. i of its example (transformers' sliding window).
    chunk:     query i attends only to keys in the same `chunk`-token chunk of its example (Llama 4).
    softcap:   scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2).
    sinks:     a learned logit per head joins every softmax denominator (gpt-oss `s_aux`).
    value_dim: the value head dim differs from the query/key head dim (DeepSeek's MLA).
    wide_head: a head dim above 256, more than the FlashAttention kernels take (Gemma 4's
               global layers use 512).
    """

    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: bool = False
    value_dim: bool = False
    wide_head: bool = False

    def used(self) -> set[str]:
        """Names of the features in use, e.g. {"window", "softcap"}. Numbers are tested with `is
        None` and flags by truth: under torch.compile a window may be a symbolic int (which must
        not be compared with False) and a flag a symbolic bool (which only truth evaluates)."""
        numbers = {name for name in ("window", "chunk", "softcap") if getattr(self, name) is not None}
        return numbers | {name for name in ("sinks", "value_dim", "wide_head") if getattr(self, name)}


EVERY_FEATURE = frozenset(f.name for f in fields(Features))  # computed once: dataclass fields() breaks a compiled graph

FEATURE_NAMES = {
    "window": "sliding-window attention",
    "chunk": "chunked attention",
    "softcap": "attention logit soft-capping",
    "sinks": "attention sinks",
    "value_dim": "a value head dim unlike the query's",
    "wide_head": "a head dim above 256",
}


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


def with_tensors(
    features: Features, q: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
) -> Features:
    """`features` completed with what the tensors themselves say: sinks present, a value head dim
    unlike the query's, a head dim above 256 (head dims are the last axis in any layout)."""
    return replace(features, sinks=sinks is not None, value_dim=bool(v.shape[-1] != q.shape[-1]),
                   wide_head=bool(max(q.shape[-1], v.shape[-1]) > 256))


def supported(kernel: str) -> set[str]:
    """The features `kernel` reproduces exactly (with this PyTorch / flash-attn)."""
    if kernel in ("sdpa", "flex"):
        return set(EVERY_FEATURE)
    if kernel in ("fa4", "flash_attn"):
        return EVERY_FEATURE - {"sinks", "wide_head"}
    fn = torch_varlen_fn()
    window = fn is not None and varlen_signature(fn)["window_size"]
    return {"chunk", "value_dim"} | ({"window"} if window else set())


# --------------------------------------------------------------------------- helpers


def segment_ids(cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Example index of every token of the flat sequence, computed on cu_seqlens' device (no sync)."""
    positions = torch.arange(n_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)


def split_chunks(cu_seqlens: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int]:
    """Boundaries that also cut every example every `chunk` tokens, and the longest piece.

    Chunked attention inside each example equals plain causal attention over these pieces:
    [0, 10) with chunk 4 -> [0, 4), [4, 8), [8, 10). Reads the bounds on the host.
    """
    bounds = cu_seqlens.tolist()
    cuts = [0]
    for start, end in zip(bounds[:-1], bounds[1:]):
        cuts.extend(range(start + chunk, end, chunk))
        cuts.append(end)
    cu = torch.tensor(cuts, dtype=torch.int32, device=cu_seqlens.device)
    longest = max((b - a for a, b in zip(cuts[:-1], cuts[1:])), default=0)
    return cu, longest


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[T, Hkv, D] -> [T, Hkv * groups, D], query head h using kv head h // groups (as in HF)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def _same_head_dims(q, k, v, scale):
    """FlashAttention needs one head dim for q, k and v: zero-pad the smaller side (zeros add
    nothing to scores or outputs); the caller slices the output back to v's head dim."""
    d = max(q.shape[-1], v.shape[-1])
    if d == q.shape[-1] == v.shape[-1]:
        return q, k, v, scale
    scale = q.shape[-1] ** -0.5 if scale is None else scale  # the unpadded default
    return _pad_last(q, d), _pad_last(k, d), _pad_last(v, d), scale


# --------------------------------------------------------------------------- kernels


# Examples whose attention runs as one batched call: a bucket takes every example at least this
# fraction of its longest as long (right-padded to it), so padding adds at most ~1/0.8^2 = 1.56x
# to an example's attention work; examples of at most SMALL_EXAMPLE tokens share one bucket, where
# a call costs more than the padding.
BUCKET_FILL = 0.8
SMALL_EXAMPLE = 64


def length_buckets(lengths: list[int]) -> list[list[int]]:
    """Indices of the non-empty examples, grouped into buckets of similar length (longest first):
    each bucket's examples are padded to its longest and attended in one batched call."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets:
            longest = lengths[buckets[-1][0]]
            if lengths[i] >= BUCKET_FILL * longest or longest <= SMALL_EXAMPLE:
                buckets[-1].append(i)
                continue
        buckets.append([i])
    return buckets


def _sdpa(q, k, v, cu_seqlens, max_seqlen, scale, feats: Features, sinks):
    """Reference: causal attention on each example alone, written the obvious way.

    Examples of similar length (`length_buckets`) are right-padded to the longest of their bucket
    and attended as one [B, H, L, D] batch: padding sits after every real token, so causality keeps
    it out of every real query's attention, and the padded queries' outputs are dropped (their
    gradients are exactly zero). Without soft-capping or sinks each bucket is one
    `F.scaled_dot_product_attention` call (causal, or with the window/chunk mask; 4-D, so that
    PyTorch's fused CPU kernel takes it instead of materialising the scores); with them, the scores,
    mask and softmax are spelled out as transformers' eager attention does."""
    hq = q.shape[1]
    groups = hq // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bounds = cu_seqlens.tolist()
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    pieces, positions = [], []
    for bucket in length_buckets(lengths):
        longest = lengths[bucket[0]]
        i = torch.arange(longest, device=q.device)
        starts = torch.tensor([bounds[b] for b in bucket], device=q.device)
        sizes = torch.tensor([lengths[b] for b in bucket], device=q.device)
        real = i[None, :] < sizes[:, None]  # [B, L]
        index = starts[:, None] + torch.minimum(i[None, :], sizes[:, None] - 1)  # padding repeats a real token
        qb, kb, vb = (x[index].transpose(1, 2) for x in (q, k, v))  # [B, H, L, D]
        mask = i[None, :] <= i[:, None]
        if feats.window is not None:
            mask &= i[:, None] - i[None, :] < feats.window
        if feats.chunk is not None:
            mask &= i[:, None] // feats.chunk == i[None, :] // feats.chunk
        if feats.softcap is None and sinks is None:
            plain = feats.window is None and feats.chunk is None
            out = F.scaled_dot_product_attention(
                qb, kb, vb, attn_mask=None if plain else mask, is_causal=plain, scale=scale,
                enable_gqa=groups > 1)
        else:
            kb, vb = _repeat_kv(kb, groups), _repeat_kv(vb, groups)  # [B, H, L, D]: heads on dim 1 too
            scores = (qb @ kb.transpose(-1, -2)) * scale
            if feats.softcap is not None:
                scores = feats.softcap * torch.tanh(scores / feats.softcap)
            scores = scores.masked_fill(~mask, float("-inf"))
            if sinks is not None:
                sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
                scores = torch.cat([scores, sink], dim=-1)
            probs = torch.softmax(scores.float(), dim=-1)[..., :longest].to(vb.dtype)
            out = probs @ vb
        pieces.append(out.transpose(1, 2)[real])  # [tokens of the bucket, H, Dv]
        positions.append(index[real])
    if not pieces:
        return q.new_zeros((*q.shape[:2], v.shape[-1]))
    placed = torch.cat(positions)
    where = torch.empty_like(placed)
    where[placed] = torch.arange(len(placed), device=placed.device)
    return torch.cat(pieces)[where]


_FLEX_MASKS: dict[tuple, tuple[torch.Tensor, Any]] = {}


@torch.compiler.disable
def _flex_block_mask(cu_seqlens: torch.Tensor, n_tokens: int, feats: Features):
    """The document-causal (+ window / chunk) BlockMask of this batch, built once per batch and
    kind of layer: every layer of a forward gets the same cu_seqlens tensor, so masks are cached
    by its identity (the cache holds the tensor, so its id cannot be reused while cached) and by
    window and chunk (Gemma's window and full layers alternate)."""
    key = (n_tokens, feats.window, feats.chunk, cu_seqlens.device)
    cached = _FLEX_MASKS.get(key)
    if cached is not None and cached[0] is cu_seqlens:
        return cached[1]
    if any(tensor is not cu_seqlens for tensor, _ in _FLEX_MASKS.values()):
        _FLEX_MASKS.clear()  # a new batch: the old one's masks are done with
    seg = segment_ids(cu_seqlens, n_tokens)
    pos = torch.arange(n_tokens, device=cu_seqlens.device) - cu_seqlens.long()[seg]
    window, chunk = feats.window, feats.chunk

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (seg[q_idx] == seg[kv_idx]) & (kv_idx <= q_idx)
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        if chunk is not None:
            keep = keep & (pos[q_idx] // chunk == pos[kv_idx] // chunk)
        return keep

    mask = create_block_mask(mask_mod, None, None, n_tokens, n_tokens, device=cu_seqlens.device)
    _FLEX_MASKS[key] = (cu_seqlens, mask)
    return mask


def _flex(q, k, v, cu_seqlens, max_seqlen, scale, feats: Features, sinks):
    """flex_attention over the whole flat batch as one [1, H, T, D] sequence with a block mask.
    Sinks: flex returns log Z (the LSE); a sink logit s turns the softmax's denominator into
    Z + e^s, so the output is scaled by Z / (Z + e^s) = sigmoid(LSE - s)."""
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise UserError(
            "attention backend 'flex' cannot train on the CPU (PyTorch has no FlexAttention backward "
            "there); use --attn sdpa"
        )
    n_tokens = q.shape[0]
    block_mask = _flex_block_mask(cu_seqlens, n_tokens, feats)
    softcap = feats.softcap
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)
    lse_kwargs: dict[str, Any] = {}
    if sinks is not None:
        try:
            from torch.nn.attention.flex_attention import AuxRequest

            lse_kwargs = {"return_aux": AuxRequest(lse=True)}
        except ImportError:  # torch < 2.9 returns (out, lse)
            lse_kwargs = {"return_lse": True}
    as_batch = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731  [T, H, D] -> [1, H, T, D]
    with torch.autocast(q.device.type, enabled=False):  # inputs are cast already; score_mod too
        result = flex_attention(
            as_batch(q), as_batch(k), as_batch(v), score_mod=score_mod, block_mask=block_mask,
            scale=scale, enable_gqa=q.shape[1] != k.shape[1], **lse_kwargs,
        )
    if sinks is None:
        out = result
    else:
        out, aux = result
        lse = aux.lse if hasattr(aux, "lse") else aux  # [1, H, T]
        out = out * torch.sigmoid(lse - sinks.float().reshape(1, -1, 1)).unsqueeze(-1).to(out.dtype)
    return out[0].transpose(0, 1)


def _torch_varlen(q, k, v, cu_seqlens, max_seqlen, scale, feats: Features, sinks):
    """PyTorch's FlashAttention varlen kernel, whichever entry point this version has."""
    groups = q.shape[1] // k.shape[1]
    fn = torch_varlen_fn()
    if fn is None:
        op = torch_flash_op()
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
            k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


def _flash_attn_varlen(q, k, v, cu_seqlens, max_seqlen, scale, feats: Features, sinks):
    """flash-attn 2: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p,
    softmax_scale, causal, window_size, softcap); grouped-query attention is native."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        dropout_p=0.0, softmax_scale=scale, causal=True,
        window_size=(-1 if feats.window is None else feats.window - 1, 0),
        softcap=0.0 if feats.softcap is None else feats.softcap,
    )


def _fa4_window(window: int) -> dict[str, int | None]:
    """FlashAttention-4's window keywords (the same for forward and backward): none for -1, else
    `window` keys to the left and none to the right."""
    return {"window_size_left": None if window < 0 else window, "window_size_right": None if window < 0 else 0}


# FlashAttention-4 as two custom ops: torch.compile sees each as one opaque call with a known output
# shape (the fake implementations), instead of tracing into flash_attn.cute's Python. `window` is
# the number of keys to the left (-1: none), `softcap` 0.0 for none, as FlashAttention counts them.
@torch.library.custom_op("packlm::fa4_varlen_fwd", mutates_args=(), schema=(
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, SymInt max_seqlen, float scale, SymInt window, "
    "float softcap) -> (Tensor, Tensor)"))
def _fa4_fwd(q, k, v, cu_seqlens, max_seqlen, scale, window, softcap):
    """out [T, Hq, D] and the softmax's log-sum-exp [Hq, T] (float32), which the backward needs."""
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen, softmax_scale=scale, causal=True, softcap=softcap, return_lse=True,
        **_fa4_window(window),
    )
    return out, lse


@_fa4_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale, window, softcap):
    return q.new_empty((*q.shape[:2], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("packlm::fa4_varlen_bwd", mutates_args=(), schema=(
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens, SymInt max_seqlen, "
    "float scale, SymInt window, float softcap) -> (Tensor, Tensor, Tensor)"))
def _fa4_bwd(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, window, softcap):
    """dq, dk, dv of `_fa4_fwd` given the output's gradient."""
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(
        q, k, v, out, dout, lse, scale, True, softcap, **_fa4_window(window),
        cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
    )
    return dq, dk, dv


@_fa4_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, window, softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fa4_save(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale, window, softcap = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
    ctx.args = (max_seqlen, scale, window, softcap)


def _fa4_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _fa4_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


_fa4_fwd.register_autograd(_fa4_backward, setup_context=_fa4_save)


FA4_HEAD_DIMS = (64, 96, 128, 192, 256)  # FlashAttention-3's Hopper head dims, which FA4's tiles follow


def _fa4_varlen(q, k, v, cu_seqlens, max_seqlen, scale, feats: Features, sinks):
    """FlashAttention-4 through the custom ops above; grouped-query attention is native. Head dims
    are zero-padded to the next of FA4_HEAD_DIMS (zeros add nothing to scores or outputs) and the
    output sliced back: FA4 accepts any multiple of 8 up to 256, but on an H100 its backward gave
    wrong gradients at head dim 16 (forward right), so only the dims its tiles are tuned for run."""
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    padded = next(h for h in FA4_HEAD_DIMS if h >= d)
    q, k, v = (_pad_last(x, padded) for x in (q, k, v))
    window = -1 if feats.window is None else feats.window - 1
    softcap = 0.0 if feats.softcap is None else float(feats.softcap)
    out, _ = torch.ops.packlm.fa4_varlen_fwd(q, k, v, cu_seqlens, max_seqlen, scale, window, softcap)
    return out[..., :d]


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
    "sdpa": _sdpa,
    "flex": _flex,
    "torch": _torch_varlen,
    "flash_attn": _flash_attn_varlen,
    "fa4": _fa4_varlen,
}


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"varlen attention wants [T, H, D] tensors, got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[:2] != v.shape[:2] or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
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
) -> torch.Tensor:
    """Causal attention within each example of a packed sequence, never across examples.

    q, k: [T, Hq, D] / [T, Hkv, D] with Hq a multiple of Hkv (grouped-query attention); v:
    [T, Hkv, Dv]; cu_seqlens: int32 [n_examples + 1], cu_seqlens[-1] == T; max_seqlen: the
    longest example (a Python int). `scale` defaults to 1/sqrt(D); `features` are the layer's
    window / chunk / softcap, `sinks` its per-head sink logits [Hq] when it has them (the sinks and
    value_dim flags are taken from the tensors). Returns [T, Hq, Dv]. A feature `backend` cannot
    reproduce raises UserError naming it.
    """
    _check_shapes(q, k, v)
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
        return _sdpa(q, k, v, cu_seqlens, int(max_seqlen), scale, feats, sinks)
    if backend == "flex":  # one dtype: under autocast RoPE hands over float32 q/k and a bf16 v
        device = q.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
        return _flex(q.to(dtype), k.to(dtype), v.to(dtype), cu_seqlens, int(max_seqlen), scale, feats, sinks)
    # FlashAttention kernels: 16-bit, contiguous, one head dim, chunks as separate sequences
    q, k, v = _half_inputs(q, k, v)
    value_dim = v.shape[-1]
    q, k, v, scale = _same_head_dims(q, k, v, scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if feats.chunk is not None:
        cu_seqlens, max_seqlen = split_chunks(cu_seqlens, feats.chunk)
    out = _KERNELS[backend](q, k, v, cu_seqlens, int(max_seqlen), scale, feats, sinks)
    return out[..., :value_dim]
