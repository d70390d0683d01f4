"""pack-data at --max-len 1048576: rows of a million tokens, shards of several such rows, positions
and boundaries per example, the report and pack-verify; an example that fits a row is never cut."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cli import pack_data, pack_report, pack_verify
from pipeline.plan.binpack import MAX_LEN_LIMIT
from pipeline.plan.rows import OVERLONG, apply_overlong, plan_rows
from pipeline.report.report_render import length_bins
from pipeline.shards import IGNORE_INDEX, MAX_SHARD_TOKENS, iter_rows, read_manifest
from pipeline.tokenize.spill import Spill

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "data" / "tokenizer")
MAX_LEN = 1 << 20  # 1,048,576
# one example exactly a row, one just under it, several past 131,072, and short ones
LENGTHS = [MAX_LEN, MAX_LEN - 576, 300_000, 140_000, 131_073, 70_000, 5_000, 3]


def run(command, *args: object):
    return CliRunner().invoke(command, [*map(str, args)], catch_exceptions=False)


def one_line_error(result) -> str:
    """The single `Error: ...` line of a refused command (no traceback)."""
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def token_ids(i: int, n: int) -> np.ndarray:
    """Example i's ids: distinct per example and position, inside the sample vocabulary (4096)."""
    return ((np.arange(n, dtype=np.int64) * 7 + i * 131) % 4000 + 10).astype(np.int32)


@pytest.fixture(scope="module")
def long_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("long") / "long.parquet"
    ids = pa.array([token_ids(i, n) for i, n in enumerate(LENGTHS)], type=pa.list_(pa.int32()))
    pq.write_table(pa.table({"input_ids": ids}), path)
    return path


@pytest.fixture(scope="module")
def long_out(long_input: Path) -> Path:
    out = long_input.parent / "packed"
    result = run(
        pack_data, long_input, "--tokenizer", TOKENIZER, "--max-len", MAX_LEN, "--rows-per-shard", 2, "--out", out, "--no-progress"
    )
    assert result.exit_code == 0, result.output
    return out


def test_million_token_rows_keep_every_example_whole(long_out: Path):
    manifest = read_manifest(long_out)
    c = manifest.counts
    assert (c.examples_read, c.examples_packed, c.truncated, c.split, c.dropped) == (len(LENGTHS), len(LENGTHS), 0, 0, 0)
    assert manifest.max_len == MAX_LEN and manifest.total_tokens == sum(LENGTHS)
    assert manifest.config["rows_per_shard"] == 2 and len(manifest.shards) >= 2  # shards of several 1M-token rows
    assert max(s.tokens for s in manifest.shards) > MAX_LEN
    seen: dict[int, int] = {}
    for row in iter_rows(long_out):
        assert len(row["input_ids"]) == int(row["seq_lens"].sum()) <= MAX_LEN
        start = 0
        for n, eid in zip(row["seq_lens"].tolist(), row["example_ids"].tolist()):
            ids, labels, pos = (row[k][start : start + n] for k in ("input_ids", "labels", "position_ids"))
            np.testing.assert_array_equal(ids, token_ids(eid, LENGTHS[eid]))  # whole, uncut, in order
            np.testing.assert_array_equal(pos, np.arange(n))  # positions restart at every boundary
            assert pos.dtype == np.int32 and labels[0] == IGNORE_INDEX
            np.testing.assert_array_equal(labels[1:], ids[1:])
            seen[eid] = seen.get(eid, 0) + 1
            start += n
    assert seen == {i: 1 for i in range(len(LENGTHS))}
    # the example of exactly max_len fills a row alone; the one 576 tokens short takes the 3-token one
    rows = {tuple(r["example_ids"].tolist()) for r in iter_rows(long_out)}
    assert (0,) in rows and any(1 in r and 7 in r for r in rows)


def test_verify_and_report_at_a_million_tokens(long_out: Path, tmp_path: Path):
    verified = run(pack_verify, long_out)
    assert verified.exit_code == 0, verified.output
    assert f"ok: {read_manifest(long_out).rows} rows, {sum(LENGTHS)} tokens" in verified.output
    result = run(pack_report, long_out, "--json", tmp_path / "r.json", "--html", tmp_path / "r.html", "--strategy", "ffd")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["max_len"] == MAX_LEN and report["tokens"] == sum(LENGTHS)
    assert report["lengths"]["max"] == MAX_LEN and report["lengths"]["min"] == 3
    assert report["counts"]["truncated"] == 0 and all(report["manifest_matches"].values())
    assert report["rows"] == report["lower_bound_rows"] == -(-sum(LENGTHS) // MAX_LEN)
    pad = next(r for r in report["comparison"] if r["layout"] == "pad-to-max")
    assert pad["attention_pairs"] == len(LENGTHS) * MAX_LEN * (MAX_LEN + 1) // 2  # no overflow at 1M
    page = (tmp_path / "r.html").read_text()
    assert "max_len 1,048,576" in page and page.count("<img") == 4  # three distributions and the comparison


def test_length_histogram_spans_a_million_tokens():
    bins = length_bins(np.asarray(LENGTHS), MAX_LEN)
    assert bins[0] == pytest.approx(3) and bins[-1] >= MAX_LEN and np.all(np.diff(bins) > 0)
    counts, _ = np.histogram(LENGTHS, bins=bins)
    assert counts.sum() == len(LENGTHS)  # the example of exactly max_len lands in a bin
    one = length_bins(np.asarray([MAX_LEN]), MAX_LEN)  # a single example of max_len: a bin around it
    assert np.histogram([MAX_LEN], bins=one)[0].sum() == 1


def test_attention_pairs_of_many_million_token_rows_read_in_peta():
    from pipeline.report.report_render import _n

    assert _n(10_000 * MAX_LEN * (MAX_LEN + 1) // 2) == "5.50P" and _n(4.4e12) == "4.40T"


def test_whatif_at_a_million_tokens(long_input: Path, tmp_path: Path):
    result = run(
        pack_report,
        "--input",
        long_input,
        "--tokenizer",
        TOKENIZER,
        "--max-len",
        f"131072,{MAX_LEN}",
        "--strategy",
        "ffd",
        "--json",
        tmp_path / "w.json",
    )
    assert result.exit_code == 0, result.output
    runs = {r["max_len"]: r for r in json.loads((tmp_path / "w.json").read_text())["runs"]}
    assert runs[MAX_LEN]["over_max_len"] == 0 and runs[MAX_LEN]["tokens"] == sum(LENGTHS)
    assert runs[131072]["over_max_len"] == 5  # 1M, 1M - 576, 300k, 140k and 131,073


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--max-len", MAX_LEN_LIMIT + 1], f"--max-len must be between 2 and {MAX_LEN_LIMIT}, got {MAX_LEN_LIMIT + 1}"),
        (
            ["--max-len", MAX_LEN, "--rows-per-shard", 4096],
            f"--rows-per-shard 4096 at --max-len {MAX_LEN} lets one shard hold up to 4,294,967,296 tokens, more than "
            f"the {MAX_SHARD_TOKENS:,} its int32 list offsets address: use --rows-per-shard 2047 or fewer",
        ),
    ],
)
def test_lengths_beyond_what_shards_hold_are_refused_in_one_line(long_input: Path, tmp_path: Path, args, needle):
    out = tmp_path / "out"
    result = CliRunner().invoke(pack_data, [str(long_input), "--tokenizer", TOKENIZER, "--out", str(out), "--no-progress", *map(str, args)])
    assert needle in one_line_error(result)
    assert not out.exists()


def test_whatif_refuses_a_max_len_beyond_the_planner(long_input: Path):
    result = CliRunner().invoke(pack_report, ["--input", str(long_input), "--max-len", f"4096,{MAX_LEN_LIMIT + 1}"])
    assert f"--max-len must be between 2 and {MAX_LEN_LIMIT}, got {MAX_LEN_LIMIT + 1}" in one_line_error(result)


# ------------------------------------------------------------------- never cut what fits a row


@st.composite
def long_problems(draw):
    """(lengths, max_len): max_len up to 1,048,576, lengths around it (some exactly it, some past it)."""
    max_len = draw(st.sampled_from([2, 4096, 131_072, MAX_LEN - 1, MAX_LEN]) | st.integers(2, MAX_LEN))
    near = st.integers(max(1, max_len - 3), max_len + 3)
    lengths = draw(st.lists(st.integers(1, max_len + 5) | near | st.just(max_len), min_size=1, max_size=24))
    return np.asarray(lengths, dtype=np.int64), max_len


@settings(max_examples=60, deadline=None)
@given(
    long_problems(),
    st.sampled_from([p for p in OVERLONG if p != "error"]),
    st.sampled_from(["ffd", "bfd", "shuffle", "sequential", "minibatch", "pad"]),
    st.integers(0, 1000),
)
def test_an_example_that_fits_a_row_is_never_cut(problem, policy: str, strategy: str, seed: int):
    lengths, max_len = problem
    spill = Spill(
        ids_path=Path("unused"),
        labels_path=None,
        lengths=lengths,
        example_ids=np.arange(len(lengths), dtype=np.int64),
        examples_read=len(lengths),
    )
    pieces = apply_overlong(spill, max_len, policy)
    plan = plan_rows(pieces, max_len, strategy, seed, 4) if len(pieces.lengths) else None
    offsets = spill.offsets
    for i, n in enumerate(lengths.tolist()):
        mine = np.flatnonzero(pieces.example_ids == i)
        if n <= max_len:  # one piece, the whole example
            assert len(mine) == 1 and pieces.lengths[mine[0]] == n and pieces.starts[mine[0]] == offsets[i]
        elif policy == "truncate":
            assert len(mine) == 1 and pieces.lengths[mine[0]] == max_len
        elif policy == "split":
            assert pieces.lengths[mine].sum() == n and pieces.lengths[mine].max() <= max_len
        else:  # drop
            assert len(mine) == 0
    if plan is not None:
        row_tokens = np.add.reduceat(plan.lengths, plan.row_pieces[:-1])
        assert row_tokens.max() <= max_len and plan.row_pieces[-1] == len(pieces.lengths)


def test_a_shard_past_int32_offsets_is_never_written_wrapped():
    from pipeline.shards import rows_table

    tiny = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="beyond its int32 list offsets"):
        rows_table(tiny, tiny, tiny, np.asarray([0, MAX_SHARD_TOKENS + 1]), tiny[:1], np.zeros(1, np.int64), np.asarray([0, 1]))
