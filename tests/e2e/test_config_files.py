"""`--config FILE.yaml` for pack-data and pack-train: every option from the file, flags win, the
resolved options saved with the output, one line for a bad file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import pack_data
from pipeline.config_file import read_config_file
from pipeline.foreign.keys import TRL_TRAINING
from trainer.cli import pack_train

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("name", "command"), [("pack-data.yaml", pack_data), ("pack-train.yaml", pack_train)])
def test_the_example_configs_name_only_real_options(name: str, command):
    settings = read_config_file(ROOT / "data" / "configs" / name, command)
    assert len(settings) >= 6 and "config" not in settings


def test_pack_data_takes_the_file_and_flags_win(tmp_path: Path):
    cfg = tmp_path / "pack.yaml"
    cfg.write_text(
        f"inputs: [{ROOT / 'data/sample/instructions.jsonl'}]\ntokenizer: {ROOT / 'data/tokenizer'}\n"
        f"max_len: 512\nout: {tmp_path / 'from-file'}\nlimit: 50\nno-progress: true\nstrategy: bfd\n"
    )
    result = CliRunner().invoke(pack_data, ["--config", str(cfg), "--max-len", "1024", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "o" / "manifest.json").read_text())["config"]  # the resolved options
    assert (config["max_len"], config["strategy"], config["limit"]) == (1024, "bfd", 50)
    assert not (tmp_path / "from-file").exists()


def test_pack_train_takes_the_file_and_saves_the_resolved_config(tmp_path: Path):
    packed = tmp_path / "packed"
    assert (
        CliRunner()
        .invoke(
            pack_data,
            [
                str(ROOT / "data/sample/instructions.jsonl"),
                "--tokenizer",
                str(ROOT / "data/tokenizer"),
                "--max-len",
                "512",
                "--out",
                str(packed),
                "--limit",
                "60",
                "--no-progress",
            ],
        )
        .exit_code
        == 0
    )
    cfg = tmp_path / "train.yaml"
    cfg.write_text(
        f"data: {packed}\nmodel: tiny\nout: {tmp_path / 'run'}\ntokens-per-step: 1024\nmax_steps: 5\n"
        "lr: 0.001\nno-progress: true\nnum-workers: 0\n"
    )
    result = CliRunner().invoke(pack_train, ["--config", str(cfg), "--max-steps", "2"])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    saved = saved.get("config", saved)
    assert (saved["max_steps"], saved["lr"], saved["tokens_per_step"]) == (2, 0.001, 1024)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("max-len: 512\nbogus: 1\n", "unknown option 'bogus'"),
        ("- a\n- b\n", "expected a mapping"),
        ("max-len: [1\n", "not valid YAML"),
    ],
)
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


@pytest.mark.parametrize(
    ("command", "text", "needle"),
    [
        (pack_data, "max-len: 1024.7\n", "key 'max-len': --max-len must be an integer, got 1024.7"),
        (pack_data, "max-len: 512\nseed: true\n", "key 'seed': --seed must be an integer, got True"),
        (pack_data, "max-len: 1\n", "key 'max-len': --max-len must be between 2 and 16777216, got 1"),
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
        (pack_data, "max-len: 3000000000\n", "key 'max-len': --max-len must be between 2 and 16777216"),
        (pack_data, "max-len: 99999999999999999999\n", "key 'max-len': --max-len must be a 64-bit integer (at most 9223372036854775807"),
        (
            pack_data,
            "max-len: 512\nseed: 99999999999999999999\n",
            "key 'seed': --seed must be a 64-bit integer (at most 9223372036854775807",
        ),
        (pack_data, "max-len: 512\nnum-proc: 3000000000\n", "key 'num-proc': --num-proc must be between 1 and 1024"),
        (pack_train, "seed: -99999999999999999999\n", "key 'seed': --seed must be a 64-bit integer"),
        (
            pack_train,
            "max-steps: 99999999999999999999\n",
            "key 'max-steps': --max-steps must be a 64-bit integer (at most 9223372036854775807",
        ),
        (pack_train, "num-workers: 100000000\n", "key 'num-workers': --num-workers must be between 0 and 1024"),
        (
            pack_data,
            "max-len: 512\nseed: ["
            + ", ".join(
                ['&a ["x","x","x","x","x","x","x","x","x"]']
                + [f"&{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]" for i in range(9)]
            )
            + "]\n",
            "line 4: a YAML alias (*a) is not accepted in a config file: write the value out",
        ),
        (pack_train, "x: &big [1, 2]\nseed: *big\n", "line 4: a YAML alias (*big) is not accepted"),
    ],
)
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
        "inputs": ["a.jsonl"],
        "max_len": 512,
        "eval_fraction": 0.25,
        "seed": 3,
        "progress": False,
    }
    cfg.write_text(
        "lr: 1\nmin-lr-ratio: 1\nwarmup: 0\nmax_steps: 7\nno-progress: true\ngrad-checkpointing: 2\nresume: true\nepochs: null\n"
    )
    assert read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}) == {
        "lr": 1.0,
        "min_lr_ratio": 1.0,
        "warmup": 0,
        "max_steps": 7,
        "no_progress": True,
        "grad_checkpointing": 2,
        "resume": "newest",
    }


# ---------------------------------------------------------------- Axolotl and TRL configs as they are


def axolotl_yaml(tmp_path: Path) -> str:
    """An Axolotl LoRA config as its examples write one (a CPU-sized model and row length)."""
    return f"""\
base_model: tiny
tokenizer_config: {ROOT / "data/tokenizer"}
model_type: AutoModelForCausalLM
tokenizer_type: AutoTokenizer
load_in_8bit: false
load_in_4bit: false
strict: false

chat_template: chatml
datasets:
  - path: {ROOT / "data/sample/chat.jsonl"}
    type: chat_template
    field_messages: messages
dataset_prepared_path: {tmp_path / "prepared"}
val_set_size: 0.05
output_dir: {tmp_path / "run"}

sequence_len: 512
sample_packing: true
pad_to_sequence_len: true

adapter: lora
lora_r: 8
lora_alpha: 16
lora_dropout: 0.05
lora_target_modules:
  - q_proj
  - v_proj

wandb_project:
wandb_entity:

gradient_accumulation_steps: 2
micro_batch_size: 2
num_epochs: 1
max_steps: 2
optimizer: adamw_torch
lr_scheduler: cosine
learning_rate: 0.0002
warmup_ratio: 0.1
weight_decay: 0.0

train_on_inputs: false
bf16: false
tf32: false
gradient_checkpointing: true
logging_steps: 1
flash_attention: false
saves_per_epoch: 1
seed: 7
special_tokens:
"""


TRL_YAML = """\
# trl sft --config sft.yaml
model_name_or_path: Qwen/Qwen2.5-0.5B
dataset_name: trl-lib/Capybara
dataset_train_split: train
learning_rate: 2.0e-5
num_train_epochs: 3.0
max_steps: -1
packing: true
max_length: 2048
per_device_train_batch_size: 4
gradient_accumulation_steps: 8
gradient_checkpointing: true
lr_scheduler_type: linear
warmup_ratio: 0.03
weight_decay: 0.01
optim: adamw_torch_fused
adam_beta2: 0.999
max_grad_norm: 0.5
logging_steps: 25
save_steps: 500
save_total_limit: 2
eval_strategy: "no"
bf16: true
report_to: [tensorboard]
output_dir: Qwen2.5-0.5B-SFT
use_peft: true
lora_r: 32
lora_target_modules: all-linear
assistant_only_loss: true
seed: 42
dataset_num_proc: 4
torch_dtype: bfloat16
attn_implementation: flash_attention_2
push_to_hub: false
"""


def test_an_axolotl_config_maps_key_by_key_for_both_commands(tmp_path: Path):
    from pipeline.engines.job import PACK_CHECKS
    from trainer.config import TRAIN_CHECKS

    cfg = tmp_path / "axolotl.yaml"
    cfg.write_text(axolotl_yaml(tmp_path))
    lines: list[str] = []
    train = read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train", mapping=lines)
    assert train == {
        "model": "tiny",
        "tokenizer": str(ROOT / "data/tokenizer"),
        "data": str(tmp_path / "prepared"),
        "out": str(tmp_path / "run"),
        "lora_r": 8,
        "lora_alpha": 16.0,
        "lora_dropout": 0.05,
        "lora_target": "q_proj,v_proj",
        "grad_accum": 2,
        "tokens_per_step": 1024,
        "max_steps": 2,
        "optimizer": "adamw",
        "schedule": "cosine",
        "min_lr_ratio": 0.0,
        "lr": 0.0002,
        "warmup_ratio": 0.1,
        "weight_decay": 0.0,
        "dtype": "fp32",
        "grad_checkpointing": 1,
        "log_every": 1,
        "seed": 7,
        "saves_per_epoch": 1,
        # Axolotl's defaults for what the file leaves out (transformers' for what Axolotl leaves None);
        # num_epochs is not used: max_steps decides the length, as there
        "beta1": 0.9,
        "beta2": 0.999,
        "adam_eps": 1e-8,
        "grad_clip": 1.0,
        "warmup_rule": "axolotl",
        "loss_average": "ranks",
    }
    text = "\n".join(lines)
    assert lines[0] == f"pack-train --config {cfg} (Axolotl keys):"
    assert "  learning_rate: 0.0002 -> --lr 0.0002" in lines
    assert "  micro_batch_size: 2 -> --tokens-per-step 1024" in lines
    assert "  lora_target_modules: q_proj,v_proj -> --lora-target q_proj,v_proj" in lines
    assert "  datasets: not used by pack-train: pack-data's: run pack-data --config with the same file" in lines
    # every key of the file that is not one of pack-train's own options is named once
    own = {"lora_alpha", "lora_dropout", "seed", "weight_decay", "max_steps"}
    assert lines[-1].startswith("  Axolotl defaults for the keys the file leaves out (Axolotl 0.19.0's schema): beta1 0.9, beta2 0.999"), (
        lines[-1]
    )
    named = {line.split(":")[0].strip() for line in lines[1:-1]}
    import yaml

    assert named == set(yaml.safe_load(cfg.read_text())) - own | {"max_steps"}, text
    assert "  wandb_project: (empty) -> (the defaults)" in lines

    lines = []
    data = read_config_file(cfg, pack_data, PACK_CHECKS, {"fmt": "format"}, foreign="pack-data", mapping=lines)
    assert data == {
        "tokenizer": str(ROOT / "data/tokenizer"),
        "chat_template": "chatml",
        "inputs": [str(ROOT / "data/sample/chat.jsonl")],
        "fmt": "chat",
        "messages_field": "messages",
        "out": str(tmp_path / "prepared"),
        "eval_fraction": 0.05,
        "max_len": 512,
        "train_on_prompt": False,
        "seed": 7,
        "overlong": "drop",  # Axolotl drops past sequence_len
        "min_len": 2,
    }  # and the examples of one token (min_sample_len's default)
    assert "  base_model: tiny: not used (tokenizer_config names the tokenizer)" in lines
    assert "  learning_rate: not used by pack-data: pack-train's: run pack-train --config with the same file" in lines


def test_a_trl_config_maps_key_by_key(tmp_path: Path):
    from trainer.config import TRAIN_CHECKS

    cfg = tmp_path / "sft.yaml"
    cfg.write_text(TRL_YAML)
    lines: list[str] = []
    train = read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train", mapping=lines)
    assert train == {
        "model": "Qwen/Qwen2.5-0.5B",
        "lr": 2e-5,
        "epochs": 3,
        "tokens_per_step": 4 * 2048,
        "grad_accum": 8,
        "grad_checkpointing": 1,
        "schedule": "linear",
        "min_lr_ratio": 0.0,
        "warmup_ratio": 0.03,
        "weight_decay": 0.01,
        "optimizer": "adamw",
        "beta2": 0.999,
        "grad_clip": 0.5,
        "log_every": 25,
        "save_every": 500,
        "keep_last": 2,
        "dtype": "bf16",
        "report_to": "tensorboard",
        "out": "Qwen2.5-0.5B-SFT",
        "lora_r": 32,
        "lora_alpha": 32.0,
        "lora_dropout": 0.05,
        "lora_target": "all",
        "seed": 42,
        "beta1": 0.9,
        "adam_eps": 1e-8,
    }  # TRL's defaults for what the file leaves out
    assert lines[0] == f"pack-train --config {cfg} (TRL keys):"
    assert "  max_steps: -1 -> (the defaults)" in lines
    assert "  use_peft: True -> --lora-alpha 32.0 --lora-dropout 0.05" in lines
    assert "  per_device_train_batch_size: 4 -> --tokens-per-step 8192" in lines
    assert any(line.startswith("  attn_implementation: not used by pack-train: the attention kernel") for line in lines)
    lines = []
    data = read_config_file(cfg, pack_data, None, None, foreign="pack-data", mapping=lines)
    assert data == {
        "tokenizer": "Qwen/Qwen2.5-0.5B",
        "inputs": ["trl-lib/Capybara:train"],
        "max_len": 2048,
        "train_on_prompt": False,
        "chat_template": TRL_TRAINING,  # assistant_only_loss: TRL's training version of a template it ships
        "seed": 42,
        "num_proc": 4,
    }


def test_pack_data_and_pack_train_run_an_axolotl_config_as_it_is(tmp_path: Path):
    """The same file for both commands, flags only for what a CPU test needs; the mapping is printed
    once, and the chat template it names is the data's and the checkpoints' tokenizer's."""
    cfg = tmp_path / "axolotl.yaml"
    cfg.write_text(axolotl_yaml(tmp_path))
    packed = CliRunner().invoke(pack_data, ["--config", str(cfg), "--no-progress", "--num-proc", "1"])
    assert packed.exit_code == 0, packed.output
    assert packed.stderr.count("pack-data --config") == 1 and "  sequence_len: 512 -> --max-len 512" in packed.stderr
    manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    assert manifest["max_len"] == 512 and manifest["tokenizer"]["chat_template"] == "chatml"
    assert (tmp_path / "prepared" / "eval" / "manifest.json").is_file()
    run = CliRunner().invoke(pack_train, ["--config", str(cfg), "--num-workers", "0", "--no-progress"])
    assert run.exit_code == 0, run.output
    assert run.stderr.count("pack-train --config") == 1
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    saved = saved.get("config", saved)
    assert (saved["lr"], saved["tokens_per_step"], saved["lora_target"], saved["warmup_ratio"]) == (0.0002, 1024, "q_proj,v_proj", 0.1)
    from pipeline.tokenize.chat_templates import NAMED
    from pipeline.tokenize.tokenizer import load_tokenizer

    checkpoint = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1] / "model"
    assert load_tokenizer(str(checkpoint)).chat_template == NAMED["chatml"]  # the data's template travels on


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        # padded batches (no packing) are groups of examples now (test_padded_batch_files.py); these are not
        (
            "micro_batch_size: 2\nsample_packing: true\n",
            "key 'micro_batch_size': 2 has no equivalent here: with sample_packing: true a batch of 2 rows is a token "
            "budget only with the row length: set sequence_len, or give tokens_per_step",
        ),
        ("per_device_train_batch_size: 0\n", "key 'per_device_train_batch_size': 0 has no equivalent here: give a whole number of rows"),
        ("num_epochs: 1.5\n", "key 'num_epochs': 1.5 has no equivalent here"),
        ("fp16: true\n", "key 'fp16': True has no equivalent here: pack-train does not train in float16: use bf16: true"),
        ("lr_scheduler: cosine_with_restarts\n", "key 'lr_scheduler': 'cosine_with_restarts' has no equivalent here"),
        ("optim: paged_adamw_16bit\n", "key 'optim': 'paged_adamw_16bit' has no equivalent here"),
        ("load_in_8bit: true\n", "an 8-bit base is not supported"),
        ("base_model: tiny\nlearning_rate: 0.1\nlr: 0.2\n", "'learning_rate' and 'lr' both set --lr: keep one"),
        (
            "base_model: tiny\nlora_model_dir: ./adapter\n",
            "key 'lora_model_dir': './adapter' is an Axolotl setting with no equivalent in pack-train: remove it",
        ),
        (
            "base_model: tiny\nlearning_rate: 0.1\nno_such_key_anywhere: 1\n",
            "unknown option 'no_such_key_anywhere': neither an option of pack-train nor an Axolotl key",
        ),
    ],
)
def test_an_axolotl_or_trl_value_without_an_exact_equivalent_is_one_line(tmp_path: Path, text: str, needle: str):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(f"data: {tmp_path}\nmodel: tiny\n" + text if "base_model" not in text else text)
    result = CliRunner().invoke(pack_train, ["--config", str(cfg), "--data", str(tmp_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and str(cfg) in lines[0], result.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("command", "args", "needle"),
    [
        (pack_train, ["--output_dir", "x"], "No such option: --output_dir: output_dir is the Axolotl/TRL name; here it is --out"),
        (pack_train, ["--learning_rate", "1"], "here it is --lr"),
        (pack_train, ["--max_steps", "3"], "options are spelled with dashes: --max-steps"),
        (pack_data, ["--sequence_len", "3"], "here it is --max-len"),
        (pack_train, ["--datasets", "x"], "datasets is an Axolotl/TRL key that pack-train does not use: pack-data's"),
    ],
)
def test_an_axolotl_or_trl_spelling_on_the_command_line_names_ours(command, args: list[str], needle: str):
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2 and needle in result.stderr and "Did you mean" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("text", "want", "said"),
    [
        (
            'fsdp: "full_shard auto_wrap offload"\n',
            {"parallel": "fsdp", "offload_states": True},
            "  fsdp: full_shard auto_wrap offload -> --parallel fsdp --offload-states True",
        ),
        (
            "fsdp: [full_shard, auto_wrap]\nfsdp_config: {fsdp_offload_params: true}\n",
            {"parallel": "fsdp", "offload_states": True},
            "  fsdp_config: {'fsdp_offload_params': True} -> --offload-states True",
        ),
        (
            "fsdp: [full_shard, offload]\nfsdp_config: {offload_params: true}\n",  # said once: no "both set" refusal
            {"parallel": "fsdp", "offload_states": True},
            "fsdp's offload sets --offload-states already",
        ),
        # negative controls: FSDP without offloading; an fsdp_config without it is named as not used
        (
            "fsdp: full_shard auto_wrap\nfsdp_config: {offload_params: false, sync_module_states: true}\n",
            {"parallel": "fsdp"},
            "  fsdp_config: {'offload_params': False, 'sync_module_states': True}: not used (FSDP2 wraps",
        ),
    ],
)
def test_fsdp_cpu_offload_in_a_trl_or_axolotl_config_is_offload_states(tmp_path: Path, text: str, want: dict, said: str):
    from trainer.config import TRAIN_CHECKS

    cfg = tmp_path / "f.yaml"
    cfg.write_text(text)
    lines: list[str] = []
    assert read_config_file(cfg, pack_train, TRAIN_CHECKS, foreign="pack-train", mapping=lines) == want
    assert any(said in line for line in lines), lines


def test_a_yaml_list_of_lora_targets_is_taken(tmp_path: Path):
    from trainer.config import TRAIN_CHECKS

    cfg = tmp_path / "t.yaml"
    cfg.write_text("lora_target_modules: [q_proj, k_proj]\nlora_r: 4\n")
    assert read_config_file(cfg, pack_train, TRAIN_CHECKS, foreign="pack-train")["lora_target"] == "q_proj,k_proj"
    cfg.write_text("lora-target: [q_proj, v_proj]\nlora-r: 4\n")  # our own option, as a list too
    assert read_config_file(cfg, pack_train, TRAIN_CHECKS)["lora_target"] == "q_proj,v_proj"


def test_the_page_lists_every_mapped_key_as_the_code_maps_it():
    """docs/from-trl-axolotl.md holds the table `foreign_config.markdown_table` writes from KEYS."""
    from pipeline.foreign.config import KEYS, markdown_table

    page = (ROOT / "docs" / "from-trl-axolotl.md").read_text()
    assert markdown_table() in page
    for key in KEYS:
        assert f"| `{key.name}` |" in page


def test_axolotl_kernel_compile_and_logging_keys_are_named_or_mapped(tmp_path: Path):
    """Keys of Axolotl 0.19.0's own examples that change no number here -- fused kernels
    (flash_attn_rms_norm, flash_attn_fuse_mlp, fused_attn_kernel), how torch.compile runs
    (torch_compile_mode, flex_attn_compile_kwargs), how weights load (low_cpu_mem_usage), metrics
    loggers (use_swanlab, use_otel_metrics) -- are named as not used with why; use_tensorboard is
    --report-to tensorboard; tokenizer_use_fast true is Axolotl's default, false is refused (a slow
    tokenizer may split text otherwise). Control: an unknown key is still refused."""
    base = (
        "base_model: m\nsequence_len: 256\nflash_attn_rms_norm: true\nflash_attn_fuse_mlp: true\n"
        "fused_attn_kernel: true\ntorch_compile_mode: max-autotune\nflex_attn_compile_kwargs: {dynamic: false}\n"
        "low_cpu_mem_usage: true\nuse_swanlab: true\nuse_otel_metrics: true\ntokenizer_use_fast: true\n"
    )
    cfg = tmp_path / "a.yaml"
    cfg.write_text(base + "use_tensorboard: true\n")
    mapping: list[str] = []
    got = read_config_file(cfg, pack_train, foreign="pack-train", mapping=mapping)
    assert got["report_to"] == "tensorboard"
    said = "\n".join(mapping)
    for key in ("flash_attn_rms_norm", "fused_attn_kernel", "torch_compile_mode", "low_cpu_mem_usage", "use_swanlab"):
        assert f"{key}: " in said and "not used" in said.split(f"{key}: ", 1)[1].splitlines()[0], key
    assert read_config_file(cfg, pack_data, foreign="pack-data") is not None
    cfg.write_text(base.replace("tokenizer_use_fast: true", "tokenizer_use_fast: false"))
    with pytest.raises(Exception, match="tokenizer_use_fast.*fast tokenizer"):
        read_config_file(cfg, pack_data, foreign="pack-data")
    cfg.write_text(base + "flash_attn_made_up_key: true\n")
    with pytest.raises(Exception, match="flash_attn_made_up_key"):
        read_config_file(cfg, pack_train, foreign="pack-train")


def test_a_trl_recipe_of_open_r1s_kind_maps_its_schedule_eos_and_logging_keys(tmp_path: Path):
    """Keys of the `trl sft` recipes people run (open-r1's): lr_scheduler_type cosine_with_min_lr with
    lr_scheduler_kwargs min_lr_rate (or min_lr over the learning rate) is our cosine ending at that
    share; eos_token is pack-data's --special-token eos_token; log_level, use_liger_kernel,
    save_only_model, hub_always_push, overwrite_output_dir and pad_token change no number and are
    named. Controls: cosine_with_min_lr without its kwargs, and other scheduler kwargs, are refused."""
    base = (
        "model_name_or_path: m\nlearning_rate: 4.0e-05\nlr_scheduler_type: cosine_with_min_lr\n"
        "log_level: info\nuse_liger_kernel: true\nsave_only_model: true\nhub_always_push: true\n"
        "overwrite_output_dir: true\neos_token: <|im_end|>\npad_token: <|endoftext|>\n"
    )
    cfg = tmp_path / "r1.yaml"
    cfg.write_text(base + "lr_scheduler_kwargs: {min_lr_rate: 0.1}\n")
    got = read_config_file(cfg, pack_train, foreign="pack-train")
    assert (got["schedule"], got["min_lr_ratio"]) == ("cosine", 0.1)
    assert read_config_file(cfg, pack_data, foreign="pack-data")["special_tokens"] == {"eos_token": "<|im_end|>"}
    cfg.write_text(base + "lr_scheduler_kwargs: {min_lr: 4.0e-06}\n")
    assert read_config_file(cfg, pack_train, foreign="pack-train")["min_lr_ratio"] == pytest.approx(0.1)
    # without learning_rate, min_lr is a share of TRL's default 2e-5 (SFTConfig), not transformers' 5e-5
    cfg.write_text(base.replace("learning_rate: 4.0e-05\n", "") + "lr_scheduler_kwargs: {min_lr: 4.0e-06}\n")
    assert read_config_file(cfg, pack_train, foreign="pack-train")["min_lr_ratio"] == pytest.approx(0.2)
    cfg.write_text(base)
    with pytest.raises(Exception, match="cosine_with_min_lr.*min_lr_rate or min_lr"):
        read_config_file(cfg, pack_train, foreign="pack-train")
    cfg.write_text(base.replace("cosine_with_min_lr", "cosine") + "lr_scheduler_kwargs: {num_cycles: 2}\n")
    with pytest.raises(Exception, match="lr_scheduler_kwargs"):
        read_config_file(cfg, pack_train, foreign="pack-train")


@pytest.mark.parametrize("tool", ["trl", "axolotl"])
def test_a_model_revision_reaches_model_and_tokenizer_as_name_at_revision(tmp_path: Path, tool: str):
    """TRL's model_revision and Axolotl's revision_of_model: the model (pack-train) and its tokenizer
    (pack-data) as NAME@REVISION, the form --model and --tokenizer take; a local folder stays as it
    is (from_pretrained ignores a revision there too). TRL's do_train / do_eval / ddp_timeout and
    packing_strategy bfd are named; packing_strategy wrapped is refused (it cuts examples)."""
    name, rev = ("model_name_or_path", "model_revision") if tool == "trl" else ("base_model", "revision_of_model")
    extra = "do_train: true\ndo_eval: true\nddp_timeout: 18000\npacking_strategy: bfd\n" if tool == "trl" else ""
    cfg = tmp_path / "a.yaml"
    cfg.write_text(f"{name}: org/model\n{rev}: v1.0\n{extra}")
    assert read_config_file(cfg, pack_train, foreign="pack-train")["model"] == "org/model@v1.0"
    assert read_config_file(cfg, pack_data, foreign="pack-data")["tokenizer"] == "org/model@v1.0"
    (tmp_path / "local").mkdir()
    cfg.write_text(f"{name}: {tmp_path / 'local'}\n{rev}: v1.0\n")
    assert read_config_file(cfg, pack_train, foreign="pack-train")["model"] == str(tmp_path / "local")
    if tool == "trl":
        cfg.write_text(f"{name}: org/model\npacking_strategy: wrapped\n")
        with pytest.raises(Exception, match="packing_strategy.*wrapped"):
            read_config_file(cfg, pack_data, foreign="pack-data")
