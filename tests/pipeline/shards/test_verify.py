"""pack-verify: a good folder passes; each planted defect fails with one line naming it."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner
from packed_factory import edit_manifest, make_packed_folder, rewrite_shard, shard_arrays

import pipeline.shards.checks
from pipeline.cli import pack_verify
from pipeline.errors import ShardFormatError
from pipeline.shards import IGNORE_INDEX, summarize_shard, verify_folder

MAX_LEN = 10
# Example 4 is prompt-only (all labels masked); example 5 was split into two pieces (10 + 2).
ROWS = [
    [(0, [11, 12, 13, 14]), (1, [21, 22, 23, 24, 25])],
    [(2, list(range(31, 41)))],
    [(3, [41, 42, 43]), (4, [51, 52], [IGNORE_INDEX, IGNORE_INDEX]), (5, [71, 72])],
    [(5, list(range(61, 71)))],
]


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("good") / "packed"
    make_packed_folder(folder, ROWS, MAX_LEN, rows_per_shard=2)
    return folder


@pytest.fixture()
def bad(good: Path, tmp_path: Path) -> Path:
    """A fresh copy of the good folder to plant one defect in."""
    return Path(shutil.copytree(good, tmp_path / "bad"))


def run_cli(*args: str):  # noqa: ANN201
    return CliRunner().invoke(pack_verify, [str(a) for a in args])


def test_good_folder_passes(good: Path) -> None:
    manifest = verify_folder(good)
    assert (manifest.rows, manifest.total_tokens, len(manifest.shards)) == (4, 36, 2)
    assert manifest.counts.split == 1 and manifest.counts.examples_packed == 6
    result = run_cli(good)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "ok: 4 rows, 36 tokens, 2 shards verified"


def test_no_hash_skips_sha(bad: Path) -> None:
    edit_manifest(bad, lambda m: m["shards"][0].update(sha256="0" * 64))
    assert run_cli(bad).exit_code == 1
    result = run_cli(bad, "--no-hash")
    assert result.exit_code == 0 and "sha256 not checked" in result.output


def _tamper(folder: Path, shard: int, change) -> None:  # noqa: ANN001
    arrays = shard_arrays(folder / f"shard-{shard:05d}.arrow")
    change(arrays)
    rewrite_shard(folder, shard, arrays)


def _positions_continue(a: dict) -> None:
    a["position_ids"][4:9] = np.arange(4, 9)  # row 0 example 1 does not restart


def _label_at_start(a: dict) -> None:
    a["labels"][4] = a["input_ids"][4]  # row 0 example 1 token 0 is trained


def _label_shifted(a: dict) -> None:
    a["labels"][5:8] = a["input_ids"][6:9]  # shifted labels: neither -100 nor the input id


def _seq_lens_sum(a: dict) -> None:
    a["seq_lens"][1] = 4  # row 0: 4 + 4 != 9 tokens


def _seq_len_zero(a: dict) -> None:
    a["seq_lens"][0], a["seq_lens"][1] = 0, 9


def _duplicate_id(a: dict) -> None:
    a["example_ids"][1] = 0  # id 0 twice, id 1 gone


def _id_out_of_range(a: dict) -> None:
    a["example_ids"][2] = 99


def _negative_token(a: dict) -> None:
    a["input_ids"][2] = -5
    a["labels"][2] = -5


SHARD_DEFECTS = {
    "position": (0, _positions_continue, "shard-00000.arrow row 0 example 1 (id 1) token 0", "position_ids"),
    "label-start": (0, _label_at_start, "shard-00000.arrow row 0 example 1 (id 1) token 0", "label at an example start"),
    "label-shifted": (0, _label_shifted, "shard-00000.arrow row 0 example 1 (id 1) token 1", "neither -100 nor the input id"),
    "seq-sum": (0, _seq_lens_sum, "shard-00000.arrow row 0", "seq_lens sum to 8"),
    "seq-zero": (0, _seq_len_zero, "shard-00000.arrow row 0 example 0 (id 0)", "must be >= 1"),
    "dup-id": (0, _duplicate_id, "example id 0 appears 2 times", "duplicated example"),
    "id-range": (1, _id_out_of_range, "example id 99", "counts.examples_read 6"),
    "negative-token": (0, _negative_token, "shard-00000.arrow row 0 example 0 (id 0) token 2", "negative token id -5"),
}


@pytest.mark.parametrize("defect", sorted(SHARD_DEFECTS))
def test_shard_defect_is_named(bad: Path, defect: str) -> None:
    shard, change, where, what = SHARD_DEFECTS[defect]
    _tamper(bad, shard, change)
    result = run_cli(bad)
    assert result.exit_code == 1
    assert where in result.output and what in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_column_length_mismatch(bad: Path) -> None:
    # A labels column with its own, shorter offsets cannot come from rows_table; build it by hand.
    import pyarrow.ipc as ipc  # noqa: PLC0415

    from pipeline.shards import SCHEMA, file_sha256, open_shard  # noqa: PLC0415

    path = bad / "shard-00000.arrow"
    table = open_shard(path)
    labels = table.column("labels").to_pylist()
    labels[0] = labels[0][:-1]
    # Copy every column out of the memory map before the file is overwritten.
    cols = [pa.array(labels if n == "labels" else table.column(n).to_pylist(), SCHEMA.field(n).type) for n in SCHEMA.names]
    del table
    new = pa.Table.from_arrays(cols, schema=SCHEMA)
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, SCHEMA) as w:
        w.write_table(new)
    edit_manifest(bad, lambda m: m["shards"][0].update(sha256=file_sha256(path)))
    result = run_cli(bad)
    assert result.exit_code == 1
    assert "shard-00000.arrow row 0: labels has 8 entries but input_ids has 9" in result.output


def test_row_too_long(bad: Path) -> None:
    # The same shards against a smaller max_len (efficiency kept consistent).
    edit_manifest(bad, lambda m: m.update(max_len=9, efficiency=36 / (4 * 9)))
    result = run_cli(bad)
    assert result.exit_code == 1
    assert "shard-00000.arrow row 1: row too long: 10 tokens > max_len 9" in result.output


def test_wrong_sha(bad: Path) -> None:
    with open(bad / "shard-00001.arrow", "r+b") as fh:  # flip one byte of a token id
        data = bytearray(fh.read())
        i = data.find(bytes([41, 0, 0, 0]))
        data[i] = 42
        fh.seek(0)
        fh.write(data)
    result = run_cli(bad)
    assert result.exit_code == 1
    assert "shard-00001.arrow: sha256" in result.output and "does not match" in result.output


def test_missing_shard(bad: Path) -> None:
    (bad / "shard-00001.arrow").unlink()
    result = run_cli(bad)
    assert result.exit_code == 1
    assert "shard-00001.arrow: shard listed in the manifest is missing" in result.output


def test_stray_shard(bad: Path) -> None:
    shutil.copy(bad / "shard-00001.arrow", bad / "shard-00002.arrow")
    result = run_cli(bad)
    assert result.exit_code == 1
    assert "shard-00002.arrow: shard file not listed in the manifest" in result.output


def test_bad_schema(bad: Path) -> None:
    import pyarrow.ipc as ipc  # noqa: PLC0415

    from pipeline.shards import file_sha256  # noqa: PLC0415

    path = bad / "shard-00000.arrow"
    table = pa.table({"input_ids": pa.array([[1, 2]], pa.list_(pa.int64()))})
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    edit_manifest(bad, lambda m: m["shards"][0].update(sha256=file_sha256(path)))
    result = run_cli(bad)
    assert result.exit_code == 1
    assert "shard-00000.arrow: schema is" in result.output


def test_not_arrow(bad: Path) -> None:
    (bad / "shard-00000.arrow").write_bytes(b"not arrow at all")
    result = run_cli(bad, "--no-hash")
    assert result.exit_code == 1
    assert "shard-00000.arrow: not a readable Arrow IPC file" in result.output


MANIFEST_DEFECTS = {
    "version": (lambda m: m.update(format_version=99), "format_version 99 is not supported"),
    "format": (lambda m: m.update(format="other"), "format is 'other'"),
    "packed": (
        lambda m: m["counts"].update(examples_packed=5, examples_read=7),
        "counts.examples_packed is 5 but the shards hold 6 distinct example ids",
    ),
    "split": (lambda m: m["counts"].update(split=0), "ids repeat but counts.split is 0"),
    "loss": (lambda m: m.update(loss_tokens=20), "loss_tokens is 20 but the shards hold 28"),
    "rows": (lambda m: m.update(rows=5, efficiency=36 / 50), "rows is 5 but the shards hold 4"),
    "shard-entry": (
        lambda m: m["shards"][1].update(tokens=11),
        "shard-00001.arrow: has 2 rows / 17 tokens, manifest says 2 rows / 11 tokens",
    ),
    "efficiency": (lambda m: m.update(efficiency=0.5), "efficiency 0.5 != total_tokens"),
    "missing-field": (lambda m: m.pop("rows"), "missing field 'rows'"),
    "read<packed": (lambda m: m["counts"].update(examples_read=3), "counts.examples_packed 6 > counts.examples_read 3"),
}


# Figures no shard can prove, edited so that every other check still holds: the checksum catches them.
UNPROVABLE_EDITS = {
    "truncated": lambda m: m["counts"].update(truncated=3),
    "dropped": lambda m: m["counts"].update(dropped=2),
    "empty_skipped": lambda m: m["counts"].update(empty_skipped=1),
    "examples_read": lambda m: m["counts"].update(examples_read=7),
    "max_len+efficiency": lambda m: m.update(max_len=12, efficiency=round(36 / (4 * 12), 6)),
    "strategy": lambda m: m.update(strategy="bfd"),
    "tokenizer": lambda m: m["tokenizer"].update(name="another"),
}


@pytest.mark.parametrize("edit", sorted(UNPROVABLE_EDITS))
def test_a_manifest_figure_edited_after_packing_fails_its_checksum(bad: Path, edit: str) -> None:
    edit_manifest(bad, UNPROVABLE_EDITS[edit])
    result = run_cli(bad)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "manifest.json: its checksum does not match its contents" in lines[0], result.output
    assert "re-run pack-data" in lines[0]


def test_the_checksum_covers_content_not_layout(bad: Path) -> None:
    """Negative controls: the same manifest written without indentation passes; --no-hash skips the
    checksum as it skips the sha256s. A manifest edited with its checksum removed fails (it cannot be
    told from one that never had a checksum): one line, and --no-hash checks the structure alone."""
    edit_manifest(bad, lambda m: None)  # re-serialised by json.dumps, one line
    assert run_cli(bad).exit_code == 0
    edit_manifest(bad, lambda m: m["counts"].update(truncated=3))
    assert run_cli(bad, "--no-hash").exit_code == 0
    edit_manifest(bad, lambda m: m.pop("checksum"))
    result = run_cli(bad)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert "manifest.json: it has no checksum, so its figures (counts, max_len, strategy, ...) cannot be checked" in lines[0], lines[0]
    assert run_cli(bad, "--no-hash").exit_code == 0
    assert verify_folder(bad, check_hashes=False).checksum is None


@pytest.mark.parametrize("defect", sorted(MANIFEST_DEFECTS))
def test_manifest_defect_is_named(bad: Path, defect: str) -> None:
    change, what = MANIFEST_DEFECTS[defect]
    edit_manifest(bad, change)
    result = run_cli(bad)
    assert result.exit_code == 1
    assert what in result.output, result.output


def test_manifest_not_json(bad: Path) -> None:
    (bad / "manifest.json").write_text("{not json")
    result = run_cli(bad)
    assert result.exit_code == 1 and "manifest.json: not valid JSON" in result.output


def test_not_a_packed_folder(tmp_path: Path) -> None:
    result = run_cli(tmp_path)
    assert result.exit_code == 1 and "no manifest" in result.output
    with pytest.raises(ShardFormatError, match="not a folder"):
        verify_folder(tmp_path / "nope")


def test_empty_folder_is_valid(tmp_path: Path) -> None:
    make_packed_folder(tmp_path / "empty", [], MAX_LEN)
    assert verify_folder(tmp_path / "empty").rows == 0


def test_large_folder_is_fast(tmp_path: Path) -> None:
    """~1M tokens in 2 shards: structural checks are vectorised (no per-token Python). Asserted as
    the count of Python function calls a verification makes (fewer than the rows, let alone the
    tokens), which a loaded machine does not change as it changes seconds."""
    import sys  # noqa: PLC0415

    rng = np.random.default_rng(0)
    n = 2000
    lengths = rng.integers(100, 900, size=n)
    tokens = rng.integers(3, 30000, size=int(lengths.sum()))
    # One example per row keeps building cheap; rows are what the checks loop over least.
    rows, start = [], 0
    for eid, length in enumerate(lengths):
        rows.append([(eid, tokens[start : start + length])])
        start += length
    make_packed_folder(tmp_path / "big", rows, 1024, rows_per_shard=1000)
    assert verify_folder(tmp_path / "big", check_hashes=False).total_tokens == int(lengths.sum())  # (compiles)
    calls = [0]

    def count(frame: object, event: str, arg: object) -> None:
        calls[0] += event == "call"

    sys.setprofile(count)
    try:
        manifest = verify_folder(tmp_path / "big", check_hashes=False)
    finally:
        sys.setprofile(None)
    assert manifest.total_tokens == int(lengths.sum())
    assert 0 < calls[0] < n, calls  # about 600: per shard and per check, never per row or token


def test_token_beyond_vocab(bad: Path) -> None:
    edit_manifest(bad, lambda m: m["tokenizer"].update(vocab_size=70))
    result = run_cli(bad)
    assert result.exit_code == 1
    assert "shard-00001.arrow row 0 example 2 (id 5) token 0: token id 71 >= the tokenizer's vocab_size 70" in result.output


@pytest.fixture(scope="module")
def sample_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real pack-data folder of the first 40 sample examples (tokenizer + sample in the repo)."""
    root = Path(__file__).resolve().parents[3]
    if not (root / "data/tokenizer/tokenizer.json").is_file():
        pytest.skip("data/tokenizer not generated")
    from pipeline.cli import pack_data  # noqa: PLC0415

    out = tmp_path_factory.mktemp("deep") / "packed"
    result = CliRunner().invoke(
        pack_data,
        [
            str(root / "data/sample/instructions.jsonl"),
            "--tokenizer",
            str(root / "data/tokenizer"),
            "--max-len",
            "128",
            "--overlong",
            "split",
            "--limit",
            "40",
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    return out


def test_deep_matches_pack_data(sample_pack: Path) -> None:
    assert verify_folder(sample_pack).counts.split > 0  # pieces are compared too
    result = run_cli(sample_pack, "--deep", "--sample", "40")
    assert result.exit_code == 0, result.output
    assert "40 examples re-tokenized and matched" in result.output


def test_deep_catches_changed_tokens(sample_pack: Path, tmp_path: Path) -> None:
    bad = Path(shutil.copytree(sample_pack, tmp_path / "bad"))
    arrays = shard_arrays(bad / "shard-00000.arrow")
    # Swap two token ids inside an example (labels follow): the fast checks still pass.
    t = int(arrays["seq_lens"][0]) // 2
    for col in ("input_ids", "labels"):
        arrays[col][t], arrays[col][t + 1] = arrays[col][t + 1], arrays[col][t]
    assert arrays["input_ids"][t] != arrays["input_ids"][t + 1]
    rewrite_shard(bad, 0, arrays)
    verify_folder(bad)
    result = run_cli(bad, "--deep", "--sample", "40")
    assert result.exit_code == 1
    assert "shard-00000.arrow row 0 example 0" in result.output
    assert "stored token ids differ from a fresh tokenization" in result.output


def test_several_defects_report_the_same_first_one_as_before(bad: Path) -> None:
    """Defect kinds keep their old precedence (ids, positions, start labels, other labels), not
    their order in the shard: a shifted label before a broken position reports the position."""

    def change(a: dict) -> None:
        a["labels"][1] = a["input_ids"][1] + 1  # row 0 example 0 token 1: shifted label
        a["position_ids"][6] = 9  # row 0 example 1 token 2: wrong position

    _tamper(bad, 0, change)
    result = run_cli(bad)
    assert result.exit_code == 1
    assert (
        "shard-00000.arrow row 0 example 1 (id 1) token 2: position_ids do not restart/count up "
        "per example (got 9, expected 2)" in result.output
    )


def test_checked_summaries_are_trusted_only_for_the_unchanged_file(bad: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = sorted(bad.glob("shard-*.arrow"))
    checked = {p.name: summarize_shard(p, MAX_LEN) for p in paths}
    assert [(s.rows, s.tokens, s.loss_tokens) for s in checked.values()] == [(2, 19, 16), (2, 17, 12)]  # 3+4+9, 2+0+1+9
    assert checked["shard-00001.arrow"].example_ids.tolist() == [3, 4, 5, 5]

    def no_reread(*args: object, **kwargs: object) -> None:
        pytest.fail("a shard with a valid summary was read again")

    monkeypatch.setattr(pipeline.shards.checks, "check_shard", no_reread)
    assert verify_folder(bad, checked=checked).rows == 4
    monkeypatch.undo()
    # a summary made with another max_len is not used; one made before the vocabulary was known
    # serves for any vocabulary larger than the shard's largest id
    other = {p.name: summarize_shard(p, MAX_LEN + 1) for p in paths}
    assert not other["shard-00000.arrow"].holds_for(paths[0], MAX_LEN, None)
    top = checked["shard-00000.arrow"].max_id
    assert top == int(shard_arrays(paths[0])["input_ids"].max())
    assert checked["shard-00000.arrow"].holds_for(paths[0], MAX_LEN, top + 1)
    assert not checked["shard-00000.arrow"].holds_for(paths[0], MAX_LEN, top)
    # the file changes after its summary was taken (same size): it is checked again
    time.sleep(0.05)  # past the file system's timestamp granularity
    _tamper(bad, 0, _label_shifted)
    with pytest.raises(ShardFormatError, match="row 0 example 1 .id 1. token 1: label"):
        verify_folder(bad, check_hashes=False, checked=checked)
