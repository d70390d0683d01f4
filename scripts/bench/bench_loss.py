#!/usr/bin/env python
"""Loss behaviour: padding vs packing (issue 6, the paper's loss claim).

Trains the same randomly initialised model (`--model`, default the ~100M `llama-100m` preset) from
scratch for exactly one epoch of GSM8K + CodeAlpaca (minus a held-out split) once per method, with the
same learning-rate schedule as a function of *examples seen*, and reports training loss against
examples seen (a PNG plot) and the held-out mean token loss, measured by one evaluation routine for
every method.

Methods (`--methods`):

- `pad`       batches of `--group` (32) examples right-padded to the longest, attention mask, HF `sdpa`
              model and HF's own `labels=` loss. The groups are exactly those of `minibatch`.
- `minibatch` `pack-data --strategy minibatch`: each group of 32 examples packed into rows of
              `--max-len`; one optimizer step = one group, packlm varlen attention + `packed_loss`.
- `shuffle`   `pack-data --strategy shuffle` rows, and
- `ffd`       `pack-data --strategy ffd` rows: rows in stored (seeded random) order, cut greedily into
              steps of at most T tokens, T = the mean tokens of a 32-example group, so a step holds
              about as many tokens (and examples) as in the first two methods.
- `ffd-full`  `pack-data --strategy ffd --max-len --full-len` (8192) rows, one full row per optimizer
              step: the paper's throughput setting, fewer and fuller steps per epoch (about 1.3x
              the tokens of a 32-example group here), so fewer optimizer updates for the same data.

A packed method may add `+bf16-weights` (e.g. `ffd+bf16-weights`): the same steps with pack-train's
`--dtype bf16-weights`, bf16 weights for the forward and backward and AdamW on fp32 master weights
(`trainer.model.precision.MasterAdamW`, the same betas and weight decay), still under bf16 autocast; its
held-out loss is measured with the fp32 masters as the weights. Comparing it with the plain method
shows what computing with bf16 weights does to the loss.

Every step's loss is the mean over its loss tokens (the sum over the step divided by the step's
loss-token count), which is what HF's padded loss computes too. The split: the seeded example order
is cut into train and the last `--holdout` fraction (held out), both written as JSONL in `--workdir`;
the held-out examples are packed with `--strategy pad` and evaluated in padded batches with `sdpa`
attention for every model (the stock kernel as the common referee). Training runs in this process
(`build_model` + `collate_rows` + `packed_loss` for the packed methods), because `pack-train` has no
padding mode and schedules by steps, not by examples seen.

Precision: bf16 autocast over fp32 weights (as `pack-train --dtype bf16`); fused AdamW on CUDA.

    python scripts/bench/bench_loss.py --device cuda --json bench_loss.json --plot docs/loss_curves.png
    python scripts/bench/bench_loss.py --device cpu --model tiny --limit 200
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from pipeline.shards import iter_rows, read_manifest  # noqa: E402
from scripts.benchlib import (  # noqa: E402
    AUTO_DEVICE,
    LLAMA2,
    REPO,
    PackJob,
    add_bench_args,
    autocast_ctx,
    build_hf_model,
    check_output,
    cuda_peak_gib,
    device_name,
    examples_by_id,
    ffd_steps,
    free_memory,
    group_example_ids,
    heldout_loss,
    jsonable,
    load_source_examples,
    machine_summary,
    make_optimizer,
    minibatch_groups,
    optimizer_step,
    pad_collate,
    reset_cuda_peak,
    resolve_device,
    run_pack_jobs,
    seeded_order,
    shared_dir,
    sync,
    to_device,
    tokenizer_ids,
    write_json,
    write_jsonl,
    write_output,
    write_text_output,
)
from scripts.benchlib.args import default_pack_procs, default_workdir  # noqa: E402

METHODS = ("pad", "minibatch", "shuffle", "ffd", "ffd-full")
BF16_WEIGHTS = "+bf16-weights"  # a packed method's tuning (see the module)


# ------------------------------------------------------------------------------------------ data


def split_records(records: list[dict[str, str]], holdout: float) -> tuple[list, list]:
    """(train, held-out): the last ceil(holdout * n) records of the seeded order are held out."""
    n_hold = max(1, math.ceil(holdout * len(records))) if holdout > 0 else 0
    return records[: len(records) - n_hold], records[len(records) - n_hold :]


def prepare(args: argparse.Namespace, shared: Path) -> dict[str, Path]:
    """Write train/held-out JSONL and pack them; returns folders keyed by method (+ "heldout")."""
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = args.tokenizer or shared / LLAMA2
    stamp = {
        "limit": args.limit,
        "seed": args.seed,
        "holdout": args.holdout,
        "tokenizer": str(tokenizer),
        "shared": str(shared.resolve()),
        "max_len": args.max_len,
    }
    train_file, held_file = work / "train.jsonl", work / "heldout.jsonl"
    stamp_file = work / "split.stamp.json"
    if not (train_file.is_file() and held_file.is_file() and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp):
        records = seeded_order(load_source_examples(shared, args.limit), args.seed)
        train, held = split_records(records, args.holdout)
        write_jsonl(train_file, train)
        write_jsonl(held_file, held)
        write_text_output(stamp_file, json.dumps(stamp), "--workdir")
    need = sorted(({m.removesuffix(BF16_WEIGHTS) for m in args.methods} - {"ffd-full"}) | {"minibatch", "pad"})
    jobs = [PackJob([train_file], work / f"train-{s}", s, {**stamp, "strategy": s}) for s in need]
    if any(m.startswith("ffd-full") for m in args.methods):
        jobs.append(
            PackJob(
                [train_file], work / "train-ffd-full", "ffd", {**stamp, "strategy": "ffd", "max_len": args.full_len}, max_len=args.full_len
            )
        )
    jobs.append(PackJob([held_file], work / "heldout-pad", "pad", {**stamp, "strategy": "pad", "split": "heldout"}))
    run_pack_jobs(jobs, tokenizer=tokenizer, max_len=args.max_len, seed=args.seed, num_proc=args.pack_procs)
    folders = {job.out.name.removeprefix("train-"): job.out for job in jobs}
    folders["heldout"] = folders.pop("heldout-pad")
    return folders


@dataclass
class Step:
    """One optimizer step of a method: packed rows, or (pad) example ids."""

    rows: list[dict[str, np.ndarray]] | None = None
    example_ids: list[int] | None = None
    examples: int = 0
    tokens: int = 0


def method_steps(
    method: str, folders: dict[str, Path], group: int, budget: int, examples: dict[int, dict[str, np.ndarray]] | None
) -> list[Step]:
    """The steps of one epoch of `method` (see the module docstring; a tuning changes none)."""
    method = method.removesuffix(BF16_WEIGHTS)
    if method in ("pad", "minibatch"):
        out = []
        for rows in minibatch_groups(folders["minibatch"], group):
            ids = group_example_ids(rows)
            tokens = sum(len(r["input_ids"]) for r in rows)
            out.append(
                Step(rows=None if method == "pad" else rows, example_ids=ids if method == "pad" else None, examples=len(ids), tokens=tokens)
            )
        return out
    if method == "ffd-full":
        budget = read_manifest(folders[method]).max_len  # one full row per step
    out = []
    for rows in ffd_steps(folders[method], budget):
        ids = np.unique(np.concatenate([r["example_ids"] for r in rows]))
        out.append(Step(rows=rows, examples=len(ids), tokens=sum(len(r["input_ids"]) for r in rows)))
    return out


# ---------------------------------------------------------------------------------------- train


def lr_at(examples_seen: int, total: int, peak: float, warmup_frac: float, min_ratio: float) -> float:
    """Linear warmup over the first `warmup_frac` of the epoch's examples, then cosine to
    `min_ratio * peak` at the end of the epoch: a function of examples seen, not of steps."""
    warm = max(1.0, warmup_frac * total)
    if examples_seen < warm:
        return peak * (examples_seen + 1) / warm
    progress = min(1.0, (examples_seen - warm) / max(1.0, total - warm))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class MethodResult:
    method: str
    steps: int = 0
    examples: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    final_train_loss: float | None = None  # mean of the last 5% of steps
    heldout_loss: float | None = None
    peak_gib: float | None = None
    attention: str = ""
    curve: list[tuple[int, float]] = field(default_factory=list)  # (examples seen, step loss)


def build(method: str, args: argparse.Namespace, device: torch.device, vocab: int):
    """The model of a method: HF sdpa for `pad`, packlm's varlen backend otherwise; same init."""
    if method == "pad":
        return build_hf_model(args.model, "sdpa", device, vocab, args.seed), "hf/sdpa"
    from trainer.model.load import build_model

    model, backend = build_model(args.model, attn=args.attn, device=device, dtype=torch.float32, vocab_size=vocab, seed=args.seed)
    return model, f"packlm/{backend}"


def train_method(
    method: str,
    steps: list[Step],
    args: argparse.Namespace,
    device: torch.device,
    vocab: int,
    examples: dict[int, dict[str, np.ndarray]],
    pad_id: int,
    held: Sequence[dict[str, np.ndarray]],
) -> MethodResult:
    """One epoch of `method` (with its tuning, if any), then its held-out loss (`heldout_loss`, with
    the fp32 masters as the weights under +bf16-weights)."""
    from trainer.data.batch import collate_rows
    from trainer.model.loss import packed_loss
    from trainer.model.precision import MasterAdamW

    base = method.removesuffix(BF16_WEIGHTS)
    reset_cuda_peak(device)
    model, attention = build(base, args, device, vocab)
    opt = make_optimizer(model, args.lr, device, master_weights=method.endswith(BF16_WEIGHTS))
    total = sum(s.examples for s in steps)
    res = MethodResult(method=method, attention=attention)
    losses: list[torch.Tensor] = []
    seen: list[int] = []
    n_seen = 0
    sync(device)
    t0 = time.perf_counter()
    for step in steps:
        lr = lr_at(n_seen, total, args.lr, args.warmup_frac, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        if base == "pad":
            batch = to_device(pad_collate([examples[i] for i in step.example_ids], pad_id), device)
            with autocast_ctx(device, args.dtype):
                loss = model(**batch).loss
        else:
            mb = collate_rows(step.rows)
            mb = mb.to(device)  # pinned first on CUDA (MicroBatch.to)
            with autocast_ctx(device, args.dtype):
                loss_sum, n = packed_loss(model, mb)
            loss = loss_sum / max(int(n), 1)
        optimizer_step(model, opt, loss)
        n_seen += step.examples
        losses.append(loss.detach())
        seen.append(n_seen)
        res.tokens += step.tokens
    sync(device)
    res.wall_s = time.perf_counter() - t0
    values = torch.stack(losses).float().cpu().tolist() if losses else []
    res.curve = list(zip(seen, values))
    res.steps, res.examples = len(steps), n_seen
    res.tokens_per_s = res.tokens / res.wall_s if res.wall_s > 0 else 0.0
    tail = values[-max(1, len(values) // 20) :]
    res.final_train_loss = float(np.mean(tail)) if tail else None
    res.peak_gib = cuda_peak_gib(device)
    with opt.full_precision() if isinstance(opt, MasterAdamW) else contextlib.nullcontext():
        res.heldout_loss = heldout_loss(model, held, pad_id, device, args.dtype)
    del model, opt
    free_memory(device)
    return res


# ------------------------------------------------------------------------------------- reporting


def smooth(values: Sequence[float], span: int) -> np.ndarray:
    """Exponential moving average with the given span (bias-corrected at the start)."""
    alpha = 2.0 / (span + 1)
    out = np.empty(len(values))
    acc, weight = 0.0, 0.0
    for i, v in enumerate(values):
        acc = (1 - alpha) * acc + alpha * v
        weight = (1 - alpha) * weight + alpha
        out[i] = acc / weight
    return out


def plot(results: Sequence[MethodResult], path: Path, title: str) -> None:
    """Training loss (smoothed) against examples seen, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for r in results:
        if not r.curve:
            continue
        x = [c[0] for c in r.curve]
        y = smooth([c[1] for c in r.curve], span=max(5, len(r.curve) // 40))
        label = f"{r.method} (held-out {r.heldout_loss:.3f})" if r.heldout_loss else r.method
        ax.plot(x, y, label=label, linewidth=1.3, linestyle="--" if r.method == "pad" else "-")
    ax.set_xlabel("examples seen")
    ax.set_ylabel("training loss (EMA)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    write_output(path, lambda tmp: fig.savefig(tmp, format="png"), "--plot")
    plt.close(fig)


def markdown_table(results: Sequence[MethodResult]) -> str:
    lines = [
        "| method | attention | steps | examples | wall s | tokens/s | final train loss | held-out loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.method} | {r.attention} | {r.steps} | {r.examples} | {r.wall_s:.1f} | "
            f"{r.tokens_per_s:,.0f} | {r.final_train_loss:.4f} | {r.heldout_loss:.4f} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(p, device=AUTO_DEVICE, model="llama-100m")
    p.add_argument("--methods", default=",".join(METHODS))
    add_bench_args(
        p, workdir=default_workdir("packlm-bench-loss"), shared=None, tokenizer=None, limit=(None, "first N examples of each dataset")
    )
    p.add_argument("--holdout", type=float, default=0.02)
    add_bench_args(p, seed=0)
    p.add_argument("--group", type=int, default=32)
    add_bench_args(p, max_len=(2048, "pack-data --max-len"))
    p.add_argument("--full-len", type=int, default=8192, help="pack-data --max-len of ffd-full")
    add_bench_args(p, lr=6e-4)
    p.add_argument("--warmup-frac", type=float, default=0.03)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default bf16 (autocast) on CUDA, fp32 on CPU")
    p.add_argument("--attn", default="auto")
    add_bench_args(p, pack_procs=default_pack_procs(5), json=None)
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "loss_curves.png")
    args = p.parse_args(argv)
    if args.json:
        check_output(args.json, "--json")
    if args.plot:
        check_output(args.plot, "--plot")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m.removesuffix(BF16_WEIGHTS) not in METHODS or m == "pad" + BF16_WEIGHTS]
    if bad:
        p.error(f"unknown method(s) {bad}: choose from {','.join(METHODS)}; a packed one may add {BF16_WEIGHTS}")
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    return args


def main(argv: Sequence[str] | None = None) -> list[MethodResult]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    shared = args.shared or shared_dir()
    t_all = time.perf_counter()
    print(
        f"# bench_loss: model={args.model} device={device} dtype={args.dtype} (autocast) "
        f"methods={','.join(args.methods)} limit={args.limit}"
    )
    folders = prepare(args, shared)
    vocab, pad_id = tokenizer_ids(folders["pad"])
    examples = examples_by_id(folders["pad"])
    held = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in iter_rows(folders["heldout"])]
    groups = minibatch_groups(folders["minibatch"], args.group)
    full = [g for g in groups if len(group_example_ids(g)) == args.group] or groups
    budget = round(float(np.mean([sum(len(r["input_ids"]) for r in g) for g in full])))
    print(
        f"data ready in {time.perf_counter() - t_all:.1f} s: {len(examples)} train / {len(held)} "
        f"held-out examples, token budget per packed step {budget} (mean of a {args.group}-"
        f"example group), max_len {args.max_len}"
    )
    results: list[MethodResult] = []
    for method in args.methods:
        steps = method_steps(method, folders, args.group, budget, examples)
        res = train_method(method, steps, args, device, vocab, examples, pad_id, held)
        print(
            f"  {method}: {res.steps} steps, {res.wall_s:.1f} s, {res.tokens_per_s:,.0f} tokens/s, "
            f"final train {res.final_train_loss:.4f}, held-out {res.heldout_loss:.4f}"
        )
        results.append(res)
    table = markdown_table(results)
    print()
    print(table)
    title = (
        f"{args.model} from scratch, one epoch of GSM8K+CodeAlpaca"
        f"{'' if args.limit is None else f' (first {args.limit} of each)'}, {device.type}"
    )
    if args.plot:
        plot(results, args.plot, title)
        print(f"plot: {args.plot}")
    if args.json:
        write_json(
            args.json,
            {
                "config": jsonable(args),
                "machine": machine_summary(),
                "device_name": device_name(device),
                "token_budget": budget,
                "results": [asdict(r) for r in results],
                "table": table,
                "wall_s": time.perf_counter() - t_all,
            },
        )
    print(f"total {time.perf_counter() - t_all:.1f} s")
    return results


if __name__ == "__main__":
    main()
