"""Held-out evaluation: `pack-data --eval-fraction/--eval-examples` and `pack-train --eval-data`.

- the eval folder holds a seeded set of whole examples, never in the training folder, the same for
  any --num-proc, verified by pack-verify (with a negative control: an id in both is refused);
- pack-train's eval loss equals an independent computation over every eval example with the
  trained weights (plain transformers forward, each example alone).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import pack_data, pack_verify
from pipeline.engines.job import PackConfig, run_pack_data
from pipeline.errors import ShardFormatError, UserError
from pipeline.shards import iter_rows, read_manifest, verify_eval_folder, write_shard
from trainer import TrainConfig, train

sys.path.insert(0, str(Path(__file__).parents[2]))
from gloo_ranks import train_on_two_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = str(ROOT / "data" / "sample" / "instructions.jsonl")
TOKENIZER = str(ROOT / "data" / "tokenizer")

pytestmark = pytest.mark.usefixtures("one_thread")


def _pack(out: Path, num_proc: int = 1, **kw):
    return run_pack_data(
        PackConfig(inputs=[SAMPLE], tokenizer=TOKENIZER, max_len=512, out=str(out), limit=200, num_proc=num_proc, progress=False, **kw)
    )


def _ids(folder: Path) -> np.ndarray:
    return np.concatenate([r["example_ids"] for r in iter_rows(folder)])


def _digest(folder: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.rglob("shard-*.arrow")))).hexdigest()


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ev") / "packed"
    _pack(out, eval_fraction=0.1)
    return out


def test_the_eval_folder_holds_whole_examples_never_trained_on(packed: Path, tmp_path: Path):
    train_ids, eval_ids = _ids(packed), _ids(packed / "eval")
    assert len(np.unique(eval_ids)) == 20 and len(np.unique(train_ids)) == 180
    assert not set(train_ids.tolist()) & set(eval_ids.tolist())
    m = read_manifest(packed)
    assert m.eval == {"folder": "eval", "examples": 20} and read_manifest(packed / "eval").eval == {"role": "eval"}
    _pack(tmp_path / "two", num_proc=2, eval_fraction=0.1)
    assert _digest(tmp_path / "two") == _digest(packed)  # the same choice and bytes for any --num-proc
    result = CliRunner().invoke(pack_verify, [str(packed), "--deep", "--sample", "300"])
    assert result.exit_code == 0, result.output
    assert "eval ok: " in result.output and "20 examples re-tokenized" in result.output


def test_negative_control_an_example_in_both_folders_is_refused(packed: Path, tmp_path: Path):
    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    shard = copy / "eval" / read_manifest(copy / "eval").shards[0].file
    import pyarrow as pa

    table = pa.ipc.open_file(pa.OSFile(str(shard))).read_all()  # in memory: the file is rewritten below
    ids = table.column("example_ids").to_pylist()
    ids[0] = [int(_ids(copy)[0])] + ids[0][1:]  # an example id of the training folder
    table = table.set_column(4, table.schema.field(4), pa.array(ids, type=pa.list_(pa.int64())))
    write_shard(shard, table)
    with pytest.raises(ShardFormatError, match="in the eval folder and in the training folder"):
        verify_eval_folder(copy, read_manifest(copy), check_hashes=False)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--eval-fraction", "0.1", "--eval-examples", "5"], "not both"),
        (["--eval-fraction", "1.5"], "--eval-fraction must be between 0 and 1"),
        (["--eval-examples", "0"], "--eval-examples must be >= 1"),
        (["--eval-examples", "200"], "holds out 200 of the 200 packed examples"),
    ],
)
def test_bad_eval_options_are_one_line(tmp_path: Path, args: list[str], needle: str):
    out = tmp_path / "o"
    result = CliRunner().invoke(
        pack_data, [SAMPLE, "--tokenizer", TOKENIZER, "--max-len", "512", "--out", str(out), "--limit", "200", "--no-progress", *args]
    )
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert not out.exists()


def test_the_eval_loss_is_the_token_mean_over_every_eval_example(packed: Path, tmp_path: Path):
    summary = train(
        TrainConfig(
            data=str(packed),
            model="tiny",
            tokenizer=TOKENIZER,
            out=str(tmp_path / "run"),
            tokens_per_step=1024,
            max_steps=3,
            eval_every=2,
            lr=1e-3,
            num_workers=0,
            progress=False,
            log_every=1,
        )
    )
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 3] and evals[-1]["eval_loss"] == summary["eval_loss"]
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the curves

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(summary["checkpoint"]) / "model").eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in iter_rows(packed / "eval"):
            start = 0
            for n in row["seq_lens"].tolist():
                ids = torch.from_numpy(row["input_ids"][start : start + n].astype(np.int64))[None]
                labels = torch.from_numpy(row["labels"][start : start + n].astype(np.int64))
                logits = model(input_ids=ids).logits[0, :-1]
                target = labels[1:]
                keep = target != -100
                total += float(torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum"))
                count += int(keep.sum())
                start += n
    assert summary["eval_loss_tokens"] == count
    assert summary["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert summary["eval_ppl"] == pytest.approx(np.exp(total / count), rel=1e-5)


def test_eval_can_be_turned_off_or_pointed_elsewhere(packed: Path, tmp_path: Path):
    base = dict(data=str(packed), model="tiny", tokenizer=TOKENIZER, tokens_per_step=1024, max_steps=1, num_workers=0, progress=False)
    assert train(TrainConfig(out=str(tmp_path / "off"), eval_data="none", **base))["eval_loss"] is None
    assert train(TrainConfig(out=str(tmp_path / "on"), eval_data=str(packed / "eval"), **base))["eval_loss"] > 0


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_eval_loss_is_exact_across_ranks(packed: Path, tmp_path: Path, parallel: str):
    """Two gloo ranks, each evaluating its share (one of them a micro-batch short, so it runs a
    forward that does not count): both report the loss one process computes on the same weights."""
    config = TrainConfig(
        data=str(packed),
        model="tiny",
        tokenizer=TOKENIZER,
        out=str(tmp_path / "ddp"),
        tokens_per_step=600,
        max_steps=1,
        lr=1e-12,
        warmup=0,
        num_workers=0,
        progress=False,
        parallel=parallel,
    )  # the weights barely move (--lr must be > 0, as pack-train's)
    ranks = train_on_two_ranks(config, tmp_path)
    from dataclasses import replace

    single = train(replace(config, out=str(tmp_path / "single"), parallel="ddp"))
    assert ranks[0]["eval_loss"] == ranks[1]["eval_loss"]
    assert ranks[0]["eval_loss_tokens"] == single["eval_loss_tokens"]
    assert ranks[0]["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-6)


def test_save_best_keeps_the_checkpoint_with_the_lowest_eval_loss(packed: Path, tmp_path: Path):
    summary = train(
        TrainConfig(
            data=str(packed),
            model="tiny",
            tokenizer=TOKENIZER,
            out=str(tmp_path / "run"),
            tokens_per_step=1024,
            max_steps=6,
            eval_every=1,
            save_best=True,
            keep_last=1,
            lr=3e-2,
            num_workers=0,
            progress=False,
        )
    )  # a high rate: the eval loss goes up again
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "eval_loss" in r]
    best = min(evals, key=lambda r: r["eval_loss"])
    record = json.loads((tmp_path / "run" / "best.json").read_text())
    assert (record["step"], record["eval_loss"]) == (best["step"], best["eval_loss"])
    assert summary["best_eval_loss"] == best["eval_loss"]
    assert Path(summary["best_checkpoint"]).name == record["checkpoint"] and Path(summary["best_checkpoint"]).is_dir()
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert record["checkpoint"] in kept and kept[-1] == "step-00000006" and len(kept) <= 2  # --keep-last 1 + best


def test_tensorboard_event_files_hold_the_logged_scalars(packed: Path, tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(
        TrainConfig(
            data=str(packed),
            model="tiny",
            tokenizer=TOKENIZER,
            out=str(tmp_path / "run"),
            tokens_per_step=1024,
            max_steps=3,
            eval_every=3,
            log_every=1,
            num_workers=0,
            progress=False,
            report_to="tensorboard",
        )
    )
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    # the Hugging Face Trainer's tag names
    tags = {"loss": "train/loss", "lr": "train/learning_rate", "eval_loss": "eval/loss"}
    got = {key: [(e.step, e.value) for e in events.Scalars(tag)] for key, tag in tags.items()}
    assert got["loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records if "loss" in r]
    assert got["eval_loss"] == [(3, pytest.approx(records[-1]["eval_loss"], rel=1e-6))]
    assert len(got["lr"]) == 3


def test_pack_report_summarises_a_run_folder(packed: Path, tmp_path: Path):
    from pipeline.cli import pack_report

    summary = train(
        TrainConfig(
            data=str(packed),
            model="tiny",
            tokenizer=TOKENIZER,
            out=str(tmp_path / "run"),
            tokens_per_step=1024,
            max_steps=2,
            eval_every=1,
            save_best=True,
            log_every=1,
            num_workers=0,
            progress=False,
        )
    )
    result = CliRunner().invoke(pack_report, [str(tmp_path / "run"), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "pack-train run:" in result.output and "(finished)" in result.output and "best" in result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["kind"] == "run" and [e["step"] for e in report["evals"]] == [1, 2]
    assert report["summary"]["eval_loss"] == summary["eval_loss"] and report["plot"].endswith("loss.png")


def _losses(run: Path) -> list[tuple]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in records]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_data_replaced_under_a_running_train_is_never_read(packed: Path, tmp_path: Path, monkeypatch, num_workers: int):
    """pack-data --overwrite into --data after pack-train started: the run reads only the shards it
    checked at its start (training rows and the held-out eval alike), the same numbers as a run on
    an untouched copy."""
    import trainer.run.loop

    data, control = tmp_path / "data", tmp_path / "control"
    shutil.copytree(packed, data)
    shutil.copytree(packed, control)
    base = dict(
        model="tiny",
        tokenizer=TOKENIZER,
        tokens_per_step=1024,
        max_steps=3,
        eval_every=1,
        lr=1e-3,
        num_workers=num_workers,
        progress=False,
        log_every=1,
        verify_hashes=False,
    )
    train(TrainConfig(data=str(control), out=str(tmp_path / "control-run"), **base))
    start = trainer.run.loop.start

    def start_then_repack(config, opened=None):
        run = start(config, opened)
        _pack(data, eval_fraction=0.2, seed=7, overwrite=True)  # other rows, other eval examples
        return run

    monkeypatch.setattr(trainer.run.loop, "start", start_then_repack)
    train(TrainConfig(data=str(data), out=str(tmp_path / "run"), **base))
    assert _digest(data) != _digest(control)  # the folder was replaced
    assert _losses(tmp_path / "run") == _losses(tmp_path / "control-run")


def test_a_shard_replaced_before_it_is_hashed_or_mapped_again_stops_in_one_line(packed: Path, tmp_path: Path):
    import pickle

    from trainer.data.integrity import shard_problem
    from trainer.data.stream import ShardReader

    data = tmp_path / "data"
    shutil.copytree(packed, data)
    manifest = read_manifest(data)
    reader = ShardReader(data, manifest)
    shard = Path(reader.paths[0])
    assert shard_problem(shard, manifest.shards[0].sha256, reader.identities[0]) is None  # negative control
    _pack(data, eval_fraction=0.2, seed=7, overwrite=True)
    problem = shard_problem(shard, manifest.shards[0].sha256, reader.identities[0])
    assert problem.startswith(f"{shard} was replaced or changed after pack-train started") and "\n" not in problem
    assert reader.microbatch(np.arange(2)).n_loss_tokens > 0  # the mapped files are still read
    with pytest.raises(UserError, match="was replaced or changed after pack-train started"):
        pickle.loads(pickle.dumps(reader)).microbatch(np.arange(2))  # a process that maps them anew
