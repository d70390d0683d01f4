"""Helpers shared by the benchmarks in scripts/.

- Shared data: the `../shared` folder (GSM8K, CodeAlpaca, the Llama-2 tokenizer), its records,
  and one line naming what is missing when it is absent.
- Machine facts, timing (best of N), peak memory (a process's RSS high-water mark; CUDA's
  allocator peak), result files (`check_output` before the work, `write_output`: whole or not at
  all, one line on a refused target or a full disk).
- pack-data jobs and the packed folders they write, read back as groups, examples and steps.
- The pieces the training benchmarks share: devices, the Hugging Face baseline model, AdamW,
  autocast, right-padded batches.

Only the standard library is imported here at module level: bench_pack_data.py times fresh
processes that import this module, and the GPU box has neither polars nor datasets. numpy, torch,
transformers and the pipeline/trainer modules are imported by the functions that use them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python scripts/<benchmark>.py` from anywhere
    sys.path.insert(0, str(REPO))

T = TypeVar("T")

# ---------------------------------------------------------------------------------- shared data

GSM8K = Path("datasets") / "gsm8k" / "train.jsonl"
CODEALPACA = Path("datasets") / "codealpaca" / "code_alpaca.json"
LLAMA2 = Path("tokenizers") / "llama2"


def shared_dir() -> Path:
    """The shared data folder: `$SHARED`, else `.devcarry/shared` where it exists (the GPU box),
    else `../shared` beside the repository."""
    if os.environ.get("SHARED"):
        return Path(os.environ["SHARED"])
    carried = REPO / ".devcarry" / "shared"
    return carried if carried.is_dir() else REPO.parent / "shared"


def require(*paths: Path) -> None:
    """Exit with one line naming the first of `paths` that is missing."""
    for path in paths:
        if not path.exists():
            raise SystemExit(f"missing {path}: this benchmark needs the shared data; set SHARED= "
                             "(or --shared) to the folder that holds datasets/ and tokenizers/")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON Lines file (`.jsonl`) or of a file holding one JSON array."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    return json.loads(path.read_text(encoding="utf-8"))


def load_source_examples(shared: Path, limit: int | None = None) -> list[dict[str, str]]:
    """GSM8K then CodeAlpaca as instruction/input/output records (GSM8K: question -> instruction,
    answer -> output), each cut to its first `limit` examples. One record layout for both, because
    pack-data detects one format per run; it renders them with its Alpaca template."""
    gsm, alpaca = shared / GSM8K, shared / CODEALPACA
    require(gsm, alpaca)
    out = [{"instruction": r["question"], "input": "", "output": r["answer"]}
           for r in read_records(gsm)[:limit]]
    out += [{"instruction": r["instruction"], "input": r.get("input") or "", "output": r["output"]}
            for r in read_records(alpaca)[:limit]]
    return out


def seeded_order(records: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    """The fixed, seeded example order every path uses (mixes the two datasets)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    return [records[i] for i in order]


def write_jsonl(path: Path, records: Sequence[dict[str, str]], option: str = "--out") -> None:
    """One JSON object per line, written whole or not at all (`write_output`)."""
    def write(tmp: Path) -> None:
        with tmp.open("w", encoding="utf-8") as handle:
            for rec in records:
                handle.write(json.dumps(rec, ensure_ascii=False) + "\n")

    write_output(path, write, option)


# ------------------------------------------------------------------------------ machine, timing


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_summary() -> str:
    """Architecture, CPU count and Python version, as one line."""
    return f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}"


def device_name(device: torch.device) -> str:
    """The CUDA device's name, or "cpu"."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds one call of `fn` takes, and its result."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def best_of(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    """The fastest of `repeat` calls of `fn` in seconds, and the last call's result."""
    best = float("inf")
    for _ in range(repeat):
        seconds, result = timed(fn)
        best = min(best, seconds)
    return best, result


# ----------------------------------------------------------------------------------- memory


def _status_kb(key: str) -> int | None:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM), or None where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def vmhwm_mb() -> float | None:
    """This process's peak RSS since it started (or since `reset_rss_peak`), in MB."""
    hwm = _status_kb("VmHWM")
    return None if hwm is None else hwm / 1024


def fix_malloc() -> None:
    """Make glibc return every large freed array to the OS, so each call's peak RSS is its own.

    glibc raises its mmap threshold after big frees and then serves the next big arrays from heap
    pages that are already resident, which would hide them from the RSS high-water mark.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD (fixed, no longer dynamic)
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def reset_rss_peak() -> int | None:
    """Reset the RSS high-water mark to the current RSS; return the RSS in kB (None: no /proc)."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_kb("VmRSS")


def rss_peak_extra_mb(base_kb: int | None) -> float | None:
    """The RSS high-water mark over `base_kb` (what `reset_rss_peak` returned), in MB."""
    hwm = _status_kb("VmHWM")
    if base_kb is None or hwm is None:
        return None
    return (hwm - base_kb) / 1024


def reset_cuda_peak(device: torch.device) -> None:
    """Start CUDA's allocator peak afresh (nothing on CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_gib(device: torch.device) -> float | None:
    """CUDA's allocator peak since the last reset, in GiB (None on CPU)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def free_memory(device: torch.device) -> None:
    """Collect garbage and hand CUDA's cached blocks back."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ results


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusals are one line (`PROG: error: ...`, exit 2), without the usage block."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def jsonable(args: argparse.Namespace) -> dict[str, Any]:
    """Command-line arguments as JSON values (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def check_output(path: str | os.PathLike[str], option: str = "--out") -> Path:
    """`path` as a Path, if a script may write a file there; else exit with one line naming it.
    Refused: an existing folder, anything that is not a regular file (a device such as /dev/null,
    a FIFO, a socket) and a path below a regular file. Scripts call it on their output options
    before any work, and `write_output` again before it writes."""
    import stat

    from pipeline.errors import UserError
    from pipeline.folder_lock import check_no_file_in_the_way

    path = Path(path)
    if str(path) in ("", "."):
        raise SystemExit(f"error: {option} {str(path)!r}: name a file to write")
    try:
        check_no_file_in_the_way(path, option)
        mode = path.stat().st_mode
    except UserError as exc:
        raise SystemExit(f"error: {exc}") from None
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise SystemExit(f"error: {option} {path}: {exc.strerror}: choose another {option}") from None
    if stat.S_ISDIR(mode):
        raise SystemExit(f"error: {option} {path} is a folder: name a file to write (one inside it, or another path)")
    if not stat.S_ISREG(mode):
        raise SystemExit(f"error: {option} {path} is not a regular file (a device, FIFO or socket): "
                         "name a regular file to write")
    return path


def check_output_folder(path: str | os.PathLike[str], option: str = "--out") -> Path:
    """`path` as a Path, if a script may write its files into that folder (one that exists, or
    that can be made); else exit with one line naming it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise SystemExit(f"error: {option} {path} is not a folder: name a folder to write into")
    check_output(path / "file", option)  # no regular file on the way
    return path


def write_output(path: str | os.PathLike[str], write: Callable[[Path], None], option: str = "--out") -> None:
    """Create or replace the file `path` whole (`pipeline.durable.write_atomic`: `write(tmp)` fills a
    temporary file beside it, renamed over `path`; a link keeps pointing at the new file); its
    folder is made if missing. A target `check_output` refuses, a full disk or another write error
    exits with one line, leaving nothing behind."""
    import errno

    from pipeline.durable import write_atomic

    target = Path(os.path.realpath(check_output(path, option)))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, write)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SystemExit(f"error: disk full while writing {path}: free some space or choose another "
                             f"{option}; nothing was written") from None
        raise SystemExit(f"error: cannot write {path}: {exc.strerror}: choose another {option}") from None


def write_text_output(path: str | os.PathLike[str], text: str, option: str = "--json") -> None:
    """`write_output` of a UTF-8 text."""
    write_output(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), option)


def write_json(path: str | os.PathLike[str], payload: Any, option: str = "--json") -> None:
    """Write a result file whole (`write_output`; its folder created if needed)."""
    write_text_output(path, json.dumps(payload, indent=2) + "\n", option)


# ------------------------------------------------------------------------------ pack-data jobs

PREP_STRATEGIES = ("pad", "minibatch", "ffd")


def pack_data_args(
    inputs: Sequence[Path], out: Path, *, tokenizer: Path, max_len: int, strategy: str, seed: int,
    num_proc: int = 1,
) -> list[str]:
    """The `pack-data` command-line arguments for one strategy."""
    return [
        *map(str, inputs),
        "--tokenizer", str(tokenizer), "--max-len", str(max_len), "--out", str(out),
        "--strategy", strategy, "--seed", str(seed), "--overwrite", "--no-progress",
        "--num-proc", str(num_proc),
    ]  # fmt: skip


@dataclass
class PackJob:
    """One pack-data run: `inputs` -> `out` with `strategy`; skipped when `stamp` matches."""

    inputs: list[Path]
    out: Path
    strategy: str
    stamp: dict[str, Any]
    max_len: int | None = None  # None: run_pack_jobs' max_len


def run_pack_jobs(jobs: Sequence[PackJob], *, tokenizer: Path, max_len: int, seed: int,
                  num_proc: int = 1) -> None:
    """Run `pack-data` (its click command, in this process: one import of transformers for all)
    for the jobs whose output is missing or stale."""
    import click

    from pipeline.cli import pack_data

    for job in jobs:
        stamp_file = job.out.parent / f"{job.out.name}.stamp.json"
        if ((job.out / "manifest.json").is_file() and stamp_file.is_file()
                and json.loads(stamp_file.read_text()) == job.stamp):
            print(f"  reusing {job.out}")
            continue
        job_len = job.max_len or max_len
        args = pack_data_args(job.inputs, job.out, tokenizer=tokenizer, max_len=job_len,
                              strategy=job.strategy, seed=seed, num_proc=num_proc)
        t0 = time.perf_counter()
        try:
            pack_data.main(args=args, standalone_mode=False)
        except click.ClickException as exc:
            raise SystemExit(f"pack-data {' '.join(args)} failed: {exc.format_message()}") from None
        write_text_output(stamp_file, json.dumps(job.stamp), "--workdir")
        print(f"  pack-data --strategy {job.strategy} --max-len {job_len} -> {job.out.name}: "
              f"{time.perf_counter() - t0:.1f} s")


def prepare_data(
    workdir: Path, shared: Path, *, limit: int | None, seed: int, max_len: int,
    strategies: Sequence[str] = PREP_STRATEGIES, tokenizer: Path | None = None, num_proc: int = 1,
) -> dict[str, Path]:
    """Write GSM8K + CodeAlpaca as one seeded instruction/input/output JSONL and pack it once per
    strategy; returns the folders by strategy."""
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or shared / LLAMA2
    stamp = {"limit": limit, "seed": seed, "max_len": max_len, "tokenizer": str(tokenizer),
             "shared": str(shared.resolve())}
    inputs = workdir / "examples.jsonl"
    input_stamp = workdir / "examples.stamp.json"
    if not (inputs.is_file() and input_stamp.is_file()
            and json.loads(input_stamp.read_text()) == stamp):
        write_jsonl(inputs, seeded_order(load_source_examples(shared, limit), seed))
        write_text_output(input_stamp, json.dumps(stamp), "--workdir")
    jobs = [PackJob([inputs], workdir / s, s, {**stamp, "strategy": s}) for s in strategies]
    run_pack_jobs(jobs, tokenizer=tokenizer, max_len=max_len, seed=seed, num_proc=num_proc)
    return {job.strategy: job.out for job in jobs}


def tokenizer_ids(folder: Path) -> tuple[int, int]:
    """(vocab size, padding id) of a packed folder's tokenizer; Llama-2 has no pad token, so EOS
    pads (padded positions carry no loss)."""
    from pipeline.shards import read_manifest

    tok = read_manifest(folder).tokenizer
    pad_id = tok.get("pad_token_id")
    pad_id = int(pad_id if pad_id is not None else tok.get("eos_token_id") or 0)
    return int(tok.get("vocab_size") or 32000), pad_id


# ----------------------------------------------------------------------------- packed folders


def minibatch_groups(folder: Path, group_size: int = 32) -> list[list[dict[str, np.ndarray]]]:
    """The rows of a `minibatch` folder cut back into their groups (rows never mix groups, and every
    group but the last holds exactly `group_size` examples)."""
    from pipeline.shards import iter_rows

    groups: list[list[dict[str, np.ndarray]]] = []
    current: list[dict[str, np.ndarray]] = []
    seen: set[int] = set()
    for row in iter_rows(folder):
        current.append(row)
        seen.update(int(e) for e in row["example_ids"])
        if len(seen) >= group_size:
            if len(seen) > group_size:
                raise ValueError(f"{folder}: a group holds {len(seen)} > {group_size} examples: "
                                 "was it packed with --strategy minibatch and this group size?")
            groups.append(current)
            current, seen = [], set()
    if current:
        groups.append(current)
    return groups


def group_example_ids(group: Sequence[dict[str, np.ndarray]]) -> list[int]:
    """Example ids of a group in first-seen order (a split example counted once)."""
    import numpy as np

    ids = np.concatenate([r["example_ids"] for r in group]).tolist()
    return list(dict.fromkeys(int(i) for i in ids))


def examples_by_id(pad_folder: Path) -> dict[int, dict[str, np.ndarray]]:
    """input_ids + labels of every example of a `pad` folder (one example per row), by example id."""
    from pipeline.shards import iter_rows

    out: dict[int, dict[str, np.ndarray]] = {}
    for row in iter_rows(pad_folder):
        if len(row["seq_lens"]) != 1:
            raise ValueError(f"{pad_folder}: a row holds {len(row['seq_lens'])} examples; "
                             "expected --strategy pad (one example per row)")
        out[int(row["example_ids"][0])] = {"input_ids": row["input_ids"], "labels": row["labels"]}
    return out


def ffd_steps(folder: Path, tokens_per_step: int) -> list[list[dict[str, np.ndarray]]]:
    """Rows of a packed folder in stored order, cut greedily into steps of <= tokens_per_step
    (the trainer's own cut, `trainer.data.stream.greedy_cuts`)."""
    import numpy as np

    from pipeline.shards import iter_rows
    from trainer.data.stream import greedy_cuts

    rows = list(iter_rows(folder))
    lengths = np.array([len(r["input_ids"]) for r in rows], dtype=np.int64)
    cuts = greedy_cuts(lengths, tokens_per_step)
    return [rows[a:b] for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist())]


# -------------------------------------------------------------------- training benchmarks


def resolve_device(name: str) -> torch.device:
    """`cuda` -> `cuda:<current>` (torch.cuda.set_device, which pack-train calls, needs an index)."""
    import torch

    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing on CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_config(preset: str, vocab_size: int | None) -> Any:
    """The transformers config of a packlm preset (or a local model folder)."""
    from trainer.model.load import PRESETS, preset_config

    if preset in PRESETS:
        return preset_config(preset, vocab_size)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(preset, local_files_only=True)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    return config


def build_hf_model(preset: str, attn: str, device: torch.device, vocab_size: int | None,
                   seed: int) -> torch.nn.Module:
    """A plain HF causal LM with a stock attention implementation, fp32 weights, seeded init."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(preset, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # drawn on the CPU like build_model: the same initial weights
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                 dtype=torch.float32)
    return model.to(device).train()


def make_optimizer(model: torch.nn.Module, lr: float, device: torch.device,
                   optimizer: str = "adamw", master_weights: bool = False) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA, or torch's Adafactor (the same settings for every path).
    `master_weights`: AdamW as pack-train's --dtype bf16-weights runs it (`trainer.model.precision.MasterAdamW`,
    which turns the model's weights into bf16 and keeps their fp32 masters)."""
    import torch

    if master_weights:
        from trainer.model.precision import MasterAdamW

        return MasterAdamW([{"params": list(model.parameters()), "weight_decay": 0.1}], lr=lr, betas=(0.9, 0.95))
    if optimizer == "adafactor":
        trained = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.Adafactor(trained, lr=lr, weight_decay=0.1, foreach=True)
    kwargs: dict[str, Any] = {"lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if device.type == "cuda":
        kwargs["fused"] = True
    return torch.optim.AdamW(model.parameters(), **kwargs)


def optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """Backward, gradient norm clipped at 1 (the HF Trainer's default, pack-train's --grad-clip 1),
    AdamW step, gradients dropped. A `MasterAdamW` clips its fp32 masters inside its step, as in
    pack-train."""
    import torch

    from trainer.model.precision import MasterAdamW

    loss.backward()
    if isinstance(opt, MasterAdamW):
        opt.clip_grad_norm_(1.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def autocast_ctx(device: torch.device, dtype: str) -> Any:
    """bf16 autocast (weights stay fp32) or nothing."""
    import torch

    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def pad_collate(examples: Sequence[dict[str, np.ndarray]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad examples to the longest: input_ids (pad_id), attention_mask, labels (-100)."""
    import numpy as np
    import torch

    from pipeline.shards import IGNORE_INDEX

    lens = [len(e["input_ids"]) for e in examples]
    longest = max(lens)
    input_ids = np.full((len(examples), longest), pad_id, dtype=np.int64)
    labels = np.full((len(examples), longest), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((len(examples), longest), dtype=np.int64)
    for i, (e, n) in enumerate(zip(examples, lens)):
        input_ids[i, :n] = e["input_ids"]
        labels[i, :n] = e["labels"]
        mask[i, :n] = 1
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(mask),
        "labels": torch.from_numpy(labels),
    }


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A batch's tensors on `device` (pinned, non-blocking copies to CUDA); other values (a
    flattening collator's `max_length_q`) as they are."""
    import torch

    def move(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        return v.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else v.to(device)

    return {k: move(v) for k, v in batch.items()}


def flop_rates(model: float, attention: float, seconds: float, peak_tflops: float = 989.0) -> dict[str, float]:
    """Model TFLOP/s a device from FLOPs counted by `pipeline.report.flops` (dense and causal
    attention from the examples' lengths) over `seconds` of one device (a run on N devices: N x its
    wall time), its MFU against `peak_tflops` (an H100/H200's bf16 dense peak by default), and
    attention's share of the FLOPs.

    >>> flop_rates(989e12, 98.9e12, 2.0)
    {'tflops': 494.5, 'mfu': 0.5, 'attn_flop_share': 0.1}
    """
    tflops = model / seconds / 1e12 if seconds > 0 else 0.0
    return {"tflops": tflops, "mfu": tflops / peak_tflops, "attn_flop_share": attention / model if model else 0.0}
