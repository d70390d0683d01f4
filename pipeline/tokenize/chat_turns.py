"""A conversation rendered with its chat template as (text, is_loss) segments (`chat_segments`):
with a template that marks the assistant's text with `{% generation %}` blocks, exactly those blocks
carry the loss; else the text each assistant message adds does, found by rendering prefixes of the
conversation, or, for a long one whose template renders each message on its own, short windows of it
in time linear in its messages, its trailing whitespace (the template's, after the end-of-turn token)
left without loss. Every rendering goes through the bounded sandbox (`template_sandbox`)
(`pipeline.tokenize.render` renders chat rows with it). An assistant's `<think>...</think>` is split
into its reasoning as the template itself splits it, where it does (`reasoning_split`)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from pipeline.errors import UserError
from pipeline.tokenize.control_tokens import END, START, control_tokens, unmark
from pipeline.tokenize.template_sandbox import apply_chat_template, template_name

GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' test for the tag


LOCAL_FROM = 16  # conversations with more messages try `_local_segments` first


def chat_segments(
    messages: list[dict[str, str]],
    tokenizer: Any,
    train_on_prompt: bool,
    roles: tuple[str, ...] = ("assistant",),
    train_on_eos: str = "turn",
) -> list[tuple[str, bool]]:
    """Render a conversation with the chat template as (text, is_loss) segments.

    The conversation is rendered prefix by prefix; the text an assistant message adds (after the
    generation prompt) carries loss, everything else does not. A template whose renderings are not
    prefixes of each other cannot be split this way: then only `--train-on-prompt` works.

    Rendering every prefix costs time in the square of the message count (a conversation of 3,000
    messages takes minutes), so a longer conversation is first split with short windows of it
    (`_local_segments`), which is linear; its result is kept only when its segments join into the
    rendering of the whole conversation, else the prefixes are rendered.
    """

    extra = None
    if "real_last_index" in (tokenizer.chat_template or ""):
        # Axolotl's qwen3: every prefix rendered as a part of the whole conversation (as Axolotl renders
        # it), so only its last reply gets the empty reasoning block; the generation prompt is the one
        # that closes that block, which so stays without loss as Axolotl leaves it
        extra = {"real_last_index": len(messages) - 1, "enable_thinking": False}

    def render(msgs: list[dict[str, str]], gen: bool = False) -> str:
        if not msgs:
            return ""
        return apply_chat_template(tokenizer, msgs, add_generation_prompt=gen, extra=extra)

    controls = control_tokens(tokenizer.backend_tokenizer, tokenizer.chat_template)
    if train_on_prompt:
        return [(render(messages), True)]
    if GENERATION.search(tokenizer.chat_template or "") and tuple(roles) == ("assistant",):
        segments = _generation_segments(messages, tokenizer)
    else:
        local = _local_segments(messages, render, roles) if len(messages) > LOCAL_FROM else None
        segments = without_trailing_space(local if local is not None else _prefix_segments(messages, render, roles), controls)
    if "assistant" in roles:
        check_assistant_rendered(messages, segments, template_name(tokenizer))
    return eos_policy(segments, controls, train_on_eos)


def eos_policy(segments: list[tuple[str, bool]], controls: tuple[str, ...], policy: str) -> list[tuple[str, bool]]:
    """`--train-on-eos`: the end-of-turn token ending a loss segment (a control token) keeps its loss
    ("turn"), keeps it only in the last loss segment ("last"), loses it ("none"); "all" also gives
    loss to every occurrence of those end-of-turn tokens in the segments without loss."""
    ends = [
        next((t for t in controls if text.endswith(t) and not text.endswith(END + t)), None) if loss else None for text, loss in segments
    ]
    if policy == "turn" or not any(ends):
        return segments
    last = max(i for i, end in enumerate(ends) if end)
    out: list[tuple[str, bool]] = []
    eot = re.compile("|".join(re.escape(e) for e in sorted({e for e in ends if e}, key=len, reverse=True)))
    for i, (text, loss) in enumerate(segments):
        end = ends[i]
        if end and (policy == "none" or (policy == "last" and i != last)):
            out += [(text[: -len(end)], True), (end, False)]
        elif policy == "all" and not loss:
            at = 0
            for m in eot.finditer(text):
                if not text[: m.start()].endswith(START):  # a user's literal is no end of turn
                    out += [(text[at : m.start()], False), (m.group(), True)]
                    at = m.end()
            out.append((text[at:], False))
        else:
            out.append((text, loss))
    return [(t, loss) for t, loss in out if t]


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def reasoning_split(messages: list[dict[str, Any]], tokenizer: Any, where: str) -> list[dict[str, Any]]:
    """`messages` with each assistant content that writes `<think>...</think>` split into its
    `reasoning_content` and the text after it, as a template that does this split itself (Qwen3's:
    `content.split('</think>')`) splits it, so the template writes the think tags as its own control
    tokens while the reasoning and reply stay the user's text (`control_tokens.mark`). Done only where
    the template's own rendering of the conversation is the same text either way (the template moves
    the reasoning out itself); else the messages are returned as they are, the tags then plain text.
    A bound of the template sandbox is a UserError naming `where`."""
    template = tokenizer.chat_template or ""
    if "reasoning_content" not in template or THINK_CLOSE not in template:
        return messages
    split = [_split_think(m) for m in messages]
    if split == messages:
        return messages
    try:
        same = apply_chat_template(tokenizer, split) == apply_chat_template(tokenizer, messages)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None  # a bound of the sandbox
    except Exception:  # noqa: BLE001 - the template refuses one of the forms: keep the user's
        return messages
    return split if same else messages


def _split_think(message: dict[str, Any]) -> dict[str, Any]:
    """One message split as Qwen3's template splits it (only an assistant's string content holding
    `</think>`, without a reasoning_content of its own)."""
    content = message.get("content")
    if message.get("role") != "assistant" or not isinstance(content, str) or THINK_CLOSE not in content or "reasoning_content" in message:
        return message
    reasoning = content.split(THINK_CLOSE)[0].rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
    return {**message, "content": content.split(THINK_CLOSE)[-1].lstrip("\n"), "reasoning_content": reasoning}


def ends_with_control(text: str, controls: tuple[str, ...]) -> bool:
    """Whether a rendered conversation ends (but for whitespace) with a control token of its
    template (its end-of-turn token): then pack-data adds no EOS after it (a template that ends with
    none gets the EOS, so that the model learns to stop; apply_chat_template, TRL and Axolotl add none)."""
    tail = text.rstrip()
    return not tail.endswith(END) and any(tail.endswith(token) for token in controls)  # END: one the user wrote


def _trained_text(added: str, message: dict[str, Any]) -> list[tuple[str, bool]]:
    """The text a message of a trained role other than the assistant adds: loss from its content on
    (its header, before the content, without), or on all of it when the content is not found."""
    content = message.get("content")
    at = added.find(content) if isinstance(content, str) and content else -1
    return [(added[:at], False), (added[at:], True)] if at > 0 else [(added, True)]


def _generation_segments(messages: list[dict[str, Any]], tokenizer: Any) -> list[tuple[str, bool]]:
    """The conversation rendered once; its `{% generation %}` blocks carry the loss, nothing else."""
    text, spans = apply_chat_template(tokenizer, messages, spans=True)
    segments: list[tuple[str, bool]] = []
    at = 0
    for start, end in sorted(spans):
        if start < at:
            continue  # a block inside another
        segments += [(text[at:start], False), (text[start:end], True)]
        at = end
    segments.append((text[at:], False))
    return [(t, loss) for t, loss in segments if t]


def without_trailing_space(segments: list[tuple[str, bool]], controls: tuple[str, ...]) -> list[tuple[str, bool]]:
    """The whitespace after a loss segment's end-of-turn token (a control token the template wrote,
    `controls`) moved to a segment without loss: it is the template's, not the assistant's."""
    out: list[tuple[str, bool]] = []
    for text, loss in segments:
        body = text.rstrip() if loss else text
        if loss and body != text and not body.endswith(END) and any(body.endswith(t) for t in controls):
            out += [(body, True), (text[len(body) :], False)]
        else:
            out.append((text, loss))
    return out


def visible_text(content: Any) -> str:
    """What of an assistant message's content a template shows: its text (a content list's text
    parts joined), after any reasoning closed by `</think>` (which templates drop), stripped."""
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return unmark(str(content)).split("</think>")[-1].strip() if isinstance(content, str) else ""


def check_assistant_rendered(messages: list[dict[str, Any]], segments: list[tuple[str, bool]], name: str) -> None:
    """A template that never renders an assistant message's content would train on nothing of it:
    the first assistant message whose text is not in the loss segments is a UserError."""
    trained = unmark("".join(text for text, loss in segments if loss))
    for i, message in enumerate(messages):
        if message.get("role") == "assistant" and (text := visible_text(message.get("content"))) and text not in trained:
            raise UserError(
                f"the chat template {name} does not render the assistant's content where the loss goes "
                f"(message {i + 1}: {text[:40]!r} is not in its rendering's assistant text), so it would "
                "not be trained: fix the template (it must print message['content'])"
            )


def reply_start(before: str, head: str, full: str) -> int | None:
    """Where an assistant message's reply starts in `full` (the conversation rendered up to it), given
    `before` (rendered without it) and `head` (that with the generation prompt): after the generation
    prompt, or after what `head` and `full` share where the reply fills a block the generation prompt
    opens (qwen3's `<think>\n\n` before a reply that writes its reasoning), as TRL cuts a completion
    (common_prefix_length). None where `before` is not the start of both."""
    if not (head.startswith(before) and full.startswith(before)):
        return None
    cut = len(head) if full.startswith(head) else len(os.path.commonprefix([head, full]))
    return cut if cut > len(before) else None


def _prefix_segments(
    messages: list[dict[str, str]], render: Callable[..., str], roles: tuple[str, ...] = ("assistant",)
) -> list[tuple[str, bool]]:
    """`chat_segments` by rendering every prefix of the conversation (what it defines)."""
    segments: list[tuple[str, bool]] = []
    prev = ""
    for i, message in enumerate(messages):
        full = render(messages[: i + 1])
        if message["role"] == "assistant" and "assistant" in roles:
            cut = reply_start(prev, render(messages[:i], gen=True), full)
            if cut is not None:
                segments += [(full[len(prev) : cut], False), (full[cut:], True)]
                prev = full
                continue
        if not full.startswith(prev):
            raise UserError(
                "the chat template does not render conversations prefix by prefix, so assistant turns "
                "cannot be located: mark the assistant's text with {% generation %} blocks, or pass "
                "--train-on-prompt to train on whole chats"
            )
        added = full[len(prev) :]
        segments += _trained_text(added, message) if message["role"] in roles else [(added, False)]
        prev = full
    return segments


def _local_segments(
    messages: list[dict[str, str]], render: Callable[..., str], roles: tuple[str, ...] = ("assistant",)
) -> list[tuple[str, bool]] | None:
    """`chat_segments` of a long conversation in linear time, or None where this cannot be shown.

    The leading system messages and the two messages after them are split as `_prefix_segments`
    does. Each later message i is split against a window: the leading system messages, then the
    messages from j to i - 1, where j is 2 or 3 messages back with i - j even (so a window starts
    on the turn parity the whole conversation has there, for templates that check roles
    alternate). What message i adds to the window's rendering is its text, split as a prefix would
    be. That is exact for a template that renders a message from the message alone (and the
    leading system messages): such as ChatML, Llama-2, Llama-3. A template that does more (numbers
    the turns, say) gives segments that do not join into the whole conversation's rendering, which
    this checks: then None.

    Example (ChatML): message 9, an assistant's, is split in the window [system, user 7, assistant 8],
    its text `<|im_start|>assistant\n` (no loss) + `content<|im_end|>\n` (loss).
    """
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    system = messages[:lead]
    try:
        segments = _prefix_segments(messages[: lead + 2], render, roles)
        for i in range(lead + 2, len(messages)):
            j = i - 2 if (i - lead) % 2 == 0 else i - 3
            window = system + messages[max(j, lead) : i]
            base = render(window)
            full = render(window + [messages[i]])
            if messages[i]["role"] == "assistant" and "assistant" in roles:
                cut = reply_start(base, render(window, gen=True), full)
                if cut is not None:
                    segments += [(full[len(base) : cut], False), (full[cut:], True)]
                    continue
            if not full.startswith(base):
                return None
            added = full[len(base) :]
            segments += _trained_text(added, messages[i]) if messages[i]["role"] in roles else [(added, False)]
    except UserError:
        raise  # a bound of the sandbox: the same on every rendering
    except Exception:  # noqa: BLE001 - a template that refuses a window (its own checks): render prefixes
        return None
    if "".join(text for text, _ in segments) != render(messages):
        return None
    return segments
