"""The metrics line's MFU: divided by a known peak of the device, or by --peak-flops, never by
another device's peak (no MFU on the CPU unless a peak is given)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.config import TrainConfig
from trainer.run.metrics import Meter, known_peak_flops


def _logged(tmp_path: Path, **options: object) -> dict:
    config = TrainConfig(data="d", model="tiny", out=str(tmp_path), progress=False, **options)  # type: ignore[arg-type]
    with Meter(tmp_path, config, rank=0, world=1, device=torch.device("cpu"), n_params=1_000_000, backend="sdpa",
               start_step=0, total_steps=1, tokens_seen=0) as meter:
        meter.step([], 0.0, 1000)
        meter.log(1, 0, 2.0, 1e-3, 1.0)
    return json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])


def test_no_mfu_on_a_device_without_a_known_peak(tmp_path: Path) -> None:
    assert known_peak_flops(torch.device("cpu")) is None
    record = _logged(tmp_path)
    assert record["mfu"] is None and record["tokens_per_s"] > 0


def test_mfu_against_the_peak_given(tmp_path: Path) -> None:
    record = _logged(tmp_path, peak_flops=1e12)
    assert record["mfu"] == pytest.approx(6.0 * 1_000_000 * record["tokens_per_s"] / 1e12)


def test_mfu_of_a_lora_run_counts_no_weight_gradients_of_the_frozen_base(tmp_path: Path) -> None:
    """4 x params FLOPs per token with --lora-r (forward, and the input gradients only), not 6."""
    record = _logged(tmp_path, peak_flops=1e12, lora_r=8)
    assert record["mfu"] == pytest.approx(4.0 * 1_000_000 * record["tokens_per_s"] / 1e12)


def test_known_gpu_peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, peak in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                       ("NVIDIA GeForce RTX 4090", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert known_peak_flops(torch.device("cuda", 0)) == peak, name
