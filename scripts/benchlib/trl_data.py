"""The same examples for TRL and pack-train (bench_trl.py): a packed folder's rows cut back into their
examples as TRL's pre-tokenized input, the totals both sides are checked against, and a steady
rate over the steps after the warm-up."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def loss_positions(labels: np.ndarray) -> np.ndarray:
    """Where a label carries loss (pack-data writes -100 elsewhere, also at each example's first token)."""
    return labels != -100


def folder_examples(folder: Path) -> list[dict[str, np.ndarray]]:
    """The examples of a packed folder, in its row order (each row cut at its seq_lens)."""
    from pipeline.shards import iter_rows

    from .train_steps import row_examples

    return row_examples(list(iter_rows(folder)))


def folder_totals(folder: Path) -> dict[str, int]:
    """Examples, tokens and loss tokens of a packed folder."""
    examples = folder_examples(folder)
    return {
        "examples": len(examples),
        "tokens": int(sum(len(e["input_ids"]) for e in examples)),
        "loss_tokens": int(sum(loss_positions(e["labels"]).sum() for e in examples)),
    }


def trl_dataset(folder: Path) -> Any:
    """The folder's examples as TRL's pre-tokenized input: `input_ids` and `completion_mask`."""
    from datasets import Dataset

    examples = folder_examples(folder)
    return Dataset.from_dict(
        {
            "input_ids": [e["input_ids"].tolist() for e in examples],
            "completion_mask": [loss_positions(e["labels"]).astype(np.int8).tolist() for e in examples],
        }
    )


def packed_totals(dataset: Any) -> dict[str, int]:
    """Examples, tokens and loss tokens of TRL's packed dataset (`input_ids`, `labels`, `seq_lengths`
    per row); the collator also masks each example's first token, so those are not counted."""
    totals = {"rows": 0, "examples": 0, "tokens": 0, "loss_tokens": 0}
    for row in dataset:
        labels = np.asarray(row["labels"])
        starts = np.concatenate([[0], np.cumsum(row["seq_lengths"])[:-1]]).astype(np.int64)
        keep = labels != -100
        keep[starts] = False
        totals["rows"] += 1
        totals["examples"] += len(row["seq_lengths"])
        totals["tokens"] += len(row["input_ids"])
        totals["loss_tokens"] += int(keep.sum())
    return totals


def steady_rate(tokens: Sequence[int], times: Sequence[float], warmup: int) -> tuple[int, float, float]:
    """(tokens, seconds, tokens/s) of the steps after `warmup`; times[0] is the start of step 1 and
    times[k] the end of step k.

    >>> steady_rate([10, 20, 30], [0.0, 5.0, 6.0, 8.0], warmup=1)
    (50, 3.0, 16.666666666666668)
    """
    n = len(times) - 1
    got = int(sum(tokens[warmup:n]))
    seconds = times[n] - times[warmup]
    return got, seconds, got / seconds if seconds > 0 else 0.0
