"""pipeline.plan.mix and `pack-data --mix`: uses per example, ids unique per use, the same shards for
any --num-proc, per-input records in the manifest and pack-report, one line for bad weights."""

from __future__ import annotations

import doctest
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cli import pack_data, pack_report, pack_verify
from pipeline.engines.job import PackConfig, run_pack_data
from pipeline.errors import UserError
from pipeline.plan import mix
from pipeline.plan.rows import Pieces
from pipeline.report.deep_check import deep_check
from pipeline.shards import iter_rows

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = str(ROOT / "data" / "tokenizer")


def test_docstring_example():
    assert doctest.testmod(mix).failed == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=4), st.data())
def test_every_example_is_used_its_weight_in_times(counts, data):
    """floor(w) uses of every example, plus one more for a seeded round(frac * n) of them; the ids
    are unique per use and give back their source example; a split example's pieces go together."""
    n_files = len(counts)
    weights = data.draw(st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0, 0.25]), min_size=n_files, max_size=n_files))
    ids = np.repeat(np.arange(sum(counts)), data.draw(st.lists(st.integers(1, 3), min_size=sum(counts), max_size=sum(counts))) or [])
    pieces = Pieces(ids.astype(np.int64), np.arange(len(ids)) * 7, np.ones(len(ids), np.int64))
    try:
        mixed, records = mix.apply_mix(pieces, np.array(counts), weights, seed=3, names=[str(i) for i in range(n_files)])
    except UserError as exc:
        assert "leaves none" in str(exc)
        return
    n_read = sum(counts)
    bounds = np.cumsum([0, *counts])
    source = mixed.example_ids % n_read
    for j, (n, w) in enumerate(zip(counts, weights)):
        want = math.floor(w) * n + int(round((w - math.floor(w)) * n))
        assert records[j]["uses"] == want
        mine = (source >= bounds[j]) & (source < bounds[j + 1])
        assert len(np.unique(mixed.example_ids[mine])) == want
    for use in np.unique(mixed.example_ids):  # every piece of a used example, once
        src = use % n_read
        assert np.array_equal(np.sort(mixed.starts[mixed.example_ids == use]), pieces.starts[ids == src])
    again, _ = mix.apply_mix(pieces, np.array(counts), weights, seed=3, names=[str(i) for i in range(n_files)])
    assert np.array_equal(again.example_ids, mixed.example_ids)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("mix")
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": f"alpha {i} " * (1 + i % 7)}) + "\n" for i in range(40)))
    (folder / "b.jsonl").write_text("".join(json.dumps({"prompt": f"question {i}?", "response": f"answer {i}"}) + "\n" for i in range(30)))
    return folder


def _pack(inputs: Path, out: Path, mix_spec: str, num_proc: int = 1, **kw):
    return run_pack_data(
        PackConfig(
            inputs=[str(inputs / "a.jsonl"), str(inputs / "b.jsonl")],
            tokenizer=TOKENIZER,
            max_len=kw.pop("max_len", 128),
            out=str(out),
            mix=mix_spec,
            num_proc=num_proc,
            progress=False,
            **kw,
        )
    )


def _digest(folder: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.glob("shard-*.arrow")))).hexdigest()


def test_a_mixture_is_recorded_verified_and_the_same_for_any_num_proc(inputs: Path, tmp_path: Path):
    m = _pack(inputs, tmp_path / "one", "a.jsonl=2,b.jsonl=0.5")
    assert _digest(tmp_path / "one") == (_pack(inputs, tmp_path / "two", "a.jsonl=2,b.jsonl=0.5", num_proc=2) and _digest(tmp_path / "two"))
    assert [
        (s["input"].endswith(n), s["weight"], s["examples_read"], s["examples_used"], s["uses"])
        for s, n in zip(m.sources, ("a.jsonl", "b.jsonl"))
    ] == [(True, 2.0, 40, 40, 80), (True, 0.5, 30, 15, 15)]
    assert (m.counts.examples_read, m.counts.examples_packed, m.counts.passes) == (70, 95, 2)
    ids = np.concatenate([r["example_ids"] for r in iter_rows(tmp_path / "one")])
    assert len(ids) == len(np.unique(ids)) == 95
    assert set(ids[ids >= 70] - 70) == set(range(40))  # the second use of every example of a
    assert len({i for i in ids.tolist() if 40 <= i < 70}) == 15  # a seeded half of b
    assert deep_check(tmp_path / "one", m, None, sample=200) == 95  # every use re-tokenized from its source
    assert CliRunner().invoke(pack_verify, [str(tmp_path / "one")]).exit_code == 0


def test_without_a_mixture_every_input_is_recorded_with_weight_one(inputs: Path, tmp_path: Path):
    m = _pack(inputs, tmp_path / "plain", None)
    assert [(s["weight"], s["first_id"], s["uses"]) for s in m.sources] == [(1.0, 0, 40), (1.0, 40, 30)]
    assert m.counts.passes == 1 and m.counts.examples_packed == 70


def test_split_examples_and_a_mixture(inputs: Path, tmp_path: Path):
    m = _pack(inputs, tmp_path / "split", "a.jsonl=1.5", max_len=8, overlong="split")
    assert m.counts.split > 0 and m.counts.passes == 2
    assert deep_check(tmp_path / "split", m, None, sample=500) == m.counts.examples_packed


def test_pack_report_shows_and_writes_the_per_input_table(inputs: Path, tmp_path: Path):
    m = _pack(inputs, tmp_path / "r", "a.jsonl=2,b.jsonl=0.5")
    result = CliRunner().invoke(pack_report, [str(tmp_path / "r"), "--sources-csv", str(tmp_path / "s.csv")])
    assert result.exit_code == 0, result.output
    assert "sources" in result.output and "a.jsonl" in result.output
    import polars as pl

    table = pl.read_csv(tmp_path / "s.csv")
    assert table["uses"].to_list() == [80, 15]
    assert table["tokens"].sum() == m.total_tokens and table["loss_tokens"].sum() == m.loss_tokens
    assert table["share"].sum() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("c.jsonl=2", "--mix c.jsonl=2 matches no input"),
        ("a.jsonl=-1", "a weight must be a number above 0"),
        ("a.jsonl=0", "a weight must be a number above 0"),
        ("a.jsonl", "is not NAME=WEIGHT"),
        ("a.jsonl=x", "is not NAME=WEIGHT"),
        ("b.jsonl=0.001", "leaves none of its 30 examples"),
    ],
)
def test_bad_mixtures_are_one_line_and_no_output(inputs: Path, tmp_path: Path, spec: str, needle: str):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        pack_data,
        [
            str(inputs / "a.jsonl"),
            str(inputs / "b.jsonl"),
            "--tokenizer",
            TOKENIZER,
            "--max-len",
            "64",
            "--out",
            str(out),
            "--mix",
            spec,
            "--no-progress",
        ],
    )
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert not out.exists()


def test_the_folder_loads_as_one_polars_frame_as_documented(inputs: Path, tmp_path: Path):
    import polars as pl

    m = _pack(inputs, tmp_path / "p", None)
    frame = pl.concat([pl.read_ipc(p) for p in sorted(Path(tmp_path / "p").glob("shard-*.arrow"))])
    assert frame.height == m.rows and frame["input_ids"].list.len().sum() == m.total_tokens
    assert frame.columns == ["input_ids", "labels", "position_ids", "seq_lens", "example_ids"]
