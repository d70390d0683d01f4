"""Encoding texts whose segments must keep their own token counts: one tokenizer call per text,
split back into segments (a prompt and its response, chat turns) at the character positions where
they meet, by offsets or by the bytes each token stands for. `encode_segments` is what both this
process and the encode worker processes (`pipeline.tokenize.encode_pool`) run.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

Cuts = tuple[np.ndarray, np.ndarray]  # (cuts per text, their char positions): see encode_segments


def flat_ids(encodings: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Encodings -> flat int32 ids and int64 lengths (one per encoding)."""
    ids = [e.ids for e in encodings]
    lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(lens.sum()))
    return flat, lens


def encode_segments(
    backend: Any, texts: list[str], cuts: Cuts | None = None, sizes: TokenSizes | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Encode each text whole with a `tokenizers.Tokenizer` (no special tokens) -> flat int32 ids
    and the int64 token count of each of its segments.

    `cuts` = (counts, positions): text i is cut at counts[i] ascending char positions (taken in
    order from `positions`) into counts[i] + 1 segments; None: one segment per text. Whole texts,
    because the ids must be the tokenizer's ids of the text a model will see: segments encoded
    alone differ at every cut for SentencePiece-style tokenizers (each starts with "▁"), and
    wherever a merge or a pre-tokenizer word crosses the cut. A segment starts at the first token
    that ends after its cut, so a token that straddles a cut belongs to the later segment (a
    response's first token carries loss, as in TRL's prompt/completion split).

    Where the tokens end: from the ids alone with `sizes` (`token_sizes` of this backend), for each
    text whose token sizes add up to its length; else from the tokenizer's offsets (`encode_batch`,
    which costs 17-36% more than `encode_batch_fast`).
    """
    if cuts is None or len(cuts[1]) == 0:
        return flat_ids(backend.encode_batch_fast(texts, add_special_tokens=False))
    counts, positions = np.asarray(cuts[0], np.int64), np.asarray(cuts[1], np.int64)
    if sizes is None:
        return _split_by_offsets(backend.encode_batch(texts, add_special_tokens=False), texts, counts, positions)
    flat, lens = flat_ids(backend.encode_batch_fast(texts, add_special_tokens=False))
    seg_lens, ok = _split_by_sizes(sizes, flat, lens, texts, counts, positions)
    if not ok.all():  # the sizes do not add up for these texts: their offsets tell
        bad = np.flatnonzero(~ok).tolist()
        redo = [texts[i] for i in bad]
        cut0 = np.cumsum(counts) - counts  # each text's first cut in `positions`
        seg0 = cut0 + np.arange(len(texts))  # and its first segment in `seg_lens`
        _, fixed = _split_by_offsets(
            backend.encode_batch(redo, add_special_tokens=False),
            redo,
            counts[bad],
            np.concatenate([positions[cut0[i] : cut0[i] + counts[i]] for i in bad]),
        )
        seg_lens[np.concatenate([np.arange(seg0[i], seg0[i] + counts[i] + 1) for i in bad])] = fixed
    return flat, seg_lens


def _split_by_offsets(encodings: list[Any], texts: list[str], counts: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat ids and segment token counts of `encodings` (made with offsets), cut where `positions` say."""
    flat, lens = flat_ids(encodings)
    seg_lens = np.empty(len(texts) + len(positions), dtype=np.int64)
    k = j = 0
    for text, encoding, n, count in zip(texts, encodings, lens.tolist(), counts.tolist()):
        prev = 0
        for char in positions[j : j + count].tolist():
            token = _first_token_from(encoding, char, len(text), n)
            seg_lens[k] = max(token - prev, 0)
            prev = max(token, prev)
            k += 1
        seg_lens[k] = n - prev
        k += 1
        j += count
    return flat, seg_lens


def _first_token_from(encoding: Any, char: int, n_chars: int, n_tokens: int) -> int:
    """The index of the token holding char `char` of the text, or of the first char after it that
    a token holds (normalizers may drop chars); `n_tokens` when none does."""
    while char < n_chars:
        token = encoding.char_to_token(char)
        if token is not None:
            return token
        char += 1
    return n_tokens


@dataclass(frozen=True)
class TokenSizes:
    """How many bytes of the original text each token id stands for (`token_sizes`)."""

    bytes: np.ndarray  # int64 per id; an unknown token gets an impossible size
    added: np.ndarray  # bool per id: an added (special) token, matched in the raw text
    strips: np.ndarray  # bool per id: an added token that takes the spaces beside it (lstrip/rstrip)
    prepends: bool  # the pre-tokenizer puts a "▁" before the text unless it starts with a space
    nfc: bool  # the normalizer is NFC: only texts it leaves as they are can be measured


def cached_token_sizes(backend: Any) -> TokenSizes | None:
    """`token_sizes(backend)`, worked out once per backend object in this process."""
    entry = _SIZES.get(id(backend))
    if entry is None or entry[0] is not backend:
        entry = _SIZES[id(backend)] = (backend, token_sizes(backend))  # (the backend kept: its id stays its own)
    return entry[1]


_SIZES: dict[int, tuple[Any, TokenSizes | None]] = {}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_IMPOSSIBLE = 1 << 40


def token_sizes(backend: Any) -> TokenSizes | None:
    """The byte size of every token of `backend`, where its string alone says it: BPE (no dropout,
    no subword affixes) with a byte-level pre-tokenizer (each char of a token is one byte; no prefix
    space; no normalizer but NFC, for texts already in NFC) or a SentencePiece-style Metaspace one
    ("▁" is one space, `<0xNN>` one byte; no normalizer). None for other tokenizers, whose texts
    need offsets.

    A text whose token sizes add up to its UTF-8 length (`encode_segments` checks every one) is
    measured right: here the tokens can only understate a text (a literal "▁"), but
    for an unknown token (given an impossible size) and the Metaspace "▁" put before a text (which is
    counted), so they add up to its length only when they state it exactly. Texts with an added
    token that strips the spaces beside it are not measured this way at all.
    """
    model, pre, norm = backend.model, backend.pre_tokenizer, backend.normalizer
    if type(model).__name__ != "BPE" or model.dropout or model.continuing_subword_prefix or model.end_of_word_suffix:
        return None
    kind = type(pre).__name__
    if kind == "ByteLevel" and not pre.add_prefix_space and type(norm).__name__ in ("NoneType", "NFC"):
        size, prepends = len, False
    elif kind == "Metaspace" and pre.replacement == "▁" and norm is None and pre.prepend_scheme in ("first", "never"):
        size, prepends = _metaspace_size, pre.prepend_scheme == "first"
    else:
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    sizes = np.full(backend.get_vocab_size(with_added_tokens=True), _IMPOSSIBLE, dtype=np.int64)
    sizes[np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))] = np.fromiter(map(size, vocab), dtype=np.int64, count=len(vocab))
    added = np.zeros(len(sizes), dtype=bool)
    strips = np.zeros(len(sizes), dtype=bool)
    for i, token in backend.get_added_tokens_decoder().items():
        sizes[i] = len(token.content.encode())
        added[i] = True
        strips[i] = token.lstrip or token.rstrip
    if model.unk_token is not None and backend.token_to_id(model.unk_token) is not None:
        sizes[backend.token_to_id(model.unk_token)] = _IMPOSSIBLE  # it stands for any char
    return TokenSizes(sizes, added, strips, prepends, norm is not None)


def _metaspace_size(token: str) -> int:
    return 1 if len(token) == 6 and _BYTE_TOKEN.fullmatch(token) else len(token.replace("▁", " ").encode())


def _split_by_sizes(
    sizes: TokenSizes, flat: np.ndarray, lens: np.ndarray, texts: list[str], counts: np.ndarray, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Segment token counts from the ids' byte sizes (vectorised over the batch), and per text
    whether its sizes add up (False: its counts are to be taken from offsets)."""
    n = len(texts)
    ends = np.concatenate(([0], np.cumsum(sizes.bytes[flat])))  # ends[t + 1]: where token t ends
    first_tok = np.cumsum(lens) - lens
    base = ends[first_tok]
    text_bytes = np.fromiter((len(t.encode()) for t in texts), dtype=np.int64, count=n)
    prepended = np.zeros(n, dtype=np.int64)
    if sizes.prepends:  # "▁" put before the text: unless it starts with a space or an added token
        spaced = np.fromiter((t[:1] in (" ", "▁") for t in texts), dtype=bool, count=n)
        first_added = sizes.added[flat[np.minimum(first_tok, len(flat) - 1)]] if len(flat) else np.ones(n, bool)
        prepended = ((lens > 0) & ~spaced & ~first_added).astype(np.int64)
    ok = ends[first_tok + lens] - base - prepended == text_bytes
    if sizes.nfc:
        ok &= np.fromiter((unicodedata.is_normalized("NFC", t) for t in texts), dtype=bool, count=n)
    if sizes.strips.any():
        stripping = np.concatenate(([0], np.cumsum(sizes.strips[flat])))
        ok &= stripping[first_tok + lens] == stripping[first_tok]
    owner = np.repeat(np.arange(n), counts)
    cut_bytes = np.fromiter(
        (len(texts[i][:c].encode()) for i, c in zip(owner.tolist(), positions.tolist())), dtype=np.int64, count=len(positions)
    )
    # the first token ending after the cut: ends[t + 1] > target
    target = base[owner] + prepended[owner] + cut_bytes
    bound = np.clip(np.searchsorted(ends, target, side="right") - 1 - first_tok[owner], 0, lens[owner])
    bound[cut_bytes == 0] = 0  # a cut before the text's first char: a "▁" put before it goes along
    first_seg = np.cumsum(counts + 1) - (counts + 1)
    starts = np.zeros(n + len(positions), dtype=np.int64)
    later = np.ones(len(starts), dtype=bool)
    later[first_seg] = False
    starts[later] = bound
    stops = np.empty_like(starts)
    stops[:-1] = starts[1:]
    stops[first_seg + counts] = lens
    return stops - starts, ok
