"""The training loop: `train(config) -> summary`, single process, DDP or FSDP2 under torchrun.

Loss normalisation: each optimizer step covers `grad_accum` micro-batches on each of `world_size`
ranks (the "window"). Its loss is the SUM of all token losses in the window divided by the number
of loss tokens in the whole window, the same value one big batch would give, not a mean of
per-micro-batch means. The window's loss-token count is known on the host before any forward pass
(`MicroBatch.n_loss_tokens`), all-reduced once per step, and every micro-batch backpropagates
`loss_sum * world_size / window_tokens` (DDP and FSDP average gradients over ranks, hence the
`world_size`).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers

from pipeline.api_errors import python_spelling
from pipeline.errors import UserError
from pipeline.shards import Manifest
from pipeline.shards import manifest_vocab
from trainer import checkpoint as ckpt
from trainer.attention import select_backend
from trainer.batch import MicroBatch
from trainer.config import TrainConfig, resolved, validate
from trainer.evaluate import Evaluator, held_out_folder
from trainer.lora import add_lora, freeze_in_bf16, merge_and_save
from trainer.integrity import ShardHashCheck
from trainer.loss import LossModule
from trainer.metrics import Meter, plot_losses, run_folder_lock, start_run_files, write_summary
from trainer.model import count_params, decoder_layers, enable_grad_checkpointing, load_model, prepare
from trainer.optim import make_optimizer
from trainer.fp8 import check_fp8, recipe_note, to_float8
from trainer.precision import MasterAdamW
from trainer.parallel import (
    DistInfo,
    close_distributed,
    full_model_state,
    optimizer_state,
    pick_device,
    seed_everything,
    setup_distributed,
    wrap_parallel,
)
from trainer.preempt import StopOnSigterm
from trainer.resume import checkpoint_to_resume, load_training_state, resume_model
from trainer.stream import (
    Cursor,
    CursorSampler,
    MicroBatchDataset,
    Planner,
    ShardReader,
    data_fingerprint,
    loader_batches,
    make_loader,
    open_data,
    step_cursor,
)


@python_spelling(TrainConfig)
def train(config: TrainConfig, opened: tuple[Manifest, Any] | None = None) -> dict[str, Any]:
    """Run training as configured; returns (and on rank 0 writes to RUN_DIR/summary.json) a summary.
    The run folder is locked for the run's life: a second run on it stops in one line. `opened`:
    what `open_data(config)` returned, where the caller has checked the data already."""
    with run_folder_lock(config.out):
        return _train(config, opened)


def _train(config: TrainConfig, opened: tuple[Manifest, Any] | None = None) -> dict[str, Any]:
    run = start(config, opened)
    config = run.config  # with the device's defaults filled in
    info, device, optimizer = run.info, run.device, run.optimizer
    max_norm = config.grad_clip if config.grad_clip > 0 else float("inf")
    step, position = run.start_step, run.cursor  # position: the data cursor after `step`
    last_loss: float | None = None
    last_eval: tuple[float, int] | None = None
    best = ckpt.best_checkpoint(run.out) if config.save_best and run.start_step else None  # across --resume
    last_path: Path | None = None
    stopping = False  # SIGTERM arrived (on any rank): save and stop after this step
    meter = Meter(run.out, config, rank=info.rank, world=info.world_size, device=device,
                  n_params=run.n_params, backend=run.backend, start_step=run.start_step,
                  total_steps=run.total_steps, tokens_seen=run.tokens_seen)
    with StopOnSigterm() as sigterm, meter, loader_batches(run.loader) as batches:
        while step < run.stop_at:
            t0 = time.perf_counter()
            micro = [next(batches) for _ in range(config.grad_accum)]
            wait = time.perf_counter() - t0
            loss_sum, counts, window_loss_tokens = backward_window(
                run.module, micro, device=device, autocast=run.autocast, info=info, fsdp=run.fsdp,
                masters=run.masters,
            )
            if run.masters is not None:  # the clipping itself happens inside its step
                grad_norm = run.masters.clip_grad_norm_(max_norm)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(run.wrapper.parameters(), max_norm)
            optimizer.step()
            lr = optimizer.param_groups[0]["lr"]  # the rate this step used
            run.scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            epoch = position.epoch  # of this step
            step, position = step + 1, step_cursor(run.planner, position, 1)
            meter.step(micro, wait, counts[1])

            at_log = step % config.log_every == 0 or step == run.stop_at
            stopping = sigterm.agreed(info.enabled, device, at_log) and step < run.stop_at
            if at_log or stopping:
                if run.hashes is not None:
                    run.hashes.raise_if_failed(info.enabled, device)
                if info.enabled:
                    dist.all_reduce(loss_sum)
                last_loss = float(loss_sum) / float(window_loss_tokens)
                if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
                    grad_norm = grad_norm.full_tensor()
                meter.log(step, epoch, last_loss, lr, float(grad_norm))
            improved = False
            if run.evaluator is not None and (step == run.stop_at or stopping or
                                              (config.eval_every and step % config.eval_every == 0)):
                last_eval = run.evaluator(run.module, run.autocast)
                meter.log_eval(step, *last_eval)
                improved = config.save_best and (best is None or last_eval[0] < best["eval_loss"])
            scheduled = config.save_every and step % config.save_every == 0
            if scheduled or step == run.stop_at or stopping or improved:
                meter.count_tokens()
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


def backward_window(
    module: torch.nn.Module,
    micro: list[MicroBatch],
    *,
    device: torch.device,
    autocast: Any = None,
    info: DistInfo | None = None,
    fsdp: bool = False,
    masters: MasterAdamW | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | int]:
    """Forward + backward over one accumulation window; gradients of the window's mean token loss.

    Returns (sum of this rank's token losses, [loss tokens, tokens] of the window over all ranks,
    the window's loss-token count). Every micro-batch backpropagates loss_sum * world / N where N is
    the loss-token count of the whole window on all ranks, known before any forward pass; under
    torch.distributed it stays a device tensor (no host sync). Gradient sync happens only on the
    last micro-batch (DDP no_sync / FSDP set_requires_gradient_sync). With `masters` (--dtype
    bf16-weights, one process) and several micro-batches, each one's bf16 gradients move into the
    fp32 masters right after its backward, so they accumulate in fp32.
    """
    info = info or DistInfo()
    autocast = autocast if autocast is not None else contextlib.nullcontext()
    counts = torch.tensor(
        [sum(b.n_loss_tokens for b in micro), sum(b.n_tokens for b in micro)], dtype=torch.int64
    )
    window_loss_tokens: torch.Tensor | int
    if info.enabled:
        counts = counts.to(device)
        dist.all_reduce(counts)
        window_loss_tokens = counts[0].clamp(min=1)
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
            with autocast:
                loss_sum = module(batch)
            (loss_sum * scale).backward()
        if masters is not None and len(micro) > 1:
            masters.collect_grads()
        loss_acc += loss_sum.detach().float()
    return loss_acc, counts, window_loss_tokens


# ------------------------------------------------------------------------- before and after the loop


# precisions whose weights are bf16 over fp32 masters in one process (trainer.precision)
MASTER_DTYPES = ("bf16-weights", "fp8")


@dataclass
class Run:
    """What `start` builds, and checks, before the first step."""

    config: TrainConfig
    info: DistInfo
    fsdp: bool  # --parallel fsdp under torchrun
    device: torch.device
    autocast: Any  # bf16 autocast, or a null context for fp32
    masters: MasterAdamW | None  # --dtype bf16-weights (not under FSDP): the optimizer, with fp32 masters
    out: Path
    planner: Planner
    total_steps: int  # the schedule's length
    stop_at: int  # the last step of this run (--stop-at)
    start_step: int
    cursor: Cursor  # the data cursor after start_step
    tokens_seen: int
    fingerprint: dict  # of the data, recorded in checkpoints
    hashes: ShardHashCheck | None
    tokenizer: Any
    model: transformers.PreTrainedModel  # plain, as save_pretrained writes it
    peft: Any  # with --lora-r: the PeftModel around `model` (checkpoints hold its adapter), else None
    wrapper: LossModule  # the model with the loss as its forward (what the optimizer updates)
    module: torch.nn.Module  # the wrapper as the step calls it: itself, or DDP around it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loader: torch.utils.data.DataLoader
    evaluator: Evaluator | None  # the held-out folder's loss (--eval-data)
    backend: str
    compiled: bool
    n_params: int


def start(config: TrainConfig, opened: tuple[Manifest, Any] | None = None) -> Run:
    """Everything before the first step: device and ranks, the checkpoint to resume, the data, the
    model (proven to train on packed rows), its wrapper, optimizer and data loader. Rank 0 writes
    the run folder only once all of it has been checked."""
    validate(config)
    device = pick_device(config.device)
    config = resolved(config, device.type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    info = setup_distributed(device)
    seed_everything(config.seed + info.rank)
    dtype_name = config.dtype if config.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    bf16 = dtype_name != "fp32"  # bf16 or bf16-weights
    if info.enabled:
        _refuse_under_torchrun(config, dtype_name)
    if dtype_name == "fp8":
        check_fp8(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    transformers.utils.logging.disable_progress_bar()
    resume_from = checkpoint_to_resume(config, info)

    manifest, tokenizer = opened if opened is not None else open_data(config)
    eval_folder = held_out_folder(config, manifest)
    reader = ShardReader(config.data, manifest)  # mapped now: every row trained on comes from these files
    planner = Planner(reader.row_lengths(), config.tokens_per_step, seed=config.seed,
                      world_size=info.world_size, grad_accum=config.grad_accum)
    total_steps = _total_steps(config, planner)
    stop_at = min(total_steps, config.stop_at) if config.stop_at else total_steps
    fingerprint = data_fingerprint(config.data, manifest)
    hashes = (ShardHashCheck(config.data, manifest, info.rank, info.world_size, reader.identities)
              if config.verify_hashes else None)
    model, backend, backend_why = _model(config, device, manifest)
    n_params = count_params(model)
    peft = add_lora(model, config) if config.lora_r else None  # adapters injected into `model` itself
    if peft is not None and bf16:
        freeze_in_bf16(model)  # frozen base weights need no fp32 copy: half their memory

    start_step, cursor, tokens_seen = 0, Cursor(), 0
    if resume_from is not None:
        start_step, cursor, tokens_seen = resume_model(resume_from, model, config, info.world_size,
                                                       fingerprint, stop_at, peft)
    fsdp = info.enabled and config.parallel == "fsdp"
    if dtype_name == "fp8":  # after resume and LoRA, before compile and sharding (trainer.fp8)
        to_float8(model, config.fp8_recipe, decoder_layers(model))
    compiled = config.compile if config.compile is not None else device.type == "cuda"
    wrapper, module = _wrap(model, config, info, fsdp=fsdp, compiled=compiled, bf16=bf16)
    # after resume (the masters start from its fp32 weights); under FSDP, plain bf16 already computes
    # with bf16 weights over fp32 shards (FSDP2's mixed precision), so bf16-weights is the same
    optimizer, scheduler = make_optimizer(wrapper.parameters(), config, device, total_steps,
                                          master_weights=dtype_name in MASTER_DTYPES and not info.enabled)
    masters = optimizer if isinstance(optimizer, MasterAdamW) else None
    if resume_from is not None:
        load_training_state(resume_from, module=wrapper, optimizer=optimizer, scheduler=scheduler,
                            total_steps=total_steps, rank=info.rank, fsdp=fsdp)
    loader = make_loader(
        MicroBatchDataset(reader, planner, info.rank),
        CursorSampler(planner, cursor, max(stop_at - start_step, 0)),
        num_workers=config.num_workers, pin_memory=device.type == "cuda", prefetch_factor=config.prefetch,
    )
    evaluator = None
    if eval_folder is not None:
        evaluator = Evaluator(eval_folder, manifest, config.tokens_per_step, info, device)
    run = Run(config=config, info=info, fsdp=fsdp, device=device, autocast=autocast, masters=masters,
              out=Path(config.out), planner=planner, total_steps=total_steps, stop_at=stop_at,
              start_step=start_step, cursor=cursor, tokens_seen=tokens_seen, fingerprint=fingerprint,
              hashes=hashes, tokenizer=tokenizer, model=model, peft=peft, wrapper=wrapper, module=module,
              optimizer=optimizer, scheduler=scheduler, loader=loader, evaluator=evaluator,
              backend=backend, compiled=compiled, n_params=n_params)
    if info.rank == 0:
        start_run_files(run.out, config, info.world_size, start_step if resume_from is not None else None)
        _announce(run, manifest, dtype_name, backend_why)
    return run


def _refuse_under_torchrun(config: TrainConfig, dtype_name: str) -> None:
    """One line for an option that does not combine with the data-parallel mode."""
    if dtype_name in MASTER_DTYPES and config.parallel != "fsdp":
        raise UserError(f"--dtype {dtype_name} under torchrun needs --parallel fsdp (FSDP2 computes with "
                        "bf16 weights over fp32 shards); DDP would average the gradients in bf16")
    if config.optimizer == "adafactor" and config.parallel == "fsdp":
        raise UserError("--optimizer adafactor is not supported with --parallel fsdp: its row and column "
                        "statistics would cover each rank's shard, not the whole matrix; use --parallel ddp")


def _model(
    config: TrainConfig, device: torch.device, manifest: Manifest
) -> tuple[transformers.PreTrainedModel, str, str]:
    """The model, proven to train on packed rows, its attention backend and why that one."""
    vocab = manifest_vocab(manifest.tokenizer)
    if config.attn != "auto":  # an impossible request fails before any model is loaded
        select_backend(config.attn, device)
    model = load_model(config.model, device=device, dtype=torch.float32, vocab_size=vocab, seed=config.seed)
    backend, why = prepare(model, config.attn, device)
    emb = model.get_input_embeddings().num_embeddings
    if vocab is not None and int(vocab) > emb:
        raise UserError(f"the data's tokenizer has {vocab} tokens but the model embeds only {emb}")
    return model, backend, why


def _wrap(
    model: transformers.PreTrainedModel, config: TrainConfig, info: DistInfo, *, fsdp: bool,
    compiled: bool, bf16: bool,
) -> tuple[LossModule, torch.nn.Module]:
    """The model with the loss as its forward, and that wrapper as the step calls it (DDP, FSDP2
    or itself); decoder layers recompute activations and are compiled where asked, and so is
    the loss of each chunk of tokens, except under FSDP (whose hooks on the output head's sharded
    weight torch.compile would have to trace)."""
    if config.grad_checkpointing:
        enable_grad_checkpointing(model, every=int(config.grad_checkpointing))
    layers = decoder_layers(model)
    if compiled:
        # a model with per-layer attention kinds (config.layer_types) compiles the attention call
        # once per layer index: room for every layer before dynamo falls back to running it eagerly
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, len(layers) + 8)
        for layer in layers:
            layer.compile(dynamic=True)
    wrapper = LossModule(model, compiled=compiled and not fsdp)
    module = wrap_parallel(wrapper, layers, info, fsdp=fsdp, bf16=bf16, reduce_bf16=config.grad_reduce == "bf16",
                           reshard_after_forward=config.reshard_after_forward)
    return wrapper, module


def _total_steps(config: TrainConfig, planner: Planner) -> int:
    """The schedule's length: --max-steps, or --epochs (1) of steps, whichever ends first."""
    if config.max_steps is not None:
        total = config.max_steps
        if config.epochs is not None:
            total = min(total, sum(planner.steps_in_epoch(e) for e in range(config.epochs)))
    else:
        total = sum(planner.steps_in_epoch(e) for e in range(config.epochs or 1))
    if total < 1:
        raise UserError(
            f"no complete optimizer step fits the data: one step needs {planner.group} micro-batches "
            f"(world_size x grad_accum) of up to {planner.tokens_per_step} tokens; lower "
            "--tokens-per-step or --grad-accum"
        )
    return total


def _announce(run: Run, manifest: Manifest, dtype_name: str, backend_why: str) -> None:
    """The start-up lines on stderr: model, attention, data and steps."""
    config, world = run.config, run.info.world_size
    print(
        f"pack-train: {run.n_params / 1e6:.1f}M params, attention {run.backend}, {dtype_name}, "
        f"{world} rank(s) ({config.parallel if run.info.enabled else 'single'}), "
        f"{manifest.rows} rows / {manifest.total_tokens} tokens, {run.total_steps} steps of "
        f"{config.grad_accum} x {world} micro-batches <= {config.tokens_per_step} tokens"
        + (f", resuming at step {run.start_step}" if config.resume else ""),
        file=sys.stderr,
    )
    print(f"pack-train: attention {backend_why}", file=sys.stderr)
    if dtype_name == "fp8":
        print(f"pack-train: {recipe_note(config.fp8_recipe)}", file=sys.stderr)
    plan = run.planner.plan(run.cursor.epoch)
    if plan.n_long_rows:
        print(f"pack-train: {plan.n_long_rows} rows are longer than --tokens-per-step and each "
              "becomes a micro-batch of its own", file=sys.stderr)
    if plan.n_dropped_microbatches:
        print(f"pack-train: each epoch drops its last {plan.n_dropped_microbatches} micro-batch(es) "
              "so every rank takes the same number of steps", file=sys.stderr)


def save(run: Run, step: int, cursor: Cursor, tokens_seen: int, loss: float | None) -> Path:
    """Write the checkpoint of `step` (every rank takes part), once every shard is known intact."""
    info = run.info
    if run.hashes is not None:
        run.hashes.wait(info.enabled, run.device)
    model_state = None  # unsharded: save_pretrained reads the model itself (on rank 0)
    if run.fsdp:  # collective: every rank takes part in gathering the full state
        model_state = {k.removeprefix("model."): v for k, v in full_model_state(run.wrapper).items()}
    trainer_state = {
        "step": step, "cursor": cursor.to_dict(), "tokens_seen": tokens_seen, "loss": loss,
        "config": {**asdict(run.config), "world_size": info.world_size}, "data": run.fingerprint,
        "attention": run.backend, "total_steps": run.total_steps,
    }
    writes_optimizer = run.fsdp or info.rank == 0  # under FSDP every rank helps gather it
    with full_precision(run):  # the fp32 masters of --dtype bf16-weights, not their bf16 copies
        return ckpt.save_checkpoint(
            run.out, step, model=run.peft if run.peft is not None else run.model, model_state=model_state,
            optimizer_state=optimizer_state(run.wrapper, run.optimizer, run.fsdp) if writes_optimizer else None,
            scheduler_state=run.scheduler.state_dict(), trainer_state=trainer_state,
            tokenizer=run.tokenizer, rank=info.rank, barrier=info.barrier, keep_last=run.config.keep_last,
        )


def full_precision(run: Run) -> contextlib.AbstractContextManager:
    """While saving: the model holds the fp32 masters of --dtype bf16-weights (else as it is)."""
    return run.masters.full_precision() if run.masters is not None else contextlib.nullcontext()


def finish(
    run: Run, meter: Meter, step: int, last_loss: float | None, last_path: Path | None,
    last_eval: tuple[float, int] | None = None, best: dict[str, Any] | None = None, *, stopped_by_sigterm: bool,
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
        "final_loss": last_loss,
        "eval_loss": last_eval[0] if last_eval else None,
        "eval_ppl": math.exp(min(last_eval[0], 700)) if last_eval else None,
        "eval_loss_tokens": last_eval[1] if last_eval else None,
        "best_checkpoint": str(run.out / ckpt.CHECKPOINTS / best["checkpoint"]) if best else None,
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
                summary["merged_model"] = str(merge_and_save(run.peft, run.out / "merged", run.tokenizer))
    write_summary(run.out, summary, {
        "rank": info.rank, "world_size": info.world_size, "steps": step - run.start_step,
        "micro_batches": meter.local_micro_batches, "tokens": meter.local_tokens,
    })
    if info.enabled:
        dist.barrier()
    return summary
