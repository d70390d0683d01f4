"""`--config FILE.yaml` for the commands: every option from a YAML (or JSON) file, flags on the
command line win.

The file maps option names, spelled as on the command line without the dashes (`max-len`) or with
underscores (`max_len`), to values; INPUT arguments go under `inputs`. It becomes click's
`default_map`, so each value is parsed and checked exactly like the flag, and a flag given on the
command line overrides it. For example, with `pack.yaml`:

    inputs: [data/sample/instructions.jsonl]
    tokenizer: data/tokenizer
    max-len: 4096
    out: out/sample

`pack-data --config pack.yaml --max-len 8192` packs at 8192.

Each value must have the type the flag takes (no coercion: `max-len: 1024.7` and `seed: true` are
refused, not read as 1024 and 1) and pass the flag's range and choices (the command's config
dataclass checks, `pipeline.option_checks`); a value that fails is one line naming the file, the key
and the option. An option given twice (`max-len` and `max_len`, or one key repeated) is refused
too. `key: null` (or an empty value) leaves the flag's default; `true` for an option whose flag may
stand alone (`resume: true`, `grad-checkpointing: true`) means the flag alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from pipeline.errors import UserError
from pipeline.option_checks import Check, check_value


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

    return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader)


def read_config_file(path: str | Path, command: click.Command, checks: dict[str, Check] | None = None,
                     fields: dict[str, str] | None = None) -> dict[str, Any]:
    """`path`'s settings as a default_map for `command` (keys: its parameter names); an unreadable
    file, a file that is not a mapping, an unknown or repeated option, or a value the flag would
    refuse is a UserError. `checks` (a config dataclass's, `pipeline.option_checks`) are run on the
    values of the parameters they name (`fields` maps a parameter name to its field name where
    they differ)."""
    import yaml

    try:
        data = _load_yaml(Path(path).read_text(encoding="utf-8"))
    except _Repeated as exc:
        raise UserError(f"--config {path} line {exc.line}: option {exc.key!r} is given twice: keep one") from None
    except _Alias as exc:
        raise UserError(f"--config {path} line {exc.line}: a YAML alias (*{exc.anchor}) is not accepted in a config "
                        "file: write the value out") from None
    except OSError as exc:
        raise UserError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"--config {path}{where}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of option names to values, got {type(data).__name__}")
    names: dict[str, tuple[str, bool]] = {}  # spelling -> (parameter name, a --no-x flag's inverse)
    for param in command.params:
        if param.name == "config":
            continue
        spellings = [(param.name, False), *((o.lstrip("-"), False) for o in param.opts),
                     *((o.lstrip("-"), True) for o in getattr(param, "secondary_opts", []))]
        for spelling, inverse in spellings:
            names[spelling] = names[spelling.replace("-", "_")] = (param.name, inverse)
    params = {p.name: p for p in command.params}
    out: dict[str, Any] = {}
    keys: dict[str, object] = {}
    for key, value in data.items():
        found = names.get(str(key).replace("-", "_")) or names.get(str(key))
        if found is None:
            known = ", ".join(sorted({o.lstrip("-") for p in command.params if p.name != "config"
                                      for o in (*p.opts, *getattr(p, "secondary_opts", []))}))
            raise UserError(f"--config {path}: unknown option {key!r} (this command takes: {known})")
        name, inverse = found
        if name in keys:
            raise UserError(f"--config {path}: {keys[name]!r} and {key!r} both set {_flag(params[name])}: keep one")
        keys[name] = key
        try:
            value = _checked(params[name], value, (checks or {}).get((fields or {}).get(name, name)))
        except UserError as exc:
            raise UserError(f"--config {path}: key {key!r}: {exc}") from None
        if value is not None:  # `key:` or `key: null`: not given, the flag's default holds
            out[name] = (not value) if inverse and isinstance(value, bool) else value
    return out


def _flag(param: click.Parameter) -> str:
    return param.opts[0] if param.opts and param.opts[0].startswith("-") else str(param.name).upper()


def _checked(param: click.Parameter, value: Any, check: Check | None) -> Any:
    """`value` from the file for `param`, if it has the type the flag takes and passes the flag's
    own conversion (click's range and choice checks) and `check`, else UserError."""
    if value is None:
        return None
    flag, many = _flag(param), getattr(param, "multiple", False) or param.nargs == -1
    if many and isinstance(value, str):
        value = [value]  # one INPUT
    if value is True and getattr(param, "_flag_needs_value", False):
        value = param.flag_value  # `resume: true`: the flag alone (--resume, i.e. newest)
    items = value if many else [value]
    if many and not isinstance(value, list):
        raise UserError(f"{flag} takes a list, got {value!r} ({type(value).__name__})")
    kind = (bool if getattr(param, "is_flag", False) else
            int if isinstance(param.type, (click.types.IntParamType, click.IntRange)) else
            float if isinstance(param.type, (click.types.FloatParamType, click.FloatRange)) else
            str if isinstance(param.type, (click.types.StringParamType, click.Choice, click.Path)) else None)
    for item in items:
        if isinstance(item, str) and kind in (int, float):
            continue  # text, read as the flag's text would be
        if kind is not None:
            check_value(flag, item, Check(kind))
    try:  # a path's existence is checked when the command runs (a flag may replace it)
        items = items if isinstance(param.type, click.Path) else [param.type.convert(i, param, None) for i in items]
    except click.BadParameter as exc:
        raise UserError(f"{flag}: {exc.format_message()}") from None
    value = items if many else items[0]
    if check is not None:
        check_value(flag, value, check)
    return value


def config_option(command: Callable[..., Any] | None = None, *, checks: dict[str, Check] | None = None,
                  fields: dict[str, str] | None = None) -> Any:
    """Add `--config FILE` to a click command (read before every other option): `@config_option`, or
    `@config_option(checks=..., fields=...)` to run a config dataclass's checks on the file's values
    (see `read_config_file`)."""
    if command is None:
        return lambda cmd: config_option(cmd, checks=checks, fields=fields)

    def load(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
        if value is None:
            return
        try:
            settings = read_config_file(value, ctx.command, checks, fields)
        except UserError as exc:
            raise click.ClickException(str(exc)) from None
        ctx.default_map = {**(ctx.default_map or {}), **settings}

    return click.option("--config", type=click.Path(dir_okay=False), is_eager=True, expose_value=False,
                        callback=load, help="YAML file of options (names as the flags, without dashes); "
                        "flags on the command line win.")(command)
