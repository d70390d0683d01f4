"""`pack-data --dedup` (Axolotl's dataset_exact_deduplication): the examples whose tokens and labels
equal an earlier example's are dropped, the first kept, counted in the manifest and the summary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cli import pack_data, pack_verify
from pipeline.plan.dedup import drop_duplicates
from pipeline.plan.rows import Pieces
from pipeline.shards import Counts, iter_rows, read_manifest

TOKENIZER = str(Path(__file__).resolve().parents[2] / "data" / "tokenizer")


class FakeSpill:
    """A spill of given examples: `read_pieces` returns their ids and labels concatenated."""

    def __init__(self, ids: list[list[int]], labels: list[list[int]]):
        self.ids, self.labels = np.concatenate(ids).astype(np.int32), np.concatenate(labels).astype(np.int32)

    def read_pieces(self, starts, lengths, out=None):
        take = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
        return self.ids[take], self.labels[take]


def pieces_of(ids: list[list[int]]) -> Pieces:
    lens = np.array([len(x) for x in ids], dtype=np.int64)
    counts = Counts(examples_read=len(ids), examples_packed=len(ids))
    return Pieces(np.arange(len(ids), dtype=np.int64), np.cumsum(lens) - lens, lens, counts)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4), st.booleans()), min_size=1, max_size=30))
def test_exactly_the_later_copies_go(spec):
    """Property: an example is dropped exactly when an earlier one has the same ids AND labels (same
    ids with other labels stay: a different example to train); the first of equal ones is kept, in
    input order, and the count says how many went."""
    ids = [[7 + v] * n for v, n, _ in spec]
    labels = [[-100] + row[1:] if masked else list(row) for row, (_, _, masked) in zip(ids, spec)]
    out = drop_duplicates(FakeSpill(ids, labels), pieces_of(ids))
    seen, want = set(), []
    for i, (row, lab) in enumerate(zip(ids, labels)):
        key = (tuple(row), tuple(lab))
        if key not in seen:
            seen.add(key)
            want.append(i)
    assert out.example_ids.tolist() == want
    assert out.counts.duplicates == len(ids) - len(want) and out.counts.examples_packed == len(want)


def test_windows_of_pieces_give_the_same_answer(monkeypatch):
    """Read a window of pieces at a time (here one token: every piece alone) or all at once: the
    same pieces stay, the first of each."""
    rng = np.random.default_rng(0)
    base = [rng.integers(3, 50, size=int(n)).tolist() for n in rng.integers(1, 9, size=12)]
    ids = base + base[:5] + [base[0][:-1] or [3]]
    whole = drop_duplicates(FakeSpill(ids, ids), pieces_of(ids))
    monkeypatch.setattr("pipeline.plan.dedup.WINDOW_TOKENS", 1)
    assert drop_duplicates(FakeSpill(ids, ids), pieces_of(ids)).example_ids.tolist() == whole.example_ids.tolist()
    firsts = [i for i, row in enumerate(ids) if row not in ids[:i]]
    assert whole.example_ids.tolist() == firsts and whole.counts.duplicates >= 5


def _pack(*args: object):
    return CliRunner().invoke(pack_data, [*map(str, args), "--no-progress", "--num-proc", "1"])


def test_pack_data_dedup_drops_counts_says_and_verifies(tmp_path: Path):
    """End to end: a file holding every record twice packs each once with --dedup (the examples the
    first copies gave), the manifest counts the copies, the summary says them, pack-verify --deep
    passes; without --dedup every copy is packed (control). --dedup with --overlong split is refused
    in one line; Axolotl's dataset_exact_deduplication maps to it."""
    rows = [{"text": f"record number {i} " * (1 + i % 4)} for i in range(20)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows + rows) + "\n")
    result = _pack(data, "--tokenizer", TOKENIZER, "--max-len", 256, "--out", tmp_path / "p", "--dedup")
    assert result.exit_code == 0, result.output
    manifest = read_manifest(tmp_path / "p")
    assert (manifest.counts.duplicates, manifest.counts.examples_packed) == (20, 20)
    assert "20 duplicates dropped (--dedup)" in result.output
    kept = sorted(int(e) for row in iter_rows(tmp_path / "p") for e in row["example_ids"])
    assert kept == list(range(20))
    assert CliRunner().invoke(pack_verify, [str(tmp_path / "p"), "--deep"]).exit_code == 0
    plain = _pack(data, "--tokenizer", TOKENIZER, "--max-len", 256, "--out", tmp_path / "q")
    assert plain.exit_code == 0 and read_manifest(tmp_path / "q").counts.examples_packed == 40
    refused = _pack(data, "--tokenizer", TOKENIZER, "--max-len", 256, "--out", tmp_path / "r", "--dedup", "--overlong", "split")
    assert refused.exit_code != 0 and "--dedup" in refused.output and "--overlong split" in refused.output
    assert not (tmp_path / "r").exists()
    cfg = tmp_path / "a.yaml"
    cfg.write_text("base_model: m\ndataset_exact_deduplication: true\n")
    from pipeline.config_file import read_config_file

    assert read_config_file(cfg, pack_data, foreign="pack-data")["dedup"] is True
