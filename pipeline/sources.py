"""Input readers: turn the user's inputs into a stream of Arrow tables with exact row positions.

Supported inputs (several may be given; globs are expanded in sorted order; order is kept):

- JSON Lines      `.jsonl`, `.ndjson` (also `.gz`), and `.json` files whose content is JSON Lines
- JSON array      `.json` (also `.json.gz`) holding one list of objects
- Parquet         `.parquet`, `.pq`
- Arrow IPC       `.arrow`, `.feather`, `.ipc` (IPC file or stream format, memory-mapped)
- CSV / TSV       `.csv`, `.tsv` (also `.gz`); every column is read as a string, empty stays ""
- a folder written by `datasets.save_to_disk` (memory-mapped Arrow); a `DatasetDict` folder is
  read through its `train` split (or its only split); any other folder is expanded into the
  supported files it contains (recursively, sorted)
- a Hugging Face Hub dataset `owner/name`, `owner/name:split` or `owner/name:config:split`
  (streamed; default split `train`), tried only when no local path of that name exists

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

import functools
import glob as globlib
import gzip
import hashlib
import itertools
import json
import os
import re
import socket
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from pipeline.errors import UserError
from pipeline.shards import SCHEMA, file_sha256, pack_data_files

KINDS = ("jsonl", "json", "parquet", "arrow", "csv", "hf_disk", "hub")
# Longest suffix first so that ".jsonl.gz" wins over ".gz".
EXTENSIONS = {
    ".jsonl.gz": "jsonl", ".ndjson.gz": "jsonl", ".json.gz": "json", ".csv.gz": "csv",
    ".tsv.gz": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet",
    ".pq": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow", ".csv": "csv",
    ".tsv": "csv",
}
SUPPORTED = (".jsonl, .ndjson, .json, .parquet, .pq, .arrow, .feather, .ipc, .csv, .tsv (text "
             "formats also .gz), a datasets.save_to_disk folder, or a Hub dataset name")
# Bytes of JSONL parsed at once (one pyarrow block; small, so tokenizing starts soon and overlaps
# the parsing of the next chunk); a line longer than this makes a larger chunk.
DEFAULT_CHUNK_BYTES = 1 << 20
LONG_CHUNK_BYTES = 4 << 20  # a JSONL chunk this long (a long line) has pyarrow's pool released after parsing
COLUMNS_SCAN_BYTES = 16 << 20  # JSONL bytes parsed at a time (threaded) to find every field
COLUMNS_SCAN_BLOCK = 4 << 20  # pyarrow's block per thread in that scan
_GLOB_CHARS = re.compile(r"[*?\[]")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+){0,2}$")


@dataclass
class InputFile:
    """One resolved input."""

    path: str  # as given, or as matched by a glob / found in a folder; Hub: the name as given
    kind: str  # one of KINDS
    size: int  # bytes (folders: their data files; 0 for hub)


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


# ------------------------------------------------------------------------------------ resolving


def _one_line(msg: object, limit: int = 240) -> str:
    text = " ".join(str(msg).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind_of(path: str) -> str | None:
    low = path.lower()
    for ext, kind in EXTENSIONS.items():
        if low.endswith(ext):
            return kind
    return None


def _open_binary(path: str) -> BinaryIO:
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def _first_char(path: str) -> bytes:
    """First non-whitespace byte of a text file (after a UTF-8 BOM), b"" if there is none."""
    with _open_binary(path) as f:
        head = f.read(1 << 16)
        while head:
            stripped = head.removeprefix(b"\xef\xbb\xbf").lstrip()
            if stripped:
                return stripped[:1]
            head = f.read(1 << 16)
    return b""


def _check_readable(path: str) -> None:
    if not os.access(path, os.R_OK):
        raise UserError(f"cannot read {path}: permission denied; fix its permissions (chmod +r)")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}; check the file") from None


def _is_hf_disk(folder: Path) -> bool:
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def _hf_data_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.arrow") if p.is_file())


def _resolve_file(path: str) -> InputFile:
    kind = _kind_of(path)
    if kind is None:
        ext = "".join(Path(path).suffixes[-2:]) or "(no extension)"
        raise UserError(f"unknown input format {ext!r} for {path}: supported are {SUPPORTED}")
    _check_readable(path)
    size = os.path.getsize(path)
    if size == 0:
        raise UserError(f"{path} is empty (0 bytes): give a file with at least one example")
    if kind in ("json", "jsonl"):
        try:
            first = _first_char(path)
        except (OSError, EOFError) as exc:  # e.g. a broken .gz
            raise UserError(f"cannot read {path}: {_one_line(exc)}; check the file") from None
        if not first:
            raise UserError(f"{path} has no records (only whitespace): give a non-empty file")
        if kind == "json" and first == b"{":
            kind = "jsonl"  # JSON Lines saved as .json (as `datasets` does)
        elif kind == "json" and first != b"[":
            raise UserError(f"{path} is neither a JSON array of objects nor JSON Lines "
                            f"(starts with {first.decode(errors='replace')!r}): convert it to JSONL")
    return InputFile(path=path, kind=kind, size=size)


def _resolve_folder(path: str) -> list[InputFile]:
    folder = Path(path)
    if _is_hf_disk(folder):
        _check_readable(str(folder / ("state.json" if (folder / "state.json").is_file()
                                      else "dataset_dict.json")))
        size = sum(p.stat().st_size for p in _hf_data_files(folder))
        return [InputFile(path=path, kind="hf_disk", size=size)]
    files = sorted(str(p) for p in folder.rglob("*") if p.is_file())
    found = [p for p in files if _kind_of(p)]
    skipped = [p for p in files if not _kind_of(p)]
    if found and skipped:  # said, never silent: a README beside the data is fine, a typo'd .jsonl is not
        names = ", ".join(os.path.relpath(p, path) for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        print(f"pack-data: {path}: skipping {len(skipped)} file(s) that are not data ({names}); "
              f"supported are {SUPPORTED}", file=sys.stderr)
    if not found:
        raise UserError(f"folder {path} holds no supported data files and was not written by "
                        f"datasets.save_to_disk: supported are {SUPPORTED}")
    return [_resolve_file(p) for p in found]


def _parse_hub(name: str) -> tuple[str, str | None, str]:
    parts = name.split(":")
    if len(parts) == 1:
        return parts[0], None, "train"
    if len(parts) == 2:
        return parts[0], None, parts[1]
    return parts[0], parts[1], parts[2]


def resolve_inputs(inputs: Sequence[str]) -> list[InputFile]:
    """Expand globs and folders, check that every input exists and is readable, detect formats."""
    if not inputs:
        raise UserError("no input given: pass at least one file, glob, folder or Hub dataset name")
    out: list[InputFile] = []
    for raw in inputs:
        spec = os.path.expanduser(str(raw))
        if os.path.exists(spec):
            out.extend(_resolve_folder(spec) if os.path.isdir(spec) else [_resolve_file(spec)])
        elif _GLOB_CHARS.search(spec):
            matches = sorted(globlib.glob(spec, recursive=True))
            if not matches:
                raise UserError(f"no files match {raw!r}: check the pattern and quote it so the "
                                "shell does not expand it")
            for m in matches:
                out.extend(_resolve_folder(m) if os.path.isdir(m) else [_resolve_file(m)])
        elif _kind_of(spec) is None and _HUB_NAME.match(spec) and "/" in spec.split(":")[0]:
            out.append(_resolve_hub(spec))
        else:
            raise UserError(f"input not found: {raw}: check the path (relative to {os.getcwd()})")
    for f in out:
        _refuse_packed(f)
    return out


_PACKED_COLUMNS = {"seq_lens", "position_ids", "example_ids"}


def _refuse_packed(f: InputFile) -> None:
    """Packed shards are rows of several examples each; read as input, every row would become one
    example and the boundaries would be lost. Refused: pack the original dataset instead."""
    path = Path(f.path)
    packed = path.is_file() and pack_data_files(path.parent) is not None
    if not packed and f.kind == "arrow":
        try:
            with pa.memory_map(f.path) as source:
                try:
                    names = set(pa.ipc.open_file(source).schema.names)
                except pa.ArrowInvalid:
                    source.seek(0)
                    names = set(pa.ipc.open_stream(source).schema.names)
        except (pa.ArrowInvalid, OSError):
            return  # not readable: the reading says so in its own words
        packed = _PACKED_COLUMNS <= names and set(SCHEMA.names) <= names
    if packed:
        raise UserError(
            f"{f.path} is packed output of pack-data (rows of several examples each): packing it again "
            "would make each row one example; pass the original dataset instead"
        )


# ------------------------------------------------------------------------------------ the Hub


def _hub_reachable(timeout: float = 3.0) -> str | None:
    """None if the Hub answers a TCP connect, else the reason (offline mode, DNS, refused...)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") or \
            os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("0", ""):
        return None  # offline mode: let `datasets` use its cache and say what is missing
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = re.sub(r"^\w+://", "", endpoint).split("/")[0]
    host, _, port = host.partition(":")
    try:
        socket.create_connection((host, int(port or 443)), timeout=timeout).close()
    except OSError as exc:
        return f"{host} is unreachable ({exc.strerror or exc})"
    return None


def _load_hub(name: str) -> Any:
    """The streaming `datasets.IterableDataset` for a Hub name (tests replace this function)."""
    import datasets

    repo, config, split = _parse_hub(name)
    return datasets.load_dataset(repo, config, split=split, streaming=True)


def _open_hub(name: str) -> Any:
    problem = _hub_reachable()
    if problem:
        raise UserError(f"{name!r} is not a local file or folder, and the Hugging Face Hub cannot "
                        f"be reached: {problem}; pass a local path or check the network")
    try:
        return _load_hub(name)
    except UserError:
        raise
    except Exception as exc:  # datasets raises many types (FileNotFound, ConnectionError, ...)
        raise UserError(f"could not open Hub dataset {name!r} (it is not a local path either): "
                        f"{type(exc).__name__}: {_one_line(exc)}") from None


def _resolve_hub(name: str) -> InputFile:
    _open_hub(name)  # fail now, with one line, rather than halfway through
    return InputFile(path=name, kind="hub", size=0)


# ------------------------------------------------------------------------------------ fingerprints


def _hub_revision(name: str) -> str | None:
    if _hub_reachable(timeout=2.0):
        return None
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(_parse_hub(name)[0], timeout=5).sha
    except Exception:  # unknown revision is recorded as null, never fatal
        return None


def input_fingerprints(files: list[InputFile]) -> list[dict]:
    """One manifest entry per input: path, kind, bytes and sha256 of the bytes read.

    Folders from `save_to_disk` hash their Arrow data files (name and content, sorted; the
    metadata JSON is left out); Hub inputs record the resolved revision when the Hub answers.
    """
    out = []
    for f in files:
        if f.kind == "hub":
            out.append({"path": f.path, "kind": "hub", "bytes": 0, "sha256": None,
                        "revision": _hub_revision(f.path)})
        elif f.kind == "hf_disk":
            folder = Path(f.path)
            h = hashlib.sha256()
            total = 0
            for p in _hf_data_files(folder):
                h.update(f"{p.relative_to(folder).as_posix()}\0{file_sha256(p)}\n".encode())
                total += p.stat().st_size
            out.append({"path": f.path, "kind": f.kind, "bytes": total, "sha256": h.hexdigest()})
        else:
            out.append({"path": f.path, "kind": f.kind, "bytes": os.path.getsize(f.path),
                        "sha256": file_sha256(f.path)})
    return out


# ------------------------------------------------------------------------------------ schema drift


class _Conformer:
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


# ------------------------------------------------------------------------------------ JSON Lines


def _json_kind(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(v), type(v).__name__)


def _type_conflict(path: str, items: Iterator[tuple[int, Any]]) -> UserError | None:
    """First top-level field whose JSON type changes between records: items are (line, obj)."""
    first: dict[str, tuple[str, int]] = {}
    for line, obj in items:
        for key, value in obj.items():
            if value is None:
                continue
            kind = _json_kind(value)
            seen = first.setdefault(key, (kind, line))
            if seen[0] != kind:
                return UserError(f"{path} line {line}: field {key!r} is a {kind} here but a "
                                 f"{seen[0]} on line {seen[1]}: use one type per field in every "
                                 "record")
    return None


def _locate_jsonl_error(path: str, chunk: bytes, first_line: int, offset: int,
                        exc: Exception) -> UserError:
    """Error path: re-scan a chunk line by line in Python to name the offending line."""
    parsed: list[tuple[int, Any]] = []
    pos = 0
    for i, raw in enumerate(chunk.split(b"\n")):
        line = first_line + i
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return UserError(f"{path} line {line} (byte offset {offset + pos + e.start}): not valid "
                             "UTF-8; re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")
        pos += len(raw) + 1
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            return UserError(f"{path} line {line}: malformed JSON ({e.msg} at column {e.colno}); "
                             "fix or remove that line (one JSON object per line)")
        if not isinstance(obj, dict):
            return UserError(f"{path} line {line}: expected a JSON object per line, found a "
                             f"{_json_kind(obj)}; write one {{...}} record per line")
        parsed.append((line, obj))
    conflict = _type_conflict(path, iter(parsed))
    if conflict:
        return conflict
    last = first_line + chunk.count(b"\n")
    return UserError(f"{path} lines {first_line}-{last}: pyarrow cannot read these records: "
                     f"{_one_line(exc)}; make nested fields use one type throughout")


def _jsonl_chunks(path: str, chunk_bytes: int) -> Iterator[tuple[bytes, int, int]]:
    """(chunk, 1-based line of its first line, byte offset) cut at line ends; bounded memory.

    The blocks of a line longer than a block are kept apart until its end is read and joined once,
    so a line of any length is copied a bounded number of times."""
    with _open_binary(path) as f:
        line, offset = 1, 0
        pending: list[bytes] = []  # blocks read since the last line end
        first = True
        while True:
            block = f.read(chunk_bytes)
            if first and block.startswith(b"\xef\xbb\xbf"):
                block, offset = block[3:], 3
            first = False
            if not block:
                if pending:
                    yield b"".join(pending), line, offset
                return
            cut = block.rfind(b"\n")
            if cut < 0:
                pending.append(block)
                continue
            pending.append(block[: cut + 1])  # the only part with line ends
            rest = block[cut + 1:]
            del block
            lines, size = pending[-1].count(b"\n"), sum(map(len, pending))
            yield _joined(pending), line, offset  # (no reference to the chunk stays here)
            pending = [rest] if rest else []
            line += lines
            offset += size


def _joined(parts: list[bytes]) -> bytes:
    """The parts joined, the list emptied."""
    out = parts[0] if len(parts) == 1 else b"".join(parts)
    parts.clear()
    return out


_WS = np.zeros(256, dtype=bool)
_WS[[9, 10, 13, 32]] = True


def _record_lines(chunk: bytes, first_line: int, n_rows: int) -> np.ndarray | None:
    """1-based line number of each record of a chunk (non-blank lines), None if not one per line."""
    n_newlines = chunk.count(b"\n")
    n_lines = n_newlines + (0 if chunk.endswith(b"\n") else 1)
    if n_lines == n_rows:
        return np.arange(first_line, first_line + n_rows, dtype=np.int64)
    arr = np.frombuffer(chunk, dtype=np.uint8)
    ends = np.flatnonzero(arr == 10)
    if not chunk.endswith(b"\n"):
        ends = np.append(ends, len(arr))
    starts = np.concatenate(([0], ends[:-1] + 1))
    solid = np.concatenate(([0], np.cumsum(~_WS[arr])))
    nonblank = np.flatnonzero(solid[ends] - solid[starts] > 0)
    if len(nonblank) != n_rows:
        return None  # objects spanning lines or several per line: only record numbers are exact
    return first_line + nonblank.astype(np.int64)


def _jsonl_columns(path: str) -> list[str]:
    """Every field name of a JSON Lines file, in order of first appearance (see column_names)."""
    keys: dict[str, None] = {}
    for chunk, line, offset in _jsonl_chunks(path, COLUMNS_SCAN_BYTES):
        if not chunk or chunk.isspace():
            continue
        try:
            options = pajson.ReadOptions(use_threads=True, block_size=COLUMNS_SCAN_BLOCK)
            table = pajson.read_json(pa.BufferReader(chunk), read_options=options)
        except pa.ArrowInvalid:  # a line longer than a block, or a bad record: parse it as reading does
            try:
                options = pajson.ReadOptions(use_threads=False, block_size=len(chunk) + 1)
                table = pajson.read_json(pa.BufferReader(chunk), read_options=options)
            except pa.ArrowInvalid as exc:
                raise _locate_jsonl_error(path, chunk, line, offset, exc) from None
        keys.update(dict.fromkeys(table.column_names))
        del table
    pa.default_memory_pool().release_unused()  # a long line's parse would otherwise stay in RSS
    return list(keys)


def _read_jsonl(path: str, batch_rows: int, chunk_bytes: int
                ) -> Iterator[tuple[pa.Table, np.ndarray | None]]:
    conform = _Conformer()
    for chunk, line, offset in _jsonl_chunks(path, chunk_bytes):
        if not chunk or chunk.isspace():
            continue
        try:
            # pyarrow does not validate UTF-8 inside JSON strings; CPython's decoder does, fast.
            chunk.decode("utf-8")
            table = pajson.read_json(
                pa.BufferReader(chunk),
                read_options=pajson.ReadOptions(use_threads=False, block_size=len(chunk) + 1),
            )
        except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
            raise _locate_jsonl_error(path, chunk, line, offset, exc) from None
        table = conform(table)
        lines = _record_lines(chunk, line, table.num_rows)
        if len(chunk) > LONG_CHUNK_BYTES:  # a long line: what parsing it took goes back to the system
            pa.default_memory_pool().release_unused()
        del chunk  # only the table is needed while its batches are tokenized
        for start in range(0, table.num_rows, batch_rows):
            yield (table.slice(start, batch_rows),
                   None if lines is None else lines[start: start + batch_rows])


# ------------------------------------------------------------------------------------ JSON array


_SKIP_WS = re.compile(r"[ \t\n\r]*")


def _read_json_array(path: str, batch_rows: int) -> Iterator[tuple[pa.Table, Any]]:
    """A JSON array has no line structure to cut it at, so the text is read once (memory about the
    file size) and decoded at once in C; one Arrow table is built per batch. Line numbers of the
    elements are found only if an error message needs one (`ArrayLines`). Malformed arrays are
    scanned element by element to say where they break. JSON-array datasets are small in practice
    (CodeAlpaca: 20k records, 8 MB); convert larger data to JSONL or Parquet, which are streamed."""
    text = _json_array_text(path)
    try:
        records = json.loads(text)
    except json.JSONDecodeError:
        records = None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        for _ in _scan_json_array(path, text):  # raises the located error
            pass
        raise UserError(f"{path}: expected a JSON array of objects; convert it to JSONL")
    del text
    conform = _Conformer()
    for start in range(0, len(records), batch_rows):
        batch = records[start : start + batch_rows]
        lines = ArrayLines(path, start, start + len(batch))
        try:
            table = _records_table(batch)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            numbers = [lines[k] for k in range(len(batch))]
            err = _type_conflict(path, iter(zip(numbers, batch)))
            raise (err or UserError(f"{path} lines {numbers[0]}-{numbers[-1]}: pyarrow cannot read "
                                    f"these records: {_one_line(exc)}")) from None
        yield conform(table), lines


def _records_table(records: list[dict]) -> pa.Table:
    """Records -> a table with a column for every key that any of them has (in order of first
    appearance; a record without it gives a null), as the JSON Lines reader does.
    `pa.Table.from_pylist` would take the first record's keys only and drop the others' silently."""
    return pa.Table.from_pydict({k: _column([r.get(k) for r in records]) for k in _record_keys(records)})


def _record_keys(records: list[dict]) -> list[str]:
    """Every key of the records, in order of first appearance."""
    return list(dict.fromkeys(k for r in records for k in r))


def _column(values: list) -> Any:
    """One column of JSON values as Arrow. Text (the usual case) and all-null columns are built
    from buffers: pyarrow's first conversion of Python objects imports pandas (0.2-0.3 s), so
    everything else (numbers, nested values, mixed types) is left to it."""
    present = [v for v in values if v is not None]
    if not present:
        return pa.nulls(len(values))
    if not all(type(v) is str for v in present):
        return values
    try:
        encoded = [b"" if v is None else v.encode() for v in values]
    except UnicodeEncodeError:  # a lone surrogate: pyarrow says what is wrong
        return values
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, encoded), np.int64, len(values)), out=offsets[1:])
    if offsets[-1] >= 2**31:  # beyond a string array's int32 offsets
        return values
    valid = None
    if len(present) < len(values):
        valid = pa.py_buffer(np.packbits(np.fromiter((v is not None for v in values), bool, len(values)),
                                         bitorder="little"))
    return pa.StringArray.from_buffers(len(values), pa.py_buffer(offsets.astype(np.int32)),
                                       pa.py_buffer(b"".join(encoded)), valid, len(values) - len(present))


def _json_array_head(path: str, n: int) -> list[dict]:
    """The first `n` records of a JSON array file, decoded one by one (not the whole array)."""
    return [obj for _, obj in itertools.islice(_scan_json_array(path, _json_array_text(path)), n)]


def _json_array_text(path: str) -> str:
    with _open_binary(path) as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path} line {line} (byte offset {e.start}): not valid UTF-8; re-encode "
                        "the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _scan_json_array(path: str, text: str) -> Iterator[tuple[int, dict]]:
    """(1-based line, object) of each element, decoded one at a time; a malformed array raises a
    UserError naming the line where it breaks."""
    dec = json.JSONDecoder()
    pos = _SKIP_WS.match(text, 0).end()
    if text[pos: pos + 1] != "[":
        raise UserError(f"{path}: expected a JSON array of objects; convert it to JSONL")
    pos += 1
    line, line_pos = 1, 0
    while True:
        pos = _SKIP_WS.match(text, pos).end()
        if text[pos: pos + 1] == "]":  # end of the array (also tolerates a trailing comma)
            return
        line += text.count("\n", line_pos, pos)
        line_pos = pos
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} line {e.lineno}: malformed JSON ({e.msg} at column {e.colno});"
                            " fix that element of the array") from None
        if not isinstance(obj, dict):
            raise UserError(f"{path} line {line}: array element is a {_json_kind(obj)}, not an "
                            "object; the array must hold one {...} record per example")
        yield line, obj
        pos = _SKIP_WS.match(text, pos).end()
        sep = text[pos: pos + 1]
        if sep == ",":
            pos += 1
        elif sep != "]":
            line += text.count("\n", line_pos, pos)
            line_pos = pos
            raise UserError(f"{path} line {line}: expected ',' or ']' after an array element, found "
                            f"{sep or 'end of file'!r}; the file is truncated or malformed")


def _array_element_lines(path: str) -> np.ndarray:
    st = os.stat(path)
    return _element_lines(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _element_lines(path: str, mtime_ns: int, size: int) -> np.ndarray:  # cached per file version
    return np.fromiter((line for line, _ in _scan_json_array(path, _json_array_text(path))), dtype=np.int64)


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


# ------------------------------------------------------------------------------------ CSV


def _locate_bad_utf8(path: str) -> UserError | None:
    with _open_binary(path) as f:
        offset = 0
        for lineno, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return UserError(f"{path} line {lineno} (byte offset {offset + e.start}): not valid "
                                 "UTF-8; re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")
            offset += len(raw)
    return None


def _read_csv(path: str, batch_rows: int, chunk_bytes: int) -> Iterator[pa.Table]:
    delimiter = "\t" if path.lower().endswith((".tsv", ".tsv.gz")) else ","
    parse = pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
    read = pacsv.ReadOptions(block_size=chunk_bytes, use_threads=False)

    def fail(exc: Exception) -> UserError:
        if "UTF8" in str(exc) or "UTF-8" in str(exc):
            err = _locate_bad_utf8(path)
            if err:
                return err
        return UserError(f"{path}: cannot read as CSV: {_one_line(exc)}; check quoting and that "
                         "every row has the same number of fields")

    try:
        with pacsv.open_csv(pa.input_stream(path, compression="detect"), read_options=read,
                            parse_options=parse) as probe:
            names = probe.schema.names
        convert = pacsv.ConvertOptions(column_types={n: pa.string() for n in names},
                                       strings_can_be_null=False)
        reader = pacsv.open_csv(pa.input_stream(path, compression="detect"), read_options=read,
                                parse_options=parse, convert_options=convert)
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


def _read_parquet(path: str, batch_rows: int) -> Iterator[pa.Table]:
    """Row groups in file order, decoded ahead by PARQUET_THREADS threads (pyarrow decodes without
    the GIL; one thread decoded about 0.5 GB/s); each is yielded in `batch_rows` slices.

    Bounded memory (pack-data's 1B-token benchmark): buffered reads rather than a memory map (a
    map keeps every page read resident until the file is closed); at most PARQUET_AHEAD_BYTES of
    decoded groups in flight; a group larger than a quarter of that is streamed batch by batch
    (one iter_batches call over the whole file kept ~0.7 GB of decoded data alive at 400M tokens).
    """
    try:
        pf = pq.ParquetFile(path, memory_map=False)
        sizes = [pf.metadata.row_group(g).total_byte_size for g in range(pf.metadata.num_row_groups)]
        with ThreadPoolExecutor(PARQUET_THREADS, thread_name_prefix="parquet") as pool:
            ahead: deque = deque()  # (group, future of its table, or None: stream it)
            in_flight = 0
            for group in range(len(sizes)):
                nxt = group + len(ahead)
                while nxt < len(sizes) and len(ahead) < 2 * PARQUET_THREADS and (
                        sizes[nxt] > PARQUET_AHEAD_BYTES // 4 or in_flight + sizes[nxt] <= PARQUET_AHEAD_BYTES):
                    if sizes[nxt] > PARQUET_AHEAD_BYTES // 4:
                        ahead.append((nxt, None))
                    else:
                        ahead.append((nxt, pool.submit(_parquet_group, path, nxt)))
                        in_flight += sizes[nxt]
                    nxt += 1
                _, future = ahead.popleft()
                if future is None:
                    for rb in pf.iter_batches(batch_size=batch_rows, row_groups=[group]):
                        yield pa.Table.from_batches([rb])
                    continue
                table = future.result()
                in_flight -= sizes[group]
                for start in range(0, table.num_rows, batch_rows):
                    yield table.slice(start, batch_rows)
                del table
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise UserError(f"{path}: not a readable Parquet file ({_one_line(exc)}); it may be "
                        "truncated or corrupt: re-export or re-download it") from None


def _parquet_group(path: str, group: int) -> pa.Table:
    """One row group, decoded by its own reader (ParquetFile objects are not shared across threads).

    The groups this thread decoded before were freed by the consuming thread; the allocator keeps
    such memory for its owning thread until told to collect it, which let peak RSS grow with the
    input (measured: +0.5 GB at 300M tokens), so collect first.
    """
    pa.default_memory_pool().release_unused()
    return pq.ParquetFile(path, memory_map=False).read_row_group(group)


def _read_arrow(path: str, batch_rows: int) -> Iterator[pa.Table]:
    """Arrow IPC, file format (random access) or stream format, memory-mapped: zero-copy slices."""
    try:
        source = pa.memory_map(path)
        try:
            reader = pa.ipc.open_file(source)
            batches: Iterator[pa.RecordBatch] = (reader.get_batch(i)
                                                 for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            batches = iter(pa.ipc.open_stream(source))
        for rb in batches:
            for start in range(0, rb.num_rows, batch_rows):
                yield pa.Table.from_batches([rb.slice(start, batch_rows)])
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise UserError(f"{path}: not a readable Arrow IPC file or stream ({_one_line(exc)}); it "
                        "may be truncated or corrupt: re-export it") from None


# ------------------------------------------------------------------------------------ datasets


def _load_disk(path: str) -> Any:
    import datasets

    if not _hf_data_files(Path(path)):  # `datasets` cannot even load an empty saved dataset
        raise UserError(f"{path} contains no records: give an input with at least one example")
    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:
        raise UserError(f"{path}: cannot load this datasets.save_to_disk folder: "
                        f"{type(exc).__name__}: {_one_line(exc)}") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if len(splits) == 1 or "train" in splits:
            return ds[splits[0] if len(splits) == 1 else "train"]
        raise UserError(f"{path} is a DatasetDict with splits {splits} and no 'train': pass one "
                        f"split folder, e.g. {os.path.join(path, splits[0])}")
    return ds


def _read_datasets(ds: Any, batch_rows: int, name: str) -> Iterator[pa.Table]:
    try:
        for t in ds.with_format("arrow").iter(batch_size=batch_rows):
            yield t if isinstance(t, pa.Table) else pa.Table.from_pydict(t)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{name}: reading failed: {type(exc).__name__}: {_one_line(exc)}") from None


# ------------------------------------------------------------------------------------ public


def _tables(f: InputFile, batch_rows: int, chunk_bytes: int
            ) -> Iterator[tuple[pa.Table, np.ndarray | None]]:
    if f.kind == "jsonl":
        yield from _read_jsonl(f.path, batch_rows, chunk_bytes)
    elif f.kind == "json":
        yield from _read_json_array(f.path, batch_rows)
    else:
        if f.kind == "csv":
            tables = _read_csv(f.path, batch_rows, chunk_bytes)
        elif f.kind == "parquet":
            tables = _read_parquet(f.path, batch_rows)
        elif f.kind == "arrow":
            tables = _read_arrow(f.path, batch_rows)
        elif f.kind == "hf_disk":
            tables = _read_datasets(_load_disk(f.path), batch_rows, f.path)
        elif f.kind == "hub":
            tables = _read_datasets(_open_hub(f.path), batch_rows, f.path)
        else:
            raise UserError(f"unknown input kind {f.kind!r} for {f.path}: expected one of {KINDS}")
        for t in tables:
            yield t, None


def iter_batches(files: list[InputFile], *, batch_rows: int = 4096, limit: int | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[SourceBatch]:
    """Stream every input in order as tables of at most `batch_rows` rows (never an empty one).

    `limit` stops after that many rows in total. An input that yields no rows is an error.
    """
    if batch_rows < 1:
        raise ValueError("batch_rows must be >= 1")
    index = 0
    for f in files:
        if limit is not None and index >= limit:
            return
        row = 0
        for table, lines in _tables(f, batch_rows, chunk_bytes):
            if table.num_rows == 0:
                continue
            if limit is not None and index + table.num_rows > limit:
                keep = limit - index
                table = table.slice(0, keep)
                lines = None if lines is None else lines[:keep]
            yield SourceBatch(table=table, file=f.path, first_row=row, first_index=index,
                              lines=lines)
            row += table.num_rows
            index += table.num_rows
            if limit is not None and index >= limit:
                return
        if row == 0:
            raise UserError(f"{f.path} contains no records: give an input with at least one "
                            "example")


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
    16 MiB at a time with pyarrow's threaded reader (about 200 MB/s on 2 cores).
    """
    if not files:
        raise UserError("no inputs to read columns from")
    f = files[0]
    try:
        if f.kind == "parquet":
            return list(pq.ParquetFile(f.path).schema_arrow.names)
        if f.kind == "hf_disk":
            return list(_load_disk(f.path).column_names)
        if f.kind == "hub":
            ds = _open_hub(f.path)
            if ds.column_names:
                return list(ds.column_names)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise UserError(f"{f.path}: not a readable Parquet file ({_one_line(exc)}); it may be "
                        "truncated or corrupt: re-export or re-download it") from None
    if f.kind == "json":
        keys: dict[str, None] = {}
        for _, record in _scan_json_array(f.path, _json_array_text(f.path)):
            keys.update(dict.fromkeys(record))
        if keys:
            return list(keys)
    if f.kind == "jsonl":
        keys = _jsonl_columns(f.path)
        if keys:
            return keys
    for batch in iter_batches([f], batch_rows=1024, limit=None):
        return list(batch.table.column_names)
    raise UserError(f"{f.path} contains no records")  # unreachable: iter_batches raises first
