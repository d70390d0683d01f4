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
    assert result.exit_code == 1 and "--max-len" in result.stderr and "lots" in result.stderr
    assert str(cfg) in result.stderr and "key 'max-len'" in result.stderr and len(result.stderr.splitlines()) == 1
    missing = CliRunner().invoke(pack_data, ["--config", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 1 and "cannot read it" in missing.stderr


PACK_DATA_BASE = f"inputs: [{ROOT / 'data/sample/instructions.jsonl'}]\ntokenizer: {ROOT / 'data/tokenizer'}\n"


@pytest.mark.parametrize(("command", "text", "needle"), [
    (pack_data, "max-len: 1024.7\n", "key 'max-len': --max-len must be an integer, got 1024.7"),
    (pack_data, "max-len: 512\nseed: true\n", "key 'seed': --seed must be an integer, got True"),
    (pack_data, "max-len: 1\n", "key 'max-len': --max-len must be between 2 and 2147483647, got 1"),
    (pack_data, "max-len: 512\neval-fraction: 1.5\n", "key 'eval-fraction': --eval-fraction must be between 0 and 1"),
    (pack_data, "max-len: 512\nstrategy: best\n", "key 'strategy'"),
    (pack_data, "max-len: 512\nno-progress: 1\n", "key 'no-progress': --progress must be true or false, got 1"),
    (pack_data, "max-len: 512\nlimit: [5]\n", "key 'limit': --limit must be an integer, got [5]"),
    (pack_data, "max-len: 512\nmax_len: 1024\n", "'max-len' and 'max_len' both set --max-len: keep one"),
    (pack_data, "max-len: 512\nmax-len: 1024\n", "line 4: option 'max-len' is given twice: keep one"),
    (pack_train, "max-steps: 2.9\n", "key 'max-steps': --max-steps must be an integer, got 2.9"),
    (pack_train, "seed: true\n", "key 'seed': --seed must be an integer, got True"),
    (pack_train, "min-lr-ratio: 2\n", "key 'min-lr-ratio'"),
    (pack_train, "warmup: -1\n", "key 'warmup'"),
    (pack_train, "lr: 0\n", "key 'lr'"),
    (pack_train, "schedule: 5\n", "key 'schedule': --schedule must be text, got 5"),
    # integers past 64 bits, processes past any machine's cores, alias bombs: one line, at once
    (pack_data, "max-len: 3000000000\n", "key 'max-len': --max-len must be between 2 and 2147483647"),
    (pack_data, "max-len: 99999999999999999999\n", "key 'max-len': --max-len must be a 64-bit integer (at most 9223372036854775807"),
    (pack_data, "max-len: 512\nseed: 99999999999999999999\n", "key 'seed': --seed must be a 64-bit integer (at most 9223372036854775807"),
    (pack_data, "max-len: 512\nnum-proc: 3000000000\n", "key 'num-proc': --num-proc must be between 1 and 1024"),
    (pack_train, "seed: -99999999999999999999\n", "key 'seed': --seed must be a 64-bit integer"),
    (pack_train, "max-steps: 99999999999999999999\n", "key 'max-steps': --max-steps must be a 64-bit integer (at most 9223372036854775807"),
    (pack_train, "num-workers: 100000000\n", "key 'num-workers': --num-workers must be between 0 and 1024"),
    (pack_data, "max-len: 512\nseed: [" + ", ".join(
        ['&a ["x","x","x","x","x","x","x","x","x"]'] + [f"&{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]"
                                                       for i in range(9)]) + "]\n",
     "line 4: a YAML alias (*a) is not accepted in a config file: write the value out"),
    (pack_train, "x: &big [1, 2]\nseed: *big\n", "line 4: a YAML alias (*big) is not accepted"),
])
def test_a_value_the_flag_refuses_is_refused_in_the_file(tmp_path: Path, command, text: str, needle: str):
    """Not coerced (1024.7 -> 1024, true -> 1, 2.9 -> 2) and not last-wins: one line naming the file and key."""
    cfg = tmp_path / "bad.yaml"
    base = PACK_DATA_BASE if command is pack_data else f"data: {tmp_path}\nmodel: tiny\n"
    cfg.write_text(base + text)
    result = CliRunner().invoke(command, ["--config", str(cfg), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and str(cfg) in lines[0], result.stderr
    assert not (tmp_path / "o").exists()


def test_values_the_flags_take_are_read_from_the_file(tmp_path: Path):
    """Negative control: what the flags accept is accepted, text parsed as the flag's text."""
    from pipeline.engines.job import PACK_CHECKS
    from trainer.config import TRAIN_CHECKS

    cfg = tmp_path / "ok.yaml"
    cfg.write_text("inputs: a.jsonl\nmax-len: '512'\neval-fraction: 0.25\nseed: 3\nprogress: false\nstrategy:\n")
    assert read_config_file(cfg, pack_data, PACK_CHECKS) == {
        "inputs": ["a.jsonl"], "max_len": 512, "eval_fraction": 0.25, "seed": 3, "progress": False}
    cfg.write_text("lr: 1\nmin-lr-ratio: 1\nwarmup: 0\nmax_steps: 7\nno-progress: true\ngrad-checkpointing: 2\n"
                   "resume: true\nepochs: null\n")
    assert read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}) == {
        "lr": 1.0, "min_lr_ratio": 1.0, "warmup": 0, "max_steps": 7, "no_progress": True, "grad_checkpointing": 2,
        "resume": "newest"}
