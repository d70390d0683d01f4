"""train() called from Python: its one-line errors name TrainConfig's parameters (resume='newest',
lora_r), while pack-train, which calls the same train(), names its flags."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from packed_factory import make_packed_folder, pack_lengths

from pipeline.api_errors import parameter_names
from pipeline.errors import UserError
from trainer import TrainConfig, train
from trainer.cli import pack_train

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_run_folder_with_checkpoints_tells_a_python_caller_to_set_resume(tmp_path: Path) -> None:
    packed = tmp_path / "packed"
    make_packed_folder(packed, pack_lengths(np.random.default_rng(0).integers(4, 40, size=20).tolist(), 64, vocab=300), 64)
    config = TrainConfig(
        data=str(packed), model="tiny", out=str(tmp_path / "run"), tokens_per_step=128, max_steps=1, num_workers=0, progress=False
    )
    train(config)
    with pytest.raises(UserError) as err:
        train(config)
    message = str(err.value)
    assert message == f"{tmp_path / 'run'} already holds checkpoints: pass resume='newest' to continue that run, or choose a new out", (
        message
    )
    assert "--" not in message
    cli = CliRunner().invoke(
        pack_train,
        [
            "--data",
            str(packed),
            "--model",
            "tiny",
            "--out",
            str(tmp_path / "run"),
            "--max-steps",
            "1",
            "--num-workers",
            "0",
            "--no-progress",
        ],
    )
    assert cli.exit_code == 1 and "pass --resume to continue that run, or choose a new --out" in cli.output, cli.output
    summary = train(TrainConfig(**{**config.__dict__, "resume": "newest", "max_steps": 2}))  # as the message says
    assert summary["steps"] == 2


def test_train_config_flags_are_spelled_as_parameters() -> None:
    spell = lambda text: parameter_names(text, TrainConfig)  # noqa: E731
    assert (
        spell("--merge-lora needs --lora-r (there is no adapter to merge)") == "merge_lora=True needs lora_r (there is no adapter to merge)"
    )
    assert (
        spell("--resume=strict: checkpoint c is damaged: use --resume to continue")
        == "resume='strict': checkpoint c is damaged: use resume='newest' to continue"
    )
    assert (
        spell("--no-verify-hashes skips it; --grad-checkpointing 2 is fine") == "verify_hashes=False skips it; grad_checkpointing 2 is fine"
    )


def test_running_out_of_gpu_memory_is_one_line_that_says_what_to_change(tmp_path: Path, monkeypatch) -> None:
    import torch

    import trainer.run.loop

    def no_memory(*_args, **_kwargs):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
            "of 79.19 GiB of which 10.00 MiB is free. Including non-PyTorch memory, ..."
        )

    monkeypatch.setattr(trainer.run.loop, "backward_window", no_memory)
    packed = tmp_path / "packed"
    make_packed_folder(packed, pack_lengths(np.random.default_rng(0).integers(4, 40, size=20).tolist(), 64, vocab=300), 64)
    with pytest.raises(UserError) as err:
        train(TrainConfig(data=str(packed), model="tiny", out=str(tmp_path / "run"), max_steps=1, num_workers=0, progress=False))
    message = str(err.value)
    assert message.startswith(
        "out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"
    ), message
    assert "lower tokens_per_step, recompute activations with grad_checkpointing" in message, message
    assert "tile_mlp 8192, offload_activations=True, or context_parallel N" in message, message
    cli = CliRunner().invoke(
        pack_train,
        [
            "--data",
            str(packed),
            "--model",
            "tiny",
            "--out",
            str(tmp_path / "run2"),
            "--max-steps",
            "1",
            "--num-workers",
            "0",
            "--no-progress",
        ],
    )
    errors = [line for line in cli.output.splitlines() if line.startswith("Error: ")]  # after the start-up lines
    assert cli.exit_code == 1 and cli.output.strip().endswith(errors[0]), cli.output
    assert errors[0].startswith("Error: out of GPU memory (") and "--activation-memory-budget 0.7" in errors[0]
    assert "Traceback" not in cli.output
