"""Parallel batch tokenization of rendered examples, spilled to disk; only lengths stay in RAM.

Each `SourceBatch` is rendered into segments (`pipeline.formats`); each example's segments are
joined into its whole text, the whole texts of the batch are tokenized with the fast tokenizer's
batch API (one call, or calls of bounded size with long texts cut where no id changes:
`pipeline.long_texts`), and the ids are split at the segments' cuts (`pipeline.segments.encode_segments`:
the ids are the tokenizer's ids of the text a model sees, not those of segments encoded apart). A
numba kernel then adds BOS/EOS per example and builds the labels (-100 on prompt segments and always
on an example's first token; the EOS that ends a response carries loss). Pre-tokenized input skips
the tokenizer and is reshaped with vectorised pyarrow/numpy only.

With `num_proc` > 1, `num_proc` threads each take a batch: they render and assemble it here and
have its texts encoded by one of `num_proc` worker processes (`pipeline.encode_pool`). At most a few
batches are in flight (bounded memory), and results are consumed *in input order*, so the spill file
and hence the shards are identical whatever `num_proc` is.

`tokenize_to_spill` writes the results to the spill (`pipeline.spill`): two raw int32 files on disk,
only the lengths in RAM.

Each input file is rendered with its own format (`file_formats`: detected from that file's columns).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.background import done, in_order
from pipeline.encode_pool import encode_pool
from pipeline.errors import UserError
from pipeline.formats import (
    FormatOptions,
    ResolvedFormat,
    Where,
    check_same_format,
    detect_formats,
    missing_field,
    render,
)
from pipeline.long_texts import Encode, encode_bounded
from pipeline.segments import Cuts, cached_token_sizes, encode_segments
from pipeline.shards import IGNORE_INDEX
from pipeline.sources import column_names, iter_batches, resolve_inputs, where_of
from pipeline.spill import Spill, append_values, NotDirect, direct_arrow_spill
from pipeline.tokenizer import RUST_THREADS, load_tokenizer



def encode_texts(tokenizer: Any, texts: list[str], cuts: Cuts | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize whole texts (no special tokens added) with the Rust batch API in this process ->
    flat int32 ids, int64 lengths of their segments (`encode_segments`; `EncodePool.encode` does the
    same in worker processes)."""
    backend = tokenizer.backend_tokenizer
    return encode_segments(backend, texts, cuts, cached_token_sizes(backend) if cuts is not None else None)


# ------------------------------------------------------------------------------- per-batch work


@dataclass
class TokBatch:
    """One batch tokenized: flat ids/labels of its non-empty examples and a length per example (0 = empty)."""

    input_ids: np.ndarray  # int32
    labels: np.ndarray | None  # int32; None: equal to input_ids except the (masked) first token
    lengths: np.ndarray  # int64, one per input row of the batch


@numba.njit(cache=True)
def _assemble(ids, tok_loss, ex_tok_start, ex_tok_end, ex_last_loss, empty, bos, eos):  # pragma: no cover - numba
    n = ex_tok_start.shape[0]
    lengths = np.zeros(n, dtype=np.int64)
    add_b = np.zeros(n, dtype=np.bool_)
    add_e = np.zeros(n, dtype=np.bool_)
    total = 0
    for e in range(n):
        if empty[e]:
            continue
        a = ex_tok_start[e]
        b = ex_tok_end[e]
        add_b[e] = bos >= 0 and (b == a or ids[a] != bos)
        add_e[e] = eos >= 0 and (b == a or ids[b - 1] != eos)
        lengths[e] = (b - a) + add_b[e] + add_e[e]
        total += lengths[e]
    out_ids = np.empty(total, dtype=np.int32)
    out_lab = np.empty(total, dtype=np.int32)
    k = 0
    for e in range(n):
        if empty[e]:
            continue
        start = k
        if add_b[e]:
            out_ids[k] = bos
            out_lab[k] = -100
            k += 1
        for t in range(ex_tok_start[e], ex_tok_end[e]):
            out_ids[k] = ids[t]
            out_lab[k] = ids[t] if tok_loss[t] else -100
            k += 1
        if add_e[e]:
            out_ids[k] = eos
            out_lab[k] = eos if ex_last_loss[e] else -100
            k += 1
        out_lab[start] = -100
    return out_ids, out_lab, lengths


def tokenize_batch(table: pa.Table, fmt: ResolvedFormat, tokenizer: Any, where: Where,
                   encode: Encode | None = None) -> TokBatch:
    """Render, tokenize and assemble one batch of a text / instruction / chat dataset.

    `encode` turns texts into (flat ids, lengths): `encode_texts` with this tokenizer by default, or
    a worker pool's `encode`; it is called on texts of bounded size (`long_texts.encode_bounded`:
    long texts in exact pieces; a text that cannot be cut and is too long is a UserError naming
    its row).
    """
    segs = render(table, fmt, where, tokenizer)
    n = segs.n_examples
    blank = np.fromiter((not t or t.isspace() for t in segs.texts), dtype=bool, count=len(segs.texts))
    # an example is empty when it has no segment with visible text
    has_text = np.zeros(n, dtype=bool)
    if len(segs.texts):
        np.logical_or.at(has_text, segs.example[~blank], True)
    texts = segs.texts if has_text.all() else [
        t if keep else "" for t, keep in zip(segs.texts, has_text[segs.example].tolist())
    ]
    # segments are sorted by example: example e owns segments [first[e], last[e]]
    counts = np.bincount(segs.example, minlength=n) if len(segs.example) else np.zeros(n, dtype=np.int64)
    last_seg = np.cumsum(counts) - 1
    first_seg = last_seg - counts + 1
    has_seg = counts > 0
    whole, cuts = _join_segments(texts, counts, first_seg)
    owner = np.flatnonzero(has_seg)  # the example of each whole text
    flat, seg_lens = encode_bounded(
        encode if encode is not None else partial(encode_texts, tokenizer), whole, cuts,
        lambda: tokenizer.backend_tokenizer, lambda i: where(int(owner[i])),
    )
    tok_loss = np.repeat(segs.loss, seg_lens)
    seg_end = np.cumsum(seg_lens)
    seg_start = seg_end - seg_lens
    ex_start = np.where(has_seg, seg_start[np.clip(first_seg, 0, None)] if len(seg_start) else 0, 0)
    ex_end = np.where(has_seg, seg_end[np.clip(last_seg, 0, None)] if len(seg_end) else 0, 0)
    ex_last_loss = np.where(has_seg, segs.loss[np.clip(last_seg, 0, None)] if len(segs.loss) else False, False)
    bos = tokenizer.bos_token_id
    eos = tokenizer.eos_token_id
    ids, labels, lengths = _assemble(
        flat,
        tok_loss,
        ex_start.astype(np.int64),
        ex_end.astype(np.int64),
        ex_last_loss.astype(bool),
        ~has_text,
        -1 if bos is None else int(bos),
        -1 if eos is None else int(eos),
    )
    return TokBatch(ids, labels, lengths)


def _join_segments(texts: list[str], counts: np.ndarray, first_seg: np.ndarray) -> tuple[list[str], Cuts | None]:
    """Each example's segments joined into its whole text (examples with none left out), and the
    char positions where its later segments start (None: one segment per example)."""
    if len(texts) == int((counts > 0).sum()):
        return texts, None
    chars = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    starts = np.cumsum(chars) - chars  # of each segment in the batch's segments laid end to end
    owner = np.repeat(np.arange(len(counts)), counts)
    later = np.ones(len(texts), dtype=bool)
    later[first_seg[counts > 0]] = False
    positions = (starts - starts[first_seg[owner]])[later]
    kept = counts[counts > 0]
    bounds = np.concatenate(([0], np.cumsum(kept))).tolist()
    whole = ["".join(texts[a:b]) for a, b in pairwise(bounds)]
    return whole, (kept - 1, positions)


def _int_list_column(table: pa.Table, name: str, where: Where) -> tuple[np.ndarray, np.ndarray]:
    """A list<int> column as (flat int32 values, int64 lengths); nulls and bad types are user errors."""
    if name not in table.column_names:
        raise missing_field(table, name, where)
    col = table.column(name)
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type)):
        raise UserError(f"{where(0)}: column {name!r} has type {col.type}, expected a list of token ids")
    if col.null_count:
        first = int(pc.index(pc.is_null(col), True).as_py())
        raise UserError(f"{where(first)}: {name!r} is missing or null: fix the row or remove it")
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(arr)
    if not pa.types.is_integer(values.type):
        raise UserError(f"{where(0)}: column {name!r} holds {values.type}, expected integer token ids")
    if values.null_count:
        raise UserError(f"{where(0)}: column {name!r} contains null token ids: fix the data")
    flat = values.to_numpy(zero_copy_only=False)
    if flat.dtype != np.int32:
        if len(flat) and (flat.min() < IGNORE_INDEX or flat.max() > np.iinfo(np.int32).max):
            raise UserError(f"{where(0)}: column {name!r} holds ids outside the int32 range")
        flat = flat.astype(np.int32)
    return flat, lengths


def tokenized_batch(table: pa.Table, fmt: ResolvedFormat, where: Where, *, derive_labels: bool = True) -> TokBatch:
    """Pre-tokenized rows: ids as given; labels as given or equal to the ids; first label always -100.

    Without a labels column and with `derive_labels=False`, labels are left as None (the writer
    derives them from the ids while gathering, which saves a copy and half the spill).
    """
    check_same_format(table, fmt, where)
    ids, lengths = _int_list_column(table, fmt.fields["input_ids"], where)
    if len(ids) and ids.min() < 0:
        bad = int(np.searchsorted(np.cumsum(lengths), int(np.argmax(ids < 0)), side="right"))
        raise UserError(f"{where(bad)}: input_ids contains a negative id: fix the data")
    starts = np.cumsum(lengths) - lengths
    if fmt.fields.get("labels"):
        labels, lab_lens = _int_list_column(table, fmt.fields["labels"], where)
        if not np.array_equal(lab_lens, lengths):
            bad = int(np.argmax(lab_lens != lengths))
            raise UserError(
                f"{where(bad)}: labels has {lab_lens[bad]} entries but input_ids has "
                f"{lengths[bad]}: they must be the same length"
            )
        wrong = (labels != IGNORE_INDEX) & (labels != ids)
        if wrong.any():
            bad = int(np.searchsorted(np.cumsum(lengths), int(np.argmax(wrong)), side="right"))
            raise UserError(
                f"{where(bad)}: labels must be -100 or equal to input_ids at the same "
                "position (unshifted, Hugging Face convention): fix the labels column"
            )
        labels = labels.copy() if not labels.flags.writeable else labels
    elif not derive_labels:
        return TokBatch(ids, None, lengths)
    else:
        labels = ids.copy()
    nonempty = lengths > 0
    labels[starts[nonempty]] = IGNORE_INDEX
    return TokBatch(ids, labels, lengths)


# --------------------------------------------------------------------------------- pool plumbing

Formats = ResolvedFormat | Sequence[ResolvedFormat]  # one for every file, or one per input file


def file_formats(files: list[Any], options: FormatOptions) -> list[ResolvedFormat]:
    """The resolved format of each input file, from its own columns (`formats.detect_formats`)."""
    return detect_formats([(f.path, column_names([f])) for f in files], options)


def _format_map(files: list[Any], fmt: Formats) -> dict[str, ResolvedFormat]:
    """file path -> its format."""
    if isinstance(fmt, ResolvedFormat):
        return {f.path: fmt for f in files}
    if len(fmt) != len(files):
        raise ValueError(f"{len(fmt)} formats for {len(files)} input files")
    return {f.path: x for f, x in zip(files, fmt)}


def _one(batch: Any, fmt: ResolvedFormat, tokenizer: Any, derive_labels: bool = False,
         encode: Encode | None = None) -> TokBatch:
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
    `num_proc` worker processes encode them (`pipeline.encode_pool`). Pre-tokenized batches are
    handled in this thread (vectorised, I/O bound); with `derive_labels`, their labels are filled in
    when the input has none (else left None). At most 2 batches per worker are in flight (bounded
    memory). `batch_rows` default: TEXT_BATCH_ROWS when any input is text, else TOKENIZED_BATCH_ROWS.
    """
    fmts = _format_map(files, fmt)
    text = needs_encoder(list(fmts.values()))
    if batch_rows is None:
        batch_rows = TEXT_BATCH_ROWS if text else TOKENIZED_BATCH_ROWS
    batches = iter_batches(files, batch_rows=batch_rows, limit=limit)
    if num_proc <= 1 or not text:
        with rust_threads_off():
            for batch in batches:
                yield batch, _one(batch, fmts[batch.file], tokenizer, derive_labels)
        return
    pool = encode_pool(num_proc)
    pool.use(tokenizer.backend_tokenizer)
    executor = ThreadPoolExecutor(num_proc, thread_name_prefix="tokenize")

    def start(batch: Any) -> Future:
        f = fmts[batch.file]
        if f.kind == "tokenized":
            return done(_one(batch, f, tokenizer, derive_labels))
        return executor.submit(_one, batch, f, tokenizer, False, pool.encode)

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
    same_labels = all(x.kind == "tokenized" and not x.fields.get("labels") for x in fmts.values())
    if same_labels and direct and all(f.kind == "arrow" for f in files):
        try:  # uncompressed Arrow IPC input: gather from the input itself, spill nothing
            return direct_arrow_spill(files, fmts, max_len=max_len, overlong=overlong, limit=limit,
                                      progress=progress)
        except NotDirect:
            if progress is not None:
                progress.reset()
    lengths: list[np.ndarray] = []
    example_ids: list[np.ndarray] = []
    read = empty = tokens = 0
    with open(ids_path, "wb") as fi, open(labels_path, "wb") as fl:
        for batch, tok in iter_tokenized(
            files, fmt, tokenizer, num_proc=num_proc, limit=limit, batch_rows=batch_rows,
            derive_labels=not same_labels,
        ):
            n = len(tok.lengths)
            keep = tok.lengths > 0
            if overlong == "error" and (tok.lengths > max_len).any():
                bad = int(np.argmax(tok.lengths > max_len))
                raise UserError(
                    f"{batch.where(bad)}: example is {int(tok.lengths[bad])} tokens, "
                    f"longer than --max-len {max_len}: raise --max-len or use --overlong truncate|split|drop"
                )
            append_values(fi, tok.input_ids, ids_path)
            if tok.labels is not None:
                append_values(fl, tok.labels, labels_path)
            lengths.append(tok.lengths[keep])
            example_ids.append(batch.first_index + np.flatnonzero(keep).astype(np.int64))
            read += n
            empty += int(n - keep.sum())
            tokens += len(tok.input_ids)
            if progress is not None:
                progress.set_postfix(tokens=_fmt_count(tokens), refresh=False)
                progress.update(n)
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if same_labels:
        labels_path.unlink()
    return Spill(ids_path, None if same_labels else labels_path, cat(lengths), cat(example_ids), read, empty,
                 where=partial(where_of, files))


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
    label set to -100). An empty (skipped) example comes back as two empty arrays.
    """
    wanted = np.asarray(list(example_ids), dtype=np.int64)
    if len(wanted) == 0:
        return []
    tokenizer = load_tokenizer(config["tokenizer"])
    files = resolve_inputs(list(config["inputs"]))
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
        raise UserError(f"example id {missing[0]} is not in the inputs {config['inputs']}: were they changed?")
    return [found[int(i)] for i in wanted]
