"""One batch of input rows -> token ids, labels and a length per example (`TokBatch`).

Text: each row is rendered into segments (`pipeline.tokenize.render`); each example's segments are joined
into its whole text, the whole texts of the batch are tokenized with the fast tokenizer's batch API
(one call, or calls of bounded size with long texts cut where no id changes: `pipeline.tokenize.long_texts`),
and the ids are split at the segments' cuts (`pipeline.tokenize.segments.encode_segments`: the ids are the
tokenizer's ids of the text a model sees, not those of segments encoded apart). A numba kernel then
adds BOS/EOS per example (no BOS to a chat template's rendering, tokenized as transformers'
apply_chat_template, TRL and Axolotl tokenize it: `Segments.as_rendered`) and builds the labels (-100
on prompt segments and always on an example's first token; the EOS that ends a response carries loss).

Pre-tokenized rows skip the tokenizer and are reshaped with vectorised pyarrow/numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from typing import Any

import numba
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import UserError, one_line
from pipeline.read.formats import ResolvedFormat
from pipeline.shards import IGNORE_INDEX
from pipeline.tokenize.control_tokens import encode_marked, has_marks
from pipeline.tokenize.long_texts import Encode, encode_bounded
from pipeline.tokenize.render import Where, check_same_format, missing_field, render
from pipeline.tokenize.segments import Cuts, cached_token_sizes, encode_segments


def encode_texts(tokenizer: Any, texts: list[str], cuts: Cuts | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize whole texts (no special tokens added) with the Rust batch API in this process ->
    flat int32 ids, int64 lengths of their segments (`encode_segments`; `EncodePool.encode` does the
    same in worker processes)."""
    backend = tokenizer.backend_tokenizer
    return encode_segments(backend, texts, cuts, cached_token_sizes(backend) if cuts is not None else None)


@dataclass
class TokBatch:
    """One batch tokenized: flat ids/labels of its non-empty examples and a length per example (0 = empty)."""

    input_ids: np.ndarray  # int32
    labels: np.ndarray | None  # int32; None: equal to input_ids except the (masked) first token
    lengths: np.ndarray  # int64, one per input row of the batch


@numba.njit(cache=True)
def _assemble(ids, tok_loss, ex_tok_start, ex_tok_end, ex_last_loss, empty, no_eos, bos, eos):  # pragma: no cover
    n = ex_tok_start.shape[0]
    lengths = np.zeros(n, dtype=np.int64)
    add_b = np.zeros(n, dtype=np.bool_)
    add_e = np.zeros(n, dtype=np.bool_)
    total = 0
    for e in range(n):
        if empty[e]:
            continue
        a = ex_tok_start[e]
        b = ex_tok_end[e]
        add_b[e] = bos >= 0 and (b == a or ids[a] != bos)
        add_e[e] = eos >= 0 and not no_eos[e] and (b == a or ids[b - 1] != eos)
        lengths[e] = (b - a) + add_b[e] + add_e[e]
        total += lengths[e]
    out_ids = np.empty(total, dtype=np.int32)
    out_lab = np.empty(total, dtype=np.int32)
    k = 0
    for e in range(n):
        if empty[e]:
            continue
        start = k
        if add_b[e]:
            out_ids[k] = bos
            out_lab[k] = -100
            k += 1
        for t in range(ex_tok_start[e], ex_tok_end[e]):
            out_ids[k] = ids[t]
            out_lab[k] = ids[t] if tok_loss[t] else -100
            k += 1
        if add_e[e]:
            out_ids[k] = eos
            out_lab[k] = eos if ex_last_loss[e] else -100
            k += 1
        out_lab[start] = -100
    return out_ids, out_lab, lengths


def tokenize_batch(table: pa.Table, fmt: ResolvedFormat, tokenizer: Any, where: Where, encode: Encode | None = None) -> TokBatch:
    """Render, tokenize and assemble one batch of a text / instruction / chat dataset.

    `encode` turns texts into (flat ids, lengths): `encode_texts` with this tokenizer by default, or
    a worker pool's `encode`; it is called on texts of bounded size (`long_texts.encode_bounded`:
    long texts in exact pieces; a text that cannot be cut and is too long is a UserError naming
    its row).
    """
    segs = render(table, fmt, where, tokenizer)
    n = segs.n_examples
    blank = np.fromiter((not t or t.isspace() for t in segs.texts), dtype=bool, count=len(segs.texts))
    # an example is empty when it has no segment with visible text
    has_text = np.zeros(n, dtype=bool)
    if len(segs.texts):
        np.logical_or.at(has_text, segs.example[~blank], True)
    texts = segs.texts if has_text.all() else [t if keep else "" for t, keep in zip(segs.texts, has_text[segs.example].tolist())]
    # segments are sorted by example: example e owns segments [first[e], last[e]]
    counts = np.bincount(segs.example, minlength=n) if len(segs.example) else np.zeros(n, dtype=np.int64)
    last_seg = np.cumsum(counts) - 1
    first_seg = last_seg - counts + 1
    has_seg = counts > 0
    whole, cuts = _join_segments(texts, counts, first_seg)
    owner = np.flatnonzero(has_seg)  # the example of each whole text
    flat, seg_lens = _encode_whole(
        encode if encode is not None else partial(encode_texts, tokenizer),
        whole,
        cuts,
        tokenizer,
        lambda i: where(int(owner[i])),
        segs.controls,
    )
    tok_loss = np.repeat(segs.loss, seg_lens)
    seg_end = np.cumsum(seg_lens)
    seg_start = seg_end - seg_lens
    # an example with no segment (a chat with no messages) reads a valid index that np.where drops:
    # the first segment of a trailing one would be one past the end
    top = max(len(seg_start) - 1, 0)
    ex_start = np.where(has_seg, seg_start[np.clip(first_seg, 0, top)] if len(seg_start) else 0, 0)
    ex_end = np.where(has_seg, seg_end[np.clip(last_seg, 0, top)] if len(seg_end) else 0, 0)
    ex_last_loss = np.where(has_seg, segs.loss[np.clip(last_seg, 0, top)] if len(segs.loss) else False, False)
    bos = None if segs.as_rendered else tokenizer.bos_token_id
    eos = tokenizer.eos_token_id
    ids, labels, lengths = _assemble(
        flat,
        tok_loss,
        ex_start.astype(np.int64),
        ex_end.astype(np.int64),
        ex_last_loss.astype(bool),
        ~has_text,
        segs.no_eos if segs.no_eos is not None else np.zeros(n, dtype=bool),
        -1 if bos is None else int(bos),
        -1 if eos is None else int(eos),
    )
    return TokBatch(ids, labels, lengths)


def _encode_whole(
    encode: Encode, whole: list[str], cuts: Cuts | None, tokenizer: Any, where: Where, controls: tuple[str, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """(flat ids, segment token counts) of the whole texts: with `encode` (`encode_bounded`), but for
    the texts holding control tokens the user wrote, encoded here (`control_tokens.encode_marked`)."""
    marked = [i for i, text in enumerate(whole) if has_marks(text)]
    if not marked:
        return encode_bounded(encode, whole, cuts, lambda: tokenizer.backend_tokenizer, where)
    counts = np.zeros(len(whole), dtype=np.int64) if cuts is None else np.asarray(cuts[0], dtype=np.int64)
    positions = np.zeros(0, dtype=np.int64) if cuts is None else np.asarray(cuts[1], dtype=np.int64)
    first_cut = np.cumsum(counts) - counts
    plain = [i for i in range(len(whole)) if not has_marks(whole[i])]
    plain_cuts = (
        counts[plain],
        np.concatenate([positions[first_cut[i] : first_cut[i] + counts[i]] for i in plain] or [np.zeros(0, dtype=np.int64)]),
    )
    flat_p, lens_p = (
        encode_bounded(encode, [whole[i] for i in plain], plain_cuts, lambda: tokenizer.backend_tokenizer, lambda k: where(plain[k]))
        if plain
        else (np.zeros(0, np.int32), np.zeros(0, np.int64))
    )
    parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    seg_at = tok_at = 0
    for k, i in enumerate(plain):
        n_segs = int(counts[i]) + 1
        lens = lens_p[seg_at : seg_at + n_segs]
        parts[i] = (flat_p[tok_at : tok_at + int(lens.sum())], lens)
        seg_at += n_segs
        tok_at += int(lens.sum())
    for i in marked:
        cut = positions[first_cut[i] : first_cut[i] + counts[i]].tolist()
        parts[i] = encode_marked(tokenizer.backend_tokenizer, whole[i], cut, controls)
    ordered = [parts[i] for i in range(len(whole))]
    return (np.concatenate([p[0] for p in ordered]).astype(np.int32), np.concatenate([p[1] for p in ordered]).astype(np.int64))


def _join_segments(texts: list[str], counts: np.ndarray, first_seg: np.ndarray) -> tuple[list[str], Cuts | None]:
    """Each example's segments joined into its whole text (examples with none left out), and the
    char positions where its later segments start (None: one segment per example)."""
    if len(texts) == int((counts > 0).sum()):
        return texts, None
    chars = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    starts = np.cumsum(chars) - chars  # of each segment in the batch's segments laid end to end
    owner = np.repeat(np.arange(len(counts)), counts)
    later = np.ones(len(texts), dtype=bool)
    later[first_seg[counts > 0]] = False
    positions = (starts - starts[first_seg[owner]])[later]
    kept = counts[counts > 0]
    bounds = np.concatenate(([0], np.cumsum(kept))).tolist()
    whole = ["".join(texts[a:b]) for a, b in pairwise(bounds)]
    return whole, (kept - 1, positions)


def _int_list_column(table: pa.Table, name: str, where: Where) -> tuple[np.ndarray, np.ndarray]:
    """A list<int> column as (flat int32 values, int64 lengths); nulls and bad types are user errors."""
    if name not in table.column_names:
        raise missing_field(table, name, where)
    col = table.column(name)
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type)):
        raise UserError(f"{where(0)}: column {name!r} has type {one_line(col.type, 80)}, expected a list of token ids")
    if col.null_count:
        first = int(pc.index(pc.is_null(col), True).as_py())
        raise UserError(f"{where(first)}: {name!r} is missing or null: fix the row or remove it")
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(arr)
    if not pa.types.is_integer(values.type):
        raise UserError(f"{where(0)}: column {name!r} holds {one_line(values.type, 80)}, expected integer token ids")
    if values.null_count:
        raise UserError(f"{where(0)}: column {name!r} contains null token ids: fix the data")
    flat = values.to_numpy(zero_copy_only=False)
    if flat.dtype != np.int32:
        if len(flat) and (flat.min() < IGNORE_INDEX or flat.max() > np.iinfo(np.int32).max):
            raise UserError(
                f"{where(0)}: column {name!r} holds ids outside the int32 range: token ids are "
                "non-negative and below the vocabulary size; fix the data"
            )
        flat = flat.astype(np.int32)
    return flat, lengths


def tokenized_batch(table: pa.Table, fmt: ResolvedFormat, where: Where, *, derive_labels: bool = True) -> TokBatch:
    """Pre-tokenized rows: ids as given; labels as given or equal to the ids; first label always -100.

    Without a labels column and with `derive_labels=False`, labels are left as None (the writer
    derives them from the ids while gathering, which saves a copy and half the spill).
    """
    check_same_format(table, fmt, where)
    ids, lengths = _int_list_column(table, fmt.fields["input_ids"], where)
    if len(ids) and ids.min() < 0:
        bad = int(np.searchsorted(np.cumsum(lengths), int(np.argmax(ids < 0)), side="right"))
        raise UserError(f"{where(bad)}: input_ids contains a negative id: fix the data")
    starts = np.cumsum(lengths) - lengths
    if fmt.fields.get("labels"):
        labels, lab_lens = _int_list_column(table, fmt.fields["labels"], where)
        if not np.array_equal(lab_lens, lengths):
            bad = int(np.argmax(lab_lens != lengths))
            raise UserError(
                f"{where(bad)}: labels has {lab_lens[bad]} entries but input_ids has {lengths[bad]}: they must be the same length"
            )
        wrong = (labels != IGNORE_INDEX) & (labels != ids)
        if wrong.any():
            bad = int(np.searchsorted(np.cumsum(lengths), int(np.argmax(wrong)), side="right"))
            raise UserError(
                f"{where(bad)}: labels must be -100 or equal to input_ids at the same "
                "position (unshifted, Hugging Face convention): fix the labels column"
            )
        labels = labels.copy() if not labels.flags.writeable else labels
    elif not derive_labels:
        return TokBatch(ids, None, lengths)
    else:
        labels = ids.copy()
    nonempty = lengths > 0
    labels[starts[nonempty]] = IGNORE_INDEX
    return TokBatch(ids, labels, lengths)
