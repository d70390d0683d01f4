"""Hostile inputs and faults, met the way a user meets them: every case runs the real console
command and asserts the exit status, one line on stderr that names the problem (never a
traceback), and that the user's files are exactly as they were, the output folder being either
absent or complete and verified. The command runs in its own process where the case is about
processes (signals, kill -9, locks, a full disk); where it is about what the command decides and
writes (a bad input or option, a damaged shard, manifest or checkpoint), in the test's own process
(`in_process.run_here`: no interpreter start-up, no second import of torch).

The cases follow the failure list of the hostile-input issue: bad files, data that trains nothing,
packed output given as input, --overwrite over the user's files, kill -9 and SIGTERM at work,
a full disk, a damaged shard, a damaged checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from in_process import run_here
from small_disk import small_disk

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "data" / "tokenizer"
SAMPLE = ROOT / "data" / "sample" / "instructions.jsonl"
BIN = Path(sys.executable).parent  # this environment's console scripts


def cli(name: str, *args: object, cwd: Path, wait: bool = True, **kwargs: object):  # noqa: ANN201
    """Run console script `name` (`pack-data --no-progress ...`); returns the finished process, or
    the running one with `wait=False`."""
    argv = [str(BIN / name), *map(str, args)]
    if name in ("pack-data", "pack-train"):
        argv.append("--no-progress")
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)  # type: ignore[call-overload]
    if wait:
        proc.stdout_text, proc.stderr_text = proc.communicate(timeout=600)
    return proc


def finish(proc: subprocess.Popen) -> subprocess.Popen:
    proc.stdout_text, proc.stderr_text = proc.communicate(timeout=600)
    return proc


def error_line(proc: subprocess.Popen, status: int = 1) -> str:
    """The one error line the failed command printed last (what came before: its progress notes)."""
    assert proc.returncode == status, (proc.returncode, proc.stderr_text)
    assert "Traceback" not in proc.stderr_text + proc.stdout_text, proc.stderr_text
    lines = [line for line in proc.stderr_text.splitlines() if line.strip()]
    assert lines, "no message"
    return lines[-1]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> sha256 of its bytes) and every folder ('/')."""
    state = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink() and not path.exists():
            state[rel] = "-> " + os.readlink(path)
        else:
            state[rel] = "/" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return state


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def pack(tmp: Path, source: Path, out: str = "packed", *extra: object) -> Path:
    proc = run_here("pack-data", source, "--tokenizer", TOKENIZER, "--max-len", 512, "--out", out, *extra, cwd=tmp)
    assert proc.returncode == 0, proc.stderr_text
    return tmp / out


def verified(folder: Path) -> None:
    proc = run_here("pack-verify", folder, cwd=folder.parent)
    assert proc.returncode == 0, proc.stdout_text + proc.stderr_text


# --------------------------------------------------------------------- pack-data: bad input


def _chat(*roles: str) -> dict:
    return {"messages": [{"role": r, "content": f"{r} says hello"} for r in roles]}


def _truncated_parquet(tmp: Path) -> Path:
    path = tmp / "t.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(200)]}), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _cut_gz(path: Path, data: bytes) -> Path:
    """`data` gzipped into `path`, cut in the middle (what an interrupted download leaves)."""
    import gzip

    packed = gzip.compress(data)
    path.write_bytes(packed[: len(packed) // 2])
    return path


def _packed_input(tmp: Path) -> Path:
    return pack(tmp, SAMPLE, "earlier")


def _own_files_inside_out(tmp: Path) -> list[str]:
    out = pack(tmp, SAMPLE, "out")
    (out / "MY_NOTES.txt").write_text("mine")
    return [str(SAMPLE), "--out", "out", "--overwrite"]


def _out_is_the_input_folder(tmp: Path) -> list[str]:
    folder = tmp / "corpus"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"text": "some text"}] * 5)
    return [str(folder), "--out", "corpus", "--overwrite"]


def _broken_link_in_folder(tmp: Path) -> Path:
    folder = tmp / "corpus"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"text": "some text"}] * 5)
    (folder / "b.jsonl").symlink_to(tmp / "moved-away.jsonl")
    return folder


def _input_field_and_template_without_input(tmp: Path) -> list[str]:
    rows = [{"instruction": "sum", "input": "", "output": "5"}, {"instruction": "sum", "input": "2 3", "output": "5"}]
    return [str(write_jsonl(tmp / "d.jsonl", rows)), "--template", "qa"]


# case -> (make the inputs in tmp: the arguments before --tokenizer, or a full argument list that
#          holds --out; a needle of the one error line)
BAD_INPUT: dict[str, tuple[Callable[[Path], object], str]] = {
    "bad json": (lambda t: (t / "d.jsonl").write_text('{"text": "a"}\n{"text": "b"\n') and t / "d.jsonl", "d.jsonl line 2"),
    "wrong schema": (lambda t: write_jsonl(t / "d.jsonl", [{"body": "x"}]), "cannot tell the format"),
    "truncated parquet": (_truncated_parquet, "t.parquet"),
    "non-utf8": (lambda t: (t / "d.jsonl").write_bytes(b'{"text": "caf\xe9"}\n') and t / "d.jsonl", "UTF-8"),
    "no loss token": (lambda t: write_jsonl(t / "d.jsonl", [_chat("user")] * 4), "nothing to train on"),
    "unknown role": (lambda t: write_jsonl(t / "d.jsonl", [_chat("user", "wizard")]), "d.jsonl line 1: unknown message role 'wizard'"),
    "a file that mixes formats": (
        lambda t: write_jsonl(t / "d.jsonl", [_chat("user", "assistant")] * 3 + [{"instruction": "i", "output": "o"}]),
        "d.jsonl line 4: the file mixes formats",
    ),
    "packed output as input": (_packed_input, "is packed output of pack-data"),
    "--overwrite over the user's files": (_own_files_inside_out, "'MY_NOTES.txt', which pack-data did not write"),
    "--out is an input": (_out_is_the_input_folder, "corpus"),
    "a template that leaves a field out": (
        _input_field_and_template_without_input,
        "d.jsonl line 2: field 'input' has text, but --template qa has no {input}",
    ),
    "a broken link in an input folder": (_broken_link_in_folder, "b.jsonl is a broken symbolic link"),
    "a .jsonl.gz cut short past its first block": (
        lambda t: _cut_gz(t / "d.jsonl.gz", b"".join(json.dumps({"text": f"line {i} " * 8}).encode() + b"\n" for i in range(400000))),
        "d.jsonl.gz: Compressed file ended before the end-of-stream marker was reached",
    ),
    "a .json.gz array cut short": (
        lambda t: _cut_gz(t / "d.json.gz", b"[" + b",".join(json.dumps({"text": f"row {i} " * 8}).encode() for i in range(400000)) + b"]"),
        "d.json.gz: ",
    ),
    "a .csv.gz cut short": (
        lambda t: _cut_gz(t / "d.csv.gz", b"text\n" + b"".join(b"row %d of text\n" % i for i in range(400000))),
        "d.csv.gz: ",
    ),
    "an empty messages list in every row": (lambda t: write_jsonl(t / "d.jsonl", [{"messages": []}] * 3), "all 3 examples are empty"),
    "over-long row with --overlong error": (
        lambda t: [str(write_jsonl(t / "d.jsonl", [{"text": "short"}, {"text": "long " * 2000}])), "--overlong", "error"],
        "d.jsonl line 2",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_changes_nothing(tmp_path: Path, case: str) -> None:
    make, needle = BAD_INPUT[case]
    made = make(tmp_path)
    args = made if isinstance(made, list) else [str(made)]
    if "--out" not in args:
        args += ["--out", "out"]
    before = snapshot(tmp_path)
    proc = run_here("pack-data", *args, "--tokenizer", TOKENIZER, "--max-len", 512, cwd=tmp_path)
    line = error_line(proc)
    assert line.startswith("Error: ") and needle in line, line
    assert snapshot(tmp_path) == before


def test_missing_tokenizer_is_one_line(tmp_path: Path) -> None:
    proc = run_here("pack-data", SAMPLE, "--tokenizer", tmp_path / "nope", "--max-len", 512, "--out", "o", cwd=tmp_path)
    assert "nope" in error_line(proc) and snapshot(tmp_path) == {}


@pytest.mark.parametrize("value", ["0", "-5", "many", "3000000000", "99999999999999999999"])
def test_a_bad_max_len_is_one_line(tmp_path: Path, value: str) -> None:
    proc = run_here("pack-data", SAMPLE, "--tokenizer", TOKENIZER, "--max-len", value, "--out", "o", cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr_text
    assert "--max-len" in proc.stderr_text and snapshot(tmp_path) == {}


# ------------------------------------------------------ pack-data: complete, and says what it did


@pytest.mark.parametrize(
    "args, needle",
    [
        (("--num-proc", 3 * 10**9), "--num-proc must be between 1 and 1024, got 3000000000"),
        (("--seed", 10**20), "--seed must be a 64-bit integer"),
        (("--limit", -(10**20)), "--limit must be >= 1"),
    ],
)
def test_an_absurd_number_is_one_line_at_once(tmp_path: Path, args: tuple, needle: str) -> None:
    """Not thousands of processes forked, not an OverflowError from numpy: refused before any work."""
    proc = run_here("pack-data", SAMPLE, "--tokenizer", TOKENIZER, "--max-len", 512, "--out", "o", *args, cwd=tmp_path)
    assert needle in error_line(proc) and snapshot(tmp_path) == {}


def test_a_field_that_first_appears_in_the_last_row_is_kept(tmp_path: Path) -> None:
    rows = [{"instruction": f"do {i}", "output": f"done {i}"} for i in range(300)]
    rows[-1]["input"] = "the extra context"
    out = pack(tmp_path, write_jsonl(tmp_path / "d.jsonl", rows))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["resolved_formats"][0]["fields"]["input"] == "input"
    verified(out)


def test_a_number_in_a_text_field_is_packed_as_the_text_the_file_holds(tmp_path: Path) -> None:
    from pipeline.shards import iter_rows
    from pipeline.tokenize.tokenizer import load_tokenizer

    (tmp_path / "d.jsonl").write_text(
        '{"instruction": "the id", "output": 12345678901234567890}\n{"instruction": "a price", "output": 1.10}\n', encoding="utf-8"
    )
    out = pack(tmp_path, tmp_path / "d.jsonl")
    tokenizer = load_tokenizer(str(TOKENIZER))
    texts = [tokenizer.decode(r["input_ids"]) for r in iter_rows(out)]
    assert any("12345678901234567890" in t for t in texts) and any("1.10" in t for t in texts), texts
    assert not any("e+19" in t for t in texts)


def test_files_skipped_in_a_folder_are_named(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"text": "some text"}] * 5)
    (folder / "README.txt").write_text("notes")
    proc = run_here("pack-data", folder, "--tokenizer", TOKENIZER, "--max-len", 512, "--out", "o", cwd=tmp_path)
    assert proc.returncode == 0 and "README.txt" in proc.stderr_text, proc.stderr_text
    verified(tmp_path / "o")


def test_examples_without_a_loss_token_are_counted_and_warned_about(tmp_path: Path) -> None:
    rows = [_chat("user", "assistant")] * 6 + [_chat("user")] * 2
    proc = run_here(
        "pack-data", write_jsonl(tmp_path / "d.jsonl", rows), "--tokenizer", TOKENIZER, "--max-len", 512, "--out", "o", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr_text
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["counts"]["no_loss"] == 2
    assert "2 " in proc.stdout_text + proc.stderr_text and "loss" in proc.stdout_text + proc.stderr_text


# ------------------------------------------------------------------------- pack-data: faults


def _big_input(tmp: Path) -> Path:
    """Enough text for pack-data to take a few seconds: a signal lands mid-run (it is sent once the
    temporary folder exists, before tokenizing: about 4 s of it on two idle cores, 12 s loaded). The
    tests pack it again whole, so it is no larger than that needs."""
    rows = [{"text": f"example {i} " + "lorem ipsum dolor sit amet " * (20 + i % 50)} for i in range(10000)]
    return write_jsonl(tmp / "big.jsonl", rows)


def _signal_mid_run(tmp: Path, sig: int, *, group: bool) -> subprocess.Popen:
    """Start pack-data in a session of its own and send `sig` once its temporary folder exists (to
    the whole process group with `group`, as Slurm does; else to pack-data alone, as `timeout`)."""
    proc = cli(
        "pack-data",
        "big.jsonl",
        "--tokenizer",
        TOKENIZER,
        "--max-len",
        512,
        "--out",
        "o",
        "--num-proc",
        2,
        cwd=tmp,
        wait=False,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp.glob(".o.tmp-*")):
        assert proc.poll() is None and time.monotonic() < deadline, "pack-data ended before the signal"
        time.sleep(0.02)
    time.sleep(0.3)
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    return finish(proc)


def _group_gone(pgid: int) -> bool:
    deadline = time.monotonic() + 60  # a grace for a loaded machine: the workers end as they are told
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("group", [False, True], ids=["pack-data alone", "its process group"])
def test_sigterm_mid_run_is_one_line_exit_143_and_leaves_nothing(tmp_path: Path, group: bool) -> None:
    _big_input(tmp_path)
    before = snapshot(tmp_path)
    proc = _signal_mid_run(tmp_path, signal.SIGTERM, group=group)
    line = error_line(proc, 143)
    assert line == "terminated (SIGTERM): nothing was written to the output folder", proc.stderr_text
    assert len(proc.stderr_text.strip().splitlines()) == 1, proc.stderr_text
    assert snapshot(tmp_path) == before  # no output, no temporary folder
    assert _group_gone(proc.pid), "worker processes outlived pack-data"


def test_kill_9_mid_run_then_a_rerun_gives_the_same_bytes(tmp_path: Path) -> None:
    _big_input(tmp_path)
    proc = _signal_mid_run(tmp_path, signal.SIGKILL, group=False)
    assert proc.returncode == -signal.SIGKILL and not (tmp_path / "o").exists()
    assert _group_gone(proc.pid), "workers outlived their parent"  # they see the closed pipes and end
    again = cli("pack-data", "big.jsonl", "--tokenizer", TOKENIZER, "--max-len", 512, "--out", "o", cwd=tmp_path)
    assert again.returncode == 0 and "Traceback" not in again.stderr_text, again.stderr_text
    assert not list(tmp_path.glob(".o.tmp-*"))  # the killed run's folder is gone too
    clean = cli("pack-data", "big.jsonl", "--tokenizer", TOKENIZER, "--max-len", 512, "--out", "clean", cwd=tmp_path)
    assert clean.returncode == 0
    for shard in sorted((tmp_path / "clean").glob("shard-*")):
        assert shard.read_bytes() == (tmp_path / "o" / shard.name).read_bytes()
    # the killed run's workers printed nothing either
    assert "Traceback" not in proc.stderr_text and "BrokenPipe" not in proc.stderr_text


def test_disk_full_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """A real full disk (a 512 KiB tmpfs; needs root to mount, skipped otherwise)."""
    with small_disk(tmp_path / "small", "512k") as small:
        write_jsonl(tmp_path / "d.jsonl", [{"text": f"word {i} " * 100} for i in range(2000)])
        proc = cli("pack-data", "d.jsonl", "--tokenizer", TOKENIZER, "--max-len", 1024, "--out", small / "o", cwd=tmp_path)
        line = error_line(proc)
        assert "disk full while writing" in line and "_spill" in line, line  # the phase: the token spill
        assert list(small.iterdir()) == []


# ------------------------------------------------------------------------ damaged shards


def _change_a_prompt_token(folder: Path) -> Path:
    """Change one token id that carries no loss, in the first shard, to another valid id: the shard
    keeps its size and passes every structural check; only its sha256 tells."""
    from pipeline.shards import IGNORE_INDEX, open_shard, write_shard

    shard = sorted(folder.glob("shard-*.arrow"))[0]
    table = open_shard(shard)
    ids = table.column("input_ids").combine_chunks()
    labels = table.column("labels").combine_chunks()
    values = ids.values.to_numpy().copy()
    at = int((labels.values.to_numpy() == IGNORE_INDEX).nonzero()[0][5])
    values[at] = 7 if values[at] != 7 else 8
    changed = pa.ListArray.from_arrays(ids.offsets, pa.array(values, type=ids.values.type))
    table = table.set_column(table.schema.get_field_index("input_ids"), table.schema.field("input_ids"), changed)
    write_shard(shard.with_suffix(".new"), table)  # not over the file `table` maps
    os.replace(shard.with_suffix(".new"), shard)
    return shard


@pytest.fixture(scope="module")
def packed_sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack(tmp_path_factory.mktemp("sample"), SAMPLE)


def test_a_damaged_shard_fails_verify_report_and_train_in_one_line(packed_sample: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "packed"
    shutil.copytree(packed_sample, folder)
    shard = _change_a_prompt_token(folder)
    before = snapshot(tmp_path)
    assert shard.name in error_line(run_here("pack-verify", folder, cwd=tmp_path))
    assert shard.name in error_line(run_here("pack-report", folder, cwd=tmp_path))
    train = run_here("pack-train", "--data", folder, "--model", "tiny", "--out", "run", "--max-steps", 3, "--log-every", 1, cwd=tmp_path)
    assert shard.name in error_line(train) and "sha256" in error_line(train)
    assert not (tmp_path / "run" / "checkpoints").exists()  # no checkpoint of damaged data
    after = {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("run")}  # (config, metrics)
    assert after == before


def test_a_truncated_shard_fails_verify_in_one_line(packed_sample: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "packed"
    shutil.copytree(packed_sample, folder)
    shard = sorted(folder.glob("shard-*.arrow"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    assert shard.name in error_line(run_here("pack-verify", folder, cwd=tmp_path))


def test_a_model_packing_would_change_is_refused_in_one_line(packed_sample: Path, tmp_path: Path) -> None:
    """A dynamic NTK RoPE past the start-up probe's reach: refused before any step."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=4096,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    before = snapshot(tmp_path)
    train = run_here(
        "pack-train",
        "--data",
        packed_sample,
        "--model",
        tmp_path / "model",
        "--out",
        "run",
        "--max-steps",
        1,
        "--device",
        "cpu",
        cwd=tmp_path,
    )
    line = error_line(train)
    assert line.endswith(
        "LlamaForCausalLM cannot be trained on packed rows: its dynamic NTK RoPE (rope_type "
        "'dynamic') changes past 32768 tokens, and proving that per packed example would take "
        "a 32786-token probe row (the check's limit is 16384): refused unchecked; use a static "
        "RoPE scaling (rope_type 'linear' or 'yarn')"
    ), line
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


def _wait_for(condition: Callable[[], bool], proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 300
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, f"{what}: {proc.stderr.read()}"
        time.sleep(0.05)


def test_a_second_pack_data_on_a_busy_out_is_one_line_and_kill_9_frees_it(tmp_path: Path) -> None:
    _big_input(tmp_path)
    args = ("big.jsonl", "--tokenizer", TOKENIZER, "--max-len", 512, "--out", "o")
    first = cli("pack-data", *args, "--num-proc", 1, cwd=tmp_path, wait=False, start_new_session=True)
    try:
        _wait_for(lambda: bool(list(tmp_path.glob(".o.tmp-*"))), first, "pack-data ended early")
        os.killpg(first.pid, signal.SIGSTOP)  # holds its lock for as long as the test needs
        second = cli("pack-data", *args, "--overwrite", cwd=tmp_path)
        line = error_line(second)
        assert f"o is in use by another pack-data run (pid {first.pid} on " in line, line
        assert "choose another --out" in line
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert (tmp_path / ".o.lock").exists()  # what kill -9 leaves: a file, but no lock
    third = cli("pack-data", *args, cwd=tmp_path)
    assert third.returncode == 0, third.stderr_text
    assert not (tmp_path / ".o.lock").exists()
    verified(tmp_path / "o")


def test_a_second_pack_train_on_a_busy_run_folder_is_one_line_and_kill_9_frees_it(packed_sample: Path, tmp_path: Path) -> None:
    args = ("--data", packed_sample, "--model", "tiny", "--out", "run", "--log-every", 1, "--tokens-per-step", 2048)
    first = cli("pack-train", *args, "--max-steps", 1000, cwd=tmp_path, wait=False, start_new_session=True)
    lock = tmp_path / "run" / ".pack-train.lock"
    try:
        _wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists(), first, "pack-train ended early")
        assert lock.read_text().split()[0] == str(first.pid)
        os.killpg(first.pid, signal.SIGSTOP)
        before = snapshot(tmp_path / "run")
        second = cli("pack-train", *args, "--max-steps", 2, cwd=tmp_path)
        line = error_line(second)
        assert f"run is in use by another pack-train run (pid {first.pid} on " in line, line
        assert snapshot(tmp_path / "run") == before  # the first run's metrics and config untouched
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    third = cli("pack-train", *args, "--max-steps", 2, cwd=tmp_path)
    assert third.returncode == 0, third.stderr_text
    assert [m["step"] for m in _metrics(tmp_path / "run")] == [1, 2] and not lock.exists()


# -------------------------------------------------------------------- pack-train: checkpoints


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_damaged_checkpoint_is_named_and_stepped_over(packed_sample: Path, tmp_path: Path) -> None:
    args = ("--data", packed_sample, "--model", "tiny", "--max-steps", 4, "--save-every", 2, "--log-every", 1, "--tokens-per-step", 2048)
    first = run_here("pack-train", *args, "--out", "run", cwd=tmp_path)
    assert first.returncode == 0, first.stderr_text
    original = _metrics(tmp_path / "run")
    newest = tmp_path / "run" / "checkpoints" / "step-00000004"
    weights = newest / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64] ^= 1
    weights.write_bytes(bytes(data))
    (newest / "optimizer.pt").write_bytes((newest / "optimizer.pt").read_bytes()[:-10])
    before = snapshot(tmp_path)
    strict = run_here("pack-train", *args, "--out", "run", "--resume=strict", cwd=tmp_path)
    line = error_line(strict)
    assert "step-00000004 is damaged" in line and "--resume" in line, line
    assert snapshot(tmp_path) == before
    again = run_here("pack-train", *args, "--out", "run", "--resume", cwd=tmp_path)
    assert again.returncode == 0, again.stderr_text
    assert "step-00000004 is damaged" in again.stderr_text and "resuming from step-00000002" in again.stderr_text
    assert _losses(_metrics(tmp_path / "run")) == _losses(original)  # steps 3 and 4 redone, bitwise


def _losses(metrics: list[dict]) -> list[tuple]:
    return [(m["step"], m["loss"], m["grad_norm"]) for m in metrics]


def test_sigterm_finishes_the_step_checkpoints_and_resumes_bitwise(packed_sample: Path, tmp_path: Path) -> None:
    args = ("--data", packed_sample, "--model", "tiny", "--max-steps", 12, "--log-every", 1, "--tokens-per-step", 2048)
    cut = cli("pack-train", *args, "--out", "cut", cwd=tmp_path, wait=False, start_new_session=True)
    try:
        metrics = tmp_path / "cut" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
            assert cut.poll() is None and time.monotonic() < deadline, "pack-train ended before the signal"
            time.sleep(0.05)
        os.killpg(cut.pid, signal.SIGTERM)  # the trainer and its loader workers, as Slurm does
        line = error_line(finish(cut), 143)
    finally:
        if cut.poll() is None:
            cut.kill()
    assert line.startswith("terminated (SIGTERM): stopped after step "), line
    step = int(line.split("after step ")[1].split()[0])
    assert 2 <= step < 12 and (tmp_path / "cut" / "checkpoints" / f"step-{step:08d}").is_dir()
    rest = cli("pack-train", *args, "--out", "cut", "--resume", cwd=tmp_path)
    assert rest.returncode == 0, rest.stderr_text
    whole = cli("pack-train", *args, "--out", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr_text
    a, b = _metrics(tmp_path / "whole"), _metrics(tmp_path / "cut")
    assert [m["step"] for m in b] == list(range(1, 13))
    for key in ("loss", "grad_norm", "lr", "tokens"):
        assert [m[key] for m in a] == [m[key] for m in b], key  # bitwise


# ------------------------------------------------- files from other people: code, paths, markup


class _Payload:
    """Unpickling this runs code: it writes the file `marker` (what a planted checkpoint file would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # noqa: ANN204
        return (exec, (f"open({self.marker!r}, 'w').write('code ran')",))


# every file `pack-train --resume` reads from a checkpoint (checkpoint.json lists the others)
RESUME_READS = ["optimizer.pt", "scheduler.pt", "rng-rank0.pt", "trainer_state.json", "model/model.safetensors", "checkpoint.json"]


@pytest.fixture(scope="module")
def one_checkpoint(packed_sample: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple]:
    tmp = tmp_path_factory.mktemp("resume")
    args = (
        "--data",
        packed_sample,
        "--model",
        "tiny",
        "--max-steps",
        4,
        "--save-every",
        2,
        "--log-every",
        1,
        "--tokens-per-step",
        2048,
        "--out",
        "run",
    )
    first = run_here("pack-train", *args[:5], 2, *args[6:], cwd=tmp)  # resume asks for 2 more steps
    assert first.returncode == 0, first.stderr_text
    return tmp / "run", args


@pytest.mark.parametrize("name", RESUME_READS)
def test_a_pickle_planted_in_a_checkpoint_never_runs_and_resume_refuses_in_one_line(
    one_checkpoint: tuple[Path, tuple], tmp_path: Path, name: str
) -> None:
    import shutil

    import torch

    from trainer.run.checkpoint import write_file_list

    run = tmp_path / "run"
    shutil.copytree(one_checkpoint[0], run)
    marker = tmp_path / "CODE_RAN"
    checkpoint = run / "checkpoints" / "step-00000002"
    target = checkpoint / name
    if name.endswith(".pt"):
        torch.save(_Payload(marker), target)  # what torch.load(weights_only=False) would execute
        torch.load(target, weights_only=False)
        assert marker.exists()  # the payload is live
        marker.unlink()
    else:
        target.write_bytes(pickle.dumps(_Payload(marker)))
    if name != "checkpoint.json":
        write_file_list(checkpoint)  # the listing agrees: the checkpoint looks intact
    before = snapshot(tmp_path)
    line = error_line(run_here("pack-train", *one_checkpoint[1], "--resume", cwd=tmp_path))
    assert not marker.exists()
    assert snapshot(tmp_path) == before
    if name.endswith(".pt"):
        assert f"{target.relative_to(tmp_path)}: refused: it holds Python objects besides tensors and plain " in line
    elif name == "checkpoint.json":
        assert "no intact checkpoint" in line and "checkpoint.json is unreadable" in line, line
    else:
        assert str(target.relative_to(tmp_path).parent) in line, line


def test_a_checkpoint_listing_that_names_a_file_outside_is_never_read(one_checkpoint: tuple[Path, tuple], tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(one_checkpoint[0], run)
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    checkpoint = run / "checkpoints" / "step-00000002"
    listing = json.loads((checkpoint / "checkpoint.json").read_text())
    for name, value in (("../../../secret.txt", "../../../secret.txt"), (str(secret), str(secret)), ("link", None)):
        files = dict(listing["files"])
        if value is None:
            (checkpoint / "link").symlink_to(secret)
            value = "link"
        files[value] = {"bytes": len("not yours"), "sha256": hashlib.sha256(b"not yours").hexdigest()}
        (checkpoint / "checkpoint.json").write_text(json.dumps({"files": files}))
        line = error_line(run_here("pack-train", *one_checkpoint[1], "--resume", cwd=tmp_path))
        assert f"lists {value!r}, which leaves the checkpoint folder" in line, line


def _edit_manifest(folder: Path, edit: Callable[[dict], None]) -> None:
    """Edit `folder`'s manifest and write a matching checksum, as someone sharing the folder could."""
    from pipeline.shards import manifest_checksum

    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    data["checksum"] = manifest_checksum(data)
    path.write_text(json.dumps(data))


def _shard_outside(tmp: Path, folder: Path, how: str) -> str:
    """Move the first shard out of `folder` and point the manifest (or a link) at it: how
    `climbs` ('../elsewhere/shard'), `absolute` or `link` (a link in the folder to the moved file)."""
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    first = sorted(folder.glob("shard-*.arrow"))[0]
    moved = elsewhere / first.name
    os.replace(first, moved)
    if how == "link":
        first.symlink_to(moved)
        return first.name
    name = str(moved) if how == "absolute" else f"../elsewhere/{first.name}"

    def edit(data: dict) -> None:
        data["shards"][0]["file"] = name

    _edit_manifest(folder, edit)
    return name


@pytest.mark.parametrize("how", ["climbs", "absolute", "link", "eval folder"])
def test_a_manifest_path_that_leaves_the_folder_is_one_line_everywhere(packed_sample: Path, tmp_path: Path, how: str) -> None:
    import shutil

    folder = tmp_path / "packed"
    shutil.copytree(packed_sample, folder)
    if how == "eval folder":
        name = "../other-eval"
        shutil.copytree(packed_sample, tmp_path / "other-eval")
        _edit_manifest(folder, lambda data: data.__setitem__("eval", {"folder": name, "examples": 5}))
    else:
        name = _shard_outside(tmp_path, folder, how)
    before = snapshot(tmp_path)
    for command in (
        ("pack-verify", folder),
        ("pack-report", folder),
        ("pack-train", "--data", folder, "--model", "tiny", "--out", "run", "--max-steps", 1),
    ):
        line = error_line(run_here(*command, cwd=tmp_path))
        assert f"is {name!r}, which leaves {folder}" in line, (command[0], line)
        assert ("through a symbolic link" if how == "link" else "climbs out" if "../" in name else "absolute") in line
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


def test_links_in_an_input_folder_are_followed_alike_and_said(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "sub").mkdir(parents=True)
    write_jsonl(elsewhere / "sub" / "b.jsonl", [{"text": "in a linked folder"}] * 3)
    write_jsonl(elsewhere / "c.jsonl", [{"text": "a linked file"}] * 2)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "a.jsonl", [{"text": "a real file"}] * 4)
    (corpus / "sub").symlink_to(elsewhere / "sub")
    (corpus / "c.jsonl").symlink_to(elsewhere / "c.jsonl")
    (corpus / "loop").symlink_to(corpus)  # a link back up the tree ends nowhere
    proc = run_here("pack-data", corpus, "--tokenizer", TOKENIZER, "--max-len", 512, "--out", "packed", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr_text
    assert "following 3 symbolic link(s) (c.jsonl -> " in proc.stderr_text, proc.stderr_text
    manifest = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    assert manifest["counts"]["examples_read"] == 4 + 3 + 2
    assert sorted(Path(i["path"]).name for i in manifest["inputs"]) == ["a.jsonl", "b.jsonl", "c.jsonl"]


MARKUP = '<iframe src="https://example.com/x"></iframe>'


def _set(path: str, value: object) -> Callable[[dict], None]:
    """An edit that sets the manifest field `path` ("shards.0.sha256") to `value`."""
    *parents, last = path.split(".")

    def edit(data: dict) -> None:
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value

    return edit


@pytest.mark.parametrize(
    "field", ["shards.0.sha256", "shards.0.rows", "counts.examples_read", "counts.truncated", "max_len", "efficiency", "checksum", "eval"]
)
def test_markup_in_a_manifest_field_is_one_line_and_no_report(packed_sample: Path, tmp_path: Path, field: str) -> None:
    """A value of the wrong type (markup where a hash, count or object belongs): refused by every
    command that reads the folder, and pack-report writes no file."""
    import shutil

    folder = tmp_path / "packed"
    shutil.copytree(packed_sample, folder)
    _edit_manifest(folder, _set(field, MARKUP))
    if field == "checksum":
        (folder / "manifest.json").write_text(
            (folder / "manifest.json")
            .read_text()
            .replace(json.loads((folder / "manifest.json").read_text())["checksum"], MARKUP.replace('"', "'"))
        )
    before = snapshot(tmp_path)
    report = run_here("pack-report", folder, "--html", "r.html", "--json", "r.json", cwd=tmp_path)
    line = error_line(report)
    assert "manifest.json: field" in line and "but must be" in line, line
    assert "<iframe" not in line.split("is ")[0]
    assert snapshot(tmp_path) == before  # no r.html, no r.json
    assert "but must be" in error_line(run_here("pack-verify", folder, cwd=tmp_path))


@pytest.mark.parametrize("where", ["strategy", "folder name", "shard file name"])
def test_markup_in_a_value_the_report_shows_is_escaped(packed_sample: Path, tmp_path: Path, where: str) -> None:
    """A string the HTML shows (the strategy, the folder's name, a shard's file name) that carries
    markup, in an otherwise valid folder: the page shows it as text."""
    import shutil

    folder = tmp_path / ("p" + MARKUP.replace("/", "_") if where == "folder name" else "packed")
    shutil.copytree(packed_sample, folder)
    if where == "strategy":
        _edit_manifest(folder, _set("strategy", MARKUP))
    elif where == "shard file name":
        os.replace(folder / "shard-00000.arrow", folder / "shard-<b>x.arrow")
        _edit_manifest(folder, _set("shards.0.file", "shard-<b>x.arrow"))
    report = run_here("pack-report", folder, "--html", "r.html", cwd=tmp_path)
    assert report.returncode == 0, report.stderr_text
    page = (tmp_path / "r.html").read_text()
    assert "<iframe" not in page and "<b>x" not in page
    assert "&lt;iframe" in page if where != "shard file name" else "shard-&lt;b&gt;x.arrow" in page


def test_overwrite_through_a_link_replaces_the_folder_it_names_and_leaves_nothing_beside(tmp_path: Path) -> None:
    older = pack(tmp_path, SAMPLE, "older", "--limit", 20)
    (tmp_path / "out").symlink_to(older)
    proc = run_here("pack-data", SAMPLE, "--tokenizer", TOKENIZER, "--max-len", 512, "--out", "out", "--overwrite", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr_text
    assert (tmp_path / "out").is_symlink() and os.readlink(tmp_path / "out") == str(older)
    assert json.loads((older / "manifest.json").read_text())["counts"]["examples_read"] > 20  # the new output
    verified(older)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["older", "out"]  # no hidden entry left


@pytest.fixture(scope="module")
def a_run(packed_sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("a-run")
    proc = run_here("pack-train", "--data", packed_sample, "--model", "tiny", "--out", "run", "--max-steps", 1, cwd=tmp)
    assert proc.returncode == 0, proc.stderr_text
    return tmp / "run"


@pytest.mark.parametrize(
    "command",
    [
        ("pack-verify", "RUN"),
        ("pack-train", "--data", "RUN", "--model", "tiny", "--out", "new", "--max-steps", 1),
        ("pack-train", "--data", "PACKED", "--eval-data", "RUN", "--model", "tiny", "--out", "new", "--max-steps", 1),
    ],
)
def test_a_run_folder_given_for_a_packed_folder_is_one_line(a_run: Path, packed_sample: Path, tmp_path: Path, command: tuple) -> None:
    args = [{"RUN": a_run, "PACKED": packed_sample}.get(a, a) for a in command]
    line = error_line(run_here(*args, cwd=tmp_path))
    assert f"{a_run} is a pack-train run folder, not a packed folder" in line, line
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("damage", ["summary cut short", "summary a list", "metrics line text", "a loss as text"])
def test_a_damaged_run_folder_file_is_one_line_in_pack_report(a_run: Path, tmp_path: Path, damage: str) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(a_run, run)
    summary, metrics = run / "summary.json", run / "metrics.jsonl"
    if damage == "summary cut short":
        summary.write_bytes(summary.read_bytes()[:40])
    elif damage == "summary a list":
        summary.write_text("[1, 2]")
    elif damage == "metrics line text":
        metrics.write_text(metrics.read_text() + '"just text"\n')
    else:
        record = json.loads(metrics.read_text().splitlines()[0])
        metrics.write_text(json.dumps({**record, "loss": "<b>"}) + "\n")
    line = error_line(run_here("pack-report", run, cwd=tmp_path))
    assert str(run) in line and "damaged" in line, line


def test_a_defect_in_the_eval_folder_names_its_folder(tmp_path: Path) -> None:
    folder = pack(tmp_path, SAMPLE, "packed", "--eval-fraction", 0.2)

    def more_rows(data: dict) -> None:
        data["shards"][0]["rows"] += 1

    _edit_manifest(folder / "eval", more_rows)
    line = error_line(run_here("pack-verify", folder, cwd=tmp_path))
    assert f"{folder / 'eval' / 'shard-00000.arrow'}: has " in line, line


def test_empty_messages_lists_first_and_last_are_counted_as_empty(tmp_path: Path) -> None:
    chats = [json.loads(line) for line in (ROOT / "data" / "sample" / "chat.jsonl").read_text().splitlines()[:10]]
    write_jsonl(tmp_path / "c.jsonl", [{"messages": []}] + chats + [{"messages": []}])
    folder = pack(tmp_path, tmp_path / "c.jsonl", "packed", "--num-proc", 1)
    counts = json.loads((folder / "manifest.json").read_text())["counts"]
    assert (counts["examples_read"], counts["empty_skipped"], counts["examples_packed"]) == (12, 2, 10)
    verified(folder)


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ("--lr", "1e308", "--save-every", 1),
            "after step 1 a weight is not finite (NaN or inf): training stopped at step 1 "
            "without saving; no checkpoint was saved; lower --lr",
        ),
        (("--lr", "1e308", "--log-every", 1), "is not finite (NaN or inf): training stopped at step"),
        (("--lora-r", 4, "--lora-alpha", 0), "--lora-alpha must be > 0, got 0.0"),
    ],
)
def test_a_run_that_cannot_train_what_was_asked_is_one_line(packed_sample: Path, tmp_path: Path, args: tuple, needle: str) -> None:
    """A learning rate that diverges at once, an adapter scaled by zero: refused, never a run that exits 0."""
    line = error_line(
        run_here(
            "pack-train",
            "--data",
            packed_sample,
            "--model",
            "tiny",
            "--out",
            "run",
            "--max-steps",
            3,
            "--tokens-per-step",
            2048,
            *args,
            cwd=tmp_path,
        )
    )
    assert needle in line, line
    assert not list((tmp_path / "run" / "checkpoints").glob("step-*")) if (tmp_path / "run").exists() else True
