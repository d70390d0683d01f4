"""Real Axolotl and TRL example configs (tests/data/foreign_configs, copied unchanged from those
projects) train end to end with only the model and the data swapped for local ones, and the run's
config.json holds the recipe the source tool would have used: the file's values, and the tool's own
defaults for what it leaves out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import pack_data
from pipeline.config_file import read_config_file
from trainer.cli import pack_train
from trainer.config import TRAIN_CHECKS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "tests" / "data" / "foreign_configs"
LOCAL = {
    "alpaca": ROOT / "data/sample/instructions.jsonl",
    "chat_template": ROOT / "data/sample/chat.jsonl",
    "completion": ROOT / "data/sample/text.jsonl",
}
# what a CPU test needs on the command line (flags win over the file): two small steps, few examples
TRAIN_FLAGS = ["--max-steps", "2", "--num-workers", "0", "--no-progress", "--tokens-per-step", "2048", "--grad-accum", "1"]
SIZED = ("tokens_per_step", "grad_accum")  # what the flags above replace: compared with the file's mapping
DATA_FLAGS = ["--no-progress", "--num-proc", "1", "--limit", "300"]


@pytest.fixture(scope="module")
def nf4_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer Llama over the project's tokenizer whose decoder weights NF4 can store (QLoRA)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    pytest.importorskip("torchao.quantization")
    folder = tmp_path_factory.mktemp("nf4-model")
    vocab = len(AutoTokenizer.from_pretrained(ROOT / "data/tokenizer"))
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=vocab,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
    ).save_pretrained(folder)
    return str(folder)


def swapped(name: str, tmp_path: Path, model: str = "tiny") -> Path:
    """The example `name` with what a migrating user changes: the model (the tiny preset, with the
    project's tokenizer), the data (a local file of the same kind) and the output folders."""
    settings = yaml.safe_load((EXAMPLES / ("" if "/" in name else "axolotl") / name).read_text())
    model_key = "base_model" if "base_model" in settings else "model_name_or_path"
    settings[model_key] = model
    if model_key == "base_model":
        settings["tokenizer_config"] = str(ROOT / "data/tokenizer")
        settings["dataset_prepared_path"] = str(tmp_path / "prepared")
        for entry in settings.get("datasets") or []:
            kind = str(entry.get("type", "chat_template")).split(":")[0]
            entry["path"] = str(LOCAL[kind])
            for key in ("split", "data_files", "field_messages", "field"):  # they named the Hub dataset's parts
                entry.pop(key, None)
    else:
        settings.pop("dataset_name", None)
        settings.pop("datasets", None)
    settings["output_dir"] = str(tmp_path / "run")
    from pipeline.tokenize.chat_templates import NAMED

    if settings.get("chat_template") not in (None, *NAMED):  # a named template pack-data lacks
        settings.pop("chat_template")
    elif model_key == "base_model" and settings.get("chat_template") in NAMED:
        # the model's tokenizer holds its template's markers; the tiny one gets them as Axolotl's `tokens`
        from pipeline.tokenize.render import MARKER

        markers = dict.fromkeys(MARKER.findall(NAMED[settings["chat_template"]]))
        settings["tokens"] = list(dict.fromkeys([*(settings.get("tokens") or []), *markers]))
    out = tmp_path / Path(name).name
    out.write_text(yaml.safe_dump(settings, sort_keys=False))
    return out


def run(name: str, tmp_path: Path, model: str = "tiny") -> tuple[dict, str]:
    """pack-data and pack-train on the swapped example: the run's config.json (with the file's own
    `SIZED` values) and pack-train's stderr."""
    cfg = swapped(name, tmp_path, model)
    mapped = read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train")
    packed = CliRunner().invoke(pack_data, ["--config", str(cfg), *DATA_FLAGS])
    assert packed.exit_code == 0, packed.output
    trained = CliRunner().invoke(pack_train, ["--config", str(cfg), *TRAIN_FLAGS])
    assert trained.exit_code == 0, trained.output
    assert trained.stderr.count("pack-train --config") == 1  # the summary, once
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    return {**saved.get("config", saved), **{k: mapped[k] for k in SIZED if k in mapped}}, trained.stderr


# transformers' TrainingArguments for what Axolotl leaves None (adam_beta1/2, adam_epsilon, max_grad_norm)
AXOLOTL_DEFAULTS = {
    "beta1": 0.9,
    "beta2": 0.999,
    "adam_eps": 1e-8,
    "grad_clip": 1.0,
    "schedule": "cosine",
    "min_lr_ratio": 0.0,
    "warmup_rule": "axolotl",
}


@pytest.mark.parametrize(
    ("name", "want"),
    [
        (
            "llama-3_lora-1b.yml",
            {
                "lr": 0.0002,
                "lora_r": 16,
                "lora_alpha": 32.0,
                "lora_dropout": 0.05,
                "lora_target": "gate_proj,down_proj,up_proj,q_proj,v_proj,k_proj,o_proj",
                "optimizer": "adamw8bit",
                "tokens_per_step": 4096,
                "grad_accum": 2,
                "warmup_ratio": 0.1,
                "weight_decay": 0.0,
                "grad_checkpointing": 1,
                "log_every": 1,
                "evals_per_epoch": 4,
                "saves_per_epoch": 1,
                "eval_every": 1,
                "qlora": False,
            },
        ),
        (
            "mistral_qlora.yml",
            {
                "lr": 0.0002,
                "lora_r": 32,
                "lora_alpha": 16.0,
                "qlora": True,
                "lora_target": "all",
                "optimizer": "adamw8bit",
                "tokens_per_step": 16384,
                "grad_accum": 4,
            },
        ),
        # phi3's alpaca:phi data: Axolotl's phi prompt as pack-data's --template
        (
            "phi_phi3-ft.yml",
            {
                "lr": 5e-6,
                "lora_r": 64,
                "lora_target": "all",
                "optimizer": "adamw",
                "beta2": 0.95,
                "adam_eps": 1e-5,
                "beta1": 0.9,
                "grad_clip": 1.0,
                "warmup_ratio": 0.2,
                "weight_decay": 0.1,
                "eval_every": 1000,
                "save_every": 5000,
                "tokens_per_step": 8192,
            },
        ),
    ],
)
def test_an_axolotl_example_trains_its_recipe(tmp_path: Path, name: str, want: dict, request):
    saved, stderr = run(name, tmp_path, request.getfixturevalue("nf4_model") if want.get("qlora") else "tiny")
    expected = {**AXOLOTL_DEFAULTS, **want}
    assert {k: saved[k] for k in expected} == expected
    assert "Axolotl defaults for the keys the file leaves out (Axolotl 0.19.0's schema)" in stderr
    assert "not used by pack-train" in stderr and "cannot be honoured" not in stderr


def test_a_full_fine_tune_example_trains_every_weight_with_torchaos_8bit_adamw(tmp_path: Path):
    saved, stderr = run("llama-3_fft-8b.yaml", tmp_path)
    assert (saved["lora_r"], saved["optimizer"], saved["lr"], saved["tokens_per_step"], saved["grad_accum"]) == (
        0,
        "adamw8bit",
        2e-5,
        8192,
        8,
    )
    assert "  optimizer: paged_adamw_8bit -> --optimizer adamw8bit" in stderr
    losses = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses if "loss" in r][-1] == 2


def test_a_trl_example_trains_with_trls_defaults(tmp_path: Path):
    """examples/cli_configs/example_config.yaml sets only the model, data, lr and schedule: the rest is
    SFTConfig's (beta2 0.999, weight decay 0, 3 epochs, seed 42, ...), never pack-train's."""
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
    assert json.loads((tmp_path / "packed" / "manifest.json").read_text())["max_len"] == 1024  # TRL's max_length
    trained = CliRunner().invoke(
        pack_train, ["--config", str(cfg), "--data", str(tmp_path / "packed"), "--tokenizer", str(ROOT / "data/tokenizer"), *TRAIN_FLAGS]
    )
    assert trained.exit_code == 0, trained.output
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    saved = saved.get("config", saved)
    trl = {
        "lr": 1e-4,
        "schedule": "cosine",
        "min_lr_ratio": 0.0,
        "weight_decay": 0.0,
        "beta1": 0.9,
        "beta2": 0.999,
        "adam_eps": 1e-8,
        "grad_clip": 1.0,
        "seed": 42,
        "grad_checkpointing": 1,
        "report_to": "none",
        "log_every": 10,
        "save_every": 500,
    }
    assert {k: saved[k] for k in trl} == trl
    assert "TRL defaults for the keys the file leaves out (SFTConfig of trl 1.16.0): weight decay 0" in trained.stderr


def test_a_trl_file_without_a_learning_rate_says_it_trains_at_trls():
    """Negative control for pack-train's own defaults (3e-4, cosine to 10%, beta2 0.95): a TRL file
    that sets none of them gets TRL's, and the summary names them."""
    lines: list[str] = []
    got = read_config_file(
        EXAMPLES / "trl" / "sft_mixture.yaml", pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train", mapping=lines
    )
    assert (got["lr"], got["schedule"], got["min_lr_ratio"], got["weight_decay"], got["beta2"], got["epochs"]) == (
        2e-5,
        "linear",
        0.0,
        0.0,
        0.999,
        3,
    )
    assert lines[-1].startswith(
        "  TRL defaults for the keys the file leaves out (SFTConfig of trl 1.16.0): lr 2e-5, "
        "linear to 0, weight decay 0, beta1 0.9, beta2 0.999"
    )


def test_a_trl_mixture_is_its_datasets_not_chat_data():
    data = read_config_file(EXAMPLES / "trl" / "sft_mixture.yaml", pack_data, foreign="pack-data")
    assert data["inputs"] == ["stanfordnlp/imdb:train", "roneneldan/TinyStories:train"] and "fmt" not in data
    assert data["max_len"] == 1024


@pytest.mark.parametrize(
    ("name", "want"),
    [
        # the ALST long-context example: its keys are pack-train's long-row options
        (
            "alst_llama3-8b-fsdp2-alst.yaml",
            {
                "context_parallel": 8,
                "tile_mlp": 8192,
                "offload_activations": True,
                "parallel": "fsdp",
                "optimizer": "adamw8bit",
                "warmup": 100,
            },
        ),
        ("llama-3_fft-8b-liger-fsdp.yaml", {"parallel": "fsdp", "offload_states": True, "optimizer": "adamw"}),
        (
            "qwen3_32b-qlora.yaml",
            {"qlora": True, "lora_r": 16, "optimizer": "adamw4bit", "grad_checkpointing": 1, "offload_activations": True},
        ),
        ("llama-3_qlora-1b.yml", {"qlora": True, "lora_r": 32, "optimizer": "adamw8bit"}),
    ],
)
def test_the_multi_gpu_and_long_row_examples_map_to_our_options(tmp_path: Path, name: str, want: dict):
    """What needs torchrun or a GPU is compared key by key."""
    cfg = tmp_path / name
    cfg.write_text((EXAMPLES / "axolotl" / name).read_text())
    got = read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train")
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize(
    ("style", "template"),
    [
        ("alpaca:phi", "alpaca:phi"),
        ("alpaca:chatml", "alpaca:chatml"),
        ("alpaca:chat", "alpaca:chat"),
        ("alpaca", None),
        ("alpaca:instruct", "alpaca"),
    ],
)
def test_alpaca_prompt_styles_are_axolotls_text_or_refused(tmp_path: Path, style: str, template: str | None):
    """Each style is pack-data's --template preset of the same name (plain alpaca its default)."""
    cfg = tmp_path / "a.yaml"
    cfg.write_text(f"base_model: tiny\ndatasets:\n  - path: {LOCAL['alpaca']}\n    type: {style}\n")
    got = read_config_file(cfg, pack_data, foreign="pack-data")
    assert (got["fmt"], got.get("template")) == ("instruction", template)
    from pipeline.read.formats import TEMPLATES

    assert template is None or template in TEMPLATES


def test_axolotls_alpaca_prompt_is_pack_datas_preset():
    from pipeline.read.formats import ALPACA, ALPACA_NO_INPUT

    # axolotl 0.19.0 prompters.py, AlpacaPrompter (instruct): system_prompt + "\n\n" + turn_format
    system = (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request."
    )
    assert ALPACA == system + "\n\n" + "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
    no_input = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
    assert ALPACA_NO_INPUT == no_input + "\n\n" + "### Instruction:\n{instruction}\n\n### Response:\n"


def test_what_cannot_be_honoured_is_named_all_at_once():
    """gemma3's example freezes all but some parameters (unfrozen_parameters) of a QLoRA model: one
    line naming every such key, never a run per key; ALST's min_sample_len is pack-data's --min-len, and
    its two datasets' fields, which differ, each that dataset's own (--per-input)."""
    for command, name, keys, why in (
        (pack_train, "gemma3_gemma-3-1b-qlora.yml", ["unfrozen_parameters"], "LoRA adapters (adapter) or every"),
        (pack_data, "alst_llama3-8b-fsdp2-alst.yaml", [], ""),  # tests/e2e/test_per_input_fields.py packs it
        (pack_train, "alst_llama3-8b-fsdp2-alst.yaml", [], ""),  # min_sample_len: pack-data's
        (pack_train, "phi_phi3-ft.yml", [], ""),
        (pack_data, "phi_phi3-ft.yml", [], ""),
    ):
        result = CliRunner().invoke(command, ["--config", str(EXAMPLES / "axolotl" / name), "--help"])
        if keys:
            assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
            assert all(f"key '{k}'" in result.stderr for k in keys) and why in result.stderr
            assert "min_sample_len" not in result.stderr  # pack-data's --min-len
        else:
            assert result.exit_code == 0, result.output


# ---------------------------------------------------------------- the pack-train options these keys map to


def test_adam_eps_and_the_low_bit_adamws_reach_the_optimizer():
    import torch

    from trainer.config import TrainConfig
    from trainer.run.optim import make_optimizer

    weight = torch.nn.Parameter(torch.randn(256, 256))
    for name, kind in (("adamw", "AdamW"), ("adamw8bit", "AdamW8bit"), ("adamw4bit", "AdamW4bit")):
        config = TrainConfig(data="d", model="m", out="o", optimizer=name, adam_eps=1e-5, beta2=0.999)
        optimizer, _ = make_optimizer([weight], config, torch.device("cpu"), total_steps=4)
        assert type(optimizer).__name__ == kind
        assert (optimizer.defaults["eps"], optimizer.defaults["betas"]) == (1e-5, (0.9, 0.999))


@pytest.mark.parametrize(
    ("rule", "warmup", "ratio", "steps", "want"),
    [
        ("axolotl", 0, 0.0, 1000, 30),  # 3% of the steps
        ("axolotl", 0, 0.0, 10_000, 100),  # at most 100
        ("axolotl", 0, 0.1, 25, 2),  # int(2.5), not rounded up
        ("axolotl", 0, 0.0, 40, 2),  # int(1.2) is 1, which Axolotl makes 2
        ("axolotl", 7, 0.0, 1000, 7),
        ("hf", 0, 0.1, 25, 3),  # control: the Hugging Face Trainer rounds the ratio up
        ("hf", 0, 0.0, 1000, 0),
    ],
)
def test_the_warmup_is_counted_as_the_source_tool_counts_it(rule: str, warmup: int, ratio: float, steps: int, want: int):
    from trainer.config import TrainConfig, warmup_steps

    config = TrainConfig(data="d", model="m", out="o", warmup_rule=rule, warmup=warmup, warmup_ratio=ratio)
    assert warmup_steps(config, steps) == want


@pytest.mark.parametrize(
    ("epochs", "evals", "saves", "steps", "want"),
    [
        (1, 4, 1, 40, (10, 0)),  # Axolotl: 1 / (4 x 1) of the steps
        (2, 4, 1, 40, (5, 20)),
        (1, 1, 0, 40, (0, 0)),  # a fraction of 1: at the end only, as Axolotl warns
        (3, 2, 3, 100, (17, 12)),  # rounded up, as transformers rounds a fractional eval_steps
    ],
)
def test_evals_and_saves_per_epoch_become_steps(epochs: int, evals: int, saves: int, steps: int, want: tuple):
    from trainer.config import TrainConfig, per_epoch

    config = per_epoch(TrainConfig(data="d", model="m", out="o", epochs=epochs, evals_per_epoch=evals, saves_per_epoch=saves), steps)
    assert (config.eval_every, config.save_every) == want


def test_wandb_gets_the_project_entity_and_run_name(tmp_path: Path, monkeypatch):
    import sys
    import types

    from trainer.config import TrainConfig
    from trainer.run.metrics import Reporter

    calls: list[dict] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = TrainConfig(
        data="d", model="m", out=str(tmp_path), report_to="wandb", wandb_project="p", wandb_entity="team", run_name="first"
    )
    Reporter("wandb", tmp_path, config, rank=0).close()
    Reporter("wandb", tmp_path, TrainConfig(data="d", model="m", out=str(tmp_path), report_to="wandb"), 0).close()
    assert [(c["project"], c["entity"], c["name"]) for c in calls] == [("p", "team", "first"), ("pack-train", None, None)]


# ---------------------------------------------------------------- data keys


@pytest.mark.parametrize(
    ("data", "extra", "want"),
    [
        ("chat.jsonl", "", True),  # TRL trains every token of messages data by default
        ("instructions.jsonl", "", None),  # not prompt/completion nor messages: the flag is left alone
        ("chat.jsonl", "assistant_only_loss: true\n", False),  # control: the file says assistant-only
    ],
)
def test_a_trl_messages_dataset_trains_every_token_unless_the_file_says_otherwise(tmp_path: Path, data: str, extra: str, want):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"model_name_or_path: tiny\ndataset_name: {ROOT / 'data/sample' / data}\n" + extra)
    lines: list[str] = []
    got = read_config_file(cfg, pack_data, foreign="pack-data", mapping=lines)
    assert got.get("train_on_prompt") == want
    if want:
        assert "loss on every token of the messages (assistant_only_loss: false)" in lines[-1]


def test_prompt_completion_data_keeps_trls_completion_only_default(tmp_path: Path):
    data = tmp_path / "pc.jsonl"
    data.write_text('{"prompt": "2+2=", "completion": "4"}\n')
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"model_name_or_path: tiny\ndataset_name: {data}\n")
    lines: list[str] = []
    assert "train_on_prompt" not in read_config_file(cfg, pack_data, foreign="pack-data", mapping=lines)
    assert "loss on the completion (completion_only_loss)" in lines[-1]


def test_axolotl_dataset_sub_keys_map_to_pack_data_options(tmp_path: Path):
    """message_property_mappings onto the names pack-data reads are accepted, others refused;
    roles_to_train / train_on_eos / special_tokens / tokens are pack-data's options where this
    version has them, else named as needing them (never dropped)."""
    cfg = tmp_path / "a.yaml"
    base = (
        f"base_model: tiny\ndatasets:\n  - path: {ROOT / 'data/sample/chat.jsonl'}\n    type: chat_template\n"
        "    message_property_mappings: {role: from, content: value}\n"
    )
    cfg.write_text(base)
    assert read_config_file(cfg, pack_data, foreign="pack-data")["fmt"] == "chat"
    cfg.write_text(base.replace("role: from", "role: speaker"))
    with pytest.raises(Exception, match="pack-data reads role from role or from"):
        read_config_file(cfg, pack_data, foreign="pack-data")
    cfg.write_text(
        base + "    roles_to_train: [assistant, user]\n    train_on_eos: all\n"
        "special_tokens: {eos_token: <|im_end|>, pad_token: <pad>}\ntokens: [<tool>]\n"
    )
    params = {p.name for p in pack_data.params}
    if {"roles_to_train", "train_on_eos", "special_tokens", "add_tokens"} <= params:
        got = read_config_file(cfg, pack_data, foreign="pack-data")
        assert (list(got["roles_to_train"]), got["train_on_eos"], got["add_tokens"]) == (["assistant", "user"], "all", ["<tool>"])
        assert got["special_tokens"] == {"eos_token": "<|im_end|>"}  # the pad token dropped: rows hold no padding
    else:
        with pytest.raises(Exception, match="needs pack-data --roles-to-train") as caught:
            read_config_file(cfg, pack_data, foreign="pack-data")
        assert "key 'special_tokens'" in str(caught.value) and "key 'tokens'" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (
            "wandb_project: p\nwandb_entity: team\nwandb_name: first\n",
            {"wandb_project": "p", "report_to": "wandb", "wandb_entity": "team", "run_name": "first"},
        ),
        # TRL: report_to chooses; run_name names the run
        ("report_to: wandb\nrun_name: first\n", {"report_to": "wandb", "run_name": "first"}),
        # control: Axolotl's empty W&B keys log nowhere
        ("wandb_project:\nwandb_entity:\n", {}),
    ],
)
def test_wandb_keys_map_to_the_wandb_options(tmp_path: Path, text: str, want: dict):
    cfg = tmp_path / "w.yaml"
    cfg.write_text("base_model: tiny\nlearning_rate: 0.001\n" + text if "wandb_" in text else "model_name_or_path: tiny\n" + text)
    got = read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train")
    keys = ("wandb_project", "report_to", "wandb_entity", "run_name")
    assert {k: got[k] for k in keys if k in got} == want


def test_a_resume_with_another_adam_eps_is_refused(tmp_path: Path):
    """The optimizer's state carries its epsilon: a resume with another is refused, as with --beta2;
    the same value resumes (control)."""
    packed = tmp_path / "packed"
    assert (
        CliRunner()
        .invoke(
            pack_data,
            [str(LOCAL["alpaca"]), "--tokenizer", str(ROOT / "data/tokenizer"), "--max-len", "512", "--out", str(packed), *DATA_FLAGS],
        )
        .exit_code
        == 0
    )
    args = [
        "--data",
        str(packed),
        "--model",
        "tiny",
        "--out",
        str(tmp_path / "run"),
        "--tokens-per-step",
        "1024",
        "--num-workers",
        "0",
        "--no-progress",
        "--adam-eps",
        "1e-6",
    ]
    assert CliRunner().invoke(pack_train, [*args, "--max-steps", "1"]).exit_code == 0
    other = CliRunner().invoke(pack_train, [*args[:-1], "1e-5", "--max-steps", "2", "--resume"])
    assert other.exit_code == 1 and "it was trained with --adam-eps 1e-06 but this run has --adam-eps 1e-05" in other.stderr, other.output
    assert CliRunner().invoke(pack_train, [*args, "--max-steps", "2", "--resume"]).exit_code == 0


def test_use_peft_without_target_modules_takes_peft_s_targets_for_the_model():
    """TRL passes target_modules=None, and peft then picks the model type's own (Llama: q_proj and
    v_proj), not every linear layer; --lora-target all (control) is every linear layer."""
    from trainer.config import TrainConfig
    from trainer.model.load import build_model
    from trainer.model.lora import add_lora

    def targets(name: str) -> set[str]:
        model, _ = build_model("tiny", attn="sdpa", vocab_size=300, seed=0)
        peft = add_lora(model, TrainConfig(data="d", model="tiny", out="o", lora_r=4, lora_target=name))
        return {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in peft.named_parameters() if "lora_A" in n}

    assert targets("default") == {"q_proj", "v_proj"}
    assert targets("all") == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize(
    ("text", "want"),
    [
        # Axolotl evaluates only with held-out data (qwen3/32b-qlora.yaml: val_set_size 0.0, evals_per_epoch 4)
        ("base_model: tiny\nval_set_size: 0.0\nevals_per_epoch: 4\neval_steps: 10\n", {}),
        ("base_model: tiny\nval_set_size: 0.1\nevals_per_epoch: 4\n", {"evals_per_epoch": 4}),
        # TRL evaluates only with eval_strategy: steps (its default is no)
        ("model_name_or_path: tiny\neval_steps: 10\n", {}),
        ("model_name_or_path: tiny\neval_strategy: steps\neval_steps: 10\n", {"eval_every": 10}),
    ],
)
def test_evaluation_keys_count_only_when_the_tool_would_evaluate(tmp_path: Path, text: str, want: dict):
    cfg = tmp_path / "e.yaml"
    cfg.write_text(text)
    got = read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train")
    assert {k: got[k] for k in ("evals_per_epoch", "eval_every") if k in got} == want


@pytest.mark.parametrize(
    ("entries", "want", "refused"),
    [
        # a share of a split: the input's own (pipeline.read.splits), for each dataset (tests/e2e/test_foreign_slices.py)
        ([{"split": "train[:100]"}], {"inputs": ["org/ds:train[:100]"], "limit": None}, None),
        (
            [{"split": "train[:20%]"}, {"path": "org/other", "split": "test[-5%:]"}],
            {"inputs": ["org/ds:train[:20%]", "org/other:test[-5%:]"]},
            None,
        ),
        ([{"split": "train[:10%]+test"}], None, "pack-data reads one split or one share of it"),
        # Axolotl's older spelling of message_property_mappings
        ([{"message_field_role": "from", "message_field_content": "value"}], {"inputs": ["org/ds:train"]}, None),
        ([{"message_field_role": "speaker"}], None, "pack-data reads role from role or from"),
    ],
)
def test_dataset_splits_and_older_sub_keys(tmp_path: Path, entries: list[dict], want: dict | None, refused: str | None):
    cfg = tmp_path / "d.yaml"
    import yaml as _yaml

    datasets = [{"path": "org/ds", "type": "chat_template", **e} for e in entries]
    cfg.write_text(_yaml.safe_dump({"base_model": "tiny", "datasets": datasets}))
    if refused:
        with pytest.raises(Exception, match=refused.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            read_config_file(cfg, pack_data, foreign="pack-data")
        return
    got = read_config_file(cfg, pack_data, foreign="pack-data")
    assert {k: got.get(k) for k in want} == want


@pytest.mark.parametrize("plugin", ["axolotl.integrations.kernels.KernelsPlugin", "axolotl.integrations.swanlab.SwanLabPlugin"])
def test_kernel_and_logging_plugins_are_named_as_not_used(tmp_path: Path, plugin: str):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(f"base_model: tiny\nlearning_rate: 0.001\nplugins: [{plugin}]\n")
    lines: list[str] = []
    read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train", mapping=lines)
    assert any(line.startswith("  plugins: ") and ": not used (" in line for line in lines)


def test_trls_skill_file_maps_its_padded_batch_to_groups():
    """TRL's training skill's example: report_to trackio is a logger (named as not used); its batch of
    8 padded examples x 2 accumulation steps (no packing: TRL's default), once refused, is a group of
    16 examples a step (test_padded_batch_files.py trains such files); with packing it maps whole,
    use_peft's missing dropout and targets from TRL's ModelConfig and peft."""
    result = CliRunner().invoke(pack_train, ["--config", str(EXAMPLES / "trl" / "sft_skill.yaml"), "--help"])
    assert result.exit_code == 0, result.output
    assert "TRL: batches of 16 padded examples a step, trained as packed groups of those 16 (same gradient)" in result.stderr


def test_trls_skill_file_with_packing_maps_to_trls_recipe(tmp_path: Path):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text((EXAMPLES / "trl" / "sft_skill.yaml").read_text() + "packing: true\n")
    lines: list[str] = []
    got = read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train", mapping=lines)
    want = {
        "lr": 2e-5,
        "epochs": 1,
        "tokens_per_step": 8 * 1024,
        "grad_accum": 2,
        "lora_r": 16,
        "lora_alpha": 16.0,
        "lora_dropout": 0.05,
        "lora_target": "default",
        "schedule": "linear",
        "min_lr_ratio": 0.0,
        "beta2": 0.999,
        "weight_decay": 0.0,
        "out": "./sft_output",
    }
    assert {k: got[k] for k in want} == want and "report_to" not in got
    assert "  report_to: trackio: not used (trackio: pack-train logs to metrics.jsonl, and to tensorboard or wandb)" in lines
