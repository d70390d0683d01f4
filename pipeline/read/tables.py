"""Readers of tabular inputs: CSV/TSV (pyarrow's streaming reader, every column a string), Parquet
(row groups decoded a few at a time) and Arrow IPC (memory-mapped), each as a stream of tables.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from pipeline.background import done, in_order
from pipeline.errors import UserError, one_line
from pipeline.read.json_lines import open_input


def _locate_bad_utf8(path: str) -> UserError | None:
    with open_input(path) as f:
        offset = 0
        for lineno, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return UserError(
                    f"{path} line {lineno} (byte offset {offset + e.start}): not valid "
                    "UTF-8; re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                )
            offset += len(raw)
    return None


def read_csv(path: str, batch_rows: int, chunk_bytes: int) -> Iterator[pa.Table]:
    delimiter = "\t" if path.lower().endswith((".tsv", ".tsv.gz", ".tsv.zst")) else ","
    parse = pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
    read = pacsv.ReadOptions(block_size=chunk_bytes, use_threads=False)

    def fail(exc: Exception) -> UserError:
        if "UTF8" in str(exc) or "UTF-8" in str(exc):
            err = _locate_bad_utf8(path)
            if err:
                return err
        return UserError(f"{path}: cannot read as CSV: {one_line(exc)}; check quoting and that every row has the same number of fields")

    try:
        with pacsv.open_csv(pa.input_stream(path, compression="detect"), read_options=read, parse_options=parse) as probe:
            names = probe.schema.names
        convert = pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, strings_can_be_null=False)
        reader = pacsv.open_csv(
            pa.input_stream(path, compression="detect"), read_options=read, parse_options=parse, convert_options=convert
        )
    except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
        if "Empty CSV file" in str(exc):
            raise UserError(f"{path} has no header and no rows: give a non-empty CSV") from None
        raise fail(exc) from None
    with reader:
        while True:
            try:
                rb = reader.read_next_batch()
            except StopIteration:
                return
            except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
                raise fail(exc) from None
            for start in range(0, rb.num_rows, batch_rows):
                yield pa.Table.from_batches([rb.slice(start, batch_rows)])


# ------------------------------------------------------------------------------------ Parquet, Arrow


PARQUET_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))  # row groups decoded at once
PARQUET_AHEAD_BYTES = 384 << 20  # decoded row groups in flight at most (a larger group is streamed)


def read_parquet(path: str, batch_rows: int, groups: range | None = None) -> Iterator[pa.Table]:
    """Row groups in file order (`groups`: only those), decoded ahead by PARQUET_THREADS threads
    (pyarrow decodes without the GIL; one thread decoded about 0.5 GB/s); each is yielded in
    `batch_rows` slices.

    Bounded memory (pack-data's 1B-token benchmark): buffered reads rather than a memory map (a
    map keeps every page read resident until the file is closed); at most PARQUET_AHEAD_BYTES of
    decoded groups in flight; a group larger than a quarter of that is streamed batch by batch
    (one iter_batches call over the whole file kept ~0.7 GB of decoded data alive at 400M tokens).
    """
    try:
        pf = pq.ParquetFile(path, memory_map=False)
        sizes = [pf.metadata.row_group(g).total_byte_size for g in range(pf.metadata.num_row_groups)]
        streamed = [size > PARQUET_AHEAD_BYTES // 4 for size in sizes]
        with ThreadPoolExecutor(PARQUET_THREADS, thread_name_prefix="parquet") as pool:
            decoded = in_order(
                range(len(sizes)) if groups is None else groups,
                lambda g: done(None) if streamed[g] else pool.submit(_parquet_group, path, g),
                depth=2 * PARQUET_THREADS,
                weight=lambda g: 0 if streamed[g] else sizes[g],
                budget=PARQUET_AHEAD_BYTES,
            )
            for group, table in decoded:
                if table is None:
                    for rb in pf.iter_batches(batch_size=batch_rows, row_groups=[group]):
                        yield pa.Table.from_batches([rb])
                    continue
                for start in range(0, table.num_rows, batch_rows):
                    yield table.slice(start, batch_rows)
                del table
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise UserError(
            f"{path}: not a readable Parquet file ({one_line(exc)}); it may be truncated or corrupt: re-export or re-download it"
        ) from None


def _parquet_group(path: str, group: int) -> pa.Table:
    """One row group, decoded by its own reader (ParquetFile objects are not shared across threads).

    The groups this thread decoded before were freed by the consuming thread; the allocator keeps
    such memory for its owning thread until told to collect it, which lets peak RSS grow with the
    input, so collect first.
    """
    pa.default_memory_pool().release_unused()
    return pq.ParquetFile(path, memory_map=False).read_row_group(group)


def read_arrow(path: str, batch_rows: int, parts: range | None = None) -> Iterator[pa.Table]:
    """Arrow IPC, file format (random access) or stream format, memory-mapped: zero-copy slices.
    `parts`: only these record batches of a file-format input."""
    try:
        source = pa.memory_map(path)
        try:
            reader = pa.ipc.open_file(source)
            batches: Iterator[pa.RecordBatch] = (
                reader.get_batch(i) for i in (range(reader.num_record_batches) if parts is None else parts)
            )
        except pa.ArrowInvalid:
            source.seek(0)
            batches = iter(pa.ipc.open_stream(source))
        for rb in batches:
            for start in range(0, rb.num_rows, batch_rows):
                yield pa.Table.from_batches([rb.slice(start, batch_rows)])
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise UserError(
            f"{path}: not a readable Arrow IPC file or stream ({one_line(exc)}); it may be truncated or corrupt: re-export it"
        ) from None
