"""The pack-data console script as a user runs it: its own process, worker processes that end with
it, the whole summary flushed, and one line for bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hf_cache import fake_hub

from pipeline.shards import read_manifest, verify_folder

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "data" / "tokenizer")


def _session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


PACK_DATA = "import sys; from pipeline.cli import pack_data; sys.argv[0] = 'pack-data'; pack_data()"


def _pack_data(tmp_path: Path, *args: str, code: str = PACK_DATA, env: dict | None = None) -> subprocess.CompletedProcess:
    """`pack-data` as its console script runs it (or `code`), in a session of its own; output goes
    to files, so a child left behind holding them cannot keep this waiting."""
    with open(tmp_path / "stdout", "w+") as out, open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args], cwd=ROOT, stdout=out, stderr=err, text=True, start_new_session=True, env=env
        )
        proc.wait(timeout=300)
        deadline = time.monotonic() + 60  # a grace for a loaded machine, not a measure of speed
        while _session_alive(proc.pid) and time.monotonic() < deadline:  # its children must be gone
            time.sleep(0.05)
        leftover = _session_alive(proc.pid)
        if leftover:
            os.killpg(proc.pid, signal.SIGKILL)
        assert not leftover, "pack-data left processes running"
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


def test_pack_data_console_script_with_worker_processes(tmp_path: Path):
    out = tmp_path / "o"
    args = [
        str(ROOT / "data" / "sample" / "instructions.jsonl"),
        "--tokenizer",
        TOKENIZER,
        "--max-len",
        "2048",
        "--limit",
        "300",
        "--num-proc",
        "2",
        "--no-progress",
        "--out",
        str(out),
    ]
    proc = _pack_data(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("time: setup")  # the whole summary was flushed
    verify_folder(out)
    assert read_manifest(out).counts.examples_packed == 300

    again = _pack_data(tmp_path, *args)  # the output exists: one line, status 1, nothing touched
    assert again.returncode == 1
    assert again.stderr.count("\n") == 1 and again.stderr.startswith("Error: ")
    verify_folder(out)


def test_a_bad_tokenizer_path_is_the_jobs_one_line_error(tmp_path: Path):
    args = [
        str(ROOT / "data" / "sample" / "text.jsonl"),
        "--tokenizer",
        str(tmp_path / "nope"),
        "--max-len",
        "64",
        "--no-progress",
        "--out",
        str(tmp_path / "o"),
    ]
    proc = _pack_data(tmp_path, *args)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "tokenizer folder" in proc.stderr and "not found" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_mistyped_tokenizer_folder_that_looks_like_a_hub_name_fails_at_once(tmp_path: Path):
    """data/tokenizr (no such folder) is also a well-formed Hub id, but data/ is a local folder: it is
    a mistyped path, and fails in one line without asking the Hub."""
    args = [
        str(ROOT / "data" / "sample" / "text.jsonl"),
        "--tokenizer",
        "data/tokenizr",
        "--max-len",
        "64",
        "--no-progress",
        "--out",
        str(tmp_path / "o"),
    ]
    with fake_hub(404, "RepoNotFound") as (url, asked):  # it retried for 54 s when it asked the Hub
        env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_ENDPOINT": url}
        proc = _pack_data(tmp_path, *args, env=env)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "tokenizer folder data/tokenizr not found" in proc.stderr
    assert asked == []  # at once: the Hub was not asked
    assert not (tmp_path / "o").exists()
