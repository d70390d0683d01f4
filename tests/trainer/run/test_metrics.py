"""The metrics line's MFU: divided by a known peak of the device, or by --peak-flops, never by
another device's peak (no MFU on the CPU unless a peak is given)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.report.flops import LayerShape, ModelShape
from trainer.config import TrainConfig
from trainer.data.batch import collate_flat
from trainer.run.metrics import Meter, known_peak_flops

# one layer of 1,000,000 weights, no head; one micro-batch of one 1,000-token example
SHAPE = ModelShape(layers=(LayerShape(params=1_000_000, heads=1, head_dim=1),), head_params=0)
FLOPS = 6.0 * 1_000_000 * 1000 + 12 * 1000 * 1001 // 2


def _logged(tmp_path: Path, **options: object) -> dict:
    config = TrainConfig(data="d", model="tiny", out=str(tmp_path), progress=False, **options)  # type: ignore[arg-type]
    ids = np.zeros(1000, np.int64)
    with Meter(
        tmp_path,
        config,
        rank=0,
        world=1,
        device=torch.device("cpu"),
        shape=SHAPE,
        backend="sdpa",
        start_step=0,
        total_steps=1,
        tokens_seen=0,
    ) as meter:
        meter.step([collate_flat(ids, ids, np.arange(1000), np.array([1000]))], 0.0, 1000)
        meter.log(1, 0, 2.0, 1e-3, 1.0)
    return json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])


def test_no_mfu_on_a_device_without_a_known_peak(tmp_path: Path) -> None:
    assert known_peak_flops(torch.device("cpu")) is None
    record = _logged(tmp_path)
    assert record["mfu"] is None and record["hfu"] is None and record["tokens_per_s"] > 0
    assert record["tflops"] == pytest.approx(FLOPS / record["step_time_s"] / 1e12)  # needs no peak


def test_mfu_against_the_peak_given(tmp_path: Path) -> None:
    """Model FLOPs (dense and attention, `pipeline.report.flops`) over the time and the peak."""
    record = _logged(tmp_path, peak_flops=1e12)
    assert record["mfu"] == pytest.approx(FLOPS / record["step_time_s"] / 1e12)
    assert record["hfu"] == record["mfu"]  # nothing recomputed


def test_known_gpu_peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, peak in (
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 4090", None),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert known_peak_flops(torch.device("cuda", 0)) == peak, name
