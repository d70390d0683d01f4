"""pack-data on a Ray cluster (`--engine ray`): the same job, its two heavy phases spread over
Ray tasks, the output byte-identical to the local engine's.

    chunks -> tokenize tasks (one spill part each) -> plan on the driver -> one write task per shard
    -> manifest, verify, commit on the driver

- read + tokenize: the inputs are cut into chunks (`pipeline.read.chunks.plan_chunks`: byte ranges of
  JSON Lines, runs of Parquet row groups or Arrow record batches, other inputs whole); a task
  tokenizes its chunk into `_spill/part-NNNNNN.ids` (and `.labels`) in the job's temporary folder
  and returns the length of every example. The driver numbers the examples across chunks in input
  order and builds one `Spill` over all parts (parts mode), so the planner sees exactly what the
  local engine's single spill gives it.
- write: one task per shard gathers its rows' pieces from the parts (`pipeline.write.shard_writer.shard_table`,
  the local engine's code), writes the shard, hashes it and checks it as it is on disk.
- the sha256 of every input byte is computed by one task per input file, meanwhile.

Every task is a pure function of its inputs that writes only its own file, so a task whose worker
dies is simply run again by Ray (`max_retries`) and the output is unchanged. The job's temporary
folder (beside `--out`) and the inputs must be visible at the same path on every node:
`check_shared` proves it before any work, with one line naming the node that cannot see them.

Example (a local Ray with 4 CPUs, started and stopped by the job):

    pack-data data/sample/instructions.jsonl --tokenizer data/tokenizer --max-len 2048 \\
        --out out/sample --engine ray --num-proc 4
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.engines.ray_reaper import reaped_ray
from pipeline.errors import UserError, one_line
from pipeline.plan.rows import RowPlan
from pipeline.progress import bar
from pipeline.read.batches import column_names, where_of
from pipeline.read.chunks import Chunk, chunk_batches, plan_chunks
from pipeline.read.formats import ResolvedFormat, text_fields
from pipeline.read.remote import download_file
from pipeline.read.sources import InputFile, input_fingerprints
from pipeline.shards import ShardInfo, file_sha256, shard_name, summarize_shard, write_shard
from pipeline.tokenize.spill import FILE_SHIFT, Spill
from pipeline.tokenize.tokenize_inputs import (
    Part,
    default_batch_rows,
    ids_are_labels,
    rust_threads_off,
    spill_part,
    tokenize_source_batch,
    try_direct,
)
from pipeline.tokenize.tokenizer import BackendOnly, load_tokenizer
from pipeline.write.shard_writer import Written, check_vocab, shard_table

CHUNK_BYTES = 64 << 20  # input bytes per tokenize task, at most, by default (--chunk-bytes)
MIN_CHUNK_BYTES = 1 << 20
CHUNKS_PER_CPU = 4  # default chunking: enough chunks that every CPU of the cluster stays busy to the end
RETRIES = 3  # times Ray runs a task again whose worker died


# ------------------------------------------------------------------------------------ the session


@contextmanager
def ray_session(address: str | None, num_cpus: int) -> Iterator[None]:
    """Connect to the Ray cluster at `address` (else $RAY_ADDRESS; "auto": the one running on this
    machine) or, with neither, start a local Ray of `num_cpus` CPUs for the job and stop it after
    (even when a cluster runs on this machine: use it with "auto"). Inside a process where Ray is
    already initialised, that Ray is used and left running."""
    try:
        import ray
    except ImportError:
        raise UserError("--engine ray needs Ray: pip install 'packlm[ray]'") from None
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address and address != "auto" and not address.startswith("ray://"):
        _check_reachable(address)
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")  # task errors are reported here, once
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")  # no C++ stack dump for a SIGTERM
    started = not ray.is_initialized()
    with ExitStack() as stack:
        if started:
            mark = stack.enter_context(reaped_ray()) if not address else {}  # a local Ray: stopped even after kill -9
            _init(ray, address, num_cpus, mark)
        try:
            yield
        finally:
            if started:
                ray.shutdown()


def _init(ray: Any, address: str | None, num_cpus: int, mark: dict[str, str]) -> None:
    """ray.init with the processes it starts carrying `mark` in their environment, and this
    process's SIGTERM handler kept (ray.init installs one that exits with status 15 mid-job, where
    `cli_errors`' handler unwinds the job and exits 143 with one line)."""
    in_main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if in_main else None
    os.environ.update(mark)
    try:
        ray.init(
            address=address or "local",
            num_cpus=None if address else num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UserError(
            f"cannot connect to the Ray cluster at {address or 'this machine'}: {one_line(exc)}: "
            "check --ray-address / RAY_ADDRESS (host:port of the head node, or 'auto')"
        ) from None
    finally:
        for key in mark:
            os.environ.pop(key, None)
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """A TCP connect to the head's address, so that a wrong one fails in seconds and in one line."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or address, int(port or 6379)), timeout=timeout).close()
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(exc)
        raise UserError(
            f"cannot reach the Ray cluster at {address} ({reason}): check --ray-address / "
            "RAY_ADDRESS (host:port of the head node's GCS, e.g. 10.0.0.1:6379)"
        ) from None


def _remote(fn: Callable[..., Any], **options: Any) -> Any:
    import ray

    return ray.remote(max_retries=RETRIES, retry_exceptions=False, **options)(fn)


def _get(refs: list[Any], progress: Any = None) -> list[Any]:
    """Results of tasks in the order given, as they finish (progress counts them); a task's
    UserError or OSError is raised here as itself (one line), and the other tasks are cancelled."""
    import ray

    index = {ref: k for k, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            results[index[ready[0]]] = ray.get(ready[0])
            if progress is not None:
                progress.update(1)
    except ray.exceptions.RayTaskError as exc:
        _cancel(pending)
        cause = exc.cause
        if isinstance(cause, (UserError, OSError)):
            raise cause from None
        raise
    except ray.exceptions.RayError as exc:  # a worker or node lost more often than Ray retries, ...
        _cancel(pending)
        raise UserError(
            f"a Ray task failed and was not retried again ({type(exc).__name__}: {one_line(exc)}); "
            "check the cluster's nodes and memory (ray status) and re-run"
        ) from None
    except BaseException:
        _cancel(pending)
        raise
    return results


def _cancel(refs: list[Any]) -> None:
    import ray

    for ref in refs:
        ray.cancel(ref, force=True)


# ------------------------------------------------------------------------------------ shared storage


def check_shared(folder: Path, inputs: list[str]) -> None:
    """Prove that every alive Ray node sees `folder` (where the job's temporary folder and --out
    go) and the inputs at the same paths: a task pinned to each node reads a probe file written
    here (and removed)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = uuid.uuid4().hex
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".packlm-probe-{token}"
    probe.write_text(token)
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        look = _remote(_sees, num_cpus=0)
        refs = [
            look.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                str(probe), token, [os.path.abspath(p) for p in inputs]
            )
            for n in nodes
        ]
        for node, missing in zip(nodes, ray.get(refs)):
            if missing:
                raise UserError(
                    f"Ray node {node.get('NodeManagerAddress', '?')} cannot see {missing}: --out's folder and the "
                    "inputs must be on storage every node mounts at the same path (NFS or a cluster file system)"
                )
    finally:
        probe.unlink(missing_ok=True)


def _sees(probe: str, token: str, inputs: list[str]) -> str | None:
    """On one node: the first of the probe (with its content) and the inputs that it cannot see."""
    try:
        if Path(probe).read_text() != token:
            return str(Path(probe).parent)
    except OSError:
        return str(Path(probe).parent)
    return next((p for p in inputs if not os.path.exists(p)), None)


# ------------------------------------------------------------------------------------ read + tokenize


def download_on_ray(pairs: list[tuple[str, str]]) -> None:
    """`remote.download_file` for every (uri, local path), one task each."""
    task = _remote(download_file)
    _get([task.remote(uri, local) for uri, local in pairs])


def columns_on_ray(files: list[InputFile]) -> list[list[str]]:
    """Every input file's fields (`column_names`, which may read a whole JSON file), one task each."""
    task = _remote(_columns)
    return _get([task.remote(f) for f in files])


def _columns(f: InputFile) -> list[str]:
    return column_names([f])


def fingerprints_on_ray(files: list[InputFile]) -> list[dict]:
    """`input_fingerprints`, one task per input file."""
    task = _remote(_fingerprint)
    return _get([task.remote(f) for f in files])


def _fingerprint(f: InputFile) -> dict:
    return input_fingerprints([f])[0]


def tokenize_on_ray(
    files: list[InputFile],
    fmts: list[ResolvedFormat],
    tokenizer: Any,
    name: tuple[str, str | None],
    spill_dir: Path,
    *,
    max_len: int,
    overlong: str,
    limit: int | None,
    batch_rows: int | None,
    chunk_bytes: int | None,
    progress: bool,
) -> Spill:
    """The local engine's `tokenize_to_spill`, one Ray task per chunk: the same Spill (lengths,
    example ids, counts) over one spill part per chunk, or direct mode for uncompressed Arrow IPC
    pre-tokenized input (nothing to tokenize: the write tasks read the inputs in place).
    `tokenizer`: the loaded tokenizer; the tasks get its backend alone (`BackendOnly`), or, for chat
    data, load it themselves by `name`: (its folder, on storage every node sees; the --chat-template
    text or None)."""
    fmt_of = {f.path: x for f, x in zip(files, fmts)}
    same_labels = ids_are_labels(fmts)
    in_place = try_direct(files, fmt_of, max_len=max_len, overlong=overlong, limit=limit)
    if in_place is not None:
        return in_place
    import ray

    batch_rows = batch_rows or default_batch_rows(fmts)
    chunks = plan_chunks(files, chunk_bytes or default_chunk_bytes(sum(f.size for f in files)))
    spill_dir.mkdir()
    task = _remote(_tokenize_chunk)
    spec = ray.put(name if any(x.kind == "chat" for x in fmts) else BackendOnly.of(tokenizer))
    refs = [
        task.remote(files[c.file], fmt_of[files[c.file].path], spec, c, str(spill_dir / f"part-{k:06d}"), batch_rows, not same_labels)
        for k, c in enumerate(chunks)
    ]
    with bar(progress, desc="read+tokenize", unit="chunk", total=len(chunks)) as progress_bar:
        parts: list[Part] = _get(refs, progress_bar)
    return _joined_spill(files, chunks, parts, spill_dir, same_labels=same_labels, max_len=max_len, overlong=overlong, limit=limit)


def default_chunk_bytes(input_bytes: int) -> int:
    """CHUNKS_PER_CPU chunks per CPU of the cluster, each between MIN_CHUNK_BYTES and CHUNK_BYTES."""
    import ray

    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    return int(np.clip(input_bytes // (CHUNKS_PER_CPU * cpus), MIN_CHUNK_BYTES, CHUNK_BYTES))


_TOKENIZERS: dict[str, Any] = {}  # per worker process: built once, used by every task it runs


def _tokenize_chunk(
    f: InputFile,
    fmt: ResolvedFormat,
    tokenizer: tuple[str, str | None] | BackendOnly,
    chunk: Chunk,
    part: str,
    batch_rows: int,
    derive_labels: bool,
) -> Part:
    """One chunk into spill part `part` (.ids and .labels). A JSON Lines chunk past its file's start
    is read without its line numbers (counting them reads the file up to there) and, only if it
    fails, read again with them, so the error names the right line."""
    key = repr(tokenizer) if isinstance(tokenizer, tuple) else tokenizer.key
    if fmt.kind != "tokenized" and key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(*tokenizer) if isinstance(tokenizer, tuple) else tokenizer
    tok = _TOKENIZERS.get(key)

    def run(lines_known: bool) -> Part:
        ids_path, labels_path = Path(part + ".ids"), Path(part + ".labels")
        batches = chunk_batches(f, chunk, batch_rows=batch_rows, lines_known=lines_known, exact=text_fields(fmt))
        with rust_threads_off(), open(ids_path, "wb") as fi, open(labels_path, "wb") as fl:
            tokenized = ((b, tokenize_source_batch(b, fmt, tok, derive_labels)) for b in batches)
            return spill_part(tokenized, fi, fl, ids_path, labels_path)

    try:
        return run(lines_known=chunk.start == 0)
    except UserError:
        if f.kind != "jsonl" or chunk.start == 0:
            raise
        for suffix in (".ids", ".labels"):
            Path(part + suffix).unlink(missing_ok=True)
        return run(lines_known=True)  # raises the same error, at the right line


def _joined_spill(
    files: list[InputFile],
    chunks: list[Chunk],
    parts: list[Part],
    spill_dir: Path,
    *,
    same_labels: bool,
    max_len: int,
    overlong: str,
    limit: int | None,
) -> Spill:
    """One Spill over the parts: examples numbered across chunks in input order, `--limit` applied
    (every chunk was read: the rows of a JSON Lines chunk are known only once it is read), and
    `--overlong error` raised for the first example too long (as the local engine does)."""
    firsts = np.cumsum([0] + [p.read for p in parts])  # global index of each chunk's first row
    lengths, example_ids, starts = [], [], []
    per_file = [0] * len(files)
    for k, (c, p) in enumerate(zip(chunks, parts)):
        keep = np.ones(len(p.lengths), bool) if limit is None else p.example_ids + firsts[k] < limit
        lengths.append(p.lengths[keep])
        example_ids.append(p.example_ids[keep] + firsts[k])
        offsets = np.cumsum(p.lengths) - p.lengths  # within the part file (empty examples write nothing)
        starts.append((np.int64(k) << FILE_SHIFT) + offsets[keep])
        per_file[c.file] += p.read if limit is None else int(np.clip(limit - firsts[k], 0, p.read))
    read = sum(per_file)
    # a file with no records is an error, as when it is read locally (unless --limit stopped before it)
    file_rows = np.bincount([c.file for c in chunks], weights=[p.read for p in parts], minlength=len(files))
    first_chunk = {c.file: k for k, c in reversed(list(enumerate(chunks)))}
    for k, f in enumerate(files):
        if file_rows[k] == 0 and (limit is None or firsts[first_chunk[k]] < limit):
            raise UserError(f"{f.path} contains no records: give an input with at least one example")
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)
    spill = Spill(
        spill_dir / "part-000000.ids",
        None if same_labels else spill_dir / "part-000000.labels",
        cat(lengths),
        cat(example_ids),
        read,
        read - sum(map(len, lengths)),
        starts=cat(starts),
        where=partial(where_of, files),
        file_examples=per_file,
        sources=[spill_dir / f"part-{k:06d}.ids" for k in range(len(parts))],
        label_sources=[] if same_labels else [spill_dir / f"part-{k:06d}.labels" for k in range(len(parts))],
    )
    if overlong == "error" and (spill.lengths > max_len).any():
        bad = int(np.argmax(spill.lengths > max_len))
        raise UserError(
            f"{spill.where(int(spill.example_ids[bad]))}: example is {int(spill.lengths[bad])} tokens, longer "
            f"than --max-len {max_len}: raise --max-len or use --overlong truncate|split|drop"
        )
    return spill


# ------------------------------------------------------------------------------------ write


def write_on_ray(
    folder: Path, spill: Spill, plan: RowPlan, *, max_len: int, rows_per_shard: int, vocab: int | None, progress: bool
) -> Written:
    """The local engine's `write_shards`, one Ray task per shard (each task gathers, writes,
    hashes and checks its shard); the same files and `Written`."""
    import ray

    reader = ray.put(spill.reader())
    task = _remote(_write_shard)
    bounds = list(range(0, plan.n_rows, rows_per_shard))
    refs = [
        task.remote(reader, plan.rows(r0, min(plan.n_rows, r0 + rows_per_shard)), str(folder / shard_name(s)), max_len)
        for s, r0 in enumerate(bounds)
    ]
    with bar(progress, desc="write", unit="shard", total=len(refs)) as progress_bar:
        results = _get(refs, progress_bar)
    out = Written()
    for s, (r0, (tokens, loss, size, digest, summary)) in enumerate(zip(bounds, results)):
        name = shard_name(s)
        out.shards.append(ShardInfo(file=name, rows=min(plan.n_rows, r0 + rows_per_shard) - r0, tokens=tokens, sha256=digest))
        out.total_tokens += tokens
        out.loss_tokens += loss
        out.sizes[name] = size
        out.checked[name] = summary
    check_vocab(folder, out.checked.items(), vocab, spill)
    return out


def _write_shard(spill: Spill, rows: RowPlan, path: str, max_len: int) -> tuple[int, int, int, str, Any]:
    """One shard: (tokens, loss tokens, bytes, sha256, `summarize_shard` of the file on disk)."""
    table, tokens, loss = shard_table(spill, rows, max_len)
    write_shard(path, table)
    del table
    try:
        return tokens, loss, os.path.getsize(path), file_sha256(path), summarize_shard(Path(path), max_len)
    finally:
        spill.close()
