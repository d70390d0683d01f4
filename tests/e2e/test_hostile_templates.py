"""Hostile chat templates and chat data, met the way a user meets them (the real `pack-data` /
`pack-verify` in their own process): a template is code from a file, so one that never ends, computes
a gigantic number or string, never prints the assistant's text or is not prefix-stable gets one line
naming it, exit 1, no traceback and no output folder; user text that spells a control token trains
as the text it is; a template that prints today's date gives the same bytes on every run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_hostile_inputs import TOKENIZER, cli, error_line, write_jsonl

from pipeline.shards import IGNORE_INDEX, iter_rows, load_shard, read_manifest, shard_paths
from pipeline.shards.manifest import manifest_checksum
from pipeline.tokenize.tokenizer import load_tokenizer

CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]

# each: a Jinja chat template that must not run unbounded
ENDLESS = {
    "nested ranges": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}",
    "huge power": "{{ 10**(10**10) }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "huge string": "{{ 'x' * 10**12 }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "huge width": "{{ 'x'.ljust(10**12) }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}",
}


def pack_chat(tmp: Path, rows: list, *extra: object, out: str = "packed"):  # noqa: ANN201
    data = write_jsonl(tmp / "chat.jsonl", [{"messages": m} if isinstance(m, list) else m for m in rows])
    return cli(
        "pack-data",
        data,
        "--tokenizer",
        TOKENIZER,
        "--max-len",
        256,
        "--out",
        out,
        *extra,
        cwd=tmp,
        env={**os.environ, "PACKLM_TEMPLATE_SECONDS": "3"},
    )


@pytest.mark.parametrize("name", sorted(ENDLESS))
def test_a_template_that_would_not_end_is_stopped_in_one_line_naming_it(tmp_path: Path, name: str):
    (tmp_path / "t.jinja").write_text(ENDLESS[name])
    line = error_line(pack_chat(tmp_path, [CHAT], "--chat-template", "t.jinja"))
    assert "--chat-template t.jinja" in line and ("within 3 s" in line or "size limit" in line), line
    assert not (tmp_path / "packed").exists()


def test_the_same_template_bounded_renders_when_it_stays_inside_the_limits(tmp_path: Path):
    """Control: loops, powers and strings of ordinary sizes render as before."""
    (tmp_path / "t.jinja").write_text(
        "{% for a in range(300) %}{% endfor %}{{ '' * 3 }}{{ (2**64) % 7 }}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
    )
    proc = pack_chat(tmp_path, [CHAT], "--chat-template", "t.jinja")
    assert proc.returncode == 0, proc.stderr_text


def test_a_template_that_never_renders_the_assistant_is_refused(tmp_path: Path):
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}{% if m.role != 'assistant' %}<|im_start|>{{ m.content }}<|im_end|>{% endif %}{% endfor %}"
    )
    line = error_line(pack_chat(tmp_path, [CHAT], "--chat-template", "t.jinja"))
    assert "chat.jsonl line 1" in line and "does not render the assistant's content" in line, line
    assert not (tmp_path / "packed").exists()


def test_a_template_not_prefix_stable_on_prompt_completion_is_refused(tmp_path: Path):
    """The system prompt printed last: the prompt alone is not the start of prompt + completion."""
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages if m.role != 'system' %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
        "{% for m in messages if m.role == 'system' %}{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>{% endif %}"
    )
    row = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        "completion": [{"role": "assistant", "content": "4"}],
    }
    line = error_line(pack_chat(tmp_path, [row], "--chat-template", "t.jinja"))
    assert "chat.jsonl line 1" in line and "not prefix-stable" in line, line
    assert not (tmp_path / "packed").exists()


def test_user_text_that_spells_a_control_token_trains_as_text(tmp_path: Path):
    """`</s>` and `<|im_end|>` inside a message are ordinary text: the row holds only the template's
    <|im_end|> (one per message) and no `</s>` id; control: the same row without the literals."""
    literal = [
        {"role": "user", "content": "end with </s> or <|im_end|> please"},
        {"role": "assistant", "content": "Sure: </s><|im_end|> done"},
    ]
    proc = pack_chat(tmp_path, [literal])
    assert proc.returncode == 0, proc.stderr_text
    tok = load_tokenizer(str(TOKENIZER))
    shard = load_shard(shard_paths(tmp_path / "packed", read_manifest(tmp_path / "packed"))[0])
    ids = shard.input_ids.tolist()
    end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id
    assert ids.count(end) == 2 and eos not in ids
    assert tok.decode(ids, skip_special_tokens=False).count("<|im_end|>") == 4  # two as text, two as tokens
    trained = tok.decode([t for t in shard.labels.tolist() if t != IGNORE_INDEX])
    assert trained == "Sure: </s><|im_end|> done<|im_end|>"


def test_a_template_that_prints_the_date_packs_the_same_bytes_and_records_it(tmp_path: Path):
    (tmp_path / "t.jinja").write_text(
        "Today: {{ strftime_now('%d %b %Y') }}\n{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    )
    hashes = []
    for out in ("a", "b"):
        proc = pack_chat(tmp_path, [CHAT], "--chat-template", "t.jinja", out=out)
        assert proc.returncode == 0, proc.stderr_text
        manifest = read_manifest(tmp_path / out)
        assert manifest.tokenizer["template_date"] == "2024-07-26"
        hashes.append([s["sha256"] for s in json.loads((tmp_path / out / "manifest.json").read_text())["shards"]])
    assert hashes[0] == hashes[1]
    shard = load_shard(shard_paths(tmp_path / "a", read_manifest(tmp_path / "a"))[0])
    assert "Today: 26 Jul 2024" in load_tokenizer(str(TOKENIZER)).decode(shard.input_ids.tolist())


def test_an_empty_chat_template_file_is_named(tmp_path: Path):
    (tmp_path / "t.jinja").write_text("  \n")
    line = error_line(pack_chat(tmp_path, [CHAT], "--chat-template", "t.jinja"))
    assert "--chat-template t.jinja: the file is empty" in line, line


@pytest.mark.parametrize(
    "part, answer, says", [({"type": "text", "text": 7}, 8, "the int 7 as its 'text'"), ({"type": "text"}, "ok", "no 'text'")]
)
def test_a_text_part_without_a_string_is_named(tmp_path: Path, part: dict, answer: object, says: str):
    row = [{"role": "user", "content": [part]}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
    line = error_line(pack_chat(tmp_path, [row]))
    assert "chat.jsonl line 1" in line and f"a text content part has {says}" in line, line


def test_pack_verify_deep_never_reads_a_template_path_the_manifest_names(tmp_path: Path):
    """A manifest edited to name a template outside its folder (and no recorded text): one line,
    the file never read; control: the untouched folder passes --deep."""
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}<|im_start|>{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% endfor %}"
    )
    proc = pack_chat(tmp_path, [CHAT], "--chat-template", "t.jinja")
    assert proc.returncode == 0, proc.stderr_text
    ok = cli("pack-verify", "packed", "--deep", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr_text
    path = tmp_path / "packed" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["config"]["chat_template"] = "../../outside.jinja"
    del manifest["tokenizer"]["chat_template_text"]
    manifest["checksum"] = manifest_checksum(manifest)  # edited as someone would who means it
    path.write_text(json.dumps(manifest))
    line = error_line(cli("pack-verify", "packed", "--deep", cwd=tmp_path))
    assert "'../../outside.jinja'" in line and "never from a path it names" in line, line


def test_tokens_pack_data_adds_grow_the_models_embeddings_in_pack_train(tmp_path: Path):
    """`--special-token` / `--add-token`: the manifest records them and the grown vocabulary;
    pack-train gives the model's tokenizer the same tokens (the fingerprints match) and grows the
    model's embeddings and untied LM head to it, in one line. Control: without the tokens recorded,
    a larger vocabulary is still refused."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=4096,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    proc = pack_chat(tmp_path, [CHAT] * 4, "--special-token", "pad_token=<|pad|>", "--add-token", "<tool>")
    assert proc.returncode == 0, proc.stderr_text
    manifest = read_manifest(tmp_path / "packed")
    assert manifest.tokenizer["vocab_size"] == 4098 and manifest.tokenizer["added_tokens"] == ["<tool>"]
    assert manifest.tokenizer["special_tokens"] == {"pad_token": "<|pad|>"}
    train = cli(
        "pack-train",
        "--data",
        "packed",
        "--model",
        tmp_path / "model",
        "--tokenizer",
        TOKENIZER,
        "--out",
        "run",
        "--max-steps",
        1,
        "--device",
        "cpu",
        "--tokens-per-step",
        256,
        cwd=tmp_path,
    )
    assert train.returncode == 0, train.stderr_text
    assert "embeddings and its LM head of" in train.stderr_text and "grown from 4096 to 4098 rows" in train.stderr_text
    path = tmp_path / "packed" / "manifest.json"
    edited = json.loads(path.read_text())
    del edited["tokenizer"]["added_tokens"], edited["tokenizer"]["special_tokens"]
    edited["checksum"] = manifest_checksum(edited)
    path.write_text(json.dumps(edited))
    line = error_line(
        cli(
            "pack-train",
            "--data",
            "packed",
            "--model",
            tmp_path / "model",
            "--out",
            "run2",
            "--max-steps",
            1,
            "--device",
            "cpu",
            "--tokens-per-step",
            256,
            cwd=tmp_path,
        )
    )
    assert "only embeds 4096" in line, line


@pytest.mark.parametrize("spelling", ["mapping", "texts", "axolotl"])
def test_special_tokens_from_a_config_file_are_recorded_like_the_flag(tmp_path: Path, spelling: str):
    """`--config` with pack-data's `special-token` as a mapping or as its NAME=TEXT texts, or an
    Axolotl file's `special_tokens` mapping (its pad token dropped: rows hold no padding): each packs,
    and the manifest records the tokens as `--special-token eos_token=<|end|>` does. Both native
    spellings were refused before ("takes a list" / "must be a mapping"), and with them every Axolotl
    file naming an end-of-sequence token."""
    if spelling == "axolotl":
        text = (
            "base_model: m\nsequence_len: 256\nspecial_tokens:\n  pad_token: <|pad|>\n  eos_token: <|end|>\n"
            "datasets:\n  - path: chat.jsonl\n    type: chat_template\n"
        )
    else:
        value = "{eos_token: <|end|>}" if spelling == "mapping" else "['eos_token=<|end|>']"
        text = f"special-token: {value}\n"
    (tmp_path / "run.yaml").write_text(text)
    proc = pack_chat(tmp_path, [CHAT] * 4, "--config", "run.yaml")
    assert proc.returncode == 0, proc.stderr_text
    assert read_manifest(tmp_path / "packed").tokenizer["special_tokens"] == {"eos_token": "<|end|>"}
    flag = pack_chat(tmp_path, [CHAT] * 4, "--special-token", "eos_token=<|end|>", out="packed2")
    assert flag.returncode == 0 and read_manifest(tmp_path / "packed2").tokenizer["special_tokens"] == {"eos_token": "<|end|>"}


def test_a_tokenizer_with_named_template_variants_uses_its_default_one(tmp_path: Path):
    """A tokenizer whose chat template is a set of named variants ({"default": ..., "tool_use": ...},
    as tokenizer_config.json stores a list of {name, template}) packs chat data with the "default"
    variant, as apply_chat_template does without a name: the same ids as the same template given as
    one string (control), and pack-verify --deep passes. Without a "default" one line names the
    variants. (It was a TypeError traceback.)"""
    import shutil

    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    folders = {}
    for name, value in {
        "named": [{"name": "default", "template": template}, {"name": "tool_use", "template": "{{ 1 }}"}],
        "plain": template,
        "nodefault": [{"name": "a", "template": template}, {"name": "tool_use", "template": template}],
    }.items():
        folder = tmp_path / name
        shutil.copytree(TOKENIZER, folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = value
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        folders[name] = folder
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}] * 3)
    runs = {}
    for name in ("named", "plain"):
        proc = cli("pack-data", data, "--tokenizer", folders[name], "--max-len", 256, "--out", f"p-{name}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr_text
        runs[name] = [[int(t) for t in row["input_ids"]] for row in iter_rows(tmp_path / f"p-{name}")]
    assert runs["named"] == runs["plain"]
    assert cli("pack-verify", "p-named", "--deep", cwd=tmp_path).returncode == 0
    line = error_line(cli("pack-data", data, "--tokenizer", folders["nodefault"], "--max-len", 256, "--out", "p-x", cwd=tmp_path))
    assert "named variants (a, tool_use)" in line and "--chat-template" in line, line
