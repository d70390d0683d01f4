"""Fast integrity checks of a packed folder (`verify_folder`) and the `pack-verify` command.

Per-row and per-example checks are vectorised numpy over a shard's offsets; the per-token checks
(ids in range, position_ids, labels, loss-token count) are one branch-free numba pass over the flat
token columns (`_token_checks`; only a shard with a defect gets a second pass that finds which and
where), so verifying costs about one read of the tokens; the only Python loops are per shard. The
first defect found raises `ShardFormatError` with one line naming the file, row and example index
within the row; when a shard has defects of several kinds, the first kind in the order listed below
is reported.

`summarize_shard(path, max_len, vocab_size)` checks one shard file and keeps what the folder-level
checks need (`ShardSummary`: rows, tokens, loss tokens, example ids, the largest id, and the file's
size / mtime / inode). pack-data calls it in a checker thread on each shard as soon as it is written and passes the
results as `verify_folder(..., checked=...)`, which then runs only the folder-level checks for the
shards whose file is unchanged. `pack-verify` and `pack-train` pass nothing: every shard is read.

What is checked:

- manifest: JSON, format name/version, required fields (`read_manifest`); efficiency consistent
  with rows/tokens/max_len; counts not contradictory;
- files: every listed shard present, sha256 as recorded (unless `check_hashes=False`), no stray
  `shard-*.arrow` file that the manifest does not list; Arrow IPC file with exactly `SCHEMA`;
- per row: input_ids, labels and position_ids of equal length; seq_lens and example_ids of equal
  length; seq_lens >= 1 and summing to the row length; row length in 1..max_len; position_ids
  0..n-1 within each example; the label at each example start is -100 and every other label is
  -100 or equal to the input id at the same position (labels are unshifted); token ids in
  0..vocab_size-1 (when the manifest's tokenizer records vocab_size);
- totals: rows/tokens per shard as in its manifest entry; total rows, tokens and loss tokens
  (labels != -100) as in the manifest; distinct example ids == counts.examples_packed; ids in
  0..counts.examples_read-1.

Split examples: a split example repeats its id, and the pieces need not be adjacent (the planner
may put them in different rows or shards). What can be checked is the number of *ids that repeat*:
it may not exceed counts.split (one per split example). Which pieces belong together, and their
order, is not recorded, so it is not checked.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import click
import numba
import numpy as np

from pipeline.console import run_and_exit
from pipeline.errors import ShardFormatError, UserError, cli_errors
from pipeline.shards import (
    IGNORE_INDEX,
    SHARD_GLOB,
    FlatColumn,
    Manifest,
    file_sha256,
    flat_column,
    open_shard,
    read_manifest,
    shard_paths,
)


@dataclass
class _Flat:
    """One shard's columns as 0-based flat arrays plus offsets (int64)."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    row_off: np.ndarray
    seq_lens: np.ndarray
    example_ids: np.ndarray
    ex_off: np.ndarray
    loss_tokens: int = -1  # labels != -100; set by check_shard
    max_id: int = -1  # the largest input id; set by check_shard
    no_loss: int = -1  # examples without a label != -100; set by check_shard


# Defects the token pass finds, in the order they are reported when a shard has several kinds.
_OK, _NEGATIVE_ID, _BEYOND_VOCAB, _POSITION, _LABEL_AT_START, _LABEL_SHIFTED = range(6)


@numba.njit(cache=True, nogil=True)
def _token_checks(input_ids, labels, position_ids, seq_lens, vocab):  # pragma: no cover - numba
    """One pass over a shard's flat tokens; `seq_lens` must tile them (checked before).

    Returns (code, index, loss tokens, largest id, examples without a loss token): the first defect
    kind found, in the `_NEGATIVE_ID` .. `_LABEL_SHIFTED` order (`_OK` if none), the flat token
    index of its first occurrence (the flat example index for `_LABEL_AT_START`), the number of
    labels != -100, the largest input id (-1 for no tokens) and the number of examples all of whose
    labels are -100. `vocab` <= 0: unknown.
    The pass itself is branch-free (it vectorises); only a shard with a defect gets a second,
    slower pass (`_token_defects`) that finds which and where.
    """
    limit = np.int64(vocab) if vocab > 0 else np.int64(1) << 32
    loss = 0
    top = np.int64(-1)
    bad = False
    no_loss = 0
    t = 0
    for k in range(seq_lens.shape[0]):
        n = seq_lens[k]
        acc = labels[t] != -100
        example_loss = 0
        for i in range(n):
            x = np.int64(input_ids[t + i])
            y = labels[t + i]
            m = y != -100
            example_loss += m
            top = max(top, x)
            acc |= (x < 0) | (x >= limit) | (position_ids[t + i] != i) | (m & (y != x))
        loss += example_loss
        no_loss += example_loss == 0
        bad |= acc
        t += n
    if not bad:
        return _OK, -1, loss, top, no_loss
    code, at, loss = _token_defects(input_ids, labels, position_ids, seq_lens, vocab)
    return code, at, loss, top, no_loss


@numba.njit(cache=True, nogil=True)
def _token_defects(input_ids, labels, position_ids, seq_lens, vocab):  # pragma: no cover - numba
    """`_token_checks`'s result for a shard known to have a defect: the first of each kind."""
    first = np.full(6, -1, np.int64)
    loss = 0
    t = 0
    for k in range(seq_lens.shape[0]):
        n = seq_lens[k]
        if labels[t] != -100 and first[_LABEL_AT_START] < 0:
            first[_LABEL_AT_START] = k
        for i in range(n):
            x = input_ids[t]
            y = labels[t]
            if x < 0 and first[_NEGATIVE_ID] < 0:
                first[_NEGATIVE_ID] = t
            if vocab > 0 and x >= vocab and first[_BEYOND_VOCAB] < 0:
                first[_BEYOND_VOCAB] = t
            if position_ids[t] != i and first[_POSITION] < 0:
                first[_POSITION] = t
            if y != -100:
                loss += 1
                if y != x and first[_LABEL_SHIFTED] < 0:
                    first[_LABEL_SHIFTED] = t
            t += 1
    for code in range(1, 6):
        if first[code] >= 0:
            return code, first[code], loss
    return _OK, -1, loss


def _norm(col: FlatColumn) -> tuple[np.ndarray, np.ndarray]:
    """Values covered by the offsets, with offsets rebased to start at 0."""
    off = col.offsets
    start = int(off[0]) if len(off) else 0
    end = int(off[-1]) if len(off) else 0
    return col.values[start:end], off - start


def _first(mask: np.ndarray) -> int:
    """Index of the first True in `mask` (caller knows there is one)."""
    return int(np.argmax(mask))


class _Locator:
    """Turns flat indices into 'file row R example E (id X)' text."""

    def __init__(self, name: str, flat: _Flat) -> None:
        self.name, self.flat = name, flat

    def row(self, r: int) -> str:
        return f"{self.name} row {r}"

    def example(self, k: int) -> str:
        """Location of flat example index k."""
        r = int(np.searchsorted(self.flat.ex_off, k, side="right") - 1)
        e = k - int(self.flat.ex_off[r])
        return f"{self.name} row {r} example {e} (id {int(self.flat.example_ids[k])})"

    def token(self, t: int, example_starts: np.ndarray) -> str:
        """Location of flat token index t, given the flat token start of every example."""
        k = int(np.searchsorted(example_starts, t, side="right") - 1)
        pos = t - int(example_starts[k])
        return f"{self.example(k)} token {pos}"


def _load(path: Path) -> _Flat:
    table = open_shard(path)
    names = ("input_ids", "labels", "position_ids", "seq_lens", "example_ids")
    cols = {n: _norm(flat_column(table, n)) for n in names}
    name = path.name
    row_off = cols["input_ids"][1]
    for other in ("labels", "position_ids"):
        off = cols[other][1]
        if not np.array_equal(off, row_off):
            r = _first(np.diff(off) != np.diff(row_off))
            raise ShardFormatError(
                f"{name} row {r}: {other} has {int(np.diff(off)[r])} entries but input_ids has "
                f"{int(np.diff(row_off)[r])}"
            )
    ex_off = cols["seq_lens"][1]
    if not np.array_equal(cols["example_ids"][1], ex_off):
        d1, d2 = np.diff(cols["example_ids"][1]), np.diff(ex_off)
        r = _first(d1 != d2)
        raise ShardFormatError(
            f"{name} row {r}: example_ids has {int(d1[r])} entries but seq_lens has {int(d2[r])}"
        )
    return _Flat(
        input_ids=cols["input_ids"][0],
        labels=cols["labels"][0],
        position_ids=cols["position_ids"][0],
        row_off=row_off,
        seq_lens=cols["seq_lens"][0].astype(np.int64, copy=False),
        example_ids=cols["example_ids"][0],
        ex_off=ex_off,
    )


def check_shard(path: Path, max_len: int, vocab_size: int | None = None) -> _Flat:
    """Structural checks of one shard file; returns its flat columns for the global checks."""
    flat = _load(path)
    loc = _Locator(path.name, flat)
    row_len = np.diff(flat.row_off)
    n_ex = np.diff(flat.ex_off)
    if len(row_len) and (bad := (row_len < 1) | (n_ex < 1)).any():
        r = _first(bad)
        raise ShardFormatError(f"{loc.row(r)}: empty row ({int(row_len[r])} tokens, "
                               f"{int(n_ex[r])} examples)")
    if (bad := row_len > max_len).any():
        r = _first(bad)
        raise ShardFormatError(
            f"{loc.row(r)}: row too long: {int(row_len[r])} tokens > max_len {max_len}"
        )
    seq = flat.seq_lens
    if (bad := seq < 1).any():
        k = _first(bad)
        raise ShardFormatError(f"{loc.example(k)}: seq_lens entry is {int(seq[k])}, must be >= 1")
    # Sum of seq_lens per row, vectorised through a cumulative sum over the flat example lengths.
    cum = np.concatenate(([0], np.cumsum(seq)))
    row_sums = cum[flat.ex_off[1:]] - cum[flat.ex_off[:-1]]
    if (bad := row_sums != row_len).any():
        r = _first(bad)
        raise ShardFormatError(
            f"{loc.row(r)}: seq_lens sum to {int(row_sums[r])} but the row has "
            f"{int(row_len[r])} tokens"
        )
    # From here the example boundaries tile the flat token arrays exactly: one numba pass over the
    # tokens finds the first defect of each kind (reported in the order below) and counts loss tokens.
    starts = cum[:-1]
    code, at, flat.loss_tokens, flat.max_id, flat.no_loss = _token_checks(
        flat.input_ids, flat.labels, flat.position_ids, seq, int(vocab_size or 0)
    )
    if code == _NEGATIVE_ID:
        raise ShardFormatError(
            f"{loc.token(at, starts)}: negative token id {int(flat.input_ids[at])}"
        )
    if code == _BEYOND_VOCAB:
        raise ShardFormatError(
            f"{loc.token(at, starts)}: token id {int(flat.input_ids[at])} >= the tokenizer's "
            f"vocab_size {vocab_size} (manifest): packed with another tokenizer?"
        )
    if code == _POSITION:
        expected = at - int(starts[np.searchsorted(starts, at, side="right") - 1])
        raise ShardFormatError(
            f"{loc.token(at, starts)}: position_ids do not restart/count up per example "
            f"(got {int(flat.position_ids[at])}, expected {expected})"
        )
    labels = flat.labels
    if code == _LABEL_AT_START:  # `at` is the flat example index here
        raise ShardFormatError(
            f"{loc.example(at)} token 0: label at an example start is {int(labels[starts[at]])}, "
            f"must be {IGNORE_INDEX} (no prediction across example boundaries)"
        )
    if code == _LABEL_SHIFTED:
        raise ShardFormatError(
            f"{loc.token(at, starts)}: label {int(labels[at])} is neither {IGNORE_INDEX} nor the "
            f"input id {int(flat.input_ids[at])} (labels must be unshifted copies of input_ids)"
        )
    return flat


@dataclass
class ShardSummary:
    """One shard file as `check_shard` found it: what `verify_folder`'s folder-level checks need.

    `size`, `mtime_ns` and `inode` are the file's, taken before it was opened: a summary stands for
    the file only while all three are unchanged (and it was checked against the same max_len; the
    vocabulary check is `max_id` < vocab_size, so a summary made before the vocabulary was known
    still serves). A same-size rewrite in place within one file-system timestamp tick would go
    unnoticed; `pack-verify` (sha256) catches that too.
    """

    rows: int
    tokens: int
    loss_tokens: int
    no_loss: int  # examples with no token that carries a loss
    example_ids: np.ndarray  # int64, a copy (a view would keep the memory-mapped shard resident)
    max_len: int
    max_id: int  # the largest input id (-1 for an empty shard)
    size: int
    mtime_ns: int
    inode: int

    def holds_for(self, path: Path, max_len: int, vocab_size: int | None) -> bool:
        """True when this summary still describes `path` checked with these limits."""
        try:
            st = os.stat(path)
        except OSError:
            return False
        return (st.st_size, st.st_mtime_ns, st.st_ino, max_len) == (
            self.size, self.mtime_ns, self.inode, self.max_len) and (vocab_size is None or self.max_id < vocab_size)


def summarize_shard(path: str | os.PathLike[str], max_len: int,
                    vocab_size: int | None = None) -> ShardSummary:
    """`check_shard` on the file as it is on disk (memory-mapped); its totals and example ids.

    pack-data calls this on each shard as soon as it is written and hands the results to
    `verify_folder(..., checked=...)`, which then need not read the tokens again.
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ShardFormatError(f"{path}: cannot read the shard ({exc.strerror})") from None
    flat = check_shard(path, max_len, vocab_size)
    return ShardSummary(
        rows=len(flat.row_off) - 1,
        tokens=len(flat.input_ids),
        loss_tokens=int(flat.loss_tokens),
        no_loss=int(flat.no_loss),
        example_ids=np.array(flat.example_ids, dtype=np.int64, copy=True),
        max_len=max_len,
        max_id=int(flat.max_id),
        size=st.st_size,
        mtime_ns=st.st_mtime_ns,
        inode=st.st_ino,
    )


def first_beyond_vocab(path: str | os.PathLike[str], vocab_size: int) -> tuple[int, int]:
    """(example id, token id) of the first token id >= vocab_size in a shard that has one (for the
    error message: which input example holds it)."""
    flat = _load(Path(path))
    t = _first(flat.input_ids >= vocab_size)
    k = int(np.searchsorted(np.cumsum(flat.seq_lens), t, side="right"))
    return int(flat.example_ids[k]), int(flat.input_ids[t])


def manifest_vocab(tokenizer: object) -> int | None:
    """The vocab_size a manifest's `tokenizer` entry records, when it is a usable one (else None)."""
    vocab = tokenizer.get("vocab_size") if isinstance(tokenizer, dict) else None
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None


def _check_manifest_self(manifest: Manifest, where: str) -> None:
    c = manifest.counts
    if manifest.max_len < 1:
        raise ShardFormatError(f"{where}: max_len is {manifest.max_len}, must be >= 1")
    for key, value in vars(c).items():
        if key == "no_loss" and value is None:  # manifests written before it was counted
            continue
        if not isinstance(value, int) or value < 0:
            raise ShardFormatError(f"{where}: counts.{key} is {value!r}, must be an integer >= 0")
    if c.examples_packed > c.examples_read:
        raise ShardFormatError(
            f"{where}: counts.examples_packed {c.examples_packed} > counts.examples_read "
            f"{c.examples_read}"
        )
    if manifest.loss_tokens > manifest.total_tokens:
        raise ShardFormatError(
            f"{where}: loss_tokens {manifest.loss_tokens} > total_tokens {manifest.total_tokens}"
        )
    expected = manifest.total_tokens / (manifest.rows * manifest.max_len) if manifest.rows else 0.0
    eff = manifest.efficiency
    if not isinstance(eff, (int, float)) or abs(eff - expected) > 1e-5:  # manifests round to 1e-6
        raise ShardFormatError(
            f"{where}: efficiency {manifest.efficiency!r} != total_tokens / (rows x max_len) = "
            f"{expected:.6f}"
        )


def verify_folder(
    folder: str | os.PathLike[str],
    *,
    check_hashes: bool = True,
    checked: dict[str, ShardSummary] | None = None,
) -> Manifest:
    """Run the fast checks on a packed folder; return its manifest or raise ShardFormatError.

    Raises on the first defect, naming the file, row and example index within the row.
    `checked` maps shard file names to `summarize_shard` results computed earlier (pack-data checks
    each shard as it is written): such a shard is not read again while its size and mtime are as
    they were when it was checked; any other shard is checked here. `pack-verify` and `pack-train`
    pass nothing, so every shard is read.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ShardFormatError(f"{folder}: not a folder (expected the --out folder of pack-data)")
    manifest = read_manifest(folder)
    where = str(folder / "manifest.json")
    _check_manifest_self(manifest, where)
    paths = shard_paths(folder, manifest)
    listed = {p.name for p in paths}
    if len(listed) != len(paths):
        raise ShardFormatError(f"{where}: a shard file is listed twice")
    for path in paths:
        if path.parent != folder or not path.is_file():
            raise ShardFormatError(f"{path}: shard listed in the manifest is missing")
    stray = sorted(p.name for p in folder.glob(SHARD_GLOB) if p.name not in listed)
    if stray:
        raise ShardFormatError(
            f"{folder / stray[0]}: shard file not listed in the manifest (left over from another "
            "run?): remove it or re-run pack-data"
        )

    vocab = manifest_vocab(manifest.tokenizer)
    checked = checked or {}
    rows = tokens = loss = no_loss = 0
    ids: list[np.ndarray] = []
    for info, path in zip(manifest.shards, paths, strict=True):
        if check_hashes:
            digest = file_sha256(path)
            if digest != info.sha256:
                raise ShardFormatError(
                    f"{path}: sha256 {digest[:12]}... does not match the manifest "
                    f"({str(info.sha256)[:12]}...): the file changed after packing"
                )
        summary = checked.get(path.name)
        if summary is None or not summary.holds_for(path, manifest.max_len, vocab):
            summary = summarize_shard(path, manifest.max_len, vocab)
        if summary.rows != info.rows or summary.tokens != info.tokens:
            raise ShardFormatError(
                f"{path.name}: has {summary.rows} rows / {summary.tokens} tokens, manifest says "
                f"{info.rows} rows / {info.tokens} tokens"
            )
        rows += summary.rows
        tokens += summary.tokens
        loss += summary.loss_tokens
        no_loss += summary.no_loss
        ids.append(summary.example_ids)

    for label, got, want in (
        ("rows", rows, manifest.rows),
        ("total_tokens", tokens, manifest.total_tokens),
        ("loss_tokens", loss, manifest.loss_tokens),
        ("counts.no_loss", no_loss, no_loss if manifest.counts.no_loss is None else manifest.counts.no_loss),
    ):
        if got != want:
            raise ShardFormatError(f"{where}: {label} is {want} but the shards hold {got}")
    _check_example_ids(manifest, where, np.concatenate(ids) if ids else np.zeros(0, np.int64))
    return manifest


def _check_example_ids(manifest: Manifest, where: str, ids: np.ndarray) -> None:
    c = manifest.counts
    if len(ids) and ids.min() < 0:
        raise ShardFormatError(f"{where}: negative example id {int(ids.min())} in the shards")
    if len(ids) and c.examples_read and ids.max() >= c.examples_read:
        raise ShardFormatError(
            f"{where}: example id {int(ids.max())} >= counts.examples_read {c.examples_read}"
        )
    uniq, n = np.unique(ids, return_counts=True)
    repeated = uniq[n > 1]
    if len(repeated) > c.split:
        times = int(n[n > 1][0])
        raise ShardFormatError(
            f"{where}: example id {int(repeated[0])} appears {times} times: {len(repeated)} ids "
            f"repeat but counts.split is {c.split} (duplicated example)"
        )
    if len(uniq) != c.examples_packed:
        raise ShardFormatError(
            f"{where}: counts.examples_packed is {c.examples_packed} but the shards hold "
            f"{len(uniq)} distinct example ids"
        )


# --------------------------------------------------------------------------------------- deep


def deep_check(folder: Path, manifest: Manifest, tokenizer: str | None, sample: int,
               seed: int = 0) -> int:
    """Re-tokenize a seeded sample of source examples and compare token ids and labels.

    Uses `pipeline.tokenize.tokenize_examples(config, ids)` on the manifest's `config` (inputs,
    format options, tokenizer; `tokenizer` overrides the recorded one). A split example is compared
    piece by piece: its pieces are the consecutive max_len chunks of the fresh tokens, each chunk's
    first label -100, found in any order in the shards. Returns the number of examples compared.
    """
    from pipeline.tokenize import tokenize_examples  # noqa: PLC0415

    config = dict(manifest.config)
    if tokenizer:
        config["tokenizer"] = tokenizer
    for key in ("inputs", "tokenizer"):
        if not config.get(key):
            raise UserError(f"--deep: the manifest's config has no {key!r}: cannot re-tokenize")
    pieces: dict[int, list[tuple[str, int, np.ndarray, np.ndarray]]] = {}
    flats = [(path.name, _load(path)) for path in shard_paths(folder, manifest)]
    all_ids = np.unique(np.concatenate([f.example_ids for _, f in flats])) if flats else []
    chosen = sorted(random.Random(seed).sample(list(map(int, all_ids)), min(sample, len(all_ids))))
    if not chosen:
        return 0
    wanted = set(chosen)
    for name, flat in flats:
        cum = np.concatenate(([0], np.cumsum(flat.seq_lens)))
        for k in np.flatnonzero(np.isin(flat.example_ids, chosen)):
            r = int(np.searchsorted(flat.ex_off, k, side="right") - 1)
            sl = slice(int(cum[k]), int(cum[k + 1]))
            pieces.setdefault(int(flat.example_ids[k]), []).append(
                (f"{name} row {r} example {k - int(flat.ex_off[r])}", r,
                 flat.input_ids[sl], flat.labels[sl]))
    assert wanted == set(pieces)
    fresh = tokenize_examples(config, chosen)
    for eid, (ids, labels) in zip(chosen, fresh, strict=True):
        ids, labels = np.asarray(ids), np.asarray(labels)
        stored = pieces[eid]
        if len(stored) == 1:
            expect = [(ids, labels)]
        else:  # split: consecutive max_len chunks, each chunk's first label masked
            step = manifest.max_len
            expect = []
            for i in range(0, len(ids), step):
                lab = labels[i : i + step].copy()
                lab[0] = IGNORE_INDEX
                expect.append((ids[i : i + step], lab))
        got = sorted(((p[2].tolist(), p[3].tolist()) for p in stored))
        want = sorted(((e[0].tolist(), e[1].tolist()) for e in expect))
        if got != want:
            what = "token ids" if [g[0] for g in got] != [w[0] for w in want] else "labels"
            raise ShardFormatError(
                f"{stored[0][0]} (id {eid}): stored {what} differ from a fresh tokenization of the "
                f"source ({sum(len(p[2]) for p in stored)} stored vs {len(ids)} fresh tokens): "
                "wrong input, tokenizer or format options (or shards from an older pack-data, which "
                "tokenized prompts and responses apart: pack the data again)"
            )
    return len(chosen)


# ---------------------------------------------------------------------------------------- CLI


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option("--no-hash", is_flag=True, help="Skip the sha256 of each shard (structure only).")
@click.option("--deep", is_flag=True,
              help="Also re-tokenize a sample of the source examples and compare token ids.")
@click.option("--tokenizer", default=None,
              help="Tokenizer for --deep (default: the one recorded in the manifest's config).")
@click.option("--sample", default=100, show_default=True, type=click.IntRange(min=1),
              help="How many examples --deep re-tokenizes.")
def pack_verify(
    folder: Path, no_hash: bool, deep: bool, tokenizer: str | None, sample: int
) -> None:
    """Check that FOLDER (written by pack-data) is intact and follows the shard contract."""
    with cli_errors():
        manifest = verify_folder(folder, check_hashes=not no_hash)
        extra = ""
        if deep:
            n = deep_check(folder, manifest, tokenizer, sample)
            extra = f", {n} examples re-tokenized and matched"
        hashed = "" if not no_hash else " (sha256 not checked)"
        click.echo(
            f"ok: {manifest.rows} rows, {manifest.total_tokens} tokens, "
            f"{len(manifest.shards)} shards verified{hashed}{extra}"
        )


def main() -> None:
    """The `pack-verify` console script. Its process loads no model, so a tokenizer it loads comes
    without torch (`tokenizer_load.hide_torch`: importing torch takes seconds)."""
    from pipeline.tokenizer_load import hide_torch

    hide_torch()
    run_and_exit(pack_verify, "pack-verify")


if __name__ == "__main__":  # pragma: no cover
    main()
