"""User text never becomes control tokens.

A tokenizer matches its added tokens (`</s>`, `<|im_end|>`) anywhere in the text it encodes, so a
user's message that spells one would end the example early for the model. So before anything is
rendered, every control token spelled in the user's strings (message contents and every other string
of a message, plain text, instruction fields) is wrapped in two private-use markers (`mark`); a
whole text holding markers is encoded by `encode_marked`: the control tokens the chat template (or
prompt template) wrote itself are the only control tokens of its ids, and the text between them,
user literals included, is encoded as ordinary text (the tokenizer's `encode_special_tokens`), each
piece as the tokenizer encodes text that follows an added token.

Control tokens are the tokenizer's special added tokens and the other added tokens the template
text spells (not whitespace), as transformers' `apply_chat_template(sanitize_control_tokens=True)`
defines them.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

import numpy as np

from pipeline.errors import UserError

START, END = "\U000f0f01", "\U000f0f02"  # wrap a control token the user wrote (supplementary private use)
_AFTER = "\U000f0f03\U000f0f04"  # an added token put before a piece so that it is encoded as after one


def control_tokens(backend: Any, template: str | None = None) -> tuple[str, ...]:
    """The control tokens of a tokenizer backend (`tokenizers.Tokenizer`) for `template`: its special
    added tokens, and the other added tokens `template` spells (whitespace ones left out)."""
    return _control_tokens(_json_of(backend), template or "")


_JSON: dict[int, tuple[Any, str]] = {}


def _json_of(backend: Any) -> str:
    """`backend.to_str()`, worked out once per backend object in this process (it is kept, so its id
    stays its own)."""
    entry = _JSON.get(id(backend))
    if entry is None or entry[0] is not backend:
        entry = _JSON[id(backend)] = (backend, backend.to_str())
    return entry[1]


@lru_cache(maxsize=8)
def _control_tokens(backend_json: str, template: str) -> tuple[str, ...]:
    from tokenizers import Tokenizer

    added = Tokenizer.from_str(backend_json).get_added_tokens_decoder().values()
    return tuple(
        sorted(
            {t.content for t in added if t.content and (t.special or (t.content in template and not t.content.isspace()))},
            key=len,
            reverse=True,
        )
    )


@lru_cache(maxsize=16)
def _pattern(tokens: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(map(re.escape, tokens)) or "(?!)")  # longest first (control_tokens' order)


def mark(value: Any, tokens: tuple[str, ...], where: str) -> Any:
    """`value` (a string, or lists and dicts of them: messages) with every control token in its
    strings wrapped in START/END; dict keys are left as they are. A string that holds a marker
    character itself is a UserError naming `where`."""
    if isinstance(value, str):
        if START in value or END in value or _AFTER[0] in value:
            raise UserError(
                f"{where}: the text holds the private-use character U+F0F01, U+F0F02 or U+F0F03, "
                "which pack-data uses to tell control tokens the user wrote: remove it"
            )
        return _pattern(tokens).sub(lambda m: START + m.group() + END, value) if tokens else value
    if isinstance(value, dict):
        return {k: mark(v, tokens, where) for k, v in value.items()}
    if isinstance(value, list):
        return [mark(v, tokens, where) for v in value]
    return value


def unmark(text: str) -> str:
    """`text` without the markers (what the model sees)."""
    return text.replace(START, "").replace(END, "") if START in text else text


def has_marks(text: str) -> bool:
    return START in text


@lru_cache(maxsize=8)
def _as_text_backend(backend_json: str, tokens: tuple[str, ...]) -> Any:
    """A copy of the backend that encodes the control `tokens` as text (the non-special ones made
    special, then special tokens not matched) and knows the `_AFTER` token."""
    from tokenizers import AddedToken, Tokenizer

    copy = Tokenizer.from_str(backend_json)
    copy.no_truncation()
    copy.no_padding()
    copy.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
    copy.add_tokens([AddedToken(_AFTER, special=False, normalized=False, single_word=False, lstrip=False, rstrip=False)])
    copy.encode_special_tokens = True
    return copy


def encode_marked(backend: Any, text: str, cuts: list[int], tokens: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Encode one whole text holding markers (`mark`) -> int32 ids and the token count of each of its
    `len(cuts) + 1` segments (`cuts`: ascending char positions in the marked text, as
    `pipeline.tokenize.segments.encode_segments` takes them; a token belongs to the segment its
    last char is in). The `tokens` (the control tokens) outside markers are their ids; the text
    between them is encoded as ordinary text."""
    chars = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    is_marker = (chars == ord(START)) | (chars == ord(END))
    clean_at = np.concatenate(([0], np.cumsum(~is_marker)))  # marked position -> position in the clean text
    clean = unmark(text)
    literal = np.zeros(len(clean) + 1, dtype=bool)  # chars of control tokens the user wrote
    for m in re.finditer(re.escape(START) + "(.*?)" + re.escape(END), text, flags=re.S):
        literal[clean_at[m.start(1)] : clean_at[m.end(1)]] = True
    as_text = _as_text_backend(_json_of(backend), tokens)
    pieces: list[tuple[int, str]] = []  # (start in the clean text, text) of the ordinary text
    ids: list[int] = []
    ends: list[int] = []
    at = 0
    controls: list[tuple[int, int, int]] = []  # (start, end, id) of the template's own control tokens
    for m in _pattern(tokens).finditer(clean):
        if not literal[m.start()]:
            controls.append((m.start(), m.end(), backend.token_to_id(m.group())))
    for start, end, token in controls + [(len(clean), len(clean), -1)]:
        if start > at:
            pieces.append((at, clean[at:start]))
        pieces.append((start, ""))  # the control token itself (or the end)
        at = end
    texts = [t if s == 0 else _AFTER + t for s, t in pieces if t]
    encoded = iter(as_text.encode_batch(texts, add_special_tokens=False) if texts else [])
    control = iter(controls)
    for start, piece in pieces:
        if piece:
            encoding = next(encoded)
            shift = 0 if start == 0 else len(_AFTER)
            for token, (_, end) in zip(encoding.ids, encoding.offsets):
                if shift and end <= shift:
                    continue  # the _AFTER token
                ids.append(token)
                ends.append(start + end - shift)
        else:
            nxt = next(control, None)
            if nxt is not None:
                ids.append(nxt[2])
                ends.append(nxt[1])
    where = clean_at[np.asarray(cuts, dtype=np.int64)] if cuts else np.zeros(0, dtype=np.int64)
    segment = np.searchsorted(where, np.asarray(ends, dtype=np.int64), side="left")
    return np.asarray(ids, dtype=np.int32), np.bincount(segment, minlength=len(cuts) + 1).astype(np.int64)
