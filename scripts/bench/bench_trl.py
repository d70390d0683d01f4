"""TRL's SFTTrainer end to end against pack-train on the same examples, one GPU (issue 57).

    python scripts/bench/bench_trl.py --model llama-1b --lora-r 0 --max-len 16384 --steps 8 --warmup 3 \
        --paths trl+liger+ckpt,trl+liger,trl+ckpt,packlm+ckpt,packlm --json bench_trl_1b.json
    python scripts/bench/bench_trl.py --model tiny --device cpu --limit 200 --max-len 1024 --steps 3 --warmup 1 \
        --paths trl,packlm
    python scripts/bench/bench_trl.py --model llama-8b --lora-r 16 --lengths 32768,65536,131072,196608 \
        --steps 2 --warmup 1 --paths trl+liger+ckpt+offload,packlm+ckpt+long --json bench_trl_longest.json

Data: GSM8K + CodeAlpaca from `../shared` in one seeded order, packed once by pack-data with
`--strategy ffd --max-len L` (`scripts.benchlib.prepare_data`, as bench_train.py makes its rows). pack-train
trains that folder with `--tokens-per-step L` (one row a step). TRL gets the same examples: the
folder's rows cut back into their examples (`scripts.benchlib.train_steps.row_examples`) as a pre-tokenized
`datasets.Dataset` of `input_ids` and `completion_mask` (1 where pack-data's label is not -100), and
packs them itself (`packing=True, packing_strategy="bfd"`, padding-free, `max_length=L`,
`completion_only_loss=True`, so the loss falls on exactly pack-data's loss tokens). Before training,
the TRL run (`scripts.benchlib.trl_run`) checks that its packed dataset holds the folder's examples,
tokens and loss tokens.

A path is `trl` or `packlm` with options: `+ckpt` recomputes every decoder layer in the backward
(TRL: HF gradient checkpointing, use_reentrant=False; pack-train: --grad-checkpointing), `+liger`
(TRL only) Liger's kernels (`use_liger_kernel=True`), `+compile` (TRL only) the Trainer's
`torch_compile=True` (the whole model through torch.compile: inductor, default mode), `+offload`
(TRL only) `activation_offloading=True` (what the forward saves for the backward in CPU memory),
`+fa4` (TRL only) transformers' `flash_attention_4` (FlashAttention-4, where flash-attn-4 is installed),
`+long` (pack-train only) its long-row levers, `--tile-mlp 8192 --offload-activations`. Both: bf16
autocast on CUDA (fp32 on the CPU); `--lora-r 16` puts LoRA adapters on every linear layer of the
decoder (pack-train's `--lora-target all`, alpha 16, no dropout) over a bf16 frozen base, `--lora-r 0` trains every
weight (fp32 master weights); AdamW (fused on CUDA), constant learning rate, no warmup, no saving,
no evaluation. TRL's model: the preset's config with random weights (seeded), FlashAttention-2 on
CUDA (FlashAttention-4 with `+fa4`), sdpa on the CPU. pack-train runs with its own defaults otherwise (its attention choice and,
on CUDA, its compiled layers unless --no-compile).

The longest example each path trains (`--lengths L1,L2,...`): instead of GSM8K + CodeAlpaca, rows
of one example of random ids below the preset's vocabulary (`scripts.benchlib.packing.write_long_folder`,
--steps rows), one length after another in ascending order, each at `--max-len` = that length; a
path stops at its first length that does not train (out of memory, or pack-train's memory check
refusing the row), and the summary names the longest length each path trained.

`--gpu-memory-gib G` caps what each path's allocator may reserve
(`torch.cuda.set_per_process_memory_fraction`; pack-train's memory check reads the same cap), so a
larger GPU stands in for a smaller card's memory, not its speed: 78 on an H200 for an H100 80GB.

Each path runs in its own subprocess (a fresh CUDA context; an out-of-memory path is a result,
"OOM", and the other paths still run). Each trains `--steps` S steps in all; tokens/s is over steps
W+1..S (W = --warmup): the non-padding tokens of those steps over their wall time (TRL: a callback
synchronizing CUDA at each step end, the tokens counted as the collator builds each batch;
pack-train: its metrics.jsonl lines). Peak memory: torch.cuda.max_memory_allocated (TRL) and
pack-train's peak_mem_gib. The summary prints one line per path and pack-train's speed over TRL's
at the same recompute setting (the faster TRL path with that setting) and over TRL's fastest path.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from scripts.benchlib import add_bench_args, check_output, write_text_output  # noqa: E402
from scripts.benchlib.trl_data import folder_totals  # noqa: E402
from scripts.benchlib.trl_run import run_trl  # noqa: E402

RUNNERS = ("trl", "packlm")
OPTIONS = {"trl": ("liger", "ckpt", "compile", "offload", "fa4"), "packlm": ("ckpt", "long", "keep")}
DEFAULT_PATHS = "trl+liger+ckpt,trl+liger,trl+ckpt,packlm+ckpt,packlm"


def parse_path(path: str) -> tuple[str, set[str]]:
    """(runner, options) of a path name; ValueError naming the path otherwise.

    >>> runner, options = parse_path("trl+liger+ckpt")
    >>> runner, sorted(options)
    ('trl', ['ckpt', 'liger'])
    """
    runner, *options = path.split("+")
    if runner not in RUNNERS or any(o not in OPTIONS[runner] for o in options) or len(set(options)) < len(options):
        raise ValueError(f"path {path!r}: expected trl[+liger][+ckpt][+compile][+offload][+fa4] or packlm[+ckpt][+long][+keep]")
    return runner, set(options)


# --------------------------------------------------------------------------------------- one path


def run_packlm(a: argparse.Namespace, options: set[str]) -> dict[str, Any]:
    """One pack-train run (`trainer.train`, what the CLI runs) on the packed folder; the result record."""
    from pipeline.errors import UserError
    from scripts.benchlib import flop_rates
    from scripts.benchlib.train_results import timed_result
    from scripts.benchlib.train_runs import no_checkpoint_writes
    from trainer import TrainConfig, train

    out = tempfile.mkdtemp(prefix="packlm-", dir=a.workdir)
    config = TrainConfig(
        data=a.folder,
        model=a.model,
        out=out,
        tokens_per_step=a.max_len,
        grad_accum=1,
        lr=a.lr,
        warmup=0,
        schedule="constant",
        max_steps=a.steps,
        seed=a.seed,
        log_every=1,
        lora_r=a.lora_r,
        grad_checkpointing=1 if "ckpt" in options else 0,
        compile=False if a.no_compile else None,
        device=a.device,
        progress=False,
        tile_mlp=8192 if "long" in options else 0,
        offload_activations="long" in options,
        keep_attention="keep" in options,
    )
    try:
        with no_checkpoint_writes():
            summary = train(config)
    except UserError as exc:
        if "out of GPU memory" in str(exc):
            return {"status": "OOM", "note": str(exc)[:300]}
        if "could fit" in str(exc):  # the memory check before the first step refused the row
            return {"status": "refused", "note": str(exc)[:400]}
        raise
    records = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    res, _ = timed_result("packlm", "pack-train", records, a.warmup, a.steps - a.warmup)
    timed = [r for r in records if a.warmup < r["step"] <= a.steps and r.get("tflops") is not None]
    model = sum(r["tflops"] * 1e12 * r["step_time_s"] for r in timed)  # pack-train's own count, one step a line
    attention = sum(r["attn_flop_share"] * r["tflops"] * 1e12 * r["step_time_s"] for r in timed)
    return {
        "status": "ok" if res.ok else "short",
        "note": res.note,
        "steps": records[-1]["step"] if records else 0,
        "timed_steps": res.steps,
        "tokens": res.tokens,
        "seconds": res.seconds,
        "tokens_per_s": res.tokens / res.seconds if res.seconds > 0 else 0.0,
        **flop_rates(model, attention, res.seconds),
        "tokens_all_steps": records[-1]["tokens"] if records else 0,
        "final_loss": res.final_loss,
        "peak_gib": records[-1].get("peak_mem_gib") if records and a.device.startswith("cuda") else None,
        "runner": f"pack-train, {summary.get('attention')}",
        "params": summary.get("params"),
    }


def run_one(a: argparse.Namespace) -> None:
    """The child process: one path, its record written to --result (OOM is a record)."""
    import torch

    runner, options = parse_path(a.one)
    if a.gpu_memory_gib:  # the allocator may reserve this much of the GPU and no more
        index = torch.device(a.device).index
        index = torch.cuda.current_device() if index is None else index
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.gpu_memory_gib * 2**30 / total), index)
    try:
        record = (run_trl if runner == "trl" else run_packlm)(a, options)
    except torch.OutOfMemoryError as exc:
        record = {"status": "OOM", "note": str(exc).splitlines()[0][:300]}
    record = {"path": a.one, **record}
    write_text_output(a.result, json.dumps(record, indent=1), "--result")


# ------------------------------------------------------------------------------------- the parent


def child_args(a: argparse.Namespace, path: str, folder: Path, result: Path) -> list[str]:
    """The command line of one path's subprocess."""
    return (
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--one",
            path,
            "--folder",
            str(folder),
            "--result",
            str(result),
            "--model",
            a.model,
            "--lora-r",
            str(a.lora_r),
            "--max-len",
            str(a.max_len),
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.warmup),
            "--lr",
            str(a.lr),
            "--seed",
            str(a.seed),
            "--device",
            a.device,
            "--workdir",
            str(a.workdir),
            "--shared",
            str(a.shared),
        ]
        + (["--no-compile"] if a.no_compile else [])
        + (["--gpu-memory-gib", str(a.gpu_memory_gib)] if a.gpu_memory_gib else [])
    )


def ratios(records: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """pack-train's tokens/s over TRL's, per packlm path: against the fastest TRL path with the same
    recompute setting, and against TRL's fastest path.

    >>> recs = [{"path": "trl+ckpt", "status": "ok", "tokens_per_s": 10.0},
    ...         {"path": "trl+liger", "status": "ok", "tokens_per_s": 20.0},
    ...         {"path": "packlm+ckpt", "status": "ok", "tokens_per_s": 30.0}]
    >>> ratios(recs)["packlm+ckpt"]
    {'vs_trl_same_recompute': 3.0, 'vs_trl_best': 1.5, 'trl_same_recompute': 'trl+ckpt', 'trl_best': 'trl+liger'}
    """
    ok = [r for r in records if r.get("status") == "ok" and r.get("tokens_per_s")]
    trl = [r for r in ok if parse_path(r["path"])[0] == "trl"]
    out: dict[str, dict[str, Any]] = {}
    for r in ok:
        runner, options = parse_path(r["path"])
        if runner != "packlm":
            continue
        same = [t for t in trl if ("ckpt" in parse_path(t["path"])[1]) == ("ckpt" in options)]
        peer = max(same, key=lambda t: t["tokens_per_s"], default=None)
        best = max(trl, key=lambda t: t["tokens_per_s"], default=None)
        out[r["path"]] = {
            "vs_trl_same_recompute": r["tokens_per_s"] / peer["tokens_per_s"] if peer else None,
            "vs_trl_best": r["tokens_per_s"] / best["tokens_per_s"] if best else None,
            "trl_same_recompute": peer["path"] if peer else None,
            "trl_best": best["path"] if best else None,
        }
    return out


def line(r: dict[str, Any]) -> str:
    """One summary line of a path's record."""
    if r.get("status") != "ok":
        return f"{r['path']:<16} {r.get('status')}: {r.get('note', '')}"
    peak = f"{r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else "-"
    mfu = f"  MFU {r['mfu']:.1%} ({r['tflops']:,.0f} TFLOP/s)" if r.get("tflops") is not None else ""
    return (
        f"{r['path']:<16} {r['tokens_per_s']:>10,.0f} tok/s  over {r['timed_steps']} steps, {r['tokens']} tokens"
        f"{mfu}  peak {peak}  loss {r.get('final_loss')}  ({r.get('runner')})"
    )


def run_path(a: argparse.Namespace, path: str, folder: Path) -> dict[str, Any]:
    """One path in its own subprocess on `folder` (at `a.max_len`); its record, printed as a line."""
    result = a.workdir / f"result-{path}.json"
    result.unlink(missing_ok=True)
    print(f"== {path}" + (f" at {a.max_len:,} tokens" if a.lengths else ""), flush=True)
    try:
        proc = subprocess.run(child_args(a, path, folder, result), stderr=subprocess.PIPE, text=True, timeout=a.path_timeout)
    except subprocess.TimeoutExpired as exc:
        sys.stderr.write(exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or "")
        record = {"path": path, "status": "timeout", "note": f"stopped after --path-timeout {a.path_timeout} s"}
    else:
        sys.stderr.write(proc.stderr)  # in full: a failed path's traceback is the report
        if result.is_file():
            record = json.loads(result.read_text())
        else:
            tail = proc.stderr.strip().splitlines()[-1:] or [""]
            record = {"path": path, "status": "failed", "note": f"exit {proc.returncode}: {tail[0][:300]}"}
    record["length"] = a.max_len
    print(line(record), flush=True)
    return record


def longest(records: list[dict[str, Any]]) -> dict[str, int | None]:
    """The longest length each path trained (None: not even the first).

    >>> longest([{"path": "trl", "length": 8, "status": "ok"}, {"path": "trl", "length": 16, "status": "OOM"},
    ...          {"path": "packlm", "length": 8, "status": "OOM"}])
    {'trl': 8, 'packlm': None}
    """
    out: dict[str, int | None] = {}
    for r in records:
        out.setdefault(r["path"], None)
        if r.get("status") == "ok":
            out[r["path"]] = max(out[r["path"]] or 0, r["length"])
    return out


def run_lengths(a: argparse.Namespace, paths: list[str]) -> dict[str, Any]:
    """--lengths: each path at each length, ascending, until its first length that does not train."""
    from scripts.benchlib.packing import write_long_folder
    from trainer.model.load import preset_config

    vocab = preset_config(a.model).vocab_size  # both trainers build the preset with it
    lengths = sorted({int(x) for x in a.lengths.split(",") if x})
    records: list[dict[str, Any]] = []
    going = list(paths)
    for length in lengths:
        folder = a.workdir / f"long-{length}-{a.steps}"
        if not (folder / "manifest.json").is_file():
            write_long_folder(folder, length, rows=a.steps, seed=a.seed, vocab=vocab, record_vocab=True)
        a.max_len = length
        for path in list(going):
            record = run_path(a, path, folder)
            records.append(record)
            if record.get("status") != "ok":
                going.remove(path)
    found = longest(records)
    for path, n in found.items():
        print(f"{path}: the longest example that trained: {f'{n:,} tokens' if n else 'none of those tried'}")
    compared = {str(n): ratios([r for r in records if r["length"] == n]) for n in lengths}
    return {
        "model": a.model,
        "lora_r": a.lora_r,
        "lengths": lengths,
        "steps": a.steps,
        "warmup": a.warmup,
        "device": a.device,
        "gpu_memory_gib": a.gpu_memory_gib,
        "data": "rows of one example of random ids (bench_context_parallel.write_long_folder)",
        "results": records,
        "longest": found,
        "ratios_by_length": compared,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(
        p,
        model=("llama-1b", "trainer.model.presets name (llama-1b, llama-8b, tiny)"),
        lora_r=(0, "0: full fine-tune; r: LoRA rank on every linear layer"),
        max_len=(16384, "pack-data --max-len = TRL max_length = tokens a step"),
        steps=(8, "steps in all (the first --warmup are not timed)"),
        warmup=3,
    )
    p.add_argument("--paths", default=DEFAULT_PATHS)
    add_bench_args(p, lr=1e-5, seed=0, device="cuda", limit=(None, "examples read from each data set (default: all)"))
    p.add_argument("--no-compile", action="store_true", help="pack-train --no-compile")
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="cap each path's GPU memory (torch.cuda.set_per_process_memory_fraction), e.g. 78 "
        "on a larger GPU to stand in for an 80 GB card's memory (not its speed)",
    )
    p.add_argument("--path-timeout", type=float, default=None, help="seconds a path may run (then: 'timeout')")
    add_bench_args(p, workdir=Path("/tmp/bench_trl"), shared=(None, "shared data folder (default: benchlib.shared_dir)"))
    p.add_argument("--lengths", default=None, help="comma separated example lengths: the longest each path trains (see the module)")
    add_bench_args(p, json=str)
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child: run this path only
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.json:
        check_output(a.json, "--json")
    if a.one:
        run_one(a)
        return None
    from scripts.benchlib import prepare_data, shared_dir

    paths = [x for x in a.paths.split(",") if x]
    for path in paths:
        parse_path(path)
    if not 0 <= a.warmup < a.steps:
        p.error("--warmup must be below --steps")
    a.shared = a.shared or shared_dir()
    a.workdir.mkdir(parents=True, exist_ok=True)
    if a.lengths:
        return _finish(a, run_lengths(a, paths))
    data = a.workdir / f"data-{a.max_len}-{a.limit}"
    folder = prepare_data(data, a.shared, limit=a.limit, seed=a.seed, max_len=a.max_len, strategies=("ffd",))["ffd"]
    totals = folder_totals(folder)
    print(f"data: {folder}: {totals}", flush=True)
    records = [run_path(a, path, folder) for path in paths]
    compared = ratios(records)
    for path, r in compared.items():
        same = f"{r['vs_trl_same_recompute']:.2f}x {r['trl_same_recompute']}" if r["vs_trl_same_recompute"] else "-"
        best = f"{r['vs_trl_best']:.2f}x {r['trl_best']}" if r["vs_trl_best"] else "-"
        print(f"{path}: {same} (same recompute); {best} (TRL's best)")
    payload = {
        "model": a.model,
        "lora_r": a.lora_r,
        "max_len": a.max_len,
        "steps": a.steps,
        "warmup": a.warmup,
        "device": a.device,
        "data": {"folder": str(folder), **totals},
        "results": records,
        "ratios": compared,
    }
    return _finish(a, payload)


def _finish(a: argparse.Namespace, payload: dict[str, Any]) -> dict[str, Any]:
    """The GPU's name added, the payload written to --json; the payload."""
    if a.device.startswith("cuda"):
        import torch

        payload["gpu"] = torch.cuda.get_device_name(0)
    if a.json:
        write_text_output(a.json, json.dumps(payload, indent=1))
    return payload


if __name__ == "__main__":
    main()
