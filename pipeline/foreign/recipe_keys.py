"""Conversions of the Axolotl / TRL keys that shape a run's recipe without a family of their own in
`pipeline.foreign.keys`: which examples are kept (min_sample_len), which parameters train
(unfrozen_parameters), the schedule's floor (lr_scheduler_kwargs), the tokenizer's end token and
kind (eos_token, tokenizer_use_fast), how rows are packed (packing_strategy) and TensorBoard. Each
returns our options, raises `NotUsed` saying why a value changes nothing here, or refuses in one
line a value with no exact equivalent."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.foreign.keys import AXOLOTL_MIN_LEN, NotUsed, refuse


def _min_sample_len(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    """Axolotl's min_sample_len as --min-len (keys.AXOLOTL_MIN_LEN: how Axolotl applies it): 0 is its
    default; below 1 keeps every example."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise refuse("min_sample_len", value, "give a whole number of tokens")
    return {"min_len": AXOLOTL_MIN_LEN if value == 0 else max(1, value)}


def _unfrozen_parameters(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Axolotl 0.19.0 freezes every parameter and unfreezes those a pattern matches (train.py
    setup_model_and_tokenizer -> utils/freeze.py freeze_layers_except): --unfrozen-parameters, which
    reads the patterns as Axolotl does (trainer.model.freeze). Axolotl matches them against the model
    it holds then, which with an adapter is peft's (base_model.model.model.layers..., the adapters
    included): pack-train trains adapters or chosen parameters of the model, not a mixture."""
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):  # Axolotl: list[str]
        raise refuse("unfrozen_parameters", value, "give a list of regular expressions of parameter names")
    if settings.get("adapter") in ("lora", "qlora") or settings.get("use_peft") is True:
        raise refuse(
            "unfrozen_parameters",
            value,
            "with an adapter Axolotl matches these patterns against peft's "
            "names (base_model.model.model...), so it freezes the LoRA adapters "
            "unless a pattern matches them; pack-train trains LoRA adapters "
            "(adapter) or every parameter, or chosen parameters of the model "
            "without adapters: remove the key to train the adapters, or the "
            "adapter keys to train only the matching parameters",
        )
    return {"unfrozen_parameters": value}


def _use_fast(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value is True:
        raise NotUsed("the tokenizer is tokenizer.json's fast one, as Axolotl's default")
    raise refuse(
        "tokenizer_use_fast",
        value,
        "pack-data reads tokenizer.json (the fast tokenizer); a slow one may split the text otherwise: remove the key",
    )


def _scheduler_kwargs(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if settings.get("lr_scheduler_type") == "cosine_with_min_lr" and isinstance(value, Mapping) and set(value) <= {"min_lr_rate", "min_lr"}:
        raise NotUsed("read with lr_scheduler_type cosine_with_min_lr as --min-lr-ratio")
    if not value:
        raise NotUsed("empty")
    raise refuse("lr_scheduler_kwargs", value, "only min_lr_rate / min_lr of cosine_with_min_lr are read here: remove the others")


def _packing_strategy(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value in ("bfd", "ffd"):
        raise NotUsed("pack-data's planner packs rows of whole examples (--strategy; ffd by default)")
    raise refuse("packing_strategy", value, "TRL's wrapped cuts examples at row ends, which changes what the model sees: use bfd")


def _eos_token(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """TRL's SFTConfig.eos_token: the token that ends each example (and turn), set on the tokenizer."""
    if not isinstance(value, str) or not value:
        raise refuse("eos_token", value, "give the token's text, e.g. <|im_end|>")
    return {"special_tokens": {"eos_token": value}}


def _use_tensorboard(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value is True:
        return {"report_to": "tensorboard"}
    raise NotUsed("false: no TensorBoard")


def _average_tokens(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' average_tokens_across_devices: the step's loss over all ranks' loss tokens
    (true), or each rank's own mean, the means averaged (false)."""
    if not isinstance(value, bool):
        raise refuse("average_tokens_across_devices", value, "use true or false")
    return {"loss_average": "tokens" if value else "ranks"}
