"""`pack-data --min-len N` (Axolotl's min_sample_len): exactly the examples of fewer than N tokens
(their whole tokenized length, before --overlong) are dropped, and said: the manifest's
counts.too_short, the end-of-run summary, pack-report; pack-verify accepts the folder. An Axolotl
file drops what Axolotl drops, with the key and without it (Axolotl's default 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import pack_data, pack_report, pack_verify
from pipeline.config_file import read_config_file
from pipeline.plan.rows import OVERLONG, apply_overlong
from pipeline.shards import iter_rows, read_manifest, verify_folder
from pipeline.tokenize.spill import Spill

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "data" / "tokenizer")
LENGTHS = [1, 2, 5, 3, 12, 4, 1, 9]  # the examples' tokens, against --max-len 8


def _spill(lengths: list[int]) -> Spill:
    return Spill(Path("ids"), None, np.array(lengths, np.int64), np.arange(len(lengths), dtype=np.int64), examples_read=len(lengths))


@pytest.mark.parametrize("policy", [p for p in OVERLONG if p != "error"])
def test_exactly_the_short_examples_go_whatever_the_overlong_policy(policy: str):
    """Random lengths and minimums: the examples kept are those of at least min_len tokens (and,
    with drop, at most max_len), too_short counts the others; min_len 1 drops none (control)."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(1, 30, size=int(rng.integers(1, 40))).tolist()
        min_len, max_len = int(rng.integers(1, 12)), int(rng.integers(4, 20))
        pieces = apply_overlong(_spill(lengths), max_len, policy, min_len)
        want = [i for i, n in enumerate(lengths) if n >= min_len and (policy != "drop" or n <= max_len)]
        assert sorted(set(pieces.example_ids.tolist())) == want
        assert pieces.counts.too_short == sum(n < min_len for n in lengths)
        assert pieces.counts.dropped == (sum(min_len <= n and n > max_len for n in lengths) if policy == "drop" else 0)
        assert pieces.counts.examples_packed == len(want)
        control = apply_overlong(_spill(lengths), max_len, policy)
        assert control.counts.too_short == 0 and len(set(control.example_ids.tolist())) == len(
            [n for n in lengths if policy != "drop" or n <= max_len]
        )


def _pretokenized(tmp_path: Path) -> Path:
    path = tmp_path / "tok.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(10, 10 + n))}) + "\n" for n in LENGTHS))
    return path


def _pack(*args: object) -> object:
    return CliRunner().invoke(pack_data, [*map(str, args), "--no-progress", "--num-proc", "1"])


def test_the_short_ones_are_dropped_counted_and_said(tmp_path: Path):
    data = _pretokenized(tmp_path)
    result = _pack(data, "--tokenizer", TOKENIZER, "--max-len", 8, "--out", tmp_path / "o", "--min-len", 3)
    assert result.exit_code == 0, result.output
    manifest = verify_folder(tmp_path / "o")
    assert _lengths(tmp_path / "o") == {i: min(n, 8) for i, n in enumerate(LENGTHS) if n >= 3}  # 12, 9 truncated
    c = manifest.counts
    assert (c.examples_read, c.examples_packed, c.too_short, c.truncated) == (8, 5, 3, 2)
    assert "3 shorter than --min-len 3 dropped" in result.output
    assert manifest.config["min_len"] == 3
    verified = CliRunner().invoke(pack_verify, [str(tmp_path / "o"), "--deep"])
    assert verified.exit_code == 0, verified.output
    report = CliRunner().invoke(pack_report, [str(tmp_path / "o")])
    assert report.exit_code == 0 and "shorter than --min-len 3" in report.output, report.output
    # control: without --min-len every example is packed, and nothing is said of a minimum
    result = _pack(data, "--tokenizer", TOKENIZER, "--max-len", 8, "--out", tmp_path / "all")
    assert result.exit_code == 0 and "shorter than --min-len" not in result.output, result.output
    assert read_manifest(tmp_path / "all").counts.too_short == 0
    assert read_manifest(tmp_path / "all").counts.examples_packed == len(LENGTHS)


def _lengths(folder: Path) -> dict[int, int]:
    """example id -> its packed tokens, read back from the shards."""
    return {int(e): int(n) for row in iter_rows(folder) for n, e in zip(row["seq_lens"], row["example_ids"])}


def test_held_out_examples_come_from_the_kept_ones(tmp_path: Path):
    """--eval-examples holds out examples among those --min-len keeps: the two folders hold the
    kept examples between them, each once; the short ones are counted in the training folder."""
    result = _pack(
        _pretokenized(tmp_path), "--tokenizer", TOKENIZER, "--max-len", 16, "--out", tmp_path / "o", "--min-len", 3, "--eval-examples", 2
    )
    assert result.exit_code == 0, result.output
    train, held = _lengths(tmp_path / "o"), _lengths(tmp_path / "o" / "eval")
    assert len(held) == 2 and not train.keys() & held.keys()
    assert {**train, **held} == {i: n for i, n in enumerate(LENGTHS) if n >= 3}
    assert read_manifest(tmp_path / "o").counts.too_short == 3
    assert verify_folder(tmp_path / "o" / "eval") and verify_folder(tmp_path / "o")


def test_every_example_short_is_one_line(tmp_path: Path):
    result = _pack(_pretokenized(tmp_path), "--tokenizer", TOKENIZER, "--max-len", 8, "--out", tmp_path / "o", "--min-len", 100)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and "Traceback" not in result.output, result.output
    assert "8 shorter than --min-len 100" in lines[0] and not (tmp_path / "o").exists()


TEXTS = ["a", "a b", "the cat sat on the mat", "one two three", "x", "a much longer line of plain text here", "hi"]


def _axolotl(tmp_path: Path, **keys: object) -> Path:
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    cfg = tmp_path / "axolotl.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "base_model": "tiny",
                "tokenizer_config": TOKENIZER,
                "sequence_len": 64,
                "datasets": [{"path": str(data), "type": "completion"}],
                **keys,
            }
        )
    )
    return cfg


@pytest.mark.parametrize(
    ("keys", "min_len"),
    [
        ({}, 2),
        ({"min_sample_len": None}, 2),
        ({"min_sample_len": 0}, 2),  # Axolotl: `min_sample_len or 2`
        ({"min_sample_len": 4}, 4),
        ({"min_sample_len": 1}, 1),
        ({"min_sample_len": -3}, 1),
    ],
)
def test_an_axolotl_files_min_sample_len_is_min_len(tmp_path: Path, keys: dict, min_len: int):
    assert read_config_file(_axolotl(tmp_path, **keys), pack_data, foreign="pack-data")["min_len"] == min_len


def test_an_axolotl_file_packs_what_axolotl_keeps_with_the_key_and_without(tmp_path: Path):
    """The lengths come from a run that keeps every example (min_sample_len 1); a minimum between
    them drops exactly the shorter ones; without the key, Axolotl's 2 (said in the summary)."""
    result = _pack("--config", _axolotl(tmp_path, min_sample_len=1), "--out", tmp_path / "all")
    assert result.exit_code == 0 and "shorter than --min-len" not in result.output, result.output
    every = _lengths(tmp_path / "all")
    assert len(every) == len(TEXTS)
    cut = sorted(every.values())[len(TEXTS) // 2]
    for keys, least in (({"min_sample_len": cut}, cut), ({}, 2)):
        out = tmp_path / f"o{least}"
        result = _pack("--config", _axolotl(tmp_path, **keys), "--out", out)
        assert result.exit_code == 0, result.output
        assert _lengths(out) == {i: n for i, n in every.items() if n >= least}
        short = sum(n < least for n in every.values())
        assert read_manifest(out).counts.too_short == short
        assert f"{short} shorter than --min-len {least} dropped" in result.output
    assert 0 < sum(n < cut for n in every.values()) < len(TEXTS)  # the minimum dropped some, not all


def test_a_min_sample_len_that_is_not_a_number_is_one_line(tmp_path: Path):
    result = _pack("--config", _axolotl(tmp_path, min_sample_len="long"), "--out", tmp_path / "o")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and "min_sample_len" in lines[0], result.output
