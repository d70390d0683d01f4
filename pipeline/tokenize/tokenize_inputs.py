"""Parallel tokenization of every input, in input order, spilled to disk; only lengths stay in RAM.

Inputs are streamed as batches of rows (`pipeline.read.batches`); each batch becomes token ids, labels
and lengths (`pipeline.tokenize.batch`). With `num_proc` > 1, `num_proc` threads each take a batch:
they render and assemble it here and have its texts encoded by one of `num_proc` worker processes
(`pipeline.tokenize.encode_pool`). At most a few batches are in flight (bounded memory), and results are
consumed *in input order* (`pipeline.background.in_order`), so the spill file and hence the shards
are identical whatever `num_proc` is.

`tokenize_to_spill` writes the results to the spill (`pipeline.tokenize.spill`): two raw int32 files on disk,
only the lengths in RAM.

Each input file is rendered with its own format (`file_formats`: detected from that file's columns).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pipeline.background import done, in_order
from pipeline.errors import UserError
from pipeline.read.batches import column_names, iter_batches, where_of
from pipeline.read.formats import FormatOptions, ResolvedFormat, detect_formats, text_fields
from pipeline.read.remote import download_here, staged_inputs
from pipeline.read.sources import resolve_inputs
from pipeline.tokenize.batch import TokBatch, tokenize_batch, tokenized_batch
from pipeline.tokenize.encode_pool import encode_pool
from pipeline.tokenize.long_texts import Encode
from pipeline.tokenize.spill import NotDirect, Spill, append_values, direct_arrow_spill
from pipeline.tokenize.tokenizer import RUST_THREADS, load_tokenizer

# --------------------------------------------------------------------------------- pool plumbing

Formats = ResolvedFormat | Sequence[ResolvedFormat]  # one for every file, or one per input file


def file_formats(files: list[Any], options: FormatOptions, columns: list[list[str]] | None = None) -> list[ResolvedFormat]:
    """The resolved format of each input file, from its own columns (`formats.detect_formats`;
    `columns`: each file's, when already known)."""
    if columns is None:
        columns = [column_names([f]) for f in files]
    return detect_formats(list(zip(files, columns)), options)


def _format_map(files: list[Any], fmt: Formats) -> dict[str, ResolvedFormat]:
    """file path -> its format."""
    if isinstance(fmt, ResolvedFormat):
        return {f.path: fmt for f in files}
    if len(fmt) != len(files):
        raise ValueError(f"{len(fmt)} formats for {len(files)} input files")
    return {f.path: x for f, x in zip(files, fmt)}


def tokenize_source_batch(
    batch: Any, fmt: ResolvedFormat, tokenizer: Any, derive_labels: bool = False, encode: Encode | None = None
) -> TokBatch:
    """One batch of rows (`pipeline.read.batches.SourceBatch`) as token ids and labels, in its file's
    format; `encode`: where texts are encoded (default: here, with the tokenizer's backend)."""
    if fmt.kind == "tokenized":
        return tokenized_batch(batch.table, fmt, batch.where, derive_labels=derive_labels)
    return tokenize_batch(batch.table, fmt, tokenizer, batch.where, encode)


TEXT_BATCH_ROWS = 128  # default rows per text batch: enough batches to keep every worker busy to the end
TOKENIZED_BATCH_ROWS = 4096  # default rows per pre-tokenized batch (vectorised work: larger is cheaper)


@contextmanager
def rust_threads_off() -> Iterator[None]:
    """Turn the tokenizer's own (Rust) thread pool off in this process while it encodes batches
    itself (`num_proc` 1: one batch at a time, as the workers do). The tokenizers library reads this
    variable on every call.
    """
    old = os.environ.get(RUST_THREADS)
    os.environ[RUST_THREADS] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(RUST_THREADS, None)
        else:
            os.environ[RUST_THREADS] = old


def needs_encoder(fmt: Formats) -> bool:
    """Whether any input is text to tokenize (pre-tokenized input needs no encode workers)."""
    fmts = [fmt] if isinstance(fmt, ResolvedFormat) else list(fmt)
    return any(x.kind != "tokenized" for x in fmts)


def iter_tokenized(
    files: list[Any],
    fmt: Formats,
    tokenizer: Any,
    *,
    num_proc: int = 1,
    limit: int | None = None,
    batch_rows: int | None = None,
    derive_labels: bool = False,
) -> Iterator[tuple[Any, TokBatch]]:
    """Yield (source batch, tokenized batch) in input order.

    `fmt` is one format for all files or one per file. With `num_proc` 1 everything runs here, one
    batch at a time; with more, `num_proc` threads render and assemble text batches while
    `num_proc` worker processes encode them (`pipeline.tokenize.encode_pool`). Pre-tokenized batches are
    handled in this thread (vectorised, I/O bound); with `derive_labels`, their labels are filled in
    when the input has none (else left None). At most 2 batches per worker are in flight (bounded
    memory). `batch_rows` default: TEXT_BATCH_ROWS when any input is text, else TOKENIZED_BATCH_ROWS.
    """
    fmts = _format_map(files, fmt)
    text = needs_encoder(list(fmts.values()))
    if batch_rows is None:
        batch_rows = default_batch_rows(fmts.values())
    batches = iter_batches(files, batch_rows=batch_rows, limit=limit, exact={path: text_fields(f) for path, f in fmts.items()})
    if num_proc <= 1 or not text:
        with rust_threads_off():
            for batch in batches:
                yield batch, tokenize_source_batch(batch, fmts[batch.file], tokenizer, derive_labels)
        return
    pool = encode_pool(num_proc)
    pool.use(tokenizer.backend_tokenizer)
    executor = ThreadPoolExecutor(num_proc, thread_name_prefix="tokenize")

    def start(batch: Any) -> Future:
        f = fmts[batch.file]
        if f.kind == "tokenized":
            return done(tokenize_source_batch(batch, f, tokenizer, derive_labels))
        return executor.submit(tokenize_source_batch, batch, f, tokenizer, False, pool.encode)

    try:
        yield from in_order(batches, start, depth=2 * num_proc)
    finally:
        executor.shutdown(cancel_futures=True)


def tokenize_to_spill(
    files: list[Any],
    fmt: Formats,
    tokenizer: Any,
    spill_dir: str | os.PathLike[str],
    *,
    max_len: int,
    overlong: str = "truncate",
    num_proc: int = 1,
    limit: int | None = None,
    batch_rows: int | None = None,
    progress: Any = None,
    direct: bool = True,
) -> Spill:
    """Tokenize every example into `spill_dir`; with overlong == "error", fail on the first too-long one.

    `fmt`: one format for all files or one per file. The labels file is left out only when every
    file is pre-tokenized without labels; when they are moreover all uncompressed Arrow IPC files of
    list<int32> ids (and `direct`), nothing is spilled at all (`direct_arrow_spill`).
    """
    spill_dir = Path(spill_dir)
    spill_dir.mkdir(parents=True, exist_ok=True)
    ids_path, labels_path = spill_dir / "input_ids.bin", spill_dir / "labels.bin"
    fmts = _format_map(files, fmt)
    same_labels = ids_are_labels(fmts.values())
    in_place = try_direct(files, fmts, max_len=max_len, overlong=overlong, limit=limit, progress=progress) if direct else None
    if in_place is not None:
        return in_place
    with open(ids_path, "wb") as fi, open(labels_path, "wb") as fl:
        part = spill_part(
            iter_tokenized(files, fmt, tokenizer, num_proc=num_proc, limit=limit, batch_rows=batch_rows, derive_labels=not same_labels),
            fi,
            fl,
            ids_path,
            labels_path,
            max_len=max_len if overlong == "error" else None,
            progress=progress,
        )
    if same_labels:
        labels_path.unlink()
    return Spill(
        ids_path,
        None if same_labels else labels_path,
        part.lengths,
        part.example_ids,
        part.read,
        part.read - len(part.lengths),
        where=partial(where_of, files),
        file_examples=[part.per_file.get(f.path, 0) for f in files],
    )


def ids_are_labels(fmts: Iterable[ResolvedFormat]) -> bool:
    """Every file is pre-tokenized without labels: the labels are the ids (no labels file is spilled)."""
    return all(x.kind == "tokenized" and not x.fields.get("labels") for x in fmts)


def try_direct(
    files: list[Any], fmts: dict[str, ResolvedFormat], *, max_len: int, overlong: str, limit: int | None, progress: Any = None
) -> Spill | None:
    """Direct mode (`direct_arrow_spill`: the writer gathers from the inputs themselves, nothing is
    spilled) when every input is an uncompressed Arrow IPC file of pre-tokenized ids without labels;
    else None (the progress bar, if any, reset)."""
    if not (ids_are_labels(fmts.values()) and all(f.kind == "arrow" for f in files)):
        return None
    try:
        return direct_arrow_spill(files, fmts, max_len=max_len, overlong=overlong, limit=limit, progress=progress)
    except NotDirect:
        if progress is not None:
            progress.reset()
        return None


def default_batch_rows(fmts: Iterable[ResolvedFormat]) -> int:
    """TEXT_BATCH_ROWS when any input is text, else TOKENIZED_BATCH_ROWS."""
    return TEXT_BATCH_ROWS if needs_encoder(list(fmts)) else TOKENIZED_BATCH_ROWS


@dataclass
class Part:
    """What `spill_part` wrote: the length and example index of every non-empty example (empty ones
    write nothing), and the rows read, in all and per input file."""

    lengths: np.ndarray
    example_ids: np.ndarray
    read: int
    per_file: dict[str, int]


def spill_part(
    tokenized: Iterable[tuple[Any, TokBatch]],
    ids_file: BinaryIO,
    labels_file: BinaryIO,
    ids_path: Path,
    labels_path: Path,
    *,
    max_len: int | None = None,
    progress: Any = None,
) -> Part:
    """Append tokenized batches (`iter_tokenized`'s pairs) to open spill files, in order; with
    `max_len`, the first example longer than it is a UserError naming its row (--overlong error)."""
    lengths: list[np.ndarray] = []
    example_ids: list[np.ndarray] = []
    read = tokens = 0
    per_file: dict[str, int] = {}
    for batch, tok in tokenized:
        n = len(tok.lengths)
        keep = tok.lengths > 0
        if max_len is not None and (tok.lengths > max_len).any():
            bad = int(np.argmax(tok.lengths > max_len))
            raise UserError(
                f"{batch.where(bad)}: example is {int(tok.lengths[bad])} tokens, "
                f"longer than --max-len {max_len}: raise --max-len or use --overlong truncate|split|drop"
            )
        append_values(ids_file, tok.input_ids, ids_path)
        if tok.labels is not None:
            append_values(labels_file, tok.labels, labels_path)
        lengths.append(tok.lengths[keep])
        example_ids.append(batch.first_index + np.flatnonzero(keep).astype(np.int64))
        read += n
        per_file[batch.file] = per_file.get(batch.file, 0) + n
        tokens += len(tok.input_ids)
        if progress is not None:
            progress.set_postfix(tokens=_fmt_count(tokens), refresh=False)
            progress.update(n)
    cat = lambda parts: np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    return Part(cat(lengths), cat(example_ids), read, per_file)


def _fmt_count(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


# ----------------------------------------------------------------------------- other consumers


def _format_options(options: dict[str, Any]) -> FormatOptions:
    keys = FormatOptions.__dataclass_fields__
    return FormatOptions(**{k: options[k] for k in keys if options.get(k) is not None})


def lengths_of(inputs: list[str] | str, tokenizer: Any, **format_options: Any) -> np.ndarray:
    """Token count per non-empty example (after BOS/EOS, before any --max-len policy), in input order.

    `tokenizer` is a tokenizer object or a name/path; `format_options` are FormatOptions fields plus
    optional `num_proc`, `limit`, `batch_rows`.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(str(tokenizer))
    num_proc = int(format_options.pop("num_proc", 1) or 1)
    limit = format_options.pop("limit", None)
    batch_rows = format_options.pop("batch_rows", None)
    files = resolve_inputs([inputs] if isinstance(inputs, str) else list(inputs))
    fmt = file_formats(files, _format_options(format_options))
    parts = [
        tok.lengths[tok.lengths > 0]
        for _, tok in iter_tokenized(files, fmt, tokenizer, num_proc=num_proc, limit=limit, batch_rows=batch_rows)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def tokenize_examples(config: dict[str, Any], example_ids: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """Re-tokenize the given examples (global input indices) from a manifest's `config`.

    Returns (input_ids, labels) per requested id, in the order given, exactly as pack-data produced
    them before packing; with `overlong == "truncate"` they are clipped to `max_len`. A split example
    is returned whole (its pieces in the shards are consecutive max_len chunks, each chunk's first
    label set to -100). An empty (skipped) example comes back as two empty arrays. Remote inputs
    (URIs) are downloaded into a temporary folder first (`pipeline.read.remote`).
    """
    wanted = np.asarray(list(example_ids), dtype=np.int64)
    if len(wanted) == 0:
        return []
    with (
        tempfile.TemporaryDirectory(prefix="packlm-inputs-") as tmp,
        staged_inputs(list(config["inputs"]), Path(tmp) / "inputs", download_here) as staged,
    ):
        return _tokenize_examples(config, wanted, staged.as_given(resolve_inputs(staged.inputs)))


def _tokenize_examples(config: dict[str, Any], wanted: np.ndarray, files: list[Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    tokenizer = load_tokenizer(
        config["tokenizer"], config.get("chat_template"), config.get("add_tokens") or (), config.get("special_tokens") or {}
    )
    fmts = _format_map(files, file_formats(files, _format_options(config)))
    max_len = int(config.get("max_len") or 0)
    found: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    targets = {int(i) for i in wanted}
    stop = int(wanted.max()) + 1
    for batch in iter_batches(files, batch_rows=int(config.get("batch_rows") or TOKENIZED_BATCH_ROWS), limit=stop):
        n = batch.table.num_rows
        local = [i - batch.first_index for i in targets if batch.first_index <= i < batch.first_index + n]
        if not local:
            continue
        local.sort()
        for li in local:
            sub = batch.table.slice(li, 1)
            where = lambda i, li=li, batch=batch: batch.where(li + i)
            fmt = fmts[batch.file]
            if fmt.kind == "tokenized":
                tok = tokenized_batch(sub, fmt, where)
            else:
                tok = tokenize_batch(sub, fmt, tokenizer, where)
            ids, labels = tok.input_ids, tok.labels
            if config.get("overlong", "truncate") == "truncate" and max_len and len(ids) > max_len:
                ids, labels = ids[:max_len], labels[:max_len]
            found[batch.first_index + li] = (ids, labels)
    missing = [int(i) for i in wanted if int(i) not in found]
    if missing:
        raise UserError(
            f"example id {missing[0]} is not in the inputs {config['inputs']}: were they changed "
            "since packing? Check against the original inputs, or pack them again"
        )
    return [found[int(i)] for i in wanted]
