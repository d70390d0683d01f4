"""scripts/bench/bench_trl.py on the CPU (tiny model): TRL's SFTTrainer and pack-train train the same
examples with the same loss tokens, each path in its own subprocess. Skips where trl is not
installed or the shared data sets are absent (CI's venv has neither)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "bench"))
sys.path.insert(0, str(REPO))

import bench_trl  # noqa: E402

from scripts.benchlib import shared_dir  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None, reason="trl and datasets are not installed"
    ),
    pytest.mark.skipif(not (shared_dir() / "tokenizers" / "llama2").is_dir(), reason="../shared is absent"),
]


def test_tiny_cpu_trl_and_pack_train_same_examples(tmp_path: Path) -> None:
    payload = bench_trl.main(
        [
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--limit",
            "60",
            "--max-len",
            "512",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--paths",
            "trl+ckpt,packlm+ckpt",
            "--workdir",
            str(tmp_path),
            "--json",
            str(tmp_path / "out.json"),
            "--path-timeout",
            "300",
        ]
    )  # a hung child path ends as a timeout
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
    # both paths' FLOPs by the one count (pipeline.report.flops): TRL's from its batches' example
    # lengths, pack-train's as its metrics logged them
    for r in (trl, packlm):
        assert r["tflops"] > 0 and r["mfu"] == pytest.approx(r["tflops"] / 989.0) and 0 < r["attn_flop_share"] < 1
    assert set(payload["ratios"]) == {"packlm+ckpt"}
    assert payload["ratios"]["packlm+ckpt"]["trl_same_recompute"] == "trl+ckpt"
    assert (tmp_path / "out.json").is_file()


def test_path_names() -> None:
    assert bench_trl.parse_path("packlm+ckpt") == ("packlm", {"ckpt"})
    for bad in ("packlm+liger", "trl+ckpt+ckpt", "hf"):
        with pytest.raises(ValueError, match="expected trl"):
            bench_trl.parse_path(bad)


def test_lengths_ladder_same_rows_same_losses(tmp_path: Path) -> None:
    """--lengths: each path trains rows of one example at each length; TRL packs exactly those
    examples, and its loss on them is pack-train's (fp32 on the CPU)."""
    payload = bench_trl.main(
        [
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--lengths",
            "256,128",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--paths",
            "trl+ckpt,packlm+ckpt+long",
            "--workdir",
            str(tmp_path),
            "--path-timeout",
            "300",
        ]
    )
    assert payload["lengths"] == [128, 256]
    assert payload["longest"] == {"trl+ckpt": 256, "packlm+ckpt+long": 256}
    by = {(r["path"], r["length"]): r for r in payload["results"]}
    assert set(by) == {(p, n) for p in ("trl+ckpt", "packlm+ckpt+long") for n in (128, 256)}
    for n in (128, 256):
        trl, packlm = by["trl+ckpt", n], by["packlm+ckpt+long", n]
        assert trl["status"] == packlm["status"] == "ok"
        assert trl["dataset"]["same_examples"] and trl["dataset"]["folder"]["tokens"] == 2 * n
        assert trl["step_tokens"] == [n, n]
        assert abs(trl["final_loss"] - packlm["final_loss"]) <= 1e-5 * abs(packlm["final_loss"])
    assert payload["ratios_by_length"]["256"]["packlm+ckpt+long"]["trl_same_recompute"] == "trl+ckpt"


def test_lengths_ladder_stops_a_path_at_its_first_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tried = []

    def fake_run_path(a, path, folder):  # noqa: ANN001, ANN202
        tried.append((path, a.max_len))
        assert (folder / "manifest.json").is_file()
        fails = path == "trl" and a.max_len >= 64
        return {"path": path, "length": a.max_len, "status": "OOM" if fails else "ok", "tokens_per_s": 1.0}

    monkeypatch.setattr(bench_trl, "run_path", fake_run_path)
    a = bench_trl.argparse.Namespace(
        model="tiny",
        lengths="128,32,64",
        steps=2,
        warmup=1,
        seed=0,
        gpu_memory_gib=None,
        workdir=tmp_path,
        device="cpu",
        lora_r=0,
        max_len=0,
    )
    payload = bench_trl.run_lengths(a, ["trl", "packlm"])
    assert tried == [("trl", 32), ("packlm", 32), ("trl", 64), ("packlm", 64), ("packlm", 128)]
    assert payload["longest"] == {"trl": 32, "packlm": 128}
    # a negative control of the fake: with no failure, trl reaches the longest too
    tried.clear()
    payload = bench_trl.run_lengths(a, ["packlm", "packlm+ckpt"])
    assert payload["longest"] == {"packlm": 128, "packlm+ckpt": 128} and len(tried) == 6


def test_the_memory_cap_reaches_every_path() -> None:
    """--gpu-memory-gib is passed on to each path's subprocess (which caps its allocator with it);
    without it the child gets no cap."""
    import argparse

    base = dict(
        model="llama-8b",
        lora_r=16,
        max_len=65536,
        steps=1,
        warmup=0,
        lr=1e-5,
        seed=0,
        device="cuda",
        workdir=Path("w"),
        shared=Path("s"),
        no_compile=True,
    )
    capped = bench_trl.child_args(argparse.Namespace(**base, gpu_memory_gib=78.0), "trl+ckpt", Path("f"), Path("r"))
    assert capped[capped.index("--gpu-memory-gib") + 1] == "78.0"
    plain = bench_trl.child_args(argparse.Namespace(**base, gpu_memory_gib=None), "trl+ckpt", Path("f"), Path("r"))
    assert "--gpu-memory-gib" not in plain and plain[-1] == "--no-compile"
