"""The spill: tokenized examples on disk (raw int32 files of input_ids and labels, in input order)
while only their lengths stay in RAM, and the gather that reads pieces of them back in row order.

Pre-tokenized uncompressed Arrow IPC input is not spilled at all (direct mode,
`direct_arrow_spill`): the writer reads each example from the input file itself. The Ray engine
(`pipeline.engines.ray_engine`) spills into one pair of files per chunk of input (parts mode: `sources`
and `label_sources` are those files). In both modes an example's start encodes its file: index << FILE_SHIFT | offset.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import UserError
from pipeline.read.batches import where_of
from pipeline.read.formats import ResolvedFormat
from pipeline.tokenize.render import check_same_format, rows_where


@dataclass
class Spill:
    """Tokenized examples on disk plus their lengths in RAM (non-empty examples only, input order)."""

    ids_path: Path
    labels_path: Path | None  # None: labels equal input_ids (pre-tokenized input without labels)
    lengths: np.ndarray  # int64 per kept example
    example_ids: np.ndarray  # int64 global input index per kept example
    examples_read: int = 0
    empty_skipped: int = 0
    # Direct mode (no spill written): the ids are read from the input Arrow IPC files themselves;
    # `starts` holds each example's (file index << FILE_SHIFT | int32 element offset in that file).
    sources: list[Path] = field(default_factory=list)
    starts: np.ndarray | None = None
    where: Callable[[int], str] | None = None  # example id -> "file line N" (for error messages)
    file_examples: list[int] = field(default_factory=list)  # examples read per input file, in order
    # Parts mode: `sources` are spill files of our own (read through memory maps), one per chunk,
    # and `label_sources` their labels files (empty: labels equal the ids)
    label_sources: list[Path] = field(default_factory=list)
    direct: bool = False  # direct mode: the ids are the user's, never looked at before the writer

    @property
    def offsets(self) -> np.ndarray:
        """Start of each example in the spill arrays (direct mode: encoded file + offset)."""
        if self.starts is not None:
            return self.starts
        return np.cumsum(self.lengths) - self.lengths

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    _fds: dict[Path, int] = field(default_factory=dict, repr=False)

    def read_pieces(
        self, starts: np.ndarray, lengths: np.ndarray, out: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """input_ids and labels (None: same as the ids) of the given pieces, concatenated in order.

        `out`: optional (ids, labels) int32 buffers, large enough, to read into (reused across calls
        to spare page faults on fresh memory); the results are then views of them.

        The spill files are read through memory maps, a window at a time (`_map_pieces`); the
        inputs of direct mode with one pread per piece: they are the user's files, and a file that
        shrinks while it is mapped kills the process, where a pread comes up short.
        """
        o_ids, o_lab = out if out is not None else (None, None)
        if self.direct:
            fds = [self._fd(path) for path in self.sources]
            return _pread_pieces(fds, starts, lengths, o_ids), None
        if self.sources:
            ids = _map_parts([self._fd(p) for p in self.sources], starts, lengths, o_ids)
            labels = None if not self.label_sources else _map_parts([self._fd(p) for p in self.label_sources], starts, lengths, o_lab)
            return ids, labels
        ids = _map_pieces(self._fd(self.ids_path), starts, lengths, o_ids)
        labels = None if self.labels_path is None else _map_pieces(self._fd(self.labels_path), starts, lengths, o_lab)
        return ids, labels

    def reader(self) -> Spill:
        """A copy that can read pieces but holds no per-example arrays (cheap to send to a Ray task)."""
        empty = np.zeros(0, np.int64)
        return Spill(
            self.ids_path,
            self.labels_path,
            empty,
            empty,
            sources=self.sources,
            where=self.where,
            label_sources=self.label_sources,
            direct=self.direct,
        )

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


MAP_WINDOW_BYTES = 64 << 20  # the part of a spill file mapped at once (what its reads add to RSS)


def _map_parts(fds: list[int], starts: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`_map_pieces` over several files: a start encodes its file (index << FILE_SHIFT | offset)."""
    starts = starts.astype(np.int64, copy=False)
    lengths = lengths.astype(np.int64, copy=False)
    total = int(lengths.sum())
    out = np.empty(total, dtype="<i4") if out is None else out[:total]
    dest = np.cumsum(lengths) - lengths
    which = starts >> FILE_SHIFT
    for k in np.unique(which).tolist():
        mine = which == k
        _map_pieces(fds[k], starts[mine] & _OFFSET_MASK, lengths[mine], out, dest[mine])
    return out


def _map_pieces(
    fd: int, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None, dest: np.ndarray | None = None
) -> np.ndarray:
    """Concatenate int32 ranges [start, start + length) of a file, in the order given, copied out of
    memory maps of it: the pieces sorted by start, one window of about MAP_WINDOW_BYTES mapped at a
    time and unmapped before the next, so a read costs no syscall per piece (against one pread
    each: 1-3 us, GIL held) and adds at most a window to RSS, whatever the file's size. Where the
    file cannot be mapped, it is read with one pread per piece.
    `out`: a buffer to read into (its first sum(lengths) entries are returned); `dest`: where in
    `out` each piece goes (default: one after the other).
    """
    starts = starts.astype(np.int64, copy=False)
    lengths = lengths.astype(np.int64, copy=False)
    total = int(lengths.sum())
    if out is None:
        out = np.empty(total, dtype="<i4")
    elif dest is None:
        out = out[:total]
    if dest is None:
        dest = np.cumsum(lengths) - lengths
    order = np.argsort(starts, kind="stable")
    first, n, dest = starts[order], lengths[order], dest[order]
    i = 0
    while i < len(first):
        base = int(first[i]) * 4 // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        j = int(np.searchsorted(first, (base + MAP_WINDOW_BYTES) // 4))  # the pieces that start in this window
        size = int((first[i:j] + n[i:j]).max()) * 4 - base
        if size > 0:
            try:
                window = mmap.mmap(fd, size, offset=base, access=mmap.ACCESS_READ)
            except ValueError:  # the file ends before the piece
                raise _short_read() from None
            except OSError:  # a file system that cannot map files (some FUSE mounts): piece by piece
                for a, m, d in zip(first.tolist(), n.tolist(), dest.tolist()):
                    _pread_pieces([fd], np.array([a]), np.array([m]), out[d : d + m])
                return out
            with window:
                src = np.frombuffer(window, dtype="<i4")
                _copy_pieces(src, first[i:j] - base // 4, n[i:j], dest[i:j], out)
                del src  # before the window closes
        i = j
    return out


def append_values(f: Any, values: np.ndarray, path: Path) -> None:
    """Write int32 values to the spill file. Through Python's file object, not ndarray.tofile:
    tofile reports a full disk as "N requested and M written" without an errno, which would
    escape as a traceback instead of the one-line disk-full error (`pipeline.errors.cli_errors`)."""
    try:
        f.write(np.ascontiguousarray(values, dtype="<i4").data)
    except OSError as exc:
        raise OSError(exc.errno, f"{exc.strerror or exc} (the token spill)", str(path)) from None


def _short_read() -> OSError:
    return OSError(errno.EIO, "short read from the spill file (was it changed while packing?)")


@numba.njit(cache=True, nogil=True)
def _copy_pieces(src, starts, lengths, dest, out):  # pragma: no cover - numba
    for k in range(starts.shape[0]):
        a = starts[k]
        d = dest[k]
        for t in range(lengths[k]):
            out[d + t] = src[a + t]


FILE_SHIFT = 40  # direct mode: int32 element offsets up to 2**40 (4 TiB files), file index above
_OFFSET_MASK = (1 << FILE_SHIFT) - 1


def _pread_pieces(fds: list[int], starts: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Concatenate int32 ranges [start, start + length) of a file (one pread per piece).

    With several files, a start encodes the file: fds[start >> FILE_SHIFT] at start & mask.
    `out`: a buffer to read into (its first sum(lengths) entries are returned).
    """
    total = int(lengths.sum())
    out = np.empty(total, dtype="<i4") if out is None else out[:total]
    view = memoryview(out).cast("B")
    pos = 0
    one = len(fds) == 1
    for start, n in zip(starts.tolist(), lengths.tolist()):
        nbytes = 4 * n
        fd = fds[0] if one else fds[start >> FILE_SHIFT]
        if os.preadv(fd, [view[pos : pos + nbytes]], 4 * (start & _OFFSET_MASK)) != nbytes:
            raise _short_read()
        pos += nbytes
    return out


class NotDirect(Exception):
    """The inputs cannot be gathered in place (fall back to the spill)."""


def direct_arrow_spill(
    files: list[Any], fmts: dict[str, ResolvedFormat], *, max_len: int, overlong: str, limit: int | None, progress: Any = None
) -> Spill:
    """A Spill that points into the input files: every input is an uncompressed Arrow IPC *file* of
    pre-tokenized list<int32> `input_ids` without labels, so the writer can pread each example from
    the input itself and nothing is spilled. Only the offsets buffers are read here (not through
    the memory map's data pages, which would count in RSS); the writer rejects negative ids while
    gathering (ids are not read here).

    Raises `NotDirect` when an input does not qualify (compressed, stream format, other types).
    """
    lengths: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    example_ids: list[np.ndarray] = []
    read = empty = index = 0
    per_file: list[int] = []
    for k, f in enumerate(files):
        fmt = fmts[f.path]
        if f.kind != "arrow" or fmt.kind != "tokenized" or fmt.fields.get("labels"):
            raise NotDirect
        try:
            source = pa.memory_map(f.path)
            reader = pa.ipc.open_file(source)
        except (pa.ArrowInvalid, OSError):
            raise NotDirect from None
        source.seek(0)
        base = source.read_buffer(8).address
        size = source.size()
        name = fmt.fields["input_ids"]
        if name not in reader.schema.names or reader.schema.field(name).type != pa.list_(pa.int32()):
            raise NotDirect
        file_first = index  # global index of this file's first example, for error rows
        for b in range(reader.num_record_batches):
            if limit is not None and index >= limit:
                break
            record_batch = reader.get_batch(b)
            col = record_batch.column(name)
            if limit is not None and index + len(col) > limit:
                col = col.slice(0, limit - index)
            values = col.buffers()[3]
            if values is None or not (base <= values.address and values.address + values.size <= base + size):
                raise NotDirect  # compressed or copied: the values are not where the file has them
            if (values.address - base) % 4:
                raise NotDirect
            if col.null_count:
                table = pa.Table.from_batches([record_batch]).slice(0, len(col))
                check_same_format(table, fmt, rows_where(f.path, index - file_first))
                first = int(pc.index(pc.is_null(col), True).as_py())
                raise UserError(f"{f.path} row {index - file_first + first + 1}: {name!r} is missing or null: fix the row or remove it")
            off = np.frombuffer(col.buffers()[1], dtype=np.int32, count=col.offset + len(col) + 1)[col.offset :]
            n_ex = np.diff(off).astype(np.int64)
            first_elem = (values.address - base) // 4 + col.values.offset
            keep = n_ex > 0
            if overlong == "error" and (n_ex > max_len).any():
                bad = int(np.argmax(n_ex > max_len))
                raise UserError(
                    f"{f.path} row {index - file_first + bad + 1}: example is {int(n_ex[bad])} tokens, "
                    f"longer than --max-len {max_len}: raise --max-len or use --overlong truncate|split|drop"
                )
            lengths.append(n_ex[keep])
            starts.append(((k << FILE_SHIFT) + first_elem + off[:-1].astype(np.int64))[keep])
            example_ids.append(index + np.flatnonzero(keep).astype(np.int64))
            read += len(col)
            empty += int(len(col) - keep.sum())
            index += len(col)
            if progress is not None:
                progress.update(len(col))
        if index == file_first and (limit is None or index < limit):
            raise UserError(f"{f.path} contains no records: give an input with at least one example")
        per_file.append(index - file_first)

    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return Spill(
        Path(files[0].path),
        None,
        cat(lengths),
        cat(example_ids),
        read,
        empty,
        sources=[Path(f.path) for f in files],
        starts=cat(starts),
        where=partial(where_of, files),
        file_examples=per_file + [0] * (len(files) - len(per_file)),
        direct=True,
    )
