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
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from pipeline.errors import UserError


def read_config_file(path: str | Path, command: click.Command) -> dict[str, Any]:
    """`path`'s settings as a default_map for `command` (keys: its parameter names); an unreadable
    file, a file that is not a mapping or an unknown option is a UserError."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
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
    out = {}
    for key, value in data.items():
        found = names.get(str(key).replace("-", "_")) or names.get(str(key))
        if found is None:
            known = ", ".join(sorted({o.lstrip("-") for p in command.params if p.name != "config"
                                      for o in (*p.opts, *getattr(p, "secondary_opts", []))}))
            raise UserError(f"--config {path}: unknown option {key!r} (this command takes: {known})")
        name, inverse = found
        out[name] = (not value) if inverse and isinstance(value, bool) else value
    return out


def config_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add `--config FILE` to a click command (read before every other option)."""

    def load(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
        if value is None:
            return
        try:
            settings = read_config_file(value, ctx.command)
        except UserError as exc:
            raise click.ClickException(str(exc)) from None
        ctx.default_map = {**(ctx.default_map or {}), **settings}

    return click.option("--config", type=click.Path(dir_okay=False), is_eager=True, expose_value=False,
                        callback=load, help="YAML file of options (names as the flags, without dashes); "
                        "flags on the command line win.")(command)
