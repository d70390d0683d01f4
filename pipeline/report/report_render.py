"""How `pack-report` shows a report (`pipeline.report.folder_report`) as a self-contained HTML page with
embedded charts (matplotlib, PNG as data URIs); the terminal table is `report_text`'s."""

from __future__ import annotations

import base64
import html
import io
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.report.folder_report import PADDED_LAYOUTS, FolderData
from pipeline.report.report_text import _limits_text, _n, across_lengths, model_text

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


def _v(value: Any, spec: str = "") -> str:
    """The one rule for a value on the HTML page: formatted with `spec`, then escaped (quotes too),
    so a manifest field that carries markup (`<iframe ...>` in a sha256) shows as text. Every value
    interpolated into the page goes through here; the templates hold the only markup.

    >>> _v("<b>"), _v(12345, ",")
    ('&lt;b&gt;', '12,345')
    """
    return html.escape(format(value, spec), quote=True)


def _figure(uri: str, caption: str) -> str:
    return f'<figure><img alt="{_v(caption)}" src="{_v(uri)}"><figcaption>{_v(caption)}</figcaption></figure>'


def length_bins(lengths: np.ndarray, max_len: int, n: int = 50) -> np.ndarray:
    """Edges of the length histogram's `n` log-spaced bins: from the shortest example to just past
    max_len (or the longest example), so the axis spans the lengths there are. The end edges are
    set exactly: 10 ** log10(x) may round above x, which would leave the shortest examples out
    (all of them when every example is max_len tokens, say 1,048,576)."""
    lo, hi = max(1, int(lengths.min())), max(max_len, int(lengths.max())) * 1.05
    edges = np.logspace(math.log10(lo), math.log10(hi), n)
    edges[0], edges[-1] = lo, hi
    return edges


def _plots_folder(data: FolderData) -> list[str]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    max_len = data.manifest.max_len
    out = []
    lengths = data.seq_lens
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if len(lengths):
        bins = length_bins(lengths, max_len)
        ax.hist(lengths, bins=bins, color="#3b82c4", edgecolor="white", linewidth=0.4)
        ax.set_xlim(bins[0], bins[-1])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axvline(max_len, color="#c92a2a", linestyle="--", linewidth=1.5, label=f"max_len = {max_len:,}")
    ax.set_xlabel("example length (tokens, log scale)")
    ax.set_ylabel("examples (log scale)")
    ax.set_title("Example lengths")
    ax.legend(frameon=False)
    _style(ax)
    out.append(_figure(_png(fig), "Length of every stored example; split pieces count separately."))

    fig, ax = plt.subplots(figsize=(6, 3.6))
    fill = data.row_tokens / max_len if len(data.row_tokens) else np.zeros(0)
    ax.hist(fill * 100, bins=np.linspace(0, 100, 41), color="#2f9e6f", edgecolor="white", linewidth=0.4)
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
            a1.text(v - 1.5, i, f"{v:.1f}%", va="center", ha="right", fontsize=9, color="white", fontweight="bold")
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
    head = (
        "<tr><th>layout</th><th>rows / sequences</th><th>token slots</th><th>efficiency</th>"
        "<th>padding tokens</th><th>attention pairs</th><th>est. speedup</th>"
        "<th>plan time</th></tr>"
    )
    body = []
    for r in rows:
        cls = ' class="this"' if r["layout"] == highlight else ""
        plan = "" if r["layout"] in PADDED_LAYOUTS else _v(r["plan_seconds"] * 1000, ".1f") + " ms"
        body.append(
            f"<tr{cls}><td>{_v(r['layout'])}</td><td>{_v(r['rows'], ',')}</td>"
            f"<td>{_v(r['token_slots'], ',')}</td><td>{_v(r['efficiency'], '.1%')}</td>"
            f"<td>{_v(r['padding_tokens'], ',')}</td><td>{_v(_n(r['attention_pairs']))}</td>"
            f"<td>{_v(r.get('speedup_vs_pad_to_longest', 0), '.2f')}x</td><td>{plan}</td></tr>"
        )
    return f"<table>{head}{''.join(body)}</table>"


def _cards(items: list[tuple[str, str, bool]]) -> str:
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card{" hi" if hi else ""}"><div class="v">{_v(v)}</div><div class="k">{_v(k)}</div></div>' for v, k, hi in items
        )
        + "</div>"
    )


def _stats_card(r: dict[str, Any]) -> str:
    L, F = r["lengths"], r["row_fill"]
    rows = [
        ("example length (tokens)", L["min"], L["p50"], L["p90"], L["p99"], L["max"], L["mean"]),
        ("row fill (% of max_len)", *(100 * F[k] for k in ("min", "p50", "p90", "p99", "max", "mean"))),
    ]
    body = "".join(
        f"<tr><td>{_v(name)}</td>"
        + "".join(f"<td>{_v(v, ',.1f' if name.startswith('row') else ',.0f')}</td>" for v in vals[:-1])
        + f"<td>{_v(vals[-1], ',.1f')}</td></tr>"
        for name, *vals in rows
    )
    c = r["counts"]
    counts = "".join(
        f"<tr><td>{_v(k.replace('_', ' '))}</td><td>{_v(v, ',')}</td></tr>" for k, v in c.items() if v is not None
    )  # no_loss is None in manifests written before it was counted
    return (
        '<figure><table class="stats"><tr><th>statistic</th><th>min</th><th>p50</th>'
        f"<th>p90</th><th>p99</th><th>max</th><th>mean</th></tr>{body}</table><br>"
        f'<table class="stats"><tr><th>input examples</th><th>count</th></tr>{counts}</table>'
        "<figcaption>Length and row-fill statistics (polars), and what happened to the "
        "input examples.</figcaption></figure>"
    )


def _across_table(runs: list[dict[str, Any]]) -> str:
    """The what-if across --max-len values as one HTML table (every value escaped)."""
    head = (
        "<tr><th>max_len</th><th>examples longer</th><th>lower bound rows</th><th>best strategy</th>"
        "<th>rows</th><th>efficiency</th><th>pad-to-longest efficiency</th><th>est. speedup</th></tr>"
    )
    body = ""
    for r in across_lengths(runs):
        cells = [
            f"{r['max_len']:,}",
            f"{r['longer']:,}",
            f"{r['lower_bound']:,}",
            r["strategy"],
            f"{r['rows']:,}",
            f"{r['efficiency']:.1%}",
            f"{r['pad_efficiency']:.1%}",
            f"{r['speedup']:.2f}x",
        ]
        body += "<tr>" + "".join(f"<td>{_v(c)}</td>" for c in cells) + "</tr>"
    return f"<table>{head}{body}</table>"


def _sources_html(report: dict[str, Any]) -> str:
    if "tokenizer" not in report:
        return ""
    inputs = "".join(f"<li><code>{_v(i)}</code></li>" for i in report.get("inputs") or [])
    return (
        f'<p class="note">Tokenizer <code>{_v(report["tokenizer"])}</code> '
        f'({_v(report.get("tokenizer_from"))}); inputs:</p><ul class="note">{inputs}</ul>'
    )


def _attention_html(report: dict[str, Any]) -> str:
    """Attention's share of the training FLOPs of the folder's rows, in all and per row."""
    a = report["attention"]
    q = a["row_share"]
    rows = "".join(
        f"<tr><td>{_v(r['shard'])}</td><td>{_v(r['row'], ',')}</td><td>{_v(r['tokens'], ',')}</td>"
        f"<td>{_v(r['examples'], ',')}</td><td>{_v(r['longest'], ',')}</td>"
        f"<td>{_v(r['attention_share'], '.1%')}</td><td>{_v(_n(r['flops']))}</td></tr>"
        for r in a["highest_share_rows"]
    )
    return (
        f'<p class="note">Training FLOPs (forward and backward, counted as pack-train counts them) for a '
        f"model of {_v(model_text(report))}: attention {_v(a['share'], '.1%')} of "
        f"{_v(_n(a['flops']))} FLOPs in all; per row min {_v(q['min'], '.1%')}, p50 {_v(q['p50'], '.1%')}, "
        f"p90 {_v(q['p90'], '.1%')}, max {_v(q['max'], '.1%')}. The rows where its share is highest:</p>"
        "<table><tr><th>shard</th><th>row</th><th>tokens</th><th>examples</th><th>longest example</th>"
        f"<th>attention share</th><th>FLOPs</th></tr>{rows}</table>"
    )


def _note(report: dict[str, Any]) -> str:
    return (
        f'<p class="note">Estimated speedup = FLOPs(pad-to-longest) / FLOPs(layout), in training FLOPs '
        f"(pipeline.report.flops) of a model of {_v(model_text(report))}; "
        f"pad-to-longest uses batches of {_v(report['batch_size'])} sequences in example-id order; "
        "a packed row is charged a full max_len (conservative for flat varlen batches).</p>"
    )


def write_html(
    report: dict[str, Any], path: str | os.PathLike[str], data: FolderData | None = None, title: str = "packlm packing report"
) -> None:
    """One self-contained HTML page (figures embedded as base64 PNG)."""
    parts = [
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{_v(title)}"
        f"</title><style>{_CSS}</style></head><body><main><h1>{_v(title)}</h1>"
    ]
    if report["kind"] == "folder":
        r, c = report, report["counts"]
        s1, s2 = r["savings"]["pad_to_longest"], r["savings"]["pad_to_max"]
        parts.append(_sources_html(r))
        parts.append(
            f'<p class="sub">max_len {_v(r["max_len"], ",")} &middot; strategy '
            f"<code>{_v(r['strategy'])}</code> &middot; {_v(len(r['shards']))} "
            f"shard{'s' if len(r['shards']) != 1 else ''}</p>"
        )
        parts.append(
            _cards(
                [
                    (f"{r['examples']:,}", "examples packed", False),
                    (_n(r["tokens"]), f"tokens ({_n(r['loss_tokens'])} with loss)", False),
                    (f"{r['rows']:,}", f"rows (lower bound {r['lower_bound_rows']:,})", False),
                    (f"{r['efficiency']:.1%}", "efficiency: tokens / (rows x max_len)", True),
                    (f"{r['examples_per_row']['mean']:.2f}", f"examples per row (max {r['examples_per_row']['max']})", False),
                    (_n(s1["padding_avoided"]), f"padding tokens avoided vs pad-to-longest (B={r['batch_size']})", False),
                    (f"{s1['estimated_speedup']:.2f}x", "est. speedup vs pad-to-longest", True),
                    (f"{s2['estimated_speedup']:.2f}x", "est. speedup vs pad-to-max_len", True),
                ]
            )
        )  # plain text: _cards escapes each
        parts.append(
            f'<p class="note">Examples read {_v(c["examples_read"], ",")}: packed '
            f"{_v(c['examples_packed'], ',')}, truncated {_v(c['truncated'], ',')}, split {_v(c['split'], ',')}, "
            f"dropped {_v(c['dropped'], ',')}, empty skipped {_v(c['empty_skipped'], ',')}"
            + (f", shorter than --min-len {_v(c['too_short'], ',')}" if c.get("too_short") else "")
            + (f", duplicates {_v(c['duplicates'], ',')}" if c.get("duplicates") else "")
            + ". Attention work vs "
            f"pad-to-longest {_v(s1['attention_ratio'], '.2f')}x less, vs pad-to-max_len "
            f"{_v(s2['attention_ratio'], '.2f')}x less.</p>"
        )
        if data is not None:
            parts.append('<h2>Distributions</h2><div class="figs">' + "".join(_plots_folder(data)) + _stats_card(r) + "</div>")
        parts.append("<h2>Attention's share of the work</h2>" + _attention_html(r))
        parts.append("<h2>Strategy comparison (same sequence lengths)</h2>")
        parts.append(
            _figure(
                _comparison_plot(r["comparison"], "Layouts of this folder's sequences"), "Grey: padded baselines; blue: packing strategies."
            )
        )
        parts.append("<br>" + _comparison_table(r["comparison"], r["strategy"]) + _note(r))
        if r.get("whatif"):
            parts.append("<h2>What-if: other max_len values</h2>")
            parts.append(f'<p class="note">{_v(_limits_text(r["whatif"]["limits"]).strip())}</p>')
            parts.append(_across_table(r["whatif"]["runs"]))
        parts.append("<h2>Shards</h2>")
        rows = []
        for s in r["shards"]:
            ok = (
                '<span class="ok">ok</span>'
                if s["sha256_ok"]
                else "not checked"
                if s["sha256_ok"] is None
                else '<span class="bad">MISMATCH</span>'
            )
            rows.append(
                f"<tr><td>{_v(s['file'])}</td><td>{_v(s['rows'], ',')}</td>"
                f"<td>{_v(s['tokens'], ',')}</td><td>{_v(s['loss_tokens'], ',')}</td>"
                f"<td><code>{_v(str(s['sha256'])[:16])}</code></td><td>{ok}</td></tr>"
            )
        parts.append(
            "<table><tr><th>file</th><th>rows</th><th>tokens</th><th>loss tokens</th>"
            f"<th>sha256</th><th>sha256 check</th></tr>{''.join(rows)}</table>"
        )
    else:
        r = report
        L = r["lengths"]
        parts.append(_sources_html(r))
        parts.append(
            f'<p class="sub">What-if (nothing written): {_v(r["examples"], ",")} examples, '
            f"{_v(r['tokens_untruncated'], ',')} tokens; lengths p50 {_v(L['p50'], '.0f')}, p90 "
            f"{_v(L['p90'], '.0f')}, max {_v(L['max'], ',')}</p>"
        )
        parts.append("<h2>Across max_len</h2>" + _across_table(r["runs"]))
        for run in r["runs"]:
            parts.append(f"<h2>max_len {_v(run['max_len'], ',')}</h2>")
            parts.append(
                f'<p class="note">{_v(run["over_max_len"], ",")} examples longer than max_len '
                f"(truncated in this estimate); lower bound "
                f"{_v(run['lower_bound_rows'], ',')} rows.</p>"
            )
            parts.append(_figure(_comparison_plot(run["comparison"], f"max_len {run['max_len']:,}"), ""))
            parts.append("<br>" + _comparison_table(run["comparison"]))
        parts.append(_note(r))
    parts.append("</main></body></html>\n")
    Path(path).write_text("".join(parts), encoding="utf-8")
