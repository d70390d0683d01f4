"""cuDNN's fused attention on each example of a packed row: the "cudnn" kernel (`--attn cudnn`).

PyTorch reaches cuDNN's flash-attention kernels through `F.scaled_dot_product_attention` under
`SDPBackend.CUDNN_ATTENTION`, for dense [batch, heads, length, head_dim] inputs only: its jagged
(nested-tensor) form either refuses grouped-query heads or, with the heads repeated, returned wrong
gradients on an H200 with torch 2.11 (BENCHMARKS.md, "Attention kernels alone"). So this kernel
cuts the packed row at `cu_seqlens` and attends each example alone, causally, with grouped-query
heads native: exact per example by construction, as the sdpa reference is.

It is the fastest kernel here on long examples (an H200, the 8B shape's 32 / 8 heads of 128:
1.49-1.58x flash-attn 2's forward+backward at 32K and 128K tokens; 1.21x pack-train's tokens/s with
8B LoRA at 32K), and slower on rows of many short ones (one launch per example, and the bounds read
on the host once per layer: 0.34x at 1,024-token examples). So `--attn auto` on a Hopper GPU pairs
it with flash_attn or torch ("flash_attn+cudnn"), cuDNN taking only the rows whose examples average
4,096 tokens or more (`trainer.attention.features.row_kernel`); `--attn cudnn` runs it on every row.
No window, soft-capping or sinks (the causal
mask is cuDNN's own); chunks are cut as separate examples by the caller, value heads zero-padded.
cuDNN has no kernel for a key length of 1, so a one-token example is written in closed form: its one
query attends its one key with weight 1, so its output is that token's value (each query head
reading its key-value head), which autograd differentiates exactly (dv gets the output's gradient,
q and k none), as every other kernel computes it.

cuDNN builds an execution plan for each sequence length it meets (tens of milliseconds, fwd and bwd),
so a run over examples of many lengths would spend its first epoch building plans. Examples shorter
than BUCKET_BELOW run at their length rounded up to a multiple of PLAN_BUCKET: at most
BUCKET_BELOW / PLAN_BUCKET plans. The extra positions are the tokens that follow the example in the
row (views, no copy), or zeros where the row ends first. Attention is causal, so no real query sees
them; their outputs are dropped, so their gradient is zero and they add exactly zero to every key's,
value's and query's gradient: the example computes what it computes alone.

Under `torch.compile` the call is left out of the graph (a graph break at each attention call):
the loop's bounds are data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pipeline.contract import UserError
from trainer.attention.features import Features


def cudnn_available() -> bool:
    """True when this PyTorch was built with cuDNN and cuDNN loads."""
    return bool(torch.backends.cudnn.is_available())


def _cudnn_only() -> contextlib.AbstractContextManager:
    """Restrict `F.scaled_dot_product_attention` to cuDNN's kernel (no silent fallback to another)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)


# The restriction above, looked up at each call so that CPU tests can run the same loop through
# PyTorch's CPU kernel (cuDNN needs a GPU).
SDPA_SCOPE: Callable[[], contextlib.AbstractContextManager] = _cudnn_only

PLAN_BUCKET = 128  # examples run at a multiple of this many tokens: one cuDNN plan a bucket
BUCKET_BELOW = 65_536  # longer examples run at their own length (a plan is cheap next to their attention)


def planned_length(n: int) -> int:
    """The length an `n`-token example runs at under cuDNN: rounded up to PLAN_BUCKET below
    BUCKET_BELOW, else `n`.

    >>> planned_length(1000), planned_length(1024), planned_length(70_001)
    (1024, 1024, 70001)
    """
    return -(-n // PLAN_BUCKET) * PLAN_BUCKET if n < BUCKET_BELOW else n


def _example(x: torch.Tensor, start: int, n: int, m: int) -> torch.Tensor:
    """Rows start .. start + m of x [T, H, D] as [1, H, m, D]: a view where the row holds them, else
    the example's n rows and m - n zero rows after them."""
    if start + m <= x.shape[0]:
        return x[start : start + m].transpose(0, 1).unsqueeze(0)
    return F.pad(x[start : start + n], (0, 0, 0, 0, 0, m - n)).transpose(0, 1).unsqueeze(0)


@torch.compiler.disable
def cudnn_varlen(q, k, v, cu_seqlens, max_seqlen, scale, feats: Features, sinks):
    """Causal attention of each example alone: q [T, Hq, D], k / v [T, Hkv, D] (Hq a multiple of
    Hkv, 16-bit, one head dim: `varlen_attention` prepares them), cu_seqlens int32 [n + 1] on q's
    device. Returns [T, Hq, D]. Empty examples (equal bounds) produce no rows, as they hold none;
    one-token examples are their value (softmax over one key)."""
    bounds = cu_seqlens.tolist()
    gqa = q.shape[1] != k.shape[1]
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    try:
        with SDPA_SCOPE():
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end <= start:
                    continue
                if end == start + 1:  # cuDNN refuses a key length of 1; softmax over one key is 1
                    out[start:end] = v[start:end].repeat_interleave(group, dim=1)
                    continue
                n = end - start
                m = planned_length(n)
                qe, ke, ve = (_example(x, start, n, m) for x in (q, k, v))
                o = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, scale=scale, enable_gqa=gqa)
                out[start:end] = o[0, :, :n].transpose(0, 1)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:  # cuDNN refuses a shape (head dim, dtype, GPU) it has no kernel for
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(
            f"cuDNN attention cannot run this layer (q {tuple(q.shape)}, {q.dtype}): {first[:200]}; use --attn flash_attn or --attn auto"
        ) from None
    return out
