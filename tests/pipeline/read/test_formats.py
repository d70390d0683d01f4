"""pipeline.read.formats: format auto-detection, templates, segments with loss flags, clear field errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pipeline.errors import UserError
from pipeline.read.formats import (
    ALPACA,
    ALPACA_NO_INPUT,
    TEMPLATES,
    FormatOptions,
    detect_format,
    detect_formats,
    resolve_template,
)
from pipeline.tokenize.render import chat_segments, render, rows_where

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = ROOT / "data" / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    from pipeline.tokenize.tokenizer import load_tokenizer

    return load_tokenizer(str(TOKENIZER))


@pytest.mark.parametrize(
    ("columns", "kind", "fields", "template"),
    [
        (["text", "meta"], "text", {"text": "text"}, None),
        (["content"], "text", {"text": "content"}, None),
        (["instruction", "input", "output"], "instruction", {"prompt": "instruction", "input": "input", "response": "output"}, "alpaca"),
        (["instruction", "output"], "instruction", {"prompt": "instruction", "input": None, "response": "output"}, "alpaca"),
        (["prompt", "completion"], "instruction", {"prompt": "prompt", "input": None, "response": "completion"}, "plain"),
        (["question", "answer"], "instruction", {"prompt": "question", "input": None, "response": "answer"}, "qa"),
        (["messages", "id"], "chat", {"messages": "messages"}, None),
        (["conversations"], "chat", {"messages": "conversations"}, None),
        (["input_ids", "labels", "text"], "tokenized", {"input_ids": "input_ids", "labels": "labels"}, None),
        (["input_ids"], "tokenized", {"input_ids": "input_ids", "labels": None}, None),
    ],
)
def test_auto_detection(columns, kind, fields, template):
    fmt = detect_format(columns, FormatOptions())
    assert fmt.kind == kind
    assert fmt.fields == fields
    assert fmt.template_name == template


def test_explicit_fields_choose_format_and_columns():
    fmt = detect_format(["body", "text"], FormatOptions(text_field="body"))
    assert (fmt.kind, fmt.fields["text"]) == ("text", "body")
    fmt = detect_format(["q", "a", "text"], FormatOptions(prompt_field="q", response_field="a"))
    assert (fmt.kind, fmt.fields["prompt"], fmt.fields["response"]) == ("instruction", "q", "a")
    assert fmt.template_name == "plain"


@pytest.mark.parametrize(
    ("columns", "options", "needle"),
    [
        (["foo", "bar"], FormatOptions(), "cannot tell the format"),
        (["text"], FormatOptions(text_field="body"), "--text-field"),
        (["text"], FormatOptions(format="chat"), "--messages-field"),
        (["instruction"], FormatOptions(format="instruction"), "--response-field"),
        (["text"], FormatOptions(format="tokenized"), "input_ids"),
        (["text"], FormatOptions(format="yaml"), "unknown --format"),
    ],
)
def test_detection_errors_are_one_line_with_a_fix(columns, options, needle):
    with pytest.raises(UserError) as err:
        detect_format(columns, options)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_formats_are_detected_per_file_and_errors_name_the_file():
    files = [("a.jsonl", ["instruction", "input", "output"]), ("b.jsonl", ["messages"]), ("c.parquet", ["text"])]
    kinds = [f.kind for f in detect_formats(files, FormatOptions())]
    assert kinds == ["instruction", "chat", "text"]
    with pytest.raises(UserError) as err:
        detect_formats(files, FormatOptions(text_field="text"))
    assert "column 'text' not found in a.jsonl" in str(err.value) and "--text-field" in str(err.value)
    with pytest.raises(UserError) as err:
        detect_formats([("a.jsonl", ["text"]), ("odd.csv", ["foo"])], FormatOptions())
    assert "columns of odd.csv (foo)" in str(err.value)


def test_templates():
    assert resolve_template("qa", "alpaca") == (TEMPLATES["qa"], "qa")
    assert resolve_template(None, "alpaca") == (ALPACA, "alpaca")
    assert resolve_template("Q: {prompt} ({input})\nA:", "plain") == ("Q: {prompt} ({input})\nA:", None)
    for bad in ("{nope}", "no placeholder", "{prompt"):
        with pytest.raises(UserError, match="--template"):
            resolve_template(bad, "plain")


def test_instruction_segments_template_and_loss():
    table = pa.table({"instruction": ["Add 2+2", "Name a colour"], "input": ["numbers", None], "output": ["4", "red"]})
    fmt = detect_format(table.column_names, FormatOptions())
    segs = render(table, fmt, rows_where("f.jsonl", 0))
    assert segs.texts[0] == ALPACA.format(instruction="Add 2+2", input="numbers")
    assert segs.texts[2] == ALPACA_NO_INPUT.format(instruction="Name a colour")  # null input is optional
    assert segs.texts[1::2] == ["4", "red"]
    assert segs.example.tolist() == [0, 0, 1, 1]
    assert segs.loss.tolist() == [False, True, False, True]
    fmt = detect_format(table.column_names, FormatOptions(train_on_prompt=True, template="{instruction}|{input}|"))
    segs = render(table, fmt, rows_where("f.jsonl", 0))
    assert segs.texts[0] == "Add 2+2|numbers|" and segs.texts[2] == "Name a colour||"
    assert segs.loss.all()


@pytest.mark.parametrize("template", ["qa", "plain", "chatml-lite", "Q: {instruction}\nA: "])
def test_a_template_without_input_stops_at_the_first_row_whose_input_has_text(template):
    table = pa.table({"instruction": ["a", "b", "c"], "input": [None, "  ", "the context"], "output": ["1", "2", "3"]})
    fmt = detect_format(table.column_names, FormatOptions(template=template))
    assert fmt.fields["input"] == "input"
    with pytest.raises(UserError) as err:
        render(table, fmt, rows_where("d.jsonl", 0))
    msg = str(err.value)
    assert msg.startswith("d.jsonl row 3: field 'input' has text") and "--input-field none" in msg and "\n" not in msg
    # rows whose input is null, empty or blank lose nothing: they render as before
    assert render(table.slice(0, 2), fmt, rows_where("d.jsonl", 0)).texts[1::2] == ["1", "2"]


def test_input_field_none_leaves_the_input_out_on_purpose():
    table = pa.table({"instruction": ["a"], "input": ["the context"], "output": ["1"]})
    fmt = detect_format(table.column_names, FormatOptions(template="qa", input_field="none"))
    assert fmt.fields["input"] is None  # recorded as such in the manifest's resolved_formats
    assert render(table, fmt, rows_where("d.jsonl", 0)).texts == [TEMPLATES["qa"].format(prompt="a"), "1"]
    # negative control: templates with {input} keep it
    for options in (FormatOptions(), FormatOptions(template="{instruction} / {input}")):
        texts = render(table, detect_format(table.column_names, options), rows_where("d.jsonl", 0)).texts
        assert "the context" in texts[0]


def test_null_required_field_names_file_and_row():
    table = pa.table({"question": ["a", "b", None], "answer": ["1", "2", "3"]})
    fmt = detect_format(table.column_names, FormatOptions())
    with pytest.raises(UserError, match=r"data.jsonl row 13: field 'question' is missing or null"):
        render(table, fmt, rows_where("data.jsonl", 10))
    table = pa.table({"text": ["x", None]})
    with pytest.raises(UserError, match="t.jsonl row 2"):
        render(table, detect_format(["text"], FormatOptions()), rows_where("t.jsonl", 0))


CHAT_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
PAIR_ROW = {"instruction": "add 2 and 2", "output": "4"}


def records(rows: list[dict]) -> pa.Table:
    """Rows as a table with a column for every key of any row (None where a row lacks it), as read."""
    keys = dict.fromkeys(k for r in rows for k in r)
    return pa.Table.from_pydict({k: [r.get(k) for r in rows] for k in keys})


@pytest.mark.parametrize(
    ("rows", "row", "has", "kind", "needs"),
    [
        ([CHAT_ROW] * 3 + [PAIR_ROW] * 2, 4, "instruction, output (instruction format)", "chat", "'messages'"),
        ([PAIR_ROW] * 2 + [CHAT_ROW], 1, "instruction, output (instruction format)", "chat", "'messages'"),
        ([{"text": "doc"}, {"question": "q", "answer": "a"}], 1, "text (text format)", "instruction", "'question' and 'answer'"),
        ([{"input_ids": [1, 2]}, {"text": "doc"}], 2, "text (text format)", "tokenized", "'input_ids'"),
    ],
)
def test_a_file_that_mixes_formats_is_one_line_naming_the_row_its_fields_and_the_fix(tokenizer, rows, row, has, kind, needs):
    """The format of a file comes from all its fields; its first row that lacks what that format
    needs and has another format's fields instead is named, with both sets of fields and the fix."""
    from pipeline.tokenize.render import check_same_format

    table = records(rows)
    fmt = detect_format(table.column_names, FormatOptions())
    assert fmt.kind == kind
    with pytest.raises(UserError) as info:
        if kind == "tokenized":
            check_same_format(table, fmt, rows_where("mixed.jsonl"))
        else:
            render(table, fmt, rows_where("mixed.jsonl"), tokenizer)
    msg = str(info.value)
    assert msg == (
        f"mixed.jsonl row {row}: the file mixes formats: this row has the fields {has}, but the file is "
        f"read as {kind}, which needs {needs} in every row: split it into one file per format (each "
        "input file gets its own format), or pass --format and the field options that fit every row"
    )


def test_rows_missing_a_field_without_another_formats_fields_keep_the_missing_field_message(tokenizer):
    """A row of the file's own format with a field left out, or with no format's fields at all, is
    a missing field, not a mix of formats; the same when the file is read with an explicit --format."""
    table = records([{"question": "q", "answer": "a"}, {"question": "q2"}])
    fmt = detect_format(table.column_names, FormatOptions())
    with pytest.raises(UserError, match=r"^d.jsonl row 2: field 'answer' is missing or null"):
        render(table, fmt, rows_where("d.jsonl"))
    table = records([{"text": "doc", "id": 1}, {"id": 2}])
    with pytest.raises(UserError, match=r"^d.jsonl row 2: field 'text' is missing or null"):
        render(table, detect_format(table.column_names, FormatOptions()), rows_where("d.jsonl"))
    table = records([PAIR_ROW, CHAT_ROW])
    fmt = detect_format(table.column_names, FormatOptions(format="instruction"))
    with pytest.raises(
        UserError,
        match=r"^d.jsonl row 2: the file mixes formats: this row has the fields messages "
        r"\(chat format\), but the file is read as instruction",
    ):
        render(table, fmt, rows_where("d.jsonl"), tokenizer)


def test_chat_segments_mark_only_assistant_turns(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    segs = chat_segments(messages, tokenizer, train_on_prompt=False)
    assert "".join(t for t, _ in segs) == tokenizer.apply_chat_template(messages, tokenize=False)
    loss_text = [t for t, loss in segs if loss]
    assert loss_text == ["Hello.<|im_end|>", "4<|im_end|>"]  # the generation blocks, not the "\n" after them
    assert all("Hi?" not in t and "Be brief" not in t for t in loss_text)
    whole = chat_segments(messages, tokenizer, train_on_prompt=True)
    assert len(whole) == 1 and whole[0][1]


def test_sharegpt_turns_are_accepted(tokenizer):
    table = pa.table({"conversations": [[{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]]})
    fmt = detect_format(table.column_names, FormatOptions())
    segs = render(table, fmt, rows_where("c.jsonl", 0), tokenizer)
    assert [t for t, loss in zip(segs.texts, segs.loss) if loss] == ["Yo<|im_end|>"]


def test_chat_without_template_is_a_clear_error(tmp_path):
    from pipeline.tokenize.tokenizer import load_tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(TOKENIZER, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in folder.glob("chat_template*"):
        extra.unlink()
    tok = load_tokenizer(str(folder))
    table = pa.table({"messages": [[{"role": "user", "content": "Hi"}]]})
    with pytest.raises(UserError, match="no chat template"):
        render(table, detect_format(["messages"], FormatOptions()), rows_where("c.jsonl", 0), tok)


def test_empty_chat_is_an_example_with_no_segments(tokenizer):
    table = pa.table({"messages": [[], [{"role": "user", "content": "Hi"}]]})
    segs = render(table, detect_format(["messages"], FormatOptions()), rows_where("c.jsonl", 0), tokenizer)
    assert segs.n_examples == 2
    assert set(np.unique(segs.example)) == {1}


def test_an_unknown_chat_role_is_refused_naming_the_allowed_ones():
    from pipeline.tokenize.render import normalise_messages

    assert normalise_messages([{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}], "r") == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    with pytest.raises(
        UserError,
        match=r"chat.jsonl line 3: unknown message role 'wizard': use one of "
        r"system, developer, user, assistant, tool",
    ):
        normalise_messages([{"role": "wizard", "content": "abracadabra"}], "chat.jsonl line 3")


TOOL_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<call>{{ c.function.name }}"
    "({{ c.function.arguments | tojson }})</call>{% endfor %}{% endif %}"
    "{% if m.tool_call_id is defined %}[{{ m.tool_call_id }}]{% endif %};{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_tool_calls_and_the_tool_role_reach_the_chat_template(tokenizer):
    """An assistant's tool_calls (with no content) and a tool message's tool_call_id are rendered as
    the template renders them; the null keys Arrow adds (a key one message has and another lacks,
    an argument only another call has) are left out; the assistant's call carries loss."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    tok.add_tokens(["<|user|>", "<|assistant|>", "<|tool|>"])  # its markers, tokens of the vocabulary
    rows = [
        [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            {"role": "assistant", "content": "It is sunny."},
        ],
        [
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"x": 1}}}]},
        ],
    ]
    table = pa.table({"messages": rows})  # Arrow: every message gets tool_calls and tool_call_id
    segs = render(table, detect_format(["messages"], FormatOptions()), rows_where("c.jsonl", 0), tok)
    first = "".join(t for t, e in zip(segs.texts, segs.example) if e == 0)
    assert first == (
        '<|user|>weather?;<|assistant|><call>get_weather({"city": "Paris"})</call>;<|tool|>sunny[c1];<|assistant|>It is sunny.;'
    ), first
    second = [(t, bool(l)) for t, e, l in zip(segs.texts, segs.example, segs.loss) if e == 1]
    assert ('<call>add({"x": 1})</call>;', True) in second, second  # no "city": null from the other row


@pytest.mark.parametrize(
    "template, dressed",
    [
        ("{prompt:d}", "{prompt:d}"),
        ("{instruction!r} {input}", "{instruction!r}"),
        ("{instruction:>10}", "{instruction:>10}"),
        ("{instruction} {input:{x}}", "{input:{x}}"),
    ],
)
def test_a_template_placeholder_with_a_format_spec_is_one_line(template: str, dressed: str):
    from pipeline.read.formats import resolve_template

    with pytest.raises(UserError, match=re.escape(f"{dressed} has a format spec or conversion; write the placeholders bare")):
        resolve_template(template, "alpaca")
