"""--offload-states (FSDP2's CPU offload): each rank's shards, gradients and optimizer states live in
CPU memory. On two gloo ranks, data-parallel or one --context-parallel 2 group, it trains exactly as
FSDP2 without it (the same losses, step by step),
every layer and the root are sharded with the offload policy (negative control: without the flag,
none is), a run stopped and resumed from its checkpoint ends where an uninterrupted one does, and
the option is refused in one line where it cannot run. On a GPU the process group then carries a
gloo backend for the CPU tensors (the gradient norm's all-reduce) beside NCCL."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gloo_ranks import train_on_two_ranks
from packed_factory import random_packed_folder
from run_metrics import logged_losses

from pipeline.errors import UserError
from trainer import TrainConfig, train
from trainer.config import validate
from trainer.distributed.parallel import process_group_backend

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def config(tmp_path: Path) -> TrainConfig:
    data = random_packed_folder(tmp_path / "data", 96, count=48, low=4, high=60, seed=5)
    return TrainConfig(
        data=str(data),
        model="tiny",
        out=str(tmp_path / "run"),
        tokens_per_step=192,
        max_steps=3,
        parallel="fsdp",
        lr=1e-3,
        num_workers=0,
        progress=False,
        device="cpu",
        log_every=1,
        eval_data="none",
    )


def _spy_on_fully_shard(monkeypatch, record: Path) -> None:
    """Each call of FSDP2's fully_shard (in the forked ranks) appends its offload policy's class."""
    import torch.distributed.fsdp as fsdp

    real = fsdp.fully_shard

    def spy(module, **kwargs):
        with open(record, "a") as out:
            out.write(type(kwargs.get("offload_policy")).__name__ + "\n")
        return real(module, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", spy)


@pytest.mark.parametrize("cp", [1, 2])
def test_fsdp_with_offloaded_states_trains_as_without(config: TrainConfig, tmp_path: Path, monkeypatch, cp: int) -> None:
    """Two ranks as data-parallel FSDP2 (cp 1) or as one context-parallel group sharing each row (cp 2)."""
    config = replace(config, context_parallel=cp)
    calls = tmp_path / "fully_shard.calls"
    for name in ("plain-ranks", "offload-ranks"):
        (tmp_path / name).mkdir()
    _spy_on_fully_shard(monkeypatch, calls)
    plain = train_on_two_ranks(replace(config, out=str(tmp_path / "plain")), tmp_path / "plain-ranks")
    plain_calls = calls.read_text().split()
    calls.unlink()
    offload = train_on_two_ranks(replace(config, out=str(tmp_path / "offload"), offload_states=True), tmp_path / "offload-ranks")
    assert plain[0]["steps"] == offload[0]["steps"] == 3
    assert logged_losses(tmp_path / "offload") == pytest.approx(logged_losses(tmp_path / "plain"), rel=1e-6)
    layers = 2  # the tiny preset's decoder layers, then the root, on each of two ranks
    assert calls.read_text().split() == ["CPUOffloadPolicy"] * (2 * (layers + 1))
    assert plain_calls == ["OffloadPolicy"] * (2 * (layers + 1))  # negative control


def test_a_resumed_run_with_offloaded_states_ends_where_an_uninterrupted_one_does(config: TrainConfig, tmp_path: Path) -> None:
    offloaded = replace(config, offload_states=True)
    for name in "abc":
        (tmp_path / name).mkdir()
    whole = train_on_two_ranks(replace(offloaded, out=str(tmp_path / "whole")), tmp_path / "a")
    train_on_two_ranks(replace(offloaded, out=str(tmp_path / "part"), stop_at=2), tmp_path / "b")
    resumed = train_on_two_ranks(replace(offloaded, out=str(tmp_path / "part"), resume="newest"), tmp_path / "c")
    assert resumed[0]["steps"] == 3
    assert resumed[0]["final_loss"] == pytest.approx(whole[0]["final_loss"], rel=1e-6)


def test_offloaded_states_are_refused_where_they_cannot_run(config: TrainConfig) -> None:
    validate(config)
    validate(replace(config, offload_states=True))  # negative control: FSDP2, bf16 or fp32
    with pytest.raises(UserError, match="--offload-states needs --parallel fsdp"):
        validate(replace(config, offload_states=True, parallel="ddp"))
    with pytest.raises(UserError, match="--offload-states does not combine with --dtype fp8"):
        validate(replace(config, offload_states=True, dtype="fp8"))
    with pytest.raises(UserError, match="runs under torchrun: torchrun --nproc-per-node N"):
        train(replace(config, offload_states=True))  # one process, no torchrun


def test_the_process_group_carries_gloo_for_cpu_tensors_beside_nccl() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert process_group_backend(cuda) == "nccl"
    assert process_group_backend(cuda, cpu_collectives=True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend(cpu) == process_group_backend(cpu, cpu_collectives=True) == "gloo"
