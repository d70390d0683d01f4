"""Conversions of the Axolotl / TRL adapter keys (`pipeline.foreign.config.KEYS`): LoRA's targets and
rank (lora_target_modules, lora_target_linear, adapter, lora_r, use_peft) and the frozen base's
precision (load_in_4bit: --qlora; load_in_8bit: --int8-base), each refusing in one line what the
tools refuse or what has no exact equivalent here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.foreign.keys import Convert, NotUsed, _yes_no
from pipeline.foreign.keys import refuse as _refuse


def _lora_target(key: str) -> Convert:
    def convert(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        if settings.get("lora_target_linear") is True:
            raise NotUsed("lora_target_linear: true puts adapters on every linear layer, these included")
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return {"lora_target": ",".join(value)}
        if value == "all-linear" or isinstance(value, str):
            return {"lora_target": "all" if value == "all-linear" else value}
        raise _refuse(key, value, "give a list of module names, e.g. [q_proj, v_proj]")

    return convert


def _lora_linear(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if not _yes_no("lora_target_linear", value):
        raise NotUsed("false: lora_target_modules names the modules")
    return {"lora_target": "all"}  # Axolotl: every linear layer, and the modules listed, if any


def _positive_rank(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _refuse(
            key,
            value,
            "the file asks for LoRA adapters, and their rank lora_r must be a whole number "
            "of at least 1 (without them every weight trains: remove the adapter key)",
        )


def _adapter(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if value not in ("lora", "qlora"):
        raise _refuse("adapter", value, "use lora or qlora")
    if settings.get("lora_r") is None:  # Axolotl has no default rank: peft would get r=None
        raise _refuse("adapter", value, "Axolotl takes the adapters' rank from lora_r, which the file leaves out: give lora_r (e.g. 16)")
    _positive_rank("lora_r", settings["lora_r"])
    if value == "qlora":
        return {"qlora": True}
    raise NotUsed("lora_r sets the rank of the LoRA adapters")


def _lora_r(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The rank, when the file asks for adapters (Axolotl's adapter, TRL's use_peft); a file that
    names `adapter:` empty or `use_peft: false` trains every weight there, whatever lora_r says."""
    asked = settings.get("adapter") in ("lora", "qlora") or settings.get("use_peft") is True
    if not asked and ("adapter" in settings or "use_peft" in settings):
        raise NotUsed("no adapter is asked for (adapter / use_peft): every weight trains, as there")
    if asked:
        _positive_rank("lora_r", value)
    return {"lora_r": value}


def _use_peft(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if not _yes_no("use_peft", value):
        raise NotUsed("false: every weight trains")
    # TRL's ModelConfig defaults for the keys the file leaves out; no target modules: peft's own
    # per-model default (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING), as TRL passes None
    defaults = {"lora_r": 16, "lora_alpha": 32.0, "lora_dropout": 0.05, "lora_target": "default"}
    if settings.get("lora_r") is not None:
        _positive_rank("lora_r", settings["lora_r"])
    given = {"lora_target": "lora_target_modules"}
    return {k: v for k, v in defaults.items() if settings.get(given.get(k, k)) is None and settings.get(k.replace("_", "-")) is None}


def _load_in_4bit(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if not _yes_no("load_in_4bit", value):
        raise NotUsed("false: the base stays in bf16")
    return {"qlora": True}


def _load_in_8bit(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """`--int8-base` under Axolotl's adapter: lora or TRL's use_peft; refused where those tools refuse
    it (Axolotl: with qlora or no adapter; TRL: with load_in_4bit; Trainer: no adapter)."""
    if not _yes_no("load_in_8bit", value):
        raise NotUsed("false: the base stays in bf16")
    if settings.get("load_in_4bit") is True:
        raise _refuse("load_in_8bit", value, "load_in_4bit: true asks for a 4-bit base too: keep one of them")
    if settings.get("adapter") == "qlora":
        raise _refuse(
            "load_in_8bit",
            value,
            "adapter: qlora takes a 4-bit base (Axolotl refuses qlora in 8 bits): "
            "use load_in_4bit: true, or adapter: lora over the 8-bit base",
        )
    if settings.get("adapter") == "lora" or settings.get("use_peft") is True:
        return {"int8_base": True}
    raise _refuse(
        "load_in_8bit",
        value,
        "an 8-bit base is not supported without LoRA adapters (Axolotl and TRL "
        "train only adapters over a quantized base): add adapter: lora (Axolotl) "
        "or use_peft: true (TRL), or remove load_in_8bit to train every weight",
    )
