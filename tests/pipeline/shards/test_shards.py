"""The shard file layout: one file that the file-format and the stream-format readers all open."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from pipeline.shards import SCHEMA, open_shard, rows_table, write_shard


def _table(n_rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 50, size=n_rows)
    row_off = np.concatenate([[0], np.cumsum(lens)])
    ids = rng.integers(0, 1000, size=int(row_off[-1])).astype(np.int32)
    return rows_table(ids, -ids, np.arange(len(ids)), row_off, lens, np.arange(n_rows), np.arange(n_rows + 1))


@pytest.mark.parametrize("batches", [1, 3])
def test_shard_opens_as_ipc_file_stream_dataset_and_polars(tmp_path: Path, batches: int):
    import datasets
    import polars as pl

    parts = [_table(20 + b, seed=b) for b in range(batches)]
    table = pa.concat_tables(parts)  # one record batch per part
    path = tmp_path / "shard.arrow"
    write_shard(path, table)

    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_file(source)
        assert reader.num_record_batches == batches
        assert reader.get_batch(batches - 1).equals(parts[-1].to_batches()[0])
        assert reader.read_all().equals(table)
    assert open_shard(path).equals(table)
    assert pa.ipc.open_stream(pa.memory_map(str(path))).read_all().equals(table)
    assert pads.dataset(str(path), format="arrow").to_table().equals(table)
    assert pl.read_ipc(path).to_arrow().column("labels").to_pylist() == table.column("labels").to_pylist()
    ds = datasets.Dataset.from_file(str(path))
    assert ds.num_rows == table.num_rows and ds[table.num_rows - 1]["input_ids"] == table["input_ids"][-1].as_py()


def test_write_shard_refuses_another_schema(tmp_path: Path):
    bad = pa.table({"input_ids": pa.array([[1]], pa.list_(pa.int32()))})
    with pytest.raises(ValueError, match="schema mismatch"):
        write_shard(tmp_path / "x.arrow", bad)
    assert SCHEMA.names[0] == "input_ids"


def test_every_value_type_of_the_schema_has_its_numpy_dtype():
    """flat_column maps value types itself (pyarrow's to_pandas_dtype imports pandas in some builds)."""
    from pipeline.shards.format import _VALUE_DTYPES

    for field in SCHEMA:
        dtype = _VALUE_DTYPES[field.type.value_type]
        assert np.dtype(dtype) == np.dtype(field.type.value_type.to_pandas_dtype())
