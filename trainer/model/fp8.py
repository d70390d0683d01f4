"""`--dtype fp8`: the decoder's linear layers compute in float8 through torchao's float8 training.

The run is `--dtype bf16-weights` (bf16 weights over fp32 masters in one process; FSDP2's bf16
parameters over fp32 shards under `--parallel fsdp`; DDP is refused, as for bf16-weights) in
which every `nn.Linear` inside a decoder layer whose two dimensions are multiples of 16 becomes a
torchao `Float8Linear`: its inputs, weight and output gradient are cast to float8 (e4m3) with scales,
and the three matmuls of the layer (forward, input gradient, weight gradient) run on the GPU's
float8 tensor cores where the recipe asks for it. The embedding, the output head, norms, attention
and the loss stay as they are.

Recipes (`--fp8-recipe`), torchao's names:

- `rowwise_with_gw_hp` (default): one scale per token for activations and output gradients, one per
  output channel for weights; the weight gradient stays in bf16. Every scale is a function of one
  token or of the weight alone, so an example's loss and gradients are the same whatever it is
  packed with (the product's promise; `tests/trainer/model/test_fp8.py` proves it on torchao's CPU
  emulation, with `tensorwise` as the negative control).
- `rowwise`: the same, with the weight gradient in float8 too, scaled per column over the
  micro-batch's tokens: an example's weight gradient then depends on the tokens packed beside it.
  Its extra casts cost more than the float8 weight gradient saves, so it is slower than the default.
- `tensorwise`: one scale per tensor (the micro-batch's largest value): every number depends on the
  whole micro-batch. Every matmul runs in float8; the fastest recipe at the 8B shape, but not at
  1B, where its casts outweigh that (`scripts/bench/bench_fp8_layers.py`, BENCHMARKS.md).

The two batch-dependent recipes are what other trainers run; pack-train runs them when asked and
says at start-up that they break the packed == alone guarantee. Under FSDP2 (`--parallel fsdp`),
`tensorwise` also all-gathers the weights in float8 (half the bytes of bf16), as torchtitan's float8
recipe does: each weight's one scale comes from its whole (unsharded) value, computed for all layers
in one all-reduce after every optimizer step (`refresh_fp8_weight_scales`), so the float8 weight is
the one the layer would have cast itself. The inner dimension of each float8
matmul must be a multiple of 16; a micro-batch's token count is not, so matmuls over tokens are
zero-padded (torchao's `pad_inner_dim`, exact: zeros add nothing).

Example::

    check_fp8(device)                                     # or one line saying why not
    n = to_float8(model, "rowwise_with_gw_hp", decoder_layers(model), fsdp=False)
    # llama-1b: n == 112 (7 linears x 16 layers), each now a Float8Linear over the same Parameters
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.contract import UserError

RECIPES = ("rowwise_with_gw_hp", "rowwise", "tensorwise")
PACKING_EXACT = ("rowwise_with_gw_hp",)  # recipes whose scales never span two examples
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (sm89), Hopper (sm90) and newer


def check_fp8(device: torch.device) -> None:
    """Refuse in one line where float8 training cannot run: no CUDA device, a GPU older than sm89,
    or torchao missing."""
    if device.type != "cuda":
        raise UserError(
            f"--dtype fp8 needs an NVIDIA GPU with float8 tensor cores (sm89 or newer: Ada, "
            f"Hopper, Blackwell); this run is on {device.type}: use --dtype bf16-weights"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise UserError(
            f"--dtype fp8 needs float8 tensor cores (sm89 or newer); "
            f"{torch.cuda.get_device_name(device)} is sm{capability[0]}{capability[1]}: "
            "use --dtype bf16-weights"
        )
    _torchao_float8()


def _torchao_float8() -> Any:
    """torchao's float8 training module, or one line saying how to install it."""
    try:
        from torchao import float8
    except ImportError:
        raise UserError("--dtype fp8 needs the torchao package: pip install torchao (or the project's [fp8] extra)") from None
    return float8


def float8_all_gather(recipe: str, fsdp: bool) -> bool:
    """Whether FSDP2 all-gathers the float8 layers' weights in float8: under FSDP2 with one scale
    per weight (`tensorwise`); per-channel weight scales have no float8 all-gather in torchao."""
    return fsdp and recipe == "tensorwise"


def fp8_config(recipe: str, *, emulate: bool = False, fsdp: bool = False) -> Any:
    """torchao's `Float8LinearConfig` for `recipe`, with the inner dimension padded to 16 and, under
    FSDP2 (`fsdp`), float8 all-gathers where the recipe allows (`float8_all_gather`).
    `emulate` computes the float8 arithmetic with ordinary matmuls (torchao's CPU emulation, tests)."""
    if recipe not in RECIPES:
        raise UserError(f"unknown --fp8-recipe {recipe!r}: choose {', '.join(RECIPES)}")
    float8 = _torchao_float8()
    import dataclasses

    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, pad_inner_dim=True, emulate=emulate, enable_fsdp_float8_all_gather=float8_all_gather(recipe, fsdp))


def convertible(module: torch.nn.Module) -> bool:
    """A plain `nn.Linear` whose dimensions the float8 matmul takes (multiples of 16)."""
    return type(module) is torch.nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0


def to_float8(model: torch.nn.Module, recipe: str, layers: list[torch.nn.Module], *, fsdp: bool = False, emulate: bool = False) -> int:
    """Swap every convertible linear layer inside `layers` (the decoder layers) for a torchao
    `Float8Linear` holding the same weight and bias Parameters; returns how many were swapped.
    `fsdp`: the model is about to be sharded by FSDP2 (`fp8_config`).
    LoRA adapters (peft's `lora_A`/`lora_B`, rank-sized) are left alone; their frozen base layers
    convert, so a LoRA run gets an FP8 frozen base."""
    float8 = _torchao_float8()
    inside = {id(m) for layer in layers for m in layer.modules()}
    swapped = [0]

    def keep(module: torch.nn.Module, name: str) -> bool:
        take = id(module) in inside and convertible(module) and not any(part in ("lora_A", "lora_B") for part in name.split("."))
        swapped[0] += take
        return take

    float8.convert_to_float8_training(model, module_filter_fn=keep, config=fp8_config(recipe, emulate=emulate, fsdp=fsdp))
    return swapped[0]


def refresh_fp8_weight_scales(module: torch.nn.Module) -> None:
    """After an optimizer step under FSDP2 with float8 all-gathers: every float8 weight's scale from
    its new value, all layers in one all-reduce (else each layer's all-gather computes its own)."""
    _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(module)


def recipe_note(recipe: str) -> str:
    """The start-up line's words for the recipe, with the caveat of a batch-dependent one."""
    if recipe in PACKING_EXACT:
        return f"fp8 {recipe} (per-token scales: packing changes no example's numbers)"
    return (
        f"fp8 {recipe} (WARNING: its scales span the micro-batch, so an example's gradients depend "
        f"on the examples packed beside it; --fp8-recipe rowwise_with_gw_hp keeps them exact)"
    )
