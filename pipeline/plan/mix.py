"""Dataset mixtures: how many times each input's examples are used (`pack-data --mix`).

A weight is how many times each example of an input is used: 2 = every example twice, 0.5 = a
seeded half of them, 1.5 = every example once and a seeded half a second time; inputs without a
weight use 1. The k-th use of example i (k = 0, 1, ...) gets the example id `k * examples_read + i`,
so ids stay unique per use (`pack-verify --deep` re-tokenizes source example `id % examples_read`),
and the uses come in passes: every first use in input order, then every second use, and so on.

    >>> counts = np.array([4, 2])                 # examples read per input file
    >>> pieces = Pieces(np.arange(6), np.arange(6) * 10, np.full(6, 3))
    >>> mixed, sources = apply_mix(pieces, counts, [2.0, 0.5], seed=0, names=["a.jsonl", "b.jsonl"])
    >>> mixed.example_ids.tolist()                # a: 0-3 twice (second use +6), b: one of 4, 5
    [0, 1, 2, 3, 4, 6, 7, 8, 9]
    >>> [(s["input"], s["examples_used"], s["uses"]) for s in sources]
    [('a.jsonl', 4, 8), ('b.jsonl', 1, 1)]
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import UserError
from pipeline.plan.rows import Pieces
from pipeline.read.sources import resolve_inputs

# The most uses of one example: past it even a single example's uses take more than 48 TiB to plan
# (BYTES_PER_USE each), so a larger weight (1e308, say) is refused as it is parsed.
MAX_WEIGHT = 2.0**40


def parse_mix(text: str | None) -> dict[str, float]:
    """'a.jsonl=2,b.parquet=0.5' -> {"a.jsonl": 2.0, "b.parquet": 0.5}; a bad entry is one line."""
    if not text:
        return {}
    weights: dict[str, float] = {}
    for entry in (e.strip() for e in text.split(",")):
        name, eq, value = entry.rpartition("=")
        try:
            weight = float(value) if eq and name.strip() else None
        except ValueError:
            weight = None
        if weight is None:
            raise UserError(f"--mix entry {entry!r} is not NAME=WEIGHT: write e.g. --mix 'a.jsonl=2,b.parquet=0.5'")
        if not 0 < weight <= MAX_WEIGHT:  # also nan and inf
            raise UserError(
                f"--mix {name.strip()}={value}: a weight must be a number above 0 and at "
                f"most {MAX_WEIGHT:.0f} (how many times each of its examples is used; leave an input "
                "out to drop it)"
            )
        if name.strip() in weights:
            raise UserError(f"--mix names {name.strip()!r} twice: give each input one weight")
        weights[name.strip()] = weight
    return weights


def file_weights(weights: dict[str, float], inputs: list[str], files: list[Any]) -> list[float]:
    """The weight of every input file: a name matches the INPUT a file was given as (all the files of
    a folder or glob), or a file's path or file name. A name matching nothing is a UserError."""
    out = [1.0] * len(files)
    if not weights:
        return out
    given = {arg: {f.path for f in resolve_inputs([arg])} for arg in inputs}
    for name, weight in weights.items():
        hit = [j for j, f in enumerate(files) if f.path in given.get(name, ()) or name == f.path or name == Path(f.path).name]
        if not hit:
            raise UserError(
                f"--mix {name}={weight:g} matches no input: use an INPUT as given ({', '.join(inputs)}) or one of its files' names"
            )
        for j in hit:
            out[j] = weight
    return out


def apply_mix(
    pieces: Pieces, file_counts: np.ndarray, weights: list[float], seed: int, names: list[str]
) -> tuple[Pieces, list[dict[str, Any]]]:
    """The pieces of every use (see the module docstring) and one record per input file: its name,
    weight, examples read, distinct examples used and uses. Every piece of a split example goes
    with it. A weight that leaves an input with examples but no use is a UserError."""
    file_counts = np.asarray(file_counts, dtype=np.int64)
    bounds = np.concatenate(([0], np.cumsum(file_counts)))
    n_read = int(bounds[-1])
    ids = pieces.example_ids  # non-decreasing: input order, a split example's pieces side by side
    file_of = np.searchsorted(bounds, ids, side="right") - 1
    first = pieces.first_pieces()
    passes = max(math.ceil(w) for w in weights) if weights else 1
    _check_size(ids, file_of, first, weights, passes, names)
    copies = np.zeros((passes, len(ids)), dtype=bool)
    records = []
    for j, weight in enumerate(weights):
        mine = file_of == j
        present = ids[mine & first]
        whole, part = int(weight), weight - int(weight)
        chosen = np.zeros(0, np.int64)
        if part > 0:
            m = int(round(part * len(present)))
            chosen = np.sort(np.random.default_rng([seed, j]).permutation(present)[:m])
        copies[:whole, mine] = True
        if len(chosen):
            copies[whole, mine & np.isin(ids, chosen)] = True
        used = len(present) if whole else len(chosen)
        uses = whole * len(present) + len(chosen)
        if len(present) and uses == 0:
            raise UserError(
                f"--mix {names[j]}={weight:g} leaves none of its {len(present)} examples: "
                f"raise the weight to at least {1 / len(present):.3g} or leave the input out"
            )
        records.append(
            {
                "input": names[j],
                "weight": weight,
                "first_id": int(bounds[j]),
                "examples_read": int(file_counts[j]),
                "examples_used": used,
                "uses": uses,
            }
        )
    if all(w == 1 for w in weights):
        return pieces, records
    k, idx = np.nonzero(copies)  # row-major: pass by pass, pieces in input order inside a pass
    mixed = Pieces(ids[idx] + k.astype(np.int64) * n_read, pieces.starts[idx], pieces.lengths[idx], pieces.counts)
    mixed.counts.passes = passes
    starts = np.flatnonzero(first[idx])  # the ids stay non-decreasing: pass k holds ids k*n_read + i
    mixed.counts.examples_packed = len(starts)
    if mixed.counts.split:  # uses of split examples (each use's pieces share its id)
        mixed.counts.split = int((np.diff(np.append(starts, len(idx))) > 1).sum())
    return mixed, records


BYTES_PER_USE = 48  # planning memory per used piece: its id, start, length and the indices that pick it


def _check_size(ids: np.ndarray, file_of: np.ndarray, first: np.ndarray, weights: list[float], passes: int, names: list[str]) -> None:
    """Refuse, before allocating it, a mixture too large to plan in this machine's memory (half of
    what is available): `--mix a.jsonl=1e9` would repeat each example a billion times."""
    if not weights or max(weights) <= 1:
        return
    pieces = np.bincount(file_of, minlength=len(weights)).astype(np.float64)
    uses = float(np.dot(np.ceil(weights), pieces))
    need = passes * len(ids) + uses * BYTES_PER_USE
    free = available_memory()
    if need <= free / 2:
        return
    j = int(np.argmax(np.asarray(weights) * np.maximum(pieces, 1)))
    examples = int((first & (file_of == j)).sum())
    raise UserError(
        f"--mix {names[j]}={weights[j]:g} asks for {weights[j] * examples:.3g} uses of its {examples} "
        f"examples: planning them needs about {_gib(need)} of memory and {_gib(free)} is available: "
        "use a smaller weight (how many times each example is used)"
    )


def available_memory() -> float:
    """Bytes of memory available to a new allocation (MemAvailable on Linux, else all physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return math.inf


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n < 2**40 else f"{n / 2**40:.3g} TiB"
