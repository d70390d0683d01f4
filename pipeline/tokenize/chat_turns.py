"""A conversation rendered with its chat template as (text, is_loss) segments: the text each
assistant message adds carries the loss (`chat_segments`), found by rendering prefixes of the
conversation, or, for a long one whose template renders each message on its own, short windows of it
in time linear in its messages (`pipeline.tokenize.render` renders chat rows with it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.errors import UserError


LOCAL_FROM = 16  # conversations with more messages try `_local_segments` first


def chat_segments(messages: list[dict[str, str]], tokenizer: Any, train_on_prompt: bool) -> list[tuple[str, bool]]:
    """Render a conversation with the chat template as (text, is_loss) segments.

    The conversation is rendered prefix by prefix; the text an assistant message adds (after the
    generation prompt) carries loss, everything else does not. A template whose renderings are not
    prefixes of each other cannot be split this way: then only `--train-on-prompt` works.

    Rendering every prefix costs time in the square of the message count (a conversation of 3,000
    messages takes minutes), so a longer conversation is first split with short windows of it
    (`_local_segments`), which is linear; its result is kept only when its segments join into the
    rendering of the whole conversation, else the prefixes are rendered.
    """

    def render(msgs: list[dict[str, str]], gen: bool = False) -> str:
        if not msgs:
            return ""
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    if train_on_prompt:
        return [(render(messages), True)]
    if len(messages) > LOCAL_FROM:
        local = _local_segments(messages, render)
        if local is not None:
            return local
    return _prefix_segments(messages, render)


def _prefix_segments(messages: list[dict[str, str]], render: Callable[..., str]) -> list[tuple[str, bool]]:
    """`chat_segments` by rendering every prefix of the conversation (what it defines)."""
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


def _local_segments(messages: list[dict[str, str]], render: Callable[..., str]) -> list[tuple[str, bool]] | None:
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
        segments = _prefix_segments(messages[: lead + 2], render)
        for i in range(lead + 2, len(messages)):
            j = i - 2 if (i - lead) % 2 == 0 else i - 3
            window = system + messages[max(j, lead) : i]
            base = render(window)
            full = render(window + [messages[i]])
            if messages[i]["role"] == "assistant":
                head = render(window, gen=True)
                if head.startswith(base) and full.startswith(head):
                    segments += [(head[len(base) :], False), (full[len(head) :], True)]
                    continue
            if not full.startswith(base):
                return None
            segments.append((full[len(base) :], messages[i]["role"] == "assistant"))
    except Exception:  # noqa: BLE001 - a template that refuses a window (its own checks): render prefixes
        return None
    if "".join(text for text, _ in segments) != render(messages):
        return None
    return segments
