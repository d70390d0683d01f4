"""The training loop: `train(config) -> summary`, single process, DDP or FSDP2 under torchrun
(what comes before the first step is `trainer.run.start`'s).

Loss normalisation: each optimizer step covers `grad_accum` micro-batches on each of `world_size`
ranks, or, stepping by group, one group a rank (the "window"). Its loss is the SUM of all token
losses in the window divided by the number of loss tokens in the whole window, the same value one
big batch would give, not a mean of per-micro-batch or per-rank means. The window's loss-token count
is known on the host before any forward pass (`MicroBatch.n_loss_tokens`), all-reduced once per
step, and every micro-batch backpropagates `loss_sum * world_size / window_tokens` (DDP and FSDP
average gradients over ranks, hence the `world_size`). This is what TRL 1.16's SFTTrainer trains
(transformers 5's Trainer with `average_tokens_across_devices=True`, its default: trainer.py
`_get_num_items_in_batch` gathers the loss-token count of every accumulated batch of every rank,
`compute_loss` multiplies the loss by the number of processes). Axolotl 0.19.0 sets
`average_tokens_across_devices=False` (core/builders/base.py, the training arguments), so each rank
divides by its own count and DDP averages the ranks' means: `--loss-average ranks` (its files' default)
backpropagates `loss_sum * world_size / (A * own_tokens)` instead, own_tokens the loss tokens of this
rank's data-parallel group (all its context-parallel shares) and A the groups that hold any (fewer
than all in an epoch's last step stepping by group). The logged loss is the window's token mean in
both.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch._functorch.config
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointError

from pipeline.contract import CHECKPOINTS, MERGED, Manifest, UserError, one_line, python_spelling
from trainer.config import TrainConfig, validate
from trainer.data.batch import MicroBatch
from trainer.data.stream import Cursor, loader_batches, step_cursor
from trainer.distributed.parallel import DistInfo, close_distributed, full_model_state, optimizer_state
from trainer.model.fp8 import refresh_fp8_weight_scales
from trainer.model.long_rows import PINNED, offload_activations
from trainer.model.lora import merged_model
from trainer.model.precision import MasterAdamW
from trainer.run import checkpoint as ckpt
from trainer.run import fit_check
from trainer.run.finite import FiniteWatch
from trainer.run.metrics import Meter, plot_losses, run_folder_lock, write_summary
from trainer.run.nesting import refuse_nested_run
from trainer.run.preempt import StopOnSigterm
from trainer.run.preflight import refuse_foreign_out
from trainer.run.start import start
from trainer.run.state import Run


@python_spelling(TrainConfig)
def train(config: TrainConfig, opened: tuple[Manifest, Any] | None = None) -> dict[str, Any]:
    """Run training as configured; returns (and on rank 0 writes to RUN_DIR/summary.json) a summary.
    The run folder is locked for the run's life: a second run on it stops in one line. `opened`:
    what `open_data(config)` returned, where the caller has checked the data already."""
    validate(config)
    refuse_foreign_out(config)  # before the lock, the first thing written into --out
    refuse_nested_run(config)
    # torch.compile partitions each compiled layer into forward and backward at its first step,
    # inside _train: the budget must be in force then
    with run_folder_lock(config.out), torch._functorch.config.patch(activation_memory_budget=config.activation_memory_budget):
        try:
            return _train(config, opened)
        except torch.OutOfMemoryError as exc:
            raise UserError(
                f"out of GPU memory ({one_line(exc, 110)}): lower --tokens-per-step, recompute activations "
                "with --grad-checkpointing [N] or keep fewer with --activation-memory-budget 0.7; for rows "
                "longer than that allows: --tile-mlp 8192, --offload-activations, or --context-parallel N "
                "over N GPUs; checkpoints saved before are intact (continue with --resume)"
            ) from None
        finally:
            gc.unfreeze()  # what freeze_heap set aside is the collector's again
            PINNED.clear()  # the offload's page-locked blocks go back to the host


def _train(config: TrainConfig, opened: tuple[Manifest, Any] | None = None) -> dict[str, Any]:
    run = start(config, opened)
    config = run.config  # with the device's defaults filled in
    info, device, optimizer = run.info, run.device, run.optimizer

    def window(micro: list[MicroBatch], real: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | int]:
        return backward_window(
            run.module,
            micro,
            device=device,
            autocast=run.autocast,
            info=info,
            fsdp=run.fsdp,
            masters=run.masters,
            offload=config.offload_activations,
            real=real,
            by_rank=config.loss_average == "ranks",
            context_parallel=config.context_parallel,
        )

    def zero_grad() -> None:  # DDP's gradients are views into its all-reduce buckets: zeroed in place, they stay so
        optimizer.zero_grad(set_to_none=run.fsdp or not info.enabled)

    if fit_check.applies(run):  # the largest micro-batch fits, measured before the first step
        fit_check.check_fits(run, lambda batch: window([batch]), zero_grad)
    max_norm = config.grad_clip if config.grad_clip > 0 else float("inf")
    step, position = run.start_step, run.cursor  # position: the data cursor after `step`
    last_loss: float | None = None
    last_eval: tuple[float, int] | None = None
    best = ckpt.best_checkpoint(run.out) if config.save_best and run.start_step else None  # across --resume
    last_path = run.resumed_from  # a resumed run: the checkpoint it continues is its last good one so far
    watch = FiniteWatch(device)
    stopping = False  # SIGTERM arrived (on any rank): save and stop after this step
    meter = Meter(
        run.out,
        config,
        rank=info.rank,
        world=info.world_size,
        device=device,
        shape=run.flop_shape,
        backend=run.backend,
        start_step=run.start_step,
        total_steps=run.total_steps,
        tokens_seen=run.tokens_seen,
    )
    if run.profiler is not None:
        run.profiler.after_step(step)  # starts it now if it profiles the first step of this run
    with StopOnSigterm() as sigterm, meter, loader_batches(run.loader) as batches:
        while step < run.stop_at:
            t0 = time.perf_counter()
            share = run.planner.step_share(position.epoch, position.step_in_epoch)
            micro = [next(batches) for _ in share.indices]
            wait = time.perf_counter() - t0
            loss_sum, counts, window_loss_tokens = window(micro, share.real)
            if run.masters is not None:  # the clipping itself happens inside its step
                grad_norm = run.masters.clip_grad_norm_(max_norm)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(run.wrapper.parameters(), max_norm)
            optimizer.step()
            if run.fp8_all_gather:
                refresh_fp8_weight_scales(run.module)
            lr = float(optimizer.param_groups[0]["lr"])  # the rate this step used (torchao's: a tensor)
            run.scheduler.step()
            zero_grad()
            epoch = position.epoch  # of this step
            step, position = step + 1, step_cursor(run.planner, position, 1)
            meter.step(micro[: share.real], wait, counts[1])
            watch.after_step(step, loss_sum)
            if step == run.start_step + 1:  # the layers and the optimizer are compiled now
                freeze_heap()
                if run.kept_attention is not None and not run.kept_attention.kept and info.rank == 0:
                    print(
                        f"pack-train: --keep-attention kept nothing: the {run.backend} kernel computes this model's "
                        "attention as several operations, so its layers recompute attention as without the option",
                        file=sys.stderr,
                    )
            if run.profiler is not None:
                run.profiler.after_step(step)

            at_log = step % config.log_every == 0 or step == run.stop_at
            stopping = sigterm.agreed(info.enabled, device, at_log) and step < run.stop_at
            if at_log or stopping:
                if run.hashes is not None:
                    run.hashes.raise_if_failed(info.enabled, device)
                watch.check(step, info.enabled, last_path)
                if info.enabled:
                    dist.all_reduce(loss_sum)
                last_loss = float(loss_sum) / float(window_loss_tokens)
                if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
                    grad_norm = grad_norm.full_tensor()
                meter.log(step, epoch, last_loss, lr, float(grad_norm))
            improved = False
            if run.evaluator is not None and (step == run.stop_at or stopping or (config.eval_every and step % config.eval_every == 0)):
                last_eval = run.evaluator(run.module, run.autocast)
                meter.log_eval(step, *last_eval)
                improved = config.save_best and (best is None or last_eval[0] < best["eval_loss"])
            scheduled = config.save_every and step % config.save_every == 0
            if scheduled or step == run.stop_at or stopping or improved:
                meter.count_tokens()
                watch.check(step, info.enabled, last_path, run.wrapper)
                last_path = save(run, step, position, meter.tokens_seen, last_loss)
            if improved:
                best = {"step": step, "eval_loss": last_eval[0], "checkpoint": last_path.name}
                if info.rank == 0:
                    ckpt.mark_best(run.out, step, last_eval[0], last_path)
            if stopping:
                break
    summary = finish(run, meter, step, last_loss, last_path, last_eval, best, stopped_by_sigterm=stopping)
    close_distributed(info)
    return summary


def freeze_heap() -> None:
    """Set every Python object alive now aside from the garbage collector (`gc.freeze`): the model,
    torch.compile's code and caches, hundreds of thousands of objects per rank once the first step
    has compiled a large model's layers. Python's full collection walks all of them whenever it
    runs (BENCHMARKS.md times it at 8B); in one process that is a pause the GPU's queue may hide,
    under torchrun one rank's pause holds every rank up at the next collective. Frozen, they are
    skipped; objects created later are collected as before. `train` hands them back
    (`gc.unfreeze`) when the run ends."""
    gc.collect()
    gc.freeze()


def _backward(loss: torch.Tensor) -> None:
    """`loss.backward()`, with torch's CheckpointError (a layer that activation checkpointing
    recomputed saved other tensors than its forward did) as one line. A compiled layer raises it
    when it is compiled again between its forward and its recompute and the new graph saves other
    tensors, as when the thread that recomputes starts with another thread count
    (`trainer.data.stream.make_loader` says how a pinning DataLoader caused that)."""
    try:
        loss.backward()
    except CheckpointError as exc:
        raise UserError(
            "a decoder layer that activation checkpointing recomputed saved other tensors than its forward "
            f"(torch's CheckpointError: {one_line(exc, 100)}); the compiled layer was most likely recompiled "
            "between the two: train with --no-compile or --grad-checkpointing 0, and please report it"
        ) from None


def backward_window(
    module: torch.nn.Module,
    micro: list[MicroBatch],
    *,
    device: torch.device,
    autocast: Any = None,
    info: DistInfo | None = None,
    fsdp: bool = False,
    masters: MasterAdamW | None = None,
    offload: bool = False,
    real: int | None = None,
    by_rank: bool = False,
    context_parallel: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | int]:
    """Forward + backward over one accumulation window; gradients of the window's mean token loss.

    Returns (sum of this rank's token losses, [loss tokens, tokens] of the window over all ranks,
    the window's loss-token count). Every micro-batch backpropagates loss_sum * world / N where N is
    the loss-token count of the whole window on all ranks, known before any forward pass; under
    torch.distributed it stays a device tensor (no host sync). Gradient sync happens only on the
    last micro-batch (DDP no_sync / FSDP set_requires_gradient_sync). With `masters` (--dtype
    bf16-weights, one process) and several micro-batches, each one's bf16 gradients move into the
    fp32 masters right after its backward, so they accumulate in fp32. `offload`: what each forward
    saves for its backward waits in CPU memory (`trainer.model.long_rows.offload_activations`).
    `real`: only the first `real` micro-batches count (default all); the others are fillers
    (`trainer.data.plan.StepShare`), backpropagated with weight 0 so that this rank still joins the
    step's collectives (its one synchronising backward, under FSDP every forward's gathering).
    `by_rank` (--loss-average ranks): the gradient of the mean of the data-parallel groups' own means
    (groups of `context_parallel` neighbouring ranks), over the groups with loss tokens.
    """
    info = info or DistInfo()
    autocast = autocast if autocast is not None else contextlib.nullcontext()
    real = len(micro) if real is None else real
    counts = torch.tensor([sum(b.n_loss_tokens for b in micro[:real]), sum(b.n_tokens for b in micro[:real])], dtype=torch.int64)
    window_loss_tokens: torch.Tensor | int
    if info.enabled:
        each = torch.zeros(2 + info.world_size, dtype=torch.int64)  # [loss tokens, tokens, each rank's loss tokens]
        each[:2], each[2 + info.rank] = counts, counts[0]
        each = each.to(device)
        dist.all_reduce(each)  # one collective for both averages
        counts, window_loss_tokens = each[:2], each[0].clamp(min=1)
        if by_rank:
            groups = each[2:].view(-1, context_parallel).sum(dim=1)  # loss tokens of each data-parallel group
            own = groups[info.rank // context_parallel].clamp(min=1)
            scale = info.world_size / ((groups > 0).sum().clamp(min=1) * own).to(torch.float32)
        else:
            scale = info.world_size / window_loss_tokens.to(torch.float32)
    else:
        window_loss_tokens = max(1, int(counts[0]))
        scale = 1.0 / window_loss_tokens
    loss_acc = torch.zeros((), dtype=torch.float32, device=device)
    for i, batch in enumerate(micro):
        last = i == len(micro) - 1
        batch = batch.to(device, non_blocking=True)
        if fsdp:
            module.set_requires_gradient_sync(last)
            sync: Any = contextlib.nullcontext()
        elif info.enabled and not last:
            sync = module.no_sync()
        else:
            sync = contextlib.nullcontext()
        with sync:
            with autocast, offload_activations(offload, device):
                loss_sum = module(batch)
            _backward(loss_sum * (scale if i < real else 0.0))
        if masters is not None and len(micro) > 1:
            masters.collect_grads()
        if i < real:
            loss_acc += loss_sum.detach().float()
    return loss_acc, counts, window_loss_tokens


# ------------------------------------------------------------------------- checkpoints and the summary


def save(run: Run, step: int, cursor: Cursor, tokens_seen: int, loss: float | None) -> Path:
    """Write the checkpoint of `step` (every rank takes part), once every shard is known intact."""
    info = run.info
    if run.hashes is not None:
        run.hashes.wait(info.enabled, run.device)
    model_state = None  # unsharded: save_pretrained reads the model itself (on rank 0)
    if run.fsdp:  # collective: every rank takes part in gathering the full state
        model_state = {k.removeprefix("model."): v for k, v in full_model_state(run.wrapper).items()}
    trainer_state = {
        "step": step,
        "cursor": cursor.to_dict(),
        "tokens_seen": tokens_seen,
        "loss": loss,
        "config": {**asdict(run.config), "world_size": info.world_size},
        "data": run.fingerprint,
        "attention": run.backend,
        "total_steps": run.total_steps,
    }
    writes_optimizer = run.fsdp or info.rank == 0  # under FSDP every rank helps gather it
    with full_precision(run):  # the fp32 masters of --dtype bf16-weights, not their bf16 copies
        return ckpt.save_checkpoint(
            run.out,
            step,
            model=run.peft if run.peft is not None else run.model,
            model_state=model_state,
            optimizer_state=optimizer_state(run.wrapper, run.optimizer, run.fsdp) if writes_optimizer else None,
            scheduler_state=run.scheduler.state_dict(),
            trainer_state=trainer_state,
            tokenizer=run.tokenizer,
            rank=info.rank,
            barrier=info.barrier,
            keep_last=run.config.keep_last,
        )


def full_precision(run: Run) -> contextlib.AbstractContextManager:
    """While saving: the model holds the fp32 masters of --dtype bf16-weights (else as it is)."""
    return run.masters.full_precision() if run.masters is not None else contextlib.nullcontext()


def finish(
    run: Run,
    meter: Meter,
    step: int,
    last_loss: float | None,
    last_path: Path | None,
    last_eval: tuple[float, int] | None = None,
    best: dict[str, Any] | None = None,
    *,
    stopped_by_sigterm: bool,
) -> dict[str, Any]:
    """The run's summary, written with each rank's own record (then a barrier)."""
    elapsed = time.perf_counter() - meter.run_start
    info = run.info
    summary = {
        "steps": step,
        "total_steps": run.total_steps,
        "tokens": meter.tokens_seen,
        "tokens_this_run": meter.run_tokens,
        "tokens_per_s": meter.run_tokens / max(elapsed, 1e-9),
        **meter.flop_rates(meter.run_flops, elapsed),  # mfu, tflops, hfu, attn_flop_share of the run
        "final_loss": last_loss,
        "eval_loss": last_eval[0] if last_eval else None,
        "eval_ppl": math.exp(min(last_eval[0], 700)) if last_eval else None,
        "eval_loss_tokens": last_eval[1] if last_eval else None,
        "best_checkpoint": str(run.out / CHECKPOINTS / best["checkpoint"]) if best else None,
        "best_eval_loss": best["eval_loss"] if best else None,
        "attention": run.backend,
        "compiled": run.compiled,
        "params": run.n_params,
        "world_size": info.world_size,
        "elapsed_s": elapsed,
        "checkpoint": str(last_path) if last_path else None,
        "stopped_by_sigterm": stopped_by_sigterm,  # on every rank, when any rank got SIGTERM
        "rank": info.rank,
    }
    if info.rank == 0:
        plot_losses(run.out)
        if run.config.merge_lora and not stopped_by_sigterm:
            with full_precision(run):
                summary["merged_model"] = str(save_merged(run))
    write_summary(
        run.out,
        summary,
        {
            "rank": info.rank,
            "world_size": info.world_size,
            "steps": step - run.start_step,
            "micro_batches": meter.local_micro_batches,
            "tokens": meter.local_tokens,
        },
    )
    info.barrier()
    return summary


def save_merged(run: Run) -> Path:
    """RUN/merged: the base model with the adapters merged in, saved as a full Hugging Face model with
    the tokenizer, whole or not at all (`write_folder_atomic`: a full disk or a kill -9 leaves no
    half-written folder)."""
    merged, out = merged_model(run.peft), run.out / MERGED

    def write(folder: Path) -> None:
        merged.save_pretrained(folder, safe_serialization=True)
        if run.tokenizer is not None:
            run.tokenizer.save_pretrained(folder)

    ckpt.write_folder_atomic(
        out,
        write,
        "free some space; the run's last checkpoint holds the adapter, which peft "
        "merges into the base: PeftModel.from_pretrained(base, CHECKPOINT/model).merge_and_unload()",
    )
    return out
