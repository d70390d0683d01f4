"""What `scripts/bench/bench_alst.py` reads back from an ArcticTraining run: its per-step metrics
(train-log-metrics.jsonl), their tokens/s over the steps after the first, and pack-train's FLOP count
of the same steps (`pipeline.report.flops`), so that ALST's MFU is counted as pack-train's is."""

from __future__ import annotations

import argparse
from typing import Any


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens/s and step times over the steps after the first (the first warms up and compiles)."""
    timed = steps[1:]
    out: dict[str, Any] = {"steps_done": len(steps), "timed_steps": len(timed)}
    if steps:
        out["loss_first"], out["loss_last"] = steps[0].get("loss"), steps[-1].get("loss")
    if timed and all("step_time" in s and "seqlen" in s for s in timed):
        seconds = sum(s["step_time"] for s in timed)
        out["tokens_per_s"] = sum(s["seqlen"] for s in timed) / seconds
        out["step_time_s_mean"] = seconds / len(timed)
        tflops = [s["step_tflops"] for s in timed if "step_tflops" in s]
        if tflops:
            out["arctic_step_tflops_mean"] = sum(tflops) / len(tflops)  # ArcticTraining's own count
    return out


def counted_flops(a: argparse.Namespace, vocab: int | None, lengths: list[int], record: dict[str, Any]) -> dict[str, Any]:
    """pack-train's count (`pipeline.report.flops`: attention from the example's length, every layer
    recomputed, LoRA's frozen base without weight gradients) of the timed steps, one row a step in
    order, over their time: model TFLOP/s, MFU against an H100/H200's bf16 peak, attention's share."""
    from pipeline.report.flops import StepFlops, step_flops
    from scripts.benchlib import flop_rates
    from scripts.benchlib.train_results import flop_shape
    from trainer.model.load import preset_config

    timed = record.get("timed_steps", 0)
    seconds = timed * record.get("step_time_s_mean", 0.0)
    if not timed or seconds <= 0:
        return {}
    shape = flop_shape(preset_config(a.model, vocab), a.lora_r, 1)
    rows = [lengths[i % len(lengths)] for i in range(1, 1 + timed)]  # the first step's row is not timed
    flops = sum((step_flops(shape, [n], loss_tokens=n - 1) for n in rows), StepFlops())
    return {"counted": "pipeline.report.flops over the timed steps", **flop_rates(flops.model, flops.attention, seconds)}
