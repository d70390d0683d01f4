"""packlm paths through the product's own loop (`trainer.run.loop.train`, what `pack-train` runs),
read back from its metrics.jsonl, or through the equivalent inline loop in this process
(`run_packed_inline`): the paths' shared setup, pack-train's own step plan (which rows a step
takes), checkpoint writes patched out, and where a profile's trace goes."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.report.flops import ModelShape
from pipeline.shards import iter_rows, read_manifest

from .machine import cuda_peak_gib, free_memory, reset_cuda_peak
from .packing import ffd_steps
from .train_results import H100_BF16_TFLOPS, PathResult, finish_result, loss_tokens_of, n_params_of, packed_dtype, split_path, timed_result
from .training import make_optimizer

# bench_train.py's defaults of the options `run_packed_pack_train` reads besides a run's own (model,
# steps, warmup, max_len, ffd_tokens, workdir): a script that runs packlm paths without bench_train's
# command line starts from these
PACKED_RUN_DEFAULTS = dict(
    lr=1e-4,
    attn="auto",
    dtype="bf16",
    fp8_recipe="rowwise_with_gw_hp",
    compile=False,
    lora_r=0,
    grad_checkpointing=0,
    optimizer="adamw",
    activation_memory_budget=1.0,
    num_workers=2,
    profile_steps=0,
    profile_trace=None,
    peak_tflops=H100_BF16_TFLOPS,
    seed=0,
)


@dataclass
class Setup:
    """Everything the paths share."""

    args: argparse.Namespace
    device: torch.device
    folders: dict[str, Path]
    groups: list[list[dict[str, np.ndarray]]]  # minibatch rows per group
    group_ids: list[list[int]]
    examples: dict[int, dict[str, np.ndarray]]
    pad_id: int
    vocab_size: int
    shape: ModelShape | None = None  # the model as the FLOP count sees it (`flop_shape`)


def trace_path(a: argparse.Namespace, path: str) -> Path | None:
    """Where --profile-trace puts the Chrome trace of `path`'s profiled steps (gzipped), if asked."""
    if not (a.profile_trace and a.profile_steps):
        return None
    Path(a.profile_trace).mkdir(parents=True, exist_ok=True)
    return Path(a.profile_trace) / f"{path.replace('+', '_')}.json.gz"


def plan_step_rows(
    folder: Path, tokens_per_step: int, seed: int, count: int, first: int = 0, *, world_size: int = 1, rank: int = 0
) -> list[list[dict[str, np.ndarray]]]:
    """The rows of optimizer steps first..first+count-1 that rank `rank` of pack-train's
    `world_size` data-parallel ranks takes from `folder` (grad_accum 1), in its order: the same
    deterministic `trainer.data.stream.Planner` plan."""
    from trainer.data.stream import Cursor, Planner, row_lengths, step_cursor

    manifest = read_manifest(folder)
    planner = Planner(row_lengths(folder, manifest), tokens_per_step, seed=seed, world_size=world_size)
    rows = list(iter_rows(folder))
    steps = []
    for k in range(first, first + count):
        cur = step_cursor(planner, Cursor(), k)
        steps.append([rows[int(i)] for i in planner.local_rows(cur.epoch, cur.step_in_epoch, rank)])
    return steps


def step_seq_lens_of_plan(folder: Path, tokens_per_step: int, seed: int, first: int, count: int) -> tuple[np.ndarray, int]:
    """Example lengths and real tokens of optimizer steps first..first+count-1 that pack-train takes
    (`plan_step_rows`)."""
    lens = [r["seq_lens"] for rows in plan_step_rows(folder, tokens_per_step, seed, count, first) for r in rows]
    out = np.concatenate(lens).astype(np.int64) if lens else np.zeros(0, np.int64)
    return out, int(out.sum())


@contextmanager
def no_checkpoint_writes() -> Iterator[None]:
    """pack-train always saves a checkpoint at its last step; a benchmark does not need the ~12 GB
    (1B params + AdamW state) on disk, so the harness replaces `trainer.run.loop.save` with a no-op
    (an AttributeError here if that function is renamed, never a silent save). The timed steps are
    untouched."""
    from unittest import mock

    from trainer.run import loop

    with mock.patch.object(loop, "save", lambda *args, **kwargs: None):
        yield


def run_packed_pack_train(path: str, s: Setup) -> PathResult:
    """A packlm path through the product's own loop (`trainer.run.loop.train`, what `pack-train` runs),
    read back from its metrics.jsonl. Steps 1..W are warmup; the timed region is W+1..W+S."""
    from trainer import TrainConfig, train

    a = s.args
    base, tunings = split_path(path)
    folder = s.folders["minibatch" if base == "packlm-minibatch" else "ffd"]
    # minibatch: a 32-example group fills about one max_len row, and a step of <= max_len tokens
    # then takes one whole group; ffd: --ffd-tokens of whole rows per step.
    tokens_per_step = a.max_len if base == "packlm-minibatch" else a.ffd_tokens
    run_dir = Path(tempfile.mkdtemp(prefix=f"{path}-", dir=a.workdir))
    log_every = a.warmup if a.warmup > 0 else a.steps
    if a.profile_steps and (a.warmup + a.steps) % log_every:
        raise ValueError(
            "--profile-steps with pack-train paths: --steps must be a multiple of --warmup (the timed region then ends on a metrics line)"
        )
    config = TrainConfig(
        data=str(folder),
        model=a.model,
        out=str(run_dir),
        tokens_per_step=tokens_per_step,
        grad_accum=1,
        lr=a.lr,
        warmup=0,
        schedule="constant",
        max_steps=a.warmup + a.steps + a.profile_steps,
        attn=a.attn,
        dtype=packed_dtype(tunings, a.dtype),
        fp8_recipe=a.fp8_recipe,
        compile=a.compile,
        qlora="qlora" in tunings,
        seed=a.seed,
        log_every=log_every,
        profile_steps=f"{a.warmup + a.steps + 1}-{a.warmup + a.steps + a.profile_steps}" if a.profile_steps else None,
        lora_r=a.lora_r,
        grad_checkpointing=a.grad_checkpointing,
        optimizer=a.optimizer,
        activation_memory_budget=a.activation_memory_budget,
        device=str(s.device),
        progress=False,
        num_workers=a.num_workers,
        peak_flops=a.peak_tflops * 1e12,
    )
    reset_cuda_peak(s.device)
    try:
        with no_checkpoint_writes():
            summary = train(config)
    finally:
        free_memory(s.device)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [rec for rec in records if rec["step"] <= a.warmup + a.steps]  # not the profiled ones
    res, window_ms = timed_result(
        path,
        f"pack-train/{summary.get('attention')}",
        records,
        a.warmup,
        a.steps,
        stopped_by_sigterm=bool(summary.get("stopped_by_sigterm")),
    )
    if a.profile_steps:  # pack-train --profile-steps wrote them (trainer.run.profiling)
        res.extra["profile"] = json.loads((run_dir / "profile" / "rank0.json").read_text())
        trace = trace_path(a, path)
        if trace is not None:
            shutil.copyfile(run_dir / "profile" / "rank0.trace.json.gz", trace)
    res.peak_gib = records[-1]["peak_mem_gib"] if s.device.type == "cuda" else None
    lens, planned_tokens = step_seq_lens_of_plan(folder, tokens_per_step, a.seed, a.warmup, res.steps)
    if planned_tokens != res.tokens:
        res.note = "; ".join(filter(None, [res.note, f"planned {planned_tokens} tokens but pack-train counted {res.tokens}"]))
    res.examples = len(lens)
    res.loss_tokens = loss_tokens_of(
        [r["labels"] for rows in plan_step_rows(folder, tokens_per_step, a.seed, res.steps, a.warmup) for r in rows]
    )
    n_params = int(summary["params"])
    finish_result(res, shape=s.shape, lens=lens, peak_tflops=a.peak_tflops)
    res.extra.update(
        n_params=n_params, tokens_per_step=tokens_per_step, pack_train_mfu_last=records[-1].get("mfu"), step_ms_per_metrics_window=window_ms
    )
    shutil.rmtree(run_dir, ignore_errors=True)
    return res


def finish_path(res: PathResult, lens: np.ndarray, s: Setup, *, path: str, runner: str, n_params: int) -> PathResult:
    """Label a timed path and fill in peak memory, MFU and attention FLOPs."""
    res.path, res.runner = path, runner
    res.peak_gib = cuda_peak_gib(s.device)
    finish_result(res, shape=s.shape, lens=lens, peak_tflops=s.args.peak_tflops)
    res.extra["n_params"] = n_params
    return res


def packed_step_rows(path: str, s: Setup) -> list[list[dict[str, np.ndarray]]]:
    """The micro-batches of a packlm path: minibatch groups, or ffd rows cut by --ffd-tokens."""
    if split_path(path)[0] == "packlm-minibatch":
        return s.groups
    return ffd_steps(s.folders["ffd"], s.args.ffd_tokens)


def run_packed_inline(path: str, s: Setup) -> PathResult:
    """A packlm path in this process: build_model + collate_rows + packed_loss, fused AdamW."""
    from trainer.model.load import build_model, compile_decoder_layers

    from .train_steps import packed_batches, packed_step_fn, timed_loop

    a = s.args
    if a.lora_r or a.grad_checkpointing or split_path(path)[1]:
        raise ValueError("the inline runner has no --lora-r / --grad-checkpointing / +bf16-weights: use --packed-runner pack-train")
    reset_cuda_peak(s.device)
    model, backend = build_model(a.model, attn=a.attn, device=s.device, dtype=torch.float32, vocab_size=s.vocab_size, seed=a.seed)
    model.train()
    if a.compile:  # as pack-train --compile does
        compile_decoder_layers(model)
    opt = make_optimizer(model, a.lr, s.device, a.optimizer)
    n_params = n_params_of(model)
    try:
        res, lens = timed_loop(
            packed_batches(packed_step_rows(path, s), s.device),
            packed_step_fn(model, opt, s.device, a.dtype, a.compile),
            warmup=a.warmup,
            steps=a.steps,
            device=s.device,
            profile_steps=a.profile_steps,
            trace=trace_path(a, path),
        )
    finally:
        del model, opt
        free_memory(s.device)
    return finish_path(res, lens, s, path=path, runner=f"inline/{backend}", n_params=n_params)


def run_packed_path(path: str, s: Setup) -> PathResult:
    """A packlm path through `pack-train`'s loop, or the equivalent inline loop."""
    if s.args.packed_runner == "pack-train":
        return run_packed_pack_train(path, s)
    return run_packed_inline(path, s)
