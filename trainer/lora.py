"""LoRA adapters through `peft` (`pack-train --lora-r R`): only the adapter weights train and are
saved.

`add_lora` injects LoRA layers into the (already packed, `trainer.model.prepare`d) model in place
and freezes everything else; the step trains that same model object, so packed attention, the loss,
compile and DDP see an ordinary module. Checkpoints hold the adapter as peft writes it
(`adapter_model.safetensors` + `adapter_config.json` in the checkpoint's `model/`), loadable with
`PeftModel.from_pretrained(base_model, CHECKPOINT/model)`; `--resume` loads it back into the same
base model. `--merge-lora` writes the merged full model to RUN/merged at the end. With `--dtype bf16`
the frozen base weights are kept in bfloat16 (`freeze_in_bf16`), the adapters in float32.

Each adapted linear layer computes `y = base(x) + s * (x A^T) B^T` through `LoraDelta`, one
autograd function for the adapter's part: the product with B accumulates straight into the base
output (one `addmm`, no separate add of two output-sized tensors), and `x` is used as it comes
(peft's own forward first casts it to the adapters' float32, a copy of the layer input that
autocast then casts back). `add_lora` switches every plain LoRA layer (no dropout, no DoRA or
other variant, no adapter bias) to it (`FusedLoraLinear`: peft's layer with only its forward
replaced), so the parameters, checkpoints, `merge_and_unload` and peft's loading are peft's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.errors import UserError
from trainer.config import TrainConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"



def add_lora(model: torch.nn.Module, config: TrainConfig) -> Any:
    """The `peft.PeftModel` around `model` with LoRA adapters on `config.lora_target` ("all": every
    linear layer of the decoder; else comma-separated module names such as q_proj,v_proj)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError("--lora-r needs the peft package: pip install peft (or the project's [lora] extra)") from None
    targets: Any = "all-linear" if config.lora_target == "all" else lora_targets(model, config.lora_target)
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")
    try:
        peft_model = get_peft_model(model, lora)
    except ValueError as exc:  # e.g. target modules not found in the model
        raise UserError(f"--lora-target {config.lora_target}: {str(exc).splitlines()[0][:200]}") from None
    fuse_lora_layers(peft_model)
    return peft_model


class LoraDelta(torch.autograd.Function):
    """`y0 + scale * (x A^T) B^T` for `y0 = base(x)`, with its gradients for y0, x, A and B.

    Shapes: x [..., in], y0 [..., out], A [r, in], B [out, r]. The adapters are cast to the dtype of
    the input (bf16 under autocast; they stay float32 parameters), the rank-r product `u = x A^T`
    is the only tensor computed besides the output, and `addmm` adds its product with B into y0
    in one cuBLAS call. Backward, with g = dy B: dx = s g A, dA = s g^T x, dB = s dy^T u, dy0 = dy.
    Saved for the backward: x (which A's gradient needs anyway) and u ([tokens, r]).
    """

    @staticmethod
    def forward(ctx: Any, y0: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                scale: float) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        a_x, b_x = a.to(x.dtype), b.to(y0.dtype)
        u = (x2 @ a_x.t()).to(y0.dtype)
        y = torch.addmm(y0.reshape(-1, y0.shape[-1]), u, b_x.t(), alpha=scale)
        ctx.save_for_backward(x2, u, a_x, b_x)
        ctx.scale, ctx.x_shape, ctx.dtypes = scale, x.shape, (a.dtype, b.dtype)
        return y.view(y0.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, u, a_x, b_x = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(b_x.dtype)
        g = (dy2 @ b_x) * ctx.scale  # [tokens, r]: everything below is scaled through it or alpha
        dx = (g.to(a_x.dtype) @ a_x).view(ctx.x_shape)
        da = (g.t().to(x2.dtype) @ x2).to(ctx.dtypes[0])
        db = torch.mm(dy2.t(), u).mul_(ctx.scale).to(ctx.dtypes[1])
        return dy, dx, da, db, None


def fuse_lora_layers(peft_model: Any) -> int:
    """Switch every plain LoRA linear layer of `peft_model` (one adapter, no dropout, no DoRA or
    other variant, no adapter bias) to `FusedLoraLinear`; returns how many. Others keep peft's."""
    from peft.tuners.lora.layer import Linear

    fused = 0
    for module in peft_model.modules():
        if type(module) is Linear and _plain(module):
            module.__class__ = _fused_class(Linear)
            fused += 1
    return fused


def _plain(layer: Any) -> bool:
    """One vanilla adapter: `y = base(x) + s * B(A(x))` is all the layer computes."""
    names = list(layer.lora_A.keys())
    if len(names) != 1:
        return False
    name = names[0]
    return (isinstance(layer.lora_dropout[name], torch.nn.Identity) and name not in layer.lora_variant
            and layer.lora_A[name].bias is None and layer.lora_B[name].bias is None)


_FUSED: dict[type, type] = {}


def _fused_class(linear: type) -> type:
    """`FusedLoraLinear`: peft's LoRA `Linear` whose forward goes through `LoraDelta` whenever
    the one adapter is active and unmerged; anything else (merged, disabled, peft's per-call
    options) is peft's own forward."""
    if linear not in _FUSED:
        def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            name = self.active_adapters[0] if len(self.active_adapters) == 1 else None
            if args or kwargs or self.merged or self.disable_adapters or name not in self.lora_A:
                return linear.forward(self, x, *args, **kwargs)
            y0 = self.base_layer(x)
            return LoraDelta.apply(y0, x, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name])

        _FUSED[linear] = type("FusedLoraLinear", (linear,), {"forward": forward, "__module__": __name__})
    return _FUSED[linear]


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
            raise UserError(f"--lora-target {text}: the model has no module named {target!r} (its linear layers: "
                            f"{', '.join(linear)}; or 'all')")
    return names


def freeze_in_bf16(model: torch.nn.Module) -> None:
    """Store every frozen parameter (the base model's, with LoRA) in bfloat16; the adapters, which
    the optimizer updates, stay float32. For bf16 autocast runs, where the base weights are cast to
    bf16 for every matmul anyway: the same computation with half the base weights' memory."""
    for param in model.parameters():
        if not param.requires_grad and param.dtype == torch.float32:
            param.data = param.data.to(torch.bfloat16)


def load_adapter_into(peft_model: Any, checkpoint: Path) -> None:
    """Load a checkpoint's adapter weights into `peft_model` (same base model, same LoRA options)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(checkpoint) / "model" / ADAPTER_WEIGHTS
    if not path.is_file():
        raise UserError(f"{checkpoint}/model holds no LoRA adapter ({ADAPTER_WEIGHTS}): it was not trained with "
                        "--lora-r; resume with the options it was trained with")
    result = set_peft_model_state_dict(peft_model, load_file(str(path)))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise UserError(f"{path} does not match this LoRA setup (unexpected {unexpected[:2]}): resume with the "
                        "same --lora-r / --lora-target")


def merge_and_save(peft_model: Any, out: Path, tokenizer: Any = None) -> Path:
    """The base model with the adapters merged in, saved as a full Hugging Face model at `out`."""
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
