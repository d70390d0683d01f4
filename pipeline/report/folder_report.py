"""Packing statistics: what a packed folder (or a plan) costs against padded batches.

Used by `pack-report` (`pipeline/cli.py`). Figures are computed with numpy/polars from the
shards' `seq_lens`/`example_ids` columns and the loss count of their labels, so a report over
millions of examples takes seconds. `pipeline.report.report_render` shows them: `format_text` (terminal,
<= 100 columns) and `write_html`; `to_json` here.

Cost model (documented because every "speedup" below comes from it):

- A *sequence* is one stored example (a split example counts as its pieces), lengths L <= max_len.
- Layouts: `pad-to-longest` (batches of B sequences in example-id order, each padded to the longest
  in its batch), `pad-to-max` (every sequence padded to max_len), and packed rows of each planner
  strategy. A packed row is charged a full max_len of token slots (as with fixed-shape batches),
  which is conservative: a flat varlen batch computes only the real tokens.
- Token work = token slots (padding included). Attention work = causal query-key pairs, L(L+1)/2
  per sequence for padded layouts (padded length) and per example inside a packed row (varlen
  attention never crosses examples).
- Estimated speedup = cost(layout) / cost(packed), with cost = 6 * hidden * token_slots +
  attention_pairs: per layer a transformer block does ~24 hidden^2 FLOPs per token (QKV/O
  projections and a 4x MLP) and ~4 hidden FLOPs per query-key pair, i.e. ~6 hidden slots per pair.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pipeline.plan.binpack import assign_bins
from pipeline.errors import UserError
from pipeline.shards import IGNORE_INDEX, Manifest, file_sha256, load_shard, read_manifest, shard_paths
from pipeline.report.stats import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_HIDDEN,
    PACKED_STRATEGIES,
    Layout,
    compute_cost,
    safe_ratio,
    packed,
    pad_to_longest,
    pad_to_max,
)

PADDED_LAYOUTS = ("pad-to-longest", "pad-to-max")


# ------------------------------------------------------------------------------------- layouts


def plan_layout(lengths: np.ndarray, max_len: int, strategy: str, seed: int = 0,
                group_size: int = DEFAULT_BATCH_SIZE) -> Layout:
    """Run the planner (`pipeline.plan.binpack.assign_bins`) and measure the resulting layout."""
    assign_bins(np.ones(4, np.int64), max(max_len, 4), strategy, seed, group_size)  # jit warm-up
    t0 = time.perf_counter()
    bins = assign_bins(lengths, max_len, strategy, seed, group_size)
    seconds = time.perf_counter() - t0
    rows = int(bins.max()) + 1 if len(bins) else 0
    return packed(strategy, lengths, rows, max_len, seconds)


def compare(lengths_in_order: np.ndarray, max_len: int, *, batch_size: int = DEFAULT_BATCH_SIZE,
            strategies: tuple[str, ...] = PACKED_STRATEGIES, seed: int = 0,
            hidden: int = DEFAULT_HIDDEN) -> list[dict[str, Any]]:
    """Padded baselines and every packing strategy on the same sequence lengths (all <= max_len)."""
    lengths = np.asarray(lengths_in_order, dtype=np.int64)
    ref = pad_to_longest(lengths, batch_size)
    layouts = [ref, pad_to_max(lengths, max_len)]
    layouts += [plan_layout(lengths, max_len, s, seed, batch_size) for s in strategies]
    return [layout.as_dict(hidden, ref) for layout in layouts]


# -------------------------------------------------------------------------------- folder report


@dataclass
class FolderData:
    """Per-sequence and per-row arrays of a packed folder (for figures and plots)."""

    manifest: Manifest
    seq_lens: np.ndarray  # per stored sequence, example-id order (pieces of an id: file order)
    example_ids: np.ndarray  # same order
    row_tokens: np.ndarray  # per row, in file order
    row_examples: np.ndarray  # per row
    loss_tokens: int
    shards: list[dict[str, Any]] = field(default_factory=list)
    seq_loss: np.ndarray | None = None  # loss tokens per stored sequence, same order as seq_lens


def load_folder(folder: str | os.PathLike[str], *, check_hashes: bool = True) -> FolderData:
    """Read the example columns of every shard (token columns only for the loss count)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    seqs, ids, row_tok, row_ex, shards, seq_loss = [], [], [], [], [], []
    loss = 0
    for info, path in zip(manifest.shards, shard_paths(folder, manifest), strict=True):
        if not path.is_file():
            raise UserError(f"{path}: shard listed in the manifest is missing: run pack-verify")
        cols = load_shard(path)
        seqs.append(cols.seq_lens)
        ids.append(np.asarray(cols.example_ids, dtype=np.int64))
        row_tok.append(np.diff(cols.row_off))
        row_ex.append(np.diff(cols.ex_off))
        has_loss = (cols.labels != IGNORE_INDEX).astype(np.int64)
        starts = np.cumsum(cols.seq_lens) - cols.seq_lens
        seq_loss.append(np.add.reduceat(has_loss, starts) if len(starts) else np.zeros(0, np.int64))
        shard_loss = int(has_loss.sum())
        loss += shard_loss
        sha_ok = (file_sha256(path) == info.sha256) if check_hashes else None
        shards.append({"file": info.file, "rows": len(cols.row_off) - 1, "tokens": int(cols.seq_lens.sum()),
                       "loss_tokens": shard_loss, "sha256": info.sha256, "sha256_ok": sha_ok})
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
    seq_lens, example_ids = cat(seqs), cat(ids)
    order = np.argsort(example_ids, kind="stable")
    return FolderData(manifest, seq_lens[order], example_ids[order], cat(row_tok), cat(row_ex),
                      loss, shards, cat(seq_loss)[order])


def source_table(data: FolderData) -> list[dict[str, Any]]:
    """Per input file (the manifest's `sources`; empty for folders written without them): its
    weight, examples read, uses packed, tokens, loss tokens and share of all tokens. Use k of source
    example i has id k * examples_read + i (`pipeline.plan.mix`)."""
    sources = data.manifest.sources
    if not sources or data.seq_loss is None:
        return []
    read = max(data.manifest.counts.examples_read, 1)
    source_of = np.searchsorted([s["first_id"] for s in sources], data.example_ids % read, side="right") - 1
    frame = pl.DataFrame({"source": source_of, "id": data.example_ids, "tokens": data.seq_lens,
                          "loss": data.seq_loss})
    per = frame.group_by("source").agg(pl.col("id").n_unique().alias("uses"), pl.col("tokens").sum(),
                                       pl.col("loss").sum())
    got = {row["source"]: row for row in per.iter_rows(named=True)}
    total = max(int(data.seq_lens.sum()), 1)
    return [{"input": s["input"], "weight": s.get("weight", 1.0), "examples_read": s["examples_read"],
             "uses": int(got.get(j, {}).get("uses", 0)), "tokens": int(got.get(j, {}).get("tokens", 0)),
             "loss_tokens": int(got.get(j, {}).get("loss", 0)),
             "share": int(got.get(j, {}).get("tokens", 0)) / total}
            for j, s in enumerate(sources)]


def _length_stats(lengths: np.ndarray) -> dict[str, float]:
    if len(lengths) == 0:
        return {k: 0 for k in ("min", "mean", "p50", "p90", "p99", "max")}
    s = pl.Series("len", lengths)
    exact = float if s.dtype.is_float() else int
    return {
        "min": exact(s.min()),
        "mean": float(s.mean()),
        "p50": float(s.quantile(0.5, "nearest")),
        "p90": float(s.quantile(0.9, "nearest")),
        "p99": float(s.quantile(0.99, "nearest")),
        "max": exact(s.max()),
    }


def folder_report(data: FolderData, *, batch_size: int = DEFAULT_BATCH_SIZE,
                  hidden: int = DEFAULT_HIDDEN,
                  strategies: tuple[str, ...] = PACKED_STRATEGIES,
                  seed: int | None = None) -> dict[str, Any]:
    """Every figure of a packed folder as a JSON-ready dict (planner seed: the folder's)."""
    m = data.manifest
    tokens = int(data.seq_lens.sum())
    rows = len(data.row_tokens)
    lower = -(-tokens // m.max_len)
    this = packed(f"this folder ({m.strategy})", data.seq_lens, rows, m.max_len)
    longest = pad_to_longest(data.seq_lens, batch_size)
    pmax = pad_to_max(data.seq_lens, m.max_len)
    cost_this = compute_cost(this.token_slots, this.attention_pairs, hidden)
    per_row = pl.Series("n", data.row_examples)
    fill = data.row_tokens / m.max_len if rows else np.zeros(0)
    savings = {}
    for base in (longest, pmax):
        key = base.name.replace("-", "_")
        savings[key] = {
            "token_slots": base.token_slots,
            "padding_tokens": base.padding,
            "padding_avoided": base.padding - this.padding,
            "attention_pairs": base.attention_pairs,
            "attention_ratio": safe_ratio(base.attention_pairs, this.attention_pairs),
            "token_ratio": safe_ratio(base.token_slots, this.token_slots),
            "estimated_speedup": safe_ratio(compute_cost(base.token_slots, base.attention_pairs, hidden),
                                        cost_this),
        }
    return {
        "kind": "folder",
        "max_len": m.max_len,
        "strategy": m.strategy,
        "batch_size": batch_size,
        "hidden": hidden,
        "examples": int(len(np.unique(data.example_ids))),
        "sequences": int(len(data.seq_lens)),
        "tokens": tokens,
        "loss_tokens": data.loss_tokens,
        "rows": rows,
        "efficiency": tokens / (rows * m.max_len) if rows else 0.0,
        "lower_bound_rows": lower,
        "rows_over_lower_bound": rows - lower,
        "examples_per_row": {
            "mean": float(per_row.mean()) if rows else 0.0,
            "max": int(per_row.max()) if rows else 0,
        },
        "row_fill": _length_stats(fill) if rows else _length_stats(fill),
        "lengths": _length_stats(data.seq_lens),
        "counts": dict(vars(m.counts)),
        "packed": {"token_slots": this.token_slots, "padding_tokens": this.padding,
                   "attention_pairs": this.attention_pairs},
        "savings": savings,
        "comparison": compare(data.seq_lens, m.max_len, batch_size=batch_size,
                              strategies=strategies, seed=m.seed if seed is None else seed,
                              hidden=hidden),
        "shards": data.shards,
        "sources": source_table(data),
        "eval": dict(m.eval),
        "manifest_matches": {
            "rows": rows == m.rows,
            "total_tokens": tokens == m.total_tokens,
            "loss_tokens": data.loss_tokens == m.loss_tokens,
        },
    }


def example_lengths(data: FolderData) -> np.ndarray:
    """Each packed example's length (the sum of its stored pieces: a split example is whole again),
    in example-id order: what a what-if across other --max-len values plans, without re-tokenizing."""
    if len(data.example_ids) == 0:
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, data.example_ids[1:] != data.example_ids[:-1]])
    return np.add.reduceat(data.seq_lens.astype(np.int64), starts)


def folder_whatif(data: FolderData, max_lens: list[int], **options: Any) -> dict[str, Any]:
    """`whatif_report` of a packed folder's example lengths (`example_lengths`), with the limits of
    what the folder holds: examples pack-data truncated are counted at the folder's max_len, and
    dropped ones are not there, so for a longer --max-len those figures are lower bounds."""
    counts = data.manifest.counts
    report = whatif_report(example_lengths(data), max_lens, **options)
    cut = {"truncated": counts.truncated, "dropped": counts.dropped}
    report["limits"] = {"folder_max_len": data.manifest.max_len, **cut,
                        "exact_up_to": data.manifest.max_len if any(cut.values()) else None}
    return report


def report_sources(tokenizer: str | None, via: str | None, inputs: list[str]) -> dict[str, Any]:
    """What a report names of what it counted: the tokenizer (and how it was chosen) and the inputs."""
    return {"tokenizer": tokenizer, "tokenizer_from": via, "inputs": list(inputs)}


def whatif_report(lengths: np.ndarray, max_lens: list[int], *,
                  strategies: tuple[str, ...] = PACKED_STRATEGIES,
                  batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
                  hidden: int = DEFAULT_HIDDEN) -> dict[str, Any]:
    """The strategy comparison for each max_len, with lengths over it truncated to it."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    runs = []
    for max_len in max_lens:
        clipped = np.minimum(lengths, max_len)
        runs.append({
            "max_len": max_len,
            "over_max_len": int((lengths > max_len).sum()),
            "tokens": int(clipped.sum()),
            "lower_bound_rows": -(-int(clipped.sum()) // max_len),
            "comparison": compare(clipped, max_len, batch_size=batch_size,
                                  strategies=strategies, seed=seed, hidden=hidden),
        })
    return {
        "kind": "what-if",
        "examples": int(len(lengths)),
        "tokens_untruncated": int(lengths.sum()),
        "lengths": _length_stats(lengths),
        "batch_size": batch_size,
        "hidden": hidden,
        "runs": runs,
    }


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=True) + "\n"
