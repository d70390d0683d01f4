"""pack-data --engine ray (pipeline.engines.ray_engine) on a local Ray of 2 CPUs: the shards equal the local
engine's byte for byte whatever the chunking, a worker killed mid-job changes nothing, and every
failure is one line."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from own_processes import cmdline, descendants, tagged

from pipeline.cli import pack_data
from pipeline.engines.job import PackConfig, run_pack_data
from pipeline.errors import UserError
from pipeline.read.chunks import plan_chunks
from pipeline.read.sources import resolve_inputs
from pipeline.shards import verify_folder

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = str(ROOT / "data" / "tokenizer")
SAMPLE = ROOT / "data" / "sample"


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray for the module (the job uses a Ray that is already up, and leaves it up)."""
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every shard, the eval folder's included."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*.arrow"))}


def pack(tmp: Path, name: str, inputs: list, **options) -> tuple[Path, object]:
    out = tmp / name
    config = PackConfig(
        inputs=[str(p) for p in inputs],
        tokenizer=options.pop("tokenizer", TOKENIZER),
        max_len=options.pop("max_len", 512),
        out=str(out),
        progress=False,
        num_proc=2,
        **options,
    )
    return out, run_pack_data(config)


def same_as_local(tmp: Path, inputs: list, chunk_sizes: tuple[int, ...], **options) -> None:
    """The Ray engine's shards and manifest counts equal the local engine's for every chunk size."""
    local, m_local = pack(tmp, "local", inputs, **options)
    assert digests(local)
    for size in chunk_sizes:
        out, m_ray = pack(tmp, f"ray-{size}", inputs, engine="ray", chunk_bytes=size, **options)
        assert digests(out) == digests(local), f"chunk_bytes={size}"
        assert m_ray.counts == m_local.counts and m_ray.sources == m_local.sources
        assert m_ray.shards == m_local.shards
        verify_folder(out)


@pytest.mark.parametrize("name", ["instructions.jsonl", "chat.jsonl", "text.jsonl"])
def test_sample_data_is_byte_identical_whatever_the_chunks(tmp_path: Path, name: str) -> None:
    path = SAMPLE / name
    assert len(plan_chunks(resolve_inputs([str(path)]), 7_001)) > 20  # the small size cuts it for real
    same_as_local(tmp_path, [path], (1 << 30, 100_000, 7_001), max_len=1024, rows_per_shard=64)


def test_chat_template_reaches_the_tasks(tmp_path: Path) -> None:
    """--chat-template: the tasks that load the tokenizer give it the same template (not its own)."""
    same_as_local(tmp_path, [SAMPLE / "chat.jsonl"], (100_000,), max_len=1024, chat_template="qwen_25")
    out, manifest = pack(tmp_path, "own", [SAMPLE / "chat.jsonl"], max_len=1024)
    assert digests(out) != digests(tmp_path / "ray-100000")  # the template changed the shards


def test_mixed_formats_and_options_are_byte_identical(tmp_path: Path) -> None:
    """JSONL (blank lines, a field that appears late), .jsonl.gz, a JSON array, CSV, Parquet with
    many row groups and an Arrow IPC file of many batches, with --limit, --eval-fraction, --mix and
    --overlong split."""
    rows = [{"instruction": f"say {i} " * (i % 40 + 1), "output": "ok " * (i % 90)} for i in range(600)]
    for i in range(400, 600, 3):
        rows[i]["input"] = f"context {i}"
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(r) + ("\n\n" if i % 50 == 0 else "\n") for i, r in enumerate(rows)))
    gz = tmp_path / "b.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[:100]))
    array = tmp_path / "c.json"
    array.write_text(json.dumps(rows[100:200]))
    csv = tmp_path / "d.csv"
    csv.write_text("instruction,output\n" + "".join(f"q{i},a {i}\n" for i in range(150)))
    table = pa.table({"instruction": [r["instruction"] for r in rows], "output": [r["output"] for r in rows]})
    parquet = tmp_path / "e.parquet"
    pq.write_table(table, parquet, row_group_size=37)
    arrow = tmp_path / "f.arrow"
    with pa.ipc.new_file(arrow, table.schema) as w:
        for b in table.to_batches(max_chunksize=41):
            w.write_batch(b)
    inputs = [jsonl, gz, array, csv, parquet, arrow]
    assert len(plan_chunks(resolve_inputs(list(map(str, inputs))), 3_000)) > 30
    same_as_local(
        tmp_path,
        inputs,
        (3_000, 1 << 30),
        max_len=96,
        overlong="split",
        limit=1900,
        eval_fraction=0.1,
        mix="a.jsonl=2,e.parquet=0.5",
        strategy="minibatch",
        group_size=8,
    )


def test_pre_tokenized_inputs(tmp_path: Path) -> None:
    """Arrow IPC ids read in place (direct mode) and Parquet with labels (spilled in parts)."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, 4000, int(n)).tolist() for n in rng.integers(1, 300, 500)]
    arrow = tmp_path / "ids.arrow"
    t = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32()))})
    with pa.ipc.new_file(arrow, t.schema) as w:
        for b in t.to_batches(max_chunksize=64):
            w.write_batch(b)
    same_as_local(tmp_path / "direct", [arrow], (1 << 30,), max_len=256)
    parquet = tmp_path / "lab.parquet"
    pq.write_table(pa.table({"input_ids": ids, "labels": [[-100] + x[1:] for x in ids]}), parquet, row_group_size=50)
    same_as_local(tmp_path / "parts", [parquet], (2_000, 1 << 30), max_len=256)


def test_errors_name_the_row_as_the_local_engine_does(tmp_path: Path) -> None:
    """A bad line deep in a later chunk, and --overlong error: the same one line as locally."""
    lines = [json.dumps({"text": "word " * (i % 30 + 1)}) for i in range(3000)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:2500] + ["{broken"] + lines[2500:]) + "\n")
    for options in ({}, {"engine": "ray", "chunk_bytes": 4_000}):
        with pytest.raises(UserError, match=r"bad.jsonl line 2501: malformed JSON"):
            pack(tmp_path, f"bad-{len(options)}", [bad], **options)
    long = tmp_path / "long.jsonl"
    long.write_text("\n".join(lines[:2000] + [json.dumps({"text": "word " * 900})] + lines[2000:]) + "\n")
    for options in ({}, {"engine": "ray", "chunk_bytes": 4_000}):
        with pytest.raises(UserError, match=r"long.jsonl line 2001: example is \d+ tokens, longer than max_len 512"):
            pack(tmp_path, f"long-{len(options)}", [long], overlong="error", **options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "long.jsonl"]  # nothing left behind


def test_a_worker_killed_mid_job_is_retried_and_the_output_is_unchanged(tmp_path: Path) -> None:
    path = SAMPLE / "text.jsonl"
    local, _ = pack(tmp_path, "local", [path], max_len=1024)
    killed: list[int] = []
    result: dict = {}

    def job() -> None:
        try:
            result["manifest"] = pack(tmp_path, "ray", [path], engine="ray", chunk_bytes=3_000, max_len=1024)[1]
        except BaseException as exc:  # reported by the assertion below
            result["error"] = exc

    thread = threading.Thread(target=job)
    thread.start()
    while thread.is_alive() and not killed:
        for pid in descendants():  # this module's Ray's workers, never another program's
            if cmdline(pid).startswith("ray::_tokenize_chunk"):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.002)
    thread.join()
    assert killed, "no tokenize task was caught running"
    assert "error" not in result, result.get("error")
    assert digests(tmp_path / "ray") == digests(local)


def test_an_unreachable_cluster_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        pack_data,
        [
            str(SAMPLE / "text.jsonl"),
            "--tokenizer",
            TOKENIZER,
            "--max-len",
            "512",
            "--out",
            str(tmp_path / "o"),
            "--engine",
            "ray",
            "--ray-address",
            "127.0.0.1:9",
            "--no-progress",
        ],
    )
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the Ray cluster at 127.0.0.1:9" in lines[0], result.output
    assert not (tmp_path / "o").exists()


def test_a_node_that_cannot_see_the_output_folder_is_one_line(tmp_path: Path) -> None:
    """A Ray node started in its own mount namespace, where the folder of --out is hidden under a
    fresh tmpfs: the job names the node and the folder (skipped where namespaces are not allowed)."""
    hidden = tmp_path / "shared"
    hidden.mkdir()
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--mount", "true"]).returncode:
        pytest.skip("unshare --mount is not allowed here")
    ray_bin = str(Path(sys.executable).parent / "ray")
    port = 6391
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths live under it
    script = (
        f"mount -t tmpfs none {hidden} && {ray_bin} start --head --port {port} --num-cpus 1 "
        f"--temp-dir {temp} --include-dashboard false --disable-usage-stats --block"
    )
    head = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        code = (
            f"import ray, sys; ray.init(address='127.0.0.1:{port}', log_to_driver=False)\n"
            "from click.testing import CliRunner\nfrom pipeline.cli import pack_data\n"
            f"r = CliRunner().invoke(pack_data, ['{SAMPLE / 'text.jsonl'}', '--tokenizer', '{TOKENIZER}', "
            f"'--max-len', '512', '--out', '{hidden / 'out'}', '--engine', 'ray', '--no-progress'])\n"
            "print(r.output, end=''); sys.exit(r.exit_code)"
        )
        for _ in range(60):  # the head takes a few seconds to come up
            run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            if "cannot see" in run.stdout or run.returncode == 0:
                break
            time.sleep(1)
        lines = run.stdout.strip().splitlines()
        assert run.returncode != 0 and len(lines) == 1, run.stdout + run.stderr
        assert f"cannot see {hidden}" in lines[0] and "every node mounts" in lines[0]
        assert list(hidden.iterdir()) == []  # nothing written
    finally:  # that head's processes all name its temp folder
        os.killpg(head.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-9", "-f", temp])
        head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def test_the_command_starts_and_stops_its_own_ray(tmp_path: Path) -> None:
    """`pack-data --engine ray` as a user runs it: a local Ray of --num-proc CPUs, started for the
    job (beside the one this test module runs) and stopped after it; nothing on stderr with
    --no-progress; the shards equal the local engine's."""
    local, _ = pack(tmp_path, "local", [SAMPLE / "chat.jsonl"], max_len=1024)
    tag = uuid.uuid4().hex  # the command and every process it starts carry it (own_processes)
    env = {**os.environ, "TEST_RAY_TAG": tag}
    env.pop("RAY_ADDRESS", None)
    try:
        run = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; sys.argv[0] = 'pack-data'; from pipeline.cli import pack_data; pack_data()",
                str(SAMPLE / "chat.jsonl"),
                "--tokenizer",
                TOKENIZER,
                "--max-len",
                "1024",
                "--out",
                str(tmp_path / "ray"),
                "--engine",
                "ray",
                "--num-proc",
                "2",
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            env=env,
        )
        assert run.returncode == 0 and run.stderr == "", run.stderr
        assert "examples: 300 read, 300 packed" in run.stdout
        assert digests(tmp_path / "ray") == digests(local)
        deadline = time.monotonic() + 120  # a grace for a loaded machine: processes end as they are told
        while tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [cmdline(p) for p in tagged(tag)] == []  # its Ray is gone, every process of it
    finally:
        for pid in tagged(tag):  # what this test started, if the assertion above failed
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_numbers_in_text_fields_are_the_file_s_text_on_ray_too(tmp_path: Path) -> None:
    """A JSON number in a text field is packed as the text the file holds, in every chunk."""
    jsonl = tmp_path / "n.jsonl"
    jsonl.write_text("".join(f'{{"instruction": "id {i}", "output": {10**19 + i}.{i:02d}0, "score": 0.5}}\n' for i in range(300)))
    same_as_local(tmp_path, [jsonl], (2_000, 1 << 30), max_len=128)
    from pipeline.shards import iter_rows
    from pipeline.tokenize.tokenizer import load_tokenizer

    text = "".join(load_tokenizer(TOKENIZER).decode(r["input_ids"]) for r in iter_rows(tmp_path / "ray-2000"))
    assert f"{10**19 + 7}.070" in text and "e+19" not in text
