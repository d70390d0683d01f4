"""Hostile Axolotl and TRL files (issue 70's foreign-config cases): a file that asks for LoRA never
trains every weight instead, booleans and lists never stand in for numbers and names, `data_files`
never packs a local file of the working folder, and values of the wrong shape, nested thousands of
levels deep or 100,000 characters long are one line naming the key and the file, with nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import pack_data
from pipeline.config_file import read_config_file
from trainer.cli import pack_train
from trainer.config import TRAIN_CHECKS

ROOT = Path(__file__).resolve().parents[2]
AXOLOTL = "base_model: tiny\nlearning_rate: 0.0002\n"
TRL = "model_name_or_path: tiny\n"


def one_line(command, cfg: Path, tmp_path: Path) -> str:
    """The command's one error line for `cfg`; nothing written to --out."""
    result = CliRunner().invoke(command, ["--config", str(cfg), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(cfg) in lines[0] and "Traceback" not in result.output, result.output
    assert not (tmp_path / "o").exists()
    return lines[0]


def mapped(command, cfg: Path) -> dict:
    if command is pack_train:
        return read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train")
    return read_config_file(cfg, pack_data, foreign="pack-data")


@pytest.mark.parametrize(
    ("text", "needle", "control", "want"),
    [
        # Axolotl has no default rank: a LoRA file without lora_r must not become a full fine-tune
        (
            AXOLOTL + "adapter: lora\n",
            "key 'adapter': 'lora' has no equivalent here: Axolotl takes the adapters' rank from lora_r, which the file leaves out",
            AXOLOTL + "adapter: lora\nlora_r: 8\n",
            {"lora_r": 8},
        ),
        (
            AXOLOTL + "adapter: qlora\nload_in_4bit: true\nlora_r: 0\n",
            "lora_r",
            AXOLOTL + "adapter: qlora\nload_in_4bit: true\nlora_r: 4\n",
            {"lora_r": 4, "qlora": True},
        ),
        # TRL: use_peft with a rank of 0 asks for adapters of no rank
        (
            TRL + "use_peft: true\nlora_r: 0\n",
            "key 'lora_r': 0 has no equivalent here: the file asks for LoRA adapters",
            TRL + "use_peft: true\n",
            {"lora_r": 16, "lora_alpha": 32.0, "lora_dropout": 0.05, "lora_target": "default"},
        ),
        # a file that does not ask for adapters trains every weight, as its tool would, whatever lora_r says
        (AXOLOTL + "adapter: lora\nlora_r: true\n", "key 'lora_r'", AXOLOTL + "adapter:\nlora_r: 8\n", {}),
    ],
)
def test_a_file_that_asks_for_lora_never_trains_every_weight(tmp_path: Path, text: str, needle: str, control: str, want: dict):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert needle in one_line(pack_train, cfg, tmp_path)
    cfg.write_text(control)
    got = mapped(pack_train, cfg)
    assert {k: got.get(k) for k in ("lora_r", "qlora", "lora_alpha", "lora_dropout", "lora_target") if k in want or k == "lora_r"} == {
        "lora_r": None,
        **want,
    }


@pytest.mark.parametrize(
    ("command", "text", "needle"),
    [
        (
            pack_train,
            AXOLOTL + "micro_batch_size: 2\nsample_packing: true\nsequence_len: true\n",
            "key 'micro_batch_size': its sequence_len: True has no equivalent here: it is a row length",
        ),
        (pack_data, AXOLOTL + "sequence_len: true\n", "key 'sequence_len': --max-len must be an integer, got True"),
        (pack_data, TRL + "max_length: 1024.5\n", "key 'max_length'"),
        (pack_data, TRL + "max_length: null\n", "key 'max_length': null: TRL then cuts no example"),
        (pack_train, AXOLOTL + "num_epochs: true\n", "key 'num_epochs': True has no equivalent here: give a number"),
        (pack_train, AXOLOTL + "context_parallel_size: true\n", "key 'context_parallel_size'"),
    ],
)
def test_a_boolean_where_a_number_goes_is_refused(tmp_path: Path, command, text: str, needle: str):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert needle in one_line(command, cfg, tmp_path)


def test_data_files_never_pack_a_same_named_file_of_the_working_folder(tmp_path: Path, monkeypatch):
    """Axolotl's data_files select files of the dataset at `path`: of a Hub dataset they are files of its
    repo (hf://datasets/...), never the working folder's file of that name. Control: inside a local
    dataset folder they are that folder's files."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"text": "the working folder\'s own file"}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(AXOLOTL + "datasets:\n  - path: some-org/some-dataset\n    type: completion\n    data_files: train.jsonl\n")
    assert mapped(pack_data, cfg)["inputs"] == ["hf://datasets/some-org/some-dataset/train.jsonl"]
    local = tmp_path / "local-dataset"
    local.mkdir()
    (local / "train.jsonl").write_text('{"text": "the dataset\'s file"}\n')
    cfg.write_text(AXOLOTL + f"datasets:\n  - path: {local}\n    type: completion\n    data_files: [train.jsonl]\n")
    assert mapped(pack_data, cfg)["inputs"] == [str(local / "train.jsonl")]
    cfg.write_text(AXOLOTL + f"datasets:\n  - path: {local}\n    type: completion\n    data_files: ../train.jsonl\n")
    assert "it leads outside" in one_line(pack_data, cfg, tmp_path)


@pytest.mark.parametrize(
    ("command", "text", "needle"),
    [
        # integers where names go
        (pack_data, AXOLOTL + "datasets:\n  - path: org/ds\n    name: 2024\n", "datasets[0] name: 2024 is int where a name goes"),
        (pack_data, TRL + "dataset_name: org/ds\ndataset_config: 2024\n", "dataset_config: 2024 is int where a name goes"),
        (pack_data, TRL + "dataset_name: 2024\n", "key 'dataset_name': dataset_name: 2024 is int where a name goes"),
        # lists or mappings where a scalar goes
        (pack_data, AXOLOTL + "datasets:\n  - path: org/ds\n    type: [alpaca]\n", "datasets[0] type: ['alpaca'] is list"),
        (pack_data, AXOLOTL + "datasets:\n  - path: org/ds\n    split: [train]\n", "datasets[0] split: ['train'] is list"),
        (pack_data, TRL + "datasets:\n  - path: org/ds\n    split: {a: 1}\n", "datasets[0] split: {'a': 1} is dict"),
        (pack_train, AXOLOTL + "lr_scheduler: [cosine]\n", "key 'lr_scheduler': ['cosine'] has no equivalent here"),
        (pack_train, TRL + "lr_scheduler_type: {cosine: 1}\n", "key 'lr_scheduler_type': {'cosine': 1} has no equivalent"),
        (pack_train, AXOLOTL + "optimizer: {adamw_torch: 1}\n", "key 'optimizer': {'adamw_torch': 1} has no equivalent"),
        (pack_train, TRL + "optim: [adamw_torch]\n", "key 'optim': ['adamw_torch'] has no equivalent here"),
        (pack_train, TRL + "report_to: [[wandb]]\n", "key 'report_to'"),
        (pack_data, AXOLOTL + "chat_template: 2024\n", "key 'chat_template': --chat-template must be text"),
        (pack_data, AXOLOTL + "special_tokens: [eos]\n", "key 'special_tokens': ['eos'] has no equivalent here"),
    ],
)
def test_a_value_of_the_wrong_shape_is_one_line_naming_key_and_file(tmp_path: Path, command, text: str, needle: str):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert needle in one_line(command, cfg, tmp_path)


@pytest.mark.parametrize("command", [pack_train, pack_data])
@pytest.mark.parametrize("where", ["top", "dataset"])
def test_a_value_nested_thousands_of_levels_deep_is_one_line(tmp_path: Path, command, where: str):
    deep = "[" * 5000 + "]" * 5000
    cfg = tmp_path / "c.yaml"
    cfg.write_text(AXOLOTL + (f"optimizer: {deep}\n" if where == "top" else f"datasets:\n  - path: org/ds\n    split: {deep}\n"))
    assert "nested too deeply" in one_line(command, cfg, tmp_path)


def test_an_error_line_quoting_a_long_value_is_cut(tmp_path: Path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(AXOLOTL + f"optimizer: {'x' * 100_000}\nlr_scheduler: {'y' * 100_000}\n")
    line = one_line(pack_train, cfg, tmp_path)
    assert len(line) < 1200 and "key 'optimizer'" in line and "key 'lr_scheduler'" in line
    assert "characters" in line  # says what was cut


def test_every_key_that_cannot_be_honoured_is_named_at_once(tmp_path: Path):
    """One run names all of them (never one run per key); keys at their tool's default are not among
    them (control)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        AXOLOTL + "fp16: true\nlora_model_dir: ./adapter\nunfrozen_parameters: ^lm_head.*\n"
        "ddp_find_unused_parameters: false\nlora_model_dir_unused_default:\nrl: dpo\n"
        "eval_sample_packing: false\nloss_watchdog_threshold: 5.0\n"
        "plugins: [axolotl.integrations.liger.LigerPlugin]\n"
    )
    line = one_line(pack_train, cfg, tmp_path)
    assert "keys cannot be honoured here (all named at once)" in line
    for key in ("fp16", "lora_model_dir", "unfrozen_parameters", "rl", "lora_model_dir_unused_default"):
        assert f"key '{key}'" in line, key
    for key in ("ddp_find_unused_parameters", "eval_sample_packing", "loss_watchdog_threshold", "plugins"):
        assert f"key '{key}'" not in line, key


def test_a_plugin_that_changes_the_run_is_refused(tmp_path: Path):
    """Spectrum freezes layers: refused; Cut Cross Entropy and Liger compute the same (control)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        AXOLOTL + "plugins:\n  - axolotl.integrations.spectrum.SpectrumPlugin\n"
        "  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin\n"
    )
    line = one_line(pack_train, cfg, tmp_path)
    assert "key 'plugins': ['axolotl.integrations.spectrum.SpectrumPlugin'] has no equivalent here" in line
    cfg.write_text(AXOLOTL + "plugins: [axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin]\n")
    lines: list[str] = []
    read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train", mapping=lines)
    assert any(line.startswith("  plugins: ") and "not used (kernels that compute the same" in line for line in lines)
