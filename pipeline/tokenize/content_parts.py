"""OpenAI messages whose `content` is a list of parts ([{"type": "text", "text": ...}]): given to a
chat template that renders such lists itself as they are, else as the text of their text parts
(`with_text_content`; `pipeline.tokenize.render` calls it before rendering a conversation)."""

from __future__ import annotations

from typing import Any

from pipeline.errors import UserError, one_line
from pipeline.tokenize.template_sandbox import apply_chat_template


def parts_text(content: list[Any], where: str) -> str:
    """The text of an OpenAI content list: its text parts joined with newlines (as vLLM joins them for
    a template that takes text). A part of another type (an image) is a one-line error."""
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and not isinstance(part.get("text"), str):
            value = part.get("text")
            got = "no 'text'" if value is None else f"the {type(value).__name__} {one_line(repr(value), 40)} as its 'text'"
            raise UserError(
                f'{where}: a text content part has {got}: give each text part its text as a string ([{{"type": "text", "text": "..."}}])'
            )
        if kind != "text":
            raise UserError(
                f"{where}: a message content part of type {kind!r}: only text parts "
                '([{"type": "text", "text": ...}]) can be packed for a text model; remove the others'
            )
        texts.append(part["text"])
    return "\n".join(texts)


_PROBE = "zq-packlm-part-zq"


def template_reads_parts(tokenizer: Any) -> bool:
    """Whether the chat template renders OpenAI content lists itself (as many recent ones do): a
    probe part's text appears in its rendering and the list's own text (`'type'`) does not."""
    template = getattr(tokenizer, "chat_template", None)
    cache = getattr(tokenizer, "_packlm_reads_parts", None)
    if cache is not None and cache[0] == template:
        return cache[1]
    try:
        text = apply_chat_template(tokenizer, [{"role": "user", "content": [{"type": "text", "text": _PROBE}]}])
        reads = _PROBE in text and "'type'" not in text
    except UserError:
        raise  # a bound of the sandbox
    except Exception:  # noqa: BLE001 - a template that cannot take a list
        reads = False
    try:
        tokenizer._packlm_reads_parts = (template, reads)
    except AttributeError:
        pass
    return reads


def with_text_content(messages: list[dict[str, Any]], tokenizer: Any, where: str) -> list[dict[str, Any]]:
    """`messages` as the chat template takes them: content lists as they are when the template
    renders them (`template_reads_parts`), else each list's text (`parts_text`)."""
    if not any(isinstance(m["content"], list) for m in messages):
        return messages
    if template_reads_parts(tokenizer):
        for m in messages:
            if isinstance(m["content"], list):
                parts_text(m["content"], where)  # only text parts
        return messages
    return [{**m, "content": parts_text(m["content"], where) if isinstance(m["content"], list) else m["content"]} for m in messages]
