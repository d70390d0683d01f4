"""Detect the format of an input dataset from its columns and the user's options: which format
(`ResolvedFormat.kind`) and which column holds what. Rendering the rows of a format into text
segments is `pipeline.tokenize.render`'s.

Formats:
- `text`: one column of documents (auto: `text`, `content`, `document`).
- `instruction`: a prompt column rendered through a template, plus a response column (auto:
  instruction[+input]/output, instruction/response, prompt/completion, prompt/response,
  question/answer, query/response).
- `chat`: a column of `[{role, content}, ...]` lists (auto: `messages`, `conversations`), rendered
  with the tokenizer's chat template; ShareGPT-style `{from, value}` turns are accepted too.
- `tokenized`: an `input_ids` column (+ optional `labels`), used as is.

The options apply to every input file, but for what `--per-input INPUT:OPTION=VALUE` gives one input
of its own (`per_input_options`): inputs whose columns differ pack in one run.
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.option_checks import check_value, checks_of, flag_of, opt

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
# Axolotl's other alpaca prompt styles (axolotl prompters.py, AlpacaPrompter: the system prompt in
# the style's system_format, then its turn_format; Apache-2.0): (with input, without input). The
# control tokens they write are the template's own, encoded as the tokenizer's tokens.
_SYSTEM, _SYSTEM_NO_INPUT = ALPACA.split("\n\n")[0], ALPACA_NO_INPUT.split("\n\n")[0]
_ALPACA_STYLES = {
    "alpaca:chat": (
        f"SYSTEM: {_SYSTEM}\nUSER: {{instruction}}\n{{input}}\nASSISTANT:",
        f"SYSTEM: {_SYSTEM_NO_INPUT}\nUSER: {{instruction}}\nASSISTANT:",
    ),
    "alpaca:chatml": (
        f"<|im_start|>system\n{_SYSTEM}<|im_end|>\n<|im_start|>user\n{{instruction}}\n{{input}}<|im_end|>\n<|im_start|>assistant\n",
        f"<|im_start|>system\n{_SYSTEM_NO_INPUT}<|im_end|>\n<|im_start|>user\n{{instruction}}<|im_end|>\n<|im_start|>assistant\n",
    ),
    "alpaca:phi": (
        f"<|system|>\n{_SYSTEM}<|end|>\n<|user|>\n{{instruction}}<|end|>{{input}}<|assistant|>",
        f"<|system|>\n{_SYSTEM_NO_INPUT}<|end|>\n<|user|>\n{{instruction}}<|end|>\n<|assistant|>\n",
    ),
}
# Named templates for --template. The alpaca ones switch to their no-input wording (`NO_INPUT_FORMS`)
# for a row whose `input` is empty.
TEMPLATES: dict[str, str] = {
    "alpaca": ALPACA,
    "qa": "Question: {prompt}\nAnswer:\n",
    "plain": "{prompt}",
    "chatml-lite": "User: {prompt}\nAssistant:\n",
    **{name: forms[0] for name, forms in _ALPACA_STYLES.items()},
}
NO_INPUT_FORMS = {"alpaca": ALPACA_NO_INPUT, **{name: forms[1] for name, forms in _ALPACA_STYLES.items()}}

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


EOS_CHOICES = ("turn", "last", "all", "none")  # each trained turn's, the last trained turn's, every turn's, none
FORMAT = "Input format"  # the options' section (pipeline.option_checks.opt)


@dataclass
class FormatOptions:
    """What the user asked for (the options of pack-data and pack-report that say how input rows
    become examples, each declared once); `None` fields are auto-detected."""

    # fmt: off
    # A table, one declaration an option (as PackConfig's): ruff format would give every argument a line.
    format: str = opt("auto", choices=FORMATS, flags=("--format", "fmt"), show_default=True, section=FORMAT, help=(
        "Input format; auto looks at column names: input_ids -> tokenized, messages -> chat, "
        "instruction/output, prompt/completion, question/answer -> instruction, text -> text."))
    text_field: str | None = opt(None, section=FORMAT,
                                 help="Column with the documents (text format). Auto: text, content, document.")
    prompt_field: str | None = opt(None, section=FORMAT, help=(
        "Column with the prompt/instruction. Auto: instruction, prompt, question, query."))
    input_field: str | None = opt(None, section=FORMAT, help=(
        "Optional extra-context column of instruction data. Auto: input. 'none': leave it out (a "
        "--template without {input} stops at the first row whose input has text, unless given this)."))
    response_field: str | None = opt(None, section=FORMAT, help=(
        "Column with the response. Auto: output, response, completion, answer."))
    messages_field: str | None = opt(None, section=FORMAT, help=(
        "Column with chat messages [{role, content}]. Auto: messages, conversations."))
    labels_field: str | None = opt(None, section=FORMAT, help=(
        "Column with labels for tokenized input. Auto: labels (else loss on all tokens)."))
    template: str | None = opt(None, section=FORMAT, help=(
        f"Prompt template of instruction data: a preset ({', '.join(TEMPLATES)}) or a Python format "
        "string with {instruction} or {prompt}, and optionally {input}. Default: alpaca for "
        "instruction/output, qa for question/answer, plain otherwise."))
    train_on_prompt: bool = opt(False, section=FORMAT, help=(
        "Also take loss on prompts / non-assistant turns (default: responses and assistant turns only)."))
    roles_to_train: tuple[str, ...] = opt(("assistant",), multiple=True, show_default=True, metavar="ROLE",
                                          section=FORMAT, help=(
        "Chat data: the roles whose turns carry loss (repeat it for several; Axolotl's roles_to_train)."))
    train_on_eos: str = opt("turn", choices=EOS_CHOICES, show_default=True, section=FORMAT, help=(
        "Chat data: which end-of-turn tokens carry loss: each trained turn's, only the last trained "
        "turn's, every turn's, or none (Axolotl's train_on_eos)."))
    # `per_input_options`: the options above for one input, each entry INPUT:OPTION=VALUE
    per_input: tuple[str, ...] = opt((), multiple=True, metavar="INPUT:OPTION=VALUE", section=FORMAT, help=(
        "One input's own value of an option above (repeatable), e.g. 'chapters.jsonl:text-field=chapter' to "
        "pack inputs whose columns differ in one run: INPUT is an INPUT as given or a file's name, OPTION a "
        "flag above without its dashes (roles-to-train: ROLE,ROLE; train-on-prompt: true or false). It wins "
        "over the option given for every input."))
    # fmt: on


@dataclass
class ResolvedFormat:
    """The concrete format and column names used for a dataset (recorded in the manifest)."""

    kind: str  # text | instruction | chat | tokenized
    fields: dict[str, str | None] = field(default_factory=dict)
    template: str | None = None
    template_name: str | None = None
    train_on_prompt: bool = False
    roles_to_train: tuple[str, ...] = ("assistant",)
    train_on_eos: str = "turn"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------- detection


def _pick(columns: list[str], candidates: tuple[str, ...]) -> str | None:
    return next((c for c in candidates if c in columns), None)


def _require(columns: list[str], name: str, flag: str, source: str | None = None) -> str:
    if name not in columns:
        place = source or "the input"
        raise UserError(
            f"column {name!r} not found in {place} (columns: {', '.join(columns) or 'none'}): pass {flag} with the right column name"
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
        parts = list(string.Formatter().parse(name))
    except ValueError as exc:
        raise UserError(f"--template {name!r} is not a valid Python format string ({exc})") from None
    dressed = next(
        (f"{{{f}{'!' + c if c else ''}{':' + spec if spec else ''}}}" for _, f, spec, c in parts if f is not None and (spec or c)), None
    )
    if dressed is not None:  # {prompt:d}, {prompt!r}, {input:{x}}: the text goes in as it is, or not at all
        raise UserError(
            f"--template {name!r}: {dressed} has a format spec or conversion; write the placeholders "
            "bare ({instruction}, {prompt}, {input}): the field's text is put in as it is"
        )
    keys = {f for _, f, _, _ in parts if f is not None}
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
            "chat",
            {"messages": req(name, "--messages-field")},
            train_on_prompt=top,
            roles_to_train=tuple(options.roles_to_train),
            train_on_eos=options.train_on_eos,
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
        roles_to_train=tuple(options.roles_to_train),  # conversational prompt/completion data
        train_on_eos=options.train_on_eos,
    )


def detect_formats(columns_per_file: Sequence[tuple[Any, list[str]]], options: FormatOptions) -> list[ResolvedFormat]:
    """One `ResolvedFormat` per input file (an `InputFile` or its path), each from that file's own
    columns.

    With `--format auto` and no field options every file gets its own format and fields (an
    instruction file, a chat file and a text file can be packed in one run); explicit options apply
    to every file but for the inputs `--per-input` gives their own; a file they do not fit is a
    one-line error naming the file and the field.
    """
    files = [f for f, _ in columns_per_file]
    out = []
    for (file, cols), (own, hints) in zip(columns_per_file, per_input_options(files, options)):
        try:
            out.append(detect_format(cols, own, source=getattr(file, "path", file)))
        except UserError as exc:  # a column of --per-input's: its fix is that entry's, not the option's
            raise UserError(
                next((str(exc).replace(f"pass {f} ", f"pass {h} ") for f, h in hints.items() if f"pass {f} " in str(exc)), str(exc))
            ) from None
    return out


# ------------------------------------------------------------------------------------ --per-input

# the options --per-input sets (every FormatOptions field but its own), by their flag without dashes
PER_INPUT = {flag_of(f.name)[2:]: f.name for f in fields(FormatOptions) if f.name != "per_input"}
_ENTRY = re.compile(rf"^(?P<name>.+?):(?P<option>{'|'.join(map(re.escape, PER_INPUT))})=(?P<value>.*)$", re.S)
_CHECKS = checks_of(FormatOptions)  # each option's own check, for its value in an entry


def parse_per_input(entry: str) -> tuple[str, str, Any]:
    """'chapters.jsonl:text-field=chapter' -> ("chapters.jsonl", "text_field", "chapter"): the value
    checked as the option's own (`pipeline.option_checks`); a malformed entry is one line."""
    match = _ENTRY.match(entry)
    if match is None:
        raise UserError(
            f"--per-input {entry!r} is not INPUT:OPTION=VALUE with OPTION one of "
            f"{', '.join(PER_INPUT)}: write e.g. --per-input 'chapters.jsonl:text-field=chapter'"
        )
    name, key, text = match.group("name"), PER_INPUT[match.group("option")], match.group("value")
    if not text.strip():
        raise UserError(
            f"--per-input {entry!r} gives {match.group('option')} no value: write {name}:"
            f"{match.group('option')}=VALUE, or leave the entry out"
        )
    value: Any = text
    if key == "roles_to_train":
        value = tuple(r.strip() for r in text.split(",") if r.strip())
    elif key == "train_on_prompt":
        value = {"true": True, "false": False}.get(text.lower(), text)
    check_value(f"--per-input {name}:{match.group('option')}", value, _CHECKS[key])
    if key == "template":  # a preset or a format string with the right placeholders
        try:
            resolve_template(value, "plain")
        except UserError as exc:
            raise UserError(f"--per-input {entry!r}: {str(exc).removeprefix('--template ')}") from None
    return name, key, value


def _names(name: str, file: Any) -> bool:
    """Whether --per-input's NAME is the INPUT `file` was given as, its path (either spelled as
    another path to the same place: ./b.jsonl, its absolute path) or its file name."""
    path, given = str(getattr(file, "path", file)), getattr(file, "given", None)
    same = {os.path.abspath(p) for p in (path, given) if p and "://" not in p}
    return name in (given, path, Path(path).name) or ("://" not in name and os.path.abspath(name) in same)


def per_input_options(files: Sequence[Any], options: FormatOptions) -> list[tuple[FormatOptions, dict[str, str]]]:
    """Each file's options: `options` with the `--per-input` entries naming it applied, and the
    flags those entries replace (--text-field -> the entry to fix when its column is missing). An
    entry that names no input, or a second value of one option for one file, is one line."""
    own: list[dict[str, Any]] = [{} for _ in files]
    hints: list[dict[str, str]] = [{} for _ in files]
    for entry in options.per_input:
        name, key, value = parse_per_input(entry)
        hit = [j for j, f in enumerate(files) if _names(name, f)]
        if not hit:
            given = dict.fromkeys(str(getattr(f, "given", None) or getattr(f, "path", f)) for f in files)
            raise UserError(
                f"--per-input {entry!r}: {name!r} matches no input: use an INPUT as given ({', '.join(given)}) or one of its files' names"
            )
        for j in hit:
            if key in own[j] and own[j][key] != value:
                raise UserError(
                    f"--per-input gives {getattr(files[j], 'path', files[j])} two values of "
                    f"{flag_of(key)} ({own[j][key]!r}, {value!r}): give each input one"
                )
            own[j][key] = value
            hints[j][flag_of(key)] = f"--per-input {name}:{flag_of(key)[2:]}=COLUMN"
    return [(replace(options, per_input=(), **o) if o else options, h) for o, h in zip(own, hints)]


def absolute_per_input(entries: Sequence[str], absolute: Callable[[str], str]) -> list[str]:
    """`--per-input` entries with their INPUT made absolute by `absolute` (as the manifest records
    the inputs, so that `pack-verify --deep` matches them from any folder)."""
    out = []
    for entry in entries:
        match = _ENTRY.match(entry)
        out.append(entry if match is None else f"{absolute(match.group('name'))}{entry[match.end('name') :]}")
    return out


def text_fields(fmt: ResolvedFormat) -> list[str]:
    """The top-level columns this format reads as text (a JSON number there is kept as its text)."""
    keys = {"text": ("text",), "instruction": ("prompt", "input", "response")}.get(fmt.kind, ())
    return [str(fmt.fields[k]) for k in keys if fmt.fields.get(k)]
