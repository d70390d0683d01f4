"""What a training benchmark's path measured and how it is reported: a path's name and precision
class, its raw counts turned into rates by the one FLOP count (`pipeline.report.flops`), pack-train's
metrics lines read back as a result, and the table and targets of a run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.report.flops import ModelShape, attention_share, step_flops
from pipeline.shards import IGNORE_INDEX

H100_BF16_TFLOPS = 989.0  # an H100/H200's dense bf16 peak, the default of --peak-tflops


def split_path(path: str) -> tuple[str, list[str]]:
    """ "hf-flat-fa2+layers+liger" -> ("hf-flat-fa2", ["layers", "liger"])."""
    base, *tunings = path.split("+")
    return base, tunings


def precision_class(path: str) -> str:
    """ "fp8", "bf16 weights" or "autocast" (bf16 autocast over fp32 weights, or fp32 with --dtype
    fp32): the precision a path computes at, for same-precision ratios. pack-train's bf16-weights
    (fp32 masters) and HF's +bf16 (no masters) share a class: HF gets the faster, less precise one."""
    tunings = split_path(path)[1]
    if "fp8" in tunings:
        return "fp8"
    return "bf16 weights" if {"bf16", "bf16-weights"} & set(tunings) else "autocast"


def packed_dtype(tunings: Sequence[str], dtype: str) -> str:
    """pack-train's --dtype for a packlm path's tunings (else the run's --dtype)."""
    return next((t for t in ("fp8", "bf16-weights") if t in tunings), dtype)


@dataclass
class PathResult:
    """What one path measured (JSON-serialisable)."""

    path: str
    runner: str
    ok: bool = True
    note: str = ""
    steps: int = 0
    tokens: int = 0  # real tokens in the timed steps
    loss_tokens: int = 0  # of which carry a loss
    examples: int = 0
    seconds: float = 0.0
    data_wait_s: float = 0.0
    peak_gib: float | None = None
    tokens_per_s: float = 0.0
    step_ms: float = 0.0
    tflops: float = 0.0  # model TFLOP/s (pipeline.report.flops: dense and causal attention)
    mfu: float = 0.0  # model FLOPs/s / peak
    hfu: float = 0.0  # as mfu, with the recompute (--grad-checkpointing)
    attn_tflops_per_s: float = 0.0
    attn_share: float = 0.0  # attention's share of the model FLOPs
    data_wait_pct: float = 0.0
    final_loss: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def flop_shape(config: Any, lora_r: int = 0, grad_checkpointing: int = 0) -> ModelShape:
    """The model of `config` as the one FLOP count sees it (`trainer.run.metrics.model_shape`), with
    LoRA adapters of rank `lora_r` on every linear layer of the decoder and every
    `grad_checkpointing`-th layer recomputed, as the paths train it; built on the meta device."""
    from transformers import AutoModelForCausalLM

    from trainer import TrainConfig
    from trainer.model.lora import add_lora
    from trainer.run.metrics import model_shape

    options = TrainConfig(data="-", model="-", out="-", lora_r=lora_r, grad_checkpointing=grad_checkpointing)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        if lora_r:
            add_lora(model, options)
    return model_shape(model, options)


def loss_tokens_of(labels: Sequence[np.ndarray]) -> int:
    """The loss tokens of examples or rows by their (unshifted) labels: those not -100 (an example's
    first label is -100, so it is the count of shifted targets)."""
    return int(sum(int((np.asarray(x) != IGNORE_INDEX).sum()) for x in labels))


def n_params_of(model: torch.nn.Module) -> int:
    """All parameters (embeddings and LM head included)."""
    return sum(p.numel() for p in model.parameters())


def finish_result(res: PathResult, *, shape: ModelShape, lens: np.ndarray, peak_tflops: float) -> None:
    """Fill the derived rates of `res` from its raw counts: the FLOPs of the timed steps' examples
    (`lens`, `res.tokens`, `res.loss_tokens`) for `shape`, by the one count."""
    if res.seconds <= 0 or res.steps <= 0:
        return
    res.tokens_per_s = res.tokens / res.seconds
    res.step_ms = 1000.0 * res.seconds / res.steps
    flops = step_flops(shape, lens, tokens=res.tokens, loss_tokens=res.loss_tokens)
    res.tflops = flops.model / res.seconds / 1e12
    res.mfu = flops.model / res.seconds / (peak_tflops * 1e12)
    res.hfu = flops.hardware / res.seconds / (peak_tflops * 1e12)
    res.attn_tflops_per_s = flops.attention / res.seconds / 1e12
    res.attn_share = attention_share(flops)
    res.data_wait_pct = 100.0 * res.data_wait_s / res.seconds


def timed_result(
    path: str, runner: str, records: Sequence[dict], warmup: int, steps: int, *, stopped_by_sigterm: bool = False
) -> tuple[PathResult, list[float]]:
    """The timed steps (warmup+1..warmup+steps) of pack-train's metrics lines, and the mean step of
    each timed line's window in ms. A run that logged fewer timed steps is not a result: SIGTERM
    (a `timeout` around the benchmark) makes pack-train finish its step, save and end, and one
    step's rate would otherwise stand in for the benchmark's.

    >>> recs = [{"step": 3, "tokens": 30, "step_time_s": 2.0, "data_wait_s": 0.0, "loss": 9.0},
    ...         {"step": 4, "tokens": 40, "step_time_s": 0.5, "data_wait_s": 0.0, "loss": 8.0}]
    >>> res, ms = timed_result("packlm-ffd", "pack-train", recs, warmup=3, steps=6)
    >>> res.ok, res.steps, res.tokens, ms, res.note
    (False, 1, 10, [500.0], 'pack-train stopped after 1 of 6 timed steps')
    """
    res = PathResult(path=path, runner=runner)
    prev_step, prev_tokens = 0, 0
    window_ms = []  # the mean step of each timed metrics window (a stall shows in one of them)
    for rec in records:
        n = rec["step"] - prev_step
        if rec["step"] > warmup:
            window_ms.append(round(rec["step_time_s"] * 1000, 1))
            res.steps += n
            res.seconds += rec["step_time_s"] * n
            res.data_wait_s += rec["data_wait_s"] * n
            res.tokens += rec["tokens"] - prev_tokens
            res.final_loss = rec["loss"]
        prev_step, prev_tokens = rec["step"], rec["tokens"]
    if res.steps < steps:
        res.ok = False
        res.note = f"pack-train stopped after {res.steps} of {steps} timed steps" + (" (SIGTERM)" if stopped_by_sigterm else "")
    return res, window_ms


def best_hf_same_rows(results: Sequence[PathResult], precision: str | None = None) -> PathResult | None:
    """The fastest `hf-ffd*` path (the peer fed the same rows), of one precision class if given."""
    peers = [
        r
        for r in results
        if r.ok and r.tokens_per_s > 0 and r.path.startswith("hf-ffd") and (precision is None or precision_class(r.path) == precision)
    ]
    return max(peers, key=lambda r: r.tokens_per_s, default=None)


def markdown_table(results: Sequence[PathResult]) -> str:
    """Path, precision, tokens/s, step ms, peak GiB, MFU, attention share, data-wait %, ratios: against
    the HF peer fed the same rows (fastest of all, and of the path's precision), the best HF packed
    path and the best padding one."""
    ok = [r for r in results if r.ok and r.tokens_per_s > 0]
    best_hf = max((r.tokens_per_s for r in ok if r.path.startswith(("hf-flat", "hf-ffd"))), default=0.0)
    pad = max((r.tokens_per_s for r in ok if r.path.startswith("hf-pad")), default=0.0)
    same = best_hf_same_rows(results)

    def ratio(r: PathResult, base: float) -> str:
        return f"{r.tokens_per_s / base:.2f}" if base else "n/a"

    head = (
        "| path | precision | runner | tokens/step | tokens/s | step ms | peak GiB | MFU | HFU "
        "| attn FLOP share | data-wait % | x HF same rows | x HF same rows, same precision "
        "| x best HF packed | x best padding |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in results:
        if not r.ok:
            lines.append(f"| {r.path} | {precision_class(r.path)} | {r.runner} | skipped: {r.note} | | | | | | | | | | | |")
            continue
        peak = f"{r.peak_gib:.1f}" if r.peak_gib is not None else "n/a"
        same_precision = best_hf_same_rows(results, precision_class(r.path))
        lines.append(
            f"| {r.path} | {precision_class(r.path)} | {r.runner} | {r.tokens / max(r.steps, 1):,.0f} | "
            f"{r.tokens_per_s:,.0f} | {r.step_ms:.0f} | {peak} | {100 * r.mfu:.1f}% | "
            f"{100 * r.hfu:.1f}% | {100 * r.attn_share:.1f}% | {r.data_wait_pct:.2f} | "
            f"{ratio(r, same.tokens_per_s if same else 0)} | "
            f"{ratio(r, same_precision.tokens_per_s if same_precision else 0)} | "
            f"{ratio(r, best_hf)} | {ratio(r, pad)} |"
        )
    return "\n".join(lines)


def target_lines(results: Sequence[PathResult]) -> list[str]:
    """Issue 38's targets, checked against this run's numbers: every packlm-ffd path against the HF
    peer fed the same rows (all precisions, and its own); fp8 against bf16-weights of the same run;
    the bf16 ffd MFU; the packlm paths' data wait."""
    ok = [r for r in results if r.ok and r.tokens_per_s > 0]
    by_path = {r.path: r for r in ok}
    lines = []
    same = best_hf_same_rows(results)
    for r in ok:
        if split_path(r.path)[0] != "packlm-ffd" or same is None:
            continue
        own = best_hf_same_rows(results, precision_class(r.path))
        lines.append(
            f"{r.path} vs best HF same rows ({same.path}): {r.tokens_per_s / same.tokens_per_s:.2f}x"
            + (f"; vs same precision ({own.path}): {r.tokens_per_s / own.tokens_per_s:.2f}x" if own else "")
        )
    fp8, bf16 = by_path.get("packlm-ffd+fp8"), by_path.get("packlm-ffd+bf16-weights")
    if fp8 and bf16:
        x = fp8.tokens_per_s / bf16.tokens_per_s
        lines.append(
            f"packlm-ffd+fp8 vs packlm-ffd+bf16-weights: {x:.2f}x (target >= 1.25x on the 8B shape): {'MET' if x >= 1.25 else 'NOT MET'}"
        )
    if fp8 and same:
        x = fp8.tokens_per_s / same.tokens_per_s
        lines.append(f"packlm-ffd+fp8 vs best HF same rows: {x:.2f}x (target >= 1.3x): {'MET' if x >= 1.3 else 'NOT MET'}")
    bf16_ffd = [r for r in ok if split_path(r.path)[0] == "packlm-ffd" and precision_class(r.path) != "fp8"]
    if bf16_ffd:
        best = max(bf16_ffd, key=lambda r: r.mfu)
        mfu = 100 * best.mfu
        lines.append(f"{best.path} MFU {mfu:.1f}% (target >= 60% in bf16): {'MET' if mfu >= 60 else 'NOT MET'}")
    waits = [r for r in ok if r.path.startswith("packlm")]
    if waits:
        worst = max(waits, key=lambda r: r.data_wait_pct)
        lines.append(
            f"data-wait of packlm paths <= {worst.data_wait_pct:.2f}% of step time "
            f"(target < 1%): {'MET' if worst.data_wait_pct < 1 else 'NOT MET'}"
        )
    return lines
