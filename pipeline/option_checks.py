"""The type and range of every option, checked one way for each face of a command: the config
dataclasses (`PackConfig`, `TrainConfig`, called from Python) run `check_options` in their
`validate`, and `--config FILE` (`pipeline.config_file`) runs `check_value` on each value of the
file. A value of the wrong type is refused, never coerced: `max_len=1024.7` is not 1024, and
`seed=True` is not 1.

Example: `Check(int, low=2)` accepts 2 and 4096, and refuses 1 ("--max-len must be >= 2, got 1"),
1024.7 and True ("--max-len must be an integer, got 1024.7").
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from pipeline.errors import UserError

INT_MAX = 2 ** 63 - 1  # the largest integer any option takes (what numpy, torch and C hold in 64 bits)
MAX_PROCS = 1024  # the most worker processes an option may ask for (more than any machine has cores)
PATH = "path"  # a `Check.kind`: text or an os.PathLike
PATHS = "paths"  # a list (or tuple) of paths; a lone string is refused
TEXTS = "texts"  # a list (or tuple) of texts; a lone string is refused
TEXT_MAP = "text map"  # a mapping of text to text


@dataclass(frozen=True)
class Check:
    """What one option accepts: its kind (int, float, bool, str, PATH or PATHS), an optional range
    or list of choices, and whether None ("not given") is allowed."""

    kind: Any
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()
    none: bool = False


KIND_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "text",
              PATH: "a path (text)", PATHS: "a list of paths, e.g. ['a.jsonl'] (not one string)",
              TEXTS: "a list of texts, e.g. ['<|im_end|>'] (not one string)",
              TEXT_MAP: "a mapping of names to texts, e.g. {eos_token: '<|im_end|>'}"}


def flag_of(name: str) -> str:
    """The command-line spelling of a config field: max_len -> --max-len."""
    return "--" + name.replace("_", "-")


def _is_kind(value: Any, kind: Any) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is bool:
        return isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if kind == PATH:
        return isinstance(value, (str, os.PathLike))
    if kind == PATHS:
        return isinstance(value, (list, tuple)) and all(isinstance(v, (str, os.PathLike)) for v in value)
    if kind == TEXTS:
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    if kind == TEXT_MAP:
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    raise TypeError(f"unknown Check kind {kind!r}")


def _range_text(check: Check) -> str:
    def num(x: float) -> str:  # 16777216, not 1.67772e+07
        return str(int(x)) if float(x).is_integer() else f"{x:g}"

    low = f"{'>' if check.low_open else '>='} {num(check.low)}" if check.low is not None else ""
    high = f"{'<' if check.high_open else '<='} {num(check.high)}" if check.high is not None else ""
    if low and high and check.low_open == check.high_open:
        return (f"between {num(check.low)} and {num(check.high)}"  # type: ignore[arg-type]
                + (" (exclusive)" if check.low_open else ""))
    return " and ".join(t for t in (low, high) if t)


def check_value(flag: str, value: Any, check: Check) -> None:
    """Raise UserError (one line naming `flag`) unless `value` has the kind, range and choices
    `check` allows."""
    if value is None:
        if check.none:
            return
        raise UserError(f"{flag} must be given ({KIND_WORDS[check.kind]}), got None")
    if not _is_kind(value, check.kind):
        raise UserError(f"{flag} must be {KIND_WORDS[check.kind]}, got {value!r} ({type(value).__name__})")
    if check.choices and value not in check.choices:
        raise UserError(f"unknown {flag} {value!r}: choose one of {', '.join(check.choices)}")
    too_low = check.low is not None and (value <= check.low if check.low_open else value < check.low)
    too_high = check.high is not None and (value >= check.high if check.high_open else value > check.high)
    if too_low or too_high:
        raise UserError(f"{flag} must be {_range_text(check)}, got {value}")
    if check.kind is int and not -INT_MAX - 1 <= value <= INT_MAX:  # numpy, torch and C take 64 bits
        raise UserError(f"{flag} must be a 64-bit integer (at most {INT_MAX} either side of 0), got {value}")


def check_options(config: object, checks: dict[str, Check], flags: dict[str, str] | None = None) -> None:
    """`check_value` on each field of `config` that `checks` names (its flag: `flags[name]`, else
    `flag_of(name)`)."""
    for name, check in checks.items():
        check_value((flags or {}).get(name) or flag_of(name), getattr(config, name), check)
