"""Long conversations: `chat_segments` splits a conversation of many messages in linear time
(`_local_segments`), with exactly the segments of rendering every prefix, for the templates that
allow it, and falls back to the prefixes for those that do not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.tokenize.chat_turns import LOCAL_FROM, _local_segments, _prefix_segments, chat_segments
from pipeline.tokenize.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = str(ROOT / "data" / "tokenizer")

# Llama-2's template: the system prompt goes into the first user turn, roles must alternate
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '<s>' + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' </s>' }}{% endif %}{% endfor %}"
)
# Llama-3's: one BOS, then a header per message
LLAMA3 = (
    "{{ '<s>' }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n\\n' + message['content'] "
    "| trim + '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n\\n' }}{% endif %}"
)
# Qwen2.5's: a default system prompt when the conversation has none
QWEN = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NUMBERED = (  # the turn number of every message: a window would number it wrongly
    "{% for message in messages %}{{ 'Turn ' + loop.index|string + ' ' + message['role'] + ': ' + message['content'] "
    "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'Turn ' + (messages|length + 1)|string + ' assistant: ' }}"
    "{% endif %}"
)
LAST_ONLY = (  # not prefix by prefix: the last message is marked
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] }}{% if loop.last %}{{ ' [end]' }}"
    "{% endif %}{{ '\\n' }}{% endfor %}"
)


def conversation(n_pairs: int, system: bool = True) -> list[dict[str, str]]:
    rows = [json.loads(line) for line in (ROOT / "data/sample/chat.jsonl").read_text().splitlines()]
    turns = [m for r in rows for m in r["messages"] if m["role"] != "system"]
    users = [m["content"] for m in turns if m["role"] == "user"]
    answers = [m["content"] for m in turns if m["role"] == "assistant"]
    msgs = [{"role": "system", "content": "Be brief."}] if system else []
    for k in range(n_pairs):
        msgs += [{"role": "user", "content": f" {users[k % len(users)]} "}, {"role": "assistant", "content": answers[k % len(answers)]}]
    return msgs


def tokenizer_with(template: str | None):
    tok = load_tokenizer(TOKENIZER)
    if template is not None:
        tok.chat_template = template
    return tok


def renderer(tok):
    def render(msgs, gen=False):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) if msgs else ""

    return render


@pytest.mark.parametrize("template", [None, LLAMA2, LLAMA3, QWEN])
@pytest.mark.parametrize("system", [True, False])
def test_windows_give_the_segments_of_every_prefix(template: str | None, system: bool):
    render = renderer(tokenizer_with(template))
    msgs = conversation(30, system)
    local = _local_segments(msgs, render)
    assert local is not None and local == _prefix_segments(msgs, render)
    assert any(loss for _, loss in local) and any(not loss for _, loss in local)


def test_a_template_that_numbers_turns_falls_back_to_prefixes():
    tok = tokenizer_with(NUMBERED)
    msgs = conversation(12)
    assert _local_segments(msgs, renderer(tok)) is None
    assert chat_segments(msgs, tok, False) == _prefix_segments(msgs, renderer(tok))
    assert ("Turn 25 assistant: ", False) in chat_segments(msgs, tok, False)


def test_a_template_not_prefix_by_prefix_is_still_refused_in_one_line():
    with pytest.raises(UserError, match="does not render conversations prefix by prefix"):
        chat_segments(conversation(12), tokenizer_with(LAST_ONLY), False)


def test_a_long_conversation_renders_a_number_of_messages_linear_in_its_length():
    tok = tokenizer_with(None)
    whole = tok.apply_chat_template
    calls: list[int] = []  # messages rendered per call
    tok.apply_chat_template = lambda m, **kw: calls.append(len(m)) or whole(m, **kw)
    for n_pairs in (100, 400):
        msgs = conversation(n_pairs)
        calls.clear()
        segments = chat_segments(msgs, tok, False)
        assert len(msgs) > LOCAL_FROM and sum(calls) <= 20 * len(msgs)  # every prefix: len(msgs) ** 2 / 2 or more
        assert "".join(t for t, _ in segments) == whole(msgs, tokenize=False)
