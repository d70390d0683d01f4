"""What a pack-data job needs of a tokenizer: its facts (`tokenizer_info`) and its Rust backend as
JSON (`TokenizerParts`), from this process's memory, from disk where an earlier job kept them, or
from a child process forked to load the tokenizer.

Loading a tokenizer means importing transformers: 1-2 s, most of a small job's wall time
(BENCHMARKS.md). With an entry here, a job on text or pre-tokenized input needs no transformers at
all. An entry's key is the content of every file in the tokenizer's folder (weights aside), the
installed transformers and tokenizers, and this package's tokenizer-loading code: an entry is used
only where loading the tokenizer afresh would give the same result. Hub names are not cached.
Without an entry, the `pack-data` command forks the loading child first thing (`prefetch`), so
that its imports overlap the command's own.

On disk the entries live in `$PACKLM_CACHE_DIR`, by default `$XDG_CACHE_HOME/packlm` (else
`~/.cache/packlm`); an empty `PACKLM_CACHE_DIR` turns the disk cache off. Each entry is written
atomically and carries the sha256 of its backend; one that does not check out is ignored and
replaced. A cache folder that cannot be written is skipped without a word: the job loads the
tokenizer the ordinary way.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pipeline.tokenizer_load
from pipeline.background import Forked
from pipeline.errors import UserError
from pipeline.tokenizer_load import (
    load_tokenizer,
    load_tokenizer_parts,
    tokenizer_folder,
    tokenizer_info,
)

Parts = tuple[dict[str, Any], str]  # (tokenizer_info, backend JSON), as `load_tokenizer_parts` gives them

ENV = "PACKLM_CACHE_DIR"
KEEP = 8  # entries kept on disk (about 2 MB each for Llama-2): the newest used
HASHED_BYTES = 64 << 20  # files up to this size count by their content (the largest tokenizer.json: ~35 MB)
_FORMAT = b"packlm-tokenizer-cache-1"
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
_LIBRARIES = ("transformers", "tokenizers")
_MEMORY: dict[str, Parts] = {}  # entries of this process, by key
_PREFETCHED: dict[str, tuple[str, Forked]] = {}  # tokenizer name -> (its key, the child `prefetch` forked)


class TokenizerParts:
    """A job's tokenizer as `load_tokenizer_parts` gives it, (tokenizer_info, backend JSON): an entry
    of this cache when an earlier job loaded the same tokenizer, else what a child forked to load it
    (without torch) sends back; or `set` by the caller (`forked` False: chat, whose template needs
    the transformers tokenizer in the job's process).

    A tokenizer that the child fails to load is loaded here, the ordinary way: it may need torch
    after all, and if it cannot be loaded at all, that raises the one-line error.
    """

    def __init__(self, name: str, forked: bool) -> None:
        self._name = name
        key, child = _PREFETCHED.pop(name, (None, None))  # a child `prefetch` forked, and its key
        self._key = (key if child else cache_key(name)) if forked else None
        self._value = lookup(self._key, name)
        if child is not None and (not forked or self._value is not None):
            child.cancel()  # the job loads the tokenizer itself, or another job of this process kept it
            child = None
        if forked and self._value is None and child is None:
            child = Forked(load_tokenizer_parts, name)
        self._child = child

    def set(self, value: tuple[dict[str, Any], str | None]) -> None:
        self._value = value

    def done(self) -> bool:
        """Whether `result()` would return (or raise) without waiting."""
        return self._value is not None or self._child is not None and self._child.done()

    def result(self) -> tuple[dict[str, Any], str | None]:
        if self._value is None:
            assert self._child is not None, "neither forked nor set"
            try:
                self._value = self._child.result()
            except ChildProcessError as exc:  # the forked loader was killed
                raise UserError(f"loading tokenizer {self._name!r} failed: {exc} (out of memory?)") from None
            except Exception:  # noqa: BLE001 - whatever failed there, the ordinary load says what is wrong
                tokenizer = load_tokenizer(self._name)
                self._value = (tokenizer_info(tokenizer, self._name), tokenizer.backend_tokenizer.to_str())
            store(self._key, self._value)
        return self._value


def prefetch(name: str) -> None:
    """Fork the child that loads tokenizer `name` now, unless the cache has it (or it is no local
    folder): for a command's first lines, before its own imports (numba, pyarrow: 0.3-0.9 s), which
    then overlap the child's (1-2 s). The job's `TokenizerParts` takes the child over, or stops it
    if the job loads the tokenizer itself. A bad name is left for the job to report."""
    try:
        key = cache_key(name)
    except UserError:
        return
    if key is not None and name not in _PREFETCHED and lookup(key, name) is None:
        _PREFETCHED[name] = key, Forked(load_tokenizer_parts, name)


def cache_dir() -> Path | None:
    """The disk cache's folder (None: turned off)."""
    value = os.environ.get(ENV)
    if value is not None:
        return Path(os.path.expanduser(value)) if value.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "packlm"


def cache_key(name: str) -> str | None:
    """The key of tokenizer `name` as it is now (None: not cached, for a Hub name or a folder with a
    file that cannot be read). A path that names no folder is a UserError here, before any work
    starts. A file larger than HASHED_BYTES counts by its size and mtime, not its content."""
    folder = tokenizer_folder(name)
    if folder is None:
        return None
    digest = hashlib.sha256(_FORMAT)
    for library in _LIBRARIES:
        digest.update(_library_id(library).encode() + b"\0")
    digest.update(Path(pipeline.tokenizer_load.__file__).read_bytes())  # the code that makes an entry
    try:
        for path in _defining_files(folder):
            st = path.stat()
            content = path.read_bytes() if st.st_size <= HASHED_BYTES else f"{st.st_size}:{st.st_mtime_ns}".encode()
            digest.update(path.name.encode() + b"\0" + content + b"\0")
    except OSError:  # loading the tokenizer (the ordinary way) says whether that file matters
        return None
    return digest.hexdigest()


def lookup(key: str | None, name: str) -> Parts | None:
    """The entry for `key` with its info's name set to `name` (None: no entry)."""
    if key is None:
        return None
    parts = _MEMORY.get(key)
    if parts is None:
        parts = _read(key)
        if parts is None:
            return None
        _MEMORY[key] = parts
    return {**parts[0], "name": str(name)}, parts[1]


def store(key: str | None, parts: Parts) -> None:
    """Keep `parts` under `key`, in this process and on disk."""
    if key is None:
        return
    _MEMORY[key] = parts
    folder = cache_dir()
    if folder is None:
        return
    info, backend = parts
    tmp = folder / f".{key}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"info": info, "backend_sha256": _sha256(backend)}) + "\n" + backend,
                       encoding="utf-8")
        os.replace(tmp, folder / f"{key}.json")
        _prune(folder)
    except OSError:  # read-only, full, not a folder: a cache is never worth failing a job for
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _read(key: str) -> Parts | None:
    folder = cache_dir()
    if folder is None:
        return None
    path = folder / f"{key}.json"
    try:
        head, _, backend = path.read_text(encoding="utf-8").partition("\n")
        entry = json.loads(head)
        info = entry["info"]
        if _sha256(backend) != entry["backend_sha256"] or not isinstance(info, dict) or \
                not {"fingerprint", "vocab_size", "eos_token_id"} <= info.keys():
            return None
        os.utime(path)  # recently used: kept by `_prune`
        return info, backend
    except (OSError, ValueError, KeyError, TypeError):  # absent, unreadable, torn, foreign
        return None


def _prune(folder: Path) -> None:
    """Keep the KEEP entries used last; drop what writes cut short left (`.*.tmp`, an hour old)."""
    entries = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for old in entries[KEEP:]:
        old.unlink(missing_ok=True)
    for tmp in folder.glob(".*.tmp"):
        if time.time() - tmp.stat().st_mtime > 3600:
            tmp.unlink(missing_ok=True)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _defining_files(folder: Path) -> list[Path]:
    """The files of a tokenizer folder that loading it may read: all but weights, plus any extra chat
    templates."""
    files = [p for p in folder.iterdir() if p.is_file() and not p.name.endswith(_WEIGHTS)]
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        files += [p for p in extra.iterdir() if p.is_file()]
    return sorted(files)


def _library_id(name: str) -> str:
    """What identifies the installed library `name`: its dist-info folder (the version), and the size
    and mtime of its `__init__.py` and compiled modules (a reinstall or a rebuild in place)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return f"{name}: absent"
    package = Path(spec.origin).parent
    parts = sorted(p.name for p in package.parent.glob(f"{name}-*.dist-info"))
    for entry in sorted(os.scandir(package), key=lambda e: e.name):
        if entry.name == "__init__.py" or entry.name.endswith((".so", ".pyd")):
            st = entry.stat()
            parts.append(f"{entry.name}:{st.st_size}:{st.st_mtime_ns}")
    return f"{name}: " + " ".join(parts)
