"""Starting from a real checkpoint: a local Hugging Face folder with sharded bf16 safetensors, tied
embeddings and its tokenizer (chat template included) packs, trains and checkpoints; every
checkpoint's `model/` loads back with AutoModelForCausalLM and AutoTokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from click.testing import CliRunner

from pipeline.cli import pack_data
from trainer.cli import pack_train


def test_a_sharded_bf16_tied_model_folder_trains_and_its_checkpoints_reload(repo_root: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model_dir = tmp_path / "model"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir, max_shard_size="200KB")
    shutil.copytree(repo_root / "data" / "tokenizer", model_dir, dirs_exist_ok=True)
    assert len(list(model_dir.glob("model-*.safetensors"))) > 1  # sharded
    packed = tmp_path / "packed"
    assert (
        CliRunner()
        .invoke(
            pack_data,
            [
                str(repo_root / "data/sample/chat.jsonl"),
                "--tokenizer",
                str(model_dir),
                "--max-len",
                "512",
                "--out",
                str(packed),
                "--limit",
                "40",
                "--no-progress",
            ],
        )
        .exit_code
        == 0
    )
    result = CliRunner().invoke(
        pack_train,
        [
            "--data",
            str(packed),
            "--model",
            str(model_dir),
            "--out",
            str(tmp_path / "run"),
            "--max-steps",
            "2",
            "--tokens-per-step",
            "1024",
            "--num-workers",
            "0",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    checkpoint = Path(json.loads((tmp_path / "run" / "summary.json").read_text())["checkpoint"]) / "model"
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert reloaded.config.tie_word_embeddings
    assert reloaded.get_output_embeddings().weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)  # the tokenizer travels with every checkpoint
    assert tokenizer.chat_template and len(tokenizer) == 4096
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert not torch.equal(original.model.layers[0].mlp.up_proj.weight, reloaded.model.layers[0].mlp.up_proj.weight.float())  # it trained
