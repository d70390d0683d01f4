"""Padding/packing layout figures in plain numpy (no polars), shared by `pack-report` and `pack-data`.

`pipeline.report.folder_report` (polars, plots) builds its reports from these; `pipeline.engines.job` uses them for
pack-data's final summary, so both print the same "padding avoided vs pad-to-longest" figure. A
layout's work is counted in training FLOPs (`pipeline.report.flops`), as `pipeline.report.folder_report`
documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.report.flops import ModelShape, StepFlops, causal_pairs, step_flops

DEFAULT_BATCH_SIZE = 32  # examples per pad-to-longest batch of the reference layout
PACKED_STRATEGIES = ("minibatch", "sequential", "shuffle", "ffd", "bfd")  # compared by pack-report


def safe_ratio(a: float, b: float) -> float:
    """a / b, or 0 when b is 0 (an empty layout)."""
    return a / b if b else 0.0


@dataclass
class Layout:
    """One way of laying out the same sequences into batches/rows."""

    name: str
    rows: int  # packed rows, or padded sequences
    token_slots: int  # tokens computed, padding included
    tokens: int
    attention_pairs: int
    plan_seconds: float = 0.0

    @property
    def padding(self) -> int:
        return self.token_slots - self.tokens

    @property
    def efficiency(self) -> float:
        return self.tokens / self.token_slots if self.token_slots else 0.0

    def flops(self, shape: ModelShape) -> StepFlops:
        """Training FLOPs of the layout: every token slot through the layers, causal attention over
        its pairs, the output head over the real tokens (padding carries no loss)."""
        return step_flops(shape, None, tokens=self.token_slots, loss_tokens=self.tokens, pairs=self.attention_pairs)

    def as_dict(self, shape: ModelShape, reference: Layout | None = None) -> dict[str, Any]:
        flops = self.flops(shape)
        out = {
            "layout": self.name,
            "rows": self.rows,
            "token_slots": self.token_slots,
            "tokens": self.tokens,
            "padding_tokens": self.padding,
            "efficiency": self.efficiency,
            "attention_pairs": self.attention_pairs,
            "flops": flops.model,
            "attention_share": safe_ratio(flops.attention, flops.model),
            "plan_seconds": self.plan_seconds,
        }
        if reference is not None:
            out["speedup_vs_pad_to_longest"] = safe_ratio(reference.flops(shape).model, flops.model)
        return out


def pad_to_longest(lengths_in_order: np.ndarray, batch_size: int = DEFAULT_BATCH_SIZE) -> Layout:
    """Batches of `batch_size` consecutive sequences, each padded to its batch's longest."""
    lengths = np.asarray(lengths_in_order, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        return Layout("pad-to-longest", 0, 0, 0, 0)
    starts = np.arange(0, n, batch_size)
    longest = np.maximum.reduceat(lengths, starts)
    n_b = np.diff(np.append(starts, n))
    return Layout(
        "pad-to-longest",
        rows=n,
        token_slots=int((n_b * longest).sum()),
        tokens=int(lengths.sum()),
        attention_pairs=int((n_b * longest * (longest + 1) // 2).sum()),
    )


def pad_to_max(lengths: np.ndarray, max_len: int) -> Layout:
    """Every sequence padded to max_len."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    pairs = n * max_len * (max_len + 1) // 2
    return Layout("pad-to-max", n, n * max_len, int(lengths.sum()), pairs)


def packed(name: str, lengths: np.ndarray, rows: int, max_len: int, seconds: float = 0.0) -> Layout:
    """Packed rows (each charged max_len slots) with attention confined to each example."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return Layout(name, rows, rows * max_len, int(lengths.sum()), causal_pairs(lengths), seconds)
