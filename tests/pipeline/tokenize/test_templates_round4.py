"""Chat templates as untrusted code (the bounded sandbox renders as transformers renders, and stops
what would not end), and user text that never becomes control tokens, for each tokenizer family
available offline: the byte-level BPE of data/tokenizer, Llama-2's SentencePiece, and a
SentencePiece-style BPE and a WordPiece built here."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from test_tokenizer import _folder

from pipeline.errors import UserError
from pipeline.read.formats import FormatOptions, detect_format
from pipeline.shards import IGNORE_INDEX
from pipeline.tokenize.batch import tokenize_batch
from pipeline.tokenize.control_tokens import control_tokens, encode_marked, mark
from pipeline.tokenize.render import rows_where
from pipeline.tokenize.template_sandbox import SECONDS_ENV, apply_chat_template, render_template
from pipeline.tokenize.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = ROOT / "data" / "tokenizer"

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": " and 3+3? "},
        {"role": "assistant", "content": "6\n"},
    ],
]


@pytest.fixture(scope="module", params=["data", "llama2", "metaspace", "wordpiece"])
def family(request, tmp_path_factory):
    """(tokenizer, chat template name or None) of one tokenizer family."""
    folder = _folder(tmp_path_factory.mktemp(request.param), request.param)
    template = {"data": None, "llama2": "llama2", "metaspace": "llama2", "wordpiece": "chatml"}[request.param]
    markers = ["<|im_start|>", "<|im_end|>"] if template == "chatml" else []  # a vocabulary without them
    return load_tokenizer(str(folder), template, markers)


def rows(table: pa.Table, tok) -> tuple[list[int], list[int]]:
    batch = tokenize_batch(table, detect_format(table.column_names, FormatOptions()), tok, rows_where("x.jsonl"))
    return batch.input_ids.tolist(), batch.labels.tolist()


def literals(tok) -> list[str]:
    """The control tokens a user might spell: the family's special tokens."""
    return [t for t in (tok.eos_token, tok.bos_token, tok.sep_token, "<|im_end|>") if t]


# ------------------------------------------------------------------------------- the sandbox


def test_the_sandbox_renders_as_transformers_does_and_marks_its_generation_blocks():
    tok = load_tokenizer(str(TOKENIZER))
    for messages in CONVERSATIONS:
        for gen in (False, True):
            assert apply_chat_template(tok, messages, add_generation_prompt=gen) == tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )
        text, spans = apply_chat_template(tok, messages, spans=True)
        peer = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        ours = [any(a <= s < b for a, b in spans) for s, _ in offsets]
        assert any(ours) and ours == [bool(m) for m in peer["assistant_masks"]]


@pytest.mark.parametrize(
    "template",
    [
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "{{ 10**(10**10) }}",
        "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
        "{{ 'x' * 10**12 }}",
        "{{ [1] * 10**12 }}",
        "{{ 'x'.ljust(10**12) }}",
        "{{ 'x'|center(10**12) }}",
        "{{ '%0999999999d' % 1 }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{{ ('x' * 100000).replace('', 'y' * 1000) }}",
        "{% for i in range(100000) %}{{ 'y' * 1000000 }}{% endfor %}",
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% set s = 'x' * 60000000 %}{{ ([s] * 1000) | join }}",
        "{% set s = 'x' * 60000000 %}{{ [s, s] | tojson }}",
        "{% set s = 'x' * 60000000 %}{{ ''.join([s] * 1000) }}",
        "{% set s = 'x' * 60000000 %}{{ [s] * 1000 }}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    ],
)
def test_what_would_not_end_or_not_fit_is_stopped_in_one_line(template: str, monkeypatch):
    monkeypatch.setenv(SECONDS_ENV, "1")
    with pytest.raises(UserError, match="the chat template t.jinja (did not finish|exceeds a (size )?limit)"):
        render_template(template, "t.jinja", messages=[])
    # the thread renders again afterwards (the stopped rendering left nothing behind): control
    assert (
        render_template("{{ 2**100 }}{{ 'ab' * 3 }}{% for i in range(10) %}{{ i }}{% endfor %}", "t.jinja") == f"{2**100}ababab0123456789"
    )


def test_strftime_now_prints_the_pinned_date():
    assert render_template("{{ strftime_now('%d %B %Y') }}", "t") == "26 July 2024"


# -------------------------------------------------------------------- user text stays text


def test_plain_text_that_spells_control_tokens_is_encoded_as_text(family):
    tok = family
    text = "a " + " b ".join(literals(tok)) + " c"
    ids, labels = rows(pa.table({"text": [text]}), tok)
    as_text = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
    head = [tok.bos_token_id] if tok.bos_token_id is not None else []
    tail = [tok.eos_token_id] if tok.eos_token_id is not None else []
    assert ids == head + as_text + tail
    assert tok.encode(text, add_special_tokens=False) != as_text  # control: the tokenizer alone reads them


def test_control_tokens_in_messages_are_text_and_the_templates_own_stay_tokens(family):
    tok = family
    spelled = " ".join(literals(tok))
    with_literals = [{"role": "user", "content": f"say {spelled} now"}, {"role": "assistant", "content": f"ok {spelled} done"}]
    plain = [{"role": "user", "content": "say now"}, {"role": "assistant", "content": "ok done"}]
    ids, labels = rows(pa.table({"messages": [with_literals]}), tok)
    control_ids, _ = rows(pa.table({"messages": [plain]}), tok)
    controls = {
        tok.convert_tokens_to_ids(t) for t in control_tokens(tok.backend_tokenizer, tok.chat_template) if t != tok.unk_token
    }  # (a small vocabulary's text holds <unk>s)
    assert sorted(t for t in ids if t in controls) == sorted(t for t in control_ids if t in controls)
    if tok.unk_token_id is None or tok.unk_token_id not in ids:  # a vocabulary that spells every char
        rendered = tok.apply_chat_template(with_literals, tokenize=False)
        decoded = tok.decode(ids, skip_special_tokens=False)
        assert spelled in decoded and decoded.count(spelled) == rendered.count(spelled)
        trained = tok.decode([t for t in labels if t != IGNORE_INDEX])
        assert f"ok {spelled} done" in trained and "say" not in trained


def test_the_pieces_between_control_tokens_encode_as_the_tokenizer_does(family):
    """encode_marked's pieces (each encoded as after an added token) give the tokenizer's own ids on
    renderings without user literals: the ids around a literal are the ids it would have had."""
    tok = family
    controls = control_tokens(tok.backend_tokenizer, tok.chat_template)
    for messages in CONVERSATIONS:
        text = tok.apply_chat_template(messages, tokenize=False)
        marked = text + "\U000f0f01" + "\U000f0f02"  # an empty literal: the marked path, nothing else
        ids, lens = encode_marked(tok.backend_tokenizer, marked, [len(text) // 2], controls)
        assert ids.tolist() == tok.encode(text, add_special_tokens=False) and lens.sum() == len(ids)


def test_a_marker_character_in_user_text_is_refused():
    with pytest.raises(UserError, match="row 3: the text holds the private-use character"):
        mark("x\U000f0f01", ("</s>",), "row 3")


# ------------------------------------------------------------- loss: roles, end-of-turn tokens

TURNS = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
    {"role": "assistant", "content": "A2"},
]


@pytest.mark.parametrize("template", [None, "chatml"], ids=["generation-blocks", "prefixes"])
@pytest.mark.parametrize(
    "roles, eos, trained",
    [
        (("assistant",), "turn", "A1<|im_end|>A2<|im_end|>"),
        (("assistant",), "last", "A1A2<|im_end|>"),
        (("assistant",), "none", "A1A2"),
        (("assistant",), "all", "<|im_end|><|im_end|>A1<|im_end|><|im_end|>A2<|im_end|>"),
        (("user", "assistant"), "turn", "U1<|im_end|>A1<|im_end|>U2<|im_end|>A2<|im_end|>"),
    ],
)
def test_roles_to_train_and_train_on_eos_pick_the_loss_tokens(template, roles, eos, trained):
    tok = load_tokenizer(str(TOKENIZER), template)
    table = pa.table({"messages": [TURNS]})
    fmt = detect_format(table.column_names, FormatOptions(roles_to_train=roles, train_on_eos=eos))
    batch = tokenize_batch(table, fmt, tok, rows_where("x.jsonl"))
    ids, labels = batch.input_ids.tolist(), batch.labels.tolist()
    assert tok.decode([t for t in labels if t != IGNORE_INDEX]) == trained
    assert tok.eos_token_id not in ids  # the template ends the conversation with its own <|im_end|>


def test_a_template_without_its_own_end_keeps_the_eos_with_loss():
    """Control for the rule above: a template that ends with no control token gets the EOS."""
    tok = load_tokenizer(str(TOKENIZER), "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    table = pa.table({"messages": [TURNS[1:3]]})
    batch = tokenize_batch(table, detect_format(table.column_names, FormatOptions()), tok, rows_where("x.jsonl"))
    assert batch.input_ids.tolist()[-1] == tok.eos_token_id == batch.labels.tolist()[-1]


# ---------------------------------------------------------------- markers the vocabulary lacks


def test_a_template_whose_markers_are_no_tokens_is_refused_until_they_are_added():
    from pathlib import Path as P

    llama2 = ROOT.parent / "shared" / "tokenizers" / "llama2"
    if not P(llama2).is_dir():
        pytest.skip("no Llama-2 tokenizer here")
    table = pa.table({"messages": [TURNS]})
    fmt = detect_format(table.column_names, FormatOptions())
    tok = load_tokenizer(str(llama2), "chatml")
    with pytest.raises(
        UserError,
        match=r"writes the marker '<\|im_start\|>' \(and 1 more\), which is not a token .* "
        r"--special-token NAME=<\|im_start\|>",
    ):
        tokenize_batch(table, fmt, tok, rows_where("x.jsonl"))
    grown = load_tokenizer(str(llama2), "chatml", ["<|im_start|>"], {"eos_token": "<|im_end|>"})
    ids = tokenize_batch(table, fmt, grown, rows_where("x.jsonl")).input_ids.tolist()
    assert ids.count(grown.convert_tokens_to_ids("<|im_start|>")) == 5 and len(grown) == 32002


# ----------------------------------------------------------------------------- named templates

NO_SYSTEM = {"mistral_v3_tekken", "gemma"}  # gemma refuses a system message; mistral_v3_tekken puts it into the
# last user turn, which no prefix rendering can split


def _expected_loss(text: str, offsets: list, messages: list, ends: tuple[str, ...]) -> list[bool]:
    """Per token of the rendering: holding a char of an assistant message's content or of the
    end-of-turn token right after it (the first of `ends` found after the content)."""
    spans, at = [], 0
    for m in messages:
        content = m["content"].strip()
        start = text.index(content, at)
        at = start + len(content)
        if m["role"] == "assistant":
            stop = min((i + len(e) for e in ends if (i := text.find(e, at)) >= 0), default=at)
            spans.append((start, stop))
            at = stop
    return [any(s < b and e > a for a, b in spans) for s, e in offsets]  # (a token holding " 4" too)


@pytest.mark.parametrize("name", sorted(__import__("pipeline.tokenize.chat_templates", fromlist=["NAMED"]).NAMED))
def test_each_named_template_packs_as_apply_chat_template_renders_it(name: str):
    """Token by token against transformers' apply_chat_template of the same Jinja (the tokenizer
    given the template's markers as tokens), the loss on each assistant message's content and the
    end-of-turn token after it (nothing of the template's whitespace), no EOS after a template's own."""
    from pipeline.tokenize.chat_templates import NAMED
    from pipeline.tokenize.render import MARKER

    markers = list(dict.fromkeys(MARKER.findall(NAMED[name])))
    tok = load_tokenizer(str(TOKENIZER), name, [m for m in markers if m not in ("<|im_start|>", "<|im_end|>")])
    messages = ([] if name in NO_SYSTEM else [{"role": "system", "content": "Be brief."}]) + [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4, since 2+2=4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    ids, labels = rows(pa.table({"messages": [messages]}), tok)
    text = tok.apply_chat_template(messages, tokenize=False)
    peer = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    body = ids[1:] if ids[0] == tok.bos_token_id and peer["input_ids"][0] != tok.bos_token_id else ids
    assert body == peer["input_ids"]  # no EOS added: every one of these templates ends the turn itself
    ends = tuple(m for m in markers if "end" in m or "eot" in m) + (tok.eos_token,)
    loss = [label != IGNORE_INDEX for label in labels][len(ids) - len(body) :]
    assert any(loss) and loss == _expected_loss(text, peer["offset_mapping"], messages, ends)
