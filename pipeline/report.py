"""Packing statistics: what a packed folder (or a plan) costs against padded batches.

Used by `pack-report` (`pipeline/report_cli.py`). Figures are computed with numpy/polars from the
shards' `seq_lens`/`example_ids` columns only (never the tokens), so a report over millions of
examples takes seconds. Renderers: `format_text` (terminal, <= 100 columns), `to_json`,
`write_html`.

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

import base64
import html
import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pipeline.errors import UserError
from pipeline.shards import (
    IGNORE_INDEX,
    Manifest,
    file_sha256,
    flat_column,
    open_shard,
    read_manifest,
    shard_paths,
)
from pipeline.stats import (  # noqa: F401 - layout figures live in the polars-free stats module
    DEFAULT_BATCH_SIZE,
    Layout,
    compute_cost,
    causal_pairs,
    safe_ratio,
    packed,
    pad_to_longest,
    pad_to_max,
)

PADDED_LAYOUTS = ("pad-to-longest", "pad-to-max")
PACKED_STRATEGIES = ("minibatch", "sequential", "shuffle", "ffd", "bfd")
DEFAULT_HIDDEN = 2048


# ------------------------------------------------------------------------------------- layouts


def plan_layout(lengths: np.ndarray, max_len: int, strategy: str, seed: int = 0,
                group_size: int = DEFAULT_BATCH_SIZE) -> Layout:
    """Run the planner (`pipeline.binpack.assign_bins`) and measure the resulting layout."""
    from pipeline.binpack import assign_bins  # noqa: PLC0415

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


def load_folder(folder: str | os.PathLike[str], *, check_hashes: bool = True) -> FolderData:
    """Read the example columns of every shard (token columns only for the loss count)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    seqs, ids, row_tok, row_ex, shards = [], [], [], [], []
    loss = 0
    for info, path in zip(manifest.shards, shard_paths(folder, manifest), strict=True):
        if not path.is_file():
            raise UserError(f"{path}: shard listed in the manifest is missing: run pack-verify")
        table = open_shard(path)
        sl = flat_column(table, "seq_lens")
        ex = flat_column(table, "example_ids")
        s0, s1 = int(sl.offsets[0]), int(sl.offsets[-1])
        seq = np.asarray(sl.values[s0:s1], dtype=np.int64)
        seqs.append(seq)
        ids.append(np.asarray(ex.values[int(ex.offsets[0]) : int(ex.offsets[-1])], dtype=np.int64))
        cum = np.concatenate(([0], np.cumsum(seq)))
        off = sl.offsets - s0
        row_tok.append(cum[off[1:]] - cum[off[:-1]])
        row_ex.append(np.diff(off))
        lab = flat_column(table, "labels")
        labels = lab.values[int(lab.offsets[0]) : int(lab.offsets[-1])]
        shard_loss = int(np.count_nonzero(labels != IGNORE_INDEX))
        loss += shard_loss
        sha_ok = (file_sha256(path) == info.sha256) if check_hashes else None
        shards.append({"file": info.file, "rows": table.num_rows, "tokens": int(seq.sum()),
                       "loss_tokens": shard_loss, "sha256": info.sha256, "sha256_ok": sha_ok})
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
    seq_lens, example_ids = cat(seqs), cat(ids)
    order = np.argsort(example_ids, kind="stable")
    return FolderData(manifest, seq_lens[order], example_ids[order], cat(row_tok), cat(row_ex),
                      loss, shards)


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
        "manifest_matches": {
            "rows": rows == m.rows,
            "total_tokens": tokens == m.total_tokens,
            "loss_tokens": data.loss_tokens == m.loss_tokens,
        },
    }


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


# ---------------------------------------------------------------------------------- terminal


def _n(x: float) -> str:
    """Human number: 1234567 -> '1.23M'."""
    x = float(x)
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}" if x == int(x) else f"{x:.2f}"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    head = (f"{'layout':<24}{'rows':>11}{'efficiency':>12}{'padding':>11}{'attn pairs':>12}"
            f"{'speedup*':>10}{'plan ms':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        plan = "" if r["layout"] in PADDED_LAYOUTS else f"{r['plan_seconds'] * 1000:.1f}"
        lines.append(
            f"{r['layout'][:23]:<24}{r['rows']:>11,}{r['efficiency']:>11.1%} "
            f"{_n(r['padding_tokens']):>10} {_n(r['attention_pairs']):>11} "
            f"{r.get('speedup_vs_pad_to_longest', 0):>9.2f}x{plan:>10}".rstrip()
        )
    return lines


def _footnote(report: dict[str, Any]) -> str:
    return (f"* est. speedup vs pad-to-longest (B={report['batch_size']}) from token slots + "
            f"causal attention pairs, hidden={report['hidden']}")


def format_text(report: dict[str, Any]) -> str:
    """The terminal summary (lines <= 100 columns)."""
    if report["kind"] == "what-if":
        return _format_whatif(report)
    r, c = report, report["counts"]
    L = r["lengths"]
    s1, s2 = r["savings"]["pad_to_longest"], r["savings"]["pad_to_max"]
    lines = [
        f"packed folder: max_len {r['max_len']}, strategy {r['strategy']}",
        f"  examples        {r['examples']:>14,}   sequences (split pieces count) "
        f"{r['sequences']:,}",
        f"  tokens          {r['tokens']:>14,}   loss tokens {r['loss_tokens']:,} "
        f"({safe_ratio(r['loss_tokens'], r['tokens']):.1%})",
        f"  rows            {r['rows']:>14,}   lower bound ceil(tokens/max_len) "
        f"{r['lower_bound_rows']:,} (+{r['rows_over_lower_bound']:,})",
        f"  efficiency      {r['efficiency']:>14.2%}   tokens / (rows x max_len)",
        f"  examples/row    mean {r['examples_per_row']['mean']:.2f}, max "
        f"{r['examples_per_row']['max']}",
        f"  lengths         min {L['min']}, p50 {L['p50']:.0f}, p90 {L['p90']:.0f}, "
        f"p99 {L['p99']:.0f}, max {L['max']}, mean {L['mean']:.1f}",
        f"  examples read {c['examples_read']:,}: packed {c['examples_packed']:,}, truncated "
        f"{c['truncated']:,}, split {c['split']:,}, dropped {c['dropped']:,}, empty skipped "
        f"{c['empty_skipped']:,}" + (f", {c['no_loss']:,} with no loss token (they train nothing)"
                                     if c.get("no_loss") else ""),
        "",
        "savings against padding",
        f"  vs pad-to-longest (B={r['batch_size']}): {_n(s1['padding_avoided'])} padding tokens "
        f"avoided, {s1['attention_ratio']:.2f}x less attention, est. speedup "
        f"{s1['estimated_speedup']:.2f}x",
        f"  vs pad-to-max_len:      {_n(s2['padding_avoided'])} padding tokens avoided, "
        f"{s2['attention_ratio']:.2f}x less attention, est. speedup {s2['estimated_speedup']:.2f}x",
        "",
        "strategy comparison on the same sequence lengths",
        *("  " + x for x in _table(r["comparison"])),
        "  " + _footnote(r),
    ]
    bad = [s["file"] for s in r["shards"] if s["sha256_ok"] is False]
    lines.append("")
    lines.append(f"shards: {len(r['shards'])}, sha256 "
                 + ("not checked" if r["shards"] and r["shards"][0]["sha256_ok"] is None
                    else "all ok" if not bad else f"MISMATCH in {', '.join(bad[:3])}"))
    return "\n".join(lines) + "\n"


def _format_whatif(r: dict[str, Any]) -> str:
    L = r["lengths"]
    lines = [
        f"what-if: {r['examples']:,} examples, {r['tokens_untruncated']:,} tokens",
        f"  lengths min {L['min']}, p50 {L['p50']:.0f}, p90 {L['p90']:.0f}, p99 {L['p99']:.0f}, "
        f"max {L['max']}, mean {L['mean']:.1f}",
    ]
    for run in r["runs"]:
        lines += [
            "",
            f"max_len {run['max_len']}: {run['over_max_len']:,} examples longer (truncated here), "
            f"lower bound {run['lower_bound_rows']:,} rows",
            *("  " + x for x in _table(run["comparison"])),
        ]
    lines.append("  " + _footnote(r))
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:0;background:#f5f6f8;
color:#1f2933}
main{max-width:1100px;margin:0 auto;padding:28px 32px 48px}
h1{font-size:26px;margin:0 0 4px}
h2{font-size:19px;margin:34px 0 10px;border-bottom:2px solid #d9dde3;
padding-bottom:6px}
.sub{color:#616e7c;margin:0 0 20px}
.cards{display:grid;grid-template-columns:repeat(4,1fr);gap:12px}
.card{background:#fff;border-radius:10px;padding:14px 16px;box-shadow:0 1px 3px rgba(0,0,0,.08)}
.card .v{font-size:24px;font-weight:650}.card .k{color:#616e7c;font-size:13px;margin-top:2px}
.card.hi{background:#e8f4ec}
table{border-collapse:collapse;width:100%;background:#fff;border-radius:10px;overflow:hidden;
box-shadow:0 1px 3px rgba(0,0,0,.08);font-size:14px}
th,td{padding:7px 12px;text-align:right;border-bottom:1px solid #eef0f3}
th{background:#eef1f5;font-weight:600}td:first-child,th:first-child{text-align:left}
tr.this td{background:#eaf2fd;font-weight:600}
table.stats{box-shadow:none;font-size:13px}table.stats th,table.stats td{padding:5px 8px}
.figs{display:grid;grid-template-columns:1fr 1fr;gap:14px}
figure{margin:0;background:#fff;border-radius:10px;padding:10px;
box-shadow:0 1px 3px rgba(0,0,0,.08)}
figure img{width:100%}figcaption{color:#616e7c;font-size:13px;padding:4px 6px}
.note{color:#616e7c;font-size:13px;margin-top:8px}.ok{color:#18794e}.bad{color:#c92a2a;font-weight:600}
code{background:#eef1f5;padding:1px 4px;border-radius:4px}
"""


def _png(fig) -> str:  # noqa: ANN001
    import matplotlib.pyplot as plt  # noqa: PLC0415

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(uri: str, caption: str) -> str:
    return f'<figure><img alt="{html.escape(caption)}" src="{uri}"><figcaption>' \
           f"{html.escape(caption)}</figcaption></figure>"


def _plots_folder(data: FolderData) -> list[str]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    max_len = data.manifest.max_len
    out = []
    lengths = data.seq_lens
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if len(lengths):
        bins = np.logspace(0, math.log10(max(max_len, int(lengths.max())) * 1.05), 50)
        ax.hist(lengths, bins=bins, color="#3b82c4", edgecolor="white", linewidth=0.4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axvline(max_len, color="#c92a2a", linestyle="--", linewidth=1.5,
               label=f"max_len = {max_len:,}")
    ax.set_xlabel("example length (tokens, log scale)")
    ax.set_ylabel("examples (log scale)")
    ax.set_title("Example lengths")
    ax.legend(frameon=False)
    _style(ax)
    out.append(_figure(_png(fig), "Length of every stored example; split pieces count separately."))

    fig, ax = plt.subplots(figsize=(6, 3.6))
    fill = data.row_tokens / max_len if len(data.row_tokens) else np.zeros(0)
    ax.hist(fill * 100, bins=np.linspace(0, 100, 41), color="#2f9e6f", edgecolor="white",
            linewidth=0.4)
    ax.set_xlabel("row fill (tokens per row / max_len, %)")
    ax.set_ylabel("rows")
    ax.set_title("Row fill")
    ax.set_xlim(0, 100)
    _style(ax)
    out.append(_figure(_png(fig), "How full each packed row is; 100% means no slack."))

    fig, ax = plt.subplots(figsize=(6, 3.6))
    if len(data.row_examples):
        vals, counts = np.unique(data.row_examples, return_counts=True)
        ax.bar(vals, counts, color="#7c5cc4", width=0.8 if len(vals) < 60 else 1.0)
    ax.set_xlabel("examples in the row")
    ax.set_ylabel("rows")
    ax.set_title("Examples per row")
    ax.yaxis.get_major_locator().set_params(integer=True)
    _style(ax)
    out.append(_figure(_png(fig), "Number of examples packed into each row."))
    return out


def _style(ax) -> None:  # noqa: ANN001
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="y", alpha=0.25)


def _comparison_plot(rows: list[dict[str, Any]], title: str) -> str:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = [r["layout"] for r in rows]
    colors = ["#adb5bd" if n in PADDED_LAYOUTS else "#3b82c4" for n in names]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.8))
    eff = [r["efficiency"] * 100 for r in rows]
    a1.barh(names, eff, color=colors)
    a1.set_xlim(0, 100)
    a1.set_xlabel("token efficiency (real tokens / token slots, %)")
    a1.invert_yaxis()
    for i, v in enumerate(eff):
        if v > 80:  # label inside the bar, right-aligned, so it never crosses the bar's end
            a1.text(v - 1.5, i, f"{v:.1f}%", va="center", ha="right", fontsize=9, color="white",
                    fontweight="bold")
        else:
            a1.text(v + 1, i, f"{v:.1f}%", va="center", fontsize=9)
    sp = [r.get("speedup_vs_pad_to_longest", 0) for r in rows]
    a2.barh(names, sp, color=colors)
    a2.set_xlabel("estimated speedup vs pad-to-longest (x)")
    a2.invert_yaxis()
    a2.axvline(1, color="#616e7c", linewidth=1)
    for i, v in enumerate(sp):
        a2.text(v, i, f" {v:.2f}x", va="center", fontsize=9)
    a2.set_xlim(0, max(sp + [1]) * 1.18)
    for ax in (a1, a2):
        _style(ax)
        ax.grid(axis="x", alpha=0.25)
        ax.grid(axis="y", visible=False)
    fig.suptitle(title, x=0.01, ha="left", fontsize=12)
    fig.tight_layout()
    return _png(fig)


def _comparison_table(rows: list[dict[str, Any]], highlight: str | None = None) -> str:
    head = ("<tr><th>layout</th><th>rows / sequences</th><th>token slots</th><th>efficiency</th>"
            "<th>padding tokens</th><th>attention pairs</th><th>est. speedup</th>"
            "<th>plan time</th></tr>")
    body = []
    for r in rows:
        cls = ' class="this"' if r["layout"] == highlight else ""
        plan = "" if r["layout"] in PADDED_LAYOUTS else f"{r['plan_seconds'] * 1000:.1f} ms"
        body.append(
            f"<tr{cls}><td>{html.escape(r['layout'])}</td><td>{r['rows']:,}</td>"
            f"<td>{r['token_slots']:,}</td><td>{r['efficiency']:.1%}</td>"
            f"<td>{r['padding_tokens']:,}</td><td>{_n(r['attention_pairs'])}</td>"
            f"<td>{r.get('speedup_vs_pad_to_longest', 0):.2f}x</td><td>{plan}</td></tr>"
        )
    return f"<table>{head}{''.join(body)}</table>"


def _cards(items: list[tuple[str, str, bool]]) -> str:
    return '<div class="cards">' + "".join(
        f'<div class="card{" hi" if hi else ""}"><div class="v">{html.escape(v)}</div>'
        f'<div class="k">{html.escape(k)}</div></div>' for v, k, hi in items) + "</div>"


def _stats_card(r: dict[str, Any]) -> str:
    L, F = r["lengths"], r["row_fill"]
    rows = [
        ("example length (tokens)", L["min"], L["p50"], L["p90"], L["p99"], L["max"], L["mean"]),
        ("row fill (% of max_len)", *(100 * F[k] for k in ("min", "p50", "p90", "p99", "max",
                                                           "mean"))),
    ]
    body = "".join(
        f"<tr><td>{html.escape(name)}</td>"
        + "".join(f"<td>{v:,.{1 if name.startswith('row') else 0}f}</td>" for v in vals[:-1])
        + f"<td>{vals[-1]:,.1f}</td></tr>" for name, *vals in rows)
    c = r["counts"]
    counts = "".join(f"<tr><td>{k.replace('_', ' ')}</td><td>{v:,}</td></tr>" for k, v in c.items()
                     if v is not None)  # no_loss is None in manifests written before it was counted
    return ('<figure><table class="stats"><tr><th>statistic</th><th>min</th><th>p50</th>'
            f"<th>p90</th><th>p99</th><th>max</th><th>mean</th></tr>{body}</table><br>"
            f'<table class="stats"><tr><th>input examples</th><th>count</th></tr>{counts}</table>'
            "<figcaption>Length and row-fill statistics (polars), and what happened to the "
            "input examples.</figcaption></figure>")


def _note(report: dict[str, Any]) -> str:
    return (f'<p class="note">Estimated speedup = cost(pad-to-longest) / cost(layout), cost = 6 x '
            f"hidden x token slots + causal attention pairs (hidden = {report['hidden']}); "
            f"pad-to-longest uses batches of {report['batch_size']} sequences in example-id order; "
            "a packed row is charged a full max_len (conservative for flat varlen batches).</p>")


def write_html(report: dict[str, Any], path: str | os.PathLike[str],
               data: FolderData | None = None, title: str = "packlm packing report") -> None:
    """One self-contained HTML page (figures embedded as base64 PNG)."""
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{html.escape(title)}"
             f"</title><style>{_CSS}</style></head><body><main><h1>{html.escape(title)}</h1>"]
    if report["kind"] == "folder":
        r, c = report, report["counts"]
        s1, s2 = r["savings"]["pad_to_longest"], r["savings"]["pad_to_max"]
        parts.append(f'<p class="sub">max_len {r["max_len"]:,} &middot; strategy '
                     f'<code>{html.escape(r["strategy"])}</code> &middot; {len(r["shards"])} '
                     f'shard{"s" if len(r["shards"]) != 1 else ""}</p>')
        parts.append(_cards([
            (f"{r['examples']:,}", "examples packed", False),
            (f"{_n(r['tokens'])}", f"tokens ({_n(r['loss_tokens'])} with loss)", False),
            (f"{r['rows']:,}", f"rows (lower bound {r['lower_bound_rows']:,})", False),
            (f"{r['efficiency']:.1%}", "efficiency: tokens / (rows x max_len)", True),
            (f"{r['examples_per_row']['mean']:.2f}",
             f"examples per row (max {r['examples_per_row']['max']})", False),
            (f"{_n(s1['padding_avoided'])}", f"padding tokens avoided vs pad-to-longest "
                                             f"(B={r['batch_size']})", False),
            (f"{s1['estimated_speedup']:.2f}x", "est. speedup vs pad-to-longest", True),
            (f"{s2['estimated_speedup']:.2f}x", "est. speedup vs pad-to-max_len", True),
        ]))
        parts.append(
            f'<p class="note">Examples read {c["examples_read"]:,}: packed '
            f'{c["examples_packed"]:,}, truncated {c["truncated"]:,}, split {c["split"]:,}, '
            f'dropped {c["dropped"]:,}, empty skipped {c["empty_skipped"]:,}. Attention work vs '
            f"pad-to-longest {s1['attention_ratio']:.2f}x less, vs pad-to-max_len "
            f"{s2['attention_ratio']:.2f}x less.</p>")
        if data is not None:
            parts.append('<h2>Distributions</h2><div class="figs">' + "".join(_plots_folder(data))
                         + _stats_card(r) + "</div>")
        parts.append("<h2>Strategy comparison (same sequence lengths)</h2>")
        parts.append(_figure(_comparison_plot(r["comparison"], "Layouts of this folder's "
                                              "sequences"), "Grey: padded baselines; blue: "
                                              "packing strategies."))
        parts.append("<br>" + _comparison_table(r["comparison"], r["strategy"]) + _note(r))
        parts.append("<h2>Shards</h2>")
        rows = []
        for s in r["shards"]:
            ok = ('<span class="ok">ok</span>' if s["sha256_ok"] else
                  "not checked" if s["sha256_ok"] is None else '<span class="bad">MISMATCH</span>')
            rows.append(f"<tr><td>{html.escape(s['file'])}</td><td>{s['rows']:,}</td>"
                        f"<td>{s['tokens']:,}</td><td>{s['loss_tokens']:,}</td>"
                        f"<td><code>{s['sha256'][:16]}</code></td><td>{ok}</td></tr>")
        parts.append("<table><tr><th>file</th><th>rows</th><th>tokens</th><th>loss tokens</th>"
                     f"<th>sha256</th><th>sha256 check</th></tr>{''.join(rows)}</table>")
    else:
        r = report
        L = r["lengths"]
        parts.append(f'<p class="sub">What-if (nothing written): {r["examples"]:,} examples, '
                     f'{r["tokens_untruncated"]:,} tokens; lengths p50 {L["p50"]:.0f}, p90 '
                     f'{L["p90"]:.0f}, max {L["max"]:,}</p>')
        for run in r["runs"]:
            parts.append(f"<h2>max_len {run['max_len']:,}</h2>")
            parts.append(f'<p class="note">{run["over_max_len"]:,} examples longer than max_len '
                         f'(truncated in this estimate); lower bound '
                         f'{run["lower_bound_rows"]:,} rows.</p>')
            parts.append(_figure(_comparison_plot(run["comparison"],
                                                  f"max_len {run['max_len']:,}"), ""))
            parts.append("<br>" + _comparison_table(run["comparison"]))
        parts.append(_note(r))
    parts.append("</main></body></html>\n")
    Path(path).write_text("".join(parts), encoding="utf-8")
