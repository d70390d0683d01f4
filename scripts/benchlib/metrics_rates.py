"""Tokens/s from pack-train's metrics.jsonl training lines (or lines of the same shape: `step`, the
running `tokens`, the window's mean `step_time_s`): over the log windows after the warm-up, and
window by window (their median, the steady rate), leaving out windows that hold a profiled step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def timed_rate(rows: Sequence[dict[str, Any]], warmup: int) -> float:
    """Tokens/s over the metrics.jsonl training lines whose log window starts after `warmup` steps.

    A line at step s covers the steps since the previous line, at its mean `step_time_s`, and holds
    the running token count: with lines at steps 10, 20, 30 and warmup 10, the windows 11-20 and 21-30
    count; with lines at 25 and 50 and warmup 20, only 26-50 does (1-25 holds the compile).
    """
    seconds = tokens = 0.0
    last_step, last_tokens = 0, 0
    for r in rows:
        if last_step >= warmup:
            seconds += r["step_time_s"] * (r["step"] - last_step)
            tokens += r["tokens"] - last_tokens
        last_step, last_tokens = r["step"], r["tokens"]
    return tokens / seconds if seconds else 0.0


def parse_steps(spec: str | None) -> range:
    """--profile-steps "16-17" -> range(16, 18) (pack-train's own parsing); None -> an empty range."""
    if not spec:
        return range(0)
    from trainer.config import parse_step_range

    first, last = parse_step_range(spec)
    return range(first, last + 1)


def window_rates(rows: Sequence[dict[str, Any]], warmup: int, profiled: range = range(0)) -> list[float]:
    """Tokens/s of each log window that starts after `warmup`, leaving out windows with a profiled step.

    The median of these is the steady rate: one slow window (a stall, the profiler) moves
    `timed_rate` but not the median. Lines at steps 5, 10, 15, 20 with warmup 5 and step 17 profiled
    give the rates of windows 6-10 and 11-15.
    """
    rates = []
    last_step, last_tokens = 0, 0
    for r in rows:
        window = range(last_step + 1, r["step"] + 1)
        if last_step >= warmup and not any(s in profiled for s in window) and r["step_time_s"] > 0:
            rates.append((r["tokens"] - last_tokens) / (r["step_time_s"] * len(window)))
        last_step, last_tokens = r["step"], r["tokens"]
    return rates
