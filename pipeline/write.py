"""The pack-data job: inputs -> spill -> plan -> shards + manifest, made visible atomically.

`run_pack_data(PackConfig(...))` is what the `pack-data` command calls; tests and benchmarks call it
directly. Phases:

1. read + tokenize (`pipeline.tokenize.tokenize_to_spill`): tokens go to a spill on disk, only the
   per-example lengths stay in RAM (pre-tokenized uncompressed Arrow IPC input is not spilled: the
   writer reads each example from the input file itself);
2. overlong policy on the lengths (truncate / split / drop; `error` already failed in phase 1), which
   turns examples into *pieces* (example id, start in the spill, length);
3. plan: `pipeline.binpack.assign_bins` gives each piece its row; a stable sort by row keeps pieces
   in input order inside a row;
4. write: per shard, the pieces are read from the spill (one pread each, straight into the flat
   input_ids / labels arrays), a numba kernel builds position_ids and sets the first label of every
   piece to -100, `rows_table`; `write_shard` runs in a writer thread while the next shard is
   gathered. As soon as a shard file is written, a hasher thread computes its sha256 (several shards
   are hashed at once on machines with the cores: sha256 runs at about 1.2 GB/s a core) and a checker
   thread re-opens the file memory-mapped and runs `pipeline.verify.summarize_shard` on it (every
   per-row and per-token check of `check_shard`, one numba pass over the tokens), so what is checked
   is what is on disk, overlapped with gathering the next shard; a bad shard stops the job. Token
   ids are compared with the tokenizer's vocabulary through each shard's largest id, as soon as
   the tokenizer is known;
5. finish: the manifest, then `verify_folder(tmp, check_hashes=False, checked=...)`: the folder-level
   checks only (manifest self-consistency, files present and no strays, per-shard and total counts
   vs the manifest, example ids) from the per-shard summaries, without reading the tokens again (a
   shard whose size, mtime or inode changed since its check is checked again); then every shard's
   size must still equal what was written, and an atomic rename. `pack-verify` re-hashes and
   re-checks everything.

Unless there is chat data (its template needs the transformers tokenizer in this process), the
tokenizer is loaded by a forked process, without torch, which sends back its facts (vocabulary
size, special ids, fingerprint) and its Rust backend: so this process never imports transformers
and torch (seconds on some machines). Text waits for it during setup; pre-tokenized input needs
only the facts, and the job runs meanwhile. What the child sent is kept (`pipeline.tokenizer_cache`,
in memory and on disk), so a later job with the same tokenizer files needs no child at all. The
`pack-data` command forks that child before it imports this module (`console.pack_data_main`).

Everything is written inside a hidden temporary sibling of the output folder, removed on any
failure (including ^C), so a folder named like the output only ever appears complete.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numba
import numpy as np
from tqdm import tqdm

from pipeline import tokenizer_cache
from pipeline.background import Background
from pipeline.binpack import STRATEGIES, assign_bins, load_kernels
from pipeline.durable import fsync_path
from pipeline.encode_pool import default_workers, encode_pool
from pipeline.errors import UserError
from pipeline.formats import FORMATS, FormatOptions, ResolvedFormat
from pipeline.shards import (
    MANIFEST_NAME,
    Counts,
    Manifest,
    ShardInfo,
    file_sha256,
    pack_data_files,
    rows_table,
    shard_name,
    write_manifest,
    write_shard,
)
from pipeline.stats import DEFAULT_BATCH_SIZE, Layout, pad_to_longest
from pipeline.tokenize import (
    OVERLONG,
    BackendTokenizer,
    Spill,
    backend_source,
    file_formats,
    needs_encoder,
    tokenize_to_spill,
)
from pipeline.tokenizer_load import load_tokenizer, tokenizer_info
from pipeline.verify import (
    ShardSummary,
    first_beyond_vocab,
    manifest_vocab,
    summarize_shard,
)

SHARD_TARGET_BYTES = 128 << 20  # auto --rows-per-shard aims at shards of about this size (bounds RAM)
BYTES_PER_TOKEN = 12  # input_ids + labels + position_ids, int32 each


@dataclass(kw_only=True)
class PackConfig(FormatOptions):
    """Every option of `pack-data` (recorded verbatim as the manifest's `config`): the format
    options it inherits plus the job's own."""

    inputs: list[str]
    tokenizer: str
    max_len: int
    out: str
    strategy: str = "ffd"
    group_size: int = 32
    overlong: str = "truncate"
    num_proc: int | None = None  # tokenizer worker processes; None: every usable CPU, at most 16
    seed: int = 0
    rows_per_shard: int | None = None
    overwrite: bool = False
    limit: int | None = None
    batch_rows: int | None = None  # None: pipeline.tokenize's default for the input's format
    progress: bool = True

    def format_options(self) -> FormatOptions:
        keys = FormatOptions.__dataclass_fields__
        return FormatOptions(**{k: getattr(self, k) for k in keys})


# ------------------------------------------------------------------------------------- validation


def _validate(config: PackConfig) -> None:
    if not config.inputs:
        raise UserError("no INPUT given: pass one or more files, folders or globs")
    if config.max_len < 2:
        raise UserError(f"--max-len must be at least 2, got {config.max_len}")
    if config.strategy not in STRATEGIES:
        raise UserError(f"unknown --strategy {config.strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if config.overlong not in OVERLONG:
        raise UserError(f"unknown --overlong {config.overlong!r}: choose one of {', '.join(OVERLONG)}")
    if config.format not in FORMATS:
        raise UserError(f"unknown --format {config.format!r}: choose one of {', '.join(FORMATS)}")
    if config.num_proc is not None and config.num_proc < 1:
        raise UserError(f"--num-proc must be >= 1, got {config.num_proc}")
    if config.seed < 0:
        raise UserError(f"--seed must be >= 0, got {config.seed}")
    if config.rows_per_shard is not None and config.rows_per_shard < 1:
        raise UserError(f"--rows-per-shard must be >= 1, got {config.rows_per_shard}")
    if config.limit is not None and config.limit < 1:
        raise UserError(f"--limit must be >= 1, got {config.limit}")
    if config.batch_rows is not None and config.batch_rows < 1:
        raise UserError(f"--batch-rows must be >= 1, got {config.batch_rows}")
    if config.group_size < 1:
        raise UserError(f"--group-size must be >= 1, got {config.group_size}")
    _check_out(Path(config.out), config.overwrite)


def _absolute_if_local(path: str) -> str:
    """An existing local path (or a glob) made absolute; anything else (a Hub name) unchanged."""
    if os.path.exists(path) or any(c in path for c in "*?["):
        return os.path.abspath(path)
    return path


def _check_out(out: Path, overwrite: bool) -> None:
    """--out may be new, or, with --overwrite, an empty folder or one that holds only what
    pack-data wrote into it: nothing of the user's is ever deleted."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder: choose another --out")
    if not overwrite:
        raise UserError(f"output folder {out} already exists: pass --overwrite to replace it, or choose another --out")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    ours = pack_data_files(out)
    if ours is None:
        raise UserError(
            f"--out {out} is a non-empty folder that pack-data did not write (no pack-data {MANIFEST_NAME}); "
            "refusing to replace it even with --overwrite: choose another --out"
        )
    foreign = [name for name in entries if name not in ours]
    if foreign:
        raise UserError(
            f"--out {out} holds {foreign[0]!r}, which pack-data did not write; refusing to replace the "
            "folder even with --overwrite: move it out of the folder, or choose another --out"
        )


# ------------------------------------------------------------------------------------ overlong


@dataclass
class Pieces:
    """What gets packed: one entry per (piece of an) example, in input order."""

    example_ids: np.ndarray  # int64
    starts: np.ndarray  # int64 offset into the spill
    lengths: np.ndarray  # int64
    counts: Counts = field(default_factory=Counts)


def apply_overlong(spill: Spill, max_len: int, policy: str) -> Pieces:
    """Turn spilled examples into pieces of at most `max_len` tokens according to `policy`."""
    lengths, starts, ids = spill.lengths, spill.offsets, spill.example_ids
    over = lengths > max_len
    counts = Counts(examples_read=spill.examples_read, empty_skipped=spill.empty_skipped)
    if policy == "truncate":
        counts.truncated = int(over.sum())
        pieces = Pieces(ids, starts, np.minimum(lengths, max_len), counts)
    elif policy == "drop":
        counts.dropped = int(over.sum())
        keep = ~over
        pieces = Pieces(ids[keep], starts[keep], lengths[keep], counts)
    elif policy == "split":
        counts.split = int(over.sum())
        n_chunks = (lengths + max_len - 1) // max_len
        rep = np.repeat(np.arange(len(lengths)), n_chunks)
        first_chunk = np.cumsum(n_chunks) - n_chunks
        k = np.arange(len(rep), dtype=np.int64) - np.repeat(first_chunk, n_chunks)
        chunk_start = k * max_len
        pieces = Pieces(
            ids[rep], starts[rep] + chunk_start, np.minimum(lengths[rep] - chunk_start, max_len), counts
        )
    else:  # "error": tokenize_to_spill already raised on the first overlong example
        if over.any():
            raise UserError(f"an example is longer than --max-len {max_len}")
        pieces = Pieces(ids, starts, lengths, counts)
    counts.examples_packed = len(np.unique(pieces.example_ids)) if policy == "split" else len(pieces.example_ids)
    return pieces


# --------------------------------------------------------------------------------------- gather


@numba.njit(cache=True, nogil=True)
def _finish(ids, labels, lengths, out_pos, check_ids):  # pragma: no cover - numba
    """position_ids, first label of each piece -100, loss count; with check_ids, the index of the
    first negative id (else -1)."""
    k = 0
    loss = 0
    bad = -1
    for p in range(lengths.shape[0]):
        n = lengths[p]
        labels[k] = -100
        for t in range(n):
            out_pos[k + t] = t
            if labels[k + t] != -100:
                loss += 1
            if check_ids and bad < 0 and ids[k + t] < 0:
                bad = k + t
        k += n
    return loss, bad


def gather_rows(
    spill: Spill,
    starts: np.ndarray,
    lengths: np.ndarray,
    example_ids: np.ndarray | None = None,
    buffers: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Read pieces (in row order) from the spill into flat ids, labels, position_ids; count loss tokens.

    The first label of every piece is set to -100 (a split example's later chunks included). When
    the spill reads the input in place (direct mode: its ids were never looked at), a negative id
    is a UserError naming its example's file and row (`example_ids` of the pieces).
    `buffers`: optional (ids, labels, position_ids) int32 arrays, large enough, reused across shards;
    the results are then views of them.
    """
    ids, labels = spill.read_pieces(starts, lengths, None if buffers is None else buffers[:2])
    n = len(ids)
    if labels is None:
        labels = ids.copy() if buffers is None else buffers[1][:n]
        if buffers is not None:
            np.copyto(labels, ids)
    pos = np.empty(n, np.int32) if buffers is None else buffers[2][:n]
    lens = np.ascontiguousarray(lengths, dtype=np.int64)
    loss, bad = _finish(ids, labels, lens, pos, bool(spill.sources))
    if bad >= 0:
        piece = int(np.searchsorted(np.cumsum(lens), bad, side="right"))
        where = spill.where(int(example_ids[piece])) if example_ids is not None and spill.where else "the input"
        raise UserError(f"{where}: input_ids contains a negative id: fix the data")
    return ids, labels, pos, int(loss)


# ------------------------------------------------------------------------------------------ job


@contextmanager
def spill_closed(spill: Spill) -> Iterator[Spill]:
    """Close the spill's file descriptors however the block ends."""
    try:
        yield spill
    finally:
        spill.close()


def estimate_rows(files: list[Any], limit: int | None = None, max_scan_bytes: int = 1 << 30) -> int | None:
    """Rows in the inputs for the progress bar's ETA: file metadata (Parquet, Arrow) or a newline
    count (JSONL, CSV, under `max_scan_bytes` in all); None when it cannot be known cheaply."""
    import pyarrow.parquet as pq

    total = 0
    scanned = 0
    for f in files:
        try:
            if f.kind == "parquet":
                total += pq.ParquetFile(f.path).metadata.num_rows
            elif f.kind == "arrow":
                import pyarrow as pa

                with pa.memory_map(f.path) as source:
                    total += _ipc_rows(source)
            elif f.kind in ("jsonl", "csv") and not f.path.endswith(".gz") and scanned + f.size <= max_scan_bytes:
                scanned += f.size
                with open(f.path, "rb") as handle:
                    lines = sum(block.count(b"\n") for block in iter(lambda: handle.read(1 << 22), b""))
                total += lines - (1 if f.kind == "csv" else 0)
            else:
                return limit
        except Exception:  # noqa: BLE001 - only an estimate: the reader reports real problems
            return limit
        if limit is not None and total >= limit:
            return limit
    return total if limit is None else min(total, limit)


def _ipc_rows(source: Any) -> int:
    import pyarrow as pa

    try:
        reader = pa.ipc.open_file(source)
        return sum(reader.get_record_batch(i).num_rows for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        raise ValueError("not an IPC file") from None


HASH_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))  # shards hashed at once (hashlib frees the GIL)


def _auto_rows_per_shard(max_len: int) -> int:
    return max(1, SHARD_TARGET_BYTES // (max_len * BYTES_PER_TOKEN))


def _bar(enabled: bool, **kwargs: Any) -> tqdm:
    return tqdm(file=sys.stderr, disable=not enabled, dynamic_ncols=True, mininterval=0.5, **kwargs)


def run_pack_data(
    config: PackConfig,
    *,
    echo: Callable[[str], None] | None = None,
    stats: dict[str, Any] | None = None,
) -> Manifest:
    """Run the whole job; return the manifest of the finished output folder.

    `echo` receives the final summary lines; `stats`, when given, is filled with per-phase seconds
    and totals (for benchmarks).
    """
    from pipeline.sources import resolve_inputs
    from pipeline.verify import verify_folder

    _validate(config)
    if config.num_proc is None:
        config.num_proc = default_workers()
    if config.rows_per_shard is None:
        config.rows_per_shard = _auto_rows_per_shard(config.max_len)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    files = resolve_inputs(list(config.inputs))
    fmts = file_formats(files, config.format_options())  # each input file's own format and fields
    tokenizer, loaded, inputs_info = _start(config, files, fmts)
    times["setup"] = time.perf_counter() - t0

    out = Path(config.out)
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(parent, out.name)
    tmp = parent / f"{_tmp_prefix(out.name)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        manifest, reference, sizes, checked = _pack_into(
            tmp, config, files, fmts, tokenizer, loaded, inputs_info, times)
        t = time.perf_counter()
        # folder-level checks (manifest, files, totals, example ids) from the per-shard results of
        # the checker thread; no second pass over the tokens, no second sha256 pass over every byte
        verify_folder(tmp, check_hashes=False, checked=checked)
        check_sizes(tmp, sizes)
        times["verify"] = time.perf_counter() - t
        _commit(tmp, out, config.overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    times["total"] = time.perf_counter() - t0
    lines = summary_lines(manifest, times, stats, reference)
    if echo is not None:
        for line in lines:
            echo(line)
    if stats is not None:
        stats["times"] = times
    return manifest


def _start(config: PackConfig, files: list[Any], fmts: list[ResolvedFormat]) -> tuple[Any, tokenizer_cache.TokenizerParts, Background]:
    """What the job needs before it reads: the tokenizer, its worker processes, numba and the input
    hashing thread, ordered so that their waits overlap. Returns the tokenizer (None for
    pre-tokenized input), its `tokenizer_cache.TokenizerParts` and the inputs' fingerprints to come.

    Unless there is chat (its template needs the transformers tokenizer in this process), the
    tokenizer comes from the cache or from a child forked now that loads it and sends back its facts
    and its Rust backend as JSON. Processes are forked before this process starts threads, and
    before it imports transformers, which makes forks slow.
    """
    from pipeline.sources import input_fingerprints

    text = needs_encoder(fmts)
    chat = any(f.kind == "chat" for f in fmts)
    loaded = tokenizer_cache.TokenizerParts(config.tokenizer, forked=not chat)
    workers = config.num_proc if config.num_proc > 1 and text else 0
    pool = encode_pool(workers) if workers and chat else None
    tokenizer = None
    kernels_loaded = False
    if chat:
        tokenizer = load_tokenizer(config.tokenizer)
        loaded.set((tokenizer_info(tokenizer, config.tokenizer), None))
    elif text:
        if not loaded.done():
            load_kernels(config.strategy)  # numba's one-time setup, while the child loads the tokenizer
            kernels_loaded = True
        tokenizer = BackendTokenizer.from_parts(*loaded.result())
    if workers and pool is None:  # forked once the backend is known: they inherit it, and build it now
        pool = encode_pool(workers, tokenizer.backend_json)
    if pool is not None:
        pool.use(backend_source(tokenizer))  # (for chat, or a pool an earlier job left)
    # sha256 of every input byte (for the manifest) in the background: it overlaps everything else
    inputs_info = Background(input_fingerprints, files)
    if not kernels_loaded:  # (text: while the workers build the tokenizer)
        load_kernels(config.strategy)
    return tokenizer, loaded, inputs_info


def _pack_into(
    tmp: Path,
    config: PackConfig,
    files: list[Any],
    fmts: list[ResolvedFormat],
    tokenizer: Any,
    loaded: tokenizer_cache.TokenizerParts,
    inputs_info: Background,
    times: dict[str, float],
) -> tuple[Manifest, Layout, dict[str, int], dict[str, ShardSummary]]:
    """Write shards + manifest into `tmp`; return the manifest, the pad-to-longest reference layout,
    the bytes written per shard file and each shard's `summarize_shard` (checked as written).

    `tokenizer`: None for pre-tokenized input; `loaded`: its `tokenizer_info` (and backend JSON),
    maybe still coming.
    """
    max_len = config.max_len
    t = time.perf_counter()
    total = estimate_rows(files, config.limit) if config.progress else None
    with _bar(config.progress, desc="read+tokenize", unit="ex", total=total) as bar:
        spill = tokenize_to_spill(
            files,
            fmts,
            tokenizer,
            tmp / "_spill",
            max_len=max_len,
            overlong=config.overlong,
            num_proc=config.num_proc,
            limit=config.limit,
            batch_rows=config.batch_rows,
            progress=bar,
        )
    times["read_tokenize"] = time.perf_counter() - t
    if spill.examples_read == 0:
        raise UserError(f"the inputs {' '.join(map(str, config.inputs))} hold no rows: nothing to pack")
    if len(spill.lengths) == 0:
        raise UserError(
            f"all {spill.examples_read} examples are empty after rendering: check the field names "
            "(--text-field, --prompt-field, ...) and --format"
        )

    t = time.perf_counter()
    with _bar(config.progress, desc="plan", total=1, unit="step") as bar:
        pieces = apply_overlong(spill, max_len, config.overlong)
        if len(pieces.lengths) == 0:
            raise UserError(
                f"all {len(spill.lengths)} examples are longer than --max-len {max_len} and were dropped: "
                "raise --max-len or use --overlong truncate|split"
            )
        bins = assign_bins(pieces.lengths, max_len, config.strategy, config.seed, config.group_size)
        # what pack-report compares against: batches of 32 stored sequences in example-id order
        reference = pad_to_longest(pieces.lengths, DEFAULT_BATCH_SIZE)
        order = np.argsort(bins, kind="stable")
        n_rows = int(bins.max()) + 1
        per_row = np.bincount(bins, minlength=n_rows).astype(np.int64)
        row_pieces = np.concatenate(([0], np.cumsum(per_row)))
        p_ids = pieces.example_ids[order]
        p_starts = pieces.starts[order]
        p_lens = pieces.lengths[order]
        del bins, order
        bar.update(1)
    times["plan"] = time.perf_counter() - t

    t = time.perf_counter()
    rps = int(config.rows_per_shard or _auto_rows_per_shard(max_len))
    shards: list[ShardInfo] = []
    total_tokens = loss_tokens = 0
    written: list[Future] = []
    sizes: dict[str, int] = {}
    checked: dict[str, ShardSummary] = {}
    checks: list[tuple[str, Future]] = []
    in_vocab: list[tuple[str, ShardSummary]] = []  # checked shards whose ids await the vocabulary

    def write_one(path: Path, table: Any) -> tuple[int, Future, Future]:
        write_shard(path, table)  # looked up at call time (tests replace it)
        # hashlib and the numba checks release the GIL: hash this shard and check the file as it is
        # on disk (re-opened memory-mapped) while the next ones are gathered and written
        check = checker.submit(summarize_shard, path, max_len)
        checks.append((path.name, check))
        return os.path.getsize(path), hasher.submit(file_sha256, path), check

    # two sets of token buffers, reused: one shard is gathered into one set while the previous one,
    # whose table views the other set, is written (fresh 128 MiB arrays per shard cost page faults)
    bounds = row_pieces[np.append(np.arange(0, n_rows, rps), n_rows)]
    cap = int(np.diff(np.concatenate(([0], np.cumsum(p_lens)))[bounds]).max())
    sets = [tuple(np.empty(cap, np.int32) for _ in range(3)) for _ in range(min(2, -(-n_rows // rps)))]
    with (
        spill_closed(spill),
        _bar(config.progress, desc="write", total=n_rows, unit="row") as bar,
        ThreadPoolExecutor(HASH_THREADS) as hasher,
        ThreadPoolExecutor(1) as checker,
        ThreadPoolExecutor(1) as writer,
    ):
        for s, r0 in enumerate(range(0, n_rows, rps)):
            r1 = min(n_rows, r0 + rps)
            a, b = int(row_pieces[r0]), int(row_pieces[r1])
            lens = p_lens[a:b]
            ids, labels, pos, loss = gather_rows(spill, p_starts[a:b], lens, p_ids[a:b], sets[s % 2])
            piece_off = row_pieces[r0 : r1 + 1] - a
            tok_cum = np.concatenate(([0], np.cumsum(lens)))
            row_off = tok_cum[piece_off]
            if int(np.diff(row_off).max()) > max_len:
                raise RuntimeError("planner produced a row longer than max_len")  # a bug, not user input
            table = rows_table(ids, labels, pos, row_off, lens, p_ids[a:b], piece_off)
            name = shard_name(s)
            if written:  # the previous shard is written (in a thread) while this one was gathered;
                written[-1].result()  # at most one shard waits in RAM
            while checks and checks[0][1].done():  # a shard that failed its check stops the job now
                name_done, check = checks.pop(0)
                in_vocab.append((name_done, check.result()))
            if loaded.done():  # and so does one with an id beyond the vocabulary, once that is known
                _check_vocab(tmp, in_vocab, manifest_vocab(loaded.result()[0]), spill)
                in_vocab.clear()
            written.append(writer.submit(write_one, tmp / name, table))
            del table, ids, labels, pos
            shards.append(ShardInfo(file=name, rows=r1 - r0, tokens=int(row_off[-1]), sha256=""))
            total_tokens += int(row_off[-1])
            loss_tokens += loss
            bar.update(r1 - r0)
        for info, done in zip(shards, written):
            size, digest, check = done.result()
            sizes[info.file] = size
            checked[info.file] = check.result()
            info.sha256 = digest.result()
    t_wait = time.perf_counter()  # pre-tokenized input: the forked tokenizer load may still run
    with _bar(config.progress and not loaded.done(), desc="load tokenizer", total=1, unit="step") as bar:
        tok_info = loaded.result()[0]
        bar.update(1)
    wait = time.perf_counter() - t_wait
    _check_vocab(tmp, checked.items(), manifest_vocab(tok_info), spill)
    if loss_tokens == 0:
        raise UserError(
            "no packed example has a token that carries a loss (e.g. chat rows without an assistant "
            "turn, or responses all cut off by --max-len): there is nothing to train on; check the "
            "data and its format options (pack-report --input shows what the format resolves to)"
        )
    pieces.counts.no_loss = sum(summary.no_loss for summary in checked.values())
    dicts = [f.to_dict() for f in fmts]
    tok_info = {**tok_info, "format": dicts[0] if all(d == dicts[0] for d in dicts) else {"kind": "mixed"}}
    shutil.rmtree(tmp / "_spill", ignore_errors=True)
    config_dict = asdict(config)
    # local paths absolute, so `pack-verify --deep` can re-read the inputs from any folder
    config_dict["inputs"] = [_absolute_if_local(p) for p in config.inputs]
    config_dict["tokenizer"] = _absolute_if_local(config.tokenizer)
    # what --format auto (or the field options) resolved to, per input file
    config_dict["resolved_formats"] = [{"file": f.path, **x.to_dict()} for f, x in zip(files, fmts)]
    manifest = Manifest(
        max_len=max_len,
        strategy=config.strategy,
        seed=config.seed,
        rows=n_rows,
        total_tokens=total_tokens,
        loss_tokens=loss_tokens,
        efficiency=round(total_tokens / (n_rows * max_len), 6),
        counts=pieces.counts,
        shards=shards,
        tokenizer=tok_info,
        inputs=inputs_info.result(),
        config=config_dict,
    )
    write_manifest(tmp, manifest)
    times["write"] = time.perf_counter() - t - wait
    if tokenizer is None:
        times["tokenizer"] = wait
    return manifest, reference, sizes, checked


def check_sizes(folder: Path, sizes: dict[str, int]) -> None:
    """Cheap integrity check before the rename: each shard file still has the size it was written with."""
    for name, size in sizes.items():
        now = os.path.getsize(folder / name)
        if now != size:
            raise UserError(
                f"{folder / name}: shard is {now} bytes but {size} were written (changed on disk while "
                "packing?): re-run pack-data"
            )


def _tmp_prefix(name: str) -> str:
    """Temporary folders of output `name` are `.NAME.tmp-HOST-PID-RANDOM`, beside it."""
    return f".{name}.tmp-{socket.gethostname()}-"


def remove_stale_tmp(parent: Path, name: str) -> None:
    """Remove the temporary folders of output `name` in `parent` that runs on this host left when
    they were killed outright (SIGKILL, power loss): those whose process no longer exists. A folder
    of another host, or of a process that still exists, is left alone."""
    prefix = _tmp_prefix(name)
    for path in parent.iterdir():
        pid = path.name[len(prefix):].split("-", 1)[0] if path.name.startswith(prefix) else ""
        if pid.isdigit() and not _process_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _commit(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished temporary folder to `out` (replacing an old output when allowed).
    Its files were fsynced as they were written; its entries are fsynced here, before the rename,
    and the parent's after it (`pipeline.durable`)."""
    fsync_path(tmp)
    if out.exists():
        _check_out(out, overwrite)  # it may have appeared while we worked
        old = out.absolute().parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        try:
            os.rename(tmp, out)
        except OSError as exc:  # --out appeared (non-empty) after the check at the start
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise UserError(
                f"output folder {out} appeared while packing: pass --overwrite to replace it, or "
                "choose another --out"
            ) from None
    fsync_path(out.absolute().parent)


def _check_vocab(folder: Path, summaries: Iterable[tuple[str, ShardSummary]], vocab: int | None,
                 spill: Spill) -> None:
    """Every token id below the tokenizer's vocabulary size, else a UserError naming the input
    example of the first one beyond it."""
    for name, summary in summaries:
        if vocab is not None and summary.max_id >= vocab:
            example, value = first_beyond_vocab(folder / name, vocab)
            where = spill.where(example) if spill.where else f"example {example} of the input"
            raise UserError(
                f"{where}: token id {value} is outside the tokenizer's vocabulary ({vocab} ids): "
                "was this data tokenized with another tokenizer?"
            )


def summary_lines(
    manifest: Manifest,
    times: dict[str, float],
    stats: dict[str, Any] | None = None,
    reference: Layout | None = None,
) -> list[str]:
    """Human summary: counts, rows, efficiency, padding against pad-to-longest, time per phase.

    `reference` is `pipeline.stats.pad_to_longest` of the stored sequences (batches of 32 in
    example-id order), the same baseline and figure as `pack-report`'s "padding tokens avoided".
    """
    c = manifest.counts
    pad_packed = manifest.rows * manifest.max_len - manifest.total_tokens
    tok_s = manifest.total_tokens / times["total"] if times.get("total") else 0.0
    phases = ", ".join(f"{k.replace('_', '+')} {v:.2f}s" for k, v in times.items() if not k.startswith("_"))
    lines = [
        (f"examples: {c.examples_read} read, {c.examples_packed} packed, {c.empty_skipped} empty skipped, "
         f"{c.truncated} truncated, {c.split} split, {c.dropped} dropped"),
        (f"rows: {manifest.rows} in {len(manifest.shards)} shard(s), {manifest.total_tokens} tokens "
         f"({manifest.loss_tokens} with loss), efficiency {manifest.efficiency:.2%} of {manifest.rows} x {manifest.max_len}"),
    ]
    if c.no_loss:
        lines.append(f"warning: {c.no_loss} packed example(s) have no token that carries a loss (e.g. chat "
                     "rows without an assistant turn): they take room but train nothing")
    if reference is not None:
        avoided = reference.padding - pad_packed
        verdict = f"{avoided:,} avoided" if avoided >= 0 else f"{-avoided:,} more than pad-to-longest"
        lines.append(
            f"padding: pad-to-longest batches of {DEFAULT_BATCH_SIZE} (example order) {reference.padding:,} "
            f"tokens (efficiency {reference.efficiency:.2%}); this packing {pad_packed:,} "
            f"(efficiency {manifest.efficiency:.2%}): {verdict}"
        )
        if stats is not None:
            stats.update(pad_longest=reference.padding, pad_packed=pad_packed, padding_avoided=avoided)
    if stats is not None:
        stats.update(tokens=manifest.total_tokens, rows=manifest.rows, pieces=reference.rows if reference else None)
    lines.append(f"time: {phases} ({tok_s / 1e6:.2f}M tokens/s)")
    return lines
