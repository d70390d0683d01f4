"""Fast integrity checks of a packed folder (`verify_folder`): the manifest, the files, and every
shard through `pipeline.shards.checks` (about one read of the tokens; the only Python loops are per
shard). The first defect found raises `ShardFormatError` with one line naming the file, row and
example index within the row; when a shard has defects of several kinds, the first kind in the
order listed below is reported.

pack-data calls `summarize_shard` in a checker thread on each shard as soon as it is written and passes the
results as `verify_folder(..., checked=...)`, which then runs only the folder-level checks for the
shards whose file is unchanged. `pack-verify` and `pack-train` pass nothing: every shard is read.

What is checked:

- manifest: JSON, format name/version, required fields (`read_manifest`); efficiency consistent
  with rows/tokens/max_len; counts not contradictory;
- the manifest's own checksum (unless `check_hashes=False`): the figures no shard can prove
  (max_len, counts of truncated/dropped/skipped examples, strategy, ...) are as pack-data wrote them;
  a manifest without one fails;
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

import json
import os
from pathlib import Path

import numpy as np

from pipeline.errors import ShardFormatError
from pipeline.shards.checks import ShardSummary, summarize_shard
from pipeline.shards.format import SHARD_GLOB, load_shard, shard_paths
from pipeline.shards.manifest import MANIFEST_NAME, Manifest, file_sha256, manifest_checksum, read_manifest


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
    if c.passes < 1:
        raise ShardFormatError(f"{where}: counts.passes is {c.passes}, must be >= 1")
    if c.examples_packed > c.examples_read * c.passes:
        raise ShardFormatError(
            f"{where}: counts.examples_packed {c.examples_packed} > counts.examples_read "
            f"{c.examples_read}" + (f" x counts.passes {c.passes}" if c.passes != 1 else "")
        )
    if manifest.loss_tokens > manifest.total_tokens:
        raise ShardFormatError(f"{where}: loss_tokens {manifest.loss_tokens} > total_tokens {manifest.total_tokens}")
    expected = manifest.total_tokens / (manifest.rows * manifest.max_len) if manifest.rows else 0.0
    eff = manifest.efficiency
    if not isinstance(eff, (int, float)) or abs(eff - expected) > 1e-5:  # manifests round to 1e-6
        raise ShardFormatError(f"{where}: efficiency {manifest.efficiency!r} != total_tokens / (rows x max_len) = {expected:.6f}")


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
            f"{folder / stray[0]}: shard file not listed in the manifest (left over from another run?): remove it or re-run pack-data"
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
                f"{path}: has {summary.rows} rows / {summary.tokens} tokens, manifest says {info.rows} rows / {info.tokens} tokens"
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
    if manifest.groups or manifest.group_size is not None:
        _check_groups(manifest, where, paths)
    if check_hashes:
        check_checksum(folder / MANIFEST_NAME)
    return manifest


def _check_groups(manifest: Manifest, where: str, paths: list[Path]) -> None:
    """`groups` (rows of each group of --strategy minibatch) covers the rows, and every group holds
    `group_size` examples (pieces) but the last, which holds at most that many."""
    size, groups = manifest.group_size, manifest.groups
    if size is None or not groups:
        raise ShardFormatError(f"{where}: groups and group_size come together (one is missing): re-run pack-data")
    if sum(groups) != manifest.rows:
        raise ShardFormatError(f"{where}: the groups hold {sum(groups)} rows but the folder has {manifest.rows}: re-run pack-data")
    pieces = np.concatenate([np.diff(load_shard(p).ex_off) for p in paths] or [np.zeros(0, np.int64)])
    per_group = np.add.reduceat(pieces, np.concatenate(([0], np.cumsum(groups)[:-1]))) if len(pieces) else pieces
    wrong = np.flatnonzero(per_group[:-1] != size)
    if len(wrong) or per_group[-1] > size:
        g = int(wrong[0]) if len(wrong) else len(groups) - 1
        raise ShardFormatError(
            f"{where}: group {g} holds {int(per_group[g])} examples, not group_size {size} "
            "(only the last group may hold fewer): re-run pack-data"
        )


def check_checksum(path: Path) -> None:
    """The manifest's own checksum: the figures no shard can prove (max_len, the counts of
    truncated, dropped and skipped examples, strategy, seed, ...) as pack-data wrote them. A
    manifest without one is refused too: a checksum removed along with an edit looks the same as
    none ever written, so what it would cover cannot be vouched for."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("checksum") is None:
        raise ShardFormatError(
            f"{path}: it has no checksum, so its figures (counts, max_len, strategy, ...) cannot be checked: "
            "it was removed after pack-data wrote the manifest, or an older pack-data wrote none; re-run "
            "pack-data (or pass --no-hash to check the structure only)"
        )
    if data["checksum"] != manifest_checksum(data):
        raise ShardFormatError(
            f"{path}: its checksum does not match its contents: a figure in it (counts, max_len, efficiency, "
            "...) was changed after pack-data wrote it; restore the manifest or re-run pack-data"
        )


def _check_example_ids(manifest: Manifest, where: str, ids: np.ndarray) -> None:
    c = manifest.counts
    if len(ids) and ids.min() < 0:
        raise ShardFormatError(f"{where}: negative example id {int(ids.min())} in the shards")
    if len(ids) and c.examples_read and ids.max() >= c.examples_read * c.passes:
        raise ShardFormatError(
            f"{where}: example id {int(ids.max())} >= counts.examples_read {c.examples_read}"
            + (f" x counts.passes {c.passes}" if c.passes != 1 else "")
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
            f"{where}: counts.examples_packed is {c.examples_packed} but the shards hold {len(uniq)} distinct example ids"
        )


def verify_eval_folder(folder: str | os.PathLike[str], manifest: Manifest, *, check_hashes: bool = True) -> Manifest:
    """Verify the held-out eval folder a training folder's manifest names (`pack-data
    --eval-fraction`) and that no example id is in both; returns the eval folder's manifest."""
    held = Path(folder) / manifest.eval["folder"]
    if not (held / MANIFEST_NAME).is_file():
        raise ShardFormatError(f"{folder}: its manifest names the eval folder {held}, which is missing: re-run pack-data")
    eval_manifest = verify_folder(held, check_hashes=check_hashes)
    ids = [
        np.unique(np.concatenate([load_shard(p).example_ids for p in shard_paths(f, m)] or [np.zeros(0)]))
        for f, m in ((folder, manifest), (held, eval_manifest))
    ]
    both = np.intersect1d(*ids)
    if len(both):
        raise ShardFormatError(
            f"{held}: example id {int(both[0])} is in the eval folder and in the training folder ({len(both)} in both): re-run pack-data"
        )
    return eval_manifest
