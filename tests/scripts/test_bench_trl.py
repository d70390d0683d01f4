"""scripts/bench_trl.py on the CPU (tiny model): TRL's SFTTrainer and pack-train train the same
examples with the same loss tokens, each path in its own subprocess. Skips where trl is not
installed or the shared data sets are absent (CI's venv has neither)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import bench_trl  # noqa: E402
from benchlib import shared_dir  # noqa: E402

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None,
                       reason="trl and datasets are not installed"),
    pytest.mark.skipif(not (shared_dir() / "tokenizers" / "llama2").is_dir(), reason="../shared is absent"),
]


def test_tiny_cpu_trl_and_pack_train_same_examples(tmp_path: Path) -> None:
    payload = bench_trl.main(["--model", "tiny", "--device", "cpu", "--limit", "60", "--max-len", "512",
                              "--steps", "3", "--warmup", "1", "--paths", "trl+ckpt,packlm+ckpt",
                              "--workdir", str(tmp_path), "--json", str(tmp_path / "out.json"),
                              "--path-timeout", "300"])  # a hung child path ends as a timeout
    trl, packlm = payload["results"]
    assert [trl["status"], packlm["status"]] == ["ok", "ok"], payload["results"]
    data = payload["data"]
    # TRL packed exactly the folder's examples, tokens and loss tokens (its own BFD rows of <= 512)
    assert trl["dataset"]["same_examples"]
    for key in ("examples", "tokens", "loss_tokens"):
        assert trl["dataset"]["trl_packed"][key] == trl["dataset"]["folder"][key] == data[key]
    assert data["examples"] == 120  # 60 from each data set
    # both trained the same number of steps of at most --max-len tokens each, and timed the last two
    assert trl["steps"] == packlm["steps"] == 3
    assert trl["timed_steps"] == packlm["timed_steps"] == 2
    assert all(0 < n <= 512 for n in trl["step_tokens"])
    assert 0 < trl["loss_tokens"] <= sum(trl["step_tokens"])
    assert trl["tokens_per_s"] > 0 and packlm["tokens_per_s"] > 0
    assert set(payload["ratios"]) == {"packlm+ckpt"}
    assert payload["ratios"]["packlm+ckpt"]["trl_same_recompute"] == "trl+ckpt"
    assert (tmp_path / "out.json").is_file()


def test_path_names() -> None:
    assert bench_trl.parse_path("packlm+ckpt") == ("packlm", {"ckpt"})
    for bad in ("packlm+liger", "trl+ckpt+ckpt", "hf"):
        with pytest.raises(ValueError, match="expected trl"):
            bench_trl.parse_path(bad)
