"""A share of an input's rows in `datasets`' split syntax (`pipeline.read.splits`): `data.jsonl:train[:20%]`,
`org/name:train[10:100]`, and files of a Hub dataset's repo (`hf://datasets/org/name/FILE`). The rows
kept are the rows `datasets.load_dataset(..., split=...)` keeps, compared with `datasets` itself;
every slice it would not read is one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_cache import C1, add_snapshot, hf_home  # noqa: F401 - hf_home is a fixture

from pipeline.errors import UserError
from pipeline.read.batches import iter_batches
from pipeline.read.chunks import plan_chunks
from pipeline.read.sources import input_fingerprints, resolve_inputs
from pipeline.splits import split_share

SLICES = [
    "train[:20%]",
    "train[10:100]",
    "train[-5%:]",
    "train[:1000]",
    "train[33%:67%]",
    "train[-15:-2]",
    "train[5%:-5%]",
    "train[2:]",
    "train[:50%]",
    "train[1_0:]",
    "train[-1:]",
    "train[10%:-3]",
]


def _jsonl(path: Path, first: int, stop: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(first, stop)))
    return path


def _read(spec: str) -> list[int]:
    return [int(x) for b in iter_batches(resolve_inputs([spec]), batch_rows=4) for x in b.table.column("i").to_pylist()]


def _theirs(builder: str, files: str | list[str], split: str) -> list[int] | None:
    """The rows `datasets` selects (None where it refuses the slice: no rows)."""
    import datasets

    datasets.disable_progress_bars()
    try:
        return [int(x) for x in datasets.load_dataset(builder, data_files=files, split=split)["i"]]
    except ValueError:
        return None


@pytest.mark.parametrize("rows", [3, 7, 19, 50, 101, 250])
def test_a_share_of_a_local_file_is_the_rows_datasets_selects(tmp_path: Path, rows: int) -> None:
    data = _jsonl(tmp_path / f"d{rows}.jsonl", 0, rows)
    for split in SLICES:
        want = _theirs("json", str(data), split)
        start, stop = split_share(f"x:{split}")[2].rows(rows)
        if stop < start:  # datasets reads it to the end when one row short, else as nothing: refused
            with pytest.raises(UserError, match="before it starts"):
                _read(f"{data}:{split}")
            assert want in (None, [], list(range(start, rows))), split
        elif want is None:  # no row: datasets refuses, and so does pack-data, in one line
            with pytest.raises(UserError, match="selects no examples"):
                _read(f"{data}:{split}")
        else:
            assert _read(f"{data}:{split}") == want, split


def test_a_share_counts_over_every_file_of_the_input_in_every_format(tmp_path: Path) -> None:
    for k, (a, b) in enumerate([(0, 13), (13, 20), (20, 41)]):
        _jsonl(tmp_path / "g" / f"p{k}.jsonl", a, b)
    pq.write_table(pa.table({"i": list(range(230))}), tmp_path / "t.parquet", row_group_size=7)
    (tmp_path / "a.json").write_text(json.dumps([{"i": i} for i in range(37)]))
    (tmp_path / "c.csv").write_text("i\n" + "".join(f"{i}\n" for i in range(29)))
    cases = [
        ("json", sorted(str(p) for p in (tmp_path / "g").glob("*.jsonl")), f"{tmp_path}/g/*.jsonl"),
        ("json", [str(tmp_path / "g" / f"p{k}.jsonl") for k in range(3)], str(tmp_path / "g")),
        ("parquet", str(tmp_path / "t.parquet"), str(tmp_path / "t.parquet")),
        ("json", str(tmp_path / "a.json"), str(tmp_path / "a.json")),
        ("csv", str(tmp_path / "c.csv"), str(tmp_path / "c.csv")),
    ]
    for builder, files, spec in cases:
        for split in ("train[:20%]", "train[10:30]", "train[-5%:]", "train[33%:67%]", "train[-15:-2]"):
            assert _read(f"{spec}:{split}") == _theirs(builder, files, split), (spec, split)
    split = "train[:50%](pct1_dropremainder)"
    assert _read(f"{tmp_path / 't.parquet'}:{split}") == _theirs("parquet", str(tmp_path / "t.parquet"), split)
    with pytest.raises(UserError, match="needs a split of at least 100"):  # datasets refuses it too
        _read(f"{tmp_path / 'a.json'}:{split}")


def test_a_shared_file_keeps_its_own_line_numbers_and_limit_counts_kept_rows(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "d.jsonl", 0, 30)
    files = resolve_inputs([f"{data}:train[10:20]"])
    batches = list(iter_batches(files, batch_rows=4))
    assert batches[0].where(0) == f"{data} line 11" and batches[0].first_row == 10
    assert [b.first_index for b in batches] == [0, 2, 6]  # tables of 4 records: 8-11, 12-15, 16-19
    assert sum(b.table.num_rows for b in iter_batches(files, batch_rows=4, limit=7)) == 7
    assert input_fingerprints(files)[0]["rows"] == [10, 20]
    whole = resolve_inputs([str(data)])
    assert "rows" not in input_fingerprints(whole)[0]  # negative control: a whole file records no share
    assert plan_chunks(files, 16) == [plan_chunks(files, 16)[0]] and plan_chunks(files, 16)[0].end == -1
    assert len(plan_chunks(whole, 16)) > 1  # the same file unshared is cut into byte ranges


@pytest.mark.parametrize(
    ("split", "needle"),
    [
        ("train[1:2:3]", "is no slice of a split"),
        ("train[:200%]", "between -100% and 100%"),
        ("train[:5](closest)", "for percent slices only"),
        ("train[:5%](nearest)", "one of closest, pct1_dropremainder"),
        ("test[:5]", "datasets' split 'train'"),
        ("train[5:5]", "selects no examples of its 30"),
        ("train[5:4]", "ends (row 4) before it starts (row 5) of its 30 examples"),
    ],
)
def test_a_slice_datasets_would_not_read_is_one_line(tmp_path: Path, split: str, needle: str) -> None:
    data = _jsonl(tmp_path / "d.jsonl", 0, 30)
    with pytest.raises(UserError, match=re.escape(needle)) as info:
        resolve_inputs([f"{data}:{split}"])
    assert "\n" not in str(info.value)


@pytest.fixture
def hub_dataset(hf_home: Path, tmp_path: Path) -> Path:
    """someone/ds in the cache: train in two JSONL files (rows 0-39, 40-79), test in one (80-99),
    and a pretrain/ file outside the split conventions."""
    src = tmp_path / "src"
    files = {
        "data/train-00000-of-00002.jsonl": _jsonl(src / "t0.jsonl", 0, 40),
        "data/train-00001-of-00002.jsonl": _jsonl(src / "t1.jsonl", 40, 80),
        "data/test-00000-of-00001.jsonl": _jsonl(src / "e.jsonl", 80, 100),
        "pretrain/rp_sub.jsonl": _jsonl(src / "p.jsonl", 1000, 1010),
    }
    return add_snapshot(hf_home, "dataset", "someone/ds", files, C1)


def test_a_share_of_a_hub_split_counts_over_its_files(hub_dataset: Path) -> None:
    assert _read("someone/ds:train[:20%]") == list(range(16))
    assert _read("someone/ds:train[30:50]") == list(range(30, 50))  # across the two files
    assert _read("someone/ds:test[-5%:]") == [99]
    files = resolve_inputs(["someone/ds:train[50:]"])
    assert [Path(f.path).name for f in files] == ["train-00001-of-00002.jsonl"]  # the first file keeps no row
    assert files[0].rows == (10, 40) and files[0].hub["split"] == "train[50:]"
    assert _read("someone/ds:train") == list(range(80))  # negative control: the whole split


def test_hub_files_by_path_read_only_those_files(hub_dataset: Path) -> None:
    assert _read("hf://datasets/someone/ds/pretrain/rp_sub.jsonl") == list(range(1000, 1010))
    assert _read("hf://datasets/someone/ds/pretrain/rp_sub.jsonl:train[-3:]") == [1007, 1008, 1009]
    assert _read("hf://datasets/someone/ds/data/train-*.jsonl") == list(range(80))
    files = resolve_inputs([f"hf://datasets/someone/ds@{C1}/pretrain/rp_sub.jsonl"])
    assert files[0].hub["commit"] == C1 and files[0].hub["data_files"] == "pretrain/rp_sub.jsonl"
    for spec, needle in [
        ("hf://datasets/someone/ds/pretrain/nope.jsonl", "has no file 'pretrain/nope.jsonl'"),
        ("hf://datasets/someone/ds/../../etc/passwd", "climbs out"),
        ("hf://datasets/someone/ds/pretrain/rp_sub.jsonl:test[:5]", "split 'train'"),
        ("hf://datasets/someone", "hf://datasets/OWNER/NAME"),
        ("hf://datasets/someone/other/x.jsonl", "not in the local Hugging Face cache"),
    ]:
        with pytest.raises(UserError, match=needle.replace("(", r"\(")) as info:
            resolve_inputs([spec])
        assert "\n" not in str(info.value)


def test_zstd_compressed_text_inputs_read_as_their_plain_files(tmp_path: Path) -> None:
    """.zst (Axolotl's ALST example reads pretrain/rp_sub.jsonl.zst) as .gz: JSON Lines, JSON arrays, CSV."""

    def zst(name: str, data: bytes) -> str:
        with pa.output_stream(tmp_path / name, compression="zstd") as f:
            f.write(data)
        return str(tmp_path / name)

    jsonl = zst("d.jsonl.zst", b"".join(b'{"i": %d}\n' % i for i in range(1000)))
    assert [f.kind for f in resolve_inputs([jsonl])] == ["jsonl"]
    assert _read(jsonl) == list(range(1000)) and _read(f"{jsonl}:train[-5%:]") == list(range(950, 1000))
    assert plan_chunks(resolve_inputs([jsonl]), 100)[0].end == -1  # read whole, never cut at byte offsets
    assert _read(zst("a.json.zst", json.dumps([{"i": i} for i in range(50)]).encode())) == list(range(50))
    assert _read(zst("c.csv.zst", b"i\n" + b"".join(b"%d\n" % i for i in range(70)))) == list(range(70))
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(Path(jsonl).read_bytes()[:40])
    with pytest.raises(UserError, match="cut.jsonl.zst: Truncated compressed stream") as info:
        _read(str(cut))
    assert "\n" not in str(info.value)


def test_pack_verify_deep_reads_the_same_share_and_files(hub_dataset: Path, hf_home: Path, tmp_path: Path) -> None:
    """pack-verify --deep re-reads a share of a split and hf:// files at the commit packed (`pinned_config`)."""
    from pipeline.engines.job import PackConfig, run_pack_data
    from pipeline.report.deep_check import deep_check, pinned_config
    from pipeline.shards import verify_folder

    tokenizer = str(Path(__file__).resolve().parents[3] / "data" / "tokenizer")
    (hf_home / "hub" / "datasets--someone--ds" / "refs" / "main").write_text(C1)
    for n, spec in enumerate(["someone/ds:train[25%:-10]", "hf://datasets/someone/ds/pretrain/rp_sub.jsonl:train[-4:]"]):
        out = tmp_path / f"packed{n}"
        run_pack_data(
            PackConfig(
                inputs=[spec], tokenizer=tokenizer, max_len=64, out=str(out), num_proc=1, progress=False, format="text", text_field="i"
            )
        )
        manifest = verify_folder(out)
        pinned = pinned_config(manifest)["inputs"]
        assert pinned == (
            [f"someone/ds@{C1}:train[25%:-10]"] if n == 0 else [f"hf://datasets/someone/ds@{C1}/pretrain/rp_sub.jsonl:train[-4:]"]
        )
        # datasets reads both bounds as percents when one is: -10 is -10% (8 rows)
        assert _read(pinned[0]) == (list(range(20, 72)) if n == 0 else [1006, 1007, 1008, 1009])
        assert deep_check(out, manifest, None, sample=10) == min(10, manifest.counts.examples_read)


def test_a_share_of_a_remote_input_is_taken_of_its_downloaded_copy(tmp_path: Path) -> None:
    """file:// (as s3://, gs://): the share follows the input's local copy; the manifest keeps the URI."""
    from pipeline.engines.job import PackConfig, run_pack_data

    data = _jsonl(tmp_path / "d.jsonl", 0, 50)
    tokenizer = str(Path(__file__).resolve().parents[3] / "data" / "tokenizer")
    for given, out in ((f"file://{data}:train[-20%:]", "remote"), (f"{data}:train[-20%:]", "local")):
        manifest = run_pack_data(
            PackConfig(
                inputs=[given],
                tokenizer=tokenizer,
                max_len=64,
                out=str(tmp_path / out),
                num_proc=1,
                progress=False,
                format="text",
                text_field="i",
            )
        )
        assert manifest.counts.examples_read == 10 and manifest.inputs[0]["rows"] == [40, 50]
        assert manifest.config["inputs"] == [given]
