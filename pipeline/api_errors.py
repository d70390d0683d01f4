"""Errors in the words of the caller: library code names options as the console commands spell
them (`--max-len`, `--resume`); a Python caller of `run_pack_data(PackConfig(...))` or
`train(TrainConfig(...))` gets the same one line with the config's parameter names instead
(`max_len`, `resume='newest'`), never a flag it has no way to pass.

`@python_spelling(Config)` on an entry point does it when no click command is running (the console
commands call the same functions, inside their click command, and keep the flags).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

from pipeline.errors import UserError

F = TypeVar("F", bound=Callable[..., Any])
_FLAG = re.compile(r"(?<![\w-])--(no-)?([a-z][a-z0-9-]*)(?:=([\w.-]+))?")
# What a flag given alone means, where that is not True (`--resume` is `--resume=newest`).
FLAG_ALONE = {"resume": "newest"}


def parameter_names(message: str, config_type: type) -> str:
    """`message` with each `--flag` of a `config_type` field written as that parameter: `--max-len`
    as `max_len`, `--resume=strict` as `resume='strict'`, `--overwrite` (a bool flag) as
    `overwrite=True`, `--no-progress` as `progress=False`. Other text is unchanged."""
    fields = {f.name: f for f in dataclasses.fields(config_type)}

    def spell(m: re.Match) -> str:
        negated, name, value = m.group(1), m.group(2).replace("-", "_"), m.group(3)
        field = fields.get(name)
        if field is None:
            return m.group(0)
        is_bool = "bool" in str(field.type)
        if negated:
            return f"{name}=False" if is_bool else m.group(0)
        if value is not None:
            return f"{name}={value!r}"
        if name in FLAG_ALONE:
            return f"{name}={FLAG_ALONE[name]!r}"
        return f"{name}=True" if is_bool else name

    return _FLAG.sub(spell, message)


def python_spelling(config_type: type) -> Callable[[F], F]:
    """Decorate an API entry point: a UserError it raises to a Python caller names `config_type`'s
    parameters instead of the console command's flags (same exception, same type)."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except UserError as exc:
                if not _in_click_command() and len(exc.args) == 1 and isinstance(exc.args[0], str):
                    exc.args = (parameter_names(exc.args[0], config_type),)
                raise

        return wrapper  # type: ignore[return-value]

    return decorate


def _in_click_command() -> bool:
    import click

    return click.get_current_context(silent=True) is not None
