"""Seen from outside: `pack-train` on a local Hugging Face folder of a family with attention
features trains with exactly the loss of the model run example by example, or refuses the folder
in one line.

For a packed folder whose one step covers every row (CPU, --dtype fp32, --max-steps 1), the
step-1 `loss` and `grad_norm` in metrics.jsonl equal the stock eager model's token-mean loss over
the examples run alone, and the norm of its gradient."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from families import FAMILIES, ROPE_THRESHOLD, fresh_rope
from packed_factory import make_packed_folder

from pipeline.shards import iter_rows
from trainer.cli import pack_train

MAX_LEN = 96


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 rows of 2-4 examples (12-40 tokens, ids < 256), labels masking a 'prompt' of 3 tokens."""
    rng = np.random.default_rng(3)
    rows, example_id = [], 0
    for _ in range(6):
        row, used = [], 0
        while True:
            n = int(rng.integers(12, 41))
            if used + n > MAX_LEN:
                break
            ids = rng.integers(3, 256, n)
            labels = ids.copy()
            labels[0] = -100
            labels[4:7] = -100
            row.append((example_id, ids, labels))
            example_id += 1
            used += n
        rows.append(row)
    folder = tmp_path_factory.mktemp("families") / "packed"
    make_packed_folder(folder, rows, MAX_LEN, rows_per_shard=4)
    return folder


def stock_loss_and_grad_norm(model_dir: Path, packed: Path, fresh: bool = False) -> tuple[float, float]:
    """Token-mean loss of every example run alone through the stock eager model, and the norm of
    its gradient (`fresh`: each example on the RoPE state of a freshly built model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    model.train()
    total, count = torch.zeros(()), 0
    for row in iter_rows(packed):
        starts = np.concatenate([[0], np.cumsum(row["seq_lens"])])
        for s, e in zip(starts[:-1], starts[1:]):
            if fresh:
                fresh_rope(model)
            ids = torch.from_numpy(row["input_ids"][s:e].astype(np.int64))[None]
            labels = torch.from_numpy(row["labels"][s:e].astype(np.int64))
            logits = model(input_ids=ids).logits[0]
            total = total + F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100, reduction="sum")
            count += int((labels[1:] != -100).sum())
    loss = total / count
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss), float(norm)


# stablelm, nemotron: layers that do not pass keyword arguments to attention; the last three:
# position features computed per example past thresholds the data's examples and rows pass
@pytest.mark.parametrize(
    "name",
    ["gemma2", "gpt_oss", "llama4", "deepseek_v3", "stablelm", "nemotron", "llama-dynamic-rope", "phi3-longrope", "llama4-temperature"],
)
def test_step_one_loss_and_grad_norm_equal_the_stock_model_example_by_example(name: str, packed: Path, tmp_path: Path) -> None:
    family = next(f for f in FAMILIES if f.name == name)
    from transformers import CONFIG_MAPPING

    if family.model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no {family.model_type} here")
    model_dir = tmp_path / "model"
    family.build().save_pretrained(model_dir)
    run = tmp_path / "run"
    args = [
        "--data",
        str(packed),
        "--model",
        str(model_dir),
        "--out",
        str(run),
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--max-steps",
        "1",
        "--tokens-per-step",
        str(6 * MAX_LEN),
        "--log-every",
        "1",
        "--num-workers",
        "0",
        "--no-progress",
    ]
    result = CliRunner().invoke(pack_train, args)
    assert result.exit_code == 0, result.output
    if name in ("llama-dynamic-rope", "phi3-longrope", "llama4-temperature"):  # the data passes the threshold
        lengths = [n for row in iter_rows(packed) for n in row["seq_lens"]]
        assert max(lengths) > ROPE_THRESHOLD and min(lengths) < ROPE_THRESHOLD
    step = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert step["step"] == 1 and step["attention"] == "sdpa"
    loss, norm = stock_loss_and_grad_norm(model_dir, packed, family.fresh_alone)
    assert step["loss"] == pytest.approx(loss, rel=1e-5)
    assert step["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_a_family_that_leaks_across_examples_is_refused_in_one_line(packed: Path, tmp_path: Path) -> None:
    family = next(f for f in FAMILIES if f.name == "lfm2")
    model_dir = tmp_path / "model"
    family.build().save_pretrained(model_dir)
    run = tmp_path / "run"
    result = CliRunner().invoke(
        pack_train, ["--data", str(packed), "--model", str(model_dir), "--out", str(run), "--device", "cpu", "--no-progress"]
    )
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Lfm2ForCausalLM cannot be trained on packed rows" in lines[0], result.output
    assert "Traceback" not in result.output and not run.exists()
