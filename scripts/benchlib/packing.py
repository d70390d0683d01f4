"""pack-data jobs (the seeded GSM8K + CodeAlpaca JSONL packed once per strategy) and the packed
folders they write, read back as groups, examples and steps; a packed folder of long rows of random
ids written directly (`write_long_folder`: one example a row, for the long-context benchmarks)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .output import write_jsonl, write_text_output
from .shared import LLAMA2, load_source_examples, seeded_order

if TYPE_CHECKING:
    import numpy as np


PREP_STRATEGIES = ("pad", "minibatch", "ffd")


def pack_data_args(
    inputs: Sequence[Path],
    out: Path,
    *,
    tokenizer: Path,
    max_len: int,
    strategy: str,
    seed: int,
    num_proc: int = 1,
) -> list[str]:
    """The `pack-data` command-line arguments for one strategy."""
    return [
        *map(str, inputs),
        "--tokenizer", str(tokenizer), "--max-len", str(max_len), "--out", str(out),
        "--strategy", strategy, "--seed", str(seed), "--overwrite", "--no-progress",
        "--num-proc", str(num_proc),
    ]  # fmt: skip


@dataclass
class PackJob:
    """One pack-data run: `inputs` -> `out` with `strategy`; skipped when `stamp` matches."""

    inputs: list[Path]
    out: Path
    strategy: str
    stamp: dict[str, Any]
    max_len: int | None = None  # None: run_pack_jobs' max_len


def run_pack_jobs(jobs: Sequence[PackJob], *, tokenizer: Path, max_len: int, seed: int, num_proc: int = 1) -> None:
    """Run `pack-data` (its click command, in this process: one import of transformers for all)
    for the jobs whose output is missing or stale."""
    import click

    from pipeline.cli import pack_data

    for job in jobs:
        stamp_file = job.out.parent / f"{job.out.name}.stamp.json"
        if (job.out / "manifest.json").is_file() and stamp_file.is_file() and json.loads(stamp_file.read_text()) == job.stamp:
            print(f"  reusing {job.out}")
            continue
        job_len = job.max_len or max_len
        args = pack_data_args(
            job.inputs, job.out, tokenizer=tokenizer, max_len=job_len, strategy=job.strategy, seed=seed, num_proc=num_proc
        )
        t0 = time.perf_counter()
        try:
            pack_data.main(args=args, standalone_mode=False)
        except click.ClickException as exc:
            raise SystemExit(f"pack-data {' '.join(args)} failed: {exc.format_message()}") from None
        write_text_output(stamp_file, json.dumps(job.stamp), "--workdir")
        print(f"  pack-data --strategy {job.strategy} --max-len {job_len} -> {job.out.name}: {time.perf_counter() - t0:.1f} s")


def prepare_data(
    workdir: Path,
    shared: Path,
    *,
    limit: int | None,
    seed: int,
    max_len: int,
    strategies: Sequence[str] = PREP_STRATEGIES,
    tokenizer: Path | None = None,
    num_proc: int = 1,
) -> dict[str, Path]:
    """Write GSM8K + CodeAlpaca as one seeded instruction/input/output JSONL and pack it once per
    strategy; returns the folders by strategy."""
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or shared / LLAMA2
    stamp = {"limit": limit, "seed": seed, "max_len": max_len, "tokenizer": str(tokenizer), "shared": str(shared.resolve())}
    inputs = workdir / "examples.jsonl"
    input_stamp = workdir / "examples.stamp.json"
    if not (inputs.is_file() and input_stamp.is_file() and json.loads(input_stamp.read_text()) == stamp):
        write_jsonl(inputs, seeded_order(load_source_examples(shared, limit), seed))
        write_text_output(input_stamp, json.dumps(stamp), "--workdir")
    jobs = [PackJob([inputs], workdir / s, s, {**stamp, "strategy": s}) for s in strategies]
    run_pack_jobs(jobs, tokenizer=tokenizer, max_len=max_len, seed=seed, num_proc=num_proc)
    return {job.strategy: job.out for job in jobs}


def tokenizer_ids(folder: Path) -> tuple[int, int]:
    """(vocab size, padding id) of a packed folder's tokenizer; Llama-2 has no pad token, so EOS
    pads (padded positions carry no loss)."""
    from pipeline.shards import read_manifest

    tok = read_manifest(folder).tokenizer
    pad_id = tok.get("pad_token_id")
    pad_id = int(pad_id if pad_id is not None else tok.get("eos_token_id") or 0)
    return int(tok.get("vocab_size") or 32000), pad_id


# ----------------------------------------------------------------------------- packed folders


def minibatch_groups(folder: Path, group_size: int = 32) -> list[list[dict[str, np.ndarray]]]:
    """The rows of a `minibatch` folder cut back into their groups (rows never mix groups, and every
    group but the last holds exactly `group_size` examples)."""
    from pipeline.shards import iter_rows

    groups: list[list[dict[str, np.ndarray]]] = []
    current: list[dict[str, np.ndarray]] = []
    seen: set[int] = set()
    for row in iter_rows(folder):
        current.append(row)
        seen.update(int(e) for e in row["example_ids"])
        if len(seen) >= group_size:
            if len(seen) > group_size:
                raise ValueError(
                    f"{folder}: a group holds {len(seen)} > {group_size} examples: "
                    "was it packed with --strategy minibatch and this group size?"
                )
            groups.append(current)
            current, seen = [], set()
    if current:
        groups.append(current)
    return groups


def group_example_ids(group: Sequence[dict[str, np.ndarray]]) -> list[int]:
    """Example ids of a group in first-seen order (a split example counted once)."""
    import numpy as np

    ids = np.concatenate([r["example_ids"] for r in group]).tolist()
    return list(dict.fromkeys(int(i) for i in ids))


def examples_by_id(pad_folder: Path) -> dict[int, dict[str, np.ndarray]]:
    """input_ids + labels of every example of a `pad` folder (one example per row), by example id."""
    from pipeline.shards import iter_rows

    out: dict[int, dict[str, np.ndarray]] = {}
    for row in iter_rows(pad_folder):
        if len(row["seq_lens"]) != 1:
            raise ValueError(f"{pad_folder}: a row holds {len(row['seq_lens'])} examples; expected --strategy pad (one example per row)")
        out[int(row["example_ids"][0])] = {"input_ids": row["input_ids"], "labels": row["labels"]}
    return out


def ffd_steps(folder: Path, tokens_per_step: int) -> list[list[dict[str, np.ndarray]]]:
    """Rows of a packed folder in stored order, cut greedily into steps of <= tokens_per_step
    (the trainer's own cut, `trainer.data.stream.greedy_cuts`)."""
    import numpy as np

    from pipeline.shards import iter_rows
    from trainer.data.stream import greedy_cuts

    rows = list(iter_rows(folder))
    lengths = np.array([len(r["input_ids"]) for r in rows], dtype=np.int64)
    cuts = greedy_cuts(lengths, tokens_per_step)
    return [rows[a:b] for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist())]


def write_long_folder(folder: Path, length: int, rows: int, seed: int = 0, vocab: int = 32000, record_vocab: bool = False) -> None:
    """A packed folder of `rows` rows, each one example of `length` tokens (ids below `vocab`). With
    `record_vocab` the manifest names `vocab` as the tokenizer's size, which pack-train then gives the
    model; without, a preset keeps its own vocabulary (the 8B's 128,256)."""
    import numpy as np

    from pipeline.shards import IGNORE_INDEX, Counts, Manifest, ShardInfo, file_sha256, rows_table, shard_name, write_manifest, write_shard

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=rows * length, dtype=np.int64)
    labels = ids.copy()
    labels[::length] = IGNORE_INDEX
    positions = np.tile(np.arange(length, dtype=np.int64), rows)
    table = rows_table(
        ids,
        labels,
        positions,
        np.arange(rows + 1, dtype=np.int64) * length,
        np.full(rows, length, dtype=np.int64),
        np.arange(rows, dtype=np.int64),
        np.arange(rows + 1, dtype=np.int64),
    )
    name = shard_name(0)
    write_shard(folder / name, table)
    manifest = Manifest(
        max_len=length,
        strategy="ffd",
        seed=seed,
        rows=rows,
        total_tokens=rows * length,
        loss_tokens=rows * (length - 1),
        efficiency=1.0,
        counts=Counts(examples_read=rows, examples_packed=rows),
        shards=[ShardInfo(file=name, rows=rows, tokens=rows * length, sha256=file_sha256(folder / name))],
        tokenizer={"name": f"random ids below {vocab}", "fingerprint": "0" * 64, **({"vocab_size": vocab} if record_vocab else {})},
        config={"max_len": length, "strategy": "ffd", "seed": seed},
    )
    write_manifest(folder, manifest)
