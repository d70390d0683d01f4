"""The pieces of the Axolotl / TRL key table (`pipeline.foreign.config.KEYS`): what a rule is (`Map`,
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
TRL_LEARNING_RATE = 2e-5  # SFTConfig's learning_rate (transformers' TrainingArguments has 5e-5)
# Axolotl 0.19.0 drops, before packing, the examples whose input_ids (prompt, BOS and EOS included)
# are fewer than `min_sample_len or 2` tokens: utils/data/utils.py handle_long_seq_in_dataset ->
# _drop_outside_range / _filter_short_sequences, which filter with utils/trainer.py
# filter_sequences_by_length and utils/data/utils.py keep_min_len (`min_sequence_len or 2`). A file
# without the key (or with null or 0) drops the 1-token examples: schema.source_defaults gives it.
AXOLOTL_MIN_LEN = 2


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


def shown(value: Any, limit: int = 80) -> str:
    """`value` as an error line quotes it: its repr, cut to about `limit` characters."""
    try:
        text = repr(value)
    except RecursionError:
        return "(a value nested too deeply)"
    return text if len(text) <= limit else f"{text[: limit - 20]}...({len(text)} characters)"


def refuse(key: str, value: Any, fix: str) -> UserError:
    """The one line for a value of `key` that has no exact equivalent here (read_config_file names the
    file and the key before it; `key` names a sub-key, such as `datasets[0] split`)."""
    where = f"{key}: " if " " in key or "[" in key else ""
    return UserError(f"{where}{shown(value)} has no equivalent here: {fix}")


_refuse = refuse


def text_value(key: str, value: Any, none: bool = False) -> Any:
    """`value` where a name goes: text (None too when `none`), else the one-line refusal (a YAML
    `name: 2024` is an integer, `split: [a, b]` a list)."""
    if value is None and none:
        return None
    if not isinstance(value, str) or not value:
        raise UserError(
            f"{key}: {shown(value)} is "
            f"{type(value).__name__ if value != '' else 'empty'} where a name goes: write it as "
            "text (quoted in YAML: '2024')"
        )
    return value


def _whole(key: str, option: str) -> Convert:
    """A count that must be a whole number (TRL writes `num_train_epochs: 3.0`)."""

    def convert(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _refuse(key, value, "give a number")
        steps = settings.get("max_steps")
        if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
            raise NotUsed("max_steps sets the run's length, as in Axolotl and TRL (where it overrides the epochs)")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, float):
            raise _refuse(
                key, value, f"{option.replace('_', '-')} counts whole passes or steps; round it, or give max_steps for a partial pass"
            )
        return {option: value}

    return convert


def _max_steps(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    return {} if value == -1 else {"max_steps": value}  # TRL's -1: no step limit (the epochs decide)


REVISION_KEYS = ("model_revision", "revision_of_model")  # TRL's ModelConfig, Axolotl's


def with_revision(value: Any, settings: Mapping[str, Any]) -> Any:
    """A Hub model id with the file's revision (`model_revision` / `revision_of_model`) as NAME@REVISION,
    what our --model and --tokenizer take; a local folder as it is (from_pretrained ignores a revision
    there too)."""
    rev = next((settings[k] for k in REVISION_KEYS if isinstance(settings.get(k), str) and settings[k]), None)
    if rev is None or not isinstance(value, str) or "@" in value or Path(value).exists():
        return value
    return f"{value}@{rev}"


def _model(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    return {"model": with_revision(value, settings)}


def _model_tokenizer(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if settings.get("tokenizer_config") is not None:
        raise NotUsed("tokenizer_config names the tokenizer")
    return {"tokenizer": with_revision(value, settings)}


def _bf16(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if value == "auto":
        return {"dtype": "auto"}
    if value is True:
        return {"dtype": "bf16"}
    if value is False:
        if settings.get("fp16") is True or settings.get("bfloat16") is True:
            return {}  # fp16: true refuses on its own key; bfloat16: true sets bf16 (Axolotl: bf16 or bfloat16)
        return {"dtype": "fp32"}
    raise _refuse("bf16", value, "use true, false or auto")


def _bfloat16(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Axolotl's bfloat16 (core/builders/base.py: bf16 = cfg.bf16 or cfg.bfloat16)."""
    if not _yes_no("bfloat16", value):
        raise NotUsed("false: bf16 sets the precision")
    if settings.get("bf16") not in (None, False):
        raise NotUsed(f"bf16: {settings['bf16']} sets the precision (Axolotl trains in bf16 when either is set)")
    return {"dtype": "bf16"}


def _yes_no(key: str, value: Any) -> bool:
    """A true/false key's value. Anything else (a quoted "true", a 1) is refused rather than read as
    false: the tools would read it as true, and the run would silently be another recipe."""
    if not isinstance(value, bool):
        raise _refuse(key, value, "use true or false, unquoted")
    return value


def _fp16(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if _yes_no("fp16", value):
        raise _refuse("fp16", value, "pack-train does not train in float16: use bf16: true")
    raise NotUsed("float16 is off, as here")


def _grad_checkpointing(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value == "offload":  # Axolotl: checkpoints kept in CPU memory
        return {"grad_checkpointing": 1, "offload_activations": True}
    if not isinstance(value, bool):
        raise _refuse("gradient_checkpointing", value, "use true, false or offload")
    return {"grad_checkpointing": int(value)}


SCHEDULE_NAMES = {
    "cosine": "cosine",
    "linear": "linear",
    "constant": "constant",
    "constant_with_warmup": "constant",
    "cosine_with_min_lr": "cosine",
}


def min_lr_rate(settings: Mapping[str, Any]) -> float | None:
    """transformers' `cosine_with_min_lr` floor as a share of the peak: `lr_scheduler_kwargs`'
    min_lr_rate, or its min_lr over the learning rate (TRL's default when the file gives none;
    transformers' optimization.py,
    get_cosine_with_min_lr_schedule_with_warmup: the cosine of ours, ending at that share)."""
    kwargs = settings.get("lr_scheduler_kwargs")
    if not isinstance(kwargs, Mapping):
        return None
    rate, lowest, peak = kwargs.get("min_lr_rate"), kwargs.get("min_lr"), settings.get("learning_rate", TRL_LEARNING_RATE)
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        return float(rate)
    if isinstance(lowest, (int, float)) and isinstance(peak, (int, float)) and peak > 0:
        return float(lowest) / float(peak)
    return None


def _schedule(key: str) -> Convert:
    def convert(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(value, str) or value not in SCHEDULE_NAMES:
            raise _refuse(key, value, f"choose one of {', '.join(SCHEDULE_NAMES)}")
        out: dict[str, Any] = {"schedule": SCHEDULE_NAMES[value]}
        if value == "cosine_with_min_lr":
            rate = min_lr_rate(settings)
            if rate is None:
                raise _refuse(key, value, "give lr_scheduler_kwargs with min_lr_rate or min_lr, as transformers needs")
            return {**out, "min_lr_ratio": rate}
        if value in ("cosine", "linear") and not {"cosine_min_lr_ratio", "min_lr_ratio", "min-lr-ratio"} & set(settings):
            out["min_lr_ratio"] = 0.0  # the Hugging Face schedules decay to 0
        return out

    return convert


# Axolotl's and transformers' optimizer names -> ours; the 8-bit and 4-bit AdamWs (bitsandbytes',
# paged or not, and torchao's) are torchao's block-quantized AdamW8bit / AdamW4bit here; paging only
# moves states between GPU and CPU memory, so paged_adamw_32bit is AdamW
OPTIMIZER_NAMES = {
    "adamw": "adamw",
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw",
    "adamw_hf": "adamw",
    "paged_adamw_32bit": "adamw",
    "adafactor": "adafactor",
    "adamw_8bit": "adamw8bit",
    "adamw_bnb_8bit": "adamw8bit",
    "paged_adamw_8bit": "adamw8bit",
    "adamw_torch_8bit": "adamw8bit",
    "adamw_torch_4bit": "adamw4bit",
}


def _optimizer(key: str) -> Convert:
    def convert(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(value, str) or value not in OPTIMIZER_NAMES:
            raise _refuse(key, value, f"choose one of {', '.join(OPTIMIZER_NAMES)}")
        return {"optimizer": OPTIMIZER_NAMES[value]}

    return convert


def _val_set_size(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value == 0:
        return {}
    if isinstance(value, float) and 0 < value < 1:
        return {"eval_fraction": value}
    if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer() and value >= 1:
        return {"eval_examples": int(value)}
    raise _refuse("val_set_size", value, "give a fraction below 1 or a number of examples")


def _trl_loss_key(key: str) -> Convert:
    """TRL 1.16's loss keys as its SFTTrainer reads them together (build_labels): assistant_only_loss
    masks all but the assistant's tokens of either data shape; completion_only_loss (default: true for
    prompt/completion data) has no effect on messages data, so only `false` (every token of either
    shape) sets --train-on-prompt, and not beside assistant_only_loss: true. What neither sets is the
    data's shape's default (`schema.source_defaults`)."""

    def convert(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        if value is None:
            raise NotUsed("null")
        if not isinstance(value, bool):
            raise _refuse(key, value, "use true or false")
        if key == "assistant_only_loss":
            return {"train_on_prompt": False, **_trl_template_path(settings.get("chat_template_path"), settings)} if value else {}
        return {"train_on_prompt": True} if not value and settings.get("assistant_only_loss") is not True else {}

    return convert


# put before a TRL file's chat template (none: the tokenizer's own) under assistant_only_loss: true: a
# Jinja comment that `pipeline.tokenize.chat_templates` reads as "TRL's training version of this
# template where TRL ships one" (`pipeline.tokenize.templates_trl`), as TRL's SFTTrainer swaps it
TRL_TRAINING = "{#- TRL's training version where TRL ships it -#}"


def _trl_template_path(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """TRL's chat_template_path as --chat-template; under assistant_only_loss: true, after
    `TRL_TRAINING` (the same value from either key)."""
    template = "" if value is None else str(value)
    if settings.get("assistant_only_loss") is True:
        return {"chat_template": TRL_TRAINING + template}
    return {"chat_template": template} if template else {}


def _report_to(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    """tensorboard or wandb as --report-to; other loggers (trackio, mlflow, ...) only receive metrics,
    so they are named as not used (metrics.jsonl is always written)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _refuse("report_to", value, "use none, tensorboard or wandb")
    ours = [n for n in names if n in ("tensorboard", "wandb")]
    if len(ours) > 1:
        raise _refuse("report_to", value, "pack-train logs to one of tensorboard or wandb: keep one")
    if ours:
        return {"report_to": ours[0]}
    others = [n for n in names if n != "none"]
    if others:
        raise NotUsed(f"{', '.join(others)}: pack-train logs to metrics.jsonl, and to tensorboard or wandb")
    return {"report_to": "none"}


def _wandb_project(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Axolotl logs to W&B when a project is named (TRL: report_to chooses)."""
    if not isinstance(value, str):
        raise _refuse("wandb_project", value, "give the project's name as text")
    if settings.get("report_to") is not None:
        return {"wandb_project": value}
    return {"wandb_project": value, "report_to": "wandb"}


def _evaluations(option: str) -> Convert:
    """eval_steps / evals_per_epoch, when the tool would evaluate: Axolotl only with held-out data
    (val_set_size or test_datasets), TRL only with eval_strategy: steps (its default is no)."""

    def convert(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        if "base_model" in settings and not settings.get("val_set_size") and not settings.get("test_datasets"):
            raise NotUsed("no held-out data (val_set_size 0): Axolotl evaluates nothing either")
        if "model_name_or_path" in settings and settings.get("eval_strategy", "no") != "steps":
            raise NotUsed(f"eval_strategy is {settings.get('eval_strategy', 'no')} (TRL's default: no): no evaluation")
        return {option: value}

    return convert


def _chat_template(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if value in ("tokenizer_default", None):
        raise NotUsed("the tokenizer's own template renders chats")
    if value == "jinja":
        if not settings.get("chat_template_jinja"):  # Axolotl refuses it too; never the tokenizer's instead
            raise _refuse(
                "chat_template",
                value,
                "it reads the template from chat_template_jinja, which the file "
                "leaves out: give chat_template_jinja, or the template's name",
            )
        raise NotUsed("chat_template_jinja holds the template")
    return {"chat_template": value}


def _chat_template_jinja(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if settings.get("chat_template") != "jinja":
        raise _refuse("chat_template_jinja", "...", "Axolotl reads it with chat_template: jinja: set that, or remove it")
    return {"chat_template": value}


def _in_dataset_name(key: str) -> Convert:
    def convert(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        if settings.get("dataset_name") is None:
            raise _refuse(key, value, "TRL reads it with dataset_name: set that, or remove it")
        raise NotUsed("part of the input named from dataset_name")

    return convert


def show(value: Any) -> str:
    """A value as the printed mapping shows it: long texts (a Jinja template) shortened."""
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."


WATCHDOG = "pack-train stops at a non-finite loss or gradient; a high but finite loss is logged, not watched"
# --tile-mlp's tile when Axolotl's tiled_mlp gives no number of shards (README: long rows)


def _same(option: str) -> Map:
    return Map((option,))


DATA_KEY = Unused("pack-data's: run pack-data --config with the same file")
TRAIN_KEY = Unused("pack-train's: run pack-train --config with the same file")
ATTN = "the attention kernel is --attn's choice (auto: the fastest that runs here)"
PACKED = "rows are always packed here (pack-data packs them; no example attends to another)"
HUB = "checkpoints are written locally: upload them with huggingface-cli upload"
