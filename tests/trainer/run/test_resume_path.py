"""--resume PATH (Hugging Face's resume_from_checkpoint): any intact checkpoint of a compatible run.
An older checkpoint of the same --out rolls back (the newer ones are kept, unchanged, in
RUN/superseded/N/, out of the continued run's way); one of another folder starts a new --out's own
history from there. What cannot be continued exactly (a renamed checkpoint, a data cursor beyond the
data, another model, a damaged checkpoint, a fork into a folder with a history of its own) is one line.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2]))
from packed_factory import random_packed_folder  # noqa: E402

from pipeline.errors import UserError  # noqa: E402
from trainer import TrainConfig, train  # noqa: E402
from trainer.run import checkpoint as ckpt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 18 rows of <= 64 tokens in 3 shards: ~4 steps per epoch."""
    return random_packed_folder(tmp_path_factory.mktemp("packed"), 64, count=50, low=4, high=40, rows_per_shard=7)


def _config(packed: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        data=str(packed),
        model="tiny",
        out=str(out),
        tokens_per_step=128,
        grad_accum=2,
        lr=2e-3,
        warmup=2,
        max_steps=6,
        save_every=2,
        log_every=1,
        num_workers=0,
        progress=False,
    )
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def full(packed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of 6 steps with checkpoints at steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("full") / "run"
    train(_config(packed, run))
    return run


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> list[tuple]:
    return [(m["step"], m["loss"], m["grad_norm"]) for m in _metrics(run)]


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def _copy(full: Path, to: Path) -> Path:
    shutil.copytree(full, to)
    return to


def test_an_older_checkpoint_rolls_back_and_keeps_the_newer_ones_aside(
    packed: Path, full: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy(full, tmp_path / "run")
    newer = {name: tree(run / "checkpoints" / name) for name in ("step-00000004", "step-00000006")}
    before = _metrics(run)
    summary = train(_config(packed, run, keep_last=1, resume=str(run / "checkpoints" / "step-00000002")))
    note = capsys.readouterr().err
    assert "rolled back; the newer checkpoints of this run (step-00000004, step-00000006) are kept, unchanged, in" in note
    kept = run / "superseded" / "1"
    assert {name: tree(kept / "checkpoints" / name) for name in newer} == newer  # untouched, still loadable
    assert _metrics(kept) == before  # the metrics they logged
    # the continuation is exact (steps 3-6 again, bitwise), and its saves and --keep-last see only its own
    assert summary["steps"] == 6 and _losses(run) == _losses(full)
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000006"]
    assert (run / "checkpoints" / "latest").read_text() == "step-00000006\n"
    assert ckpt.checkpoint_damage(run / "checkpoints" / "step-00000006") is None
    # a second roll-back (through a link of the user's, named otherwise) keeps the first one's set-aside
    # checkpoints where they are
    train(_config(packed, run, max_steps=7, resume="newest"))
    (tmp_path / "good").symlink_to(run / "checkpoints" / "step-00000006")
    train(_config(packed, run, max_steps=7, resume=str(tmp_path / "good")))
    assert (run / "superseded" / "2" / "checkpoints" / "step-00000007").is_dir()
    assert {name: tree(kept / "checkpoints" / name) for name in newer} == newer


def test_resuming_the_newest_sets_nothing_aside(packed: Path, full: Path, tmp_path: Path) -> None:
    """Control: the newest checkpoint (by PATH or --resume) continues without a roll-back."""
    run = _copy(full, tmp_path / "run")
    train(_config(packed, run, max_steps=8, resume=str(run / "checkpoints" / "step-00000006")))
    assert not (run / "superseded").exists()
    assert [m["step"] for m in _metrics(run)] == list(range(1, 9))


def test_a_checkpoint_of_another_folder_starts_a_new_history(packed: Path, full: Path, tmp_path: Path) -> None:
    before = tree(full)
    fork = tmp_path / "fork"
    train(_config(packed, fork, resume=str(full / "checkpoints" / "step-00000002")))
    assert tree(full) == before  # the source run is only read
    assert _losses(fork) == _losses(full)[2:]  # steps 3-6, bitwise as the source run trained them
    assert sorted(p.name for p in (fork / "checkpoints").glob("step-*")) == ["step-00000004", "step-00000006"]
    # a folder with a history of its own is not forked into
    with pytest.raises(
        UserError,
        match=r"a checkpoint of another run folder, but out .*fork holds checkpoints of "
        r"its own run \(newest step-00000006\): to start a new run from .*give a new out",
    ):
        train(_config(packed, fork, max_steps=8, resume=str(full / "checkpoints" / "step-00000004")))
    with pytest.raises(UserError, match=r"resume='nowhere': expected newest, strict, or a checkpoint folder"):
        train(_config(packed, fork, max_steps=8, resume="nowhere"))


def test_a_renamed_checkpoint_is_not_resumed_as_the_step_its_name_says(packed: Path, full: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "config.json", run / "config.json")
    shutil.copytree(full / "checkpoints" / "step-00000002", run / "checkpoints" / "step-00000009")  # intact, renamed
    before = tree(tmp_path)
    message = r"its name says step 9 but it holds the state of step 2 \(a renamed folder\?\): rename it back to step-00000002"
    for resume in ("newest", str(run / "checkpoints" / "step-00000009")):
        with pytest.raises(UserError, match=message):
            train(_config(packed, run, max_steps=12, resume=resume))
    assert tree(tmp_path) == before
    (run / "checkpoints" / "step-00000009").rename(run / "checkpoints" / "step-00000002")  # control: as it says
    assert train(_config(packed, run, resume="newest"))["steps"] == 6


@pytest.mark.parametrize(
    "cursor", [{"epoch": 0, "step_in_epoch": 10**9}, {"epoch": 10**9, "step_in_epoch": 0}, {"epoch": 0, "step_in_epoch": 1}]
)
def test_a_data_cursor_that_is_not_the_checkpoints_step_is_one_line(packed: Path, full: Path, tmp_path: Path, cursor: dict) -> None:
    run = _copy(full, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-00000006")
    shutil.rmtree(run / "checkpoints" / "step-00000004")
    checkpoint = run / "checkpoints" / "step-00000002"
    state = json.loads((checkpoint / ckpt.STATE_FILE).read_text())
    assert state["cursor"] == {"epoch": 0, "step_in_epoch": 2}  # what a real one holds
    state["cursor"] = cursor
    (checkpoint / ckpt.STATE_FILE).write_text(json.dumps(state))
    ckpt.write_file_list(checkpoint)  # the listing agrees: only the cursor is wrong
    before = tree(tmp_path)
    with pytest.raises(
        UserError,
        match=rf"its data cursor \(epoch {cursor['epoch']}, step {cursor['step_in_epoch']} "
        r"of that epoch\) is not where step 2 stands in .* \(epoch 0, step 2\)",
    ):
        train(_config(packed, run, resume="newest"))
    assert tree(tmp_path) == before


def test_another_model_or_a_damaged_checkpoint_is_one_line(packed: Path, full: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    other = tmp_path / "other-model"
    config = AutoConfig.from_pretrained(full / "checkpoints" / "step-00000002" / "model")
    config.intermediate_size *= 2
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    with pytest.raises(
        UserError,
        match=r"holds another model than model \(its intermediate_size is \d+, this "
        r"model's \d+\): resume with the model it was trained with \(tiny\)",
    ):
        train(_config(packed, tmp_path / "fork", model=str(other), resume=str(full / "checkpoints" / "step-00000002")))
    damaged = _copy(full, tmp_path / "damaged")
    weights = damaged / "checkpoints" / "step-00000004" / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(
        UserError,
        match=r"step-00000004: the checkpoint is damaged \(model/model.safetensors does "
        r"not match its sha256\): give another one",
    ):
        train(_config(packed, damaged, resume=str(damaged / "checkpoints" / "step-00000004")))
    assert not (damaged / "superseded").exists()
