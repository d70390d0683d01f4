"""The type and range of every option, checked one way for each face of a command: the config
dataclasses (`PackConfig`, `TrainConfig`, called from Python) run `check_options` in their
`validate`, and `--config FILE` (`pipeline.config_file`) runs `check_value` on each value of the
file. A value of the wrong type is refused, never coerced: `max_len=1024.7` is not 1024, and
`seed=True` is not 1.

Each option is declared once, on its config field (`opt`: type, default, range or choices, help,
section); the checks (`checks_of`), the click options (`click_options`) and
the README's option tables (`option_table`) are generated from it.

Example: `Check(int, low=2)` accepts 2 and 4096, and refuses 1 ("--max-len must be >= 2, got 1"),
1024.7 and True ("--max-len must be an integer, got 1024.7").
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

import click

from pipeline.errors import UserError

INT_MAX = 2**63 - 1  # the largest integer any option takes (what numpy, torch and C hold in 64 bits)
MAX_PROCS = 1024  # the most worker processes an option may ask for (more than any machine has cores)
PATH = "path"  # a `Check.kind`: text or an os.PathLike
PATHS = "paths"  # a list (or tuple) of paths; a lone string is refused
TEXTS = "texts"  # a list (or tuple) of texts; a lone string is refused
TEXT_MAP = "text map"  # a mapping of text to text


@dataclass(frozen=True)
class Check:
    """What one option accepts: its kind (int, float, bool, str, PATH or PATHS), an optional range
    or list of choices, whether None ("not given") is allowed, and (`comma_list`) whether a --config
    file's list of texts is taken as the text of them joined with commas (`lora-target: [q_proj, v_proj]`)."""

    kind: Any
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()
    none: bool = False
    comma_list: bool = False  # text that is a comma-separated list: a --config file may give a YAML list


KIND_WORDS = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "text",
    PATH: "a path (text)",
    PATHS: "a list of paths, e.g. ['a.jsonl'] (not one string)",
    TEXTS: "a list of texts, e.g. ['<|im_end|>'] (not one string)",
    TEXT_MAP: "a mapping of names to texts, e.g. {eos_token: '<|im_end|>'}",
}


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
        return (
            f"between {num(check.low)} and {num(check.high)}"  # type: ignore[arg-type]
            + (" (exclusive)" if check.low_open else "")
        )
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


# ------------------------------------------------------------------ one declaration per option


@dataclass(frozen=True)
class Option:
    """The declaration of one option, held in its config field's metadata (`opt`): what the field
    accepts (`check`, its kind read from the field's type unless given), its help and its section;
    `flags` (click's declarations, default `--field-name`, `--x/--no-x` for a bool that defaults to
    on or to None), `invert` (the flag stores the field's opposite: `--no-progress`), `cli` (False:
    no flag, a field only Python callers and `--config` set) and `click` (other click settings:
    metavar, is_flag, flag_value, multiple, show_default, hidden). The click option, the checks of
    `validate` and of `--config FILE`, and the README's tables are all generated from it."""

    check: Check
    help: str
    section: str
    flags: tuple[str, ...] = ()
    invert: bool = False
    cli: bool = True
    click: tuple[tuple[str, Any], ...] = ()


def opt(
    default: Any = MISSING,
    *,
    help: str,
    section: str,
    kind: Any = None,
    low: float | None = None,  # noqa: A002
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    choices: tuple[str, ...] = (),
    comma_list: bool = False,
    flags: tuple[str, ...] = (),
    invert: bool = False,
    cli: bool = True,
    factory: Callable[[], Any] | None = None,
    **click_settings: Any,
) -> Any:
    """A config field with its option's declaration (`Option`), e.g.
    `lr: float = opt(3e-4, low=0, low_open=True, help="Peak learning rate (AdamW).", section="Optimizer")`.
    No `default` (and no `factory`): a required option. `kind` is read from the field's type
    (`int | None` is an int that may be None) unless given (PATH, PATHS, TEXTS, TEXT_MAP)."""
    check = Check(kind, low, high, low_open, high_open, tuple(choices), comma_list=comma_list)
    declared = Option(check, help, section, tuple(flags), invert, cli, tuple(click_settings.items()))
    if factory is not None:
        return field(default_factory=factory, metadata={"option": declared})
    return field(default=default, metadata={"option": declared})


_KINDS = {"int": int, "float": float, "bool": bool, "str": str, "tuple[str, ...]": TEXTS, "list[str]": PATHS, "dict[str, str]": TEXT_MAP}


@functools.cache
def declarations(config_type: type) -> dict[str, Option]:
    """Every declared field of the config dataclass `config_type`, in field order, each with its
    check complete (its kind and whether None is allowed, from the field's type)."""
    out = {}
    for f in fields(config_type):
        declared = f.metadata.get("option")
        if declared is None:
            continue
        kind = str(f.type).removesuffix(" | None")
        check = replace(declared.check, kind=declared.check.kind or _KINDS[kind], none=kind != str(f.type))
        out[f.name] = replace(declared, check=check)
    return out


def checks_of(config_type: type) -> dict[str, Check]:
    """The check of every declared field of `config_type` (`check_options`, `--config FILE`)."""
    return {name: declared.check for name, declared in declarations(config_type).items()}


def default_of(config_type: type, name: str) -> Any:
    """The default of field `name` (MISSING for a required one)."""
    f = config_type.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not MISSING else f.default


def flag_decls(name: str, declared: Option, default: Any) -> tuple[str, ...]:
    """The click declarations of an option: its `flags`, else `--name`, `--name/--no-name` for a
    bool that defaults to on or to None (a bool that defaults to off is a flag alone)."""
    if declared.flags:
        return declared.flags
    if declared.check.kind is bool and default is not False:
        return (f"{flag_of(name)}/--no-{name.replace('_', '-')}",)
    return (flag_of(name),)


def option_sections(config_type: type) -> dict[str, list[str]]:
    """The declared fields of `config_type` with a flag, by section: in the order of its `SECTIONS`
    where it has one, else in the order they first appear among the fields. A hidden option
    (`opt(..., hidden=True)`) is in none: click_options adds those after the others."""
    out: dict[str, list[str]] = {section: [] for section in getattr(config_type, "SECTIONS", ())}
    for name, declared in declarations(config_type).items():
        if declared.cli and not dict(declared.click).get("hidden"):
            out.setdefault(declared.section, []).append(name)
    return {section: names for section, names in out.items() if names}


def click_options(
    config_type: type, *, ranges: bool, settings: dict[str, dict[str, Any]] | None = None, skip: tuple[str, ...] = ()
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator adding a click option for every declared field of `config_type` with a flag
    (`pipeline.option_checks.opt`), by section: its flag names, default, help and click settings from
    the declaration, its type from the check (`click.Choice` for choices; with `ranges`, a range
    type for a bounded number, so click refuses it; without, the command's `validate` does).
    `settings` gives a field the click settings only the command knows (a click type such as a
    folder that must exist, a callback), and `skip` leaves fields out (an argument declared by hand)."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        shown = [name for names in option_sections(config_type).values() for name in names]
        hidden = [name for name, d in declarations(config_type).items() if d.cli and name not in shown]
        options = [_click_option(config_type, name, ranges, (settings or {}).get(name, {})) for name in shown + hidden if name not in skip]
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def _click_option(config_type: type, name: str, ranges: bool, given: dict[str, Any]) -> Callable[..., Any]:
    declared = declarations(config_type)[name]
    check, default, settings = declared.check, default_of(config_type, name), {**dict(declared.click), **given}
    kind_type: Any = None
    if check.choices:
        kind_type = click.Choice(check.choices)
    elif check.kind in (int, float) and ranges and (check.low is not None or check.high is not None):
        kind_type = (click.IntRange if check.kind is int else click.FloatRange)(
            check.low, check.high, min_open=check.low_open, max_open=check.high_open
        )
    elif check.kind in (int, float):
        kind_type = check.kind
    decls = flag_decls(name, declared, default)
    if check.kind is bool and "/" not in decls[0]:
        settings.setdefault("is_flag", True)  # a bool that defaults to off (or an inverted one): the flag alone
    elif kind_type is not None:
        settings.setdefault("type", kind_type)
    if default is MISSING:
        settings["required"] = True
    elif not (settings.get("multiple") and not default):  # a multiple option's empty default is click's own
        settings.setdefault("default", (not default) if declared.invert else default)
    return click.option(*decls, help=declared.help or None, **settings)


def param_name(name: str, declared: Option, default: Any) -> str:
    """The click parameter of a declared field: the name its flags give it (`compile_`, `fmt`,
    `no_progress`), else the field's own."""
    decls = flag_decls(name, declared, default)
    given = [d for d in decls if not d.startswith("-")]
    return given[0] if given else decls[0].split("/")[0].lstrip("-").replace("-", "_")


def param_fields(config_type: type) -> dict[str, str]:
    """Click parameter -> field of `config_type`, where they differ (`--config FILE`'s checks)."""
    pairs = ((param_name(n, d, default_of(config_type, n)), n) for n, d in declarations(config_type).items())
    return {param: name for param, name in pairs if param != name}


def field_values(config_type: type, values: dict[str, Any]) -> dict[str, Any]:
    """A click command's values as `config_type`'s keyword arguments: each under its field's name
    (`compile_` as `compile`), an inverted flag's negated (`--no-progress` is progress=False)."""
    out = dict(values)
    for name, declared in declarations(config_type).items():
        param = param_name(name, declared, default_of(config_type, name))
        if declared.cli and param in out:
            value = out.pop(param)
            out[name] = (not value) if declared.invert else value
    return out


_TABLE_KINDS = {
    int: "integer",
    float: "number",
    bool: "on/off",
    str: "text",
    PATH: "path",
    PATHS: "paths",
    TEXTS: "text, repeatable",
    TEXT_MAP: "NAME=TEXT, repeatable",
}


def option_table(config_type: type) -> str:
    """Markdown tables of `config_type`'s options by section (the README's, between its
    `<!-- options:COMMAND -->` markers): each flag, its default, what it accepts and its help."""

    def cell(text: object) -> str:
        return str(text).replace("|", "\\|")

    declared = declarations(config_type)
    out = []
    for section, names in option_sections(config_type).items():
        out += [f"**{section}**", "", "| Option | Default | Accepts | Description |", "| --- | --- | --- | --- |"]
        for name in names:
            d, default = declared[name], default_of(config_type, name)
            flags = " / ".join(f"`{f}`" for decl in flag_decls(name, d, default) if decl.startswith("-") for f in decl.split("/"))
            shown = (
                "required"
                if default is MISSING
                else "off"
                if d.invert or default is False
                else "on"
                if default is True
                else "-"
                if default in (None, (), {})
                else ", ".join(default)
                if isinstance(default, tuple)
                else default
            )
            accepts = (
                ", ".join(d.check.choices)
                if d.check.choices
                else " ".join(t for t in (_TABLE_KINDS[d.check.kind], _range_text(d.check)) if t)
            )
            out.append(f"| {flags} | {cell(shown)} | {cell(accepts)} | {cell(d.help)} |")
        out.append("")
    return "\n".join(out)


# the config dataclass of each command, for `python -m pipeline.option_checks COMMAND`; named, not
# imported, since pipeline imports no trainer module
CONFIGS = {"pack-data": "pipeline.engines.pack_config:PackConfig", "pack-train": "trainer.config:TrainConfig"}


if __name__ == "__main__":  # python -m pipeline.option_checks pack-data|pack-train: the README's tables
    import importlib
    import sys

    if len(sys.argv) != 2 or sys.argv[1] not in CONFIGS:
        sys.exit(f"usage: python -m pipeline.option_checks {'|'.join(CONFIGS)}")
    module, _, name = CONFIGS[sys.argv[1]].partition(":")
    print(option_table(getattr(importlib.import_module(module), name)), end="")
