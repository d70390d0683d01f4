"""A remote `--out` (any URI that `pyarrow.fs` opens; the storage access is `pipeline.read.remote`'s):
the job writes and verifies the folder locally (`--tmp-dir`, else the system's temporary folder; on
a Ray cluster it must be on storage every node sees), then uploads it with the manifest last, so a
folder without `manifest.json` is one that is not finished. An old output is replaced only with
`--overwrite` and only when everything in it is what pack-data wrote (its manifest lists it); its
manifest is deleted first, the files of the new one uploaded, then the old files the new output
does not have are deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import UserError, one_line
from pipeline.files.contained import escape
from pipeline.read.remote import bounded, file_info, files_under, is_uri, open_fs, remote_timeout
from pipeline.shards import FORMAT_NAME, MANIFEST_NAME


def check_remote_out(uri: str, overwrite: bool) -> None:
    """A remote --out may be new, or, with --overwrite, empty or holding only what pack-data wrote."""
    existing = _remote_files(uri)
    if not existing:
        return
    if not overwrite:
        raise UserError(f"output folder {uri} already exists: pass --overwrite to replace it, or choose another --out")
    ours = _ours(uri)
    foreign = sorted(set(existing) - ours)
    if foreign:
        raise UserError(
            f"--out {uri} holds {foreign[0]!r}, which pack-data did not write; refusing to replace it "
            "even with --overwrite: choose another --out"
        )


def _remote_files(uri: str) -> list[str]:
    """Paths (relative to `uri`) of every file under it."""
    import pyarrow.fs as pafs

    fs, root = open_fs(uri)
    root = root.rstrip("/")
    info = file_info(fs, root, f"cannot read --out {uri}")
    if info.type == pafs.FileType.File:
        raise UserError(f"--out {uri} exists and is not a folder: choose another --out")
    if info.type == pafs.FileType.NotFound:
        return []
    return [p[len(root) + 1 :] for p, _ in files_under(fs, root, uri)]


def _ours(uri: str) -> set[str]:
    """The files pack-data's manifest at `uri` lists (paths relative to it; the eval folder's too),
    with the manifests; empty when there is no manifest of pack-data's there."""
    fs, root = open_fs(uri)
    root = root.rstrip("/")

    def listed(sub: str) -> set[str]:
        def read() -> bytes:
            with fs.open_input_stream(f"{root}/{sub}{MANIFEST_NAME}") as f:
                return f.read()

        try:
            data = json.loads(bounded(f"cannot read {uri}/{sub}{MANIFEST_NAME}", read, remote_timeout()))
        except UserError:
            raise
        except Exception:  # noqa: BLE001 - no manifest there, or not JSON
            return set()
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            return set()
        names = {sub + MANIFEST_NAME} | {
            sub + s["file"] for s in data.get("shards", []) if isinstance(s, dict) and escape(s.get("file")) is None
        }
        held = (data.get("eval") or {}).get("folder") if not sub and isinstance(data.get("eval"), dict) else None
        if isinstance(held, str) and held and "/" not in held and held not in (".", ".."):
            names |= listed(held + "/")
        return names

    return listed("")


@contextmanager
def remote_out(out: str, overwrite: bool, tmp_dir: str | None) -> Iterator[Path]:
    """Yield the local folder the job writes for `out`: `out` itself when it is local; for a URI,
    a folder in a fresh temporary folder (under `tmp_dir`), uploaded to the URI when the block
    succeeds and removed however it ends."""
    if not is_uri(out):
        yield Path(out)
        return
    check_remote_out(out, overwrite)
    staging = Path(tempfile.mkdtemp(prefix=f"packlm-out-{socket.gethostname()}-{os.getpid()}-", dir=tmp_dir)).absolute()
    try:
        yield staging / "out"
        upload_folder(staging / "out", out, overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def upload_folder(local: Path, uri: str, overwrite: bool) -> None:
    """Upload a finished output folder: manifests last (the eval folder's before the top one);
    an old output's manifest is deleted first and its other leftover files after. On failure,
    what was uploaded is deleted again."""
    import pyarrow.fs as pafs

    check_remote_out(uri, overwrite)  # it may have changed while the job ran
    fs, root = open_fs(uri)
    root = root.rstrip("/")
    old = _remote_files(uri)
    files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    manifests = sorted((f for f in files if f.endswith(MANIFEST_NAME)), key=lambda f: -f.count("/"))
    failed = f"uploading the output to {uri} failed"

    def delete(name: str) -> None:
        bounded(f"{failed} (deleting {name})", lambda: fs.delete_file(f"{root}/{name}"), remote_timeout())

    done: list[str] = []
    try:
        if MANIFEST_NAME in old:
            delete(MANIFEST_NAME)  # the old output stops looking finished
        bounded(failed, lambda: fs.create_dir(root, recursive=True), remote_timeout())
        for name in [f for f in files if f not in manifests] + manifests:
            bounded(
                failed,
                lambda: pafs.copy_files(
                    str(local / name), f"{root}/{name}", source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs
                ),
                None,
            )
            done.append(name)
    except BaseException as exc:
        if isinstance(exc, Exception):  # (after SIGTERM or Ctrl-C, no more waiting on the storage)
            for name in done:
                try:
                    delete(name)
                except Exception:  # noqa: BLE001 - best effort; the manifest went last, so nothing looks finished
                    break
            detail = str(exc) if isinstance(exc, UserError) else f"{failed}: {one_line(exc)}"
            raise UserError(f"{detail}; nothing was left there that looks finished (no manifest.json): re-run pack-data") from None
        raise
    for name in sorted(set(old) - set(files)):
        delete(name)
