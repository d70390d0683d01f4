"""Input sources: resolve the user's inputs into files (the streaming of their rows is
`pipeline.read.batches`), refuse packed output given as input, and fingerprint every input.

Supported inputs (several may be given; globs are expanded in sorted order; order is kept):

- JSON Lines      `.jsonl`, `.ndjson` (also `.gz`, `.zst`: gzip, zstd), and `.json` files whose content is JSON Lines
- JSON array      `.json` (also `.json.gz`, `.json.zst`) holding one list of objects
- Parquet         `.parquet`, `.pq`
- Arrow IPC       `.arrow`, `.feather`, `.ipc` (IPC file or stream format, memory-mapped)
- CSV / TSV       `.csv`, `.tsv` (also `.gz`, `.zst`); every column is read as a string, empty stays ""
- a folder written by `datasets.save_to_disk` (memory-mapped Arrow); a `DatasetDict` folder is
  read through its `train` split (or its only split); any other folder is expanded into the
  supported files it contains (recursively, sorted)
- a Hugging Face Hub dataset `owner/name`, `owner/name:split` or `owner/name:config:split`, each
  optionally at a revision (`owner/name@rev:split`; default split `train`), when it names no local
  path (`pipeline.read.hub`): its split's files, from the local Hugging Face cache or downloaded, are read
  as the local files they are
- files of a Hub dataset's repo by their path in it, as `datasets` and huggingface_hub spell them:
  `hf://datasets/owner/name[@rev]/PATH` (PATH may hold a glob); they are the rows of split `train`
- a share of any input's rows, in `datasets`' split syntax after its split (`pipeline.splits`):
  `owner/name:train[:20%]`, `data.jsonl:train[10:100]` (local files and hf:// files are split `train`)
"""

from __future__ import annotations

import glob as globlib
import hashlib
import os
import re
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa

from pipeline import splits
from pipeline.errors import UserError, one_line
from pipeline.read import hub
from pipeline.read.json_lines import DEFAULT_CHUNK_BYTES, open_input
from pipeline.read.readers import KINDS, count_records, hf_data_files  # noqa: F401 (KINDS: what InputFile.kind is)
from pipeline.shards import SCHEMA, file_sha256, pack_data_files

# Longest suffix first so that ".jsonl.gz" wins over ".gz".
EXTENSIONS = {
    ".jsonl.gz": "jsonl",
    ".ndjson.gz": "jsonl",
    ".json.gz": "json",
    ".csv.gz": "csv",
    ".tsv.gz": "csv",
    ".jsonl.zst": "jsonl",
    ".ndjson.zst": "jsonl",
    ".json.zst": "json",
    ".csv.zst": "csv",
    ".tsv.zst": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".csv": "csv",
    ".tsv": "csv",
}
SUPPORTED = (
    ".jsonl, .ndjson, .json, .parquet, .pq, .arrow, .feather, .ipc, .csv, .tsv (text "
    "formats also .gz or .zst), a datasets.save_to_disk folder, or a Hub dataset id (org/name)"
)
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass
class InputFile:
    """One resolved input."""

    path: str  # as given, or as matched by a glob / found in a folder or a Hub dataset's snapshot
    kind: str  # one of KINDS
    size: int  # bytes (folders: their data files)
    hub: dict | None = None  # a Hub dataset's file: the input as given, id, revision, commit (`pipeline.read.hub`)
    mtime_ns: int | None = None  # a file's modification time when resolved (`changed_inputs`)
    rows: tuple[int, int] | None = None  # only these records [start, stop) of the file (a split's share)
    given: str | None = None  # the INPUT it came from, as given (what --mix and --per-input name)


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
    return UserError(f"{path} is a broken symbolic link (to {os.readlink(path)!r}, which does not exist): fix the link or remove it")


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
        kind = (
            "a named pipe (FIFO)"
            if stat.S_ISFIFO(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file"
        )
        raise UserError(
            f"{path} is {kind}, not a regular file (reading it could wait forever or never end): save the data to a file and give that"
        )


def _resolve_file(path: str) -> InputFile:
    _check_regular(path)
    kind = _kind_of(path)
    if kind is None:
        ext = "".join(Path(path).suffixes[-2:]) or "(no extension)"
        raise UserError(f"unknown input format {ext!r} for {path}: supported are {SUPPORTED}")
    _check_readable(path)
    st = os.stat(path)
    size = st.st_size
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
            raise UserError(
                f"{path} is neither a JSON array of objects nor JSON Lines "
                f"(starts with {first.decode(errors='replace')!r}): convert it to JSONL"
            )
    return InputFile(path=path, kind=kind, size=size, mtime_ns=st.st_mtime_ns)


def _resolve_folder(path: str) -> list[InputFile]:
    folder = Path(path)
    if _is_hf_disk(folder):
        _check_readable(str(folder / ("state.json" if (folder / "state.json").is_file() else "dataset_dict.json")))
        size = sum(p.stat().st_size for p in hf_data_files(folder))
        return [InputFile(path=path, kind="hf_disk", size=size)]
    entries, links = _walk(folder)
    if links:  # one rule for links to files and to folders: followed, and said
        names = ", ".join(f"{os.path.relpath(p, path)} -> {os.path.realpath(p)}" for p in links[:3])
        print(f"pack-data: {path}: following {len(links)} symbolic link(s) ({names}{', ...' if len(links) > 3 else ''})", file=sys.stderr)
    broken = sorted(str(p) for p in entries if p.is_symlink() and not p.exists())
    for p in broken:  # a link to data that is gone: never skipped unsaid
        if _kind_of(p):
            raise _broken_link(p)
    files = sorted(str(p) for p in entries if p.is_file())
    found = [p for p in files if _kind_of(p)]
    skipped = sorted([p for p in files if not _kind_of(p)] + broken)
    if found and skipped:  # said, never silent: a README beside the data is fine, a typo'd .jsonl is not
        names = ", ".join(os.path.relpath(p, path) for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        print(f"pack-data: {path}: skipping {len(skipped)} file(s) that are not data ({names}); supported are {SUPPORTED}", file=sys.stderr)
    if not found:
        raise UserError(
            f"folder {path} holds no supported data files and was not written by datasets.save_to_disk: supported are {SUPPORTED}"
        )
    return [_resolve_file(p) for p in found]


def _walk(folder: Path) -> tuple[list[Path], list[Path]]:
    """(every entry under `folder`, the symbolic links among them that lead somewhere): links to
    files and to folders are followed alike (a linked folder is walked as if it were there), each
    real folder once, so a link back up the tree ends nowhere."""
    entries: list[Path] = []
    seen: set[str] = set()
    for top, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(top)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        entries += [Path(top, name) for name in sorted(dirs + files)]
    links = sorted(p for p in entries if p.is_symlink() and p.exists())
    return entries, links


def resolve_inputs(inputs: Sequence[str]) -> list[InputFile]:
    """Expand globs and folders, check that every input exists and is readable, detect formats."""
    if not inputs:
        raise UserError("no input given: pass at least one file, glob, folder or Hub dataset id")
    out: list[InputFile] = []
    for raw in inputs:
        spec = os.path.expanduser(str(raw))
        sliced = None if os.path.lexists(spec) else splits.split_share(spec)
        if sliced is None:
            out.extend(replace(f, given=str(raw)) for f in _resolve_one(str(raw), spec))
            continue
        base, split, share = sliced
        ref = None if base.startswith(splits.HF_FILES) else hub.hub_ref(f"{base}:{split}", dataset=True)
        if ref is None and split != "train":
            raise UserError(f"{raw}: the rows of a local file (or of hf:// files) are datasets' split 'train': write {base}:train[...]")
        files = _resolve_hub(str(raw), ref) if ref is not None else _resolve_one(str(raw), base)
        out.extend(replace(f, given=str(raw)) for f in _share(files, share, str(raw)))
    for f in out:
        _refuse_packed(f)
    return out


def _resolve_one(raw: str, spec: str) -> list[InputFile]:
    """The files of one input (no share of its rows): a path, a glob, a Hub dataset or hf:// files."""
    if os.path.exists(spec):
        return _resolve_folder(spec) if os.path.isdir(spec) else [_resolve_file(spec)]
    if spec.startswith(splits.HF_FILES):
        return _resolve_hub_files(raw, spec)
    if _GLOB_CHARS.search(spec):
        matches = sorted(globlib.glob(spec, recursive=True))
        if not matches:
            raise UserError(f"no files match {raw!r}: check the pattern and quote it so the shell does not expand it")
        return [f for m in matches for f in (_resolve_folder(m) if os.path.isdir(m) else [_resolve_file(m)])]
    if os.path.islink(spec):
        raise _broken_link(spec)
    if (ref := hub.hub_ref(spec, dataset=True)) is not None:
        return _resolve_hub(raw, ref)
    raise UserError(f"input not found: {raw}: check the path (relative to {os.getcwd()})")


def _share(files: list[InputFile], share: splits.Share, given: str) -> list[InputFile]:
    """The files of an input that `share` of their rows (counted over all of them, in order) keeps,
    each with the records of its own it keeps."""
    counts = [count_records(f.path, f.kind, DEFAULT_CHUNK_BYTES) for f in files]
    kept = splits.assign(share, counts, given)
    return [replace(f, rows=rows, hub=f.hub and {**f.hub, "split": share.text}) for f, rows in zip(files, kept) if rows is not None]


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
    """The files of a Hub dataset's split (`pipeline.read.hub.dataset_files`), each an input of its own
    format that remembers the input as given and the commit it came from."""
    paths, commit = hub.dataset_files(ref)
    if not paths:
        raise UserError(f"dataset {given}: its split holds no data files: choose another split ({ref.repo_id}:SPLIT)")
    facts = {"input": given, **hub.record(ref, commit), "config": ref.config, "split": ref.split or "train"}
    return [replace(_resolve_file(p), hub=facts) for p in paths]


def _resolve_hub_files(given: str, spec: str) -> list[InputFile]:
    """`hf://datasets/owner/name[@rev]/PATH`: the files of that dataset repo matching PATH (a glob
    allowed), from the cache or downloaded alone, as `datasets.load_dataset(owner/name,
    data_files=PATH)` reads them."""
    repo, _, pattern = spec[len(splits.HF_FILES) :].partition("/")
    owner_name = f"{repo}/{pattern.partition('/')[0]}"
    pattern = pattern.partition("/")[2]
    ref = hub.hub_ref(owner_name, dataset=True)
    if ref is None or ref.split is not None or not pattern or pattern.startswith("/"):
        raise UserError(f"{given}: write files of a Hub dataset as hf://datasets/OWNER/NAME[@REVISION]/PATH")
    paths, commit = hub.repo_files(ref, pattern)
    facts = {"input": given, **hub.record(ref, commit), "config": None, "split": "train", "data_files": pattern}
    return [replace(_resolve_file(p), hub=facts) for p in paths]


# ------------------------------------------------------------------------------------ fingerprints


def changed_inputs(files: list[InputFile], fingerprints: list[dict]) -> None:
    """Raise UserError if an input file changed while pack-data read it (appended to, rewritten):
    its size or modification time now, or the bytes its sha256 covers, differ from what they were
    when it was resolved, so the packed rows and the manifest's fingerprint could cover different
    bytes."""
    for f, entry in zip(files, fingerprints):
        if f.mtime_ns is None:  # a save_to_disk folder: its Arrow files are hashed as a whole
            continue
        try:
            st = os.stat(f.path)
            now, mtime = st.st_size, st.st_mtime_ns
        except OSError:
            now, mtime = -1, None
        if now != f.size or mtime != f.mtime_ns or entry.get("bytes") != f.size:
            raise UserError(
                f"{f.path} changed while pack-data read it ({f.size} bytes when it started, "
                f"{max(now, entry.get('bytes', -1))} later): the packed rows and the manifest's sha256 could cover "
                "different bytes; pack a copy that nothing writes to; nothing was written"
            )


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
            for p in hf_data_files(folder):
                h.update(f"{p.relative_to(folder).as_posix()}\0{file_sha256(p)}\n".encode())
                total += p.stat().st_size
            out.append({"path": f.path, "kind": f.kind, "bytes": total, "sha256": h.hexdigest()})
        else:
            out.append(
                {
                    "path": f.path,
                    "kind": f.kind,
                    "bytes": os.path.getsize(f.path),
                    "sha256": file_sha256(f.path),
                    **({"hub": f.hub} if f.hub else {}),
                    **({"rows": list(f.rows)} if f.rows else {}),
                }
            )
    return out
