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
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import pack_data, pack_verify
from pipeline.errors import ShardFormatError
from pipeline.job import PackConfig, run_pack_data
from pipeline.shards import iter_rows, read_manifest, verify_eval_folder, write_shard
from trainer import TrainConfig, train

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = str(ROOT / "data" / "sample" / "instructions.jsonl")
TOKENIZER = str(ROOT / "data" / "tokenizer")


def _pack(out: Path, num_proc: int = 1, **kw):
    return run_pack_data(PackConfig(inputs=[SAMPLE], tokenizer=TOKENIZER, max_len=512, out=str(out), limit=200,
                                    num_proc=num_proc, progress=False, **kw))


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


@pytest.mark.parametrize(("args", "needle"), [
    (["--eval-fraction", "0.1", "--eval-examples", "5"], "not both"),
    (["--eval-fraction", "1.5"], "--eval-fraction must be between 0 and 1"),
    (["--eval-examples", "0"], "--eval-examples must be >= 1"),
    (["--eval-examples", "200"], "holds out 200 of the 200 packed examples"),
])
def test_bad_eval_options_are_one_line(tmp_path: Path, args: list[str], needle: str):
    out = tmp_path / "o"
    result = CliRunner().invoke(pack_data, [SAMPLE, "--tokenizer", TOKENIZER, "--max-len", "512", "--out", str(out),
                                            "--limit", "200", "--no-progress", *args])
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert not out.exists()


def test_the_eval_loss_is_the_token_mean_over_every_eval_example(packed: Path, tmp_path: Path):
    torch.set_num_threads(1)
    summary = train(TrainConfig(data=str(packed), model="tiny", tokenizer=TOKENIZER, out=str(tmp_path / "run"),
                                tokens_per_step=1024, max_steps=3, eval_every=2, lr=1e-3, num_workers=0,
                                progress=False, log_every=1))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 3] and evals[-1]["eval_loss"] == summary["eval_loss"]

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
    base = dict(data=str(packed), model="tiny", tokenizer=TOKENIZER, tokens_per_step=1024, max_steps=1,
                num_workers=0, progress=False)
    assert train(TrainConfig(out=str(tmp_path / "off"), eval_data="none", **base))["eval_loss"] is None
    assert train(TrainConfig(out=str(tmp_path / "on"), eval_data=str(packed / "eval"), **base))["eval_loss"] > 0
