"""Inputs cut into chunks that can be read on their own, the Ray engine's unit of work
(`pipeline.engines.ray_engine`): byte ranges of JSON Lines, runs of Parquet row groups or Arrow
record batches, other inputs whole; each chunk streamed as `pipeline.read.batches` streams files.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.read.batches import SourceBatch, iter_batches
from pipeline.read.json_lines import COMPRESSED, DEFAULT_CHUNK_BYTES, line_start, lines_before, read_jsonl
from pipeline.read.sources import InputFile
from pipeline.read.tables import read_arrow, read_parquet


@dataclass(frozen=True)
class Chunk:
    """A part of one input file that can be read on its own (the Ray engine's unit of work).

    JSON Lines: the lines that start in bytes [start, end); Parquet: row groups [start, end);
    Arrow IPC files: record batches [start, end); any other input: the whole file (start 0, end -1).
    `first_row`: the record index of its first row in the file, where known without reading the
    file (-1 for JSON Lines, whose rows are counted as they are read).
    """

    file: int  # index into the resolved inputs
    start: int
    end: int
    first_row: int


def plan_chunks(files: list[InputFile], chunk_bytes: int) -> list[Chunk]:
    """Cut every input into chunks of about `chunk_bytes` (whole files where the format allows no
    cut: compressed text, JSON arrays, CSV, Arrow streams, `datasets` folders, a share of a file's rows). Only file
    sizes and Parquet/Arrow metadata are read. The chunks of a file are in file order."""
    chunks: list[Chunk] = []
    for k, f in enumerate(files):
        if f.rows is not None:  # a share of its rows: read whole, `iter_batches` keeps them
            chunks.append(Chunk(k, 0, -1, 0))
            continue
        if f.kind == "jsonl" and not f.path.lower().endswith(COMPRESSED) and f.size > chunk_bytes:
            cuts = sorted({line_start(f.path, pos) for pos in range(0, f.size, chunk_bytes)} | {f.size})
            chunks += [Chunk(k, a, b, -1 if a else 0) for a, b in zip(cuts, cuts[1:]) if b > a]
            continue
        counts = _part_rows(f)
        if counts is None:
            chunks.append(Chunk(k, 0, -1, 0))
            continue
        sizes = [max(1, f.size * n // max(1, sum(counts))) for n in counts]  # bytes per part, roughly
        first = begin = acc = 0
        for g, (n, size) in enumerate(zip(counts, sizes)):
            acc += size
            if acc >= chunk_bytes or g == len(counts) - 1:
                chunks.append(Chunk(k, begin, g + 1, first))
                first += sum(counts[begin : g + 1])
                begin, acc = g + 1, 0
    return chunks


def _part_rows(f: InputFile) -> list[int] | None:
    """Rows per row group (Parquet) or record batch (Arrow IPC file); None for other inputs."""
    try:
        if f.kind == "parquet":
            meta = pq.ParquetFile(f.path, memory_map=False).metadata
            return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] or None
        if f.kind == "arrow":
            with pa.memory_map(f.path) as source:
                reader = pa.ipc.open_file(source)
                return [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)] or None
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError):
        return None  # the reading says what is wrong, in its own words
    return None


def chunk_batches(
    f: InputFile,
    chunk: Chunk,
    *,
    batch_rows: int,
    lines_known: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    exact: Collection[str] | None = None,
) -> Iterator[SourceBatch]:
    """Stream one chunk as `iter_batches` streams files, `first_index` counted from the chunk's
    first row. A JSON Lines chunk past the file's start knows its line numbers only with
    `lines_known` (which counts the line ends before it: a read of the file up to there); without,
    they are counted from 1 (fine when nothing is reported). `exact`: as `iter_batches`'s, for `f`."""
    if chunk.end < 0:
        yield from iter_batches([f], batch_rows=batch_rows, chunk_bytes=chunk_bytes, exact=None if exact is None else {f.path: exact})
        return
    if f.kind == "jsonl":
        first_line = 1 + (lines_before(f.path, chunk.start) if lines_known and chunk.start else 0)
        tables: Iterator[tuple[pa.Table, Any]] = read_jsonl(f.path, batch_rows, chunk_bytes, chunk.start, chunk.end, first_line, exact)
    else:
        parts = range(chunk.start, chunk.end)
        read = read_parquet(f.path, batch_rows, parts) if f.kind == "parquet" else read_arrow(f.path, batch_rows, parts)
        tables = ((t, None) for t in read)
    row = max(0, chunk.first_row)
    index = 0
    for table, lines in tables:
        if table.num_rows:
            yield SourceBatch(table=table, file=f.path, first_row=row, first_index=index, lines=lines)
            row += table.num_rows
            index += table.num_rows
