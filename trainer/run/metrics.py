"""What a run records in `--out` besides its checkpoints: config.json, metrics.jsonl (a line every
`--log-every` steps, written by `Meter`), summary.json and ranks/rank{r}.json; and the lock that
keeps a second run out of the folder while one runs (`run_folder_lock`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from pipeline.contract import (
    LOSS_PLOT,
    METRICS,
    RANKS,
    RUN_CONFIG,
    RUN_LOCK,
    SUMMARY,
    TENSORBOARD,
    LayerShape,
    ModelShape,
    StepFlops,
    UserError,
    attention_share,
    folder_lock,
    step_flops,
    write_text_atomic,
)
from trainer.config import TrainConfig
from trainer.data.batch import MicroBatch
from trainer.model.load import decoder_layers
from trainer.model.long_rows import layer_mlp
from trainer.model.loss import KEEP_LOGITS_UP_TO
from trainer.model.presets import model_hub_record


def run_folder_lock(out: str) -> contextlib.AbstractContextManager:
    """One run per run folder at a time: the lock `RUN/.pack-train.lock`, taken by rank 0 (the rank
    that writes the folder; torchrun's RANK) for the whole run, released however it ends."""
    if int(os.environ.get("RANK", "0")) != 0:
        return contextlib.nullcontext()
    return folder_lock(Path(out) / RUN_LOCK, out, "pack-train")


def start_run_files(out: Path, config: TrainConfig, world: int, resume_step: int | None, group_size: int | None = None) -> None:
    """Create the run folder and write config.json (the TrainConfig, the world size, the examples per
    step when stepping by group, and, for a Hub-id --model, its id and commit); metrics lines of steps
    after the checkpoint a run resumes from are dropped (they will be redone), and a new run starts a
    new metrics.jsonl."""
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    if resume_step is not None:
        trim_metrics(out / METRICS, resume_step)
    elif (out / METRICS).exists():
        (out / METRICS).unlink()
    try:  # whole or not at all (a full disk leaves no empty config.json)
        record = {
            **asdict(config),
            "world_size": world,
            "model_hub": model_hub_record(config.model),
            **({"group_size": group_size} if config.step_by_group else {}),
        }
        write_text_atomic(out / RUN_CONFIG, json.dumps(record, indent=2) + "\n")
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


def trim_metrics(path: Path, step: int) -> None:
    """Keep only the metric lines of steps up to `step`."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    keep = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if number < len(lines):
                raise UserError(f"{path} line {number}: not a JSON metrics line: fix or remove it") from None
            print(
                f"pack-train: {path}: its last line was cut off (a write that did not finish, e.g. on a full disk); dropped",
                file=sys.stderr,
            )
            continue
        if record.get("step", 0) <= step:
            keep.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in keep))


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


# TensorBoard tags of the metrics keys that the Hugging Face Trainer also logs, under its names, so
# that runs of both tools share charts; the other keys go under train/ with their own names
HF_TAGS = {"lr": "train/learning_rate", "eval_loss": "eval/loss", "eval_ppl": "eval/perplexity", "eval_loss_tokens": "eval/loss_tokens"}


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a metrics key: loss -> train/loss, eval_loss -> eval/loss, lr ->
    train/learning_rate, grad_norm -> train/grad_norm."""
    return HF_TAGS.get(key, f"train/{key}")


class Reporter:
    """The scalars of every metrics line (the epoch too; the step is the step they are logged at),
    also to TensorBoard (`RUN/tensorboard`, through torch.utils.tensorboard) or Weights & Biases
    (only when installed; offline unless the user's W&B settings say otherwise). Rank 0 only;
    "none" does nothing."""

    def __init__(self, kind: str, out: Path, config: TrainConfig, rank: int) -> None:
        self.kind = kind if rank == 0 else "none"
        self.writer: Any = None
        if self.kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("--report-to tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.writer = SummaryWriter(log_dir=str(out / TENSORBOARD))
        elif self.kind == "wandb":
            try:
                import wandb
            except ImportError:
                raise UserError("--report-to wandb needs the wandb package: pip install wandb") from None
            os.environ.setdefault("WANDB_MODE", "offline")  # no network unless the user set a mode
            self.writer = wandb.init(
                project=config.wandb_project or "pack-train",
                entity=config.wandb_entity,
                name=config.run_name,
                dir=str(out),
                config=asdict(config),
                resume="allow",
            )

    def log(self, step: int, record: dict[str, Any]) -> None:
        scalars = {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.kind == "tensorboard":
            for key, value in scalars.items():
                self.writer.add_scalar(tensorboard_tag(key), value, step)
        elif self.kind == "wandb":
            self.writer.log(scalars, step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close() if self.kind == "tensorboard" else self.writer.finish()


# bf16 dense peak FLOP/s of the GPUs whose figure is known, by a part of their CUDA device name
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12, "A800": 312e12}


def known_peak_flops(device: torch.device) -> float | None:
    """The bf16 dense peak FLOP/s of `device` when known (PEAK_FLOPS), else None: no MFU is logged
    for a device (the CPU, another GPU) without a peak to divide by, unless --peak-flops gives one."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_FLOPS.items() if part in name), None)


def model_shape(model: torch.nn.Module, config: TrainConfig) -> ModelShape:
    """What `pipeline.report.flops` counts of this model as this run trains it: each decoder layer's
    weights (LoRA adapters apart: parameters named lora_*), its MLP's, its attention kind (the
    config's `layer_types`, `sliding_window` and `attention_chunk_size`, read as
    `trainer.attention.backend.layer_features` reads them) and whether it recomputes; the output
    head's weights. A mixture of experts counts the share of its experts' weights a token uses
    (`num_experts_per_tok` of them). Call it before the weights are quantized or sharded."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    per_token = getattr(text, "num_experts_per_tok", None)
    experts = next((getattr(text, k) for k in ("num_local_experts", "num_experts", "n_routed_experts") if getattr(text, k, None)), None)
    active = min(1.0, per_token / experts) if per_token and experts else 1.0  # the experts' share a token uses
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    kinds = getattr(text, "layer_types", None)
    every = int(config.grad_checkpointing)
    layers = []
    for i, layer in enumerate(decoder_layers(model)):
        kind = kinds[i] if kinds and i < len(kinds) else None
        window = getattr(text, "sliding_window", None) if kind == "sliding_attention" or not kinds else None
        chunk = getattr(text, "attention_chunk_size", None) if kind == "chunked_attention" else None
        base, adapters = _split_params(layer, active)
        mlp = layer_mlp(layer)
        layers.append(
            LayerShape(
                params=base,
                heads=heads,
                head_dim=head_dim,
                window=int(window) if window else None,
                chunk=int(chunk) if chunk else None,
                adapter_params=adapters,
                mlp_params=_split_params(mlp, active)[0] if mlp is not None else 0,
                recompute=bool(every) and i % every == 0,
                recompute_attention=not config.keep_attention,
            )
        )
    head = model.get_output_embeddings()
    weight = head.weight if head is not None else torch.empty(0, 0, device="meta")
    return ModelShape(
        layers=tuple(layers),
        head_params=weight.numel(),
        vocab=int(weight.shape[0]),
        lora=bool(config.lora_r),
        tiled_mlp=int(config.tile_mlp),
    )


def _split_params(module: torch.nn.Module, active: float = 1.0) -> tuple[int, int]:
    """(base weights, LoRA adapter weights) of a module that a token multiplies: of a mixture of
    experts' routed experts (parameters under an `experts` module), the `active` share."""
    base = adapters = 0.0
    for name, param in module.named_parameters():
        share = active if re.search(r"(^|\.)experts\.", name) else 1.0
        if "lora_" in name:
            adapters += param.numel() * share
        else:
            base += param.numel() * share
    return round(base), round(adapters)


def batch_flops(shape: ModelShape, batch: MicroBatch) -> StepFlops:
    """The FLOPs of one micro-batch on this rank (`pipeline.report.flops`). Under context
    parallelism (`batch.context`) the rank counts its own tokens and loss tokens, and its share
    (1 / ranks) of the whole row's attention, so the group's sum is the row's count."""
    shard = batch.context
    cu = shard.cu_seqlens if shard is not None else batch.cu_seqlens.numpy()
    share = 1.0 / shard.n_ranks if shard is not None else 1.0
    dense = step_flops(
        shape,
        np.zeros(0, np.int64),
        tokens=batch.n_tokens,
        loss_tokens=batch.n_loss_tokens,
        head_recompute=batch.n_loss_tokens * shape.vocab > KEEP_LOGITS_UP_TO,
    )
    attention = step_flops(shape, np.diff(cu), tokens=0, loss_tokens=0)
    return dense + attention.scaled(share)


class Meter:
    """Counts tokens, FLOPs, steps and data-loader waits, and writes a metrics line when asked (rank 0
    writes the file and shows the progress bar). The window token counts of the steps stay device
    tensors until a line or a checkpoint needs them, so steps do not wait for the host; each rank
    counts the FLOPs of its own micro-batches (`batch_flops`, on the host), summed over the ranks
    when a line is written."""

    def __init__(
        self,
        out: Path,
        config: TrainConfig,
        *,
        rank: int,
        world: int,
        device: torch.device,
        shape: ModelShape,
        backend: str,
        start_step: int,
        total_steps: int,
        tokens_seen: int,
    ) -> None:
        self.device, self.backend, self.shape, self.world = device, backend, shape, world
        peak = config.peak_flops or known_peak_flops(device)
        self.peak_flops = peak * world if peak else None  # for the MFU and HFU
        self.file = open(out / METRICS, "a", encoding="utf-8") if rank == 0 else None  # noqa: SIM115
        self.reporter = Reporter(config.report_to, out, config, rank)
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            disable=rank != 0 or not config.progress,
            desc="pack-train",
            unit="step",
            dynamic_ncols=True,
        )
        self.tokens_seen = tokens_seen  # all ranks, this run and the ones it resumes
        self.run_tokens = 0  # all ranks, this run
        self.run_flops = StepFlops()  # all ranks, this run, up to the last metrics line
        self.local_micro_batches = self.local_tokens = 0  # this rank's own, host ints
        self._pending: torch.Tensor | int = 0  # window tokens not yet added to the counts above
        self._flops_since = StepFlops()  # this rank's, since the last metrics line
        self._tokens_since = self._steps_since = 0
        self._wait_since = 0.0
        self.run_start = self._log_time = time.perf_counter()

    def __enter__(self) -> Meter:
        return self

    def __exit__(self, kind: type | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.bar.close()
        self.reporter.close()
        if self.file is not None:
            self.file.close()

    def step(self, micro: list[MicroBatch], wait: float, window_tokens: torch.Tensor | int) -> None:
        """Count one optimizer step: this rank's `micro` batches (host tensors) and their FLOPs, the
        time spent waiting for them, and the tokens of the whole window (all ranks)."""
        self.local_micro_batches += len(micro)
        self.local_tokens += sum(b.n_tokens for b in micro)
        for batch in micro:
            self._flops_since = self._flops_since + batch_flops(self.shape, batch)
        self._wait_since += wait
        self._steps_since += 1
        self._pending = self._pending + window_tokens
        self.bar.update(1)

    def count_tokens(self) -> None:
        """Bring the token counts up to date (reads the pending device count)."""
        n = int(self._pending)
        self.tokens_seen, self.run_tokens, self._tokens_since = (self.tokens_seen + n, self.run_tokens + n, self._tokens_since + n)
        self._pending = 0

    def _window_flops(self) -> StepFlops:
        """The FLOPs since the last line, all ranks (every rank writes a line at the same steps)."""
        flops = self._flops_since
        if dist.is_available() and dist.is_initialized() and self.world > 1:
            total = torch.tensor(flops.as_list(), dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
            dist.all_reduce(total)
            flops = StepFlops(*total.tolist())
        self._flops_since = StepFlops()
        return flops

    def log(self, step: int, epoch: int, loss: float, lr: float, grad_norm: float) -> None:
        """Write the metrics line of `step`: the given values and the throughput since the last line."""
        self.count_tokens()
        flops = self._window_flops()
        self.run_flops = self.run_flops + flops
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed = now - self._log_time
        tokens_per_s = self._tokens_since / max(elapsed, 1e-9)
        record = {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.tokens_seen,
            "tokens_per_s": tokens_per_s,
            **self.flop_rates(flops, elapsed),
            "step_time_s": elapsed / self._steps_since,
            "data_wait_s": self._wait_since / self._steps_since,
            "peak_mem_gib": peak_memory_gib(self.device),
            "attention": self.backend,
        }
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        self.reporter.log(step, record)
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}")
        self._log_time, self._tokens_since, self._wait_since, self._steps_since = now, 0, 0.0, 0

    def flop_rates(self, flops: StepFlops, seconds: float) -> dict[str, float | None]:
        """`mfu` (model FLOPs, attention included, / seconds / the peak of all devices), `tflops`
        (model TFLOP/s a device), `hfu` (as mfu with the recompute) and `attn_flop_share`; mfu and
        hfu are None without a known peak."""
        seconds = max(seconds, 1e-9)
        return {
            "mfu": flops.model / seconds / self.peak_flops if self.peak_flops else None,
            "tflops": flops.model / seconds / self.world / 1e12,
            "hfu": flops.hardware / seconds / self.peak_flops if self.peak_flops else None,
            "attn_flop_share": attention_share(flops),
        }

    def log_eval(self, step: int, loss: float, loss_tokens: int) -> None:
        """A metrics line of the held-out loss after `step` (and on the progress bar)."""
        record = _eval_record(step, loss, loss_tokens)
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        self.reporter.log(step, record)
        self.bar.set_postfix(eval_loss=f"{loss:.4f}")


def _eval_record(step: int, loss: float, loss_tokens: int) -> dict[str, Any]:
    return {"step": step, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 700)), "eval_loss_tokens": loss_tokens}


def plot_losses(out: Path) -> Path | None:
    """RUN/loss.png: the training loss of every metrics line and the eval loss of every evaluation,
    against the step; None when metrics.jsonl holds no loss yet."""
    train, held = [], []
    for line in (out / METRICS).read_text(encoding="utf-8").splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("loss") is not None:
            train.append((record["step"], record["loss"]))
        if record.get("eval_loss") is not None:
            held.append((record["step"], record["eval_loss"]))
    if not train and not held:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train loss", color="#1f77b4")
    if held:
        ax.plot(*zip(*held), "o-", label="eval loss", color="#d62728")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (token mean)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / LOSS_PLOT
    fig.savefig(path)
    plt.close(fig)
    return path


def write_summary(out: Path, summary: dict[str, Any], own: dict[str, Any]) -> None:
    """summary.json (rank 0's `summary`), and ranks/rank{r}.json: what each rank did itself (`own`),
    so equal step counts across ranks can be checked."""
    rank = summary["rank"]
    if rank == 0:
        (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (out / RANKS).mkdir(exist_ok=True)
    (out / RANKS / f"rank{rank}.json").write_text(json.dumps(own) + "\n", encoding="utf-8")
