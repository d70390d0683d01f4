"""What every record of a JSON input must be, for both JSON readers (`pipeline.read.json_lines`,
`pipeline.read.json_array`): an object with each key once (`unique_keys`), one JSON type per field
across the records of a file (`type_conflict`), nested at most MAX_DEPTH levels, text without a
lone UTF-16 surrogate (`lone_surrogate`, found where a reader fails); and `Conformer`,
which keeps a column's type steady across the independently parsed tables of one file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from pipeline.errors import UserError


class Conformer:
    """Keeps a column's type steady across independently parsed chunks of one file.

    A column that is all-null in a chunk (type null) is cast to the type seen before, and a column
    missing from a chunk is added as nulls of its known type, so `input` missing or null in some
    chunks still arrives as a string column. Columns first seen in a later chunk appear from there.
    """

    def __init__(self) -> None:
        self.types: dict[str, pa.DataType] = {}

    def __call__(self, table: pa.Table) -> pa.Table:
        for name, typ in zip(table.column_names, table.schema.types):
            if not pa.types.is_null(typ):
                self.types[name] = typ
            elif name not in self.types:
                self.types[name] = typ
        cols, names = [], []
        for name, typ in self.types.items():
            if name in table.column_names:
                col = table.column(name)
                if pa.types.is_null(col.type) and not pa.types.is_null(typ):
                    col = pa.nulls(len(table), typ)
                cols.append(col)
            else:
                cols.append(pa.nulls(len(table), typ))
            names.append(name)
        return pa.table(cols, names=names) if names else table


def json_kind(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(v), type(v).__name__)


MAX_DEPTH = 1000  # nesting levels of a JSON value read (as Python's json module, whose limit is about this)


def type_conflict(path: str, items: Iterator[tuple[int, Any]]) -> UserError | None:
    """First top-level field whose JSON type changes between records: items are (line, obj)."""
    first: dict[str, tuple[str, int]] = {}
    for line, obj in items:
        for key, value in obj.items():
            if value is None:
                continue
            kind = json_kind(value)
            seen = first.setdefault(key, (kind, line))
            if seen[0] != kind:
                return UserError(
                    f"{path} line {line}: field {key!r} is a {kind} here but a "
                    f"{seen[0]} on line {seen[1]}: use one type per field in every "
                    "record"
                )
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate_field(obj: dict[str, Any]) -> tuple[str, str] | None:
    """(where, the surrogate's escape) of the first key or string in `obj` holding a lone UTF-16
    surrogate, where as "field 'messages[1].content'" or "a key of 'messages[1]'"; None when none."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found:
                return f"field {short(where)!r}", f"\\u{ord(found.group()):04x}"
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                field = f"{where}.{key}" if where else key
                found = _SURROGATE.search(key)
                if found:
                    return f"a key of {short(where)!r}" if where else "a key", f"\\u{ord(found.group()):04x}"
                stack.append((field, item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def lone_surrogate(path: str, items: Iterable[tuple[int, dict[str, Any]]]) -> UserError | None:
    """The first record (items: (line, obj)) whose text holds a lone UTF-16 surrogate: JSON's
    "\\ud800" escape without the other half of its pair, which Python's json reads but which is no
    Unicode text (no UTF-8 file, Arrow string or tokenizer can hold it)."""
    for line, obj in items:
        found = _lone_surrogate_field(obj)
        if found:
            where, escape = found
            return UserError(
                f"{path} line {line}: {where} holds a lone surrogate {escape} (half of "
                "a UTF-16 pair, not a character): fix the text, e.g. replace it with \\ufffd or remove it"
            )
    return None


class DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object_pairs_hook that refuses a key given twice (json would keep the last)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return obj


def short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _text_part(value: Any) -> Any:
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


def uniform_content(chunk: bytes) -> bytes | None:
    """JSON Lines whose chat messages mix text and OpenAI content lists (`"content": "Be brief."`
    beside `"content": [{"type": "text", ...}]`), which pyarrow cannot hold in one column, with every
    text content of those messages written as one text part, line for line; None when the chunk has
    no such mix (its error is another one). The chat renderer treats one text part as the text."""
    import json

    lines = chunk.split(b"\n")
    records: list[Any] = []
    mixed: set[str] = set()
    try:
        for raw in lines:
            records.append(json.loads(raw) if raw.strip() else None)
    except ValueError:
        return None
    kinds: dict[str, set[bool]] = {}
    for obj in records:
        if not isinstance(obj, dict):
            continue
        for key, value in obj.items():
            if isinstance(value, list):
                for m in value:
                    if isinstance(m, dict) and "content" in m and m["content"] is not None:
                        kinds.setdefault(key, set()).add(isinstance(m["content"], list))
    mixed = {key for key, seen in kinds.items() if seen == {True, False}}
    if not mixed:
        return None
    out = []
    for raw, obj in zip(lines, records):
        if isinstance(obj, dict):
            for key in mixed & set(obj):
                if isinstance(obj[key], list):
                    obj[key] = [
                        {**m, "content": _text_part(m["content"])} if isinstance(m, dict) and "content" in m else m for m in obj[key]
                    ]
            raw = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        out.append(raw)
    return b"\n".join(out)
