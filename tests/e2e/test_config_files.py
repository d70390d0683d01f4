"""`--config FILE.yaml` for pack-data and pack-train: every option from the file, flags win, the
resolved options saved with the output, one line for a bad file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import pack_data
from pipeline.config_file import read_config_file
from trainer.cli import pack_train

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("name", "command"), [("pack-data.yaml", pack_data), ("pack-train.yaml", pack_train)])
def test_the_example_configs_name_only_real_options(name: str, command):
    settings = read_config_file(ROOT / "data" / "configs" / name, command)
    assert len(settings) >= 6 and "config" not in settings


def test_pack_data_takes_the_file_and_flags_win(tmp_path: Path):
    cfg = tmp_path / "pack.yaml"
    cfg.write_text(f"inputs: [{ROOT / 'data/sample/instructions.jsonl'}]\ntokenizer: {ROOT / 'data/tokenizer'}\n"
                   f"max_len: 512\nout: {tmp_path / 'from-file'}\nlimit: 50\nno-progress: true\nstrategy: bfd\n")
    result = CliRunner().invoke(pack_data, ["--config", str(cfg), "--max-len", "1024", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "o" / "manifest.json").read_text())["config"]  # the resolved options
    assert (config["max_len"], config["strategy"], config["limit"]) == (1024, "bfd", 50)
    assert not (tmp_path / "from-file").exists()


def test_pack_train_takes_the_file_and_saves_the_resolved_config(tmp_path: Path):
    packed = tmp_path / "packed"
    assert CliRunner().invoke(pack_data, [str(ROOT / "data/sample/instructions.jsonl"), "--tokenizer",
                                          str(ROOT / "data/tokenizer"), "--max-len", "512", "--out", str(packed),
                                          "--limit", "60", "--no-progress"]).exit_code == 0
    cfg = tmp_path / "train.yaml"
    cfg.write_text(f"data: {packed}\nmodel: tiny\nout: {tmp_path / 'run'}\ntokens-per-step: 1024\nmax_steps: 5\n"
                   "lr: 0.001\nno-progress: true\nnum-workers: 0\n")
    result = CliRunner().invoke(pack_train, ["--config", str(cfg), "--max-steps", "2"])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    saved = saved.get("config", saved)
    assert (saved["max_steps"], saved["lr"], saved["tokens_per_step"]) == (2, 0.001, 1024)


@pytest.mark.parametrize(("text", "needle"), [
    ("max-len: 512\nbogus: 1\n", "unknown option 'bogus'"),
    ("- a\n- b\n", "expected a mapping"),
    ("max-len: [1\n", "not valid YAML"),
])
def test_a_bad_config_file_is_one_line(tmp_path: Path, text: str, needle: str):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    result = CliRunner().invoke(pack_data, ["--config", str(cfg), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and str(cfg) in lines[0], result.stderr
    assert not (tmp_path / "o").exists()


def test_a_bad_value_in_the_file_is_refused_like_the_flag(tmp_path: Path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"inputs: [{ROOT / 'data/sample/instructions.jsonl'}]\ntokenizer: x\nmax-len: lots\nout: o\n")
    result = CliRunner().invoke(pack_data, ["--config", str(cfg)])
    assert result.exit_code == 2 and "--max-len" in result.stderr and "lots" in result.stderr
    missing = CliRunner().invoke(pack_data, ["--config", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 1 and "cannot read it" in missing.stderr
