#!/usr/bin/env python
"""Multi-GPU scaling table from `pack-train` run folders (what `scripts/bench/bench_scale.sh` writes).

    python scripts/bench/scale_table.py RUN_DIR... [--warmup 8] [--md scale.md] [--json scale.json]

Each RUN_DIR holds pack-train's `metrics.jsonl` (written by rank 0, one line per `--log-every`
steps), `config.json` (with `world_size`, `parallel`, `peak_flops`), `summary.json` when the run
ended, and optionally `exit_code` (one integer, written by bench_scale.sh: torchrun's exit status,
non-zero if any rank failed).

What pack-train logs (trainer/run/loop.py): `tokens` is the cumulative count of real (non-padding)
tokens over ALL ranks (each window's counts are all-reduced), `tokens_per_s` is therefore global,
`step_time_s` is the mean wall time per step since the previous line, `peak_mem_gib` is rank 0's
peak allocated CUDA memory (max RSS on CPU), and `mfu` is per device (global tokens/s divided by
world size). Only rank 0 writes metrics, so per-rank step counts are not logged: the table shows
the last logged step, the summary's step count and the exit code (the planner gives every rank the
same number of micro-batches per step, so a zero exit means every rank ran all steps).

Measured window: lines whose step is > `--warmup` (compile / allocator warmup excluded). Totals:
tokens/s = sum of token deltas / sum of (step_time_s x steps) over that window; per GPU = total /
world size; scaling efficiency = per-GPU tokens/s over the 1-GPU run's per-GPU tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from pipeline.errors import UserError, cli_errors  # noqa: E402
from scripts.benchlib import add_bench_args, check_output, write_text_output  # noqa: E402


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc}); was the run interrupted?") from None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The metrics lines of one run, in step order (an empty list when the file is missing)."""
    if not path.is_file():
        return []
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise UserError(f"{path}:{n}: not a JSON line; is this a pack-train metrics.jsonl?") from None
    return sorted(records, key=lambda r: r["step"])


def _rank_steps(run_dir: Path) -> list[int] | None:
    """Steps each rank says it ran (pack-train writes ranks/rank{r}.json on every rank)."""
    files = sorted((run_dir / "ranks").glob("rank*.json"), key=lambda f: int(f.stem[4:] or 0))
    return [int(json.loads(f.read_text())["steps"]) for f in files] or None


def summarize_run(run_dir: Path, warmup: int) -> dict[str, Any]:
    """One row of the table: throughput, MFU and memory over the steps after `warmup`."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run folder; pass folders written by pack-train --out")
    config = _read_json(run_dir / "config.json") or {}
    summary = _read_json(run_dir / "summary.json")
    exit_file = run_dir / "exit_code"
    exit_code = int(exit_file.read_text().strip()) if exit_file.is_file() else None
    records = read_metrics(run_dir / "metrics.jsonl")
    known = config.get("world_size") or (summary or {}).get("world_size")
    world = int(known) if known else None  # None: the run died before writing config.json
    parallel = "single" if world == 1 else str(config.get("parallel", "?"))
    row: dict[str, Any] = {
        "name": run_dir.name,
        "run_dir": str(run_dir),
        "parallel": parallel,
        "gpus": world,
        "exit_code": exit_code,
        "ok": bool(records) and exit_code in (0, None) and summary is not None,
        "steps_logged": records[-1]["step"] if records else 0,
        "steps_summary": summary.get("steps") if summary else None,
        "total_steps": summary.get("total_steps") if summary else None,
        "steps_measured": 0,
        "tokens_measured": 0,
        "seconds_measured": 0.0,
        "tokens_per_s": None,
        "tokens_per_s_per_gpu": None,
        "mfu": None,
        "step_time_ms": None,
        "peak_mem_gib": max((r.get("peak_mem_gib") or 0.0 for r in records), default=None),
        "attention": records[-1].get("attention") if records else None,
        "params": summary.get("params") if summary else None,
        "peak_flops": config.get("peak_flops"),
        "rank_steps": _rank_steps(run_dir),
    }
    prev_step, prev_tokens = 0, 0
    mfu_time = 0.0
    for rec in records:
        n = rec["step"] - prev_step
        if rec["step"] > warmup and n > 0:
            seconds = float(rec["step_time_s"]) * n
            row["steps_measured"] += n
            row["tokens_measured"] += int(rec["tokens"]) - prev_tokens
            row["seconds_measured"] += seconds
            mfu_time += float(rec.get("mfu") or 0.0) * seconds
        prev_step, prev_tokens = rec["step"], int(rec["tokens"])
    if row["seconds_measured"] > 0:
        secs = row["seconds_measured"]
        row["tokens_per_s"] = row["tokens_measured"] / secs
        row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / (world or 1)
        row["mfu"] = mfu_time / secs  # time-weighted mean of the per-device MFU pack-train logs
        row["step_time_ms"] = 1000.0 * secs / row["steps_measured"]
    return row


def add_efficiency(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Scaling efficiency of every row against the first measured 1-GPU row (its per-GPU tokens/s
    ratio); returns that baseline row, or None when there is none."""
    base = next((r for r in rows if r["gpus"] == 1 and r["tokens_per_s_per_gpu"]), None)
    for r in rows:
        per_gpu = r["tokens_per_s_per_gpu"]
        r["scaling_efficiency"] = per_gpu / base["tokens_per_s_per_gpu"] if base and per_gpu else None
    return base


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(rows: Sequence[dict[str, Any]], warmup: int) -> str:
    """The scaling table in Markdown, with a note saying how each column was computed."""
    lines = [
        (
            "| config | GPUs | exit | steps (logged / summary) | steps measured "
            "| tokens/s total (all GPUs, real tokens) | tokens/s per GPU | scaling eff. vs 1 GPU "
            "| MFU (per GPU) | step time ms | peak mem GiB (rank 0) | steps per rank |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        steps = f"{r['steps_logged']} / {_fmt(r['steps_summary'], 'd')}"
        label = r["name"] if r["name"] == r["parallel"] else f"{r['name']} ({r['parallel']})"
        lines.append(
            f"| {label} | {_fmt(r['gpus'], 'd')} | {_fmt(r['exit_code'], 'd')} | {steps} "
            f"| {r['steps_measured']} | {_fmt(r['tokens_per_s'], ',.0f')} "
            f"| {_fmt(r['tokens_per_s_per_gpu'], ',.0f')} | {_fmt(r['scaling_efficiency'], '.1%')} "
            f"| {_fmt(r['mfu'], '.2%')} | {_fmt(r['step_time_ms'], '.1f')} "
            f"| {_fmt(r['peak_mem_gib'], '.2f')} "
            f"| {','.join(map(str, r['rank_steps'])) if r.get('rank_steps') else '-'} |"
        )
    lines += [
        "",
        (
            f"Measured: steps > {warmup} (earlier steps are compile/allocator warmup). pack-train's "
            "`tokens` are summed over all ranks, so tokens/s total is global and per GPU = total / GPUs. "
            "Scaling efficiency = per-GPU tokens/s / the 1-GPU run's. MFU = model FLOPs/s (causal attention "
            "included: pipeline.report.flops) / (peak FLOP/s x GPUs), as pack-train logs it (peak = its "
            "--peak-flops). Only rank 0 logs "
            "metrics; steps per rank come from each rank's own ranks/rank{r}.json."
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="pack-train run folders (its --out)")
    add_bench_args(parser, warmup=(8, "steps excluded from the measurement"))
    parser.add_argument("--md", type=Path, default=None, help="also write the table here")
    add_bench_args(parser, json=(None, "also write the rows here as JSON"))
    args = parser.parse_args(argv)
    for option, path in (("--md", args.md), ("--json", args.json)):
        if path:
            check_output(path, option)
    try:
        return _run(args)
    except click.ClickException as exc:  # a UserError, as one line
        exc.show()
        return 1


def _run(args: argparse.Namespace) -> int:
    with cli_errors():
        rows = [summarize_run(d, args.warmup) for d in args.runs]
        base = add_efficiency(rows)
        table = markdown_table(rows, args.warmup)
        print(table, end="")
        if args.md:
            write_text_output(args.md, table, "--md")
        if args.json:
            payload = {
                "warmup": args.warmup,
                "baseline": base["name"] if base else None,
                "tokens_per_s_scope": "global (all ranks), real tokens",
                "runs": rows,
            }
            write_text_output(args.json, json.dumps(payload, indent=2) + "\n")
        bad = [r["name"] for r in rows if not r["ok"]]
        if bad:
            print(f"scale_table: runs that failed or did not finish: {', '.join(bad)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
