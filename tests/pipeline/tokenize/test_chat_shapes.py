"""Chat data beyond `messages` of strings: `--chat-template` (a named template or a Jinja file, for a
tokenizer with none), TRL's conversational prompt/completion and OpenAI content lists, each checked
against what the peer's own code makes of the same example (TRL's tokenizing helpers; transformers'
`apply_chat_template`)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from pipeline.cli import pack_data
from pipeline.errors import UserError
from pipeline.read.formats import FormatOptions, detect_format
from pipeline.shards import IGNORE_INDEX
from pipeline.tokenize.batch import tokenize_batch
from pipeline.tokenize.chat_templates import NAMED, resolve_chat_template
from pipeline.tokenize.render import rows_where
from pipeline.tokenize.tokenizer import load_tokenizer, tokenizer_fingerprint

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = ROOT / "data" / "tokenizer"
LLAMA2 = ROOT.parent / "shared" / "tokenizers" / "llama2"  # real data beside the checkout; skipped without it
CHAT = ROOT / "data" / "sample" / "chat.jsonl"


def one(table: pa.Table, tok) -> tuple[list[int], list[int]]:
    fmt = detect_format(table.column_names, FormatOptions())
    batch = tokenize_batch(table, fmt, tok, rows_where("x.jsonl"))
    return batch.input_ids.tolist(), batch.labels.tolist()


def test_trl_conversational_prompt_completion_packs_as_trl_tokenizes_it():
    """TRL's SFTTrainer: ids = the template over prompt + completion; loss from where they leave the
    prompt rendered with the generation prompt (`_tokenize`, `common_prefix_length`)."""
    pytest.importorskip("trl")
    from trl.data_utils import _tokenize, common_prefix_length

    tok = load_tokenizer(str(TOKENIZER))
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    completion = [{"role": "assistant", "content": "4, since 2+2=4."}]
    prompt_ids = _tokenize(tok, prompt, add_generation_prompt=True)["input_ids"]
    trl_ids = _tokenize(tok, prompt + completion)["input_ids"]
    start = common_prefix_length(prompt_ids, trl_ids)
    ids, labels = one(pa.table({"prompt": [prompt], "completion": [completion]}), tok)
    assert ids == trl_ids  # no BOS or EOS added: TRL's apply_chat_template adds none
    # TRL's loss, the "\n" the template writes after <|im_end|> included (tests/e2e/test_foreign_rest.py
    # runs TRL's own preparation on more templates)
    assert [label != IGNORE_INDEX for label in labels] == [False] * start + [True] * (len(trl_ids) - start)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id not in ids and ids[-2] == end and labels[-2] == end


def test_a_prompt_list_beside_a_completion_string_is_one_line():
    tok = load_tokenizer(str(TOKENIZER))
    with pytest.raises(UserError, match="x.jsonl row 1: field 'completion' is not a list of messages"):
        one(pa.table({"prompt": [[{"role": "user", "content": "hi"}]], "completion": ["hello"]}), tok)


PARTS = [
    {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "text", "text": "2+2?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "4"}]},
]
READS_PARTS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_openai_content_lists_render_as_the_template_renders_them(tmp_path: Path):
    """A template that reads content lists gets them as they are (transformers' apply_chat_template
    is the peer); one that takes text gets each list's text parts joined with newlines."""
    jinja = tmp_path / "parts.jinja"
    jinja.write_text(READS_PARTS)
    tok = load_tokenizer(str(TOKENIZER), str(jinja))
    ours, labels = one(pa.table({"messages": [PARTS]}), tok)
    peer = tok.apply_chat_template(PARTS, tokenize=True, return_dict=True)["input_ids"]
    assert ours == list(peer) and "Look:2+2?" in tok.decode(ours)  # no BOS or EOS added: the template's ids
    assert tok.decode([t for t in labels if t != IGNORE_INDEX]) == "4<|im_end|>"  # not the template's "\n" after it

    plain = load_tokenizer(str(TOKENIZER))  # its template concatenates content as text
    joined = [{"role": "user", "content": "Look:\n2+2?"}, {"role": "assistant", "content": "4"}]
    assert one(pa.table({"messages": [PARTS]}), plain) == one(pa.table({"messages": [joined]}), plain)


def test_a_content_part_that_is_not_text_is_one_line():
    tok = load_tokenizer(str(TOKENIZER))
    msgs = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]},
    ]
    with pytest.raises(UserError, match="x.jsonl row 1: a message content part of type 'image_url'"):
        one(pa.table({"messages": [msgs]}), tok)


def test_a_jsonl_file_mixing_text_and_content_lists_packs_as_the_text(tmp_path: Path):
    """OpenAI data writes a system prompt as text and a user turn as parts: the file packs, and to the
    same rows as the same conversations written as text."""
    system = {"role": "system", "content": "Be brief."}
    mixed = [
        [
            system,
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "text", "text": "2+2?"}]},
            {"role": "assistant", "content": "4"},
        ],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}],
    ]
    text = [
        [system, {"role": "user", "content": "Look:\n2+2?"}, {"role": "assistant", "content": "4"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    ]
    for name, rows in (("mixed", mixed), ("text", text)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
        result = CliRunner().invoke(
            pack_data,
            [
                str(tmp_path / f"{name}.jsonl"),
                "--tokenizer",
                str(TOKENIZER),
                "--max-len",
                "256",
                "--out",
                str(tmp_path / name),
                "--no-progress",
                "--num-proc",
                "1",
            ],
        )
        assert result.exit_code == 0, result.output
    manifests = [json.loads((tmp_path / n / "manifest.json").read_text()) for n in ("mixed", "text")]
    assert manifests[0]["total_tokens"] == manifests[1]["total_tokens"]
    assert manifests[0]["loss_tokens"] == manifests[1]["loss_tokens"]
    shards = [(tmp_path / n / m["shards"][0]["file"]).read_bytes() for n, m in zip(("mixed", "text"), manifests)]
    assert shards[0] == shards[1]


def test_chat_template_names_files_and_text():
    assert resolve_chat_template("chatml") == NAMED["chatml"]
    assert resolve_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(UserError, match="--chat-template 'chatm': not a template name"):
        resolve_chat_template("chatm")


@pytest.mark.skipif(not LLAMA2.is_dir(), reason="the Llama-2 tokenizer is not beside the checkout")
def test_chat_data_with_a_tokenizer_without_template_packs_with_chat_template(tmp_path: Path):
    args = [str(CHAT), "--tokenizer", str(LLAMA2), "--max-len", "1024", "--limit", "20", "--no-progress", "--num-proc", "1"]
    refused = CliRunner().invoke(pack_data, [*args, "--out", str(tmp_path / "none")])
    assert refused.exit_code == 1 and "has no chat template" in refused.stderr and "--chat-template" in refused.stderr
    assert not (tmp_path / "none").exists()
    packed = CliRunner().invoke(pack_data, [*args, "--out", str(tmp_path / "o"), "--chat-template", "llama2"])
    assert packed.exit_code == 0, packed.output
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    tok = load_tokenizer(str(LLAMA2), "llama2")
    assert manifest["tokenizer"]["chat_template"] == "llama2" and manifest["config"]["chat_template"] == "llama2"
    assert manifest["tokenizer"]["fingerprint"] == tokenizer_fingerprint(tok)
    assert manifest["tokenizer"]["fingerprint"] != tokenizer_fingerprint(load_tokenizer(str(LLAMA2)))
    assert manifest["loss_tokens"] > 0
    deep = CliRunner().invoke(
        __import__("pipeline.cli", fromlist=["pack_verify"]).pack_verify, [str(tmp_path / "o"), "--deep", "--sample", "5"]
    )
    assert deep.exit_code == 0 and "re-tokenized and matched" in deep.output, deep.output


def test_an_unknown_chat_template_is_refused_before_any_work(tmp_path: Path):
    result = CliRunner().invoke(
        pack_data, [str(CHAT), "--tokenizer", str(TOKENIZER), "--max-len", "512", "--out", str(tmp_path / "o"), "--chat-template", "nope"]
    )
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert (
        "--chat-template 'nope': not a template name (chatml, llama3, llama2, qwen_25, qwen3, gemma, gemma3, phi_3, mistral_v1, mistral_v3_tekken, mistral_v7_tekken)"
        in result.stderr
    )
    assert not (tmp_path / "o").exists()
