"""The repository and the shared data the benchmarks read: the `../shared` folder (GSM8K,
CodeAlpaca, the Llama-2 tokenizer), its records, and one line naming what is missing when it is
absent. Importing it puts the repository on sys.path, so `pipeline` and `trainer` import from a
script run as `python3 scripts/<folder>/<name>.py` from anywhere."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GSM8K = Path("datasets") / "gsm8k" / "train.jsonl"
CODEALPACA = Path("datasets") / "codealpaca" / "code_alpaca.json"
LLAMA2 = Path("tokenizers") / "llama2"


def shared_dir() -> Path:
    """The shared data folder: `$SHARED`, else `.devcarry/shared` where it exists (the GPU box),
    else `../shared` beside the repository."""
    if os.environ.get("SHARED"):
        return Path(os.environ["SHARED"])
    carried = REPO / ".devcarry" / "shared"
    return carried if carried.is_dir() else REPO.parent / "shared"


def require(*paths: Path) -> None:
    """Exit with one line naming the first of `paths` that is missing."""
    for path in paths:
        if not path.exists():
            raise SystemExit(
                f"missing {path}: this benchmark needs the shared data; set SHARED= "
                "(or --shared) to the folder that holds datasets/ and tokenizers/"
            )


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON Lines file (`.jsonl`) or of a file holding one JSON array."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    return json.loads(path.read_text(encoding="utf-8"))


def load_source_examples(shared: Path, limit: int | None = None) -> list[dict[str, str]]:
    """GSM8K then CodeAlpaca as instruction/input/output records (GSM8K: question -> instruction,
    answer -> output), each cut to its first `limit` examples. One record layout for both, because
    pack-data detects one format per run; it renders them with its Alpaca template."""
    gsm, alpaca = shared / GSM8K, shared / CODEALPACA
    require(gsm, alpaca)
    out = [{"instruction": r["question"], "input": "", "output": r["answer"]} for r in read_records(gsm)[:limit]]
    out += [{"instruction": r["instruction"], "input": r.get("input") or "", "output": r["output"]} for r in read_records(alpaca)[:limit]]
    return out


def seeded_order(records: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    """The fixed, seeded example order every path uses (mixes the two datasets)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    return [records[i] for i in order]
