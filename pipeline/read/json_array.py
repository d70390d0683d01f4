"""Reader of JSON array inputs (`.json`, `.json.gz` holding one list of objects): decoded at once,
tables built per batch, the line of each element found only when an error message needs it.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.errors import UserError, one_line
from pipeline.read.json_lines import open_input
from pipeline.read.json_numbers import exact_column, exact_float
from pipeline.read.json_records import MAX_DEPTH, Conformer, DuplicateKey, json_kind, lone_surrogate, short, type_conflict, unique_keys

_SKIP_WS = re.compile(r"[ \t\n\r]*")


def read_json_array(path: str, batch_rows: int) -> Iterator[tuple[pa.Table, Any]]:
    """A JSON array has no line structure to cut it at, so the text is read once (memory about the
    file size) and decoded at once in C; one Arrow table is built per batch. Line numbers of the
    elements are found only if an error message needs one (`ArrayLines`). Malformed arrays are
    scanned element by element to say where they break. JSON-array datasets are small in practice
    (CodeAlpaca: 20k records, 8 MB); convert larger data to JSONL or Parquet, which are streamed."""
    text = json_array_text(path)
    try:
        records = json.loads(text, parse_float=exact_float, object_pairs_hook=unique_keys)
    except (json.JSONDecodeError, RecursionError, DuplicateKey):
        records = None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        for _ in scan_json_array(path, text):  # raises the located error
            pass
        raise UserError(f"{path}: expected a JSON array of objects; convert it to JSONL")
    del text
    conform = Conformer()
    for start in range(0, len(records), batch_rows):
        batch = records[start : start + batch_rows]
        lines = ArrayLines(path, start, start + len(batch))
        try:
            table = _records_table(batch)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, UnicodeEncodeError) as exc:
            numbers = [lines[k] for k in range(len(batch))]
            err = lone_surrogate(path, zip(numbers, batch)) or type_conflict(path, iter(zip(numbers, batch)))
            raise (
                err or UserError(f"{path} lines {numbers[0]}-{numbers[-1]}: pyarrow cannot read these records: {one_line(exc)}")
            ) from None
        yield conform(table), lines


def _records_table(records: list[dict]) -> pa.Table:
    """Records -> a table with a column for every key that any of them has (in order of first
    appearance; a record without it gives a null), as the JSON Lines reader does.
    `pa.Table.from_pylist` would take the first record's keys only and drop the others' silently.
    Numbers that pyarrow would hold as floats are kept as their text (`exact_column`)."""
    return pa.Table.from_pydict({k: exact_column([r.get(k) for r in records]) for k in _record_keys(records)})


def _record_keys(records: list[dict]) -> list[str]:
    """Every key of the records, in order of first appearance."""
    return list(dict.fromkeys(k for r in records for k in r))


def _json_array_head(path: str, n: int) -> list[dict]:
    """The first `n` records of a JSON array file, decoded one by one (not the whole array)."""
    return [obj for _, obj in itertools.islice(scan_json_array(path, json_array_text(path)), n)]


def json_array_text(path: str) -> str:
    with open_input(path) as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(
            f"{path} line {line} (byte offset {e.start}): not valid UTF-8; re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def scan_json_array(path: str, text: str) -> Iterator[tuple[int, dict]]:
    """(1-based line, object) of each element, decoded one at a time; a malformed array raises a
    UserError naming the line where it breaks."""
    dec = json.JSONDecoder(object_pairs_hook=unique_keys)
    pos = _SKIP_WS.match(text, 0).end()
    if text[pos : pos + 1] != "[":
        raise UserError(f"{path}: expected a JSON array of objects; convert it to JSONL")
    pos += 1
    line, line_pos = 1, 0
    while True:
        pos = _SKIP_WS.match(text, pos).end()
        if text[pos : pos + 1] == "]":  # end of the array (also tolerates a trailing comma)
            return
        line += text.count("\n", line_pos, pos)
        line_pos = pos
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise UserError(
                f"{path} line {e.lineno}: malformed JSON ({e.msg} at column {e.colno}); fix that element of the array"
            ) from None
        except RecursionError:
            raise UserError(
                f"{path} line {line}: JSON nested too deeply (about {MAX_DEPTH} levels or more): flatten that element of the array"
            ) from None
        except DuplicateKey as e:
            raise UserError(
                f"{path} line {line}: key {short(e.key)!r} appears twice in one JSON object: keep one of them (each key once per object)"
            ) from None
        if not isinstance(obj, dict):
            raise UserError(
                f"{path} line {line}: array element is a {json_kind(obj)}, not an "
                "object; the array must hold one {...} record per example"
            )
        yield line, obj
        pos = _SKIP_WS.match(text, pos).end()
        sep = text[pos : pos + 1]
        if sep == ",":
            pos += 1
        elif sep != "]":
            line += text.count("\n", line_pos, pos)
            line_pos = pos
            raise UserError(
                f"{path} line {line}: expected ',' or ']' after an array element, found "
                f"{sep or 'end of file'!r}; the file is truncated or malformed"
            )


def _array_element_lines(path: str) -> np.ndarray:
    st = os.stat(path)
    return _element_lines(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _element_lines(path: str, mtime_ns: int, size: int) -> np.ndarray:  # cached per file version
    return np.fromiter((line for line, _ in scan_json_array(path, json_array_text(path))), dtype=np.int64)


class ArrayLines:
    """The 1-based line numbers of elements [start, stop) of a JSON array file, indexable and
    sliceable like `SourceBatch.lines`; found by scanning the file only when one is asked for
    (by an error message), so reading does not pay for them."""

    def __init__(self, path: str, start: int, stop: int) -> None:
        self.path, self.start, self.stop = path, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step != 1:
                raise ValueError("ArrayLines slices take no step")
            return ArrayLines(self.path, self.start + a, self.start + max(a, b))
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return int(_array_element_lines(self.path)[self.start + (i % len(self))])
