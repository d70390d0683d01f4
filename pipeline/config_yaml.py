"""A config file's YAML, read safely for `pipeline.config_file`: only a regular file of at most
MAX_CONFIG_BYTES; a key repeated in one mapping and any alias (`*name`, the "alias bomb") refused;
and the plain scalars that YAML 1.1 (PyYAML, so Axolotl and TRL) and YAML 1.2 read as different
values (`yes`, `1:30`, `017`) kept as `Spelling`s until the option they reach is known (`settled`,
`Spelling.settle`). For example, `_load_yaml("a: yes")["a"].settle(bool)` is True, and
`.settle(int)` is refused in one line."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

MAX_CONFIG_BYTES = 16 * 2**20  # a config file past this is refused unread


class _Repeated(Exception):
    """A mapping key given twice in the YAML file."""

    def __init__(self, key: object, line: int) -> None:
        super().__init__(key, line)
        self.key, self.line = key, line


class _Alias(Exception):
    """A YAML alias (`*name`) in the file."""

    def __init__(self, anchor: object, line: int) -> None:
        super().__init__(anchor, line)
        self.anchor, self.line = anchor, line


def _config_text(path: str | Path) -> str:
    """The file's text. A FIFO or a device (whose read could wait or never end) is refused unread,
    and so is a file past MAX_CONFIG_BYTES: a run's settings are a few kilobytes."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"--config {path}: not a regular file (a pipe or a device could wait or never end): give the YAML file itself")
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise UserError(
            f"--config {path}: larger than a config file can be ({MAX_CONFIG_BYTES // 2**20} MiB): give the YAML file of the run's settings"
        )
    return data.decode("utf-8")


def _load_yaml(text: str) -> Any:
    """`yaml.safe_load`, except that a key repeated in one mapping raises `_Repeated`, and an alias
    (`*name`) raises `_Alias`: options are plain values, and nested aliases make a few lines expand
    into billions of values (an "alias bomb") once anything walks them."""
    import yaml

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise _Alias(event.anchor, event.start_mark.line + 1)
            return super().compose_node(parent, index)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in seen:
                        raise _Repeated(key, key_node.start_mark.line + 1)
                    seen.add(key)
                except TypeError:  # an unhashable key: yaml's own error follows
                    pass
            return super().construct_mapping(node, deep)

        def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
            if kind is yaml.ScalarNode and implicit[0] and Spelling.of(value) is not None:
                return SPELLING_TAG
            return super().resolve(kind, value, implicit)

    Loader.add_constructor(SPELLING_TAG, lambda loader, node: Spelling.of(node.value))
    return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader)


SPELLING_TAG = "tag:packlm:yaml-1.1-spelling"
_FLAGS = {"yes": True, "on": True, "no": False, "off": False}
_BASE60 = re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?")
_OCTAL11 = re.compile(r"[-+]?0[0-7_]+")
_OCTAL12 = re.compile(r"[-+]?0o[0-7]+")


class Spelling(str):
    """A plain YAML scalar that YAML 1.1 (PyYAML, and so Axolotl and TRL) and YAML 1.2 read as
    different values: `yes`/`no`/`on`/`off` (true/false, or text), a base-60 number (`1:30` is 90,
    or text), an octal number (`017` is 15 in 1.1 and 17 in 1.2; `0o17` is 15 in 1.2 and text in
    1.1). It stays text until the option it reaches is known (`settle`): a flag takes the yes/no
    words as true/false, a text option the text, a number option the one number both readings agree
    on (`0o17`), and anything else is refused in one line instead of becoming a different number."""

    flag: bool | None = None  # its true/false, for the yes/no words
    number: int | None = None  # the number it means to every reader, where there is one
    why: str = ""  # why a number option cannot take it

    @classmethod
    def of(cls, text: str) -> Spelling | None:
        """The Spelling of a plain scalar's text, or None where YAML 1.1 and 1.2 agree on it."""
        made = cls(text)
        bare = text.lstrip("+-")
        if text in _FLAGS or text.lower() in _FLAGS and text in (text.lower(), text.title(), text.upper()):
            made.flag = _FLAGS[text.lower()]
            made.why = f"{text!r} is a word (true or false to YAML 1.1), not a number: write the number"
        elif _BASE60.fullmatch(text):
            made.why = (
                f"{text} is a base-60 number to YAML 1.1 ({_base60(text):g}) and text to YAML 1.2: "
                f"write the number itself, e.g. {_base60(text):g}"
            )
        elif _OCTAL11.fullmatch(text) and bare.strip("0_"):
            octal, decimal = int(text.replace("_", ""), 8), int(text.replace("_", ""), 10)
            made.why = (
                f"{text} is octal to YAML 1.1 ({octal}) and decimal to YAML 1.2 ({decimal}): write {octal} or {decimal}, the one you mean"
            )
        elif _OCTAL12.fullmatch(text):
            made.number = int(text, 0)
            made.why = f"{text} is octal to YAML 1.2 ({made.number}) and text to YAML 1.1 (Axolotl, TRL): write {made.number}"
        else:
            return None
        return made

    def settle(self, kind: Any) -> Any:
        """The value for an option of `kind` (bool, int, float, or anything else: text), or UserError."""
        if kind is bool:
            if self.flag is None:
                raise UserError(f"{self} is a number to YAML 1.1, not true or false: write true or false")
            return self.flag
        if kind in (int, float):
            if self.number is None:
                raise UserError(self.why)
            return kind(self.number)
        return str(self)


def _base60(text: str) -> float:
    sign = -1 if text.startswith("-") else 1
    total = 0.0
    for part in text.lstrip("+-").replace("_", "").split(":"):
        total = total * 60 + float(part)
    return sign * total


def settled(value: Any, strict: bool = True) -> Any:
    """`value` as Axolotl and TRL read it (PyYAML, YAML 1.1): the yes/no words true or false; a
    number spelling that YAML 1.2 reads otherwise is refused (UserError), or with `strict` False
    left as it is (refused when its key is read); everything else as written."""
    if isinstance(value, Spelling):
        if value.flag is not None:
            return value.flag
        if strict:
            raise UserError(value.why)
        return value
    if isinstance(value, list):
        return [settled(v, strict) for v in value]
    if isinstance(value, dict):
        return {k: settled(v, strict) for k, v in value.items()}
    return value
