"""LoRA adapters through `peft` (`pack-train --lora-r R`): only the adapter weights train and are
saved.

`add_lora` injects LoRA layers into the (already packed, `trainer.model.load.prepare`d) model in place
and freezes everything else; the step trains that same model object, so packed attention, the loss,
compile and DDP see an ordinary module. Checkpoints hold the adapter as peft writes it
(`adapter_model.safetensors` + `adapter_config.json` in the checkpoint's `model/`), loadable with
`PeftModel.from_pretrained(base_model, CHECKPOINT/model)`; `--resume` loads it back into the same
base model. `--merge-lora` writes the merged full model to RUN/merged at the end. With `--dtype bf16`
the frozen base weights are kept in bfloat16 (`freeze_in_bf16`), the adapters in float32.

`--qlora` stores the frozen base's linear layers of the decoder in 4 bits instead (QLoRA): each
becomes an `NF4Linear`, whose weight is torchao's NF4 tensor (4-bit NormalFloat in blocks of 64
values, each block's scale quantized in blocks of 256: about 4.1 bits a weight, a quarter of bf16).
Every matmul dequantizes it to the input's dtype, forward and backward; the backward keeps only
the NF4 weight. The embedding, the output head and the norms stay as they are. Example: an
8B-shaped base's 6.98B decoder weights take about 3.6 GB instead of 14 GB.

`--int8-base` stores them in int8 instead: each becomes an `Int8Linear`, whose weight is int8 with
one float32 scale per output row (torchao's int8 weight-only quantization: symmetric, the scale is
the row's largest magnitude / 127.5): half of bf16, closer to it than NF4, for any layer shape. As
with NF4, every matmul dequantizes it to the input's dtype and the backward keeps only the int8
weight and its scales. Unlike bitsandbytes' LLM.int8 (Axolotl's and TRL's `load_in_8bit`),
activations are not quantized and no outlier columns are kept apart: every matmul runs in the
compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.contract import UserError
from trainer.config import TrainConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def add_lora(model: torch.nn.Module, config: TrainConfig) -> Any:
    """The `peft.PeftModel` around `model` with LoRA adapters on `config.lora_target` ("all": every
    linear layer of the decoder; else comma-separated module names such as q_proj,v_proj)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError("--lora-r needs the peft package: pip install peft (or the project's [lora] extra)") from None
    # "default": None, peft's own targets for the model's type (what TRL's use_peft passes without any)
    targets: Any = (
        "all-linear"
        if config.lora_target == "all"
        else None
        if config.lora_target == "default"
        else lora_targets(model, config.lora_target)
    )
    lora = LoraConfig(
        r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout, target_modules=targets, task_type="CAUSAL_LM"
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as exc:  # e.g. target modules not found in the model
        raise UserError(f"--lora-target {config.lora_target}: {str(exc).splitlines()[0][:200]}") from None


def lora_targets(model: torch.nn.Module, text: str) -> list[str]:
    """The module names of `--lora-target` (comma-separated, e.g. q_proj,v_proj); each must name a
    module of `model` (its full name, or its last parts as peft matches them: `q_proj` matches
    `model.layers.0.self_attn.q_proj`), else UserError naming it (peft itself only refuses a list
    that matches nothing)."""
    names = [t.strip() for t in text.split(",")]
    modules = [name for name, _ in model.named_modules()]
    for target in names:
        if not target or not any(m == target or m.endswith("." + target) for m in modules):
            linear = sorted({m.rsplit(".", 1)[-1] for m, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)})
            raise UserError(
                f"--lora-target {text}: the model has no module named {target!r} (its linear layers: {', '.join(linear)}; or 'all')"
            )
    return names


def freeze_in_bf16(model: torch.nn.Module) -> None:
    """Store every frozen parameter (the base model's, with LoRA) in bfloat16; the adapters, which
    the optimizer updates, stay float32. For bf16 autocast runs, where the base weights are cast to
    bf16 for every matmul anyway: the same computation with half the base weights' memory."""
    for param in model.parameters():
        if not param.requires_grad and param.dtype == torch.float32:
            param.data = param.data.to(torch.bfloat16)


NF4_BLOCK = 64 * 256  # torchao's NF4 blocks (64 values) and scaler blocks (256 blocks) must fill the weight


def _nf4() -> Any:
    """torchao's NF4 tensor module, or one line saying how to install it."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        raise UserError("--qlora needs the torchao package (0.18 or newer): pip install torchao") from None
    return nf4_tensor


class NF4Linear(torch.nn.Module):
    """A frozen `nn.Linear` whose weight is stored as torchao's 4-bit NF4 tensor: y = x W^T + b, W
    dequantized to x's dtype for the matmul (torchao's `linear_nf4`, which saves only the NF4
    weight for the backward and dequantizes it again there)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = _nf4().to_nf4(linear.weight.detach())
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _nf4().linear_nf4(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized(self) -> torch.nn.Linear:
        """An ordinary `nn.Linear` with the dequantized weight (what the layer computes with)."""
        return _plain_linear(self.weight.get_original_weight(), self.bias)


def _plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    """A frozen `nn.Linear` holding `weight` and `bias` (a quantized layer's dequantized form)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear.requires_grad_(False)


class _Int8Matmul(torch.autograd.Function):
    """x W^T with W = int8 rows x their scales, dequantized to x's dtype in the forward and to the
    gradient's in the backward: only the int8 weight and the scales are saved for the backward
    (torchao's own int8 weight-only linear saves a float copy of W)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(qdata, scale)
        return torch.nn.functional.linear(x, _int8_weight(qdata, scale, x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        qdata, scale = ctx.saved_tensors
        return grad @ _int8_weight(qdata, scale, grad.dtype), None, None


def _int8_weight(qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight in `dtype` (the product taken in float32, rounded once)."""
    return (qdata.to(torch.float32) * scale).to(dtype)


class Int8Linear(torch.nn.Module):
    """A frozen `nn.Linear` whose weight is stored in int8 with one float32 scale per output row
    (torchao's `Int8Tensor` per-row symmetric quantization): y = x W^T + b, W dequantized to x's
    dtype for every matmul (`_Int8Matmul`)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        try:
            from torchao.quantization import Int8Tensor, PerRow
        except ImportError:
            raise UserError("--int8-base needs the torchao package (0.18 or newer): pip install torchao") from None
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.original_dtype = linear.weight.dtype  # what `dequantized` gives back (bf16 under --dtype bf16)
        quantized = Int8Tensor.from_hp(linear.weight.detach(), PerRow())
        # frozen parameters, as NF4Linear's weight: DDP leaves them out of its broadcast by that
        self.weight = torch.nn.Parameter(quantized.qdata, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(quantized.scale.to(torch.float32).reshape(-1, 1), requires_grad=False)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Int8Matmul.apply(x, self.weight, self.weight_scale)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized(self) -> torch.nn.Linear:
        """An ordinary `nn.Linear` with the dequantized weight, in the dtype the layer came in."""
        return _plain_linear(_int8_weight(self.weight, self.weight_scale, self.original_dtype), self.bias)


def _replace_frozen_linears(
    layers: list[torch.nn.Module], quantized: Callable[[torch.nn.Linear], torch.nn.Module], fits: Callable[[torch.nn.Linear], bool]
) -> tuple[int, int]:
    """Replace every frozen `nn.Linear` inside `layers` (the decoder layers: a LoRA layer's
    `base_layer`, or a linear layer without adapters) for which `fits(linear)` by `quantized(linear)`;
    LoRA adapters stay as they are. Returns (replaced, kept as they were)."""
    swapped = kept = 0
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear or child.weight.requires_grad:
                    continue  # LoRA's lora_A / lora_B train; anything else is left alone
                if not fits(child):
                    kept += 1
                    continue
                setattr(parent, name, quantized(child))
                swapped += 1
    return swapped, kept


def quantize_base_nf4(layers: list[torch.nn.Module]) -> tuple[int, int]:
    """The decoder's frozen linear layers as `NF4Linear`s where NF4 can hold their weight (a
    multiple of 64 x 256 values; every layer of common models). Returns (replaced, kept as they were)."""
    return _replace_frozen_linears(layers, NF4Linear, lambda linear: linear.weight.numel() % NF4_BLOCK == 0)


def quantize_base_int8(layers: list[torch.nn.Module]) -> int:
    """The decoder's frozen linear layers as `Int8Linear`s (any shape). Returns how many."""
    return _replace_frozen_linears(layers, Int8Linear, lambda linear: True)[0]


def dequantize_base(model: torch.nn.Module) -> None:
    """Every `NF4Linear` / `Int8Linear` of `model` back to an `nn.Linear` of its dequantized weight
    (before merging the adapters: the merged model is the base a QLoRA or --int8-base run trained
    against, plus the adapters)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (NF4Linear, Int8Linear)):
                setattr(parent, name, child.dequantized())


def load_adapter_into(peft_model: Any, checkpoint: Path) -> None:
    """Load a checkpoint's adapter weights into `peft_model` (same base model, same LoRA options)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(checkpoint) / "model" / ADAPTER_WEIGHTS
    if not path.is_file():
        raise UserError(
            f"{checkpoint}/model holds no LoRA adapter ({ADAPTER_WEIGHTS}): it was not trained with "
            "--lora-r; resume with the options it was trained with"
        )
    result = set_peft_model_state_dict(peft_model, load_file(str(path)))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise UserError(
            f"{path} does not match this LoRA setup (unexpected {unexpected[:2]}): resume with the same --lora-r / --lora-target"
        )


def merged_model(peft_model: Any) -> Any:
    """The base model with the adapters merged in, as a plain Hugging Face model (a --qlora or
    --int8-base base is dequantized first: the adapters merge into the weights they trained against)."""
    dequantize_base(peft_model)
    return peft_model.merge_and_unload()
