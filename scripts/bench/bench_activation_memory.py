#!/usr/bin/env python
"""What a decoder layer keeps for its backward, per token, on the CPU: the bytes autograd saves
(parameters left out) for one step of pack-train's model at a preset's layer shape, with LoRA or
not, eager or compiled, at each `--budgets` value of torch.compile's activation memory budget
(`pack-train --activation-memory-budget`).

One layer's share is the difference between the model with two decoder layers and with one, so
the embedding, the output head and the loss drop out. The LoRA adapters' weights, cast to bf16
under autocast, are counted too (a constant per layer, small at many tokens). The projection
multiplies by `--project-tokens` and the preset's layer count: about what the GPU would hold for
all layers' activations at that micro-batch with nothing recomputed (the CPU runs the SDPA
reference attention, which keeps its padded q/k/v where flash-attn keeps q/k/v/out and the
log-sum-exp: about the same bytes).

    python scripts/bench/bench_activation_memory.py --model llama-8b --lora-r 16 --tokens 256 --budgets 1,0.7,0.5

With `--tile-mlp N` each layer's MLP runs in tiles of N tokens (`pack-train --tile-mlp`), so the
count is what a layer recomputed in the backward (`--grad-checkpointing`) holds while its backward
runs, the working set that bounds a long row on one GPU (the tiles' own intermediates, one tile at a
time, are left out: pick N a small share of --tokens, as 8,192 is of a 524,288-token row).

    python scripts/bench/bench_activation_memory.py --tokens 1024 --tile-mlp 16 --budgets eager,1
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch._functorch.config as functorch_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from scripts.benchlib import add_bench_args  # noqa: E402


def saved_per_layer(args: argparse.Namespace, budget: float | None) -> tuple[float, Counter]:
    """(bytes per token, bytes per token by (dtype, shape)) one decoder layer keeps for the backward."""
    totals, kinds = [], []
    for n_layers in (1, 2):
        total, by_kind = _saved(args, n_layers, budget)
        totals.append(total)
        kinds.append(by_kind)
    diff = kinds[1].copy()
    diff.subtract(kinds[0])
    return (totals[1] - totals[0]) / args.tokens, Counter({k: v / args.tokens for k, v in diff.items() if v})


def _saved(args: argparse.Namespace, n_layers: int, budget: float | None) -> tuple[int, Counter]:
    from transformers import LlamaForCausalLM

    from trainer.data.batch import collate_flat
    from trainer.model.load import compile_decoder_layers, decoder_layers, prepare, preset_config
    from trainer.model.long_rows import tile_mlp
    from trainer.model.lora import freeze_in_bf16
    from trainer.model.loss import LossModule

    torch._dynamo.reset()
    config = preset_config(args.model, 32000)
    config.num_hidden_layers = n_layers
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    prepare(model, "sdpa", "cpu")
    if args.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=16, target_modules="all-linear"))
        freeze_in_bf16(model)
    if args.tile_mlp:
        tile_mlp(decoder_layers(model), args.tile_mlp)
    if budget is not None:  # as pack-train --compile does
        compile_decoder_layers(model)
    lens = np.full(4, args.tokens // 4)
    ids = np.random.default_rng(0).integers(3, 32000, int(lens.sum()))
    batch = collate_flat(ids, ids.copy(), np.concatenate([np.arange(n) for n in lens]), lens)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}
    by_kind: Counter = Counter()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in kept:
            kept[storage.data_ptr()] = storage.nbytes()
            by_kind[(str(t.dtype).removeprefix("torch."), tuple(t.shape))] += storage.nbytes()
        return t

    loss_module = LossModule(model)
    with functorch_config.patch(activation_memory_budget=budget or 1.0):
        for _ in range(2):  # the first step compiles; count the second
            kept.clear()
            by_kind.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_module(batch)
            loss.backward()
    return sum(kept.values()), by_kind


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(
        p,
        model=("llama-8b", "packlm preset whose layer shape is measured"),
        lora_r=(16, "LoRA rank on every linear layer (0: full fine-tune)"),
    )
    p.add_argument("--tokens", type=int, default=256, help="tokens of the packed batch (four examples)")
    p.add_argument(
        "--budgets", default="eager,1,0.7,0.5", help="comma separated: 'eager' (no compile) or a compiled layer's activation memory budget"
    )
    p.add_argument("--project-tokens", type=int, default=16384, help="micro-batch of the projection")
    p.add_argument("--tile-mlp", type=int, default=0, help="the MLP in tiles of this many tokens (0: whole)")
    args = p.parse_args(argv)
    from trainer.model.load import preset_config

    config = preset_config(args.model)
    hidden_bytes = 2 * config.hidden_size  # one bf16 hidden-size vector
    print(
        f"# {args.model} layer (hidden {config.hidden_size}, MLP {config.intermediate_size}), LoRA r{args.lora_r}, "
        f"{args.tokens} tokens, bf16 autocast{f', MLP in tiles of {args.tile_mlp}' if args.tile_mlp else ''}, "
        f"torch {torch.__version__}"
    )
    for entry in args.budgets.split(","):
        budget = None if entry == "eager" else float(entry)
        t0 = time.perf_counter()
        per_token, kinds = saved_per_layer(args, budget)
        # recomputed layers (with tiles) hold one layer's set at a time; otherwise every layer keeps its own
        layers = 1 if args.tile_mlp else config.num_hidden_layers
        project = per_token * args.project_tokens * layers / 2**30
        print(
            f"{'eager' if budget is None else f'compiled, budget {budget:g}'}: {per_token:,.0f} bytes per token "
            f"per layer ({per_token / hidden_bytes:.1f} bf16 hidden vectors); {args.project_tokens} tokens x "
            f"{layers} layer{'s' if layers > 1 else ' (recomputed)'}: {project:.1f} GiB "
            f"({time.perf_counter() - t0:.0f} s)"
        )
        for (dtype, shape), b in sorted(kinds.items(), key=lambda x: -x[1])[:8]:
            print(f"  {b:9,.0f} B/token  {dtype} {list(shape)}")


if __name__ == "__main__":
    main()
