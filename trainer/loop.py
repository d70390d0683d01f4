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
import json
import logging
import math
import os
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import transformers
from tqdm import tqdm

from pipeline.errors import UserError
from pipeline.shards import Manifest
from trainer import checkpoint as ckpt
from trainer.integrity import ShardHashCheck
from trainer.batch import MicroBatch
from trainer.stream import (
    Cursor,
    CursorSampler,
    MicroBatchDataset,
    Planner,
    ShardReader,
    data_fingerprint,
    loader_batches,
    make_loader,
    row_lengths,
    step_cursor,
)
from trainer.loss import find_decoder, packed_loss
from trainer.attention import select_backend
from trainer.preempt import StopOnSigterm
from trainer.model import count_params, load_model, prepare

log = logging.getLogger(__name__)

SCHEDULES = ("cosine", "linear", "constant")
RESUME = ("newest", "strict")
PARALLEL = ("ddp", "fsdp")
# Options that fix the data stream: a resume with other values could not continue exactly.
STREAM_KEYS = ("tokens_per_step", "grad_accum", "seed", "world_size")


@dataclass
class TrainConfig:
    """Every option of `pack-train` (see trainer/cli.py for the user-facing help)."""

    data: str
    model: str
    out: str
    tokenizer: str | None = None
    tokens_per_step: int = 16384
    grad_accum: int = 1
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup: int = 0
    schedule: str = "cosine"
    epochs: int | None = None
    max_steps: int | None = None
    stop_at: int | None = None
    attn: str = "auto"
    dtype: str = "auto"
    compile: bool | None = None  # None: compile on CUDA (1.5x faster on llama-1b), not on CPU
    grad_checkpointing: bool = False
    seed: int = 0
    save_every: int = 0
    keep_last: int | None = None
    resume: str | None = None  # "newest" (intact checkpoint) or "strict" (the latest, or refuse)
    log_every: int = 10
    parallel: str = "ddp"
    grad_reduce: str = "fp32"
    reshard_after_forward: bool = True
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    num_workers: int = 2
    prefetch: int = 4
    peak_flops: float = 989e12
    device: str = "auto"
    verify_hashes: bool = True
    progress: bool = True


# ------------------------------------------------------------------------------------ schedule


@dataclass
class Schedule:
    """LR multiplier after `step` completed steps: linear warmup, then cosine/linear/constant decay
    to `min_ratio` at `total` steps. A dataclass, so LambdaLR checkpoints it with the scheduler."""

    kind: str
    warmup: int
    total: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        if self.kind == "linear":
            return 1.0 - (1.0 - self.min_ratio) * progress
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------------- distributed


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    enabled: bool = False

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def setup_distributed(device: torch.device) -> DistInfo:
    """Join the process group torchrun describes in the environment (NCCL on CUDA, else gloo)."""
    if "WORLD_SIZE" not in os.environ:
        return DistInfo()
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local, enabled=True)


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {requested}: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {requested}: no CUDA device is available here; use --device cpu")
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device needs an index
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------- data


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def open_data(config: TrainConfig) -> tuple[Manifest, Any]:
    """Verify the packed folder (fast checks; the sha256 of its shards is checked beside training,
    `trainer.integrity`) and its tokenizer fingerprint; returns (manifest, tokenizer or None). The
    tokenizer is `--tokenizer`, else the one inside a local model folder."""
    from pipeline.verify import verify_folder

    manifest = verify_folder(config.data, check_hashes=False)
    if manifest.loss_tokens == 0:
        raise UserError(f"{config.data} has no token that carries a loss: training on it would learn "
                        "nothing; re-pack data with responses (assistant turns) to train on")
    source = config.tokenizer
    model_dir = Path(config.model)
    if source is None and model_dir.is_dir() and any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        source = str(model_dir)
    if source is None:
        return manifest, None
    from pipeline.tokenizer_load import load_tokenizer, tokenizer_fingerprint

    tokenizer = load_tokenizer(source)
    have = tokenizer_fingerprint(tokenizer)
    want = manifest.tokenizer.get("fingerprint")
    if have != want:
        raise UserError(
            f"{config.data} was packed with tokenizer {manifest.tokenizer.get('name', '?')!r} "
            f"(fingerprint {str(want)[:12]}) but the model's tokenizer {source} has fingerprint "
            f"{have[:12]}: re-run pack-data with this tokenizer, or pass the right --tokenizer"
        )
    return manifest, tokenizer


# ------------------------------------------------------------------------------------ modules


class LossModule(torch.nn.Module):
    """Wraps the causal LM so DDP/FSDP see the loss computation as the module's forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: MicroBatch) -> torch.Tensor:
        loss_sum, _ = packed_loss(self.model, batch)
        return loss_sum


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    decoder = find_decoder(model)
    layers = getattr(decoder, "layers", None)
    return list(layers) if layers is not None else [decoder]


def enable_grad_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer (transformers 5 renamed the
    method; both spellings are supported)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on norms, biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _full_state(module: torch.nn.Module, fsdp: bool) -> dict[str, torch.Tensor]:
    """Full (unsharded) model state dict on the CPU; collective under FSDP."""
    if not fsdp:
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _optimizer_state(wrapper: torch.nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool) -> dict:
    if not fsdp:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(
        wrapper, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _load_optimizer(wrapper: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict, fsdp: bool) -> None:
    if not fsdp:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(
        wrapper, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True)
    )


def load_weights_into(model: torch.nn.Module, path: Path) -> None:
    """Load a checkpoint's safetensors into `model` (plain, before wrapping); tied copies may be
    absent from the file."""
    state = ckpt.load_model_weights(path)
    with ckpt.loading(path / "model"):  # e.g. a tensor of another shape
        missing, unexpected = model.load_state_dict(state, strict=False)
    missing = set(missing) - ckpt.tied_parameter_names(model)
    if missing or unexpected:
        raise UserError(
            f"{path}/model does not match the model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}: resume with the same --model"
        )


def peak_memory_gib(device: torch.device) -> float:
    """CUDA: the most memory allocated; CPU: this process's peak RSS (VmHWM, where Linux has it:
    `ru_maxrss` of a process started by another also counts the starter's peak, kept across exec)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ---------------------------------------------------------------------------------------- train


def backward_window(
    module: torch.nn.Module,
    micro: list[MicroBatch],
    *,
    device: torch.device,
    autocast: Any = None,
    info: DistInfo | None = None,
    fsdp: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | int]:
    """Forward + backward over one accumulation window; gradients of the window's mean token loss.

    Returns (sum of this rank's token losses, [loss tokens, tokens] of the window over all ranks,
    the window's loss-token count). Every micro-batch backpropagates loss_sum * world / N where N is
    the loss-token count of the whole window on all ranks, known before any forward pass; under
    torch.distributed it stays a device tensor (no host sync). Gradient sync happens only on the
    last micro-batch (DDP no_sync / FSDP set_requires_gradient_sync).
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
        loss_acc += loss_sum.detach().float()
    return loss_acc, counts, window_loss_tokens


def check_resumable(path: Path, config: TrainConfig, world: int, fingerprint: dict) -> dict[str, Any]:
    """The checkpoint's state, if this run can continue it exactly (same data stream), else UserError."""
    state = ckpt.read_trainer_state(path)
    saved = state.get("config", {})
    for key in STREAM_KEYS:
        now = world if key == "world_size" else getattr(config, key)
        if saved.get(key) != now:
            raise UserError(
                f"cannot resume {path}: it was trained with {key}={saved.get(key)} but this run has "
                f"{key}={now}; the data order would differ: use the same value"
            )
    if state.get("data") != fingerprint:
        raise UserError(
            f"cannot resume {path}: it was trained on other data (shard hashes or row counts differ "
            f"from {config.data})"
        )
    return state


def _bf16_allreduce_hook(state, bucket):  # noqa: ANN001, ANN202 (DDP rejects string annotations here)
    """DDP comm hook: average a gradient bucket (dist.GradBucket) across ranks in bf16, write it
    back in fp32; returns a Future of the bucket's tensor.

    torch's `bf16_compress_hook` does the same but insists on NCCL; this one also runs on gloo,
    so the CPU tests exercise it."""
    buffer = bucket.buffer()
    sent = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    future = dist.all_reduce(sent, async_op=True).get_future()

    def back(done: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(done.value()[0])

    return future.then(back)


def wrap_parallel(
    wrapper: LossModule, info: DistInfo, *, fsdp: bool, bf16: bool, reduce_bf16: bool = False,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """DDP, or FSDP2 (`fully_shard` per decoder layer, then the root), or nothing (one process).

    `reduce_bf16` sends gradients across ranks in bf16 (DDP comm hook / FSDP2 reduce_dtype); they
    are accumulated and applied in fp32 either way. `reshard_after_forward=False` keeps each FSDP2
    layer's parameters gathered from its forward to its backward (one all-gather per micro-batch
    instead of two, at the memory of the unsharded bf16 parameters).
    """
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        reduce_dtype = torch.bfloat16 if reduce_bf16 else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=reduce_dtype)
        for layer in _decoder_layers(wrapper.model):
            fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        fully_shard(wrapper, mp_policy=policy)
        return wrapper
    if info.enabled:
        # broadcast_buffers=False: the only buffers are the rotary frequencies, equal on every rank
        # by construction; broadcasting them before every forward would lock the ranks together on
        # each micro-batch, no_sync ones included
        ddp = torch.nn.parallel.DistributedDataParallel(wrapper, broadcast_buffers=False)
        if reduce_bf16:
            ddp.register_comm_hook(None, _bf16_allreduce_hook)
        return ddp
    return wrapper


def _resolve_total_steps(config: TrainConfig, planner: Planner) -> int:
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


def _prepare_run_dir(config: TrainConfig, info: DistInfo) -> tuple[Path, Path | None]:
    """The run folder, and the checkpoint to resume from (None for a new run). Rank 0 verifies the
    checkpoints (`ckpt.resume_point`) and tells the other ranks which one, or why there is none."""
    out = Path(config.out)
    if not config.resume:
        if ckpt.list_checkpoints(out):
            raise UserError(
                f"{out} already holds checkpoints: pass --resume to continue that run, or choose a new --out"
            )
        return out, None
    if config.resume not in RESUME:
        raise UserError(f"unknown --resume={config.resume}: choose {' or '.join(RESUME)}")
    found: tuple[Path, list[str]] | str | None = None
    if info.rank == 0:
        try:
            found = ckpt.resume_point(out, strict=config.resume == "strict")
        except UserError as exc:
            found = str(exc)
    if info.enabled:
        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    if isinstance(found, str):
        raise UserError(found)
    path, notes = found
    for note in notes:
        print(f"pack-train: {note}", file=sys.stderr)
    return out, path


def _trim_metrics(path: Path, step: int) -> None:
    """On resume, drop metric lines of steps after the checkpoint (they will be redone)."""
    if not path.is_file():
        return
    keep = [
        line for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= step
    ]
    path.write_text("".join(line + "\n" for line in keep), encoding="utf-8")


def train(config: TrainConfig) -> dict[str, Any]:
    """Run training as configured; returns (and on rank 0 writes to RUN_DIR/summary.json) a summary."""
    if config.schedule not in SCHEDULES:
        raise UserError(f"unknown --schedule {config.schedule!r}: choose {', '.join(SCHEDULES)}")
    if config.parallel not in PARALLEL:
        raise UserError(f"unknown --parallel {config.parallel!r}: choose {', '.join(PARALLEL)}")
    if config.grad_reduce not in ("fp32", "bf16"):
        raise UserError(f"unknown --grad-reduce {config.grad_reduce!r}: choose fp32, bf16")
    device = pick_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    info = setup_distributed(device)
    rank, world = info.rank, info.world_size
    fsdp = info.enabled and config.parallel == "fsdp"
    seed_everything(config.seed + rank)

    dtype_name = config.dtype if config.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    if dtype_name not in ("bf16", "fp32"):
        raise UserError(f"unknown --dtype {config.dtype!r}: choose bf16 or fp32")
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if dtype_name == "bf16" else contextlib.nullcontext()
    )

    transformers.utils.logging.disable_progress_bar()
    out, resume_from = _prepare_run_dir(config, info)
    manifest, tokenizer = open_data(config)
    lengths = row_lengths(config.data, manifest)
    planner = Planner(
        lengths, config.tokens_per_step, seed=config.seed, world_size=world, grad_accum=config.grad_accum
    )
    total_steps = _resolve_total_steps(config, planner)
    stop_at = min(total_steps, config.stop_at) if config.stop_at else total_steps
    fingerprint = data_fingerprint(config.data, manifest)
    hashes = ShardHashCheck(config.data, manifest, rank, world) if config.verify_hashes else None

    from pipeline.verify import manifest_vocab

    vocab = manifest_vocab(manifest.tokenizer)
    if config.attn != "auto":  # an impossible request fails before any model is loaded
        select_backend(config.attn, device)
    model = load_model(config.model, device=device, dtype=torch.float32, vocab_size=vocab, seed=config.seed)
    backend, backend_why = prepare(model, config.attn, device)
    n_params = count_params(model)
    emb = model.get_input_embeddings().num_embeddings
    if vocab is not None and int(vocab) > emb:
        raise UserError(f"the data's tokenizer has {vocab} tokens but the model embeds only {emb}")

    start_step, cursor, tokens_seen = 0, Cursor(), 0
    if resume_from is not None:
        state = check_resumable(resume_from, config, world, fingerprint)
        load_weights_into(model, resume_from)
        start_step = int(state["step"])
        cursor = Cursor(**state["cursor"])
        tokens_seen = int(state.get("tokens_seen", 0))
        if start_step >= stop_at:
            raise UserError(
                f"{resume_from} is already at step {start_step} of {stop_at}: nothing to resume; "
                "raise --max-steps (or --stop-at) to train further"
            )

    if config.grad_checkpointing:
        enable_grad_checkpointing(model)
    compiled = config.compile if config.compile is not None else device.type == "cuda"
    if compiled:
        for layer in _decoder_layers(model):
            layer.compile(dynamic=True)

    wrapper = LossModule(model)
    train_module = wrap_parallel(wrapper, info, fsdp=fsdp, bf16=dtype_name == "bf16",
                                 reduce_bf16=config.grad_reduce == "bf16",
                                 reshard_after_forward=config.reshard_after_forward)

    optimizer = torch.optim.AdamW(
        param_groups(wrapper, config.weight_decay), lr=config.lr, betas=(config.beta1, config.beta2),
        **({"fused": True} if device.type == "cuda" else {"foreach": True}),
    )
    schedule = Schedule(config.schedule, config.warmup, total_steps, config.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    if resume_from is not None:
        for name, restore in (
            ("optimizer.pt", lambda state: _load_optimizer(wrapper, optimizer, state, fsdp)),
            ("scheduler.pt", scheduler.load_state_dict),
            (f"rng-rank{rank}.pt", ckpt.set_rng_state),
        ):
            with ckpt.loading(resume_from / name):
                restore(ckpt.load_torch(resume_from / name))
        schedule.total = total_steps  # the checkpoint restores the old length; --max-steps may grow
        for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = base * schedule(scheduler.last_epoch)

    n_steps = stop_at - start_step
    reader = ShardReader(config.data, manifest)
    loader = make_loader(
        MicroBatchDataset(reader, planner, rank),
        CursorSampler(planner, cursor, max(n_steps, 0)),
        num_workers=config.num_workers, pin_memory=device.type == "cuda", prefetch_factor=config.prefetch,
    )

    metrics_path = out / "metrics.jsonl"
    if rank == 0:  # created only now that data, model and checkpoint have been checked
        out.mkdir(parents=True, exist_ok=True)
        if resume_from is not None:
            _trim_metrics(metrics_path, start_step)
        elif metrics_path.exists():
            metrics_path.unlink()
        (out / "config.json").write_text(
            json.dumps({**asdict(config), "world_size": world}, indent=2) + "\n", encoding="utf-8"
        )
        p0 = planner.plan(cursor.epoch)
        print(
            f"pack-train: {n_params / 1e6:.1f}M params, attention {backend}, {dtype_name}, "
            f"{world} rank(s) ({config.parallel if info.enabled else 'single'}), "
            f"{manifest.rows} rows / {manifest.total_tokens} tokens, {total_steps} steps of "
            f"{config.grad_accum} x {world} micro-batches <= {config.tokens_per_step} tokens"
            + (f", resuming at step {start_step}" if resume_from else ""),
            file=sys.stderr,
        )
        print(f"pack-train: attention {backend_why}", file=sys.stderr)
        if p0.n_long_rows:
            print(f"pack-train: {p0.n_long_rows} rows are longer than --tokens-per-step and each "
                  "becomes a micro-batch of its own", file=sys.stderr)
        if p0.n_dropped_microbatches:
            print(f"pack-train: each epoch drops its last {p0.n_dropped_microbatches} micro-batch(es) "
                  "so every rank takes the same number of steps", file=sys.stderr)

    def save(step: int, cur: Cursor, last_loss: float | None) -> Path:
        if hashes is not None:  # no checkpoint before every shard is known intact
            hashes.wait(info.enabled, device)
        model_state = None  # unsharded: save_pretrained reads the model itself (on rank 0)
        if fsdp:  # collective: every rank takes part in gathering the full state
            model_state = {k.removeprefix("model."): v for k, v in _full_state(wrapper, True).items()}
        trainer_state = {
            "step": step, "cursor": cur.to_dict(), "tokens_seen": tokens_seen, "loss": last_loss,
            "config": {**asdict(config), "world_size": world}, "data": fingerprint,
            "attention": backend, "total_steps": total_steps,
        }
        return ckpt.save_checkpoint(
            out, step, model=model, model_state=model_state,
            optimizer_state=_optimizer_state(wrapper, optimizer, fsdp) if (fsdp or rank == 0) else None,
            scheduler_state=scheduler.state_dict(), trainer_state=trainer_state,
            tokenizer=tokenizer, rank=rank, barrier=info.barrier, keep_last=config.keep_last,
        )

    tokens_since_log = run_tokens = 0
    metrics_file = open(metrics_path, "a", encoding="utf-8") if rank == 0 else None  # noqa: SIM115
    bar = tqdm(total=total_steps, initial=start_step, disable=rank != 0 or not config.progress,
               desc="pack-train", unit="step", dynamic_ncols=True)
    step = start_step
    position = Cursor(cursor.epoch, cursor.step_in_epoch)  # data cursor after `step`
    last_loss: float | None = None
    last_path: Path | None = None
    preempted = False  # stopped early by SIGTERM
    pending_tokens: torch.Tensor | int = 0
    local_micro, local_tokens = 0, 0  # this rank's own counts (host ints), written to ranks/

    def flush_tokens() -> None:
        nonlocal pending_tokens, tokens_seen, run_tokens, tokens_since_log
        n = int(pending_tokens)
        tokens_seen, run_tokens, tokens_since_log = tokens_seen + n, run_tokens + n, tokens_since_log + n
        pending_tokens = 0

    t_log, wait_since_log, steps_since_log = time.perf_counter(), 0.0, 0
    run_start = time.perf_counter()
    with (
        StopOnSigterm() as sigterm, bar, metrics_file or contextlib.nullcontext(),
        loader_batches(loader) as batches,
    ):
        while step < stop_at:
            t0 = time.perf_counter()
            micro = [next(batches) for _ in range(config.grad_accum)]
            wait = time.perf_counter() - t0
            local_micro += len(micro)
            local_tokens += sum(b.n_tokens for b in micro)
            loss_acc, counts, window_loss_tokens = backward_window(
                train_module, micro, device=device, autocast=autocast, info=info, fsdp=fsdp
            )
            grad_norm = torch.nn.utils.clip_grad_norm_(
                wrapper.parameters(), config.grad_clip if config.grad_clip > 0 else float("inf")
            )
            optimizer.step()
            lr = optimizer.param_groups[0]["lr"]  # the rate this step used
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            epoch_of_step = position.epoch
            position = step_cursor(planner, position, 1)
            steps_since_log += 1
            wait_since_log += wait
            pending_tokens = pending_tokens + counts[1]  # stays on the device: read when logging
            bar.update(1)

            at_log = step % config.log_every == 0 or step == stop_at
            stopping = sigterm.agreed(info.enabled, device, at_log) and step < stop_at
            if at_log or stopping:
                if hashes is not None:
                    hashes.raise_if_failed(info.enabled, device)
                if info.enabled:
                    dist.all_reduce(loss_acc)
                loss_value = float(loss_acc) / float(window_loss_tokens)
                if hasattr(grad_norm, "full_tensor"):
                    grad_norm = grad_norm.full_tensor()
                flush_tokens()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                now = time.perf_counter()
                elapsed = now - t_log
                tps = tokens_since_log / max(elapsed, 1e-9)
                record = {
                    "step": step,
                    "epoch": epoch_of_step,
                    "loss": loss_value,
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "tokens": tokens_seen,
                    "tokens_per_s": tps,
                    "mfu": 6.0 * n_params * tps / (config.peak_flops * world),
                    "step_time_s": elapsed / steps_since_log,
                    "data_wait_s": wait_since_log / steps_since_log,
                    "peak_mem_gib": peak_memory_gib(device),
                    "attention": backend,
                }
                last_loss = loss_value
                if metrics_file is not None:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
                t_log, tokens_since_log, wait_since_log, steps_since_log = now, 0, 0.0, 0
            if (config.save_every and step % config.save_every == 0) or step == stop_at or stopping:
                flush_tokens()
                last_path = save(step, position, last_loss)
            if stopping:
                preempted = True
                break

    elapsed = time.perf_counter() - run_start
    summary = {
        "steps": step,
        "total_steps": total_steps,
        "tokens": tokens_seen,
        "tokens_this_run": run_tokens,
        "tokens_per_s": run_tokens / max(elapsed, 1e-9),
        "final_loss": last_loss,
        "attention": backend,
        "compiled": compiled,
        "params": n_params,
        "world_size": world,
        "elapsed_s": elapsed,
        "checkpoint": str(last_path) if last_path else None,
        "stopped_by_sigterm": preempted,  # on every rank, when any rank got SIGTERM
        "rank": rank,
    }
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    # Every rank records what it did itself, so equal step counts across ranks can be checked.
    (out / "ranks").mkdir(exist_ok=True)
    (out / "ranks" / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world_size": world, "steps": step - start_step,
        "micro_batches": local_micro, "tokens": local_tokens,
    }) + "\n", encoding="utf-8")
    if info.enabled:
        dist.barrier()
    return summary

