"""Inputs and `--out` on remote storage: any URI that `pyarrow.fs` opens (`s3://bucket/key`,
`gs://bucket/key`, `hdfs://...`, `file:///path`). Credentials and endpoints come from the usual
environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS, ...).

- Remote inputs (a file, a folder-like prefix, or a glob in the last parts of the key) are
  downloaded into a hidden folder beside the job's local output folder, one task per file
  (`download` is the engine's: threads here, Ray tasks on a cluster), read from there like local
  files, and removed when the job ends. Error messages and the manifest name them by their URIs.
- A remote `--out` is written locally and uploaded when finished (`pipeline.write.remote_out`, over
  the storage access of this module).
- `pack-verify` and `pack-report` read a packed folder at a URI from a local copy (`folder_to_read`).

Every call to the storage is bounded in time and can be stopped: it runs in a daemon thread that
the job waits for (so SIGTERM and Ctrl-C stop the job at once, whatever the storage client is
doing); a call that lists, stats or deletes gets `PACKLM_REMOTE_TIMEOUT` seconds (default 60) before
it is a one-line error naming the URI; S3 requests time out and retry a bounded number of times,
GCS retries for a bounded time, so a transfer from storage that stops answering ends too.

Example: `pack-data 's3://corpus/2026/*.jsonl' --tokenizer tok --max-len 8192 --out s3://packed/run1`
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from pipeline import splits
from pipeline.errors import UserError, leave_behind, one_line

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_GLOB = re.compile(r"[*?\[]")
DOWNLOAD_THREADS = 8
CONNECT_TIMEOUT_S = 10.0  # S3: seconds to connect
REQUEST_TIMEOUT_S = 60.0  # S3: seconds a request may go without an answer
S3_ATTEMPTS = 3  # S3: tries of a failing request
GCS_RETRY_S = 30  # GCS: seconds the client keeps retrying a failing request
T = TypeVar("T")


def remote_timeout() -> float:
    """Seconds a listing, stat or delete on remote storage may take: $PACKLM_REMOTE_TIMEOUT, else 60."""
    text = os.environ.get("PACKLM_REMOTE_TIMEOUT", "60")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise UserError(f"PACKLM_REMOTE_TIMEOUT={text!r}: give a number of seconds above 0")
    return value


def bounded(what: str, fn: Callable[[], T], limit: float | None) -> T:
    """fn() run in a daemon thread, waited for at most `limit` seconds (None: as long as it takes).
    The wait, unlike a call into the storage client's C++ code, is interrupted by SIGTERM and
    Ctrl-C; a call that outlives the job is abandoned with its thread. `what` starts the error."""
    box: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box.append((False, exc))
        finally:
            done.set()

    thread = threading.Thread(target=run, name="packlm-remote", daemon=True)
    thread.start()
    try:
        answered = done.wait(limit)
    except BaseException:  # SIGTERM, Ctrl-C: the call is left running
        leave_behind(thread)
        raise
    if not answered:
        leave_behind(thread)
        raise UserError(
            f"{what}: the storage did not answer in {limit:g} s: check the endpoint "
            "(e.g. AWS_ENDPOINT_URL), the network and the credentials (set PACKLM_REMOTE_TIMEOUT "
            "to wait longer)"
        )
    ok, value = box[0]
    if ok:
        return value
    raise value


def is_uri(text: str) -> bool:
    """Whether `text` is a URI (scheme://...) rather than a local path or a Hub name (hf://datasets/...
    names files of a Hub dataset: `pipeline.read.sources`)."""
    return bool(_URI.match(str(text))) and not str(text).startswith("hf://")


def open_fs(uri: str) -> tuple[Any, str]:
    """(pyarrow FileSystem, path inside it) of a URI, with bounded timeouts and retries (S3, GCS);
    a one-line UserError when it cannot be opened."""
    import pyarrow.fs as pafs

    try:
        fs, path = bounded(f"cannot open {uri}", lambda: pafs.FileSystem.from_uri(uri), remote_timeout())
        return _with_timeouts(fs), path
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... per scheme
        raise UserError(
            f"cannot open {uri}: {one_line(exc)}: check the URI (s3://, gs://, hdfs://, file://) "
            "and the storage's credentials in the environment"
        ) from None


def _with_timeouts(fs: Any) -> Any:
    """The same file system with the client's waits bounded: S3 connect and request timeouts and a
    few attempts (the SDK's defaults retry a silent endpoint for minutes), GCS a retry time limit."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.S3FileSystem):
        options = dict(fs.__reduce__()[1][0])
        if options.get("connect_timeout", -1) < 0:
            options["connect_timeout"] = CONNECT_TIMEOUT_S
        if options.get("request_timeout", -1) < 0:
            options["request_timeout"] = REQUEST_TIMEOUT_S
        return pafs.S3FileSystem(**options, retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=S3_ATTEMPTS))
    gcs = getattr(pafs, "GcsFileSystem", None)
    if gcs is not None and isinstance(fs, gcs):
        options = dict(fs.__reduce__()[1][0])
        if options.get("retry_time_limit") is None:
            options["retry_time_limit"] = timedelta(seconds=GCS_RETRY_S)
        return gcs(**options)
    return fs


def files_under(fs: Any, path: str, uri: str) -> list[tuple[str, int]]:
    """(path, size) of every file under a folder-like path, sorted."""
    import pyarrow.fs as pafs

    try:
        infos = bounded(f"cannot list {uri}", lambda: fs.get_file_info(pafs.FileSelector(path, recursive=True)), remote_timeout())
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"cannot list {uri}: {one_line(exc)}: check the URI and the credentials") from None
    return sorted((i.path, i.size) for i in infos if i.type == pafs.FileType.File)


def list_input(uri: str) -> tuple[str, list[tuple[str, int]]]:
    """The files of a remote input: (the path its files are relative to, [(path, size)]) for a
    file, a folder-like prefix (every file under it) or a glob (matched against whole paths)."""
    import pyarrow.fs as pafs

    if _GLOB.search(uri.split("://", 1)[1]):
        head, _, _ = _GLOB.split(uri, 1)[0].rpartition("/")
        fs, base = open_fs(head)
        pattern = base.rstrip("/") + "/" + uri[len(head) + 1 :]
        found = [(p, n) for p, n in files_under(fs, base, uri) if fnmatch.fnmatchcase(p, pattern)]
        if not found:
            raise UserError(f"no files match {uri!r}: check the pattern")
        return base, found
    fs, path = open_fs(uri)
    info = file_info(fs, path, f"cannot read {uri}")
    if info.type == pafs.FileType.File:
        return path.rpartition("/")[0], [(path, info.size)]
    found = files_under(fs, path, uri) if info.type == pafs.FileType.Directory else []
    if found:  # a folder, or an object-store prefix with objects under it
        return path, found
    raise UserError(f"input not found: {uri}: check the bucket and key")


def file_info(fs: Any, path: str, what: str) -> Any:
    """fs.get_file_info(path), bounded; a failure is a UserError starting with `what`."""
    try:
        return bounded(what, lambda: fs.get_file_info(path), remote_timeout())
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"{what}: {one_line(exc)}: check the URI and the credentials") from None


def download_file(uri: str, local: str) -> None:
    """Copy one remote file to a local path (its folder must exist)."""
    import pyarrow.fs as pafs

    fs, path = open_fs(uri)
    try:
        bounded(
            f"cannot download {uri}",
            lambda: pafs.copy_files(path, local, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem(), use_threads=False),
            None,
        )
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"cannot download {uri}: {one_line(exc)}: check the URI, the credentials and the free space of --tmp-dir") from None


def download_here(pairs: list[tuple[str, str]]) -> None:
    """Download (uri, local path) pairs with a few daemon threads in this process (not a thread
    pool, which the interpreter waits for at exit: a download stuck in the storage client must not
    keep a stopped job alive); the first failure is raised."""
    todo = list(reversed(pairs))
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not todo or errors:
                    return
                pair = todo.pop()
            try:
                download_file(*pair)
            except BaseException as exc:  # noqa: BLE001 - raised in the waiting thread
                with lock:
                    errors.append(exc)

    threads = [threading.Thread(target=work, name="packlm-download", daemon=True) for _ in range(min(DOWNLOAD_THREADS, len(pairs)))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(1.0)  # a timed join: SIGTERM and Ctrl-C get through
    except BaseException:
        for t in threads:
            leave_behind(t)
        raise
    if errors:
        raise errors[0]


@dataclass
class Staged:
    """The inputs as the job reads them: remote ones replaced by their local copies."""

    inputs: list[str]  # local paths, in the order given
    prefixes: list[tuple[str, str]] = field(default_factory=list)  # (local prefix, URI prefix)
    local_of: dict[str, str] = field(default_factory=dict)  # an input as given -> its local path

    def to_uri(self, path: str) -> str:
        """A local copy's path as the URI it was downloaded from (other paths unchanged)."""
        for local, uri in self.prefixes:
            if path == local or path.startswith(local + "/"):
                return uri + path[len(local) :]
        return path

    def as_given(self, files: list[Any]) -> list[Any]:
        """Resolved input files (`pipeline.read.sources.InputFile`) with the remote inputs they came
        from as given (what --per-input names), not their local copies."""
        given = {local: uri for uri, local in self.local_of.items()}
        return [replace(f, given=given.get(f.given, f.given)) for f in files]

    def in_message(self, text: str) -> str:
        """An error message with every local copy's path replaced by its URI."""
        for local, uri in self.prefixes:
            text = text.replace(local, uri)
        return text


@contextmanager
def staged_inputs(inputs: list[str], folder: Path, download: Callable[[list[tuple[str, str]]], None]) -> Iterator[Staged]:
    """Download the remote inputs into `folder` (made here, removed afterwards); local inputs pass
    through. Input k's files go to folder/k/ under their paths relative to the input."""
    if not any(is_uri(p) for p in inputs):
        yield Staged(list(inputs))
        return
    staged = Staged([])
    pairs: list[tuple[str, str]] = []
    try:
        for k, given in enumerate(inputs):
            if not is_uri(given):
                staged.inputs.append(given)
                continue
            sliced = splits.split_share(given)  # a share of its rows (:train[:20%]) follows the local copy
            uri, tail = (sliced[0], given[len(sliced[0]) :]) if sliced else (given, "")
            base, files = list_input(uri)
            scheme = uri.split("://", 1)[0]
            root = folder / str(k)
            for path, _ in files:
                local = root / path[len(base) :].lstrip("/")
                local.parent.mkdir(parents=True, exist_ok=True)
                pairs.append((f"{scheme}://{path}", str(local)))
            # a file stays a file (its name tells its format); a prefix or glob becomes the folder
            one_file = len(files) == 1 and files[0][0] == uri.split("://", 1)[1].rstrip("/")
            local_input = (str(root / files[0][0][len(base) :].lstrip("/")) if one_file else str(root)) + tail
            staged.inputs.append(local_input)
            staged.local_of[given] = local_input
            staged.prefixes.append((str(root), f"{scheme}://{base}"))
        download(pairs)
        yield staged
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------- a packed folder to read


@contextmanager
def folder_to_read(folder: str) -> Iterator[Path]:
    """The local folder pack-verify and pack-report read for FOLDER: FOLDER itself when it is a
    local path; for a URI, every file under it downloaded into a temporary folder (removed however
    the block ends), so the checks see the bytes stored there. A UserError raised in the block
    names the URI instead of the local copy."""
    if not is_uri(folder):
        yield Path(folder)
        return
    uri = folder.rstrip("/")
    fs, root = open_fs(uri)
    root = root.rstrip("/")
    import pyarrow.fs as pafs

    try:
        kind = fs.get_file_info(root).type
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"cannot read {uri}: {one_line(exc)}: check the URI and the credentials") from None
    files = files_under(fs, root, uri) if kind == pafs.FileType.Directory else []
    if not files:
        raise UserError(f"{uri}: no folder there (expected the --out folder of pack-data): check the bucket and key")
    scheme = uri.split("://", 1)[0]
    with tempfile.TemporaryDirectory(prefix="packlm-read-") as tmp:
        local = Path(tmp) / "folder"
        pairs = []
        for path, _ in files:
            target = local / path[len(root) :].lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            pairs.append((f"{scheme}://{path}", str(target)))
        download_here(pairs)
        try:
            yield local
        except UserError as exc:
            exc.args = (str(exc).replace(str(local), uri),)
            raise
