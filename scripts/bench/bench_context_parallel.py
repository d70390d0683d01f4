"""Long examples over several GPUs: `pack-train --context-parallel N` (issue 57), its data, an
exactness check on the GPU kernels, and a summary of the runs.

    python scripts/bench/bench_context_parallel.py data runs/long --lengths 32768,131072 --rows 3
    torchrun --nproc-per-node 2 scripts/bench/bench_context_parallel.py check --json cp_check.json
    torchrun --nproc-per-node 2 -m trainer.cli --data runs/long/len-131072 --model llama-8b --lora-r 16 \
        --context-parallel 2 --grad-checkpointing --no-compile --tokens-per-step 131072 --max-steps 3 \
        --log-every 1 --out runs/cp2-131072
    python scripts/bench/bench_context_parallel.py report runs/cp2-131072 ... --json bench_context_parallel.json

`data`: one packed folder per length, OUT/len-L, of --rows rows each holding one example of exactly
L tokens (random ids below --vocab, 32,000, loss on every token but the first), written with the shard
contract's own writer (`pipeline.shards`): the same rows for every run at that length.

`check` (under torchrun, one GPU per rank, or ranks sharing one GPU with `--backend gloo`): a
4-layer (`--layers`) Llama of the 8B's width, bf16 autocast, the kernel `--attn auto` takes under
context parallelism (FlashAttention-4 where installed) and flash_attn, on one row of mixed example
lengths (one spans every rank): each example's loss and the gradients of their sum,
context-parallel against the whole row on one GPU, as relative errors; the same comparison in
float32 with the sdpa kernel bounds what rounding alone gives.

`report`: per run folder, tokens/s over the steps after the first --warmup (1: the first compiles
and warms up), tokens/s per GPU, pack-train's TFLOP/s a GPU, MFU, HFU and attention share (medians of
the same steps), the peak GPU memory, the row length and the ranks, as one JSON file.

`peer` (under torchrun, one GPU per rank): ring-flash-attn's Hugging Face adapter fed the same rows
as `pack-train --context-parallel N` (scripts/benchlib/ring_peer.py: the 8B shape, LoRA, every layer
recomputed; --warmup W steps then --steps S timed; tokens/s per GPU, peak memory per GPU, final
loss); `--fake-ring` runs it on the CPU (gloo, e.g. `--model tiny` on `data --vocab 4096` rows)
with an exact reference in place of the ring function.

    torchrun --nproc-per-node 2 scripts/bench/bench_context_parallel.py peer --data runs/long/len-131072 \
        --model llama-8b --lora-r 16 --steps 3 --warmup 2 --json peer-131072.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from scripts.benchlib import add_bench_args, check_output, check_output_folder, write_text_output  # noqa: E402
from scripts.benchlib.packing import write_long_folder  # noqa: E402


def check(json_path: str | None, backend: str = "nccl", layers: int = 4) -> None:
    """Context-parallel against the whole row on the GPU kernels (see the module)."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.attention.backend import piece_backend
    from trainer.data.batch import collate_flat
    from trainer.data.row_split import shard_microbatch
    from trainer.distributed import context_parallel as cp
    from trainer.model.load import prepare
    from trainer.model.loss import token_losses

    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    # gloo lets ranks share a GPU (NCCL refuses that): the kernels' exactness checked on a one-GPU machine
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    layout = cp.setup(rank, world, True, world)
    lengths = np.array([6000, 17, 300, 1, 2500, 3000, 99])  # the first spans every share
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 32000, int(lengths.sum()))
    row = collate_flat(ids, ids, np.concatenate([np.arange(n) for n in lengths]), lengths)
    share = shard_microbatch(row, layout.cp_rank, layout.cp_size)
    ends = torch.tensor(np.cumsum(lengths), device=device)
    results = {}
    kernels = [(k, torch.bfloat16) for k in dict.fromkeys((piece_backend(device), "flash_attn"))] + [("sdpa", torch.float32)]
    for kernel, dtype in kernels:
        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=4096,
            num_hidden_layers=layers,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=32000,
            rope_theta=500000.0,
        )
        model = LlamaForCausalLM(config).to(device)
        prepare(model, kernel, device, layout.groups)
        found = []
        for batch, tokens in ((row, None), (share, torch.from_numpy(share.context.tokens).to(device))):
            model.zero_grad()
            batch = batch.to(device)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                losses, where = token_losses(model, batch)
            example = torch.searchsorted(ends, where if tokens is None else tokens[where], right=True)
            sums = torch.zeros(len(lengths), device=device).index_add(0, example, losses.float())
            counts = torch.bincount(example, minlength=len(lengths)).float()
            if tokens is not None:
                dist.all_reduce(counts)
            (sums / counts).sum().backward()
            grads = [p.grad.float().clone() for p in model.parameters()]
            sums = sums.detach()
            if tokens is not None:
                dist.all_reduce(sums)
                for g in grads:
                    dist.all_reduce(g)
            found.append(((sums / counts).cpu(), grads))
        (want, want_g), (got, got_g) = found
        grad = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got_g, want_g))
        results[kernel] = {"dtype": str(dtype), "loss_rel_max": float(((got - want).abs() / want.abs()).max()), "grad_rel_norm_max": grad}
        del model
        torch.cuda.empty_cache()
    if rank == 0:
        payload = {
            "world": world,
            "backend": backend,
            "layers": layers,
            "lengths": lengths.tolist(),
            "device": torch.cuda.get_device_name(device),
            "results": results,
        }
        print(json.dumps(payload, indent=1))
        if json_path:
            write_text_output(json_path, json.dumps(payload, indent=1))
    dist.destroy_process_group()


def report(runs: list[str], json_path: str | None, warmup: int = 1) -> None:
    """One record per run folder (see the module)."""
    records = []
    for run in map(Path, runs):
        config = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
        steps = [r for r in rows if r.get("tokens_per_s") is not None and r.get("step", 0) > warmup]
        world = summary.get("world_size") or config.get("world_size") or 1
        rate = statistics.median(r["tokens_per_s"] for r in steps) if steps else None
        records.append(
            {
                "run": run.name,
                "steps": summary.get("steps"),
                "world_size": world,
                "context_parallel": config.get("context_parallel", 1),
                "tokens_per_step": config.get("tokens_per_step"),
                "tokens_per_s": rate,
                "tokens_per_s_per_gpu": rate / world if rate else None,
                # pack-train's FLOP rates (pipeline.report.flops: causal attention from the examples'
                # lengths, each rank its share of the row), medians over the same steps
                **{
                    key: statistics.median(r[key] for r in steps) if steps and all(r.get(key) is not None for r in steps) else None
                    for key in ("tflops", "mfu", "hfu", "attn_flop_share")
                },
                # pack-train's own count over the whole run, the first step (start-up effects) included
                "whole_run_tokens_per_s": summary.get("tokens_per_s"),
                "peak_mem_gib": max((r.get("peak_mem_gib") or 0 for r in rows), default=None),
                "final_loss": summary.get("final_loss"),
                "completed": bool(summary),
            }
        )
    print(json.dumps(records, indent=1))
    if json_path:
        write_text_output(json_path, json.dumps(records, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="packed folders of one-example rows")
    data.add_argument("out")
    data.add_argument("--lengths", default="32768,131072")
    data.add_argument("--rows", type=int, default=3)
    data.add_argument("--vocab", type=int, default=32000, help="token ids below this (the tiny preset: 4096)")
    checked = sub.add_parser("check", help="context-parallel against the whole row (under torchrun)")
    add_bench_args(checked, json=str)
    checked.add_argument("--backend", choices=("nccl", "gloo"), default="nccl", help="gloo: the ranks may share one GPU")
    checked.add_argument("--layers", type=int, default=4, help="decoder layers (2 keeps two ranks within one H200)")
    reported = sub.add_parser("report", help="summarize run folders")
    reported.add_argument("runs", nargs="+")
    add_bench_args(reported, json=str, warmup=(1, "steps left out of the rate"))
    peer = sub.add_parser("peer", help="ring-flash-attn's HF adapter on the same rows (under torchrun)")
    peer.add_argument("--data", required=True, help="a packed folder (one made by `data`)")
    add_bench_args(peer, model="llama-8b", lora_r=16, steps=(3, "timed steps, after --warmup"), warmup=2, lr=1e-4, seed=0)
    peer.add_argument("--heads-k-stride", type=int, default=1, help="kv heads per all-gather in the ring")
    peer.add_argument("--fake-ring", action="store_true", help="CPU, gloo, exact reference attention")
    add_bench_args(peer, json=str)
    args = parser.parse_args()
    if getattr(args, "json", None):
        check_output(args.json, "--json")
    if args.command == "data":
        check_output_folder(args.out)
        for length in (int(x) for x in args.lengths.split(",")):
            write_long_folder(Path(args.out) / f"len-{length}", length, args.rows, vocab=args.vocab)
    elif args.command == "check":
        check(args.json, args.backend, args.layers)
    elif args.command == "peer":
        from scripts.benchlib.ring_peer import peer_main

        peer_main(
            args.data,
            preset=args.model,
            lora_r=args.lora_r,
            steps=args.steps,
            warmup=args.warmup,
            lr=args.lr,
            seed=args.seed,
            fake=args.fake_ring,
            heads_k_stride=args.heads_k_stride,
            json_path=args.json,
        )
    else:
        report(args.runs, args.json, args.warmup)


if __name__ == "__main__":
    main()
