"""Reader of JSON Lines inputs: cut into byte chunks at line ends that pyarrow parses one by one
(bounded memory; a schema that changes between chunks is fine), knowing the exact line of every
record, for one-line errors. JSON arrays are `pipeline.read.json_array`'s.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson

from pipeline.errors import UserError, one_line
from pipeline.read.json_numbers import exact_numbers
from pipeline.read.json_records import (
    MAX_DEPTH,
    Conformer,
    DuplicateKey,
    json_kind,
    lone_surrogate,
    short,
    type_conflict,
    uniform_content,
    unique_keys,
)

# Bytes of JSONL parsed at once (one pyarrow block; small, so tokenizing starts soon and overlaps
# the parsing of the next chunk); a line longer than this makes a larger chunk.
DEFAULT_CHUNK_BYTES = 1 << 20
LONG_CHUNK_BYTES = 4 << 20  # a JSONL chunk this long (a long line) has pyarrow's pool released after parsing
COLUMNS_SCAN_BYTES = 16 << 20  # JSONL bytes parsed at a time (threaded) to find every field
COLUMNS_SCAN_BLOCK = 4 << 20  # pyarrow's block per thread in that scan


COMPRESSED = (".gz", ".zst")  # text inputs read decompressed: gzip, zstd (Axolotl's ALST example's data)


def open_input(path: str) -> BinaryIO:
    """A text input for reading bytes, decompressed when its name ends in .gz or .zst (zstd, through
    pyarrow's codec; such a stream is read from its start only)."""
    low = path.lower()
    if low.endswith(".zst"):
        return io.BufferedReader(pa.input_stream(path, compression="zstd"))  # type: ignore[arg-type]
    return gzip.open(path, "rb") if low.endswith(".gz") else open(path, "rb")


@contextmanager
def compressed_errors(path: str) -> Iterator[None]:
    """A .gz or .zst input cut short or damaged (EOFError, zlib.error, BadGzipFile, found only when the
    reading gets there) is one line naming the file, not click's bare "Aborted!" (its answer to an
    EOFError)."""
    try:
        yield
    except (EOFError, zlib.error, gzip.BadGzipFile, OSError) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, gzip.BadGzipFile) and "compressed" not in str(exc):
            raise  # a full disk, a vanished file: not the file's own damage (pyarrow: "Truncated compressed stream")
        raise UserError(
            f"cannot read {path}: {one_line(exc)}: the compressed file is cut short or damaged; check "
            "it (gzip -t, zstd -t) or decompress it again"
        ) from None


# ------------------------------------------------------------------------------------ JSON Lines


def _too_deep(table: pa.Table) -> bool:
    """Whether a column's type nests lists or structs more than MAX_DEPTH levels (walked without
    recursion: pyarrow's own recursive code overflows the stack on such types)."""
    todo = [(t, 1) for t in table.schema.types]
    while todo:
        typ, depth = todo.pop()
        if depth > MAX_DEPTH:
            return True
        if pa.types.is_struct(typ):
            todo.extend((typ.field(i).type, depth + 1) for i in range(typ.num_fields))
        elif pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
            todo.append((typ.value_type, depth + 1))
    return False


_OPENS = np.zeros(256, np.int8)
_OPENS[[ord("["), ord("{")]] = 1
_OPENS[[ord("]"), ord("}")]] = -1


def _too_deep_line(path: str, chunk: bytes, first_line: int) -> UserError | None:
    """The one-line error for a record of `chunk` nested more than about MAX_DEPTH levels, found
    before pyarrow parses it (pyarrow takes tens of seconds on a value 10,000 levels deep before it
    fails); None where no record is that deep.

    The brackets' running count (strings included, so an over-count) picks the chunks and lines to
    look at; Python's json module, whose recursion limit is about MAX_DEPTH, decides. A line it
    cannot parse for any other reason is left to the reading's own error path.

    >>> _too_deep_line("a.jsonl", b'{"t": 1}\\n{"t": ' + b"[" * 5000 + b"]" * 5000 + b"}\\n", 1)
    UserError('a.jsonl line 2: JSON nested too deeply (about 1000 levels or more): flatten that record')
    >>> _too_deep_line("a.jsonl", b'{"t": "' + b"[" * 5000 + b'"}\\n', 1) is None
    True
    """
    if chunk.count(b"[") + chunk.count(b"{") <= MAX_DEPTH:
        return None
    if int(np.cumsum(_OPENS[np.frombuffer(chunk, np.uint8)], dtype=np.int32).max()) <= MAX_DEPTH:
        return None
    for i, raw in enumerate(chunk.split(b"\n")):
        if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
            continue
        try:
            json.loads(raw)
        except RecursionError:
            return _deep_error(path, first_line + i)
        except ValueError:
            continue
    return None


def _deep_error(path: str, line: int) -> UserError:
    return UserError(f"{path} line {line}: JSON nested too deeply (about {MAX_DEPTH} levels or more): flatten that record")


def _locate_jsonl_error(path: str, chunk: bytes, first_line: int, offset: int, exc: Exception) -> UserError:
    """Error path: re-scan a chunk line by line in Python to name the offending line."""
    parsed: list[tuple[int, Any]] = []
    pos = 0
    for i, raw in enumerate(chunk.split(b"\n")):
        line = first_line + i
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return UserError(
                f"{path} line {line} (byte offset {offset + pos + e.start}): not valid "
                "UTF-8; re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
            )
        pos += len(raw) + 1
        if not text.strip():
            continue
        try:
            obj = json.loads(text, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as e:
            return UserError(
                f"{path} line {line}: malformed JSON ({e.msg} at column {e.colno}); fix or remove that line (one JSON object per line)"
            )
        except DuplicateKey as e:
            return UserError(
                f"{path} line {line}: key {short(e.key)!r} appears twice in one JSON object: keep one of them (each key once per object)"
            )
        except RecursionError:
            return _deep_error(path, line)
        if not isinstance(obj, dict):
            return UserError(
                f"{path} line {line}: expected a JSON object per line, found a {json_kind(obj)}; write one {{...}} record per line"
            )
        parsed.append((line, obj))
    conflict = lone_surrogate(path, parsed) or type_conflict(path, iter(parsed))
    if conflict:
        return conflict
    last = first_line + chunk.count(b"\n") - chunk.endswith(b"\n")
    return UserError(
        f"{path} lines {first_line}-{last}: pyarrow cannot read these records: {one_line(exc)}; make nested fields use one type throughout"
    )


def _jsonl_chunks(
    path: str, chunk_bytes: int, start: int = 0, end: int | None = None, first_line: int = 1
) -> Iterator[tuple[bytes, int, int]]:
    """(chunk, 1-based line of its first line, byte offset) cut at line ends; bounded memory.

    The blocks of a line longer than a block are kept apart until its end is read and joined once,
    so a line of any length is copied a bounded number of times. `start`/`end`: only the bytes
    [start, end) of an uncompressed file (both at line starts: `line_start`), whose first line is
    line `first_line`."""
    with compressed_errors(path), open_input(path) as f:
        line, offset = first_line, start
        if start:  # a byte range of an uncompressed file
            f.seek(start)
        left = -1 if end is None else end - start  # bytes still to read (-1: to the end)
        pending: list[bytes] = []  # blocks read since the last line end
        first = start == 0
        while True:
            block = f.read(chunk_bytes if left < 0 else min(chunk_bytes, left))
            left -= len(block) if left >= 0 else 0
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
            rest = block[cut + 1 :]
            del block
            lines, size = pending[-1].count(b"\n"), sum(map(len, pending))
            yield _joined(pending), line, offset  # (no reference to the chunk stays here)
            pending = [rest] if rest else []
            line += lines
            offset += size


def line_start(path: str, pos: int) -> int:
    """The first byte offset >= pos at which a line of the (uncompressed) file starts, or its size."""
    if pos <= 0:
        return 0
    with open(path, "rb") as f:
        f.seek(pos - 1)
        while True:
            block = f.read(1 << 16)
            if not block:
                return f.tell()
            cut = block.find(b"\n")
            if cut >= 0:
                return f.tell() - len(block) + cut + 1


def lines_before(path: str, pos: int) -> int:
    """How many line ends the (uncompressed) file has before byte `pos`."""
    count = 0
    with open(path, "rb") as f:
        while pos > 0:
            block = f.read(min(pos, 1 << 24))
            if not block:
                break
            count += block.count(b"\n")
            pos -= len(block)
    return count


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


def jsonl_columns(path: str) -> list[str]:
    """Every field name of a JSON Lines file, in order of first appearance (see column_names)."""
    keys: dict[str, None] = {}
    for chunk, line, offset in _jsonl_chunks(path, COLUMNS_SCAN_BYTES):
        if not chunk or chunk.isspace():
            continue
        deep = _too_deep_line(path, chunk, line)
        if deep is not None:
            raise deep
        try:
            options = pajson.ReadOptions(use_threads=True, block_size=COLUMNS_SCAN_BLOCK)
            table = pajson.read_json(pa.BufferReader(chunk), read_options=options)
        except pa.ArrowInvalid:  # a line longer than a block, or a bad record: parse it as reading does
            try:
                options = pajson.ReadOptions(use_threads=False, block_size=len(chunk) + 1)
                table = pajson.read_json(pa.BufferReader(chunk), read_options=options)
            except pa.ArrowInvalid as exc:
                parsed = _parse_uniform(chunk)
                if parsed is None:
                    raise _locate_jsonl_error(path, chunk, line, offset, exc) from None
                table = parsed[0]
        keys.update(dict.fromkeys(table.column_names))
        del table
    pa.default_memory_pool().release_unused()  # a long line's parse would otherwise stay in RSS
    return list(keys)


def _parse_uniform(chunk: bytes) -> tuple[pa.Table, bytes] | None:
    """`chunk` rewritten by `uniform_content` (chat messages that mix text and content lists) and
    parsed, or None when it has no such mix or still cannot be parsed."""
    uniform = uniform_content(chunk) if b"content" in chunk else None
    if uniform is None:
        return None
    try:
        return pajson.read_json(
            pa.BufferReader(uniform), read_options=pajson.ReadOptions(use_threads=False, block_size=len(uniform) + 1)
        ), uniform
    except pa.ArrowInvalid:
        return None


def read_jsonl(
    path: str,
    batch_rows: int,
    chunk_bytes: int,
    start: int = 0,
    end: int | None = None,
    first_line: int = 1,
    exact: Collection[str] | None = None,
) -> Iterator[tuple[pa.Table, np.ndarray | None]]:
    """Tables of at most `batch_rows` records and the line of each; `start`, `end`, `first_line`:
    only that byte range (as `_jsonl_chunks`); `exact`: the columns whose numbers are kept as their
    text (`exact_numbers`; None: all)."""
    conform = Conformer()
    for chunk, line, offset in _jsonl_chunks(path, chunk_bytes, start, end, first_line):
        if not chunk or chunk.isspace():
            continue
        deep = _too_deep_line(path, chunk, line)
        if deep is not None:
            raise deep
        try:
            # pyarrow does not validate UTF-8 inside JSON strings; CPython's decoder does, fast.
            chunk.decode("utf-8")
            table = pajson.read_json(
                pa.BufferReader(chunk),
                read_options=pajson.ReadOptions(use_threads=False, block_size=len(chunk) + 1),
            )
        except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
            parsed = _parse_uniform(chunk) if isinstance(exc, pa.ArrowInvalid) else None
            if parsed is None:
                raise _locate_jsonl_error(path, chunk, line, offset, exc) from None
            table, chunk = parsed
        if _too_deep(table):  # deeper types crash pyarrow's own code (a segfault, no line at all)
            raise _locate_jsonl_error(path, chunk, line, offset, ValueError(f"nested more than {MAX_DEPTH} levels"))
        table = conform(exact_numbers(table, chunk, exact))
        lines = _record_lines(chunk, line, table.num_rows)
        if len(chunk) > LONG_CHUNK_BYTES:  # a long line: what parsing it took goes back to the system
            pa.default_memory_pool().release_unused()
        del chunk  # only the table is needed while its batches are tokenized
        for start in range(0, table.num_rows, batch_rows):
            yield (table.slice(start, batch_rows), None if lines is None else lines[start : start + batch_rows])
