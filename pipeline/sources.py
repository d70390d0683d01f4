"""Input sources: resolve the user's inputs into files, and stream them as Arrow tables with exact
row positions (the format readers are `pipeline.read_json` and `pipeline.read_tables`).

Supported inputs (several may be given; globs are expanded in sorted order; order is kept):

- JSON Lines      `.jsonl`, `.ndjson` (also `.gz`), and `.json` files whose content is JSON Lines
- JSON array      `.json` (also `.json.gz`) holding one list of objects
- Parquet         `.parquet`, `.pq`
- Arrow IPC       `.arrow`, `.feather`, `.ipc` (IPC file or stream format, memory-mapped)
- CSV / TSV       `.csv`, `.tsv` (also `.gz`); every column is read as a string, empty stays ""
- a folder written by `datasets.save_to_disk` (memory-mapped Arrow); a `DatasetDict` folder is
  read through its `train` split (or its only split); any other folder is expanded into the
  supported files it contains (recursively, sorted)
- a Hugging Face Hub dataset `owner/name`, `owner/name:split` or `owner/name:config:split`, each
  optionally at a revision (`owner/name@rev:split`; default split `train`), when it names no local
  path (`pipeline.hub`): its split's files, from the local Hugging Face cache or downloaded, are read
  as the local files they are

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

import glob as globlib
import hashlib
import os
import re
import stat
import sys
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import hub
from pipeline.errors import UserError, one_line
from pipeline.read_json import (DEFAULT_CHUNK_BYTES, json_array_text, jsonl_columns, line_start, lines_before,
                                open_input, read_json_array, read_jsonl, scan_json_array)
from pipeline.read_tables import read_arrow, read_csv, read_parquet
from pipeline.shards import SCHEMA, file_sha256, pack_data_files

KINDS = ("jsonl", "json", "parquet", "arrow", "csv", "hf_disk")
# Longest suffix first so that ".jsonl.gz" wins over ".gz".
EXTENSIONS = {
    ".jsonl.gz": "jsonl", ".ndjson.gz": "jsonl", ".json.gz": "json", ".csv.gz": "csv",
    ".tsv.gz": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet",
    ".pq": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow", ".csv": "csv",
    ".tsv": "csv",
}
SUPPORTED = (".jsonl, .ndjson, .json, .parquet, .pq, .arrow, .feather, .ipc, .csv, .tsv (text "
             "formats also .gz), a datasets.save_to_disk folder, or a Hub dataset id (org/name)")
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass
class InputFile:
    """One resolved input."""

    path: str  # as given, or as matched by a glob / found in a folder or a Hub dataset's snapshot
    kind: str  # one of KINDS
    size: int  # bytes (folders: their data files)
    hub: dict | None = None  # a Hub dataset's file: the input as given, id, revision, commit (`pipeline.hub`)


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


def _kind_of(path: str) -> str | None:
    low = path.lower()
    for ext, kind in EXTENSIONS.items():
        if low.endswith(ext):
            return kind
    return None


def _first_char(path: str) -> bytes:
    """First non-whitespace byte of a text file (after a UTF-8 BOM), b"" if there is none."""
    with open_input(path) as f:
        head = f.read(1 << 16)
        while head:
            stripped = head.removeprefix(b"\xef\xbb\xbf").lstrip()
            if stripped:
                return stripped[:1]
            head = f.read(1 << 16)
    return b""


def _broken_link(path: str) -> UserError:
    """The error for a symbolic link whose target does not exist (or a loop of links)."""
    return UserError(f"{path} is a broken symbolic link (to {os.readlink(path)!r}, which does not exist): "
                     "fix the link or remove it")


def _check_readable(path: str) -> None:
    if os.path.islink(path) and not os.path.exists(path):
        raise _broken_link(path)
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


def _check_regular(path: str) -> None:
    """Refuse, without opening it, an input that is not a regular file: a FIFO with no writer would
    block the read forever, a device would never end."""
    if os.path.islink(path) and not os.path.exists(path):
        raise _broken_link(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}; check the path") from None
    if not stat.S_ISREG(mode):
        kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise UserError(f"{path} is {kind}, not a regular file (reading it could wait forever "
                        "or never end): save the data to a file and give that")


def _resolve_file(path: str) -> InputFile:
    _check_regular(path)
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
            raise UserError(f"cannot read {path}: {one_line(exc)}; check the file") from None
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
    entries = list(folder.rglob("*"))
    broken = sorted(str(p) for p in entries if p.is_symlink() and not p.exists())
    for p in broken:  # a link to data that is gone: never skipped unsaid
        if _kind_of(p):
            raise _broken_link(p)
    files = sorted(str(p) for p in entries if p.is_file())
    found = [p for p in files if _kind_of(p)]
    skipped = sorted([p for p in files if not _kind_of(p)] + broken)
    if found and skipped:  # said, never silent: a README beside the data is fine, a typo'd .jsonl is not
        names = ", ".join(os.path.relpath(p, path) for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        print(f"pack-data: {path}: skipping {len(skipped)} file(s) that are not data ({names}); "
              f"supported are {SUPPORTED}", file=sys.stderr)
    if not found:
        raise UserError(f"folder {path} holds no supported data files and was not written by "
                        f"datasets.save_to_disk: supported are {SUPPORTED}")
    return [_resolve_file(p) for p in found]


def resolve_inputs(inputs: Sequence[str]) -> list[InputFile]:
    """Expand globs and folders, check that every input exists and is readable, detect formats."""
    if not inputs:
        raise UserError("no input given: pass at least one file, glob, folder or Hub dataset id")
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
        elif os.path.islink(spec):
            raise _broken_link(spec)
        elif (ref := hub.hub_ref(spec, dataset=True)) is not None:
            out.extend(_resolve_hub(str(raw), ref))
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


def _resolve_hub(given: str, ref: hub.HubRef) -> list[InputFile]:
    """The files of a Hub dataset's split (`pipeline.hub.dataset_files`), each an input of its own
    format that remembers the input as given and the commit it came from."""
    paths, commit = hub.dataset_files(ref)
    if not paths:
        raise UserError(f"dataset {given}: its split holds no data files: choose another split ({ref.repo_id}:SPLIT)")
    facts = {"input": given, **hub.record(ref, commit), "config": ref.config, "split": ref.split or "train"}
    return [replace(_resolve_file(p), hub=facts) for p in paths]


# ------------------------------------------------------------------------------------ fingerprints


def input_fingerprints(files: list[InputFile]) -> list[dict]:
    """One manifest entry per input: path, kind, bytes and sha256 of the bytes read.

    Folders from `save_to_disk` hash their Arrow data files (name and content, sorted; the
    metadata JSON is left out); a Hub dataset's files also record the input as given, its id, the
    revision asked for and the commit read (`hub`).
    """
    out = []
    for f in files:
        if f.kind == "hf_disk":
            folder = Path(f.path)
            h = hashlib.sha256()
            total = 0
            for p in _hf_data_files(folder):
                h.update(f"{p.relative_to(folder).as_posix()}\0{file_sha256(p)}\n".encode())
                total += p.stat().st_size
            out.append({"path": f.path, "kind": f.kind, "bytes": total, "sha256": h.hexdigest()})
        else:
            out.append({"path": f.path, "kind": f.kind, "bytes": os.path.getsize(f.path),
                        "sha256": file_sha256(f.path), **({"hub": f.hub} if f.hub else {})})
    return out


# ------------------------------------------------------------------------------------ datasets


def _load_disk(path: str) -> Any:
    import datasets

    if not _hf_data_files(Path(path)):  # `datasets` cannot even load an empty saved dataset
        raise UserError(f"{path} contains no records: give an input with at least one example")
    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:
        raise UserError(f"{path}: cannot load this datasets.save_to_disk folder: "
                        f"{type(exc).__name__}: {one_line(exc)}") from None
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
        raise UserError(f"{name}: reading failed: {type(exc).__name__}: {one_line(exc)}") from None


# ------------------------------------------------------------------------------------ public


def _tables(f: InputFile, batch_rows: int, chunk_bytes: int, exact: Collection[str] | None = None
            ) -> Iterator[tuple[pa.Table, np.ndarray | None]]:
    if f.kind == "jsonl":
        yield from read_jsonl(f.path, batch_rows, chunk_bytes, exact=exact)
    elif f.kind == "json":
        yield from read_json_array(f.path, batch_rows)
    else:
        if f.kind == "csv":
            tables = read_csv(f.path, batch_rows, chunk_bytes)
        elif f.kind == "parquet":
            tables = read_parquet(f.path, batch_rows)
        elif f.kind == "arrow":
            tables = read_arrow(f.path, batch_rows)
        elif f.kind == "hf_disk":
            tables = _read_datasets(_load_disk(f.path), batch_rows, f.path)
        else:
            raise UserError(f"unknown input kind {f.kind!r} for {f.path}: expected one of {KINDS}")
        for t in tables:
            yield t, None


def iter_batches(files: list[InputFile], *, batch_rows: int = 4096, limit: int | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 exact: dict[str, Collection[str]] | None = None) -> Iterator[SourceBatch]:
    """Stream every input in order as tables of at most `batch_rows` rows (never an empty one).

    `limit` stops after that many rows in total. An input that yields no rows is an error.
    `exact`: per file path, the columns whose JSON numbers are kept as their text
    (`read_json.exact_numbers`); None, or a file not in it: every column.
    """
    if batch_rows < 1:
        raise ValueError("batch_rows must be >= 1")
    index = 0
    for f in files:
        if limit is not None and index >= limit:
            return
        row = 0
        for table, lines in _tables(f, batch_rows, chunk_bytes, None if exact is None else exact.get(f.path)):
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
    cut: compressed text, JSON arrays, CSV, Arrow streams, `datasets` folders). Only file
    sizes and Parquet/Arrow metadata are read. The chunks of a file are in file order."""
    chunks: list[Chunk] = []
    for k, f in enumerate(files):
        if f.kind == "jsonl" and not f.path.lower().endswith(".gz") and f.size > chunk_bytes:
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
                first += sum(counts[begin:g + 1])
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


def chunk_batches(f: InputFile, chunk: Chunk, *, batch_rows: int, lines_known: bool = True,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES, exact: Collection[str] | None = None
                  ) -> Iterator[SourceBatch]:
    """Stream one chunk as `iter_batches` streams files, `first_index` counted from the chunk's
    first row. A JSON Lines chunk past the file's start knows its line numbers only with
    `lines_known` (which counts the line ends before it: a read of the file up to there); without,
    they are counted from 1 (fine when nothing is reported). `exact`: as `iter_batches`'s, for `f`."""
    if chunk.end < 0:
        yield from iter_batches([f], batch_rows=batch_rows, chunk_bytes=chunk_bytes,
                                exact=None if exact is None else {f.path: exact})
        return
    if f.kind == "jsonl":
        first_line = 1 + (lines_before(f.path, chunk.start) if lines_known and chunk.start else 0)
        tables: Iterator[tuple[pa.Table, Any]] = read_jsonl(f.path, batch_rows, chunk_bytes, chunk.start,
                                                             chunk.end, first_line, exact)
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
    f = files[0]
    try:
        if f.kind == "parquet":
            return list(pq.ParquetFile(f.path).schema_arrow.names)
        if f.kind == "hf_disk":
            return list(_load_disk(f.path).column_names)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise UserError(f"{f.path}: not a readable Parquet file ({one_line(exc)}); it may be "
                        "truncated or corrupt: re-export or re-download it") from None
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
