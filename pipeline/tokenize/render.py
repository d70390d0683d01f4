"""Render each example of a batch into text segments, by its file's format (`pipeline.read.formats`).

A *segment* is a piece of text with a loss flag: the prompt of an instruction pair carries no loss
(unless `--train-on-prompt`), its response does; every token of plain text carries loss; the
assistant turns of a chat carry loss. `pipeline.tokenize.batch` tokenizes each example's segments
joined into its whole text, splits the ids where the segments meet and adds BOS/EOS; this module
only decides *what* text goes where.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import UserError, one_line
from pipeline.foreign.data import DROP_FIRST_SYSTEM
from pipeline.read import formats
from pipeline.read.formats import NO_INPUT, NO_INPUT_FORMS, ROLE_ALIASES, ROLES, FormatOptions, ResolvedFormat
from pipeline.tokenize.chat_turns import (
    chat_segments,
    check_assistant_rendered,
    ends_with_control,
    eos_policy,
    reasoning_split,
    without_trailing_space,
)
from pipeline.tokenize.content_parts import with_text_content
from pipeline.tokenize.control_tokens import control_tokens, mark
from pipeline.tokenize.template_sandbox import apply_chat_template, template_name


@dataclass
class Segments:
    """Rendered segments of a batch: `texts[k]` belongs to example `example[k]` with loss `loss[k]`.

    `example` is non-decreasing; an example with no segment at all (or only blank text) is empty.
    """

    texts: list[str]
    example: np.ndarray  # int64, index within the batch
    loss: np.ndarray  # bool
    n_examples: int
    controls: tuple[str, ...] = ()  # the control tokens the texts' markers wrap (`control_tokens.mark`)
    no_eos: np.ndarray | None = None  # bool per example: no EOS added (its template ends it with its own end of turn)
    as_rendered: bool = False  # a chat template's rendering: no BOS added (the template writes one where it wants)


Where = Callable[[int], str]  # row index within the batch -> "file line 17" (SourceBatch.where)


def rows_where(file: str, first_row: int = 0) -> Where:
    """A `Where` for a table without line numbers: 1-based record number within `file`."""
    return lambda i: f"{file} row {first_row + i + 1}"


def missing_field(table: pa.Table, name: str, where: Where) -> UserError:
    """Error for an input whose rows lack a field the chosen format needs (inputs with mixed fields)."""
    file = where(0).rsplit(" line ", 1)[0].rsplit(" row ", 1)[0]
    return UserError(
        f"{file} has no field {name!r} (its fields: {', '.join(table.column_names)}): all inputs of one "
        "run need the same fields; pack them separately or pass the field options"
    )


def needed_fields(fmt: ResolvedFormat) -> list[str]:
    """The columns every row of a file in this format must fill (the optional ones left out)."""
    keys = {"text": ("text",), "instruction": ("prompt", "response"), "chat": ("messages",), "tokenized": ("input_ids",)}[fmt.kind]
    return [str(fmt.fields[k]) for k in keys]


def check_same_format(table: pa.Table, fmt: ResolvedFormat, where: Where) -> None:
    """Raise a one-line UserError when the first row lacking a field the file's format needs has
    instead the fields of another format: the file mixes formats (say chat rows, then instruction
    rows). Other rows with a missing field are left to the readers of each field, which name it.

    The file's format is resolved from all its fields (`detect_format`), so a mixed file is read as
    the format its fields select first, and the rows of the other format lack that format's fields.
    """
    needed = needed_fields(fmt)
    first = table.num_rows
    for name in needed:
        if name not in table.column_names:
            first = 0
        elif table.column(name).null_count:
            first = min(first, int(pc.index(pc.is_null(table.column(name)), True).as_py()))
    if first == table.num_rows:
        return
    has = [c for c in table.column_names if table.column(c)[first].is_valid]
    if set(has) & set(needed):
        return  # a row of this format with a field missing
    try:
        other = formats.detect_format(has, FormatOptions())
    except UserError:
        return  # the fields of no format
    raise UserError(
        f"{where(first)}: the file mixes formats: this row has the fields {', '.join(has)} ({other.kind} "
        f"format), but the file is read as {fmt.kind}, which needs "
        f"{' and '.join(map(repr, needed))} in every row: split it into one file per format (each input file "
        "gets its own format), or pass --format and the field options that fit every row"
    )


def string_column(table: pa.Table, name: str, where: Where, *, optional: bool) -> list[str]:
    """A column as Python strings; a null in a required field is a one-line error naming its row."""
    if name not in table.column_names:
        if optional:
            return [""] * table.num_rows
        raise missing_field(table, name, where)
    col = table.column(name)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        if pa.types.is_null(col.type):
            col = pa.chunked_array([pa.nulls(len(col), pa.string())])
        else:
            try:
                col = pc.cast(col, pa.string())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise UserError(
                    f"{where(0)}: field {name!r} has type {one_line(col.type, 80)}, expected text: choose another field or --format"
                ) from None
    if col.null_count:
        if optional:
            col = pc.fill_null(col, "")
        else:
            first = int(pc.index(pc.is_null(col), True).as_py())
            raise UserError(f"{where(first)}: field {name!r} is missing or null: fix the row or remove it")
    return col.to_pylist()


def marked_column(texts: list[str], controls: tuple[str, ...], where: Where) -> list[str]:
    """`texts` with the control tokens they spell marked as the user's (`control_tokens.mark`)."""
    return [mark(t, controls, where(i)) for i, t in enumerate(texts)] if controls else texts


def render_text(table: pa.Table, fmt: ResolvedFormat, where: Where, tokenizer: Any = None) -> Segments:
    texts = string_column(table, fmt.fields["text"], where, optional=False)
    controls = control_tokens(tokenizer.backend_tokenizer) if tokenizer is not None else ()
    n = len(texts)
    return Segments(marked_column(texts, controls, where), np.arange(n, dtype=np.int64), np.ones(n, dtype=bool), n, controls)


def is_conversational(table: pa.Table, fmt: ResolvedFormat) -> bool:
    """Instruction data whose prompt column holds message lists: TRL's conversational
    prompt/completion (`prompt: [{role, content}]`, `completion: [{role: assistant, ...}]`)."""
    name = fmt.fields.get("prompt")
    return name in table.column_names and (pa.types.is_list(table.column(name).type) or pa.types.is_large_list(table.column(name).type))


def render_prompt_completion(table: pa.Table, fmt: ResolvedFormat, where: Where, tokenizer: Any) -> Segments:
    """TRL's conversational prompt/completion, as TRL 1.16's SFTTrainer._prepare_dataset (tokenize_fn,
    build_labels in trl/trainer/sft_trainer.py) makes it: the chat template over prompt + completion,
    nothing added (its apply_chat_template adds no BOS or EOS), the loss on all that follows the prompt
    rendered with the generation prompt: the template's whitespace after the end-of-turn token too, and
    a qwen3 reply's `</think>\n\n` (its generation prompt ends with `<think>\n\n`). With
    `--train-on-prompt`, on everything; a --train-on-eos other than turn moves that whitespace out."""
    if not hasattr(tokenizer, "chat_template"):
        raise UserError(
            f"{where(0)}: conversational prompt/completion data is rendered with the chat template, "
            "which --engine ray tasks do not load for instruction data: pack it with --engine local"
        )
    check_has_template(tokenizer)
    for name in (fmt.fields["prompt"], fmt.fields["response"]):
        if name not in table.column_names:
            raise missing_field(table, name, where)
    prompts = table.column(fmt.fields["prompt"]).to_pylist()
    completions = table.column(fmt.fields["response"]).to_pylist()
    controls = control_tokens(tokenizer.backend_tokenizer, tokenizer.chat_template)
    texts: list[str] = []
    example: list[int] = []
    loss: list[bool] = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        if not isinstance(completion, list):
            raise UserError(
                f"{where(i)}: field {fmt.fields['response']!r} is not a list of messages while "
                f"{fmt.fields['prompt']!r} is: give both as [{{role, content}}] lists, or both as text"
            )
        head_msgs = normalise_messages(prompt, where(i))
        msgs = head_msgs + normalise_messages(completion, where(i))
        if not msgs:
            continue
        msgs = mark(reasoning_split(with_text_content(msgs, tokenizer, where(i)), tokenizer, where(i)), controls, where(i))
        try:
            full = apply_chat_template(tokenizer, msgs)
            head = apply_chat_template(tokenizer, msgs[: len(head_msgs)], add_generation_prompt=True)
            bare = apply_chat_template(tokenizer, msgs[: len(head_msgs)]) if head_msgs else ""
        except UserError as exc:
            raise UserError(f"{where(i)}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any jinja error of a user template
            raise UserError(
                f"{where(i)}: the chat template {template_name(tokenizer)} failed on this conversation "
                f"({one_line(exc)}): fix the conversation or the template"
            ) from None
        if not full.startswith(bare):
            raise UserError(
                f"{where(i)}: the chat template {template_name(tokenizer)} is not prefix-stable: the prompt "
                "rendered alone is not the start of prompt + completion rendered together, so the loss "
                "would land on the prompt: fix the template (each message rendered the same whatever "
                "follows it)"
            )
        cut = len(head) if full.startswith(head) else len(os.path.commonprefix([head, full]))
        segs = [(full[:cut], fmt.train_on_prompt), (full[cut:], True)]
        if fmt.train_on_eos != "turn":
            segs = eos_policy(without_trailing_space(segs, controls), controls, fmt.train_on_eos)
        try:
            check_assistant_rendered(msgs[len(head_msgs) :], segs, template_name(tokenizer))
        except UserError as exc:
            raise UserError(f"{where(i)}: {exc}") from None
        for text, is_loss in segs:
            texts.append(text)
            example.append(i)
            loss.append(is_loss)
    return Segments(
        texts,
        np.asarray(example, dtype=np.int64),
        np.asarray(loss, dtype=bool),
        len(prompts),
        controls,
        np.ones(len(prompts), dtype=bool),
        as_rendered=True,
    )  # TRL adds no EOS either


def render_instruction(table: pa.Table, fmt: ResolvedFormat, where: Where, tokenizer: Any = None) -> Segments:
    template = fmt.template or "{prompt}"
    controls = control_tokens(tokenizer.backend_tokenizer, template) if tokenizer is not None else ()
    prompts = marked_column(string_column(table, fmt.fields["prompt"], where, optional=False), controls, where)
    responses = marked_column(string_column(table, fmt.fields["response"], where, optional=False), controls, where)
    n = len(prompts)
    inputs = marked_column(
        string_column(table, fmt.fields["input"], where, optional=True) if fmt.fields.get("input") else [""] * n, controls, where
    )
    no_input = NO_INPUT_FORMS.get(fmt.template_name or "")  # the preset's wording for a row without input
    if fmt.fields.get("input") and "input" not in formats.template_fields(template):
        check_input_unused(inputs, fmt, where)
    texts: list[str] = []
    for p, x, r in zip(prompts, inputs, responses):
        if not p.strip() and not r.strip() and not x.strip():
            texts.extend(("", ""))
            continue
        tpl = no_input if no_input and not x.strip() else template
        texts.append(tpl.format(instruction=p, prompt=p, input=x))
        texts.append(r)
    example = np.repeat(np.arange(n, dtype=np.int64), 2)
    loss = np.tile(np.array([fmt.train_on_prompt, True]), n)
    return Segments(texts, example, loss, n, controls)


def check_input_unused(inputs: list[str], fmt: ResolvedFormat, where: Where) -> None:
    """A template without {input} would leave the input field's text out of the shards: the first
    row whose input is not blank is a one-line error naming the field, the row and the fixes."""
    first = next((i for i, x in enumerate(inputs) if x.strip()), None)
    if first is None:
        return
    name = f"--template {fmt.template_name}" if fmt.template_name else "the --template given"
    raise UserError(
        f"{where(first)}: field {fmt.fields['input']!r} has text, but {name} has no {{input}}, so it would be "
        "left out of the shards: use a template with {input} (the alpaca preset, or your own --template), or "
        f"pass --input-field {NO_INPUT} to leave the field out"
    )


def normalise_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """Accept [{role, content, ...}] or ShareGPT [{from, value}]; return [{role, content, ...}] with
    every other key of the message kept for the chat template (an assistant's `tool_calls`, a tool
    message's `tool_call_id` or `name`, ...). Keys whose value is null are left out, at every depth:
    Arrow gives each message every key any message of the batch has (null where it had none), and a
    template tests `message.tool_calls is defined`. An assistant message with `tool_calls` may have no
    content (it becomes ""). A content may be OpenAI's list of parts ([{"type": "text", "text": ...}]);
    see `with_text_content`.

    >>> normalise_messages([{"from": "gpt", "value": "hi", "tool_calls": None}], "row 1")
    [{'role': 'assistant', 'content': 'hi'}]
    """
    if messages is None:
        raise UserError(f"{where}: field with the messages is missing or null: fix the row or remove it")
    if not isinstance(messages, list):
        raise UserError(f"{where}: the messages must be a list of objects with role and content")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise UserError(f"{where}: each message must be an object with role and content")
        message = _without_nulls(m)
        role = message.pop("role", message.pop("from", None))
        content = message.pop("content", message.pop("value", None))
        if content is None and message.get("tool_calls"):
            content = ""
        if role is None or content is None:
            raise UserError(f"{where}: a message lacks role/content (or from/value): fix the row")
        role = ROLE_ALIASES.get(role, role)
        if role not in ROLES:
            raise UserError(
                f"{where}: unknown message role {role!r}: use one of {', '.join(ROLES)} (or ShareGPT's {', '.join(ROLE_ALIASES)})"
            )
        out.append({"role": role, "content": content, **message})
    return out


def check_has_template(tokenizer: Any) -> None:
    """A tokenizer without a chat template cannot render chats: one line saying what to pass. A
    template whose markers are not single tokens of the vocabulary (`missing_markers`) would train
    the model on ordinary pieces for each: one line naming the first and the fix."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template, so chat "
            "data cannot be rendered: pass --chat-template (chatml, llama3, llama2, or a Jinja file), use a "
            "tokenizer with one, or --format instruction/text"
        )
    missing = missing_markers(tokenizer)
    if missing:
        pieces = len(tokenizer.backend_tokenizer.encode(missing[0], add_special_tokens=False).ids)
        raise UserError(
            f"the chat template {template_name(tokenizer)} writes the marker {missing[0]!r}"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which is not a token of the tokenizer "
            f"{getattr(tokenizer, 'name_or_path', '')!r} (it would be {pieces} ordinary pieces): add it with "
            f"--special-token NAME={missing[0]} (eos_token=... for an end-of-turn marker) or --add-token "
            f"{missing[0]} (the model's embeddings grow to match), or use a template made for this tokenizer"
        )


MARKER = re.compile(r"<\|[^\s<>|]{1,64}\|>|<(?:start|end)_of_turn>|<｜[^\s｜]{1,64}｜>")  # ChatML, Llama 3, Gemma, ...


def missing_markers(tokenizer: Any) -> list[str]:
    """The control markers (`<|im_end|>`, `<|eot_id|>`, `<start_of_turn>`, ...) the chat template
    spells that are not one added token of the tokenizer, in the template's order."""
    template = tokenizer.chat_template or ""
    cache = getattr(tokenizer, "_packlm_markers", None)
    if cache is not None and cache[0] == template:
        return cache[1]
    added = set(
        tokenizer.backend_tokenizer.get_added_tokens_decoder()[i].content for i in tokenizer.backend_tokenizer.get_added_tokens_decoder()
    )
    missing = list(dict.fromkeys(m for m in MARKER.findall(template) if m not in added))
    try:
        tokenizer._packlm_markers = (template, missing)
    except AttributeError:
        pass
    return missing


def _without_nulls(value: Any) -> Any:
    """`value` with every null-valued key of every mapping in it left out."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def render_chat(table: pa.Table, fmt: ResolvedFormat, where: Where, tokenizer: Any) -> Segments:
    check_has_template(tokenizer)
    if fmt.fields["messages"] not in table.column_names:
        raise missing_field(table, fmt.fields["messages"], where)
    rows = table.column(fmt.fields["messages"]).to_pylist()
    controls = control_tokens(tokenizer.backend_tokenizer, tokenizer.chat_template)
    drop_system = str(tokenizer.chat_template).startswith(DROP_FIRST_SYSTEM)  # an Axolotl file's drop_system_message
    texts: list[str] = []
    example: list[int] = []
    loss: list[bool] = []
    no_eos = np.zeros(len(rows), dtype=bool)
    for i, messages in enumerate(rows):
        msgs = normalise_messages(messages, where(i))
        if drop_system and msgs and msgs[0]["role"] == "system":
            msgs = msgs[1:]
        if not msgs:
            continue
        msgs = mark(reasoning_split(with_text_content(msgs, tokenizer, where(i)), tokenizer, where(i)), controls, where(i))
        try:
            segs = chat_segments(msgs, tokenizer, fmt.train_on_prompt, tuple(fmt.roles_to_train), fmt.train_on_eos)
        except UserError as exc:
            raise UserError(f"{where(i)}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any jinja error of a user template
            raise UserError(
                f"{where(i)}: the chat template {template_name(tokenizer)} failed on this conversation "
                f"({one_line(exc)}): fix the conversation or the template"
            ) from None
        no_eos[i] = ends_with_control("".join(text for text, _ in segs), controls)
        for text, is_loss in segs:
            texts.append(text)
            example.append(i)
            loss.append(is_loss)
    return Segments(texts, np.asarray(example, dtype=np.int64), np.asarray(loss, dtype=bool), len(rows), controls, no_eos, as_rendered=True)


def render(table: pa.Table, fmt: ResolvedFormat, where: Where, tokenizer: Any = None) -> Segments:
    """Render one batch of a text / instruction / chat dataset into segments."""
    check_same_format(table, fmt, where)
    if fmt.kind == "text":
        return render_text(table, fmt, where, tokenizer)
    if fmt.kind == "instruction":
        if is_conversational(table, fmt):
            return render_prompt_completion(table, fmt, where, tokenizer)
        return render_instruction(table, fmt, where, tokenizer)
    if fmt.kind == "chat":
        return render_chat(table, fmt, where, tokenizer)
    raise ValueError(f"render() does not handle {fmt.kind!r}")
