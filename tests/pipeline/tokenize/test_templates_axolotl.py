"""The named chat templates are Axolotl's own files, byte for byte (Axolotl 0.19.0, the PyPI sdist
axolotl-0.19.0.tar.gz, src/axolotl/utils/chat_templates/templates/NAME.jinja: the SHA-256 of each
file there), and Axolotl's qwen3 trains its last reply as Axolotl renders it: after the
empty reasoning block, which carries no loss. (Each is compared with apply_chat_template's
rendering token by token and mask by mask in test_templates_round4.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pipeline.tokenize.chat_templates import NAMED
from pipeline.tokenize.chat_turns import chat_segments
from pipeline.tokenize.tokenizer import load_tokenizer

TOKENIZER = Path(__file__).resolve().parents[3] / "data" / "tokenizer"
AXOLOTL_SHA256 = {
    "chatml": "e7a3df47d72feec173403ca6c63b3632edde3536fc0f5a4413ab432a2cfddb8d",
    "llama3": "e7f0dce6b67524c32dc234d159dd4ce1cc92b74bc0ec905caa1b7765e448259e",
    "qwen_25": "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
    "qwen3": "8a7de74d0cb8060fae0f830aa16cee5f35aa8ba07bfb3f3a06290ff4aae90849",
    "gemma": "1d096f2ee097e52920f9ccbaddda5a025ec71ad540b5676862e6ba978efdc626",
    "gemma3": "f9a34f0fd767baf6e6a990f54ea9189611086350025a1b743afbec62c7d242c8",
    "phi_3": "f10b966738c6926071e76474228b2d7f569da8d699a392e73d4215a09ebbc9c4",
    "mistral_v1": "6757558eb58d2df189712a697cd28d8f77ba53142c2c51136632736ff5e0e40a",
    "mistral_v3_tekken": "5d73b7eebd0d38168b7a59fec462efa5aebb0dd3ddb4e9e8ffa5b53c51dff719",
    "mistral_v7_tekken": "848b4e6befdfcf887467dd882616b343433e8b2a2ccb4375274e4a29679ea709",
}


@pytest.mark.parametrize("name", sorted(AXOLOTL_SHA256))
def test_each_named_template_is_axolotls_file(name: str):
    assert hashlib.sha256(NAMED[name].encode()).hexdigest() == AXOLOTL_SHA256[name]


def test_only_llama2_is_not_axolotls():
    assert set(NAMED) - set(AXOLOTL_SHA256) == {"llama2"}  # Axolotl ships no Llama-2 template


def test_qwen3_trains_each_reply_and_not_the_reasoning_block_of_the_last():
    tok = load_tokenizer(str(TOKENIZER), "qwen3", ["<|im_start|>", "<|im_end|>"])
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    segments = chat_segments(messages, tok, False)
    assert [text for text, loss in segments if loss] == ["4<|im_end|>", "6<|im_end|>"]
    # the whole rendering as Axolotl renders it: only the last reply after an (empty) reasoning block
    assert "".join(text for text, _ in segments) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n6<|im_end|>\n"
    )
