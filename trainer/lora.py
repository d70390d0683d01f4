"""LoRA adapters through `peft` (`pack-train --lora-r R`): only the adapter weights train and are
saved.

`add_lora` injects LoRA layers into the (already packed, `trainer.model.prepare`d) model in place
and freezes everything else; the step trains that same model object, so packed attention, the loss,
compile and DDP see an ordinary module. Checkpoints hold the adapter as peft writes it
(`adapter_model.safetensors` + `adapter_config.json` in the checkpoint's `model/`), loadable with
`PeftModel.from_pretrained(base_model, CHECKPOINT/model)`; `--resume` loads it back into the same
base model. `--merge-lora` writes the merged full model to RUN/merged at the end. With `--dtype bf16`
the frozen base weights are kept in bfloat16 (`freeze_in_bf16`), the adapters in float32.
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
