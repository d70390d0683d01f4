"""Encoding texts in tokenizer calls of bounded size, cutting a long text into pieces where the
cut provably changes no id.

The Rust tokenizer holds about a hundred bytes per character of the texts of one call
(normalized strings with alignments, BPE symbols and merge queues, encodings with a string per
token), and a SentencePiece-style pre-tokenizer without splitting makes a whole text one BPE
word. So a batch
is encoded in calls of at most CALL_CHARS characters, and a text longer than LONG_TEXT_CHARS is
cut into pieces of about PIECE_CHARS characters, encoded apart and joined: the same flat ids and
segment lengths as one call over the whole texts (`encode_bounded`).

A cut is made only where encoding the text whole and encoding its two sides apart give the same
ids, which `cut_pattern` proves from the tokenizer's pipeline (a match's start is such a place):

- BPE after a Metaspace pre-tokenizer (Llama-2, Mistral), no normalizer: before a space that
  follows a char x that is a token of its own and is followed by the replacement char ("▁") in
  no token of the vocabulary. Every merge makes a token of the vocabulary, so no merge joins
  symbols across the cut; the later piece starts with the space, so Metaspace puts no "▁" before
  it (it does so only before a text that does not start with one).
- BPE after the ByteLevel pre-tokenizer with its own (GPT-2) regex: before a space between two
  ASCII letters. In the whole text and in the pieces alike the regex ends a word at the letter
  (no alternative takes a letter and a space, none looks past that letter) and starts the next
  one at the space; BPE encodes word by word.

Both also need a BPE without dropout or word prefix/suffix, a normalizer that leaves the place
alone (none; NFC for ByteLevel, as a space composes with nothing before it), and added tokens
without spaces in them or beside them (lstrip/rstrip), so no added token match spans the cut.

A text that cannot be cut into pieces of at most MAX_PIECE_CHARS (another tokenizer, or a
stretch without such a place) and is longer than that is refused with a one-line error naming
its row: encoding it at once would take memory of a large multiple of its size.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from pipeline.errors import UserError
from pipeline.tokenize.encode_pool import Cuts

LONG_TEXT_CHARS = 1 << 20  # a text longer than this is cut into pieces (where the tokenizer allows it)
PIECE_CHARS = 8 << 10  # a piece ends at the first place to cut from this many chars after its start
CALL_CHARS = 1 << 20  # chars of text per tokenizer call (one text or piece may exceed it alone)
MAX_PIECE_CHARS = 4 << 20  # the longest text or piece handed to the tokenizer

Encode = Callable[[list[str], Cuts | None], tuple[np.ndarray, np.ndarray]]

_PATTERNS: dict[int, tuple[Any, re.Pattern[str] | None]] = {}
_ASCII_WORD_GAP = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")


def cut_pattern(backend: Any) -> re.Pattern[str] | None:
    """A regex whose matches start where texts of this `tokenizers.Tokenizer` can be cut (see
    the module doc), or None when no such place is proven for its pipeline. Worked out once per
    backend object in this process."""
    entry = _PATTERNS.get(id(backend))
    if entry is None or entry[0] is not backend:
        entry = _PATTERNS[id(backend)] = (backend, _pattern(backend))  # (the backend kept: its id stays its own)
    return entry[1]


def _pattern(backend: Any) -> re.Pattern[str] | None:
    model, pre, norm = backend.model, backend.pre_tokenizer, type(backend.normalizer).__name__
    if type(model).__name__ != "BPE" or model.dropout or model.continuing_subword_prefix or model.end_of_word_suffix:
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    kind = type(pre).__name__
    if kind == "Metaspace" and norm == "NoneType":
        replacement = pre.replacement
    elif kind == "ByteLevel" and pre.use_regex and norm in ("NoneType", "NFC"):
        replacement = None
    else:
        return None
    for token in backend.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or " " in token.content or (replacement and replacement in token.content):
            return None
    if replacement is None:
        return _ASCII_WORD_GAP
    vocab = backend.get_vocab(with_added_tokens=False)
    before = {t[i - 1] for t in vocab for i in range(1, len(t)) if t[i] == replacement}
    safe = sorted(t for t in vocab if len(t) == 1 and t not in before and t not in (" ", replacement))
    if not safe:
        return None
    return re.compile("(?<=[" + "".join(map(re.escape, safe)) + "]) ")


def piece_starts(text: str, pattern: re.Pattern[str] | None) -> list[int] | None:
    """Where the pieces of `text` start: [0] for a text of at most LONG_TEXT_CHARS; for a longer
    one, a cut at the first match of `pattern` from PIECE_CHARS after the previous cut. None when
    a piece would exceed MAX_PIECE_CHARS."""
    if len(text) <= LONG_TEXT_CHARS:
        return [0]
    if pattern is None:
        return None if len(text) > MAX_PIECE_CHARS else [0]
    starts = [0]
    while len(text) - starts[-1] > PIECE_CHARS:
        found = pattern.search(text, starts[-1] + PIECE_CHARS)
        end = found.start() if found is not None else len(text)
        if end - starts[-1] > MAX_PIECE_CHARS:
            return None
        if found is None:
            break
        starts.append(end)
    return starts


def encode_bounded(
    encode: Encode, texts: list[str], cuts: Cuts | None, backend: Callable[[], Any], where: Callable[[int], str]
) -> tuple[np.ndarray, np.ndarray]:
    """`encode(texts, cuts)` (flat int32 ids, int64 segment lengths), made of calls of at most
    CALL_CHARS chars each, long texts cut into pieces (module doc).

    `backend()` gives the `tokenizers.Tokenizer` (asked for only when a text is long); `where(i)`
    names the row of text i for the error that refuses a text that cannot be cut.
    """
    chars = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    if int(chars.sum()) <= CALL_CHARS:
        return encode(texts, cuts)
    n = len(texts)
    counts = np.zeros(n, np.int64) if cuts is None else np.asarray(cuts[0], np.int64)
    positions = np.zeros(0, np.int64) if cuts is None else np.asarray(cuts[1], np.int64)
    pattern = cut_pattern(backend()) if int(chars.max()) > LONG_TEXT_CHARS else None
    unit_text: list[int] = []
    unit_start: list[int] = []
    for i in range(n):
        starts = piece_starts(texts[i], pattern)
        if starts is None:
            raise _too_long(where(i), int(chars[i]), pattern is not None)
        unit_text.extend([i] * len(starts))
        unit_start.extend(starts)
    u_text = np.asarray(unit_text, np.int64)
    u_start = np.asarray(unit_start, np.int64)
    u_end = np.append(u_start[1:], 0)
    last = np.append(u_text[1:] != u_text[:-1], True)
    u_end[last] = chars[u_text[last]]
    # each cut goes to the piece it falls in (a cut where a piece starts: to that piece, at 0)
    text_base = np.cumsum(chars + 1) - (chars + 1)  # texts laid end to end, a char apart
    cut_text = np.repeat(np.arange(n), counts)
    unit_of_cut = np.searchsorted(text_base[u_text] + u_start, text_base[cut_text] + positions, side="right") - 1
    local = positions - u_start[unit_of_cut]
    u_counts = np.bincount(unit_of_cut, minlength=len(u_text)).astype(np.int64)
    u_cut0 = np.concatenate(([0], np.cumsum(u_counts)))
    flats: list[np.ndarray] = []
    seg_parts: list[np.ndarray] = []
    for a, b in _calls(u_end - u_start):
        pieces = [texts[t][s:e] for t, s, e in zip(u_text[a:b].tolist(), u_start[a:b].tolist(), u_end[a:b].tolist())]
        piece_cuts = None if cuts is None else (u_counts[a:b], local[u_cut0[a] : u_cut0[b]])
        flat, seg_lens = encode(pieces, piece_cuts)
        del pieces
        flats.append(np.asarray(flat, np.int32))
        seg_parts.append(np.asarray(seg_lens, np.int64))
    # segment j of a piece of text i is the text's segment (its cuts in earlier pieces) + j, at index
    # i + (cuts before the piece) + j of the batch's segments
    per_unit = u_counts + 1
    first = np.cumsum(per_unit) - per_unit
    segment = np.repeat(u_text + u_cut0[:-1], per_unit) + np.arange(int(per_unit.sum())) - np.repeat(first, per_unit)
    seg_lens = np.bincount(segment, weights=np.concatenate(seg_parts), minlength=n + len(positions))
    return np.concatenate(flats), seg_lens.astype(np.int64)


def _calls(chars: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive ranges [a, b) of the pieces, each of at most CALL_CHARS chars or one piece."""
    calls: list[tuple[int, int]] = []
    a, total = 0, 0
    for k, size in enumerate(chars.tolist()):
        if k > a and total + size > CALL_CHARS:
            calls.append((a, k))
            a, total = k, 0
        total += size
    calls.append((a, len(chars)))
    return calls


def _too_long(where: str, chars: int, cuttable: bool) -> UserError:
    if cuttable:
        why = (
            f"has no place within {MAX_PIECE_CHARS:,} characters where cutting it leaves its tokens unchanged "
            "(such as a space after a word)"
        )
    else:
        why = f"is longer than the {MAX_PIECE_CHARS:,} characters this tokenizer encodes at once (its texts cannot be cut exactly)"
    return UserError(
        f"{where}: the text of {chars:,} characters {why}, and tokenizing it whole takes memory many times its size: "
        f"split it into rows of at most {MAX_PIECE_CHARS:,} characters"
    )
