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

An Axolotl or TRL (`trl sft`) YAML is read as it is: each of their keys that means something here
is mapped to options of ours, each that does not is named with why (`pipeline.foreign.config`), what
the file leaves out takes that tool's defaults (`foreign_schema.source_defaults`), and the mapping is
printed once, key by key, on stderr. Every key whose meaning cannot be honoured is named in one line,
all at once (an error line quoting a long value is cut):

    pack-train --config axolotl.yaml (Axolotl keys):
      base_model: NousResearch/Llama-3.2-1B -> --model NousResearch/Llama-3.2-1B
      learning_rate: 0.0002 -> --lr 0.0002
      datasets: not used by pack-train: pack-data's: run pack-data --config with the same file
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from pipeline.config_yaml import (  # noqa: F401 - MAX_CONFIG_BYTES: the limit, imported from here too
    MAX_CONFIG_BYTES,
    Spelling,
    _Alias,
    _config_text,
    _load_yaml,
    _Repeated,
    settled,
)
from pipeline.errors import UserError
from pipeline.foreign import config as foreign_config
from pipeline.option_checks import TEXT_MAP, Check, check_value


def read_config_file(
    path: str | Path,
    command: click.Command,
    checks: dict[str, Check] | None = None,
    fields: dict[str, str] | None = None,
    *,
    foreign: str | None = None,
    mapping: list[str] | None = None,
) -> dict[str, Any]:
    """`path`'s settings as a default_map for `command` (keys: its parameter names); an unreadable
    file, a file that is not a mapping, an unknown or repeated option, or a value the flag would
    refuse is a UserError. `checks` (a config dataclass's, `pipeline.option_checks`) are run on the
    values of the parameters they name (`fields` maps a parameter name to its field name where
    they differ). `foreign` (the command's name, `foreign_config.TRAIN` or `DATA`) also reads the
    Axolotl and TRL keys of `foreign_config.KEYS`; `mapping` then receives one line per such key
    (what it became, or why it is not used), after a heading line naming the file."""
    import yaml

    try:
        data = _load_yaml(_config_text(path))
    except _Repeated as exc:
        raise UserError(f"--config {path} line {exc.line}: option {exc.key!r} is given twice: keep one") from None
    except RecursionError:
        raise UserError(f"--config {path}: values nested too deeply (thousands of levels): write plain values") from None
    except _Alias as exc:
        raise UserError(
            f"--config {path} line {exc.line}: a YAML alias (*{exc.anchor}) is not accepted in a config file: write the value out"
        ) from None
    except OSError as exc:
        raise UserError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise UserError(
            f"--config {path} line {line}: not UTF-8 text (byte {exc.object[exc.start]:#04x}): save the file as UTF-8"
        ) from None
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
        spellings = [
            (param.name, False),
            *((o.lstrip("-"), False) for o in param.opts),
            *((o.lstrip("-"), True) for o in getattr(param, "secondary_opts", [])),
        ]
        for spelling, inverse in spellings:
            names[spelling] = names[spelling.replace("-", "_")] = (param.name, inverse)
    params = {p.name: p for p in command.params}
    out: dict[str, Any] = {}
    keys: dict[str, object] = {}
    tool = foreign_config.looks_foreign(data) if foreign else None
    if tool is not None:
        data = settled(data, strict=False)  # the yes/no words as the tool reads them
    lines: list[str] = []
    refused: list[str] = []  # every key that cannot be honoured, named together in one line

    def take(key: object, name: str, value: Any, inverse: bool = False) -> Any:
        if name not in params:  # an option another version of the command has
            raise UserError(f"needs {command.name} --{name.replace('_', '-')}, which this version does not have")
        try:
            value = _checked(params[name], value, (checks or {}).get((fields or {}).get(name, name)))
        except UserError as exc:
            raise UserError(f"key {key!r}: {exc}") from None
        if value is not None:  # `key:` or `key: null`: not given, the flag's default holds
            value = (not value) if inverse and isinstance(value, bool) else value
            if name in keys and out.get(name) != value:
                raise UserError(f"keys {keys[name]!r} and {key!r} both set {_flag(params[name])}: keep one")
            keys[name], out[name] = key, value
        return value

    for key, value in data.items():
        try:
            line = _read_key(key, value, data, foreign, tool, names, params, take)
        except UserError as exc:
            text = str(exc)
            refused.append(text if text.startswith("key") else f"key {key!r}: {text}")
            continue
        except RecursionError:
            refused.append(f"key {key!r}: nested too deeply to be a setting: give a plain value")
            continue
        if line:
            lines.append(line)
    if foreign and tool in (foreign_config.AXOLOTL, foreign_config.TRL):
        lines.extend(foreign_config.source_defaults(tool, foreign, data, out, take, refused))
    if refused:
        head = f"--config {path}: " + ("" if len(refused) == 1 else f"{len(refused)} keys cannot be honoured here (all named at once): ")
        raise UserError(cut(head + "; ".join(refused)))
    if mapping is not None and lines:
        mapping.append(f"{foreign} --config {path} ({tool or 'Axolotl/TRL'} keys):")
        mapping.extend(lines)
    return out


def _read_key(
    key: object,
    value: Any,
    data: dict,
    foreign: str | None,
    tool: str | None,
    names: dict[str, tuple[str, bool]],
    params: dict[str, click.Parameter],
    take: Callable[..., Any],
) -> str | None:
    """Take one key of the file: its line of the printed mapping (None for our own options), or a
    UserError for a key that cannot be honoured."""
    if tool and isinstance(value, str) and value.strip().lower() in ("true", "false"):  # the tools read it as a yes/no
        raise UserError(f"key {key!r}: {value!r} is quoted text where true or false goes: write it unquoted")
    rule = foreign_config.rule(str(key), foreign) if foreign else None
    if isinstance(rule, foreign_config.Unused):
        return f"  {key}: not used by {foreign}: {rule.why}"
    found = names.get(str(key).replace("-", "_")) or names.get(str(key))
    if rule is not None or (found is None and tool is not None):
        value = settled(value)  # an Axolotl/TRL key: as the tool reads it, or refused (`Spelling`)
    if rule is not None:
        if value is None or value == "":
            return f"  {key}: (empty) -> (the defaults)"
        try:
            mapped = rule.apply(value, data)
        except foreign_config.NotUsed as exc:
            return f"  {key}: {foreign_config.show(value)}: not used ({exc})"
        shown = [
            f"{_flag(params[name]) if name in params else name} {foreign_config.show(take(key, name, v))}" for name, v in mapped.items()
        ]
        return f"  {key}: {foreign_config.show(value)} -> {' '.join(shown) or '(the defaults)'}"
    if found is None:
        if tool is not None:
            return foreign_config.schema_key(str(key), value, tool, foreign or "")
        known = ", ".join(
            sorted({o.lstrip("-") for p in params.values() if p.name != "config" for o in (*p.opts, *getattr(p, "secondary_opts", []))})
        )
        raise UserError(f"unknown option {key!r} (this command takes: {known})")
    name, inverse = found
    take(key, name, value, inverse)
    return None


def cut(text: str, limit: int = 1000) -> str:
    """An error line of at most about `limit` characters: a long value quoted in it (a 100,000-character
    string) is cut in the middle, so the line keeps what is wrong, where, and the fix at its end."""
    if len(text) <= limit:
        return text
    return f"{text[: limit * 2 // 3]} ...({len(text) - limit} characters cut)... {text[-limit // 3 :]}"


def _flag(param: click.Parameter) -> str:
    return param.opts[0] if param.opts and param.opts[0].startswith("-") else str(param.name).upper()


def _checked(param: click.Parameter, value: Any, check: Check | None) -> Any:
    """`value` from the file for `param`, if it has the type the flag takes and passes the flag's
    own conversion (click's range and choice checks) and `check`, else UserError."""
    if value is None:
        return None
    flag, many = _flag(param), getattr(param, "multiple", False) or param.nargs == -1
    if check.kind == TEXT_MAP if check is not None else many and isinstance(value, dict):
        # `special-token: {eos_token: ...}`, or its NAME=TEXT texts: the command's callback takes the
        # mapping as it is (pipeline.cli._special_tokens)
        if isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value):
            value = {name.strip(): text for name, _, text in (v.partition("=") for v in value)}
        check_value(flag, value, check or Check(TEXT_MAP))
        return value
    if many and isinstance(value, str):
        value = [value]  # one INPUT
    if check is not None and check.comma_list and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        value = ",".join(value)  # `lora-target: [q_proj, v_proj]`
    kind = (
        bool
        if getattr(param, "is_flag", False)
        else int
        if isinstance(param.type, (click.types.IntParamType, click.IntRange))
        else float
        if isinstance(param.type, (click.types.FloatParamType, click.FloatRange))
        else str
        if isinstance(param.type, (click.types.StringParamType, click.Choice, click.Path))
        else None
    )
    try:  # `yes`, `1:30`, `017`: what the option takes, or refused (`Spelling`)
        value = (
            [v.settle(kind) if isinstance(v, Spelling) else v for v in value]
            if isinstance(value, list)
            else value.settle(bool if getattr(param, "_flag_needs_value", False) and value.flag is not None else kind)
            if isinstance(value, Spelling)
            else value
        )
    except UserError as exc:
        raise UserError(f"{flag}: {exc}") from None
    if value is True and getattr(param, "_flag_needs_value", False):
        value = param.flag_value  # `resume: true`: the flag alone (--resume, i.e. newest)
    items = value if many else [value]
    if many and not isinstance(value, list):
        raise UserError(f"{flag} takes a list, got {value!r} ({type(value).__name__})")
    for item in items:
        if isinstance(item, str) and kind in (int, float):
            continue  # text, read as the flag's text would be
        if kind is not None:
            check_value(flag, item, Check(kind))
    if check is not None and not many and not isinstance(value, str):  # the check's words before click's
        check_value(flag, value, check)
    try:  # a path's existence is checked when the command runs (a flag may replace it)
        items = items if isinstance(param.type, click.Path) else [param.type.convert(i, param, None) for i in items]
    except click.BadParameter as exc:
        raise UserError(f"{flag}: {exc.format_message()}") from None
    value = items if many else items[0]
    if check is not None:
        check_value(flag, value, check)
    return value


def config_option(
    command: Callable[..., Any] | None = None,
    *,
    checks: dict[str, Check] | None = None,
    fields: dict[str, str] | None = None,
    foreign: str | None = None,
) -> Any:
    """Add `--config FILE` to a click command (read before every other option): `@config_option`, or
    `@config_option(checks=..., fields=..., foreign=...)` to run a config dataclass's checks on the
    file's values and read Axolotl/TRL keys as the command `foreign` (see `read_config_file`); the
    mapping of those keys is printed on stderr (by rank 0 under torchrun)."""
    if command is None:
        return lambda cmd: config_option(cmd, checks=checks, fields=fields, foreign=foreign)

    def load(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
        if value is None:
            return
        mapping: list[str] = []
        try:
            settings = read_config_file(value, ctx.command, checks, fields, foreign=foreign, mapping=mapping)
        except UserError as exc:
            raise click.ClickException(cut(" ".join(str(exc).split()))) from None
        if mapping and os.environ.get("RANK", "0") == "0":
            click.echo("\n".join(mapping), err=True)
        ctx.default_map = {**(ctx.default_map or {}), **settings}

    return click.option(
        "--config",
        type=click.Path(dir_okay=False),
        is_eager=True,
        expose_value=False,
        callback=load,
        help="YAML file of options (names as the flags, without dashes); flags on the command line win.",
    )(command)


class HintedCommand(click.Command):
    """A click command whose unknown option names the option meant when it is an Axolotl/TRL key
    (`--output_dir`: "here it is --out") or one of ours spelled with underscores (`--max_steps`),
    instead of click's closest spelling."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            foreign = self.name if self.name in (foreign_config.TRAIN, foreign_config.DATA) else None
            hint = option_hint(exc.option_name, self, foreign)
            if hint is None:
                raise
            raise click.NoSuchOption(exc.option_name, f"No such option: {exc.option_name}: {hint}", ctx=ctx) from None


def option_hint(option: str, command: click.Command, foreign: str | None) -> str | None:
    """What to give instead of the unknown `option` (`--output_dir`), or None when nothing fits."""
    key = option.lstrip("-").split("=", 1)[0]
    flags = {o for p in command.params for o in (*p.opts, *getattr(p, "secondary_opts", []))}
    dashed = "--" + key.replace("_", "-")
    if dashed in flags:
        return f"options are spelled with dashes: {dashed}"
    rule = foreign_config.rule(key, foreign) if foreign else None
    if isinstance(rule, foreign_config.Unused):
        return f"{key} is an Axolotl/TRL key that {foreign} does not use: {rule.why}"
    if rule is not None and rule.options:
        params = {p.name: p for p in command.params}
        ours = " / ".join(_flag(params[o]) for o in rule.options if o in params)
        return f"{key} is the Axolotl/TRL name; here it is {ours}{' (' + rule.doc + ')' if rule.doc else ''}"
    return None
