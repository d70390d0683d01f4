"""End to end: `pack-data` on the embedded sample, then `pack-train --model tiny` lowers the loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from trainer.cli import pack_train

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data" / "sample" / "instructions.jsonl"
TOKENIZER = ROOT / "data" / "tokenizer"
LLAMA2 = ROOT.parent / "shared" / "tokenizers" / "llama2"

pytestmark = pytest.mark.skipif(
    not (SAMPLE.is_file() and (TOKENIZER / "tokenizer.json").is_file()),
    reason="embedded sample data not present",
)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # far faster than 2 contending threads for a model this small
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.cli import pack_data

    out = tmp_path_factory.mktemp("e2e") / "packed"
    result = CliRunner().invoke(pack_data, [str(SAMPLE), "--tokenizer", str(TOKENIZER), "--max-len", "1024", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow
def test_pack_data_then_pack_train_lowers_the_loss(packed: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [
        "--data",
        str(packed),
        "--model",
        "tiny",
        "--out",
        str(run),
        "--tokenizer",
        str(TOKENIZER),
        "--max-steps",
        "20",
        "--tokens-per-step",
        "1024",
        "--lr",
        "3e-3",
        "--warmup",
        "2",
        "--log-every",
        "1",
        "--num-workers",
        "1",
        "--no-progress",
    ]
    result = CliRunner().invoke(pack_train, args)
    assert result.exit_code == 0, result.output
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 21))
    losses = [m["loss"] for m in metrics]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.0, losses  # ln(4096) = 8.3 at random init; it must learn something
    for m in metrics:
        assert m["tokens_per_s"] > 0 and m["mfu"] is None and m["grad_norm"] > 0  # the CPU has no known peak
        assert m["attention"] == "sdpa" and m["peak_mem_gib"] > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["final_loss"] == losses[-1]
    assert "final loss" in result.output and summary["checkpoint"] in result.output

    # The checkpoint is a usable Hugging Face model folder, tokenizer included.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(summary["checkpoint"]) / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.vocab_size == 4096 and tokenizer.eos_token_id == 2


def test_cli_errors_are_one_line(packed: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(pack_train, ["--data", str(packed), "--model", "tiny", "--out", str(tmp_path / "r"), "--resume"])
    assert result.exit_code == 1
    assert "holds no checkpoint" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(pack_train, ["--data", str(packed), "--model", "no-such-preset", "--out", str(tmp_path / "r")])
    assert result.exit_code == 1 and "nor a Hub id" in result.output
    for bad, needle in (
        (["--device", "mps"], "use auto, cpu, cuda"),
        (["--seed", "-1"], "--seed"),
        (["--lr", "-1"], "--lr"),
        (["--peak-flops", "0"], "--peak-flops"),
    ):
        result = CliRunner().invoke(pack_train, ["--data", str(packed), "--model", "tiny", "--out", str(tmp_path / "r"), *bad])
        assert result.exit_code != 0 and needle in result.output and "Traceback" not in result.output
        assert not (tmp_path / "r").exists()


@pytest.mark.skipif(not LLAMA2.is_dir(), reason="../shared/tokenizers/llama2 not present")
def test_refuses_data_packed_with_another_tokenizer(packed: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        pack_train,
        ["--data", str(packed), "--model", "tiny", "--out", str(tmp_path / "r"), "--tokenizer", str(LLAMA2)],
    )
    assert result.exit_code == 1
    assert "fingerprint" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "r").exists()  # nothing half-written


def test_uris_for_the_data_or_the_run_folder_are_refused_in_one_line(packed: Path, tmp_path: Path) -> None:
    """pack-train reads and writes local folders: a URI is said to be one, not taken as a path
    (which made --out s3://b/run a local folder 's3:/b/run')."""
    from pipeline.errors import UserError
    from trainer import TrainConfig, train

    for args, option in (
        (["--data", "s3://bucket/packed", "--out", str(tmp_path / "r")], "--data"),
        (["--data", str(packed), "--out", "s3://bucket/run"], "--out"),
    ):
        result = CliRunner().invoke(pack_train, [*args, "--model", "tiny"])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"Invalid value for '{option}'" in result.output and "local folders only, not URIs" in result.output
    assert not (tmp_path / "r").exists() and not Path("s3:").exists()
    with pytest.raises(UserError, match="s3://bucket/packed: pack-train reads and writes local folders only"):
        train(TrainConfig(data="s3://bucket/packed", model="tiny", out=str(tmp_path / "r")))
    assert not (tmp_path / "r").exists()


def test_a_checkpoints_model_folder_continues_training_without_tokenizer(packed: Path, tmp_path: Path) -> None:
    """The checkpoint's model/ holds the tokenizer re-saved by save_pretrained (other files than
    data/tokenizer's): it is the tokenizer the data was packed with, so training continues from
    that folder alone. Negative control: the same folder with another EOS token is refused."""
    common = [
        "--data",
        str(packed),
        "--max-steps",
        "1",
        "--tokens-per-step",
        "1024",
        "--num-workers",
        "0",
        "--no-progress",
        "--no-verify-hashes",
    ]
    first = CliRunner().invoke(pack_train, [*common, "--model", "tiny", "--tokenizer", str(TOKENIZER), "--out", str(tmp_path / "first")])
    assert first.exit_code == 0, first.output
    model_dir = tmp_path / "first" / "checkpoints" / "step-00000001" / "model"
    assert (model_dir / "tokenizer.json").read_bytes() != (TOKENIZER / "tokenizer.json").read_bytes()
    again = CliRunner().invoke(pack_train, [*common, "--model", str(model_dir), "--out", str(tmp_path / "second")])
    assert again.exit_code == 0, again.output
    assert json.loads((tmp_path / "second" / "summary.json").read_text())["steps"] == 1

    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "eos_token": "<pad>"}))
    refused = CliRunner().invoke(pack_train, [*common, "--model", str(model_dir), "--out", str(tmp_path / "third")])
    assert refused.exit_code == 1 and "fingerprint" in refused.output and "Traceback" not in refused.output
