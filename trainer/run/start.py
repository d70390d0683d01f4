"""Everything before the first step of `trainer.run.loop`: `start(config) -> Run`, with device and
ranks, the checkpoint to resume, the data, the model (proven to train on packed rows), its wrapper,
optimizer and data loader, each checked before rank 0 writes the run folder.
"""

from __future__ import annotations

import contextlib
import errno
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import transformers

from pipeline.contract import PROFILE, Manifest, UserError, added_count, manifest_vocab
from trainer.attention.backend import piece_backend, select_backend
from trainer.config import TrainConfig, parse_step_range, per_epoch, resolved, validate
from trainer.data.evaluate import Evaluator, held_out_folder
from trainer.data.integrity import ShardHashCheck
from trainer.data.stream import (
    Cursor,
    CursorSampler,
    MicroBatchDataset,
    Planner,
    ShardReader,
    data_fingerprint,
    largest_microbatch,
    make_loader,
)
from trainer.distributed import context_parallel
from trainer.distributed.context_parallel import ContextGroups
from trainer.distributed.parallel import DistInfo, pick_device, seed_everything, setup_distributed, wrap_parallel
from trainer.model.check import check_context_parallel
from trainer.model.fp8 import check_fp8, float8_all_gather, recipe_note, to_float8
from trainer.model.freeze import unfreeze_only
from trainer.model.keep_attention import KeptAttention
from trainer.model.load import compile_decoder_layers, count_params, decoder_layers, enable_grad_checkpointing, load_model, prepare
from trainer.model.long_rows import tile_mlp
from trainer.model.lora import NF4_BLOCK, add_lora, freeze_in_bf16, quantize_base_int8, quantize_base_nf4
from trainer.model.loss import LossModule
from trainer.model.precision import MasterAdamW
from trainer.run.metrics import model_shape, start_run_files
from trainer.run.optim import make_optimizer
from trainer.run.preflight import open_data
from trainer.run.profiling import StepProfiler
from trainer.run.resume import check_resumable, checkpoint_to_resume, continue_history, load_training_state, resume_model
from trainer.run.state import Run

# precisions whose weights are bf16 over fp32 masters in one process (trainer.model.precision)
MASTER_DTYPES = ("bf16-weights", "fp8")


def start(config: TrainConfig, opened: tuple[Manifest, Any] | None = None) -> Run:
    """Everything before the first step: device and ranks, the checkpoint to resume, the data, the
    model (proven to train on packed rows), its wrapper, optimizer and data loader. Rank 0 writes
    the run folder only once all of it has been checked."""
    validate(config)
    device = pick_device(config.device)
    config = resolved(config, device.type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    info = setup_distributed(device, cpu_collectives=config.offload_states)
    if config.offload_states and not info.enabled:
        raise UserError(
            "--offload-states shards the model with FSDP2, which runs under torchrun: torchrun "
            "--nproc-per-node N $(which pack-train) ... --parallel fsdp --offload-states (N may be 1)"
        )
    layout = context_parallel.setup(info.rank, info.world_size, info.enabled, config.context_parallel)
    if layout.cp_size > 1 and config.attn == "auto":  # a kernel that attends a share to the whole row
        config = replace(config, attn=piece_backend(device))
    seed_everything(config.seed + info.rank)
    dtype_name = config.dtype if config.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    bf16 = dtype_name != "fp32"  # bf16 or bf16-weights
    if info.enabled:
        _refuse_under_torchrun(config, dtype_name)
    if dtype_name == "fp8":
        check_fp8(device)
    compiled = config.compile if config.compile is not None else device.type == "cuda"
    if config.activation_memory_budget < 1 and not compiled:
        raise UserError(
            f"--activation-memory-budget {config.activation_memory_budget:g} applies to compiled "
            f"layers, and this run compiles none: add --compile (the default on CUDA)"
        )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    transformers.utils.logging.disable_progress_bar()
    resume_from = checkpoint_to_resume(config, info)

    manifest, tokenizer = opened if opened is not None else open_data(config)
    eval_folder = held_out_folder(config, manifest)
    reader = ShardReader(config.data, manifest)  # mapped now: every row trained on comes from these files
    config = by_group(config, manifest)
    planner = Planner(
        reader.row_lengths(),
        config.tokens_per_step,
        seed=config.seed,
        world_size=layout.dp_size,
        grad_accum=config.grad_accum,
        groups=manifest.groups if config.step_by_group else None,
        rank=layout.dp_rank,
        even=info.enabled and config.parallel == "fsdp",
    )
    shortest = int(reader.row_lengths().min())
    if layout.cp_size > 1 and shortest < layout.cp_size:  # a share of no token
        raise UserError(
            f"--context-parallel {layout.cp_size}: {config.data} holds a row of "
            f"{shortest} token(s), too short to split over {layout.cp_size} "
            "ranks: lower --context-parallel, or pack the data with longer rows"
        )
    total_steps = _total_steps(config, planner)
    config = per_epoch(config, total_steps)  # --evals-per-epoch / --saves-per-epoch as steps
    stop_at = min(total_steps, config.stop_at) if config.stop_at else total_steps
    fingerprint = data_fingerprint(config.data, manifest)
    state = check_resumable(resume_from, config, info.world_size, fingerprint, planner, stop_at) if resume_from is not None else None
    hashes = ShardHashCheck(config.data, manifest, info.rank, info.world_size, reader.identities) if config.verify_hashes else None
    model, backend, backend_why = _model(config, device, manifest, load_on=load_device(config, device, bf16), groups=layout.groups)
    reader.vocab = model.get_input_embeddings().num_embeddings  # every micro-batch's ids checked against it
    if layout.cp_size > 1:  # where the model was proven, still in float32 (a LoRA base: on the CPU)
        check_context_parallel(model, layout)
    n_params = count_params(model)
    if config.unfrozen_parameters:  # before anything wraps the model: the names Axolotl matches
        tensors, of, trained, _ = unfreeze_only(model, config.unfrozen_parameters)
        if info.rank == 0:
            print(
                f"pack-train: --unfrozen-parameters: {trained / 1e6:.2f}M of {n_params / 1e6:.2f}M parameters "
                f"({tensors} of {of} tensors) train, the others are frozen",
                file=sys.stderr,
            )
    peft = add_lora(model, config) if config.lora_r else None  # adapters injected into `model` itself
    flop_shape = model_shape(model, config)  # before quantizing and sharding change the weights
    if peft is not None and bf16:
        freeze_in_bf16(model)  # frozen base weights need no fp32 copy: half their memory
    model.to(device)
    if config.qlora:  # on the device, where quantizing is fast (the base arrives in bf16)
        nf4, kept = quantize_base_nf4(decoder_layers(model))
        if not nf4:
            raise UserError(
                f"--qlora: none of the decoder's {kept} linear layers has a weight NF4 can store "
                f"(a multiple of {NF4_BLOCK} values): train this model with --lora-r alone"
            )
        if info.rank == 0:
            print(
                f"pack-train: --qlora: {nf4} linear layers of the decoder stored in 4-bit NF4 (torchao)"
                + (f"; {kept} stay as they were (NF4 needs weights of a multiple of {NF4_BLOCK} values)" if kept else ""),
                file=sys.stderr,
            )
    if config.int8_base:  # on the device too: one scale per output row, any shape
        int8 = quantize_base_int8(decoder_layers(model))
        if info.rank == 0:
            print(
                f"pack-train: --int8-base: {int8} linear layers of the decoder stored in int8, one scale per "
                "output row (torchao); every matmul dequantizes them to the compute dtype",
                file=sys.stderr,
            )

    start_step, cursor, tokens_seen = 0, Cursor(), 0
    if resume_from is not None:
        start_step, cursor, tokens_seen = resume_model(resume_from, model, state, peft)
    profiler = _profiler(config, device, info.rank, start_step, stop_at)
    fsdp = info.enabled and config.parallel == "fsdp"
    if dtype_name == "fp8":  # after resume and LoRA, before compile and sharding (trainer.model.fp8)
        to_float8(model, config.fp8_recipe, decoder_layers(model), fsdp=fsdp)
    kept_attention = KeptAttention() if config.keep_attention else None
    wrapper, module = _wrap(model, config, info, fsdp=fsdp, compiled=compiled, bf16=bf16, keep=kept_attention)
    # after resume (the masters start from its fp32 weights); under FSDP, plain bf16 already computes
    # with bf16 weights over fp32 shards (FSDP2's mixed precision), so bf16-weights is the same
    optimizer, scheduler = make_optimizer(
        wrapper.parameters(), config, device, total_steps, master_weights=dtype_name in MASTER_DTYPES and not info.enabled
    )
    masters = optimizer if isinstance(optimizer, MasterAdamW) else None
    if resume_from is not None:
        load_training_state(
            resume_from, module=wrapper, optimizer=optimizer, scheduler=scheduler, total_steps=total_steps, rank=info.rank, fsdp=fsdp
        )
    loader = make_loader(
        MicroBatchDataset(reader, planner, layout.dp_rank, share=(layout.cp_rank, layout.cp_size)),
        CursorSampler(planner, cursor, max(stop_at - start_step, 0)),
        num_workers=config.num_workers,
        prefetch_factor=config.prefetch,
    )
    evaluator = None
    if eval_folder is not None:
        evaluator = Evaluator(eval_folder, manifest, config.tokens_per_step, info, device, share=(layout.cp_rank, layout.cp_size))
        evaluator.reader.vocab = reader.vocab
    run = Run(
        config=config,
        info=info,
        fsdp=fsdp,
        device=device,
        autocast=autocast,
        masters=masters,
        out=Path(config.out),
        planner=planner,
        total_steps=total_steps,
        stop_at=stop_at,
        start_step=start_step,
        cursor=cursor,
        tokens_seen=tokens_seen,
        fingerprint=fingerprint,
        hashes=hashes,
        tokenizer=tokenizer,
        model=model,
        peft=peft,
        wrapper=wrapper,
        module=module,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        evaluator=evaluator,
        backend=backend,
        compiled=compiled,
        n_params=n_params,
        flop_shape=flop_shape,
        fp8_all_gather=dtype_name == "fp8" and float8_all_gather(config.fp8_recipe, fsdp),
        profiler=profiler,
        layout=layout,
        largest=largest_microbatch(planner, reader.paths, reader.starts),
        resumed_from=resume_from,
        kept_attention=kept_attention,
    )
    if info.rank == 0:
        try:
            start_run_files(run.out, config, info.world_size, continue_history(run.out, resume_from, start_step), manifest.group_size)
        except OSError as exc:  # config.json and metrics.jsonl are written whole or not at all
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise UserError(
                f"disk full: pack-train could not write its run files (config.json, metrics.jsonl) into "
                f"{run.out} (each is written whole or not at all): free some space, or choose another "
                "--out"
            ) from None
        _announce(run, manifest, dtype_name, backend_why)
    return run


def _profiler(config: TrainConfig, device: torch.device, rank: int, start_step: int, stop_at: int) -> StepProfiler | None:
    """The profiler of `--profile-steps FIRST-LAST` (RUN/profile/), whose steps must be among the
    steps this run trains (start_step + 1 .. stop_at), else one line saying which those are."""
    if config.profile_steps is None:
        return None
    first, last = parse_step_range(config.profile_steps)
    if first <= start_step or last > stop_at:
        raise UserError(
            f"--profile-steps {config.profile_steps}: this run trains steps {start_step + 1} to "
            f"{stop_at}; profile steps among them, past the first few, which compile (e.g. "
            f"its last three: {max(start_step + 1, stop_at - 2)}-{stop_at})"
        )
    return StepProfiler((first, last), device, Path(config.out) / PROFILE, rank)


def _refuse_under_torchrun(config: TrainConfig, dtype_name: str) -> None:
    """One line for an option that does not combine with the data-parallel mode."""
    if dtype_name in MASTER_DTYPES and config.parallel != "fsdp":
        raise UserError(
            f"--dtype {dtype_name} under torchrun needs --parallel fsdp (FSDP2 computes with "
            "bf16 weights over fp32 shards); DDP would average the gradients in bf16"
        )
    if config.optimizer == "adafactor" and config.parallel == "fsdp":
        raise UserError(
            "--optimizer adafactor is not supported with --parallel fsdp: its row and column "
            "statistics would cover each rank's shard, not the whole matrix; use --parallel ddp"
        )


def load_device(config: TrainConfig, device: torch.device, bf16: bool) -> torch.device:
    """Where the model is loaded and proven: `device`, except for a LoRA run under bf16, whose frozen
    base is loaded, proven, given its adapters and frozen in bf16 on the CPU, and only then moved,
    so the base's fp32 weights never occupy the device (an 8B base: 29 GB, against 14.5 in bf16).
    The proof (`trainer.model.check`, a 28-token probe) then runs on the CPU, in float32 as before."""
    return torch.device("cpu") if config.lora_r and bf16 else device


def _model(
    config: TrainConfig,
    device: torch.device,
    manifest: Manifest,
    *,
    load_on: torch.device,
    groups: ContextGroups | None,
) -> tuple[transformers.PreTrainedModel, str, str]:
    """The model in float32 on `load_on` (`device`, or the CPU for the caller to move it later),
    proven to train on packed rows, and the attention backend for `device` (gathering keys over the
    context-parallel `groups`, where the run has them) and why that one."""
    vocab = manifest_vocab(manifest.tokenizer)
    if config.attn != "auto":  # an impossible request fails before any model is loaded
        select_backend(config.attn, device)
    model = load_model(
        config.model, device=load_on, dtype=torch.float32, vocab_size=vocab, seed=config.seed, added_tokens=added_count(manifest.tokenizer)
    )
    backend, why = prepare(model, config.attn, device, groups)
    emb = model.get_input_embeddings().num_embeddings
    if vocab is not None and int(vocab) > emb:
        raise UserError(
            f"--data {config.data}: its tokenizer has {vocab} tokens but --model {config.model} embeds "
            f"only {emb}: pack the data with the model's tokenizer (pack-data --tokenizer)"
        )
    return model, backend, why


def _wrap(
    model: transformers.PreTrainedModel,
    config: TrainConfig,
    info: DistInfo,
    *,
    fsdp: bool,
    compiled: bool,
    bf16: bool,
    keep: KeptAttention | None,
) -> tuple[LossModule, torch.nn.Module]:
    """The model with the loss as its forward, and that wrapper as the step calls it (DDP, FSDP2
    or itself); decoder layers recompute activations and are compiled where asked, and so is
    the loss of each chunk of tokens (`keep`: recomputed layers keep attention's output), except under FSDP (whose hooks on the output head's sharded
    weight torch.compile would have to trace)."""
    if config.grad_checkpointing:
        enable_grad_checkpointing(model, every=int(config.grad_checkpointing), keep=keep)
    layers = decoder_layers(model)
    if config.tile_mlp:
        tile_mlp(layers, config.tile_mlp)
    if compiled:
        compile_decoder_layers(model)
    wrapper = LossModule(model, compiled=compiled and not fsdp)
    module = wrap_parallel(
        wrapper,
        layers,
        info,
        fsdp=fsdp,
        bf16=bf16,
        reduce_bf16=config.grad_reduce == "bf16",
        reshard_after_forward=config.reshard_after_forward,
        bucket_mb=config.ddp_bucket_mb,
        offload_states=config.offload_states,
    )
    return wrapper, module


def by_group(config: TrainConfig, manifest: Manifest) -> TrainConfig:
    """`config` with --step-by-group decided: on for a folder of groups unless turned off; asked for on
    a folder without groups, one line."""
    if config.step_by_group and not manifest.groups:
        raise UserError(
            f"--step-by-group: {config.data} has no groups (it was packed with --strategy "
            f"{manifest.strategy}): pack it with --strategy minibatch --group-size B, or drop the option"
        )
    return replace(config, step_by_group=bool(manifest.groups) and config.step_by_group is not False)


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
    dp = world // config.context_parallel  # data-parallel ranks
    print(
        f"pack-train: {run.n_params / 1e6:.1f}M params, attention {run.backend}, {dtype_name}, "
        f"{world} rank(s) ({config.parallel if run.info.enabled else 'single'}"
        f"{f', each row split over {config.context_parallel}' if config.context_parallel > 1 else ''}), "
        f"{manifest.rows} rows / {manifest.total_tokens} tokens, {run.total_steps} steps of "
        + (
            f"{'one group' if dp == 1 else f'{dp} groups, one a rank,'} of {manifest.group_size} examples each "
            f"(cut into micro-batches <= {config.tokens_per_step} tokens)"
            if config.step_by_group
            else f"{config.grad_accum} x {dp} micro-batches <= {config.tokens_per_step} tokens"
        )
        + (f", resuming at step {run.start_step}" if config.resume else ""),
        file=sys.stderr,
    )
    print(f"pack-train: attention {backend_why}", file=sys.stderr)
    if config.step_by_group:
        step = "one" if dp == 1 else f"{dp} (one a rank; an epoch's last step may take fewer)"
        mean = (
            "each rank's group its own mean, the means averaged (--loss-average ranks)"
            if dp > 1 and config.loss_average == "ranks"
            else "the mean over all its loss tokens"
        )
        print(
            f"pack-train: stepping by group: each optimizer step is {step} of the {len(manifest.groups)} groups "
            f"of {manifest.group_size} examples pack-data made (the last may hold fewer), its loss {mean}, "
            "as padded batches of those examples; every epoch takes the same groups in "
            "another seeded order (TRL/Axolotl draw new batches each epoch: another random draw, the same "
            "recipe); --no-step-by-group steps by token budget instead",
            file=sys.stderr,
        )
    if dtype_name == "fp8":
        print(f"pack-train: {recipe_note(config.fp8_recipe)}", file=sys.stderr)
    if run.compiled:
        print(
            "pack-train: the first step compiles the decoder layers (torch.compile), which takes "
            "minutes on a large model; later steps reuse that code (--no-compile skips it)",
            file=sys.stderr,
        )
    plan = run.planner.plan(run.cursor.epoch)
    if plan.n_long_rows:
        print(
            f"pack-train: {plan.n_long_rows} rows are longer than --tokens-per-step and each becomes a micro-batch of its own",
            file=sys.stderr,
        )
    if plan.n_dropped_microbatches:
        print(
            f"pack-train: each epoch drops its last {plan.n_dropped_microbatches} micro-batch(es) "
            "so every rank takes the same number of steps",
            file=sys.stderr,
        )
