"""One input file, by its kind, as Arrow tables (each with the 1-based line of every row where one is
known): the readers of `pipeline.read.json_lines`, `pipeline.read.json_array`, `pipeline.read.tables`,
and `datasets` for `save_to_disk` folders. `pipeline.read.batches` streams resolved inputs through
them; `count_records` counts a file's records with them (what a share of a split is counted over,
`pipeline.splits`)."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import UserError, one_line
from pipeline.read.json_array import read_json_array
from pipeline.read.json_lines import compressed_errors, read_jsonl
from pipeline.read.tables import read_arrow, read_csv, read_parquet

KINDS = ("jsonl", "json", "parquet", "arrow", "csv", "hf_disk")


def hf_data_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.arrow") if p.is_file())


def load_disk(path: str) -> Any:
    """The `datasets.Dataset` of a `save_to_disk` folder (a DatasetDict's train split, or its only one)."""
    import datasets

    if not hf_data_files(Path(path)):  # `datasets` cannot even load an empty saved dataset
        raise UserError(f"{path} contains no records: give an input with at least one example")
    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:
        raise UserError(f"{path}: cannot load this datasets.save_to_disk folder: {type(exc).__name__}: {one_line(exc)}") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if len(splits) == 1 or "train" in splits:
            return ds[splits[0] if len(splits) == 1 else "train"]
        raise UserError(
            f"{path} is a DatasetDict with splits {splits} and no 'train': pass one split folder, e.g. {os.path.join(path, splits[0])}"
        )
    return ds


def _read_datasets(ds: Any, batch_rows: int, name: str) -> Iterator[pa.Table]:
    try:
        for t in ds.with_format("arrow").iter(batch_size=batch_rows):
            yield t if isinstance(t, pa.Table) else pa.Table.from_pydict(t)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(
            f"{name}: reading failed: {type(exc).__name__}: {one_line(exc)}: check that the "
            "folder is a complete datasets.save_to_disk folder (save it again)"
        ) from None


def tables(
    path: str, kind: str, batch_rows: int, chunk_bytes: int, exact: Collection[str] | None = None
) -> Iterator[tuple[pa.Table, np.ndarray | None]]:
    """The file's rows in order, as (table, line of each row or None); `exact`: as
    `pipeline.read.batches.iter_batches`'s, for this file."""
    with compressed_errors(path):
        yield from _tables_of(path, kind, batch_rows, chunk_bytes, exact)


def _tables_of(
    path: str, kind: str, batch_rows: int, chunk_bytes: int, exact: Collection[str] | None
) -> Iterator[tuple[pa.Table, np.ndarray | None]]:
    if kind == "jsonl":
        yield from read_jsonl(path, batch_rows, chunk_bytes, exact=exact)
    elif kind == "json":
        yield from read_json_array(path, batch_rows)
    else:
        if kind == "csv":
            found = read_csv(path, batch_rows, chunk_bytes)
        elif kind == "parquet":
            found = read_parquet(path, batch_rows)
        elif kind == "arrow":
            found = read_arrow(path, batch_rows)
        elif kind == "hf_disk":
            found = _read_datasets(load_disk(path), batch_rows, path)
        else:
            raise UserError(f"unknown input kind {kind!r} for {path}: expected one of {KINDS}")
        for t in found:
            yield t, None


def count_records(path: str, kind: str, chunk_bytes: int) -> int:
    """The records of a file (`pipeline.read.batches`' module doc says what a record is), read whole
    (Parquet: from its metadata)."""
    if kind == "parquet":
        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError):
            pass  # the reading says what is wrong, in its own words
    if kind == "hf_disk":
        return len(load_disk(path))
    return sum(t.num_rows for t, _ in tables(path, kind, 1 << 16, chunk_bytes))
