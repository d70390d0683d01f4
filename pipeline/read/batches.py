"""Resolved inputs (`pipeline.read.sources`) streamed as Arrow tables with exact row positions,
each file by its format's reader (`pipeline.read.json_lines`, `pipeline.read.json_array`,
`pipeline.read.tables`, `datasets` for `save_to_disk` folders).

Memory stays bounded: JSONL is cut into byte chunks at line ends and each chunk is parsed by pyarrow
on its own (so a schema that changes between chunks is fine), CSV uses pyarrow's streaming reader,
Parquet is read batch by batch, Arrow IPC and `save_to_disk` folders are memory-mapped. Every bad
input raises a one-line `UserError` naming the file and line (or row) and how to fix it.

Row numbering (`SourceBatch.first_row`) is the 0-based index of a *record* in its file: for JSONL a
record is one non-blank line (blank lines are skipped and not counted), for CSV one data row (the
header is not counted), for a JSON array one element, for the other formats one table row.
`SourceBatch.lines` gives the exact 1-based line number of each record where one is known
(JSONL, JSON arrays); `SourceBatch.where(i)` formats a location for error messages.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import UserError, one_line
from pipeline.read.json_array import json_array_text, scan_json_array
from pipeline.read.json_lines import DEFAULT_CHUNK_BYTES, compressed_errors, jsonl_columns
from pipeline.read.readers import load_disk, tables
from pipeline.read.sources import InputFile


@dataclass
class SourceBatch:
    """A chunk of rows from one input, with where it came from."""

    table: pa.Table  # all columns as read
    file: str  # InputFile.path it came from
    first_row: int  # 0-based record index of table's first row within that file (see module doc)
    first_index: int  # global example index of the first row across all inputs, in input order
    # 1-based line of each row, if known: an array, or ArrayLines (JSON arrays: found when asked for)
    lines: Any = field(default=None, repr=False)

    def where(self, i: int) -> str:
        """Human location of row `i` of this batch, e.g. "data.jsonl line 17" or "x.parquet row 4"."""
        if self.lines is not None:
            return f"{self.file} line {int(self.lines[i])}"
        return f"{self.file} row {self.first_row + i + 1}"


# ------------------------------------------------------------------------------------ public


def iter_batches(
    files: list[InputFile],
    *,
    batch_rows: int = 4096,
    limit: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    exact: dict[str, Collection[str]] | None = None,
) -> Iterator[SourceBatch]:
    """Stream every input in order as tables of at most `batch_rows` rows (never an empty one).

    `limit` stops after that many rows in total; a file with `rows` yields only those records. An input
    that yields no rows is an error.
    `exact`: per file path, the columns whose JSON numbers are kept as their text
    (`pipeline.read.json_numbers.exact_numbers`); None, or a file not in it: every column.
    """
    if batch_rows < 1:
        raise ValueError("batch_rows must be >= 1")
    index = 0
    for f in files:
        if limit is not None and index >= limit:
            return
        row = 0
        start, stop = f.rows or (0, None)
        for table, lines in tables(f.path, f.kind, batch_rows, chunk_bytes, None if exact is None else exact.get(f.path)):
            first, row = row, row + table.num_rows  # the file's records [first, row) are in this table
            if table.num_rows == 0 or row <= start:
                continue
            cut = max(start - first, 0)
            keep = table.num_rows - cut if stop is None else min(stop, row) - first - cut
            if limit is not None:
                keep = min(keep, limit - index)
            if cut or keep < table.num_rows:
                table = table.slice(cut, keep)
                lines = None if lines is None else lines[cut : cut + keep]
            yield SourceBatch(table=table, file=f.path, first_row=first + cut, first_index=index, lines=lines)
            index += table.num_rows
            if (limit is not None and index >= limit) or (stop is not None and row >= stop):
                break
        if row == 0:
            raise UserError(f"{f.path} contains no records: give an input with at least one example")
        if limit is not None and index >= limit:
            return


def where_of(files: list[InputFile], index: int) -> str:
    """Human location of the example with global input index `index` ("data.jsonl line 17"), for an
    error found after reading: the inputs are read again up to it."""
    for batch in iter_batches(files, limit=index + 1):
        if index < batch.first_index + batch.table.num_rows:
            return batch.where(index - batch.first_index)
    return f"example {index} of the input"


def column_names(files: list[InputFile]) -> list[str]:
    """Every field of the first input, in order of first appearance: from its schema (Parquet,
    Arrow, CSV header, `datasets` folder) or, for JSON Lines and JSON arrays, from every record of
    the file, so that `--format auto` never misses a field that first appears late (an optional
    `input` in row 90,000 would otherwise be dropped from every row). The JSON Lines scan parses
    16 MiB at a time with pyarrow's threaded reader.
    """
    if not files:
        raise UserError("no inputs to read columns from")
    with compressed_errors(files[0].path):
        return _column_names(files[0])


def _column_names(f: InputFile) -> list[str]:
    try:
        if f.kind == "parquet":
            return list(pq.ParquetFile(f.path).schema_arrow.names)
        if f.kind == "hf_disk":
            return list(load_disk(f.path).column_names)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise UserError(
            f"{f.path}: not a readable Parquet file ({one_line(exc)}); it may be truncated or corrupt: re-export or re-download it"
        ) from None
    if f.kind == "json":
        keys: dict[str, None] = {}
        for _, record in scan_json_array(f.path, json_array_text(f.path)):
            keys.update(dict.fromkeys(record))
        if keys:
            return list(keys)
    if f.kind == "jsonl":
        keys = jsonl_columns(f.path)
        if keys:
            return keys
    for batch in iter_batches([f], batch_rows=1024, limit=None):
        return list(batch.table.column_names)
    raise UserError(f"{f.path} contains no records")  # unreachable: iter_batches raises first
