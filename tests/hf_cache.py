"""A Hugging Face cache built by tests, in the layout huggingface_hub writes:
`HF_HOME/hub/{models,datasets}--ORG--NAME/{blobs/SHA256, snapshots/COMMIT/FILE -> blob, refs/main}`,
so that ids resolve offline (HF_HUB_OFFLINE=1) exactly as after a real download; and a fake Hub
(`fake_hub`) answering every request with one HTTP status, for the "not found" and "gated" cases."""

from __future__ import annotations

import hashlib
import http.server
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

C1, C2 = "1" * 40, "2" * 40  # two commit shas for the snapshots the tests build


def add_snapshot(home: Path, repo_type: str, repo_id: str, files: dict[str, Path | bytes], commit: str, ref: str | None = "main") -> Path:
    """Put `files` (path in the repo -> a file to copy, or bytes) in the cache under HF_HOME `home`
    as snapshot `commit` of `repo_id`, `ref` (if any) pointing at it; returns the snapshot folder."""
    root = home / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    for name, content in files.items():
        data = content if isinstance(content, bytes) else Path(content).read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


def folder_files(folder: Path) -> dict[str, Path]:
    """Every file of `folder`, by its path inside it."""
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF_HOME, offline (HF_HUB_OFFLINE=1; the Hub's URL one where nothing listens), for
    this process and the ones it starts; nothing resolved earlier in this process is remembered."""
    import huggingface_hub.constants

    from pipeline.read import hub

    home = tmp_path / "hf-home"
    (home / "hub").mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there, should a test go online
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hub, "_RESOLVED", {})
    return home


@contextmanager
def fake_hub(status: int, error_code: str | None = None) -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server answering every request with `status` (and `X-Error-Code: error_code`);
    yields (its URL, the paths asked for)."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            asked.append(self.path)
            body = b'{"error": "test"}'
            self.send_response(status)
            if error_code:
                self.send_header("X-Error-Code", error_code)
                self.send_header("X-Error-Message", "test answer")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_HEAD = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()
