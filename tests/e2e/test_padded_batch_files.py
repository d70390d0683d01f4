"""Axolotl and TRL files without packing (TRL's default `packing: false`, Axolotl without
`sample_packing: true`) train their padded batches exactly: pack-data packs each step's B examples
as one group (`--strategy minibatch --group-size B`, B = per-device batch x gradient_accumulation_steps)
and pack-train takes one group a step (`--step-by-group`); the gradient is a padded batch's
(tests/trainer/run/test_group_steps.py proves that). Here: the real example files, with only the
model and the data swapped, train end to end, and the combinations that would change the group are
one line each."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from click.testing import CliRunner
from test_foreign_recipes import DATA_FLAGS, LOCAL, ROOT, swapped

from pipeline.cli import pack_data
from trainer.cli import pack_train

TRAIN_FLAGS = ["--max-steps", "2", "--num-workers", "0", "--no-progress", "--log-every", "1"]


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_trls_example_without_packing_trains_groups_of_its_batch(tmp_path: Path):
    """examples/cli_configs/example_config.yaml gives no batch size and no packing: TRL's 8 padded
    examples a step."""
    cfg = swapped("trl/example_config.yaml", tmp_path)
    packed = CliRunner().invoke(
        pack_data,
        [
            "--config",
            str(cfg),
            str(LOCAL["completion"]),
            "--out",
            str(tmp_path / "packed"),
            "--tokenizer",
            str(ROOT / "data/tokenizer"),
            *DATA_FLAGS,
        ],
    )
    assert packed.exit_code == 0, packed.output
    assert "TRL: batches of 8 padded examples a step, trained as packed groups of those 8 (same gradient)" in packed.stderr
    manifest = _manifest(tmp_path / "packed")
    assert f"groups: {len(manifest['groups'])} of 8 examples" in packed.output
    assert (manifest["strategy"], manifest["group_size"], manifest["max_len"]) == ("minibatch", 8, 1024)
    assert sum(manifest["groups"]) == manifest["rows"] and len(manifest["groups"]) == -(-300 // 8)
    trained = CliRunner().invoke(
        pack_train, ["--config", str(cfg), "--data", str(tmp_path / "packed"), "--tokenizer", str(ROOT / "data/tokenizer"), *TRAIN_FLAGS]
    )
    assert trained.exit_code == 0, trained.output
    assert "TRL: batches of 8 padded examples a step" in trained.stderr and "stepping by group" in trained.stderr
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (saved["step_by_group"], saved["group_size"], saved["grad_accum"], saved["tokens_per_step"]) == (True, 8, 1, 8 * 1024)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "loss" in m] == [1, 2]

    # what would change the group is one line: --grad-accum on top, or a folder without groups
    again = [
        "--config",
        str(cfg),
        "--data",
        str(tmp_path / "packed"),
        "--tokenizer",
        str(ROOT / "data/tokenizer"),
        "--out",
        str(tmp_path / "accum"),
        *TRAIN_FLAGS,
    ]
    refused = CliRunner().invoke(pack_train, [*again, "--grad-accum", "2"])
    assert refused.exit_code != 0 and "--grad-accum 2 with stepping by group: a group is already" in refused.stderr
    assert "Traceback" not in refused.output and len(refused.stderr.strip().splitlines()[-1]) > 40
    plain = tmp_path / "plain"
    assert (
        CliRunner()
        .invoke(
            pack_data,
            [str(LOCAL["completion"]), "--tokenizer", str(ROOT / "data/tokenizer"), "--out", str(plain), "--max-len", "1024", *DATA_FLAGS],
        )
        .exit_code
        == 0
    )
    refused = CliRunner().invoke(
        pack_train,
        [
            "--config",
            str(cfg),
            "--data",
            str(plain),
            "--tokenizer",
            str(ROOT / "data/tokenizer"),
            "--out",
            str(tmp_path / "plain-run"),
            *TRAIN_FLAGS,
        ],
    )
    assert refused.exit_code != 0 and "has no groups (it was packed with --strategy ffd)" in refused.stderr
    assert not (tmp_path / "plain-run" / "metrics.jsonl").exists()


def test_an_axolotl_example_without_sample_packing_trains_groups(tmp_path: Path):
    """llama-3 lora-1b with sample_packing false: micro_batch_size 2 x gradient_accumulation_steps 2 is a
    group of 4 examples a step; with sample_packing true (the control) it is a token budget."""
    cfg = swapped("llama-3_lora-1b.yml", tmp_path)
    settings = yaml.safe_load(cfg.read_text())
    settings["sample_packing"] = False
    cfg.write_text(yaml.safe_dump(settings, sort_keys=False))
    packed = CliRunner().invoke(pack_data, ["--config", str(cfg), *DATA_FLAGS])
    assert packed.exit_code == 0, packed.output
    assert "  micro_batch_size: 2 -> --strategy minibatch --group-size 4" in packed.stderr
    manifest = _manifest(tmp_path / "prepared")
    assert (manifest["strategy"], manifest["group_size"]) == ("minibatch", 4)
    trained = CliRunner().invoke(pack_train, ["--config", str(cfg), *TRAIN_FLAGS])
    assert trained.exit_code == 0, trained.output
    assert "Axolotl: batches of 4 padded examples a step" in trained.stderr
    assert "gradient_accumulation_steps: 2: not used (padded batches" in trained.stderr
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (saved["step_by_group"], saved["group_size"], saved["grad_accum"]) == (True, 4, 1)

    settings["sample_packing"] = True  # control: packed rows, a token budget, accumulation as the file says
    cfg.write_text(yaml.safe_dump(settings, sort_keys=False))
    from pipeline.config_file import read_config_file
    from trainer.config import TRAIN_CHECKS

    got = read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train")
    assert (got["tokens_per_step"], got["grad_accum"], got.get("step_by_group")) == (4096, 2, None)
    assert "strategy" not in read_config_file(cfg, pack_data, foreign="pack-data")


def test_axolotls_excess_length_strategy_is_overlong(tmp_path: Path):
    """Axolotl drops examples past sequence_len unless excess_length_strategy says otherwise; TRL
    truncates them (pack-data's own default, nothing to set)."""
    import pytest

    from pipeline.config_file import read_config_file

    cfg = tmp_path / "a.yaml"
    for given, want in ((None, "drop"), ("drop", "drop"), ("truncate", "truncate"), ("raise", "error")):
        cfg.write_text("base_model: tiny\nsequence_len: 256\n" + (f"excess_length_strategy: {given}\n" if given else ""))
        assert read_config_file(cfg, pack_data, foreign="pack-data")["overlong"] == want, given
    cfg.write_text("base_model: tiny\nexcess_length_strategy: cut\n")
    with pytest.raises(Exception, match="excess_length_strategy.*'cut' has no equivalent here: give drop, truncate"):
        read_config_file(cfg, pack_data, foreign="pack-data")
    cfg.write_text("model_name_or_path: tiny\nmax_length: 256\n")
    assert "overlong" not in read_config_file(cfg, pack_data, foreign="pack-data")  # TRL: truncate, the default
