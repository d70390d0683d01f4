"""A checkpoint whose write fails (a full disk in torch.save or in safetensors, a write error) is one
line naming the checkpoint and the file, and leaves the checkpoints saved before exactly as they were
and no part of the new one; pack-train's run files are written whole or not at all."""

from __future__ import annotations

import errno
import hashlib
import sys
from pathlib import Path

import pytest
import torch
from small_disk import small_disk

from pipeline.errors import UserError
from trainer.model.load import load_model
from trainer.run import checkpoint as ckpt

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", vocab_size=300)


def save(run: Path, step: int, model) -> Path:  # noqa: ANN001
    optimizer = torch.optim.AdamW(model.parameters())
    return ckpt.save_checkpoint(
        run,
        step,
        model=model,
        model_state=None,
        optimizer_state=optimizer.state_dict(),
        scheduler_state={"step": step},
        trainer_state={"step": step},
    )


def tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def full_disk_in_torch_save(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.save

    def save_(obj, f, *a, **kw):  # noqa: ANN001, ANN202
        if str(f).endswith("optimizer.pt"):
            Path(f).write_bytes(b"\0" * 100)  # what was written before the disk filled up
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save_)


def full_disk_in_safetensors(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.modeling_utils as mu
    from safetensors import SafetensorError

    def save_(tensors, filename, *a, **kw):  # noqa: ANN001, ANN202
        Path(filename).write_bytes(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(mu, "safe_save_file", save_)


@pytest.mark.parametrize(
    "fault, file", [(full_disk_in_torch_save, "optimizer.pt"), (full_disk_in_safetensors, "model")], ids=["torch.save", "safetensors"]
)
@pytest.mark.parametrize("step", [2, 1], ids=["a new step", "the same step again"])
def test_a_full_disk_while_saving_is_one_line_and_keeps_the_previous_checkpoint(
    model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault, file: str, step: int
) -> None:  # noqa: ANN001
    first = save(tmp_path, 1, model)
    before = tree(tmp_path)
    fault(monkeypatch)
    with pytest.raises(UserError) as err:
        save(tmp_path, step, model)
    line = str(err.value)
    assert "\n" not in line and line.startswith("disk full: saving checkpoint "), line
    assert f"step-{step:08d} failed while writing .tmp-step-{step:08d}/{file}" in line, line
    assert "free some space" in line and "the checkpoints saved before are intact" in line, line
    assert tree(tmp_path) == before  # step 1 as it was, nothing of the failed save left
    assert ckpt.checkpoint_damage(first) is None
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == sorted(["latest", "step-00000001"])


def test_another_write_error_is_one_line_too(model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    real = torch.save

    def save_(obj, f, *a, **kw):  # noqa: ANN001, ANN202
        if str(f).endswith("scheduler.pt"):
            raise OSError(errno.EIO, "Input/output error", str(f))
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save_)
    with pytest.raises(
        UserError,
        match=r"saving checkpoint .*step-00000003 failed while writing "
        r"\.tmp-step-00000003/scheduler\.pt \(OSError: .*Input/output error",
    ):
        save(tmp_path, 3, model)
    assert not list((tmp_path / "checkpoints").iterdir())


def test_a_torch_stream_write_failure_is_one_line(model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """torch.save's own error for a failed write (no errno; the disk is not full here)."""
    real = torch.save

    def save_(obj, f, *a, **kw):  # noqa: ANN001, ANN202
        if str(f).endswith("optimizer.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save_)
    with pytest.raises(
        UserError,
        match=r"saving checkpoint .*step-00000002 failed while writing "
        r"\.tmp-step-00000002/optimizer\.pt \(RuntimeError: .*unexpected pos.*\): "
        r"check the disk",
    ):
        save(tmp_path, 2, model)
    assert not list((tmp_path / "checkpoints").iterdir())


def test_a_bug_in_the_saver_is_not_hidden(model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Negative control: an exception that is no write failure keeps its traceback (and the folder goes)."""

    def save_(obj, f, *a, **kw):  # noqa: ANN001, ANN202
        raise KeyError("a bug")

    monkeypatch.setattr(torch, "save", save_)
    with pytest.raises(KeyError):
        save(tmp_path, 1, model)
    assert not list((tmp_path / "checkpoints").iterdir())


def test_a_real_full_disk_in_torch_save_is_one_line(model, tmp_path: Path) -> None:  # noqa: ANN001
    """torch.save on a full file system raises a RuntimeError without an errno ("unexpected pos");
    a small tmpfs (needs root to mount, skipped otherwise) shows it is still named a full disk."""
    with small_disk(tmp_path / "small", "2m") as small:
        with pytest.raises(UserError, match=r"^disk full: saving checkpoint .*step-00000001 failed while writing"):
            ckpt.save_checkpoint(
                small, 1, model=model, model_state=None, scheduler_state={}, optimizer_state={"m": torch.zeros(1 << 20)}, trainer_state={}
            )  # 4 MiB
        assert not list((small / "checkpoints").iterdir())


# ------------------------------------------------------------------------- pack-train's run files


def test_config_json_is_written_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.config import TrainConfig
    from trainer.run.metrics import start_run_files

    def full(path: Path, text: str, encoding: str = "utf-8") -> int:
        path.write_bytes(b"")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    config = TrainConfig(data=str(tmp_path), model="tiny", out=str(tmp_path / "run"))
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError):
        start_run_files(tmp_path / "run", config, 1, None)
    assert not (tmp_path / "run").exists()  # the folder it made goes, with no empty config.json
    (tmp_path / "old").mkdir()
    with pytest.raises(OSError):
        start_run_files(tmp_path / "old", config, 1, None)
    assert list((tmp_path / "old").iterdir()) == []
    monkeypatch.undo()
    start_run_files(tmp_path / "run", config, 1, None)
    assert '"world_size": 1' in (tmp_path / "run" / "config.json").read_text()


def test_disk_full_lines_fit_each_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pack-verify and pack-report have no --out, and pack-train leaves its checkpoints: none of
    them says "choose another --out; nothing was left behind" as pack-data does."""
    from click.testing import CliRunner

    import pipeline.cli as pcli
    import trainer.cli as tcli

    def full(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise OSError(errno.ENOSPC, "No space left on device", "/x/f")

    monkeypatch.setattr(pcli, "verify_folder", full)
    monkeypatch.setattr(pcli, "_strategies", full)
    import trainer.run.loop

    monkeypatch.setattr(tcli, "open_data", lambda config: None)  # the empty folder passes the early check
    monkeypatch.setattr(trainer.run.loop, "train", full)
    (tmp_path / "d").mkdir()
    runs = {
        "pack-verify": CliRunner().invoke(pcli.pack_verify, [str(tmp_path / "d")]),
        "pack-report": CliRunner().invoke(pcli.pack_report, [str(tmp_path / "d")]),
        "pack-train": CliRunner().invoke(
            tcli.pack_train, ["--data", str(tmp_path / "d"), "--model", "tiny", "--out", str(tmp_path / "run")]
        ),
    }
    lines = {}
    for name, result in runs.items():
        assert result.exit_code == 1 and "Traceback" not in result.output, (name, result.output)
        lines[name] = result.output.strip()
        assert lines[name].startswith("Error: disk full while writing /x/f: free some space"), lines[name]
        assert "\n" not in lines[name] and "nothing was left behind" not in lines[name], lines[name]
    assert "--out" not in lines["pack-verify"] and "the packed folder was not changed" in lines["pack-verify"]
    assert "--out" not in lines["pack-report"] and "--json" in lines["pack-report"]
    assert "checkpoints saved before are intact" in lines["pack-train"]


def test_pack_train_out_below_a_regular_file_is_one_line(tmp_path: Path) -> None:
    import numpy as np
    from click.testing import CliRunner

    sys.path.insert(0, str(Path(__file__).parents[2]))
    from packed_factory import make_packed_folder, pack_lengths

    from trainer.cli import pack_train

    data = tmp_path / "packed"
    data.mkdir()
    make_packed_folder(data, pack_lengths(np.full(8, 20).tolist(), 64, vocab=300), 64, rows_per_shard=4)
    (tmp_path / "notes.txt").write_text("mine")
    out = tmp_path / "notes.txt" / "run"
    result = CliRunner().invoke(
        pack_train, ["--data", str(data), "--model", "tiny", "--out", str(out), "--max-steps", "1", "--no-progress", "--num-workers", "0"]
    )
    assert result.exit_code == 1 and not isinstance(result.exception, OSError), result.output
    assert result.output.strip().splitlines()[-1] == (
        f"Error: --out {out}: {tmp_path / 'notes.txt'} is a file, not a folder, so nothing can be written below it: choose another --out"
    ), result.output
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_resuming_drops_a_metrics_line_a_full_disk_cut_off(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from trainer.run.metrics import trim_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')
    trim_metrics(path, 2)
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n'
    assert "its last line was cut off" in capsys.readouterr().err
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 1.9}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl line 1: not a JSON metrics line"):
        trim_metrics(path, 2)
