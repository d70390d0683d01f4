"""The embedded sample data and tokenizer: reproducible, loadable, and shaped as documented."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
SAMPLES = ["sample/instructions.jsonl", "sample/chat.jsonl", "sample/text.jsonl"]
TOKENIZER_FILES = ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]


def _script():
    spec = importlib.util.spec_from_file_location("make_sample_data", ROOT / "scripts" / "tools" / "make_sample_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DATA / "tokenizer"))


def _rows(name: str) -> list[dict]:
    with open(DATA / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_regeneration_is_byte_identical(tmp_path):
    import tokenizers

    record = _script().generate(tmp_path)
    committed = json.loads((DATA / "GENERATED.json").read_text())
    for name in SAMPLES:
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name
    if committed["tokenizers_version"] != tokenizers.__version__:
        pytest.skip(
            f"sample files identical; tokenizer trained with tokenizers "
            f"{committed['tokenizers_version']}, installed {tokenizers.__version__}"
        )
    for name in TOKENIZER_FILES:
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name
    assert (tmp_path / "GENERATED.json").read_bytes() == (DATA / "GENERATED.json").read_bytes()
    assert set(record["files"]) == set(SAMPLES + TOKENIZER_FILES)


def test_tokenizer_specials_and_no_auto_bos(tokenizer):
    assert tokenizer.is_fast
    assert len(tokenizer) == 4096
    expected = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "<|im_start|>": 4, "<|im_end|>": 5}
    assert tokenizer.convert_tokens_to_ids(list(expected)) == list(expected.values())
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert (tokenizer.pad_token, tokenizer.unk_token) == ("<pad>", "<unk>")
    ids = tokenizer("Explain the water cycle.")["input_ids"]
    assert ids[0] != tokenizer.bos_token_id and ids[-1] != tokenizer.eos_token_id
    # The im tokens are atomic special tokens, never split.
    assert tokenizer("<|im_start|>user")["input_ids"][0] == 4


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "  leading spaces\nand\ttabs  ",
        "Zürich, 東京, emoji 🙂 and ümlauts",
        "```python\ndef f(x):\n    return x * 2\n```",
        "",
    ],
)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_chat_template_renders(tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert tokenizer.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    out = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = np.array(out["input_ids"]), np.array(out["assistant_masks"], dtype=bool)
    assert tokenizer.decode(ids[mask].tolist()) == "Hello!<|im_end|>"


def test_instruction_lengths_have_long_tail(tokenizer):
    rows = _rows("sample/instructions.jsonl")
    assert len(rows) == 3000
    assert all(set(r) == {"instruction", "input", "output"} for r in rows)
    assert sum(1 for r in rows if r["input"] == "") > 500
    texts = [f"{r['instruction']}\n{r['input']}\n{r['output']}" for r in rows]
    lengths = np.array([len(ids) for ids in tokenizer(texts)["input_ids"]])
    assert 50 <= np.median(lengths) <= 500
    assert ((lengths >= 50) & (lengths <= 500)).mean() > 0.6
    assert (lengths > 2000).sum() >= 3  # a tail into thousands
    assert 2 <= (lengths > 8192).sum() <= 5  # --max-len 8192 truncates a few


def test_chat_and_text_shapes():
    chats = _rows("sample/chat.jsonl")
    assert 100 <= len(chats) <= 1000
    for row in chats:
        roles = [m["role"] for m in row["messages"]]
        body = roles[1:] if roles[0] == "system" else roles
        assert body[0::2] == ["user"] * (len(body) // 2) and body[1::2] == ["assistant"] * (len(body) // 2)
        assert all(m["content"] for m in row["messages"])
    assert any(len(r["messages"]) >= 5 for r in chats)  # multi-turn
    texts = _rows("sample/text.jsonl")
    assert 100 <= len(texts) <= 1000 and all(set(r) == {"text"} and r["text"] for r in texts)


def test_data_folder_is_small():
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert total < 4 * 1024 * 1024
