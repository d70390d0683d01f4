#!/usr/bin/env python
"""FP8 recipes against bf16 on the decoder layers alone: time and GPU work per layer, one GPU.

A step of an 8B full fine-tune is almost all decoder layers, and the rest (embedding, output head,
optimizer) does not get faster in float8, so a run that recomputes no layer gains at most what its
layers gain. (Recomputation runs the forward, all of it in float8, twice, which shifts the mix.)
This builds a preset's decoder with `--layers` layers (the llama-8b shape
by default), bf16 weights, pack-train's packed attention and each layer compiled as pack-train
compiles it, then runs forward + backward of one packed row of `--tokens` tokens (examples of
random lengths) through it, for each `--recipes` entry:

- `bf16`: the layers as they are;
- a pack-train `--fp8-recipe` (`trainer.model.fp8.RECIPES`), converted as pack-train converts it;
- `rowwise_tw_weight`: per-token scales for activations and output gradients, as
  `rowwise_with_gw_hp`, but one scale for the whole weight in both matmuls it takes part in
  (`rowwise_with_gw_hp` scales it per output channel in the forward and per tensor in the input
  gradient), so the weight is cast once less. Still packing-exact: a weight's scale depends on
  the weight alone.

Each entry: `--iters` timed iterations (CUDA events) after `--warmup`, then 3 profiled ones: GPU ms
per layer by kernel kind (`trainer.run.profiling.kernel_kind`) and the kernels that take the most. "Per
layer" divides the whole decoder's time by `--layers`; its embedding and final norm are a small part.

    python scripts/bench/bench_fp8_layers.py --recipes bf16,rowwise_with_gw_hp,rowwise_tw_weight,tensorwise \\
        --json bench_fp8_layers.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from scripts.benchlib import add_bench_args, check_output, device_name, machine_summary, write_json  # noqa: E402
from trainer.data.batch import collate_flat
from trainer.model.fp8 import RECIPES, check_fp8, convertible, fp8_config
from trainer.model.load import compile_decoder_layers, decoder_layers, prepare, preset_config
from trainer.run.profiling import new_profiler, profile_summary

VARIANTS = ("rowwise_tw_weight",)


def variant_config(name: str) -> Any:
    """torchao Float8LinearConfig of a recipe defined here (see the module docstring)."""
    from torchao.float8.config import CastConfig, Float8LinearConfig, ScalingGranularity, ScalingType, e4m3_dtype

    if name != "rowwise_tw_weight":
        raise SystemExit(f"unknown recipe {name!r}: choose bf16, {', '.join(RECIPES + VARIANTS)}")
    return Float8LinearConfig(
        cast_config_input=CastConfig(scaling_granularity=ScalingGranularity.AXISWISE),
        cast_config_weight=CastConfig(scaling_granularity=ScalingGranularity.TENSORWISE),
        cast_config_grad_output=CastConfig(scaling_granularity=ScalingGranularity.AXISWISE, target_dtype=e4m3_dtype),
        cast_config_weight_for_grad_input=CastConfig(scaling_granularity=ScalingGranularity.TENSORWISE),
        cast_config_input_for_grad_weight=CastConfig(scaling_type=ScalingType.DISABLED),
        cast_config_grad_output_for_grad_weight=CastConfig(scaling_type=ScalingType.DISABLED, target_dtype=e4m3_dtype),
        round_scales_to_power_of_2=True,
        pad_inner_dim=True,
    )


def packed_row(tokens: int, seed: int, device: torch.device) -> dict[str, Any]:
    """Model kwargs of one packed row (`trainer.data.batch.MicroBatch`): examples of 64-2,048 tokens
    filling `tokens` exactly."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(int(min(rng.integers(64, 2049), tokens - sum(lengths))))
    seq_lens = np.array(lengths)
    positions = np.arange(tokens) - np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
    ids = rng.integers(0, 32000, size=tokens)
    return collate_flat(ids, ids, positions, seq_lens).to(device).model_kwargs()


def build(args: argparse.Namespace, recipe: str, device: torch.device) -> torch.nn.Module:
    """The decoder (embedding, `--layers` layers, final norm) in bf16, `recipe` applied, compiled."""
    from transformers import LlamaForCausalLM

    config = preset_config(args.model, vocab_size=32000)
    config.num_hidden_layers = args.layers
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    prepare(model, args.attn, device)
    if recipe != "bf16":
        from torchao.float8 import convert_to_float8_training

        layers = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
        config8 = fp8_config(recipe) if recipe in RECIPES else variant_config(recipe)
        convert_to_float8_training(model, config=config8, module_filter_fn=lambda m, name: id(m) in layers and convertible(m))
    compile_decoder_layers(model)
    return model.model  # the decoder: no output head, no loss


def run_entry(args: argparse.Namespace, recipe: str, device: torch.device) -> dict[str, Any]:
    decoder = build(args, recipe, device)
    kwargs = packed_row(args.tokens, args.seed, device)
    grad = torch.randn(1, args.tokens, decoder.config.hidden_size, device=device, dtype=torch.bfloat16)

    def iteration() -> None:
        out = decoder(**kwargs).last_hidden_state
        out.backward(grad)
        decoder.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    iteration()
    torch.cuda.synchronize(device)
    first_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        iteration()
    times = []
    for _ in range(args.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        iteration()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    prof = new_profiler(device, trace=None)
    with prof:
        for _ in range(3):
            iteration()
        torch.cuda.synchronize(device)
    summary = profile_summary(prof, 3 * args.layers, device, top=args.top)
    median = statistics.median(times)
    result = {
        "recipe": recipe,
        "first_iteration_s": first_s,
        "ms_per_iteration": times,
        "median_ms": median,
        "ms_per_layer": median / args.layers,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "profile_per_layer": summary,
    }
    del decoder
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser, model=("llama-8b", "preset whose layer shape to use"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--recipes", default="bf16,rowwise_with_gw_hp,rowwise_tw_weight,tensorwise,rowwise")
    parser.add_argument("--attn", default="auto")
    add_bench_args(parser, warmup=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=25, help="kernels listed per entry")
    add_bench_args(parser, seed=0, json=str)
    args = parser.parse_args(argv)
    if args.json:
        check_output(args.json, "--json")
    device = torch.device("cuda", torch.cuda.current_device())
    check_fp8(device)
    results = [run_entry(args, recipe, device) for recipe in args.recipes.split(",")]
    base = next((r for r in results if r["recipe"] == "bf16"), results[0])
    print(f"{args.model} shape, {args.layers} layers, {args.tokens} tokens, {device_name(device)}")
    print(f"{'recipe':<22}{'ms/layer':>10}{'x bf16':>8}  GPU ms per layer by kind")
    for r in results:
        r["x_bf16"] = base["ms_per_layer"] / r["ms_per_layer"]
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["profile_per_layer"]["ms_per_step_by_kind"].items())
        print(f"{r['recipe']:<22}{r['ms_per_layer']:>10.3f}{r['x_bf16']:>8.3f}  {kinds}")
    report = {
        "config": vars(args),
        "machine": machine_summary(),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "results": results,
    }
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
