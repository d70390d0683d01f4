"""Console scripts leave without the interpreter's teardown, but keep the exit status, the atexit
handlers, flushed output and the wait for running non-daemon threads (pipeline/console.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.shards import read_manifest
from pipeline.verify import verify_folder

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(ROOT / "data" / "tokenizer")

TOY = """
import atexit, sys, threading, time
from pathlib import Path
import click
from pipeline.console import run_and_exit

@click.command()
@click.argument("what")
@click.argument("marker")
def toy(what, marker):
    atexit.register(lambda: Path(marker).write_text("atexit ran"))
    sys.stdout.write("no newline yet")  # still buffered when the command returns
    if what == "user-error":
        raise click.ClickException("bad input: fix it")
    if what == "exit-3":
        sys.exit(3)
    if what == "exit-message":
        sys.exit("stopped: a message")
    if what == "thread":  # a non-daemon thread a normal exit would wait for
        threading.Thread(target=lambda: (time.sleep(0.3), Path(marker + ".thread").write_text("done"))).start()

run_and_exit(toy, "toy")
"""


def toy(tmp_path: Path, what: str) -> tuple[subprocess.CompletedProcess, Path]:
    marker = tmp_path / "marker"
    proc = subprocess.run([sys.executable, "-c", TOY, what, str(marker)], cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=60)
    return proc, marker


@pytest.mark.parametrize(("what", "code"), [("ok", 0), ("user-error", 1), ("exit-3", 3), ("exit-message", 1)])
def test_exit_status_atexit_handlers_and_buffered_output_survive(tmp_path: Path, what: str, code: int):
    proc, marker = toy(tmp_path, what)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "no newline yet"
    assert marker.read_text() == "atexit ran"
    if what == "user-error":
        assert proc.stderr == "Error: bad input: fix it\n"
    if what == "exit-message":
        assert proc.stderr == "stopped: a message\n"


def test_a_running_non_daemon_thread_is_waited_for(tmp_path: Path):
    proc, marker = toy(tmp_path, "thread")
    assert proc.returncode == 0, proc.stderr
    assert Path(str(marker) + ".thread").read_text() == "done"


def _session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


PACK_DATA = "import sys; from pipeline.console import pack_data_main; sys.argv[0] = 'pack-data'; pack_data_main()"


def _pack_data(tmp_path: Path, *args: str, code: str = PACK_DATA, env: dict | None = None) -> subprocess.CompletedProcess:
    """`pack-data` as its console script runs it (or `code`), in a session of its own; output goes
    to files, so a child left behind holding them cannot keep this waiting."""
    with open(tmp_path / "stdout", "w+") as out, open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=out, stderr=err,
                                text=True, start_new_session=True, env=env)
        proc.wait(timeout=300)
        deadline = time.monotonic() + 10
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
    args = [str(ROOT / "data" / "sample" / "instructions.jsonl"), "--tokenizer", TOKENIZER,
            "--max-len", "2048", "--limit", "300", "--num-proc", "2", "--no-progress", "--out", str(out)]
    proc = _pack_data(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("time: setup")  # the whole summary was flushed
    verify_folder(out)
    assert read_manifest(out).counts.examples_packed == 300

    again = _pack_data(tmp_path, *args)  # the output exists: one line, status 1, nothing touched
    assert again.returncode == 1
    assert again.stderr.count("\n") == 1 and again.stderr.startswith("Error: ")
    verify_folder(out)


PREFETCH_PROBE = r"""
import atexit, json, sys
import pipeline.tokenizer_cache as cache
forks, real = [], cache.Forked
def forked(*args):  # what this process had imported when it forked a tokenizer loader
    forks.append(sorted(m for m in ("numba", "pyarrow", "transformers") if m in sys.modules))
    return real(*args)
cache.Forked = forked
atexit.register(lambda: print("FORKS", json.dumps(forks), flush=True))
from pipeline.console import pack_data_main
sys.argv[0] = "pack-data"
pack_data_main()
"""


@pytest.mark.parametrize("form", ["--tokenizer PATH", "--tokenizer=PATH"])
@pytest.mark.parametrize("data", ["instructions.jsonl", "chat.jsonl"])
def test_the_command_forks_the_tokenizer_loader_before_its_heavy_imports(tmp_path: Path, data: str, form: str):
    """With no cache entry, the loading child is forked first thing, so that its imports overlap the
    command's own, and the job takes it over (text) or stops it (chat, which loads the tokenizer in
    the job); no process is left behind, and the shards are a library call's. A later process finds
    the entry and forks nothing."""
    from pipeline.write import PackConfig, run_pack_data

    tok = ["--tokenizer", TOKENIZER] if form == "--tokenizer PATH" else [f"--tokenizer={TOKENIZER}"]
    args = [str(ROOT / "data" / "sample" / data), *tok, "--max-len", "2048", "--limit", "60", "--no-progress"]
    env = {**os.environ, "PACKLM_CACHE_DIR": str(tmp_path / "cache")}
    first = _pack_data(tmp_path, *args, "--out", str(tmp_path / "a"), code=PREFETCH_PROBE, env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[-1] == "FORKS [[]]"  # one loader, forked before numba and pyarrow
    later = _pack_data(tmp_path, *args, "--out", str(tmp_path / "b"), code=PREFETCH_PROBE, env=env)
    assert later.stdout.splitlines()[-1] == ("FORKS []" if data != "chat.jsonl" else "FORKS [[]]")
    run_pack_data(PackConfig(inputs=args[:1], tokenizer=TOKENIZER, max_len=2048, limit=60, out=str(tmp_path / "c"),
                             progress=False))
    assert read_manifest(tmp_path / "a").shards == read_manifest(tmp_path / "c").shards
    assert read_manifest(tmp_path / "b").shards == read_manifest(tmp_path / "c").shards


def test_a_bad_tokenizer_path_forks_nothing_and_is_the_jobs_one_line_error(tmp_path: Path):
    args = [str(ROOT / "data" / "sample" / "text.jsonl"), "--tokenizer", str(tmp_path / "nope"), "--max-len", "64",
            "--no-progress", "--out", str(tmp_path / "o")]
    proc = _pack_data(tmp_path, *args, code=PREFETCH_PROBE)
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1] == "FORKS []"
    assert proc.stderr.count("\n") == 1 and "tokenizer folder" in proc.stderr and "not found" in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("argv", "value"), [
    (["in.jsonl", "--tokenizer", "tok", "--max-len", "8"], "tok"),
    (["--tokenizer=a/b", "in.jsonl"], "a/b"),
    (["in.jsonl", "--tokenizer"], None),  # no value: click reports it
    (["--", "--tokenizer", "tok"], None),  # after "--" it is an input's name
    (["in.jsonl", "--tokenizers", "tok"], None),
])
def test_the_tokenizer_option_is_found_as_click_reads_it(argv: list[str], value: str | None):
    from pipeline.console import _option_value

    assert _option_value(argv, "--tokenizer") == value


NO_TORCH = r"""
import atexit, importlib, sys
atexit.register(lambda: print("torch:", type(sys.modules.get("torch")).__name__,
                              "transformers:", "transformers" in sys.modules, flush=True))
module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
importlib.import_module(module).main()
"""


@pytest.mark.parametrize("command", ["pack-verify", "pack-report"])
def test_commands_that_load_a_tokenizer_do_it_without_torch(tmp_path: Path, command: str):
    """pack-verify --deep and pack-report's what-if mode load the tokenizer in their own process;
    they hide torch from transformers (importing it takes seconds), quietly."""
    from pipeline.write import PackConfig, run_pack_data

    chat = str(ROOT / "data" / "sample" / "chat.jsonl")
    if command == "pack-verify":
        run_pack_data(PackConfig(inputs=[chat], tokenizer=TOKENIZER, max_len=512, out=str(tmp_path / "o"),
                                 limit=40, progress=False))
        argv = ["pipeline.verify", str(tmp_path / "o"), "--deep"]
    else:
        argv = ["pipeline.report_cli", "--input", chat, "--tokenizer", TOKENIZER, "--max-len", "512",
                "--limit", "40", "--json", str(tmp_path / "r.json")]
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "torch: NoneType transformers: True"
    assert "PyTorch" not in proc.stderr
