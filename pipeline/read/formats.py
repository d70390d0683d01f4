"""Detect the format of an input dataset and render each example into text segments.

A *segment* is a piece of text with a loss flag: the prompt of an instruction pair carries no loss
(unless `--train-on-prompt`), its response does; every token of plain text carries loss; the
assistant turns of a chat carry loss. `pipeline.tokenize.tokenize_inputs` tokenizes each example's segments joined
into its whole text, splits the ids where the segments meet and adds BOS/EOS; this module only
decides *what* text goes where.

Formats:
- `text`: one column of documents (auto: `text`, `content`, `document`).
- `instruction`: a prompt column rendered through a template, plus a response column (auto:
  instruction[+input]/output, instruction/response, prompt/completion, prompt/response,
  question/answer, query/response).
- `chat`: a column of `[{role, content}, ...]` lists (auto: `messages`, `conversations`), rendered
  with the tokenizer's chat template; ShareGPT-style `{from, value}` turns are accepted too.
- `tokenized`: an `input_ids` column (+ optional `labels`), used as is.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import UserError, one_line

FORMATS = ("auto", "text", "instruction", "chat", "tokenized")

ALPACA = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
# Named templates for --template. "alpaca" switches to its no-input wording when `input` is empty.
TEMPLATES: dict[str, str] = {
    "alpaca": ALPACA,
    "qa": "Question: {prompt}\nAnswer:\n",
    "plain": "{prompt}",
    "chatml-lite": "User: {prompt}\nAssistant:\n",
}

TEXT_FIELDS = ("text", "content", "document")
MESSAGE_FIELDS = ("messages", "conversations", "conversation")
# (prompt field, response field, default template), tried in order.
PAIRS = (
    ("instruction", "output", "alpaca"),
    ("instruction", "response", "alpaca"),
    ("prompt", "completion", "plain"),
    ("prompt", "response", "plain"),
    ("question", "answer", "qa"),
    ("query", "response", "qa"),
)
NO_INPUT = "none"  # --input-field none: instruction data rendered without its input field
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class FormatOptions:
    """What the user asked for (CLI options); `None` fields are auto-detected."""

    format: str = "auto"
    text_field: str | None = None
    prompt_field: str | None = None
    input_field: str | None = None
    response_field: str | None = None
    messages_field: str | None = None
    labels_field: str | None = None
    template: str | None = None
    train_on_prompt: bool = False


@dataclass
class ResolvedFormat:
    """The concrete format and column names used for a dataset (recorded in the manifest)."""

    kind: str  # text | instruction | chat | tokenized
    fields: dict[str, str | None] = field(default_factory=dict)
    template: str | None = None
    template_name: str | None = None
    train_on_prompt: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Segments:
    """Rendered segments of a batch: `texts[k]` belongs to example `example[k]` with loss `loss[k]`.

    `example` is non-decreasing; an example with no segment at all (or only blank text) is empty.
    """

    texts: list[str]
    example: np.ndarray  # int64, index within the batch
    loss: np.ndarray  # bool
    n_examples: int


# ------------------------------------------------------------------------------------- detection


def _pick(columns: list[str], candidates: tuple[str, ...]) -> str | None:
    return next((c for c in candidates if c in columns), None)


def _require(columns: list[str], name: str, flag: str, source: str | None = None) -> str:
    if name not in columns:
        place = source or "the input"
        raise UserError(
            f"column {name!r} not found in {place} (columns: {', '.join(columns) or 'none'}): "
            f"pass {flag} with the right column name"
        )
    return name



def template_fields(template: str) -> set[str]:
    """The placeholders of a format-string template ({instruction}, {prompt}, {input})."""
    return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}


def resolve_template(template: str | None, default: str) -> tuple[str, str | None]:
    """Return (template text, preset name or None) for --template (a preset name or a format string)."""
    name = template or default
    if name in TEMPLATES:
        return TEMPLATES[name], name
    try:
        keys = template_fields(name)
    except ValueError as exc:
        raise UserError(f"--template {name!r} is not a valid Python format string ({exc})") from None
    unknown = keys - {"instruction", "prompt", "input"}
    if unknown or not keys & {"instruction", "prompt"}:
        raise UserError(
            f"--template {name!r}: use the placeholders {{instruction}} (or {{prompt}}) and optionally "
            f"{{input}}, or a preset: {', '.join(TEMPLATES)}"
        )
    return name, None


def detect_format(columns: list[str], options: FormatOptions, *, source: str | None = None) -> ResolvedFormat:
    """Choose the format and field names from the column names and the user's options.

    `source` (a file name) is named in the error when a needed column is missing.
    """
    fmt = options.format
    req = lambda name, flag: _require(cols, name, flag, source)
    if fmt not in FORMATS:
        raise UserError(f"unknown --format {fmt!r}: choose one of {', '.join(FORMATS)}")
    cols = list(columns)
    if fmt == "auto":
        if options.messages_field:
            fmt = "chat"
        elif options.prompt_field or options.response_field:
            fmt = "instruction"
        elif options.text_field:
            fmt = "text"
        elif "input_ids" in cols:
            fmt = "tokenized"
        elif _pick(cols, MESSAGE_FIELDS):
            fmt = "chat"
        elif any(p in cols and r in cols for p, r, _ in PAIRS):
            fmt = "instruction"
        elif _pick(cols, TEXT_FIELDS):
            fmt = "text"
        else:
            place = f" of {source}" if source else ""
            raise UserError(
                f"cannot tell the format from the columns{place} ({', '.join(cols) or 'none'}): pass --format "
                "and the field options (--text-field, --prompt-field/--response-field, --messages-field)"
            )
    top = options.train_on_prompt
    if fmt == "tokenized":
        ids = req("input_ids", "--format tokenized (it needs an input_ids column)")
        labels = options.labels_field or ("labels" if "labels" in cols else None)
        if labels:
            req(labels, "--labels-field")
        return ResolvedFormat("tokenized", {"input_ids": ids, "labels": labels}, train_on_prompt=top)
    if fmt == "text":
        name = options.text_field or _pick(cols, TEXT_FIELDS) or "text"
        return ResolvedFormat("text", {"text": req(name, "--text-field")}, train_on_prompt=top)
    if fmt == "chat":
        name = options.messages_field or _pick(cols, MESSAGE_FIELDS) or "messages"
        return ResolvedFormat(
            "chat", {"messages": req(name, "--messages-field")}, train_on_prompt=top
        )
    # instruction
    prompt, response, default_tpl = options.prompt_field, options.response_field, "alpaca"
    for p, r, tpl in PAIRS:
        if (prompt in (None, p)) and (response in (None, r)) and p in cols and r in cols:
            prompt, response, default_tpl = p, r, tpl
            break
    if prompt is None:
        prompt = _pick(cols, ("instruction", "prompt", "question", "query")) or "prompt"
    if response is None:
        response = _pick(cols, ("output", "response", "completion", "answer")) or "response"
    req(prompt, "--prompt-field")
    req(response, "--response-field")
    input_field = options.input_field
    if input_field is None and "input" in cols and prompt != "input":
        input_field = "input"
    elif input_field == NO_INPUT:
        input_field = None  # left out on purpose (recorded in the manifest's config)
    elif input_field is not None:
        req(input_field, "--input-field")
    if options.template is None and default_tpl == "alpaca" and prompt not in ("instruction",):
        default_tpl = "plain"
    template, tname = resolve_template(options.template, default_tpl)
    return ResolvedFormat(
        "instruction",
        {"prompt": prompt, "input": input_field, "response": response},
        template=template,
        template_name=tname,
        train_on_prompt=top,
    )


def detect_formats(columns_per_file: list[tuple[str, list[str]]], options: FormatOptions) -> list[ResolvedFormat]:
    """One `ResolvedFormat` per input file, each from that file's own columns.

    With `--format auto` and no field options every file gets its own format and fields (an
    instruction file, a chat file and a text file can be packed in one run); explicit options apply
    to every file, and a file they do not fit is a one-line error naming the file and the field.
    """
    return [detect_format(cols, options, source=name) for name, cols in columns_per_file]


# ------------------------------------------------------------------------------------- rendering


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


def text_fields(fmt: ResolvedFormat) -> list[str]:
    """The top-level columns this format reads as text (a JSON number there is kept as its text)."""
    keys = {"text": ("text",), "instruction": ("prompt", "input", "response")}.get(fmt.kind, ())
    return [str(fmt.fields[k]) for k in keys if fmt.fields.get(k)]


def needed_fields(fmt: ResolvedFormat) -> list[str]:
    """The columns every row of a file in this format must fill (the optional ones left out)."""
    keys = {"text": ("text",), "instruction": ("prompt", "response"), "chat": ("messages",),
            "tokenized": ("input_ids",)}[fmt.kind]
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
        other = detect_format(has, FormatOptions())
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
                    f"{where(0)}: field {name!r} has type {one_line(col.type, 80)}, expected text: choose another "
                    "field or --format"
                ) from None
    if col.null_count:
        if optional:
            col = pc.fill_null(col, "")
        else:
            first = int(pc.index(pc.is_null(col), True).as_py())
            raise UserError(
                f"{where(first)}: field {name!r} is missing or null: fix the row or "
                "remove it"
            )
    return col.to_pylist()


def render_text(table: pa.Table, fmt: ResolvedFormat, where: Where) -> Segments:
    texts = string_column(table, fmt.fields["text"], where, optional=False)
    n = len(texts)
    return Segments(texts, np.arange(n, dtype=np.int64), np.ones(n, dtype=bool), n)


def render_instruction(table: pa.Table, fmt: ResolvedFormat, where: Where) -> Segments:
    prompts = string_column(table, fmt.fields["prompt"], where, optional=False)
    responses = string_column(table, fmt.fields["response"], where, optional=False)
    n = len(prompts)
    inputs = (
        string_column(table, fmt.fields["input"], where, optional=True)
        if fmt.fields.get("input")
        else [""] * n
    )
    template = fmt.template or "{prompt}"
    alpaca = fmt.template_name == "alpaca"
    if fmt.fields.get("input") and "input" not in template_fields(template):
        check_input_unused(inputs, fmt, where)
    texts: list[str] = []
    for p, x, r in zip(prompts, inputs, responses):
        if not p.strip() and not r.strip() and not x.strip():
            texts.extend(("", ""))
            continue
        tpl = ALPACA_NO_INPUT if alpaca and not x.strip() else template
        texts.append(tpl.format(instruction=p, prompt=p, input=x))
        texts.append(r)
    example = np.repeat(np.arange(n, dtype=np.int64), 2)
    loss = np.tile(np.array([fmt.train_on_prompt, True]), n)
    return Segments(texts, example, loss, n)


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


def normalise_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """Accept [{role, content}] or ShareGPT [{from, value}]; return [{role, content}]."""
    if messages is None:
        raise UserError(f"{where}: field with the messages is missing or null: fix the row or remove it")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise UserError(f"{where}: each message must be an object with role and content")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if role is None or content is None:
            raise UserError(f"{where}: a message lacks role/content (or from/value): fix the row")
        role = ROLE_ALIASES.get(role, role)
        if role not in ROLES:
            raise UserError(f"{where}: unknown message role {role!r}: use one of {', '.join(ROLES)} "
                            f"(or ShareGPT's {', '.join(ROLE_ALIASES)})")
        out.append({"role": role, "content": content})
    return out


def chat_segments(messages: list[dict[str, str]], tokenizer: Any, train_on_prompt: bool) -> list[tuple[str, bool]]:
    """Render a conversation with the chat template as (text, is_loss) segments.

    The conversation is rendered prefix by prefix; the text an assistant message adds (after the
    generation prompt) carries loss, everything else does not. A template whose renderings are not
    prefixes of each other cannot be split this way: then only `--train-on-prompt` works.
    """

    def render(msgs: list[dict[str, str]], gen: bool = False) -> str:
        if not msgs:
            return ""
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    if train_on_prompt:
        return [(render(messages), True)]
    segments: list[tuple[str, bool]] = []
    prev = ""
    for i, message in enumerate(messages):
        full = render(messages[: i + 1])
        if message["role"] == "assistant":
            head = render(messages[:i], gen=True)
            if head.startswith(prev) and full.startswith(head):
                segments.append((head[len(prev) :], False))
                segments.append((full[len(head) :], True))
                prev = full
                continue
        if not full.startswith(prev):
            raise UserError(
                "the tokenizer's chat template does not render conversations prefix by prefix, so "
                "assistant turns cannot be located: pass --train-on-prompt to train on whole chats"
            )
        segments.append((full[len(prev) :], message["role"] == "assistant"))
        prev = full
    return segments


def render_chat(table: pa.Table, fmt: ResolvedFormat, where: Where, tokenizer: Any) -> Segments:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template, so chat "
            "data cannot be rendered: use a tokenizer with one, or --format instruction/text"
        )
    if fmt.fields["messages"] not in table.column_names:
        raise missing_field(table, fmt.fields["messages"], where)
    rows = table.column(fmt.fields["messages"]).to_pylist()
    texts: list[str] = []
    example: list[int] = []
    loss: list[bool] = []
    for i, messages in enumerate(rows):
        msgs = normalise_messages(messages, where(i))
        if not msgs:
            continue
        try:
            segs = chat_segments(msgs, tokenizer, fmt.train_on_prompt)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - any jinja error of a user template
            raise UserError(f"{where(i)}: the chat template failed on this conversation ({exc})") from None
        for text, is_loss in segs:
            texts.append(text)
            example.append(i)
            loss.append(is_loss)
    return Segments(texts, np.asarray(example, dtype=np.int64), np.asarray(loss, dtype=bool), len(rows))


def render(table: pa.Table, fmt: ResolvedFormat, where: Where, tokenizer: Any = None) -> Segments:
    """Render one batch of a text / instruction / chat dataset into segments."""
    check_same_format(table, fmt, where)
    if fmt.kind == "text":
        return render_text(table, fmt, where)
    if fmt.kind == "instruction":
        return render_instruction(table, fmt, where)
    if fmt.kind == "chat":
        return render_chat(table, fmt, where, tokenizer)
    raise ValueError(f"render() does not handle {fmt.kind!r}")
