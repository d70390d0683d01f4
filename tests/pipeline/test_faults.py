"""Faults that used to end in a traceback, a hang or an unclear line, each now one line naming the
file, row or option and the fix, with a non-zero exit and nothing written: a --mix weight too large
to plan, --out below a regular file, a FIFO as input, a duplicate JSON key, a deeply nested value
quoted in full, and remote storage that does not answer (bounded in time, stoppable by SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import pack_data

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "data" / "tokenizer")
SAMPLE = ROOT / "data" / "sample" / "instructions.jsonl"


def run(*args: object) -> tuple[int, list[str]]:
    """pack-data in this process: (exit code, output lines); a traceback fails the test."""
    result = CliRunner().invoke(pack_data, [*map(str, args), "--tokenizer", TOKENIZER, "--max-len", "512", "--no-progress"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result.exit_code, result.output.strip().splitlines()


def one_error(code: int, lines: list[str]) -> str:
    assert code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), lines
    return lines[0]


def test_a_mix_weight_too_large_to_plan_is_one_line(tmp_path: Path) -> None:
    line = one_error(*run(SAMPLE, "--out", tmp_path / "o", "--mix", "instructions.jsonl=1e9"))
    assert "--mix " in line and "instructions.jsonl=1e+09" in line and "3000 examples" in line, line
    assert "use a smaller weight" in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_large_but_plannable_mix_weight_still_packs(tmp_path: Path) -> None:
    """Negative control: a weight of 20 (60,000 uses of 3,000 examples) is planned as before."""
    code, lines = run(SAMPLE, "--out", tmp_path / "o", "--mix", "instructions.jsonl=20")
    assert code == 0, lines
    assert (tmp_path / "o" / "manifest.json").is_file()


def test_out_below_a_regular_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    line = one_error(*run(SAMPLE, "--out", tmp_path / "notes.txt" / "run"))
    assert f"--out {tmp_path / 'notes.txt' / 'run'}: {tmp_path / 'notes.txt'} is a file, not a folder" in line, line
    assert "choose another --out" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_fifo_input_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    """Run in a process of its own, bounded: reading a FIFO that nobody writes would block forever."""
    fifo = tmp_path / "d.jsonl"
    os.mkfifo(fifo)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.argv[0] = 'pack-data'; from pipeline.cli import pack_data; pack_data()",
            str(fifo),
            "--tokenizer",
            TOKENIZER,
            "--max-len",
            "512",
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"Error: {fifo} is a named pipe (FIFO), not a regular file (reading it could wait forever or never end): "
        "save the data to a file and give that"
    ], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


# (file name, its text around the bad record, the bad record's line): JSON Lines, and a .json array
# (where json would silently keep the last value)
LAYOUTS = {
    "jsonl": ("d.jsonl", '{{"text": "fine", "meta": {{"k": 0}}}}\n{record}\n', 2),
    "json array": ("d.json", '[\n{{"text": "fine", "meta": {{"k": 0}}}},\n{record}\n]\n', 3),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "record, key", [('{"text": "a", "text": "b"}', "text"), ('{"text": "a", "meta": {"k": 1, "k": 2}}', "k")], ids=["top level", "nested"]
)
def test_a_duplicate_json_key_names_the_file_line_and_key(tmp_path: Path, layout: str, record: str, key: str) -> None:
    name, text, bad_line = LAYOUTS[layout]
    data = tmp_path / name
    data.write_text(text.format(record=record))
    line = one_error(*run(data, "--out", tmp_path / "o"))
    assert line == (
        f"Error: {data} line {bad_line}: key {key!r} appears twice in one JSON object: keep one of them (each key once per object)"
    ), line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["[" * 500 + '"a"' + "]" * 500, '{"a": ' * 500 + "1" + "}" * 500], ids=["lists", "objects"])
def test_a_deeply_nested_field_is_a_short_line(tmp_path: Path, value: str) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": ' + value + "}\n")
    line = one_error(*run(data, "--out", tmp_path / "o"))
    assert len(line) < 300, len(line)
    assert line.startswith(f"Error: {data} line 1: field 'text' has type ") and "expected text" in line, line


@pytest.mark.parametrize("name", ["d.jsonl", "d.json"])
def test_a_value_nested_10000_deep_is_one_line_not_a_crash(tmp_path: Path, name: str) -> None:
    """In a process of its own: pyarrow's code overflows the stack on such a type (a segfault)."""
    deep = '{"text": "x", "m": ' + "[" * 10_000 + "]" * 10_000 + "}"
    data = tmp_path / name
    data.write_text('{"text": "fine"}\n' + deep + "\n" if name.endswith("l") else '[{"text": "fine"},\n' + deep + "]\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.argv[0] = 'pack-data'; from pipeline.cli import pack_data; pack_data()",
            str(data),
            "--tokenizer",
            TOKENIZER,
            "--max-len",
            "512",
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    element = "record" if name.endswith("l") else "element of the array"
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"Error: {data} line 2: JSON nested too deeply (about 1000 levels or more): flatten that {element}"
    ], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_brackets_inside_strings_are_not_nesting(tmp_path: Path) -> None:
    """The control of the test above: 3,000 brackets inside a string (and more across records) are
    text, and the file packs with every record."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "' + "[" * 3_000 + '"}\n' + '{"text": "fine", "m": [[1]]}\n' * 2_000)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.argv[0] = 'pack-data'; from pipeline.cli import pack_data; pack_data()",
            str(data),
            "--tokenizer",
            TOKENIZER,
            "--max-len",
            "8192",
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    counts = manifest["counts"]
    assert counts["examples_read"] == counts["examples_packed"] == 2_001 and counts["truncated"] == 0, counts


def test_an_overlong_error_line_keeps_its_start_and_its_fix() -> None:
    from pipeline.errors import shortened

    text = "a.jsonl line 3: " + "x" * 50_000 + ": fix it"
    short = shortened(text)
    assert len(short) <= 2000 and short.startswith("a.jsonl line 3: ") and short.endswith(": fix it")
    assert shortened("short") == "short"


# ------------------------------------------------------------------------------ remote storage


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Endpoint(str):
    """The silent endpoint's URL, and the connections it holds (`held`: a client is waiting on it)."""

    held: list[socket.socket]


def wait_until_connected(endpoint: _Endpoint, proc: subprocess.Popen) -> None:
    """Until `proc` waits on the endpoint (within the test's wall-clock limit): a signal sent then
    meets the storage call, not the imports before it, however slow a loaded machine makes those."""
    while not endpoint.held:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)


@pytest.fixture
def silent_endpoint():
    """A TCP server on 127.0.0.1 that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = _Endpoint(f"http://127.0.0.1:{server.getsockname()[1]}")
    url.held = held
    yield url
    stop.set()
    thread.join()
    for c in held:
        c.close()
    server.close()


def s3_env(endpoint: str, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        **extra,
    }
    env.pop("AWS_PROFILE", None)
    return env


def pack_data_process(args: list[str], env: dict[str, str], tmp: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; sys.argv[0] = 'pack-data'; from pipeline.cli import pack_data; pack_data()",
            *args,
            "--tokenizer",
            TOKENIZER,
            "--max-len",
            "512",
            "--no-progress",
        ],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_an_unreachable_s3_out_is_one_line(tmp_path: Path) -> None:
    proc = pack_data_process([str(SAMPLE), "--out", "s3://bucket/run"], s3_env(f"http://127.0.0.1:{closed_port()}"), tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: cannot read --out s3://bucket/run: "), err
    assert "check the URI and the credentials" in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["input", "out"])
def test_s3_that_never_answers_is_one_line_within_the_timeout(tmp_path: Path, silent_endpoint: str, where: str) -> None:
    args = ["s3://bucket/in.jsonl", "--out", str(tmp_path / "o")] if where == "input" else [str(SAMPLE), "--out", "s3://bucket/run"]
    proc = pack_data_process(args, s3_env(silent_endpoint, PACKLM_REMOTE_TIMEOUT="2"), tmp_path)
    # without the bound, the client's own retries (3 attempts of 60 s) would outlast this
    _, err = proc.communicate(timeout=120)
    uri = "s3://bucket/in.jsonl" if where == "input" else "--out s3://bucket/run"
    assert proc.returncode == 1 and err.strip().splitlines() == [
        f"Error: cannot read {uri}: the storage did not answer in 2 s: check the endpoint (e.g. AWS_ENDPOINT_URL), "
        "the network and the credentials (set PACKLM_REMOTE_TIMEOUT to wait longer)"
    ], err
    assert list(tmp_path.iterdir()) == []


def test_sigterm_stops_a_job_waiting_on_silent_storage(tmp_path: Path, silent_endpoint: str) -> None:
    env = s3_env(silent_endpoint, PACKLM_REMOTE_TIMEOUT="3600")  # only SIGTERM ends it within communicate's limit
    proc = pack_data_process(["s3://bucket/in.jsonl", "--out", str(tmp_path / "o")], env, tmp_path)
    wait_until_connected(silent_endpoint, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and err.strip().splitlines() == ["terminated (SIGTERM): nothing was written to the output folder"], err
    assert list(tmp_path.iterdir()) == []


HANGING_FS = """
import sys, time
import pyarrow.fs as pafs

class Hangs:  # a gs:// client stuck in its credential or retry loop
    def get_file_info(self, *a):
        print("waiting on the storage", flush=True)
        time.sleep(3600)

class Opens:
    @staticmethod
    def from_uri(uri):
        return Hangs(), uri.split("://", 1)[1]

pafs.FileSystem = Opens
sys.argv[0] = "pack-data"
from pipeline.cli import pack_data
pack_data()
"""


def test_a_gs_input_whose_client_hangs_is_bounded_and_stoppable(tmp_path: Path) -> None:
    """gcsfs/GCS credentials are not available here: a file system whose calls never return stands
    for a gs:// client that retries forever without credentials."""
    args = ["gs://bucket/in.jsonl", "--tokenizer", TOKENIZER, "--max-len", "512", "--out", str(tmp_path / "o"), "--no-progress"]
    env = {**os.environ, "PACKLM_REMOTE_TIMEOUT": "2"}
    proc = subprocess.run([sys.executable, "-c", HANGING_FS, *args], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "Error: cannot read gs://bucket/in.jsonl: the storage did not answer in 2 s: check the endpoint (e.g. "
        "AWS_ENDPOINT_URL), the network and the credentials (set PACKLM_REMOTE_TIMEOUT to wait longer)"
    ], proc.stderr
    env["PACKLM_REMOTE_TIMEOUT"] = "600"
    slow = subprocess.Popen(
        [sys.executable, "-c", HANGING_FS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env
    )
    assert slow.stdout.readline() == "waiting on the storage\n"  # in the call, past the imports
    slow.send_signal(signal.SIGTERM)
    _, err = slow.communicate(timeout=30)
    assert slow.returncode == 143 and err.strip().splitlines() == ["terminated (SIGTERM): nothing was written to the output folder"], err
    assert list(tmp_path.iterdir()) == []


def test_an_input_appended_to_while_packing_is_one_line_and_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines appended to the input after its rows were read (a logger still writing): the packed rows
    and the manifest's sha256 would cover different bytes, so the job stops."""
    from pipeline.engines import job

    source = tmp_path / "live.jsonl"
    source.write_bytes(SAMPLE.read_bytes())
    real = job._tokenize

    def tokenize_then_append(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real(*args, **kwargs)
        with source.open("a") as f:
            f.write('{"instruction": "one more", "input": "", "output": "written later"}\n')
        return out

    monkeypatch.setattr(job, "_tokenize", tokenize_then_append)
    result = CliRunner().invoke(
        pack_data,
        [str(source), "--tokenizer", TOKENIZER, "--out", str(tmp_path / "out"), "--no-progress", "--num-proc", "1", "--max-len", "512"],
    )
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert f"{source} changed while pack-data read it ({SAMPLE.stat().st_size} bytes when it started" in lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.jsonl"]
