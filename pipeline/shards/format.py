"""The shard files of a packed folder: their schema, how they are written and how they are read.

A packed folder holds `manifest.json` and `shard-00000.arrow`, `shard-00001.arrow`, ..., one packed
row per record and no padding stored. Each shard is an Arrow IPC *stream* followed by the IPC *file*
footer (see `write_shard`), so it opens memory-mapped with `pyarrow.ipc.open_file`, with
`datasets.Dataset.from_file` (which reads only streams) and with `polars.read_ipc`:

- `input_ids`    list<int32>  token ids of the row, length <= max_len
- `labels`       list<int32>  the token id where loss is taken, -100 elsewhere; the first token of
                              every example is always -100, so no token is trained to predict across
                              a boundary (labels are *unshifted*, as in Hugging Face: the model
                              predicts labels[t] from tokens[:t])
- `position_ids` list<int32>  0..n-1, restarting at every example
- `seq_lens`     list<int32>  the lengths of the examples in the row, in order; sums to len(input_ids)
- `example_ids`  list<int64>  input-order index of each example (a split example repeats its id)

Lists are Arrow `list` (int32 offsets), so one shard holds at most `MAX_SHARD_TOKENS` tokens: pack-data
refuses a --rows-per-shard x --max-len beyond it. A row holds at most --max-len tokens (up to
16,777,216, the planner's limit); rows of 1,048,576 tokens take about 12 MiB each (the default
--rows-per-shard there is 10).

Beside them, `manifest.json` (`pipeline.shards.manifest`) records one entry per shard with its
sha256, so a folder can be proven intact (`pack-verify`) before training on it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.errors import ShardFormatError
from pipeline.shards.manifest import Manifest, read_manifest

SHARD_GLOB = "shard-*.arrow"
IGNORE_INDEX = -100

SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("labels", pa.list_(pa.int32()), nullable=False),
        pa.field("position_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("seq_lens", pa.list_(pa.int32()), nullable=False),
        pa.field("example_ids", pa.list_(pa.int64()), nullable=False),
    ]
)
MAX_SHARD_TOKENS = (1 << 31) - 1  # the largest int32 list offset: tokens one shard can hold
TOKEN_COLUMNS = ("input_ids", "labels", "position_ids")
# the longest row a shard holds: a position, a sequence length and a row's offsets are 32-bit
MAX_ROW_TOKENS = 2**31 - 1
EXAMPLE_COLUMNS = ("seq_lens", "example_ids")


def shard_name(index: int) -> str:
    """File name of shard number `index`."""
    return f"shard-{index:05d}.arrow"


# ------------------------------------------------------------------------------------ shard files


def rows_table(
    input_ids: np.ndarray,
    labels: np.ndarray,
    position_ids: np.ndarray,
    row_offsets: np.ndarray,
    seq_lens: np.ndarray,
    example_ids: np.ndarray,
    example_offsets: np.ndarray,
) -> pa.Table:
    """Build a table in SCHEMA from flat arrays and offsets, without copying per row.

    Token columns share `row_offsets` (n_rows + 1 entries into the flat token arrays); example
    columns share `example_offsets` (n_rows + 1 entries into the flat per-example arrays).
    """
    if len(row_offsets) and int(row_offsets[-1]) > MAX_SHARD_TOKENS:  # pack-data's options keep shards below it
        raise ValueError(f"a shard of {int(row_offsets[-1]):,} tokens is beyond its int32 list offsets")

    # Arrays are built straight from the numpy buffers (zero-copy).
    def lists(offsets: np.ndarray, values: np.ndarray, dtype: type, arrow_type: pa.DataType) -> pa.Array:
        flat = np.ascontiguousarray(values, dtype=dtype)
        child = pa.Array.from_buffers(arrow_type, len(flat), [None, pa.py_buffer(flat)])
        offs = pa.py_buffer(np.ascontiguousarray(offsets, dtype=np.int32))
        return pa.Array.from_buffers(pa.list_(arrow_type), len(offsets) - 1, [None, offs], children=[child])

    columns = [
        lists(row_offsets, input_ids, np.int32, pa.int32()),
        lists(row_offsets, labels, np.int32, pa.int32()),
        lists(row_offsets, position_ids, np.int32, pa.int32()),
        lists(example_offsets, seq_lens, np.int32, pa.int32()),
        lists(example_offsets, example_ids, np.int64, pa.int64()),
    ]
    return pa.Table.from_arrays(columns, schema=SCHEMA)


def write_shard(path: str | os.PathLike[str], table: pa.Table) -> None:
    """Write one shard: the Arrow IPC stream of `table` followed by the IPC file footer.

    A spec IPC file is `ARROW1\\0\\0` + stream + footer + footer size + `ARROW1`. Readers of the file
    format (pyarrow's `open_file`, `pyarrow.dataset`, polars) locate everything from the footer at the
    end; `datasets.Dataset.from_file` reads the stream from byte 0. Leaving out the 8 leading bytes
    (and moving the footer's block offsets back by 8) satisfies both. Uncompressed, so it memory-maps.
    Only readers that sniff the leading magic (`pyarrow.feather.read_table`) refuse such a file.
    """
    if table.schema != SCHEMA:
        raise ValueError(f"shard schema mismatch:\n{table.schema}\nexpected:\n{SCHEMA}")
    with open(path, "w+b", buffering=0) as raw:
        sink = pa.PythonFile(_SkipLeadingMagic(raw), mode="w")
        with pa.ipc.new_file(sink, SCHEMA) as writer:
            writer.write_table(table)
        _shift_footer_blocks(raw.fileno(), -_LEADING_MAGIC)
        os.fsync(raw.fileno())  # on disk before the folder's rename commits it (`pipeline.files.durable`)


_LEADING_MAGIC = 8  # b"ARROW1" plus 2 bytes of padding
_BLOCK = struct.Struct("<qi4xq")  # flatbuffers struct Block {offset: long; metaDataLength: int; bodyLength: long}


class _SkipLeadingMagic:
    """File-like sink that drops the first 8 bytes written (the file format's leading magic)."""

    closed = False

    def __init__(self, raw: Any) -> None:
        self._raw, self._skip = raw, _LEADING_MAGIC

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._skip:
            cut = min(self._skip, len(view))
            self._skip -= cut
            view = view[cut:]
        while view:  # raw (unbuffered) writes may be short
            view = view[self._raw.write(view) :]
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:  # the caller owns `raw`; it still patches the footer
        self.closed = True


def _shift_footer_blocks(fd: int, delta: int) -> None:
    """Add `delta` to every block offset in the IPC file footer at the end of `fd`."""
    size = os.fstat(fd).st_size
    (footer_len,) = struct.unpack("<i", os.pread(fd, 4, size - 10))
    start = size - 10 - footer_len
    footer = bytearray(os.pread(fd, footer_len, start))
    u32 = struct.Struct("<I")
    root = u32.unpack_from(footer, 0)[0]  # flatbuffers: root table, then its vtable
    vtable = root - struct.unpack_from("<i", footer, root)[0]
    n_fields = (struct.unpack_from("<H", footer, vtable)[0] - 4) // 2
    for member in (2, 3):  # Footer.dictionaries, Footer.recordBatches: vectors of Block
        slot = struct.unpack_from("<H", footer, vtable + 4 + 2 * member)[0] if member < n_fields else 0
        if not slot:
            continue
        vector = root + slot + u32.unpack_from(footer, root + slot)[0]
        for k in range(u32.unpack_from(footer, vector)[0]):
            at = vector + 4 + _BLOCK.size * k
            offset, meta_len, body_len = _BLOCK.unpack_from(footer, at)
            _BLOCK.pack_into(footer, at, offset + delta, meta_len, body_len)
    os.pwrite(fd, bytes(footer), start)


def open_shard(path: str | os.PathLike[str]) -> pa.Table:
    """Open a shard memory-mapped (zero-copy); raise ShardFormatError if it is not one."""
    try:
        source = pa.memory_map(str(path), "r")
        table = pa.ipc.open_file(source).read_all()
    except (OSError, pa.ArrowInvalid) as exc:
        raise ShardFormatError(f"{path}: not a readable Arrow IPC file ({exc})") from None
    if table.schema != SCHEMA:
        raise ShardFormatError(f"{path}: schema is\n{table.schema}\nexpected\n{SCHEMA}")
    return table


def shard_paths(folder: str | os.PathLike[str], manifest: Manifest | None = None) -> list[Path]:
    """Shard files of a packed folder, in manifest order."""
    manifest = manifest or read_manifest(folder)
    return [Path(folder) / s.file for s in manifest.shards]


@dataclass
class FlatColumn:
    """A list column as flat numpy values plus offsets (n_rows + 1), zero-copy where possible."""

    values: np.ndarray
    offsets: np.ndarray

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]


def flat_column(table: pa.Table, name: str) -> FlatColumn:
    """Flatten one list column of a shard table into values + offsets."""
    chunked = table.column(name)
    arr = chunked.combine_chunks() if chunked.num_chunks != 1 else chunked.chunk(0)
    # Straight from the Arrow buffers: zero-copy.
    # `values` is the child array from its own start; list offsets may not start at 0 after slicing.
    offsets = _buffer_view(arr.buffers()[1], np.int32, arr.offset, len(arr) + 1).astype(np.int64)
    child = arr.values
    values = _buffer_view(child.buffers()[1], _VALUE_DTYPES[child.type], child.offset, len(child))
    return FlatColumn(values=values, offsets=offsets)


# numpy dtypes of the value types in SCHEMA (`DataType.to_pandas_dtype()` gives the same, but
# imports pandas in some pyarrow builds).
_VALUE_DTYPES = {pa.int32(): np.int32, pa.int64(): np.int64}


def _buffer_view(buf: pa.Buffer, dtype: type, offset: int, count: int) -> np.ndarray:
    """`count` items of `dtype` from an Arrow buffer, starting at item `offset` (no copy)."""
    return np.frombuffer(buf, dtype=dtype, count=offset + count)[offset:]


@dataclass
class ShardColumns:
    """One shard's columns as flat arrays (memory-mapped, zero-copy) plus offsets rebased to 0.

    Row r's tokens are `input_ids[row_off[r]:row_off[r + 1]]` (likewise labels, position_ids); its
    examples are `seq_lens[ex_off[r]:ex_off[r + 1]]` (likewise example_ids).
    """

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    row_off: np.ndarray
    seq_lens: np.ndarray
    example_ids: np.ndarray
    ex_off: np.ndarray


def _rebased(col: FlatColumn) -> tuple[np.ndarray, np.ndarray]:
    """Values covered by the offsets, with offsets rebased to start at 0."""
    off = col.offsets
    start = int(off[0]) if len(off) else 0
    end = int(off[-1]) if len(off) else 0
    return col.values[start:end], off - start


def _first_true(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def load_shard(path: str | os.PathLike[str]) -> ShardColumns:
    """Open a shard memory-mapped and return its columns; raise ShardFormatError when its token
    columns, or its example columns, disagree on a row's length. Every reader of shards uses this."""
    path = Path(path)
    table = open_shard(path)
    names = ("input_ids", "labels", "position_ids", "seq_lens", "example_ids")
    cols = {n: _rebased(flat_column(table, n)) for n in names}
    name = path.name
    row_off = cols["input_ids"][1]
    for other in ("labels", "position_ids"):
        off = cols[other][1]
        if not np.array_equal(off, row_off):
            r = _first_true(np.diff(off) != np.diff(row_off))
            raise ShardFormatError(
                f"{name} row {r}: {other} has {int(np.diff(off)[r])} entries but input_ids has {int(np.diff(row_off)[r])}"
            )
    ex_off = cols["seq_lens"][1]
    if not np.array_equal(cols["example_ids"][1], ex_off):
        d1, d2 = np.diff(cols["example_ids"][1]), np.diff(ex_off)
        r = _first_true(d1 != d2)
        raise ShardFormatError(f"{name} row {r}: example_ids has {int(d1[r])} entries but seq_lens has {int(d2[r])}")
    return ShardColumns(
        input_ids=cols["input_ids"][0],
        labels=cols["labels"][0],
        position_ids=cols["position_ids"][0],
        row_off=row_off,
        seq_lens=cols["seq_lens"][0].astype(np.int64, copy=False),
        example_ids=cols["example_ids"][0],
        ex_off=ex_off,
    )


def iter_rows(folder: str | os.PathLike[str]) -> Iterator[dict[str, np.ndarray]]:
    """Every row of a packed folder as numpy arrays (convenience for tests and small tools)."""
    for path in shard_paths(folder):
        cols = load_shard(path)
        for r in range(len(cols.row_off) - 1):
            tokens = slice(cols.row_off[r], cols.row_off[r + 1])
            examples = slice(cols.ex_off[r], cols.ex_off[r + 1])
            yield {
                "input_ids": cols.input_ids[tokens],
                "labels": cols.labels[tokens],
                "position_ids": cols.position_ids[tokens],
                "seq_lens": cols.seq_lens[examples],
                "example_ids": cols.example_ids[examples],
            }
