"""The data keys of Axolotl and TRL files for pack-data: Axolotl's `datasets:` entries (with their
sub-keys), TRL's `dataset_name` and its `datasets:` mixture, and `special_tokens` / `tokens`. Each
conversion refuses in one line a value that has no exact equivalent here, or a value of the wrong
shape (`name: 2024`, `type: [a, b]`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.files.contained import escape
from pipeline.foreign.keys import NotUsed, refuse, text_value
from pipeline.foreign.schema import AXOLOTL_NO_VALUE
from pipeline.splits import HF_FILES, SPLIT_NAME, SYNTAX, split_share

# Axolotl dataset `type` -> our --format (None: detected from the file's columns)
AXOLOTL_TYPES = {"chat_template": "chat", "sharegpt": "chat", "alpaca": "instruction", "completion": "text", "input_output": None}
# `alpaca:STYLE`: Axolotl's AlpacaPrompter styles, pack-data's --template presets of the same name
# (`pipeline.read.formats.TEMPLATES`); plain `alpaca` (alpaca:instruct) is pack-data's alpaca preset.
ALPACA_STYLES = {"instruct": "alpaca", "chat": "alpaca:chat", "chatml": "alpaca:chatml", "phi": "alpaca:phi"}
# sub-keys of an Axolotl dataset entry that name what `datasets` maps (the rest: `_unused_subkeys`)
_MAPPED = {
    "path",
    "type",
    "split",
    "name",
    "data_files",
    "field_messages",
    "field",
    "message_property_mappings",
    "roles_to_train",
    "train_on_eos",
    "ds_type",
    "shards",
    "message_field_role",
    "message_field_content",
    "drop_system_message",
    "revision",
}
# the option each sub-key sets (type: alpaca's prompt style): for every input when the entries agree,
# else for each entry's inputs (--per-input)
SUBKEY_OPTIONS = {
    "type": "template",
    "field_messages": "messages_field",
    "field": "text_field",
    "roles_to_train": "roles_to_train",
    "train_on_eos": "train_on_eos",
}
# values that leave a sub-key at Axolotl's own default: nothing to do
_DEFAULT_SUBKEYS = {"roles_to_train": (["assistant"], ["assistant", "gpt"]), "train_on_eos": ("turn",), "shards": (1,), "split": ("train",)}


def _is_local(path: str) -> bool:
    return Path(path).exists() or path.startswith((".", "/", "~")) or "/" not in path


def _split(key: str, value: Any) -> str | None:
    """A `split:` as `datasets` reads it: a split's name, or a share of it (train[:20%],
    `pipeline.splits`); a sum of splits (train+test) is refused."""
    split = text_value(key, value, none=True)
    if split is None or re.fullmatch(SPLIT_NAME, split):
        return split
    try:
        sliced = split_share(f"x:{split}")
    except UserError as exc:
        raise refuse(key, split, str(exc).partition(": ")[2]) from None
    if sliced is None:
        raise refuse(key, split, f"pack-data reads one split or one share of it: write {SYNTAX}")
    return split


def _saved_split(path: str, split: str | None, where: str) -> str:
    """A `datasets.save_to_disk` folder as Axolotl reads it (load_from_disk, then a DatasetDict's
    split by name): a DatasetDict's split is its own folder; a share of it ([:20%]) Axolotl does not
    take there (it reads the split whole), so it is refused rather than taken or dropped unsaid."""
    folder = Path(path).expanduser()
    kind = next((k for k in ("dataset_dict.json", "state.json") if (folder / k).is_file()), None)
    if kind is None or split is None:
        return path
    if "[" in split:
        raise refuse(
            f"{where} split",
            split,
            f"Axolotl reads the save_to_disk folder {path} whole, without a share of "
            "its rows: remove the [...] (or save the share you want)",
        )
    return str(folder / split) if kind == "dataset_dict.json" else path


def hub_or_path(path: str, split: str | None = None, name: str | None = None, revision: str | None = None) -> str:
    """An input as pack-data names it: a local path as it is (PATH:train[...] for a share of its rows,
    `datasets`' one split of a file; a revision is for Hub datasets only, as Axolotl ignores it
    there), a Hub dataset as org/name[@revision][:config]:split."""
    if _is_local(path):
        return f"{path}:{split}" if split and "[" in split else path
    return ":".join(p for p in (path + (f"@{revision}" if revision else ""), name, split or "train") if p)


def _files(entry: Mapping[str, Any], key: str, split: str | None, revision: str | None = None) -> list[str]:
    """`data_files` of one entry: inside a local dataset folder they are its files; of a Hub dataset
    they are files of its repo (hf://datasets/ID/FILE, never a same-named local file). Either way
    `datasets` reads them as one split `train`; a share of it (train[:20%]) counts over all of
    them, so it is taken here only of one file."""
    path, files = str(entry["path"]), entry.get("data_files")
    files = [files] if isinstance(files, str) else files
    if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
        raise refuse(f"{key} data_files", files, "give a file name or a list of them")
    name = split.partition("[")[0] if split else "train"
    if name != "train":
        raise refuse(f"{key} split", split, "data_files are read as the split train: write train (or train[...])")
    share = split if split and "[" in split else None
    if share and len(files) > 1:
        raise refuse(
            f"{key} split",
            split,
            "a share of the rows of several data_files is not taken here: give one file, or their folder as path with the share",
        )
    if not _is_local(path):
        if entry.get("name") is not None:
            raise refuse(f"{key} name", entry["name"], "data_files already choose the files of the Hub dataset: remove name")
        for file in files:
            if escape(file) is not None:
                raise refuse(f"{key} data_files", file, f"{escape(file)}: name a file inside the Hub dataset {path}")
        at = f"@{revision}" if revision else ""
        return [f"{HF_FILES}{path}{at}/{file}" + (f":{share}" if share else "") for file in files]
    base = Path(path)
    if base.is_file():
        raise refuse(f"{key} data_files", files, f"path {path} is a file: give the files as path, or their folder")
    out = []
    for file in files:
        target = (base / file).resolve()
        if base.resolve() not in target.parents:
            raise refuse(f"{key} data_files", file, f"it leads outside {path}: name a file inside it")
        out.append(str(base / file) + (f":{share}" if share else ""))
    return out


def _unused_subkeys(entry: Mapping[str, Any], where: str) -> None:
    for key, value in entry.items():
        if key in _MAPPED or value in (None, "", [], {}, False):
            continue
        if key in AXOLOTL_NO_VALUE:
            raise refuse(
                f"{where} {key}",
                value,
                "this dataset setting has no equivalent in pack-data: remove it, or prepare the file so that it is not needed",
            )
        raise refuse(f"{where} {key}", value, "not a dataset key of Axolotl: remove it")


def axolotl_datasets(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Axolotl's `datasets:` list (or TRL's mixture, when the file is TRL's) as pack-data's inputs,
    --format and field options: a setting every entry shares as the option, one that differs
    between entries as each entry's own (--per-input), as Axolotl tokenizes each dataset with its own."""
    entries(value)
    inputs: list[str] = []
    of_entry: dict[int, list[str]] = {}  # entry -> its inputs
    kinds: dict[int, str | None] = {}  # entry -> its --format (None: detected from the columns)
    chosen: dict[str, dict[int, Any]] = {}  # sub-key -> entry -> its value (None: Axolotl's default)
    for i, d in enumerate(value):
        where = f"datasets[{i}]"
        _unused_subkeys(d, where)
        path = text_value(f"{where} path", d["path"])
        kind = text_value(f"{where} type", d.get("type", "chat_template"))
        base, _, style = kind.partition(":") if kind.startswith("alpaca:") else (kind, "", "")
        if style and style not in ALPACA_STYLES:
            raise refuse(f"{where} type", kind, f"not one of Axolotl's alpaca styles ({', '.join(ALPACA_STYLES)})")
        if base not in AXOLOTL_TYPES:
            raise refuse(
                f"{where} type",
                kind,
                f"use one of {', '.join(AXOLOTL_TYPES)}, or pack the file with pack-data's own --format and field options",
            )
        kinds[i] = AXOLOTL_TYPES[base]
        if base == "alpaca":  # plain alpaca is alpaca:instruct, the default of instruction/output columns
            chosen.setdefault("type", {})[i] = ALPACA_STYLES[style] if style else None
        split = _split(f"{where} split", d.get("split"))
        name = text_value(f"{where} name", d.get("name"), none=True)
        shards = d.get("shards")
        if shards not in (None, 1):
            raise refuse(
                f"{where} shards",
                shards,
                "pack-data reads the whole split: save the shard you want (datasets' shard()) to a file and give its path",
            )
        revision = text_value(f"{where} revision", d.get("revision"), none=True)
        path = _saved_split(path, split, where)
        if d.get("data_files") is not None:
            of_entry[i] = _files(d, where, split, revision)
        else:
            of_entry[i] = [hub_or_path(path, split, name, revision)]
        inputs.extend(of_entry[i])
        drop = d.get("drop_system_message")
        if drop not in (None, True, False):
            raise refuse(f"{where} drop_system_message", drop, "use true or false")
        chosen.setdefault("drop_system_message", {})[i] = True if drop else None
        mapping = d.get("message_property_mappings")
        if mapping is not None:
            _message_mappings(mapping, where)
        # Axolotl's older spelling of the same mapping
        old = {
            ours: d[theirs]
            for ours, theirs in (("role", "message_field_role"), ("content", "message_field_content"))
            if d.get(theirs) is not None
        }
        if old:
            _message_mappings(old, where)
        applies = {"chat": ("field_messages", "roles_to_train", "train_on_eos"), "text": ("field",)}
        for key in ("field_messages", "field", "roles_to_train", "train_on_eos"):
            got = d.get(key)
            if got is not None and got in _DEFAULT_SUBKEYS.get(key, ()):
                got = None
            elif got is not None:
                got = tuple(got) if isinstance(got, list) else text_value(f"{where} {key}", got)
            if got is not None or key in applies.get(kinds[i] or "", ()):
                chosen.setdefault(key, {})[i] = got
    out: dict[str, Any] = {"inputs": inputs}
    per_input: list[str] = []
    for key, values in {"format": kinds, **chosen}.items():
        option = "fmt" if key == "format" else SUBKEY_OPTIONS.get(key)
        first, *rest = values.items()
        if all(v == first[1] for _, v in rest):  # one value for every entry: the option
            if option and first[1] is not None:
                out[option] = list(first[1]) if isinstance(first[1], tuple) else first[1]
            continue
        if option is None:  # drop_system_message: applied through the one chat template of the run
            i = next(i for i, v in rest if v != first[1])
            raise refuse(
                f"datasets[{i}] {key}",
                values[i] or "Axolotl's default",
                f"datasets[{first[0]}] has "
                f"{first[1] or 'the default'}, and pack-data renders every dataset of one run with the same "
                "chat template: pack them separately",
            )
        flag = "format" if key == "format" else option.replace("_", "-")
        for i, v in values.items():  # each entry's own value, for each of its inputs
            if v is not None:
                text = ",".join(v) if isinstance(v, tuple) else v
                per_input.extend(f"{name}:{flag}={text}" for name in of_entry[i])
    if chosen["drop_system_message"][0] and not _named_template(settings):
        raise refuse(
            "datasets[0] drop_system_message",
            True,
            "it is applied through the chat template, which the file "
            "leaves to the tokenizer: name it (chat_template: NAME, "
            "or jinja with chat_template_jinja)",
        )
    if per_input:
        out["per_input"] = per_input
    return out


def _message_mappings(value: Any, where: str) -> None:
    """pack-data reads a message's role from `role` or `from` and its text from `content` or `value`
    (ShareGPT's spelling): a mapping onto other names is refused."""
    if not isinstance(value, dict):
        raise refuse(f"{where} message_property_mappings", value, "give a mapping such as {role: from, content: value}")
    known = {"role": ("role", "from"), "content": ("content", "value")}
    for ours, theirs in value.items():
        if ours not in known or theirs not in known[ours]:
            raise refuse(
                f"{where} message_property_mappings",
                {ours: theirs},
                "pack-data reads role from role or from, content from content or value: rename the field in the file",
            )


def entries(value: Any) -> None:
    """`datasets:` must be a list of mappings, each with a path."""
    if not isinstance(value, list) or not value or not all(isinstance(d, dict) and d.get("path") for d in value):
        raise refuse("datasets", "...", "give a list of {path: ...} entries")


def trl_mixture(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    """TRL's `datasets:` mixture (trl.scripts.utils.DatasetConfig: path, name, data_dir, data_files,
    split, columns): each entry an input; not read as chat data."""
    entries(value)
    inputs = []
    for i, d in enumerate(value):
        where = f"datasets[{i}]"
        for key in ("data_dir", "columns", "fraction"):
            if d.get(key) is not None:
                raise refuse(f"{where} {key}", d[key], "pack-data reads whole splits: prepare the file and give its path")
        unknown = sorted(set(d) - {"path", "name", "data_dir", "data_files", "split", "columns", "fraction"})
        if unknown:
            raise refuse(f"{where} {unknown[0]}", d[unknown[0]], "not a key of TRL's dataset mixture: remove it")
        path = text_value(f"{where} path", d["path"])
        split = _split(f"{where} split", d.get("split"))
        name = text_value(f"{where} name", d.get("name"), none=True)
        inputs.extend(_files(d, where, split) if d.get("data_files") is not None else [hub_or_path(path, split, name)])
    return {"inputs": inputs}


def dataset_name(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    name = text_value("dataset_name", value)
    split = _split("dataset_train_split", settings.get("dataset_train_split"))
    config = text_value("dataset_config", settings.get("dataset_config"), none=True)
    return {"inputs": [hub_or_path(name, split, config)]}


# put before the file's chat template when its datasets set drop_system_message: a Jinja comment (it
# renders nothing) that `pipeline.tokenize.render.render_chat` reads as "drop the first message of each
# conversation when it is a system message, before rendering", as Axolotl does (its
# prompt_strategies/chat_template.py); the start-up summary and the manifest show it
DROP_FIRST_SYSTEM = "{#- drop_system_message: each conversation's first system message is dropped (Axolotl) -#}"


def _named_template(settings: Mapping[str, Any]) -> bool:
    return settings.get("chat_template") not in (None, "tokenizer_default", "jinja") or bool(
        settings.get("chat_template") == "jinja" and settings.get("chat_template_jinja")
    )


def drops_system(settings: Mapping[str, Any]) -> bool:
    """Whether the file's datasets set drop_system_message (`axolotl_datasets` checks they agree)."""
    value = settings.get("datasets")
    return isinstance(value, list) and any(isinstance(d, dict) and d.get("drop_system_message") is True for d in value)


def special_tokens(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    """Axolotl's `special_tokens: {eos_token: ..., pad_token: ...}` as pack-data's --special-token
    NAME=TEXT; the pad token is not needed (rows hold no padding)."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise refuse("special_tokens", value, "give a mapping of token names to texts, e.g. {eos_token: <|im_end|>}")
    kept = {k: v for k, v in value.items() if k != "pad_token"}
    if not kept:
        raise NotUsed("a pad token only: rows hold no padding")
    return {"special_tokens": kept}  # the form a config file gives --special-token (TEXT_MAP)


def add_tokens(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise refuse("tokens", value, "give a list of token texts")
    return {"add_tokens": list(value)}
