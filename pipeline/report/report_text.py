"""How `pack-report` shows a report (`pipeline.report.folder_report`) on the terminal: a table of at
most 100 columns, the sources, the what-if across --max-len values (`report_render` draws the HTML page)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.report.flops import Sizes
from pipeline.report.folder_report import PADDED_LAYOUTS
from pipeline.report.stats import safe_ratio


def _n(x: float) -> str:
    """Human number: 1234567 -> '1.23M'; up to peta, which the attention pairs of rows of a million
    tokens reach (one padded to 1,048,576 has 5.5e11)."""
    x = float(x)
    for unit, div in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}" if x == int(x) else f"{x:.2f}"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    head = f"{'layout':<24}{'rows':>11}{'efficiency':>12}{'padding':>11}{'attn pairs':>12}{'speedup*':>10}{'plan ms':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        plan = "" if r["layout"] in PADDED_LAYOUTS else f"{r['plan_seconds'] * 1000:.1f}"
        lines.append(
            f"{r['layout'][:23]:<24}{r['rows']:>11,}{r['efficiency']:>11.1%} "
            f"{_n(r['padding_tokens']):>10} {_n(r['attention_pairs']):>11} "
            f"{r.get('speedup_vs_pad_to_longest', 0):>9.2f}x{plan:>10}".rstrip()
        )
    return lines


def sources_lines(report: dict[str, Any]) -> list[str]:
    """The tokenizer the figures were counted with and the inputs, as the report names them."""
    if "tokenizer" not in report:
        return []
    inputs = report.get("inputs") or []
    shown = ", ".join(map(str, inputs[:3])) + (f" and {len(inputs) - 3} more" if len(inputs) > 3 else "")
    tokenizer = f"{report['tokenizer']} ({report.get('tokenizer_from')})" if report["tokenizer"] else "not recorded"
    return [f"tokenizer: {tokenizer}", f"inputs: {shown or 'not recorded'}"]


def best_packed(run: dict[str, Any]) -> dict[str, Any]:
    """The packing strategy of a what-if run with the fewest rows (ties: the first listed)."""
    packed_rows = [r for r in run["comparison"] if r["layout"] not in PADDED_LAYOUTS]
    return min(packed_rows, key=lambda r: r["rows"])


def across_lengths(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per --max-len of a what-if: examples longer, lower bound, pad-to-longest's and the best
    strategy's rows and efficiency, and its estimated speedup over pad-to-longest."""
    out = []
    for run in runs:
        best = best_packed(run)
        pad = next(r for r in run["comparison"] if r["layout"] == "pad-to-longest")
        out.append(
            {
                "max_len": run["max_len"],
                "longer": run["over_max_len"],
                "lower_bound": run["lower_bound_rows"],
                "strategy": best["layout"],
                "rows": best["rows"],
                "efficiency": best["efficiency"],
                "pad_rows": pad["rows"],
                "pad_efficiency": pad["efficiency"],
                "speedup": best.get("speedup_vs_pad_to_longest", 0),
            }
        )
    return out


def _across_text(runs: list[dict[str, Any]]) -> list[str]:
    head = f"{'max_len':>9}{'longer':>9}{'lower bound':>13}{'best':>10}{'rows':>10}{'efficiency':>12}{'padded eff.':>13}{'speedup*':>10}"
    lines = [head, "-" * len(head)]
    for r in across_lengths(runs):
        lines.append(
            f"{r['max_len']:>9,}{r['longer']:>9,}{r['lower_bound']:>13,}{r['strategy'][:9]:>10}"
            f"{r['rows']:>10,}{r['efficiency']:>11.1%} {r['pad_efficiency']:>12.1%}{r['speedup']:>9.2f}x"
        )
    return lines


def _limits_text(limits: dict[str, Any]) -> str:
    if not limits.get("exact_up_to"):
        return "  from the stored example lengths (none truncated or dropped: exact at every max_len)"
    return (
        f"  from the stored example lengths; {limits['truncated']:,} truncated, {limits['dropped']:,} dropped "
        f"at {limits['folder_max_len']:,}: rows above it are lower bounds"
    )


def model_text(report: dict[str, Any]) -> str:
    """The model the report's FLOPs are counted for (`pipeline.report.flops.Sizes`)."""
    return Sizes(**report["model"]).describe()


def _footnote(report: dict[str, Any]) -> str:
    return (
        f"* est. speedup vs pad-to-longest (B={report['batch_size']}) in training FLOPs "
        f"(pipeline.report.flops) of a model of\n    {model_text(report)}"
    )


def attention_lines(a: dict[str, Any]) -> list[str]:
    """Attention's share of the training FLOPs of a folder's rows, in all and per row."""
    q = a["row_share"]
    lines = [
        f"  all rows        {a['share']:.1%} of {_n(a['flops'])} FLOPs",
        f"  per row         min {q['min']:.1%}, p50 {q['p50']:.1%}, p90 {q['p90']:.1%}, p99 {q['p99']:.1%}, max {q['max']:.1%}",
        "  highest share",
    ]
    for r in a["highest_share_rows"]:
        lines.append(
            f"    {str(r['shard'])[:24]} row {r['row']:,}: {r['tokens']:,} tokens, {r['examples']:,} "
            f"example(s), longest {r['longest']:,}: {r['attention_share']:.1%}"
        )
    return lines


def format_text(report: dict[str, Any]) -> str:
    """The terminal summary (lines <= 100 columns)."""
    if report["kind"] == "what-if":
        return _format_whatif(report)
    r, c = report, report["counts"]
    L = r["lengths"]
    s1, s2 = r["savings"]["pad_to_longest"], r["savings"]["pad_to_max"]
    lines = [
        *sources_lines(r),
        f"packed folder: max_len {r['max_len']}, strategy {r['strategy']}",
        f"  examples        {r['examples']:>14,}   sequences (split pieces count) {r['sequences']:,}",
        f"  tokens          {r['tokens']:>14,}   loss tokens {r['loss_tokens']:,} ({safe_ratio(r['loss_tokens'], r['tokens']):.1%})",
        f"  rows            {r['rows']:>14,}   lower bound ceil(tokens/max_len) "
        f"{r['lower_bound_rows']:,} (+{r['rows_over_lower_bound']:,})",
        f"  efficiency      {r['efficiency']:>14.2%}   tokens / (rows x max_len)",
        f"  examples/row    mean {r['examples_per_row']['mean']:.2f}, max {r['examples_per_row']['max']}",
        f"  lengths         min {L['min']}, p50 {L['p50']:.0f}, p90 {L['p90']:.0f}, "
        f"p99 {L['p99']:.0f}, max {L['max']}, mean {L['mean']:.1f}",
        f"  examples read {c['examples_read']:,}: packed {c['examples_packed']:,}, truncated "
        f"{c['truncated']:,}, split {c['split']:,}, dropped {c['dropped']:,}, empty skipped "
        f"{c['empty_skipped']:,}"
        + (f", shorter than --min-len {c['too_short']:,}" if c.get("too_short") else "")
        + (f", duplicates {c['duplicates']:,}" if c.get("duplicates") else "")
        + (f", {c['no_loss']:,} with no loss token (they train nothing)" if c.get("no_loss") else ""),
        "",
        "savings against padding",
        f"  vs pad-to-longest (B={r['batch_size']}): {_n(s1['padding_avoided'])} padding tokens "
        f"avoided, {s1['attention_ratio']:.2f}x less attention, est. speedup "
        f"{s1['estimated_speedup']:.2f}x",
        f"  vs pad-to-max_len:      {_n(s2['padding_avoided'])} padding tokens avoided, "
        f"{s2['attention_ratio']:.2f}x less attention, est. speedup {s2['estimated_speedup']:.2f}x",
        "",
        "attention's share of the training FLOPs of these rows (forward and backward, as pack-train",
        f"counts them) for a model of {model_text(r)}",
        *attention_lines(r["attention"]),
        "",
        "strategy comparison on the same sequence lengths",
        *("  " + x for x in _table(r["comparison"])),
        "  " + _footnote(r),
    ]
    if r.get("whatif"):
        lines += [
            "",
            "what-if: this folder's examples packed at other max_len values",
            _limits_text(r["whatif"]["limits"]),
            *("  " + x for x in _across_text(r["whatif"]["runs"])),
        ]
    held = r.get("eval") or {}
    if held.get("folder"):
        lines += [
            "",
            f"eval: {held['examples']:,} examples held out in {held['folder']}/ (not in this folder; "
            f"pack-report FOLDER/{held['folder']} for its figures)",
        ]
    elif held.get("role") == "eval":
        lines += ["", "this is a held-out eval folder (pack-data --eval-fraction): pack-train evaluates on it"]
    if len(r.get("sources", [])) > 1 or any(x["weight"] != 1 for x in r.get("sources", [])):
        lines += [
            "",
            "sources (uses: packed examples, a --mix weight of 2 uses each example twice)",
            f"  {'input':<32} {'weight':>6} {'read':>10} {'uses':>10} {'tokens':>12} {'loss tokens':>12} {'share':>6}",
        ]
        for x in r["sources"]:
            name = Path(x["input"]).name
            lines.append(
                f"  {name[:32]:<32} {x['weight']:>6g} {x['examples_read']:>10,} {x['uses']:>10,} "
                f"{x['tokens']:>12,} {x['loss_tokens']:>12,} {x['share']:>6.1%}"
            )
    bad = [s["file"] for s in r["shards"] if s["sha256_ok"] is False]
    lines.append("")
    lines.append(
        f"shards: {len(r['shards'])}, sha256 "
        + (
            "not checked"
            if r["shards"] and r["shards"][0]["sha256_ok"] is None
            else "all ok"
            if not bad
            else f"MISMATCH in {', '.join(bad[:3])}"
        )
    )
    return "\n".join(lines) + "\n"


def _format_whatif(r: dict[str, Any]) -> str:
    L = r["lengths"]
    lines = [
        *sources_lines(r),
        f"what-if: {r['examples']:,} examples, {r['tokens_untruncated']:,} tokens",
        f"  lengths min {L['min']}, p50 {L['p50']:.0f}, p90 {L['p90']:.0f}, p99 {L['p99']:.0f}, max {L['max']}, mean {L['mean']:.1f}",
    ]
    for run in r["runs"]:
        lines += [
            "",
            f"max_len {run['max_len']}: {run['over_max_len']:,} examples longer (truncated here), "
            f"lower bound {run['lower_bound_rows']:,} rows",
            *("  " + x for x in _table(run["comparison"])),
        ]
    lines += ["", "across max_len (the best packing strategy of each)", *("  " + x for x in _across_text(r["runs"]))]
    lines.append("  " + _footnote(r))
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------- HTML
