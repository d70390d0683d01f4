"""Build small, valid packed folders by hand, for tests (verify, report, trainer data loading).

`make_packed_folder(folder, rows, max_len)` takes the packed rows explicitly: each row is a list of
examples, each example `(example_id, input_ids)` or `(example_id, input_ids, labels)`. Labels
default to the input ids with the first token of each example set to -100 (the shard contract).
`pack_lengths(lengths, max_len)` turns a list of example lengths into such rows (first fit, random
token ids) when only the shape of the data matters.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.shards import (
    IGNORE_INDEX,
    Counts,
    Manifest,
    ShardInfo,
    file_sha256,
    manifest_checksum,
    rows_table,
    shard_name,
    write_manifest,
    write_shard,
)

Example = tuple  # (example_id, input_ids) or (example_id, input_ids, labels)


def default_labels(input_ids: Sequence[int]) -> np.ndarray:
    """Labels equal to the tokens, except -100 on the first token."""
    labels = np.asarray(input_ids, dtype=np.int64).copy()
    if len(labels):
        labels[0] = IGNORE_INDEX
    return labels


def make_packed_folder(
    folder: str | os.PathLike[str],
    rows: Sequence[Sequence[Example]],
    max_len: int,
    *,
    rows_per_shard: int | None = None,
    counts: Counts | None = None,
    strategy: str = "ffd",
    seed: int = 0,
    tokenizer: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> Manifest:
    """Write `rows` as a packed folder (shards + manifest.json) and return its manifest.

    Counts default to: every distinct example id read and packed, nothing truncated, dropped or
    split except ids that occur more than once (counted as split).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [list(r) for r in rows]
    per_shard = rows_per_shard or max(len(rows), 1)
    groups = [rows[i : i + per_shard] for i in range(0, len(rows), per_shard)] or []
    shards: list[ShardInfo] = []
    total = loss = 0
    all_ids: list[int] = []
    for index, group in enumerate(groups):
        ids_, labels_, pos_, seq_, exid_ = [], [], [], [], []
        row_off, ex_off = [0], [0]
        for row in group:
            for example in row:
                eid, tokens = example[0], np.asarray(example[1], dtype=np.int64)
                labels = np.asarray(example[2], dtype=np.int64) if len(example) > 2 else default_labels(tokens)
                ids_.append(tokens)
                labels_.append(labels)
                pos_.append(np.arange(len(tokens), dtype=np.int64))
                seq_.append(len(tokens))
                exid_.append(eid)
                all_ids.append(eid)
            row_off.append(row_off[-1] + sum(len(e[1]) for e in row))
            ex_off.append(ex_off[-1] + len(row))
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
        input_ids, labels, positions = cat(ids_), cat(labels_), cat(pos_)
        table = rows_table(
            input_ids,
            labels,
            positions,
            np.array(row_off),
            np.array(seq_, dtype=np.int64),
            np.array(exid_, dtype=np.int64),
            np.array(ex_off),
        )
        name = shard_name(index)
        write_shard(folder / name, table)
        tokens = int(len(input_ids))
        shards.append(ShardInfo(file=name, rows=len(group), tokens=tokens, sha256=file_sha256(folder / name)))
        total += tokens
        loss += int((labels != IGNORE_INDEX).sum())
    if counts is None:
        distinct = len(set(all_ids))
        split = len({i for i in all_ids if all_ids.count(i) > 1}) if all_ids else 0
        counts = Counts(examples_read=distinct, examples_packed=distinct, split=split)
    n_rows = len(rows)
    manifest = Manifest(
        max_len=max_len,
        strategy=strategy,
        seed=seed,
        rows=n_rows,
        total_tokens=total,
        loss_tokens=loss,
        efficiency=total / (n_rows * max_len) if n_rows else 0.0,
        counts=counts,
        shards=shards,
        tokenizer=tokenizer or {"name": "test", "fingerprint": "0" * 64},
        config=config or {"max_len": max_len, "strategy": strategy, "seed": seed},
    )
    write_manifest(folder, manifest)
    return manifest


def pack_lengths(lengths: Sequence[int], max_len: int, *, seed: int = 0, vocab: int = 1000) -> list[list[Example]]:
    """Rows for `lengths` by first fit in input order (example id = index), random token ids.

    Lengths above max_len are not allowed here (truncate them first).
    """
    rng = np.random.default_rng(seed)
    rows: list[list[Example]] = []
    free: list[int] = []
    for eid, n in enumerate(lengths):
        if not 1 <= n <= max_len:
            raise ValueError(f"length {n} of example {eid} is not in 1..{max_len}")
        tokens = rng.integers(3, vocab, size=int(n))
        for r, space in enumerate(free):
            if space >= n:
                rows[r].append((eid, tokens))
                free[r] -= n
                break
        else:
            rows.append([(eid, tokens)])
            free.append(max_len - n)
    return rows


def random_packed_folder(
    folder: str | os.PathLike[str],
    max_len: int,
    *,
    count: int,
    low: int,
    high: int,
    seed: int = 0,
    vocab: int = 300,
    rows_per_shard: int | None = None,
) -> Path:
    """A packed folder of `count` examples of random lengths in [low, high) (numpy's generator
    from `seed`), packed by `pack_lengths` into rows of `max_len`; returns the folder.

    Example: random_packed_folder(tmp / "rows", 64, count=50, low=4, high=40, rows_per_shard=7)
    writes about 18 rows in 3 shards."""
    lengths = np.random.default_rng(seed).integers(low, high, size=count).tolist()
    make_packed_folder(folder, pack_lengths(lengths, max_len, vocab=vocab), max_len, rows_per_shard=rows_per_shard)
    return Path(folder)


def shard_arrays(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """A shard's flat columns as writable numpy arrays: five columns plus row/example offsets."""
    from pipeline.shards import flat_column, open_shard  # noqa: PLC0415

    table = open_shard(path)
    out: dict[str, np.ndarray] = {}
    for name in ("input_ids", "labels", "position_ids", "seq_lens", "example_ids"):
        col = flat_column(table, name)
        start, end = int(col.offsets[0]), int(col.offsets[-1])
        out[name] = np.array(col.values[start:end])
        if name in ("input_ids", "seq_lens"):
            key = "row_offsets" if name == "input_ids" else "example_offsets"
            out[key] = np.array(col.offsets - start)
    return out


def rewrite_shard(
    folder: str | os.PathLike[str],
    index: int,
    arrays: dict[str, np.ndarray],
    *,
    update_hash: bool = True,
) -> None:
    """Write shard `index` from (possibly tampered) `arrays` (see `shard_arrays`).

    With update_hash the manifest's sha256 (and its checksum) follow the new file, so only the
    planted defect shows.
    """
    import json  # noqa: PLC0415

    folder = Path(folder)
    a = arrays
    table = rows_table(
        a["input_ids"], a["labels"], a["position_ids"], a["row_offsets"], a["seq_lens"], a["example_ids"], a["example_offsets"]
    )
    path = folder / shard_name(index)
    write_shard(path, table)
    if update_hash:
        data = json.loads((folder / "manifest.json").read_text())
        data["shards"][index]["sha256"] = file_sha256(path)
        if data.get("checksum"):
            data["checksum"] = manifest_checksum(data)
        (folder / "manifest.json").write_text(json.dumps(data))


def edit_manifest(folder: str | os.PathLike[str], edit) -> None:  # noqa: ANN001
    """Apply `edit(dict)` to manifest.json in place (for planting manifest defects)."""
    import json  # noqa: PLC0415

    path = Path(folder) / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
