"""The pieces of the Axolotl / TRL key table (`pipeline.foreign_config.KEYS`): what a rule is (`Map`,
`Unused`, `Key`) and the conversions from their values to our options, each refusing in one line a
value that has no exact equivalent here (`fp16: true`, `num_epochs: 1.5`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

TRAIN, DATA = "pack-train", "pack-data"
AXOLOTL, TRL, BOTH = "Axolotl", "TRL", "Axolotl, TRL"
# TRL's SFTConfig default row length (`max_length`) when a TRL file gives a batch size without it
TRL_MAX_LENGTH = 1024


class NotUsed(Exception):
    """Raised by a `Map`'s conversion when the key has no effect given the rest of the file (why)."""


Convert = Callable[[Any, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Map:
    """The key sets these options of ours (parameter names); `convert(value, file)` gives their
    values (UserError: no exact equivalent; NotUsed: no effect here). `doc` says how, for the page."""

    options: tuple[str, ...]
    convert: Convert | None = None  # None: the value as it is, for the one option
    doc: str = ""

    def apply(self, value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        if self.convert is None:
            return {self.options[0]: value}
        return self.convert(value, settings)


@dataclass(frozen=True)
class Unused:
    """The key has no meaning for this command: why, and what to do instead (one line)."""

    why: str


Rule = Map | Unused


@dataclass(frozen=True)
class Key:
    """One Axolotl or TRL key: which tool spells it so, and its rule for each command (None: the
    key is that command's own option, spelled the same)."""

    name: str
    tools: str
    train: Rule | None
    data: Rule | None = field(default=None)


def _refuse(key: str, value: Any, fix: str) -> UserError:
    """The one line for a value of `key` that has no exact equivalent here (read_config_file names the
    file and the key before it)."""
    return UserError(f"{value!r} has no equivalent here: {fix}")


def _whole(key: str, option: str) -> Convert:
    """A count that must be a whole number (TRL writes `num_train_epochs: 3.0`)."""

    def convert(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, float):
            raise _refuse(key, value, f"{option.replace('_', '-')} counts whole passes or steps; round it, or "
                                      "give max_steps for a partial pass")
        return {option: value}
    return convert


def _max_steps(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    return {} if value == -1 else {"max_steps": value}  # TRL's -1: no step limit (the epochs decide)


def _model_tokenizer(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if settings.get("tokenizer_config") is not None:
        raise NotUsed("tokenizer_config names the tokenizer")
    return {"tokenizer": value}


def _bf16(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if value == "auto":
        return {"dtype": "auto"}
    if value is True:
        return {"dtype": "bf16"}
    if value is False:
        if settings.get("fp16") is True:
            return {}  # fp16: true refuses on its own key
        return {"dtype": "fp32"}
    raise _refuse("bf16", value, "use true, false or auto")


def _fp16(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value is True:
        raise _refuse("fp16", value, "pack-train does not train in float16: use bf16: true")
    raise NotUsed("float16 is off, as here")


def _grad_checkpointing(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise _refuse("gradient_checkpointing", value, "use true or false")
    return {"grad_checkpointing": int(value)}


SCHEDULE_NAMES = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant"}


def _schedule(key: str) -> Convert:
    def convert(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        if value not in SCHEDULE_NAMES:
            raise _refuse(key, value, f"choose one of {', '.join(SCHEDULE_NAMES)}")
        out: dict[str, Any] = {"schedule": SCHEDULE_NAMES[value]}
        if value in ("cosine", "linear") and not {"cosine_min_lr_ratio", "min_lr_ratio", "min-lr-ratio"} & set(settings):
            out["min_lr_ratio"] = 0.0  # the Hugging Face schedules decay to 0
        return out
    return convert


OPTIMIZER_NAMES = {"adamw": "adamw", "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
                   "adafactor": "adafactor"}


def _optimizer(key: str) -> Convert:
    def convert(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        if value not in OPTIMIZER_NAMES:
            raise _refuse(key, value, f"choose one of {', '.join(OPTIMIZER_NAMES)} (AdamW or Adafactor)")
        return {"optimizer": OPTIMIZER_NAMES[value]}
    return convert


def _lora_target(key: str) -> Convert:
    def convert(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return {"lora_target": ",".join(value)}
        if value == "all-linear" or isinstance(value, str):
            return {"lora_target": "all" if value == "all-linear" else value}
        raise _refuse(key, value, "give a list of module names, e.g. [q_proj, v_proj]")
    return convert


def _lora_linear(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if value is not True:
        raise NotUsed("false: lora_target_modules names the modules")
    if settings.get("lora_target_modules"):
        raise _refuse("lora_target_linear", value, "it and lora_target_modules both choose the modules: keep one")
    return {"lora_target": "all"}


def _adapter(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value == "qlora":
        return {"qlora": True}
    if value == "lora":
        raise NotUsed("lora_r sets the rank of the LoRA adapters")
    raise _refuse("adapter", value, "use lora or qlora")


def _use_peft(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if value is not True:
        raise NotUsed("false: every weight trains (lora_r: 0)")
    # TRL's ModelConfig defaults for the keys the file leaves out
    defaults = {"lora_r": 16, "lora_alpha": 32.0, "lora_dropout": 0.05}
    return {k: v for k, v in defaults.items() if k not in settings and k.replace("_", "-") not in settings}


def _load_in_4bit(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value is not True:
        raise NotUsed("false: the base stays in bf16")
    return {"qlora": True}


def _load_in_8bit(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value is True:
        raise _refuse("load_in_8bit", value, "an 8-bit base is not supported: use load_in_4bit: true (QLoRA)")
    raise NotUsed("false: the base stays in bf16")


def _tokens_per_step(key: str, length_keys: tuple[str, ...], packing_key: str, default_len: int | None) -> Convert:
    """A batch size in rows is exact as a token budget only when every row is packed to the full
    length: `rows * length` tokens per micro-batch."""

    def convert(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _refuse(key, value, "give a whole number of rows")
        length = next((settings[k] for k in length_keys if settings.get(k) is not None), default_len)
        if settings.get(packing_key) is not True or not isinstance(length, int):
            raise _refuse(key, value, f"a batch of {value} padded examples is no fixed number of tokens; "
                                      f"set {packing_key}: true and {length_keys[0]}, or give tokens_per_step "
                                      "(tokens per micro-batch)")
        return {"tokens_per_step": value * length}
    return convert


def _val_set_size(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value == 0:
        return {}
    if isinstance(value, float) and 0 < value < 1:
        return {"eval_fraction": value}
    if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer() and value >= 1:
        return {"eval_examples": int(value)}
    raise _refuse("val_set_size", value, "give a fraction below 1 or a number of examples")


def _not(option: str, key: str) -> Convert:
    def convert(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        if value is None:
            raise NotUsed("null")
        if not isinstance(value, bool):
            raise _refuse(key, value, "use true or false")
        return {option: not value}
    return convert


def _report_to(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list):
        raise _refuse("report_to", value, "use none, tensorboard or wandb")
    names = [n for n in names if n != "none"]
    if not names:
        return {"report_to": "none"}
    if len(names) == 1 and names[0] in ("tensorboard", "wandb"):
        return {"report_to": names[0]}
    raise _refuse("report_to", value, "one of tensorboard or wandb (or none)")


def _wandb_project(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if not value:
        raise NotUsed("empty: no W&B")
    if settings.get("report_to") is not None:
        raise NotUsed("report_to chooses where metrics go")
    return {"report_to": "wandb"}


def _fsdp_words(value: Any) -> list[str]:
    """TRL's `fsdp: "full_shard auto_wrap offload"` or Axolotl's list of the same words."""
    if isinstance(value, str):
        return value.split()
    return [str(v) for v in value] if isinstance(value, list) else []


def _fsdp(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if not value:
        raise NotUsed("empty: no FSDP")
    if "offload" in _fsdp_words(value):
        return {"parallel": "fsdp", "offload_states": True}
    return {"parallel": "fsdp"}


def _fsdp_config(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """`offload_params: true` (TRL/accelerate; Axolotl: `fsdp_offload_params`) is --offload-states."""
    offload = isinstance(value, Mapping) and any(value.get(k) is True for k in ("offload_params", "fsdp_offload_params"))
    if not offload:
        raise NotUsed("FSDP2 wraps each decoder layer; its settings are --reshard-after-forward and --offload-states")
    if "offload" in _fsdp_words(settings.get("fsdp")):
        raise NotUsed("fsdp's offload sets --offload-states already")
    return {"offload_states": True}


def _chat_template(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if value in ("tokenizer_default", None):
        raise NotUsed("the tokenizer's own template renders chats")
    if value == "jinja":
        raise NotUsed("chat_template_jinja holds the template")
    return {"chat_template": value}


def _chat_template_jinja(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if settings.get("chat_template") != "jinja":
        raise _refuse("chat_template_jinja", "...", "Axolotl reads it with chat_template: jinja: set that, or remove it")
    return {"chat_template": value}


# Axolotl dataset `type` -> our --format (None: detected from the file's columns)
AXOLOTL_TYPES = {"chat_template": "chat", "sharegpt": "chat", "alpaca": "instruction", "completion": "text",
                 "input_output": None}


def hub_or_path(path: str, split: str | None = None, name: str | None = None) -> str:
    """An input as pack-data names it: a local path as it is, a Hub dataset as org/name[:config]:split."""
    if Path(path).exists() or "/" not in path or path.startswith((".", "/", "~")):
        return path
    return ":".join(p for p in (path, name, split or "train") if p)


def _datasets(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, list) or not value or not all(isinstance(d, dict) and d.get("path") for d in value):
        raise _refuse("datasets", "...", "give a list of {path, type} entries")
    inputs, formats, fields = [], set(), {}
    for d in value:
        kind = d.get("type", "chat_template")
        if kind not in AXOLOTL_TYPES:
            raise _refuse("datasets", f"type: {kind}", f"use one of {', '.join(AXOLOTL_TYPES)}, or pack the file "
                                                       "with pack-data's own --format and field options")
        formats.add(AXOLOTL_TYPES[kind])
        files = d.get("data_files")
        if files:
            inputs.extend([files] if isinstance(files, str) else files)
        else:
            inputs.append(hub_or_path(str(d["path"]), d.get("split"), d.get("name")))
        for key, option in (("field_messages", "messages_field"), ("field", "text_field")):
            if d.get(key) is not None:
                if fields.setdefault(option, d[key]) != d[key]:
                    raise _refuse("datasets", f"{key}: {d[key]}", f"every dataset of one run reads the same {key}: "
                                                                 "pack them separately")
    out: dict[str, Any] = {"inputs": inputs, **fields}
    if len(formats) == 1 and None not in formats:
        out["fmt"] = formats.pop()
    return out


def _dataset_name(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    return {"inputs": [hub_or_path(str(value), settings.get("dataset_train_split"), settings.get("dataset_config"))]}


def _in_dataset_name(key: str) -> Convert:
    def convert(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        if settings.get("dataset_name") is None:
            raise _refuse(key, value, "TRL reads it with dataset_name: set that, or remove it")
        raise NotUsed("part of the input named from dataset_name")
    return convert


def _same(option: str) -> Map:
    return Map((option,))


DATA_KEY = Unused("pack-data's: run pack-data --config with the same file")
TRAIN_KEY = Unused("pack-train's: run pack-train --config with the same file")
NO_TOKENIZER_CHANGE = ("the tokenizer is used as it is: save it with the tokens you need and give that folder "
                       "as tokenizer")
ATTN = "the attention kernel is --attn's choice (auto: the fastest that runs here)"
PACKED = "rows are always packed here (pack-data packs them; no example attends to another)"
HUB = "checkpoints are written locally: upload them with huggingface-cli upload"
