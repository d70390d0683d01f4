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
- Estimated speedup = FLOPs(layout) / FLOPs(packed): training FLOPs as pack-train counts them
  (`pipeline.report.flops`: every token slot through the layers, 12 x heads x head_dim per causal
  pair and layer, the output head over the real tokens) for a model of the sizes given (`Sizes`:
  --hidden, --layers, --heads, --kv-heads, --intermediate; llama-3.2-1B's by default).
- Attention's share of the work (`attention_work`): of this folder's rows as pack-train trains them
  (no padding, the head over the loss tokens), in all and row by row, so the cost of long rows shows
  before training.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pipeline.errors import UserError
from pipeline.plan.binpack import assign_bins
from pipeline.report.flops import Sizes, step_flops
from pipeline.report.stats import (
    DEFAULT_BATCH_SIZE,
    PACKED_STRATEGIES,
    Layout,
    packed,
    pad_to_longest,
    pad_to_max,
    safe_ratio,
)
from pipeline.shards import IGNORE_INDEX, Manifest, file_sha256, load_shard, manifest_vocab, read_manifest, shard_paths

PADDED_LAYOUTS = ("pad-to-longest", "pad-to-max")


# ------------------------------------------------------------------------------------- layouts


def plan_layout(lengths: np.ndarray, max_len: int, strategy: str, seed: int = 0, group_size: int = DEFAULT_BATCH_SIZE) -> Layout:
    """Run the planner (`pipeline.plan.binpack.assign_bins`) and measure the resulting layout."""
    assign_bins(np.ones(4, np.int64), max(max_len, 4), strategy, seed, group_size)  # jit warm-up
    t0 = time.perf_counter()
    bins = assign_bins(lengths, max_len, strategy, seed, group_size)
    seconds = time.perf_counter() - t0
    rows = int(bins.max()) + 1 if len(bins) else 0
    return packed(strategy, lengths, rows, max_len, seconds)


def compare(
    lengths_in_order: np.ndarray,
    max_len: int,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    strategies: tuple[str, ...] = PACKED_STRATEGIES,
    seed: int = 0,
    sizes: Sizes = Sizes(),
) -> list[dict[str, Any]]:
    """Padded baselines and every packing strategy on the same sequence lengths (all <= max_len)."""
    lengths = np.asarray(lengths_in_order, dtype=np.int64)
    ref = pad_to_longest(lengths, batch_size)
    layouts = [ref, pad_to_max(lengths, max_len)]
    layouts += [plan_layout(lengths, max_len, s, seed, batch_size) for s in strategies]
    shape = sizes.shape()
    return [layout.as_dict(shape, ref) for layout in layouts]


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
    row_pairs: np.ndarray | None = None  # per row (file order): causal pairs of its examples
    row_loss: np.ndarray | None = None  # per row: loss tokens
    row_longest: np.ndarray | None = None  # per row: its longest example
    row_shard: np.ndarray | None = None  # per row: the index of its shard in `shards`


def load_folder(folder: str | os.PathLike[str], *, check_hashes: bool = True) -> FolderData:
    """Read the example columns of every shard (token columns only for the loss count)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    seqs, ids, row_tok, row_ex, shards, seq_loss = [], [], [], [], [], []
    row_pairs, row_loss, row_longest, row_shard = [], [], [], []
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
        rows_here = len(cols.row_off) - 1
        if rows_here:
            pairs = cols.seq_lens.astype(np.int64) * (cols.seq_lens.astype(np.int64) + 1) // 2
            row_pairs.append(np.add.reduceat(pairs, cols.ex_off[:-1]))
            row_longest.append(np.maximum.reduceat(cols.seq_lens.astype(np.int64), cols.ex_off[:-1]))
            row_loss.append(np.add.reduceat(has_loss, cols.row_off[:-1]))
            row_shard.append(np.full(rows_here, len(shards), np.int64))
        shard_loss = int(has_loss.sum())
        loss += shard_loss
        sha_ok = (file_sha256(path) == info.sha256) if check_hashes else None
        shards.append(
            {
                "file": info.file,
                "rows": len(cols.row_off) - 1,
                "tokens": int(cols.seq_lens.sum()),
                "loss_tokens": shard_loss,
                "sha256": info.sha256,
                "sha256_ok": sha_ok,
            }
        )
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
    seq_lens, example_ids = cat(seqs), cat(ids)
    order = np.argsort(example_ids, kind="stable")
    return FolderData(
        manifest,
        seq_lens[order],
        example_ids[order],
        cat(row_tok),
        cat(row_ex),
        loss,
        shards,
        cat(seq_loss)[order],
        cat(row_pairs),
        cat(row_loss),
        cat(row_longest),
        cat(row_shard),
    )


def source_table(data: FolderData) -> list[dict[str, Any]]:
    """Per input file (the manifest's `sources`; empty for folders written without them): its
    weight, examples read, uses packed, tokens, loss tokens and share of all tokens. Use k of source
    example i has id k * examples_read + i (`pipeline.plan.mix`)."""
    sources = data.manifest.sources
    if not sources or data.seq_loss is None:
        return []
    read = max(data.manifest.counts.examples_read, 1)
    source_of = np.searchsorted([s["first_id"] for s in sources], data.example_ids % read, side="right") - 1
    frame = pl.DataFrame({"source": source_of, "id": data.example_ids, "tokens": data.seq_lens, "loss": data.seq_loss})
    per = frame.group_by("source").agg(pl.col("id").n_unique().alias("uses"), pl.col("tokens").sum(), pl.col("loss").sum())
    got = {row["source"]: row for row in per.iter_rows(named=True)}
    total = max(int(data.seq_lens.sum()), 1)
    return [
        {
            "input": s["input"],
            "weight": s.get("weight", 1.0),
            "examples_read": s["examples_read"],
            "uses": int(got.get(j, {}).get("uses", 0)),
            "tokens": int(got.get(j, {}).get("tokens", 0)),
            "loss_tokens": int(got.get(j, {}).get("loss", 0)),
            "share": int(got.get(j, {}).get("tokens", 0)) / total,
        }
        for j, s in enumerate(sources)
    ]


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


def folder_report(
    data: FolderData,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    sizes: Sizes = Sizes(),
    strategies: tuple[str, ...] = PACKED_STRATEGIES,
    seed: int | None = None,
) -> dict[str, Any]:
    """Every figure of a packed folder as a JSON-ready dict (planner seed: the folder's; the
    model's vocabulary: its tokenizer's where the manifest records it)."""
    m = data.manifest
    sizes = folder_sizes(sizes, m)
    tokens = int(data.seq_lens.sum())
    rows = len(data.row_tokens)
    lower = -(-tokens // m.max_len)
    this = packed(f"this folder ({m.strategy})", data.seq_lens, rows, m.max_len)
    longest = pad_to_longest(data.seq_lens, batch_size)
    pmax = pad_to_max(data.seq_lens, m.max_len)
    shape = sizes.shape()
    flops_this = this.flops(shape).model
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
            "estimated_speedup": safe_ratio(base.flops(shape).model, flops_this),
        }
    return {
        "kind": "folder",
        "max_len": m.max_len,
        "strategy": m.strategy,
        "batch_size": batch_size,
        "model": asdict(sizes),
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
        "packed": {"token_slots": this.token_slots, "padding_tokens": this.padding, "attention_pairs": this.attention_pairs},
        "savings": savings,
        "comparison": compare(
            data.seq_lens, m.max_len, batch_size=batch_size, strategies=strategies, seed=m.seed if seed is None else seed, sizes=sizes
        ),
        "attention": attention_work(data, sizes),
        "shards": data.shards,
        "sources": source_table(data),
        "eval": dict(m.eval),
        "manifest_matches": {
            "rows": rows == m.rows,
            "total_tokens": tokens == m.total_tokens,
            "loss_tokens": data.loss_tokens == m.loss_tokens,
        },
    }


def folder_sizes(sizes: Sizes, manifest: Manifest) -> Sizes:
    """`sizes` with the vocabulary of the folder's tokenizer, where its manifest records one."""
    vocab = manifest_vocab(manifest.tokenizer)
    return replace(sizes, vocab=vocab) if vocab else sizes


SHOWN_ROWS = 5  # rows a report names, by attention's share of their work


def attention_work(data: FolderData, sizes: Sizes) -> dict[str, Any]:
    """Attention's share of the training FLOPs of this folder's rows (`pipeline.report.flops`, for
    a model of `sizes`), in all and per row (its spread, and the rows where it is largest: their
    shard and row there, tokens, examples, longest example), as pack-train trains them: every
    token through the layers, causal attention inside each example, the head over the loss tokens."""
    shape = sizes.shape()
    tokens, pairs = data.row_tokens.astype(np.float64), data.row_pairs.astype(np.float64)
    # the count is linear in tokens, loss tokens and pairs (full causal layers): its three rates
    per_token = step_flops(shape, None, tokens=1, loss_tokens=0, pairs=0).model
    per_loss_token = step_flops(shape, None, tokens=0, loss_tokens=1, pairs=0).model
    per_pair = step_flops(shape, None, tokens=0, loss_tokens=0, pairs=1).model
    attention = per_pair * pairs
    work = per_token * tokens + per_loss_token * data.row_loss + attention
    share = np.divide(attention, work, out=np.zeros_like(work), where=work > 0)
    top = np.argsort(-share, kind="stable")[:SHOWN_ROWS]
    starts = np.searchsorted(data.row_shard, np.arange(len(data.shards)))  # each shard's first row
    return {
        "flops": float(work.sum()),
        "attention_flops": float(attention.sum()),
        "share": safe_ratio(float(attention.sum()), float(work.sum())),
        "row_share": _length_stats(share),
        "highest_share_rows": [
            {
                "shard": data.shards[data.row_shard[r]]["file"],
                "row": int(r - starts[data.row_shard[r]]),
                "tokens": int(data.row_tokens[r]),
                "examples": int(data.row_examples[r]),
                "longest": int(data.row_longest[r]),
                "attention_share": float(share[r]),
                "flops": float(work[r]),
            }
            for r in top
        ],
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
    options["sizes"] = folder_sizes(options.get("sizes", Sizes()), data.manifest)
    report = whatif_report(example_lengths(data), max_lens, **options)
    cut = {"truncated": counts.truncated, "dropped": counts.dropped}
    report["limits"] = {"folder_max_len": data.manifest.max_len, **cut, "exact_up_to": data.manifest.max_len if any(cut.values()) else None}
    return report


def report_sources(tokenizer: str | None, via: str | None, inputs: list[str]) -> dict[str, Any]:
    """What a report names of what it counted: the tokenizer (and how it was chosen) and the inputs."""
    return {"tokenizer": tokenizer, "tokenizer_from": via, "inputs": list(inputs)}


def whatif_report(
    lengths: np.ndarray,
    max_lens: list[int],
    *,
    strategies: tuple[str, ...] = PACKED_STRATEGIES,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    sizes: Sizes = Sizes(),
) -> dict[str, Any]:
    """The strategy comparison for each max_len, with lengths over it truncated to it."""
    lengths = np.asarray(lengths, dtype=np.int64)
    lengths = lengths[lengths > 0]
    runs = []
    for max_len in max_lens:
        clipped = np.minimum(lengths, max_len)
        runs.append(
            {
                "max_len": max_len,
                "over_max_len": int((lengths > max_len).sum()),
                "tokens": int(clipped.sum()),
                "lower_bound_rows": -(-int(clipped.sum()) // max_len),
                "comparison": compare(clipped, max_len, batch_size=batch_size, strategies=strategies, seed=seed, sizes=sizes),
            }
        )
    return {
        "kind": "what-if",
        "examples": int(len(lengths)),
        "tokens_untruncated": int(lengths.sum()),
        "lengths": _length_stats(lengths),
        "batch_size": batch_size,
        "model": asdict(sizes),
        "runs": runs,
    }


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=True) + "\n"
