"""Hostile run folders, met the way a user meets them (the real pack-train command, run in the test's
own process where the case is about what it decides and writes, `in_process.run_here`): an
--out that names the model, the packed data or another folder of the user's, a link inside
checkpoints/ to another run's checkpoint, a full disk at the start of a run and while --merge-lora
writes RUN/merged, a kill -9 while a folder is written. Each gets one line and a non-zero exit, and
leaves the user's files exactly as they were; controls show the same commands working where they may.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from in_process import run_here
from small_disk import small_disk
from test_hostile_inputs import SAMPLE, TOKENIZER, error_line, snapshot

from pipeline.errors import UserError
from trainer.config import TrainConfig
from trainer.run.preflight import is_run_folder, refuse_foreign_out

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ("--model", "tiny", "--max-steps", 2, "--log-every", 1, "--tokens-per-step", 2048)


@pytest.fixture(scope="module")
def packed_sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("sample")
    done = run_here("pack-data", SAMPLE, "--tokenizer", TOKENIZER, "--max-len", 512, "--out", "packed", cwd=tmp)
    assert done.returncode == 0, done.stderr_text
    return tmp / "packed"


@pytest.fixture(scope="module")
def one_run(packed_sample: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run (its checkpoint: step-00000002), written into an --out that was an
    existing empty folder of the user's."""
    tmp = tmp_path_factory.mktemp("run")
    (tmp / "run").mkdir()
    done = run_here("pack-train", "--data", packed_sample, *TRAIN, "--out", "run", cwd=tmp)
    assert done.returncode == 0, done.stderr_text
    return tmp / "run"


def _model_folder(folder: Path) -> Path:
    """What a Hugging Face model folder looks like from outside (config.json, weights, tokenizer)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.mark.parametrize("kind", ["model", "data", "config-file", "axolotl", "users-folder", "empty-name"])
def test_an_out_that_is_not_a_run_folder_is_refused_before_anything_is_written(packed_sample: Path, tmp_path: Path, kind: str) -> None:
    data = shutil.copytree(packed_sample, tmp_path / "packed")
    model = _model_folder(tmp_path / "model")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text(json.dumps({"learning_rate": 1e-4, "note": "my own experiment"}))
    (mine / "metrics.jsonl").write_text('{"step": 1, "accuracy": 0.9}\n')
    args: list[object] = ["--data", data, "--model", model, "--max-steps", 2]
    if kind == "model":
        args += ["--out", model]
        expect = f"--out {model} is the --model folder: the run would write its config.json"
    elif kind == "data":
        args = ["--data", data, "--model", "tiny", "--max-steps", 2, "--out", data]
        expect = f"--out {data} is the --data folder"
    elif kind == "config-file":  # pack-train's own config file, out: the model folder
        (tmp_path / "run.yaml").write_text(f"data: {data}\nmodel: {model}\nout: {model}\n")
        args = ["--config", tmp_path / "run.yaml"]
        expect = "is the --model folder"
    elif kind == "axolotl":  # an Axolotl file whose output_dir is its base_model
        (tmp_path / "axolotl.yml").write_text(f"base_model: {model}\noutput_dir: {model}\nmax_steps: 2\n")
        args = ["--config", tmp_path / "axolotl.yml", "--data", data]
        expect = "is the --model folder"
    elif kind == "users-folder":
        args = ["--data", data, "--model", "tiny", "--max-steps", 2, "--out", mine]
        expect = (
            f"--out {mine} is an existing folder that is not a pack-train run folder (it holds config.json, "
            "metrics.jsonl): pack-train writes only into a new or empty folder"
        )
    else:
        args = ["--data", data, "--model", "tiny", "--max-steps", 2, "--out", ""]
        expect = "--out is empty: name the run folder to create"
    before = snapshot(tmp_path)
    line = error_line(run_here("pack-train", *args, cwd=tmp_path))
    assert expect in line, line
    assert snapshot(tmp_path) == before  # nothing written, not even the lock


def test_which_folders_are_run_folders(one_run: Path, tmp_path: Path) -> None:
    """`is_run_folder` on what pack-train writes and what it does not (in-process: no run needed)."""
    assert is_run_folder(one_run)
    locked = tmp_path / "locked"  # a run that stopped before its config.json: only its lock
    locked.mkdir()
    (locked / ".pack-train.lock").write_text("1 host\n")
    (locked / ".config.json.x1y2.tmp").write_text("{")  # a kill -9 while config.json was written
    assert is_run_folder(locked)
    for name, text in (
        ("list", "[1, 2]"),
        ("hf-config", '{"model_type": "llama", "hidden_size": 64}'),
        ("broken", "{not json"),
        ("other-tool", '{"data": 1, "model": 2, "out": 3}'),
    ):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(text)
        assert not is_run_folder(folder), name
    with_metrics = tmp_path / "metrics-only"
    with_metrics.mkdir()
    (with_metrics / "metrics.jsonl").write_text("{}\n")
    assert not is_run_folder(with_metrics)
    bare = tmp_path / "bare"  # checkpoints/ alone: pack-train's when it holds checkpoints of its names
    (bare / "checkpoints" / "checkpoint-500").mkdir(parents=True)
    assert not is_run_folder(bare)
    (bare / "checkpoints" / "step-00000002").mkdir()
    assert is_run_folder(bare)
    config = TrainConfig(data="d", model="tiny", out=str(tmp_path / "empty"))
    (tmp_path / "empty").mkdir()
    refuse_foreign_out(config)  # an empty folder and a new one are the run's to write
    refuse_foreign_out(TrainConfig(data="d", model="tiny", out=str(tmp_path / "new" / "run")))
    with pytest.raises(UserError, match="is a file, not a folder"):
        refuse_foreign_out(TrainConfig(data="d", model="tiny", out=str(one_run / "config.json")))


def test_an_empty_folder_of_the_users_takes_a_run(one_run: Path) -> None:
    """Control: an existing empty --out is written (nothing of the user's is in it): `one_run` was one."""
    assert (one_run / "checkpoints" / "step-00000002").is_dir()
    assert is_run_folder(one_run) and (one_run / "metrics.jsonl").is_file()


def test_a_link_in_checkpoints_to_another_runs_checkpoint_is_one_line(packed_sample: Path, one_run: Path, tmp_path: Path) -> None:
    target = one_run / "checkpoints" / "step-00000002"
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(one_run / "config.json", run / "config.json")
    (run / "checkpoints" / "step-00000002").symlink_to(target, target_is_directory=True)
    before, theirs = snapshot(tmp_path), snapshot(one_run)
    args = ("--data", packed_sample, *TRAIN[:2], "--max-steps", 4, *TRAIN[4:], "--out", "run")
    for resume in (f"--resume={run / 'checkpoints' / 'step-00000002'}", "--resume"):
        line = error_line(run_here("pack-train", *args, resume, cwd=tmp_path))
        assert (
            f"run/checkpoints/step-00000002 is a symbolic link (to {target}): pack-train reads, "
            "replaces and removes only the checkpoints it wrote"
        ) in line, line
        assert "--resume FOLDER with a new --out" in line, line
    assert snapshot(tmp_path) == before and snapshot(one_run) == theirs
    # control: as the line says, the checkpoint itself with a new --out
    fork = run_here("pack-train", *args[:-1], "fork", f"--resume={target}", cwd=tmp_path)
    assert fork.returncode == 0, fork.stderr_text
    assert "starts its own history from this checkpoint of another run folder" in fork.stderr_text
    assert sorted(p.name for p in (tmp_path / "fork" / "checkpoints").glob("step-*")) == ["step-00000004"]
    assert snapshot(one_run) == theirs


@pytest.mark.parametrize("free_pages", [0, 1])
def test_a_full_disk_at_the_start_leaves_no_run_folder(packed_sample: Path, tmp_path: Path, free_pages: int) -> None:
    """No room for the lock (0 pages), or for config.json (1): one line naming the folder, and no
    empty run folder (nor its parents) is left behind."""
    with small_disk(tmp_path / "small", "64k") as small:
        (small / "fill").write_bytes(b"\0" * (64 - 4 * free_pages) * 1024)
        line = error_line(run_here("pack-train", "--data", packed_sample, *TRAIN, "--out", small / "a" / "run", cwd=tmp_path))
        assert line.startswith("Error: disk full: pack-train could not write its ") and f"{small / 'a' / 'run'}" in line, line
        assert sorted(p.name for p in small.iterdir()) == ["fill"]


def test_a_full_disk_while_merging_lora_leaves_no_half_written_merged(packed_sample: Path, tmp_path: Path) -> None:
    """RUN/merged (the tiny model, about 2.4 MB) does not fit on a 1 MB disk that holds the run's
    adapter checkpoints: one line, no RUN/merged nor its temporary folder, the checkpoint intact."""
    from trainer.run.checkpoint import checkpoint_damage

    with small_disk(tmp_path / "small", "1m") as small:
        proc = run_here("pack-train", "--data", packed_sample, *TRAIN, "--lora-r", 4, "--merge-lora", "--out", small / "run", cwd=tmp_path)
        line = error_line(proc)
        assert f"writing {small / 'run' / 'merged'} failed (disk full); nothing of it was left: free some space" in line
        assert not (small / "run" / "merged").exists() and not (small / "run" / ".tmp-merged").exists()
        assert checkpoint_damage(small / "run" / "checkpoints" / "step-00000002") is None


KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from trainer.run.checkpoint import write_folder_atomic

def write(folder):
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"half")
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    (folder / "model.safetensors").write_bytes(b"whole")

write_folder_atomic(Path(sys.argv[1]), write, "fix")
"""


def test_a_kill_9_while_a_folder_is_written_leaves_no_half_written_folder(tmp_path: Path) -> None:
    """RUN/merged (as --merge-lora writes it) after a kill -9 mid-write: absent, and the next writer
    removes what the killed one left and writes it whole."""
    final = tmp_path / "run" / "merged"
    final.parent.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(final), "kill"], env=env)
    assert killed.returncode == -signal.SIGKILL
    assert not final.exists()
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(final), "finish"], env=env)
    assert done.returncode == 0
    assert (final / "model.safetensors").read_bytes() == b"whole"
    assert sorted(p.name for p in final.parent.iterdir()) == ["merged"]
