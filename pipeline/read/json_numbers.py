"""JSON numbers read as text: a number in a field that is read as text (a response of
`12345678901234567890`, a price of `1.10`) must reach the tokenizer as the text the file holds, not
as a float's rendering of it (`1.2345678901234567e+19`, `1.1`). pyarrow parses such numbers as
doubles and Python's json as floats, so the readers of JSON Lines (`exact_numbers`) and of JSON arrays
(`exact_float`, `exact_column`) keep their text here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

import pyarrow as pa

_WS = re.compile(r"[ \t\n\r]*")
_RAW_NUMBERS = json.JSONDecoder(parse_float=str, parse_int=str)  # numbers as the text the file holds


def exact_numbers(table: pa.Table, chunk: bytes, columns: Collection[str] | None = None) -> pa.Table:
    """The top-level columns pyarrow parsed as floating point (JSON numbers with a fraction or an
    exponent, and integers too long for int64), as the exact text of those numbers in `chunk`: a
    number read as a text field stays the string the file holds (`12345678901234567890`, `1.10`),
    never a float's rendering of it. `columns`: only those (the text fields of the file's format;
    None: every such column), since this decodes the chunk once more in Python. Other columns, and
    chunks without such a column, are unchanged."""
    floats = [
        i
        for i, (name, typ) in enumerate(zip(table.column_names, table.schema.types))
        if pa.types.is_floating(typ) and (columns is None or name in columns)
    ]
    if not floats:
        return table
    text = chunk.decode("utf-8")
    records, pos = [], _WS.match(text, 0).end()
    while pos < len(text):
        obj, pos = _RAW_NUMBERS.raw_decode(text, pos)
        records.append(obj)
        pos = _WS.match(text, pos).end()
    if len(records) != table.num_rows:  # not one object per record: leave the table as pyarrow read it
        return table
    for i in floats:
        name = table.column_names[i]
        table = table.set_column(i, name, pa.array([r.get(name) for r in records], pa.string()))
    return table


class _Float(float):
    """A JSON number decoded as a float that remembers its text in the file."""

    text: str


def exact_float(text: str) -> float:
    """`json.loads`'s parse_float: the float, with its text (`exact_column` reads it)."""
    value = _Float(text)
    value.text = text
    return value


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def exact_column(values: list[Any]) -> list[Any]:
    """A top-level field of JSON-array records: when its values are numbers (or null) and one of
    them is a float or an integer too long for int64, every number as the text the file holds (as
    `exact_numbers` does for JSON Lines); otherwise unchanged."""
    inexact = any(isinstance(v, float) or (_is_number(v) and not -(2**63) <= v < 2**63) for v in values)
    if not inexact or not all(v is None or _is_number(v) for v in values):
        return values
    return [None if v is None else v.text if isinstance(v, _Float) else str(v) for v in values]
