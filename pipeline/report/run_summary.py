"""`pack-report RUN_DIR`: what a pack-train run did, from the files it leaves (summary.json,
metrics.jsonl, best.json, loss.png); reads JSON only, imports nothing of the trainer.

    >>> is_run_folder(Path("data"))
    False
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.contract.run_folder import BEST, LOSS_PLOT, METRICS, RUN_CONFIG, SUMMARY
from pipeline.errors import UserError
from pipeline.report.flops import rates_line

FLOP_KEYS = ("mfu", "tflops", "hfu", "attn_flop_share")  # pack-train's FLOP figures (pipeline.report.flops)


def is_run_folder(folder: Path) -> bool:
    """A folder pack-train wrote (metrics.jsonl beside config.json), not a packed folder."""
    return (folder / METRICS).is_file() and (folder / RUN_CONFIG).is_file() and not (folder / "manifest.json").exists()


def run_report(folder: Path) -> dict[str, Any]:
    """The run's figures: steps, tokens, throughput, FLOP rates (the whole run's from summary.json,
    else the last metrics line's), first/last/lowest train loss, every eval, the best checkpoint,
    the plot; a run still in progress (no summary.json yet) is reported as such."""
    records = []
    for number, line in enumerate((folder / METRICS).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                raise UserError(f"{folder / METRICS} line {number}: not JSON: the file is damaged") from None
            if not isinstance(record, dict):
                raise UserError(f"{folder / METRICS} line {number}: not a JSON object: the file is damaged")
            records.append(record)
    train = [r for r in records if r.get("loss") is not None]
    evals = [r for r in records if r.get("eval_loss") is not None]
    summary, best = _json_object(folder / SUMMARY), _json_object(folder / BEST)
    try:
        return _figures(folder, records, train, evals, summary, best)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(
            f"{folder}: metrics.jsonl holds a value pack-train does not write ({type(exc).__name__}: {exc}): the run folder is damaged"
        ) from None


def _figures(
    folder: Path, records: list[dict], train: list[dict], evals: list[dict], summary: dict | None, best: dict | None
) -> dict[str, Any]:
    return {
        "kind": "run",
        "folder": str(folder),
        "finished": summary is not None,
        "summary": summary,
        "train_loss": {"first": train[0]["loss"], "last": train[-1]["loss"], "lowest": min(r["loss"] for r in train), "lines": len(train)}
        if train
        else None,
        "last_step": max((r["step"] for r in records), default=0),
        "tokens_per_s": [r["tokens_per_s"] for r in train if "tokens_per_s" in r][-1:] or None,
        "flops": _flop_figures(summary, train),
        "evals": [{"step": r["step"], "eval_loss": r["eval_loss"], "eval_ppl": r.get("eval_ppl")} for r in evals],
        "best": best,
        "plot": str(folder / LOSS_PLOT) if (folder / LOSS_PLOT).is_file() else None,
    }


def _flop_figures(summary: dict | None, train: list[dict]) -> dict[str, Any] | None:
    """mfu, tflops, hfu and attn_flop_share of the whole run (summary.json), or of the last metrics
    line that has them (a run in progress); None for a run written before pack-train counted them."""
    for record, over in ((summary or {}, "run"), *((r, f"step {r.get('step')}") for r in reversed(train))):
        if record.get("tflops") is not None:
            return {**{k: record.get(k) for k in FLOP_KEYS}, "over": over}
    return None


def _json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, None when there is no such file; anything else (a file cut short,
    not an object) is one line naming it."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{path}: not readable JSON ({type(exc).__name__}): the run folder is damaged (a run "
            "cut off while writing it?); re-run or resume the run to write it again"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a JSON object: the run folder is damaged; re-run or resume the run to write it again")
    return data


def format_run(report: dict[str, Any]) -> str:
    """The terminal summary of `run_report`; a figure of another type than pack-train writes (text
    where a number belongs) is one line naming the run folder."""
    try:
        return _format_run(report)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise UserError(
            f"{report['folder']}: summary.json, metrics.jsonl or best.json holds a value pack-train "
            f"does not write ({type(exc).__name__}: {exc}): the run folder is damaged"
        ) from None


def _format_run(report: dict[str, Any]) -> str:
    s, t = report["summary"], report["train_loss"]
    lines = [f"pack-train run: {report['folder']} ({'finished' if report['finished'] else 'not finished'})"]
    if s:
        lines.append(
            f"  steps           {s['steps']} / {s['total_steps']}, {s['tokens']:,} tokens, "
            f"{s['tokens_per_s']:,.0f} tokens/s, attention {s['attention']}"
        )
    else:
        lines.append(f"  last step       {report['last_step']}")
    if report.get("flops"):
        f = report["flops"]
        lines.append(f"  compute         {rates_line(f)}" + ("" if f["over"] == "run" else f" at {f['over']}"))
    if t:
        lines.append(
            f"  train loss      first {t['first']:.4f}, last {t['last']:.4f}, lowest {t['lowest']:.4f} ({t['lines']} metrics lines)"
        )
    for e in report["evals"][-5:]:
        lines.append(f"  eval loss       step {e['step']}: {e['eval_loss']:.4f} (perplexity {e['eval_ppl']:.2f})")
    if report["best"]:
        b = report["best"]
        lines.append(f"  best            step {b['step']} eval loss {b['eval_loss']:.4f}: checkpoints/{b['checkpoint']}")
    if s and s.get("checkpoint"):
        lines.append(f"  last checkpoint {s['checkpoint']}")
    if report["plot"]:
        lines.append(f"  curves          {report['plot']}")
    return "\n".join(lines) + "\n"
