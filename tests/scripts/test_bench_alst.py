"""scripts/bench/bench_alst.py on the CPU, without a GPU and (in CI) without ArcticTraining: the rows
it hands ArcticTraining are the packed folder's ids and labels exactly, a folder of packed rows is
refused, the YAML is ALST's one-GPU recipe (LoRA on ZeRO-1, the full fine-tune on ZeRO-3 with both
offloads), the 8B config keeps the preset's shape for transformers 4.x, `setup` leaves folders it
did not make alone, and a child past its deadline is ended with its whole process group. The data
source registered with ArcticTraining is checked where arctic_training is importable."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "bench"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import bench_alst  # noqa: E402
from packed_factory import make_packed_folder  # noqa: E402

from pipeline.shards import iter_rows  # noqa: E402
from scripts.benchlib.alst_results import summarize  # noqa: E402
from scripts.benchlib.alst_source import read_rows  # noqa: E402
from scripts.benchlib.packing import write_long_folder  # noqa: E402


def test_rows_reach_arctic_training_as_written(tmp_path: Path) -> None:
    folder = tmp_path / "long"
    write_long_folder(folder, 96, 3, seed=5, vocab=700)
    arrays, lengths, loss_tokens, vocab = bench_alst.read_packed_rows(folder)
    assert (lengths, loss_tokens, vocab) == ([96, 96, 96], 3 * 95, None)
    np.savez(tmp_path / "rows.npz", **arrays)  # as `run` writes them
    rows = read_rows(tmp_path / "rows.npz")
    written = list(iter_rows(folder))
    assert rows["input_ids"] == [row["input_ids"].tolist() for row in written]
    assert rows["labels"] == [row["labels"].tolist() for row in written]
    assert all(labels[0] == -100 and -100 not in labels[1:] for labels in rows["labels"])  # loss on all but the first


def test_a_folder_of_packed_rows_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "packed"
    make_packed_folder(folder, [[(0, [5, 6, 7])], [(1, [8, 9]), (2, [10, 11, 12])]], max_len=8)
    with pytest.raises(SystemExit) as exc:
        bench_alst.read_packed_rows(folder)
    assert "row 1 packs 2 examples" in str(exc.value) and "\n" not in str(exc.value)
    one = tmp_path / "one"  # negative control: the same examples one a row pass
    make_packed_folder(one, [[(0, [5, 6, 7])], [(1, [8, 9])], [(2, [10, 11, 12])]], max_len=8)
    assert bench_alst.read_packed_rows(one)[1] == [3, 2, 3]


def test_not_a_packed_folder_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_alst.read_packed_rows(tmp_path)
    assert str(exc.value).startswith(f"error: --data {tmp_path}") and "\n" not in str(exc.value)


def _args(**kw: object) -> argparse.Namespace:
    base = dict(model_type="liger", attn="flash_attention_2", lora_r=16, steps=3, seed=0, lr=1e-5, zero_stage=1)
    return argparse.Namespace(**{**base, **kw})


def test_recipe_is_alst_one_gpu_llama_8b(tmp_path: Path) -> None:
    lora = bench_alst.recipe(_args(), tmp_path, tmp_path / "model", tmp_path / "tok", 131072)
    assert lora["model"]["peft_config"]["target_modules"] == bench_alst.LORA_TARGETS
    assert (lora["model"]["peft_config"]["r"], lora["model"]["peft_config"]["lora_alpha"]) == (16, 16)
    assert lora["deepspeed"]["zero_optimization"] == {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    for key in ("activation_checkpoint_cpu_offload", "tiled_mlp_compute"):
        assert lora[key] is True
    assert (lora["sequence_parallel_size"], lora["micro_batch_size"], lora["optimizer"]["type"]) == (1, 1, "cpu_adam")
    assert (lora["model"]["type"], lora["model"]["attn_implementation"]) == ("liger", "flash_attention_2")
    data = lora["data"]
    assert (data["max_length"], data["div_length"], data["sources"][0]["process"]) == (131072, 1, False)  # no padding, no template
    full = bench_alst.recipe(_args(lora_r=0, zero_stage=3), tmp_path, tmp_path / "model", tmp_path / "tok", 131072)
    assert "peft_config" not in full["model"]
    assert full["deepspeed"]["zero_optimization"]["offload_param"] == {"device": "cpu"}


def test_8b_config_for_transformers_4() -> None:
    config = bench_alst.model_config_json("llama-8b", None)
    assert config["rope_theta"] == 500000.0  # transformers 5 keeps it in rope_parameters; 4.x reads it here
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
    assert tuple(config[k] for k in shape) == (4096, 32, 32, 8, 14336, 128256)
    assert (config["model_type"], config["tie_word_embeddings"]) == ("llama", False)
    assert bench_alst.model_config_json("llama-8b", 32000)["vocab_size"] == 32000


def test_setup_leaves_foreign_folders_alone(tmp_path: Path) -> None:
    carry = tmp_path / "carry"
    (carry / "wheels").mkdir(parents=True)
    with pytest.raises(SystemExit, match="no wheels in"):
        bench_alst.setup(carry, tmp_path / "site")
    (carry / "wheels" / "x-1.0-py3-none-any.whl").write_bytes(b"")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="was not made by this script"):
        bench_alst.setup(carry, theirs)
    assert (theirs / "keep.txt").read_text() == "mine"


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan killed here may wait for a PID 1 that does
    not reap it: dead, but still listed in /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_child_past_its_deadline_is_ended_with_its_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    script = f"sleep 300 & echo $! > {pid_file}; wait"
    start = time.monotonic()
    peaks: dict[str, int] = {}
    rc, timed_out = bench_alst.run_child(["sh", "-c", script], dict(os.environ), tmp_path / "log", start + 5, peaks)
    assert timed_out and rc is not None
    assert peaks["host_used_mib"] > 0  # sampled while it ran
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _running(grandchild):
        time.sleep(0.1)
    assert not _running(grandchild)  # the background sleep went with the group
    rc, timed_out = bench_alst.run_child(["sh", "-c", "exit 3"], dict(os.environ), tmp_path / "log", time.monotonic() + 60)
    assert (rc, timed_out) == (3, False)  # negative control: a child that ends in time keeps its code


def test_tokens_per_second_leave_out_the_first_step() -> None:
    steps = [{"loss": 9.0, "step_time": 50.0, "seqlen": 100.0}, {"loss": 8.0, "step_time": 2.0, "seqlen": 100.0}]
    steps.append({"loss": 7.0, "step_time": 3.0, "seqlen": 100.0, "step_tflops": 4.0})
    summary = summarize(steps)
    assert summary["tokens_per_s"] == pytest.approx(200 / 5)
    assert (summary["loss_first"], summary["loss_last"], summary["timed_steps"]) == (9.0, 7.0, 2)


@pytest.mark.skipif(importlib.util.find_spec("arctic_training") is None, reason="arctic_training is not installed")
def test_arctic_training_source_yields_the_rows(tmp_path: Path) -> None:
    from arctic_training.registry import get_registered_data_source

    folder = tmp_path / "long"
    write_long_folder(folder, 64, 2, vocab=500)
    np.savez(tmp_path / "rows.npz", **bench_alst.read_packed_rows(folder)[0])
    from scripts.benchlib import alst_source as module  # imported above: its classes registered then

    assert get_registered_data_source(module.SOURCE_NAME) is not None
    config = module.PackedRowsConfig(type="packlm_rows", path=tmp_path / "rows.npz", process=False)
    dataset = module.PackedRowsSource.load(object.__new__(module.PackedRowsSource), config, "train")
    written = list(iter_rows(folder))
    assert dataset["input_ids"] == [row["input_ids"].tolist() for row in written]
    assert dataset["labels"] == [row["labels"].tolist() for row in written]
    assert np.asarray(dataset["labels"]).dtype == np.int64


def test_alst_mfu_is_pack_trains_count_of_the_timed_rows() -> None:
    """The timed steps (the first is not) counted by pipeline.report.flops as pack-train counts a
    recomputed LoRA run of one example a row: its attention from the row's length; none untimed."""
    from pipeline.report.flops import step_flops
    from scripts.benchlib.alst_results import counted_flops
    from scripts.benchlib.train_results import flop_shape
    from trainer.model.load import preset_config

    a = argparse.Namespace(model="tiny", lora_r=4)
    got = counted_flops(a, None, [96, 64], {"timed_steps": 1, "step_time_s_mean": 2.0})
    flops = step_flops(flop_shape(preset_config("tiny"), 4, 1), [64], loss_tokens=63)  # the second row: the timed step's
    assert got["mfu"] == pytest.approx(flops.model / 2.0 / 989e12)
    assert got["attn_flop_share"] == pytest.approx(flops.attention / flops.model) and got["attn_flop_share"] > 0
    assert counted_flops(a, None, [96, 64], {"timed_steps": 0}) == {}  # nothing timed: nothing claimed
