"""The shard contract between `pipeline/` (writer) and `trainer/` (reader). Defined here only.

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

The manifest records configuration, tokenizer and input fingerprints, counts and one entry per shard
with its sha256, so a folder can be proven intact (`pack-verify`) before training on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.durable import fsync_path
from pipeline.errors import ShardFormatError

FORMAT_NAME = "packlm-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
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
TOKEN_COLUMNS = ("input_ids", "labels", "position_ids")
EXAMPLE_COLUMNS = ("seq_lens", "example_ids")


def shard_name(index: int) -> str:
    """File name of shard number `index`."""
    return f"shard-{index:05d}.arrow"


# --------------------------------------------------------------------------------------- manifest


@dataclass
class ShardInfo:
    """One shard file as recorded in the manifest."""

    file: str
    rows: int
    tokens: int
    sha256: str


@dataclass
class Counts:
    """What happened to the input examples."""

    examples_read: int = 0
    examples_packed: int = 0
    empty_skipped: int = 0
    truncated: int = 0
    split: int = 0
    dropped: int = 0
    no_loss: int | None = None  # examples (pieces) packed with no token that carries a loss; None: not recorded


@dataclass
class Manifest:
    """Everything known about a packed folder; serialised as `manifest.json`."""

    max_len: int
    strategy: str
    seed: int
    rows: int
    total_tokens: int
    loss_tokens: int
    efficiency: float
    counts: Counts
    shards: list[ShardInfo]
    tokenizer: dict[str, Any] = field(default_factory=dict)  # name, fingerprint, bos/eos/pad ids, vocab_size
    inputs: list[dict[str, Any]] = field(default_factory=list)  # path, bytes, sha256
    config: dict[str, Any] = field(default_factory=dict)  # the full command configuration
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = MANIFEST_NAME) -> Manifest:
        """Build from parsed JSON, raising ShardFormatError naming the first missing/bad field."""
        if not isinstance(data, dict):
            raise ShardFormatError(f"{where}: expected a JSON object")
        if data.get("format") != FORMAT_NAME:
            raise ShardFormatError(
                f"{where}: format is {data.get('format')!r}, expected {FORMAT_NAME!r}: "
                "not a folder written by pack-data"
            )
        if data.get("format_version") != FORMAT_VERSION:
            raise ShardFormatError(
                f"{where}: format_version {data.get('format_version')!r} is not supported "
                f"(this version reads {FORMAT_VERSION}): re-run pack-data"
            )
        ints = ("max_len", "seed", "rows", "total_tokens", "loss_tokens")
        for key in (*ints, "strategy", "efficiency", "counts", "shards"):
            if key not in data:
                raise ShardFormatError(f"{where}: missing field {key!r}")
        for key in ints:
            if not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] < 0:
                raise ShardFormatError(f"{where}: field {key!r} must be a non-negative integer")
        try:
            counts = Counts(**data["counts"])
            shards = [ShardInfo(**s) for s in data["shards"]]
        except TypeError as exc:
            raise ShardFormatError(f"{where}: malformed counts or shards entry ({exc})") from None
        fields = {k: v for k, v in data.items() if k not in ("counts", "shards")}
        try:
            return cls(counts=counts, shards=shards, **fields)
        except TypeError as exc:
            raise ShardFormatError(f"{where}: unexpected field ({exc})") from None


def read_manifest(folder: str | os.PathLike[str]) -> Manifest:
    """Load and validate `folder/manifest.json`."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise ShardFormatError(f"{path}: no manifest: is {folder} a folder written by pack-data?")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardFormatError(f"{path}: not valid JSON ({exc})") from None
    return Manifest.from_dict(data, where=str(path))


def write_manifest(folder: str | os.PathLike[str], manifest: Manifest) -> None:
    """Write `folder/manifest.json`, fsynced (the caller makes the folder visible atomically)."""
    path = Path(folder) / MANIFEST_NAME
    path.write_text(manifest.to_json(), encoding="utf-8")
    fsync_path(path)


def file_sha256(path: str | os.PathLike[str], chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks into one reused buffer (no allocation per chunk, which
    several hashing threads would otherwise spread over the allocator's per-thread arenas)."""
    digest = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as handle:
        while n := handle.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


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
    # Arrays are built straight from the numpy buffers (zero-copy; `pa.array` on numpy would also
    # import pandas, a third of a second on a cold start).
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
        os.fsync(raw.fileno())  # on disk before the folder's rename commits it (`pipeline.durable`)


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
            view = view[self._raw.write(view):]
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
    # Straight from the Arrow buffers: zero-copy, and unlike to_numpy() it does not import pandas.
    # `values` is the child array from its own start; list offsets may not start at 0 after slicing.
    offsets = _buffer_view(arr.buffers()[1], np.int32, arr.offset, len(arr) + 1).astype(np.int64)
    child = arr.values
    values = _buffer_view(child.buffers()[1], _VALUE_DTYPES[child.type], child.offset, len(child))
    return FlatColumn(values=values, offsets=offsets)


# numpy dtypes of the value types in SCHEMA. `DataType.to_pandas_dtype()` would give them too, but
# some pyarrow builds import pandas for it: 0.15-0.35 s on the 16-core box, in the shard checker.
_VALUE_DTYPES = {pa.int32(): np.int32, pa.int64(): np.int64}


def _buffer_view(buf: pa.Buffer, dtype: type, offset: int, count: int) -> np.ndarray:
    """`count` items of `dtype` from an Arrow buffer, starting at item `offset` (no copy)."""
    return np.frombuffer(buf, dtype=dtype, count=offset + count)[offset:]


def iter_rows(folder: str | os.PathLike[str]) -> Iterator[dict[str, np.ndarray]]:
    """Every row of a packed folder as numpy arrays (convenience for tests and small tools)."""
    for path in shard_paths(folder):
        table = open_shard(path)
        cols = {name: flat_column(table, name) for name in SCHEMA.names}
        for i in range(table.num_rows):
            yield {name: col.row(i) for name, col in cols.items()}


def pack_data_files(folder: str | os.PathLike[str]) -> set[str] | None:
    """The names pack-data wrote into `folder` (its manifest and the shards the manifest lists),
    or None when the folder holds no manifest that pack-data wrote (any format version)."""
    try:
        data = json.loads((Path(folder) / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        return None
    shards = data.get("shards") if isinstance(data.get("shards"), list) else []
    return {MANIFEST_NAME} | {s["file"] for s in shards if isinstance(s, dict) and isinstance(s.get("file"), str)}
