"""What a packed attention kernel computes, and the helpers every kernel shares.

`Features`: what one attention layer computes beyond plain causal softmax attention (a window, a
chunk, soft-capping, sinks, a value head dim unlike the query's, a head dim above 256); each kernel
reproduces some of them exactly (`trainer.attention.kernels.supported`). The helpers work on a packed batch:
one flat sequence of T tokens whose examples start at `cu_seqlens`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

# auto's order, fastest first; "cudnn" (fastest on long examples only) is never auto's whole
# choice, which stops at "sdpa" (it runs anywhere): on a Hopper GPU auto pairs it with flash_attn
# or torch for rows of long examples (`row_kernel`)
KERNELS = ("fa4", "flash_attn", "torch", "flex", "sdpa", "cudnn")
# the kernels that attend a piece of an example to keys of its own (context parallelism), fastest first
PIECE_KERNELS = ("fa4", "flash_attn", "sdpa")

# A row whose examples average this many tokens or more takes cuDNN under a paired backend
# ("flash_attn+cudnn"): one kernel launch an example is then cheap beside cuDNN's faster kernel
# (8B-shape attention on an H200, 16,384-token rows: cuDNN 1.37x flash_attn at 4,096-token
# examples, 1.72x at one 16,384-token example, 0.34x at 1,024: BENCHMARKS.md, "Attention kernels alone").
LONG_EXAMPLE_TOKENS = 4096
# the head dims a pair hands to cuDNN: where it was measured (the 8B shape's 128); cuDNN refuses
# some others outright (head dim 16: "No available kernel"), which --attn cudnn says in one line
PAIRED_HEAD_DIMS = (128,)


def row_kernel(backend: str, tokens: int, n_examples: int, head_dim: int = 128) -> str:
    """The kernel one packed row runs: `backend` itself, or for a pair "A+cudnn" cudnn where the
    row's `tokens` over its `n_examples` average LONG_EXAMPLE_TOKENS or more and the head dim is one
    of PAIRED_HEAD_DIMS, else A. Read from the row's shapes, so choosing costs no copy from the GPU.

    >>> row_kernel("flash_attn+cudnn", 32768, 2), row_kernel("flash_attn+cudnn", 16384, 16)
    ('cudnn', 'flash_attn')
    """
    first, paired, long_rows = backend.partition("+")
    if not paired:
        return backend
    long_enough = tokens >= LONG_EXAMPLE_TOKENS * max(n_examples, 1)
    return long_rows if long_enough and head_dim in PAIRED_HEAD_DIMS else first


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


def with_tensors(features: Features, q: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None) -> Features:
    """`features` completed with what the tensors themselves say: sinks present, a value head dim
    unlike the query's, a head dim above 256 (head dims are the last axis in any layout)."""
    return replace(
        features, sinks=sinks is not None, value_dim=bool(v.shape[-1] != q.shape[-1]), wide_head=bool(max(q.shape[-1], v.shape[-1]) > 256)
    )


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


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[T, Hkv, D] -> [T, Hkv * groups, D], query head h using kv head h // groups (as in HF)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))
