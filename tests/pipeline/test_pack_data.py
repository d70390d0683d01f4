"""pack-data end to end through the CLI: output contract, determinism, overlong policies, clear errors."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import pipeline.engines.job
import pipeline.shards.verify
import pipeline.write.shard_writer
from pipeline.cli import pack_data, pack_verify
from pipeline.engines.job import PackConfig, run_pack_data
from pipeline.shards import IGNORE_INDEX, iter_rows, read_manifest, verify_folder
from pipeline.tokenize.encode_pool import default_workers
from pipeline.tokenize.long_texts import MAX_PIECE_CHARS
from pipeline.tokenize.segments import encode_segments
from pipeline.tokenize.tokenize_inputs import tokenize_examples
from pipeline.tokenize.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "data" / "tokenizer")
LLAMA2 = ROOT.parent / "shared" / "tokenizers" / "llama2"  # real data beside the checkout; skipped without it
SAMPLE = ROOT / "data" / "sample"
BOS, EOS = 1, 2


def run(*args: str) -> object:
    return CliRunner().invoke(pack_data, [*map(str, args), "--no-progress"], catch_exceptions=False)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def leftovers(parent: Path) -> list[str]:
    """Hidden temporary folders pack-data might have left behind."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") and ".tmp-" in p.name or ".old-" in p.name)


def examples(folder: Path) -> dict[int, list[tuple[list[int], list[int], list[int]]]]:
    """example id -> its pieces (ids, labels, position_ids), read back from the shards."""
    out: dict[int, list] = {}
    for row in iter_rows(folder):
        k = 0
        for n, eid in zip(row["seq_lens"], row["example_ids"]):
            sl = slice(k, k + int(n))
            out.setdefault(int(eid), []).append(
                (row["input_ids"][sl].tolist(), row["labels"][sl].tolist(), row["position_ids"][sl].tolist())
            )
            k += int(n)
    return out


# ------------------------------------------------------------------------------- the README run


@pytest.fixture(scope="module")
def readme_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("readme") / "sample"
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:  # exactly the README's first command (plus where to write)
        result = run("data/sample/instructions.jsonl", "--tokenizer", "data/tokenizer", "--max-len", "8192", "--out", out, "--overwrite")
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    return out


def test_readme_command_output_passes_verify_and_records_everything(readme_out: Path):
    manifest = verify_folder(readme_out, check_hashes=True)
    c = manifest.counts
    assert (c.examples_read, c.examples_packed, c.empty_skipped, c.truncated, c.split, c.dropped) == (3000, 3000, 0, 3, 0, 0)
    assert manifest.max_len == 8192 and manifest.strategy == "ffd" and manifest.seed == 0
    assert manifest.efficiency == pytest.approx(manifest.total_tokens / (manifest.rows * 8192), abs=1e-6)
    assert manifest.efficiency > 0.95
    # recorded absolute, so `pack-verify --deep` finds the inputs from any working folder
    assert manifest.config["inputs"] == [str(Path("data/sample/instructions.jsonl").resolve())]
    assert manifest.config["overlong"] == "truncate" and manifest.config["num_proc"] == default_workers()
    assert manifest.tokenizer["name"] == "data/tokenizer" and len(manifest.tokenizer["fingerprint"]) == 64
    assert (manifest.tokenizer["bos_token_id"], manifest.tokenizer["eos_token_id"]) == (BOS, EOS)
    assert manifest.tokenizer["format"]["kind"] == "instruction"
    sample = SAMPLE / "instructions.jsonl"  # hashed in a background thread while packing
    assert manifest.inputs == [
        {
            "path": str(sample.relative_to(ROOT)),
            "kind": manifest.inputs[0]["kind"],
            "bytes": sample.stat().st_size,
            "sha256": hashlib.sha256(sample.read_bytes()).hexdigest(),
        }
    ]
    assert leftovers(readme_out.parent) == []


def test_shards_open_with_arrow_mmap_datasets_and_polars(readme_out: Path, tmp_path: Path):
    import datasets
    import polars as pl

    manifest = read_manifest(readme_out)
    path = readme_out / manifest.shards[0].file
    with pa.memory_map(str(path), "r") as source:
        table = pa.ipc.open_file(source).read_all()
        first = table.column("input_ids")[0].as_py()
        assert table.num_rows == manifest.shards[0].rows
    ds = datasets.Dataset.from_file(str(path))  # reads the IPC stream from byte 0
    assert len(ds) == manifest.shards[0].rows and ds[0]["input_ids"] == first
    assert ds[len(ds) - 1]["seq_lens"] == table.column("seq_lens")[-1].as_py()
    ds = datasets.load_dataset("arrow", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
    assert len(ds) == manifest.shards[0].rows and ds[0]["input_ids"] == first
    df = pl.read_ipc(path)
    assert df.height == manifest.shards[0].rows and df["input_ids"][0].to_list() == first
    assert sum(map(len, df["input_ids"])) == manifest.shards[0].tokens


def test_rows_follow_the_contract(readme_out: Path):
    tok = load_tokenizer(TOKENIZER)
    seen = examples(readme_out)
    assert sorted(seen) == list(range(3000))  # every example once, by input index
    for eid in (0, 1, 1234):
        ((ids, labels, pos),) = seen[eid]
        assert ids[0] == BOS and labels[0] == IGNORE_INDEX and pos == list(range(len(ids)))
        assert ids[-1] == EOS and labels[-1] == EOS
        assert "### Response:" in tok.decode(ids) and "### Response:" not in tok.decode([t for t in labels if t >= 0])
    fresh = tokenize_examples(read_manifest(readme_out).config, [1234, 0])
    assert fresh[0][0].tolist() == seen[1234][0][0] and fresh[1][1].tolist() == seen[0][0][1]


# -------------------------------------------------------------------------- content, policies


def test_text_content_multiple_inputs_and_global_ids(tmp_path: Path):
    tok = load_tokenizer(TOKENIZER)
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "alpha beta"}, {"text": ""}, {"text": "gamma"}])
    pq.write_table(pa.table({"text": ["delta epsilon", "zeta"]}), tmp_path / "b.parquet")
    out = tmp_path / "out"
    result = run(a, tmp_path / "b.parquet", "--tokenizer", TOKENIZER, "--max-len", 16, "--out", out, "--rows-per-shard", 1)
    assert result.exit_code == 0, result.output
    manifest = verify_folder(out)
    assert (manifest.counts.examples_read, manifest.counts.empty_skipped, manifest.counts.examples_packed) == (5, 1, 4)
    assert len(manifest.shards) == manifest.rows
    seen = examples(out)
    texts = {0: "alpha beta", 2: "gamma", 3: "delta epsilon", 4: "zeta"}
    assert sorted(seen) == sorted(texts)
    for eid, text in texts.items():
        body = tok(text, add_special_tokens=False)["input_ids"]
        assert seen[eid] == [([BOS, *body, EOS], [IGNORE_INDEX, *body, EOS], list(range(len(body) + 2)))]
    assert "examples: 5 read, 4 packed, 1 empty skipped" in result.output


def test_mixed_formats_each_file_rendered_with_its_own(tmp_path: Path):
    """--format auto: instruction, chat, text and pre-tokenized files in one run, each detected on its own."""
    tok = load_tokenizer(TOKENIZER)
    inputs = []
    for name in ("instructions", "chat", "text"):
        lines = (SAMPLE / f"{name}.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:10]
        inputs.append(tmp_path / f"{name}.jsonl")
        inputs[-1].write_text("".join(lines), encoding="utf-8")
    inputs.append(write_jsonl(tmp_path / "tok.jsonl", [{"input_ids": [7, 8, 9]}, {"input_ids": [10, 11]}]))
    shas = []
    for n in (1, 2):
        out = tmp_path / f"out{n}"
        result = run(
            *inputs, "--tokenizer", TOKENIZER, "--max-len", 8192, "--out", out, "--num-proc", n, "--batch-rows", 3, "--rows-per-shard", 1
        )
        assert result.exit_code == 0, result.output
        shas.append([s.sha256 for s in verify_folder(out).shards])
    assert shas[0] == shas[1]  # same bytes whatever --num-proc, pre-tokenized batches included
    manifest = read_manifest(out)
    resolved = manifest.config["resolved_formats"]
    assert [(r["file"], r["kind"]) for r in resolved] == list(zip(map(str, inputs), ["instruction", "chat", "text", "tokenized"]))
    assert resolved[0]["template_name"] == "alpaca" and resolved[1]["fields"] == {"messages": "messages"}
    assert manifest.tokenizer["format"] == {"kind": "mixed"}
    seen = examples(out)
    assert sorted(seen) == list(range(32))  # global ids follow the input order across files
    ((ids, labels, _),) = seen[3]  # instruction: prompt masked
    assert "### Response:" in tok.decode(ids) and "### Response:" not in tok.decode([t for t in labels if t >= 0])
    ((ids, labels, _),) = seen[13]  # chat: only assistant turns trained
    assert "<|im_start|>" in tok.decode(ids) and "<|im_start|>" not in tok.decode([t for t in labels if t >= 0])
    ((ids, labels, _),) = seen[23]  # text: every token but the first
    assert labels[0] == IGNORE_INDEX and labels[1:] == ids[1:] and ids[-1] == EOS
    assert seen[30] == [([7, 8, 9], [IGNORE_INDEX, 8, 9], [0, 1, 2])]  # pre-tokenized: used as is
    fresh = tokenize_examples(manifest.config, [3, 13, 23, 31])  # re-tokenizes with each file's format
    assert [f[0].tolist() for f in fresh] == [seen[i][0][0] for i in (3, 13, 23, 31)]
    assert [f[1].tolist() for f in fresh] == [seen[i][0][1] for i in (3, 13, 23, 31)]


@pytest.mark.parametrize(("strategy", "max_len", "overlong"), [("ffd", 1024, "split"), ("pad", 8192, "truncate")])
def test_summary_padding_is_pack_reports_figure(tmp_path: Path, strategy: str, max_len: int, overlong: str):
    from pipeline.report.folder_report import folder_report, load_folder

    out = tmp_path / strategy
    result = run(
        SAMPLE / "text.jsonl",
        "--tokenizer",
        TOKENIZER,
        "--max-len",
        max_len,
        "--out",
        out,
        "--limit",
        150,
        "--overlong",
        overlong,
        "--strategy",
        strategy,
    )
    assert result.exit_code == 0, result.output
    report = folder_report(load_folder(out))
    longest = report["savings"]["pad_to_longest"]
    pad_packed = report["rows"] * max_len - report["tokens"]
    line = next(x for x in result.output.splitlines() if x.startswith("padding:"))
    assert f"pad-to-longest batches of 32 (example order) {longest['padding_tokens']:,} tokens" in line
    assert f"this packing {pad_packed:,} (efficiency {report['efficiency']:.2%})" in line
    avoided = longest["padding_avoided"]
    if strategy == "ffd":
        assert avoided > 0 and line.endswith(f": {avoided:,} avoided")
    else:  # one example per max_len row pads more than pad-to-longest: said so, not a negative "avoided"
        assert avoided < 0 and line.endswith(f": {-avoided:,} more than pad-to-longest")


def _ipc(path: Path, rows: list[list[int]], batch: int = 2, compression: str | None = None) -> Path:
    schema = pa.schema([pa.field("input_ids", pa.list_(pa.int32()))])
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema, options=options) as writer:
        for i in range(0, len(rows), batch):
            writer.write_batch(pa.record_batch([pa.array(rows[i : i + batch], pa.list_(pa.int32()))], schema=schema))
    return path


def test_arrow_ipc_pretokenized_is_gathered_in_place_with_the_same_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from pipeline.tokenize import tokenize_inputs as tokenize

    rows = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([5, 12, 0, 3, 20, 7, 1])]
    a = _ipc(tmp_path / "a.arrow", rows[:4], batch=3)
    b = _ipc(tmp_path / "b.arrow", rows[4:], batch=2)
    z = _ipc(tmp_path / "z.arrow", rows[4:], batch=2, compression="zstd")  # compressed: not in place
    direct: list[bool] = []
    real = tokenize.direct_arrow_spill

    def spy(*args, **kwargs):
        try:
            spill = real(*args, **kwargs)
        except tokenize.NotDirect:
            direct.append(False)
            raise
        direct.append(True)
        return spill

    monkeypatch.setattr(tokenize, "direct_arrow_spill", spy)
    args = ("--tokenizer", TOKENIZER, "--max-len", 8, "--overlong", "split", "--rows-per-shard", 2)
    assert run(a, b, *args, "--out", tmp_path / "direct").exit_code == 0
    assert run(a, z, *args, "--out", tmp_path / "fallback").exit_code == 0
    assert direct == [True, False]
    monkeypatch.setattr(tokenize, "direct_arrow_spill", lambda *a, **k: (_ for _ in ()).throw(tokenize.NotDirect()))
    assert run(a, b, *args, "--out", tmp_path / "spilled").exit_code == 0
    shas = [[s.sha256 for s in verify_folder(tmp_path / o).shards] for o in ("direct", "fallback", "spilled")]
    assert shas[0] == shas[1] == shas[2] and len(shas[0]) > 1
    m = read_manifest(tmp_path / "direct")
    assert (m.counts.examples_read, m.counts.empty_skipped, m.counts.split) == (7, 1, 2)
    seen = examples(tmp_path / "direct")
    assert sorted(seen) == [0, 1, 3, 4, 5, 6]
    whole = [t for piece in sorted(seen[4], key=lambda p: p[0][0]) for t in piece[0]]
    assert whole == rows[4]  # example 4 (first row of b.arrow) split into consecutive pieces
    monkeypatch.setattr(tokenize, "direct_arrow_spill", real)
    result = run(a, b, *args[:4], "--out", tmp_path / "lim", "--limit", 5)
    assert result.exit_code == 0 and read_manifest(tmp_path / "lim").counts.examples_read == 5


@pytest.mark.parametrize(("bad", "needle"), [(99999, "token id 99999 is outside"), (-3, "negative id")])
def test_arrow_ipc_in_place_bad_ids_name_file_and_row(tmp_path: Path, bad: int, needle: str):
    a = _ipc(tmp_path / "a.arrow", [[5, 6], [7, 8]])
    b = _ipc(tmp_path / "b.arrow", [[5, 6], [7, 8], [9, bad, 4]])
    result = run(a, b, "--tokenizer", TOKENIZER, "--max-len", 8, "--out", tmp_path / "o")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"b.arrow row 3: {'input_ids contains a ' if bad < 0 else ''}{needle}" in result.output, result.output
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


def test_arrow_ipc_in_place_rows_of_another_format_name_the_file_row_and_fields(tmp_path: Path):
    """A pre-tokenized Arrow file, gathered in place, whose later rows are text rows (no input_ids)."""
    table = pa.table({"input_ids": pa.array([[5, 6], [7], None], pa.list_(pa.int32())), "text": [None, None, "doc"]})
    with pa.ipc.new_file(tmp_path / "a.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    result = run(tmp_path / "a.arrow", "--tokenizer", TOKENIZER, "--max-len", 8, "--out", tmp_path / "o")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert (
        f"{tmp_path / 'a.arrow'} row 3: the file mixes formats: this row has the fields text (text format), but "
        "the file is read as tokenized, which needs 'input_ids' in every row"
    ) in result.output, result.output
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", ["tokenized", "text"])
def test_the_manifest_records_the_tokenizers_facts_and_the_format(tmp_path: Path, kind: str):
    from pipeline.tokenize.tokenizer import tokenizer_info

    if kind == "tokenized":
        data = _ipc(tmp_path / "a.arrow", [[5, 6], [7, 8, 9]])
    else:
        data = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello there"}, {"text": "bye"}])
    expected = tokenizer_info(load_tokenizer(TOKENIZER), TOKENIZER)
    for out in ("o1", "o2"):
        m = run_pack_data(PackConfig(inputs=[str(data)], tokenizer=TOKENIZER, max_len=64, out=str(tmp_path / out), progress=False))
        assert {k: v for k, v in m.tokenizer.items() if k != "format"} == expected
        assert m.tokenizer["format"]["kind"] == kind
    assert (tmp_path / "o1" / "shard-00000.arrow").read_bytes() == (tmp_path / "o2" / "shard-00000.arrow").read_bytes()


@pytest.mark.parametrize(("data", "num_proc"), [("instructions.jsonl", 2), ("instructions.jsonl", 1), ("chat.jsonl", 2)])
def test_truncation_or_padding_saved_in_tokenizer_json_changes_no_token(tmp_path: Path, data: str, num_proc: int):
    """A tokenizer.json saved with truncation and padding on (as some on the Hub are) gives the
    same tokens as without: the job encodes whole texts and pads nothing, in worker processes, in
    this process (chat) and with --num-proc 1 alike."""
    saved = tmp_path / "tok"
    shutil.copytree(TOKENIZER, saved)
    spec = json.loads((saved / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {
        "strategy": {"Fixed": 16},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 3,
        "pad_type_id": 0,
        "pad_token": "<pad>",
    }
    (saved / "tokenizer.json").write_text(json.dumps(spec))
    common = [SAMPLE / data, "--max-len", 2048, "--limit", 40, "--num-proc", num_proc]
    for name, tok in (("plain", TOKENIZER), ("saved", saved)):
        assert run(*common, "--tokenizer", tok, "--out", tmp_path / name).exit_code == 0
    assert examples(tmp_path / "saved") == examples(tmp_path / "plain")
    assert read_manifest(tmp_path / "saved").total_tokens > 40 * 16  # not cut to 8 tokens a text


@pytest.mark.parametrize("data_kind", ["tokenized", "text"])
@pytest.mark.parametrize("kind", ["junk", "missing"])
def test_a_bad_tokenizer_is_one_line_and_no_output(tmp_path: Path, kind: str, data_kind: str):
    if data_kind == "tokenized":
        data = _ipc(tmp_path / "a.arrow", [[5, 6], [7, 8, 9]])
    else:
        data = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello there"}, {"text": "bye"}])
    folder = tmp_path / kind
    if kind == "junk":  # a folder: only loading it (in the child) finds the problem
        folder.mkdir()
        (folder / "tokenizer.json").write_text("{not json")
    result = run(data, "--tokenizer", folder, "--max-len", 8, "--out", tmp_path / "o")
    assert result.exit_code == 1 and "Traceback" not in result.output
    needle = "cannot load tokenizer" if kind == "junk" else "not found"
    assert needle in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


def test_id_beyond_vocabulary_in_a_mixed_job_names_file_and_line(tmp_path: Path):
    """Text and pre-tokenized inputs together: the tokenizer is known from the start, and the
    vocabulary check names the pre-tokenized example's line."""
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello there"}, {"text": "bye"}])
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6]}, {"input_ids": [7, 99999]}, {"input_ids": [3]}])
    result = run(text, ids, "--tokenizer", TOKENIZER, "--max-len", 16, "--rows-per-shard", 1, "--out", tmp_path / "o")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "ids.jsonl line 2: token id 99999 is outside the tokenizer's vocabulary" in result.output, result.output
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


def test_arrow_ipc_in_place_overlong_error_names_file_and_row(tmp_path: Path):
    a = _ipc(tmp_path / "a.arrow", [[5, 6], [7, 8], [3] * 9])
    result = run(a, "--tokenizer", TOKENIZER, "--max-len", 8, "--out", tmp_path / "o", "--overlong", "error")
    assert result.exit_code == 1 and "a.arrow row 3: example is 9 tokens, longer than --max-len 8" in result.output


@pytest.fixture()
def pretok(tmp_path: Path) -> Path:
    # lengths 5, 12, 3, 20 against --max-len 8
    rows = [{"input_ids": list(range(10 + i, 10 + i + n))} for i, n in enumerate([5, 12, 3, 20])]
    return write_jsonl(tmp_path / "tok.jsonl", rows)


@pytest.mark.parametrize(
    ("policy", "counts", "tokens", "pieces"),
    [
        ("truncate", {"truncated": 2, "examples_packed": 4}, 24, {0: [5], 1: [8], 2: [3], 3: [8]}),
        ("split", {"split": 2, "examples_packed": 4}, 40, {0: [5], 1: [8, 4], 2: [3], 3: [8, 8, 4]}),
        ("drop", {"dropped": 2, "examples_packed": 2}, 8, {0: [5], 2: [3]}),
    ],
)
def test_overlong_policies(pretok: Path, tmp_path: Path, policy, counts, tokens, pieces):
    out = tmp_path / policy
    result = run(pretok, "--tokenizer", TOKENIZER, "--max-len", 8, "--out", out, "--overlong", policy)
    assert result.exit_code == 0, result.output
    manifest = verify_folder(out)
    for key, value in counts.items():
        assert getattr(manifest.counts, key) == value
    assert manifest.total_tokens == tokens and manifest.counts.examples_read == 4
    seen = examples(out)
    assert {k: sorted((len(p[0]) for p in v), reverse=True) for k, v in seen.items()} == pieces
    for eid, chunks in seen.items():
        start = 10 + eid
        whole = [t for p in sorted(chunks, key=lambda p: p[0][0]) for t in p[0]]
        assert whole == list(range(start, start + len(whole)))  # pieces are consecutive chunks, in order
        for ids, labels, pos in chunks:
            assert labels[0] == IGNORE_INDEX and labels[1:] == ids[1:] and pos == list(range(len(ids)))
    deep = CliRunner().invoke(pack_verify, [str(out), "--deep"])  # re-tokenizes via tokenize_examples
    assert deep.exit_code == 0 and "re-tokenized and matched" in deep.output, deep.output


def test_overlong_error_names_the_row(pretok: Path, tmp_path: Path):
    result = run(pretok, "--tokenizer", TOKENIZER, "--max-len", 8, "--out", tmp_path / "o", "--overlong", "error")
    assert result.exit_code == 1
    assert "tok.jsonl line 2: example is 12 tokens, longer than --max-len 8" in result.output
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


def test_same_shards_whatever_num_proc_and_batch_rows(tmp_path: Path):
    shas = []
    for n, batch_rows in ((1, 37), (2, 37), (2, None), (3, None), (None, 37)):
        out = tmp_path / f"np{n}-{len(shas)}"
        extra = (() if n is None else ("--num-proc", n)) + (() if batch_rows is None else ("--batch-rows", batch_rows))
        result = run(SAMPLE / "text.jsonl", "--tokenizer", TOKENIZER, "--max-len", 1024, "--out", out, "--rows-per-shard", 20, *extra)
        assert result.exit_code == 0, result.output
        shas.append([s.sha256 for s in read_manifest(out).shards])
    assert len(shas[0]) > 1 and all(s == shas[0] for s in shas), shas


def test_a_long_row_packs_the_same_whatever_num_proc_with_the_ids_of_its_whole_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A row longer than LONG_TEXT_CHARS (made small here), tokenized in pieces: the shards are the
    same for any --num-proc, and its example holds the ids of the whole rendered text, its loss
    starting where the tokenizer's offsets put the response, split into --max-len pieces."""
    import pipeline.tokenize.long_texts

    for name, value in (("LONG_TEXT_CHARS", 60_000), ("CALL_CHARS", 60_000), ("PIECE_CHARS", 2_000)):
        monkeypatch.setattr(pipeline.tokenize.long_texts, name, value)
    docs = [json.loads(line)["text"] for line in (SAMPLE / "text.jsonl").read_text().splitlines()]
    body = " ".join(docs)[:100_000]
    prompt, response = body[: len(body) // 2], body[len(body) // 2 :]
    rows = [{"prompt": "2+2?", "response": "4"}, {"prompt": prompt, "response": response}, {"prompt": "3+3?", "response": "6"}]
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    shas = []
    for n in (1, 2):
        result = run(
            data,
            "--tokenizer",
            TOKENIZER,
            "--max-len",
            4096,
            "--overlong",
            "split",
            "--num-proc",
            n,
            "--strategy",
            "sequential",
            "--out",
            tmp_path / f"np{n}",
        )  # (rows, so pieces, in input order)
        assert result.exit_code == 0, result.output
        shas.append([s.sha256 for s in read_manifest(tmp_path / f"np{n}").shards])
    assert shas[0] == shas[1]
    backend = load_tokenizer(TOKENIZER).backend_tokenizer
    ids, (n_prompt, n_response) = encode_segments(backend, [prompt + response], (np.array([1]), np.array([len(prompt)])))
    pieces = examples(tmp_path / "np1")[1]
    assert len(pieces) > 1 and all(len(p[0]) <= 4096 for p in pieces)
    got_ids = [i for p in pieces for i in p[0]]
    got_labels = [lab for p in pieces for lab in p[1]]
    assert got_ids == [BOS, *ids.tolist(), EOS]
    want = [IGNORE_INDEX] * (1 + n_prompt) + ids[n_prompt:].tolist() + [EOS]
    starts = np.cumsum([0] + [len(p[0]) for p in pieces[:-1]])
    for k in starts.tolist():  # the first label of every piece is -100
        want[k] = IGNORE_INDEX
    assert got_labels == want


def test_chat_sample_limit_and_strategy(tmp_path: Path):
    out = tmp_path / "chat"
    result = run(
        SAMPLE / "chat.jsonl", "--tokenizer", TOKENIZER, "--max-len", 2048, "--out", out, "--limit", 40, "--strategy", "bfd", "--seed", 3
    )
    assert result.exit_code == 0, result.output
    manifest = verify_folder(out)
    assert manifest.counts.examples_read == 40 and manifest.strategy == "bfd" and manifest.seed == 3
    tok = load_tokenizer(TOKENIZER)
    for chunks in examples(out).values():
        ((_, labels, _),) = chunks
        trained = tok.decode([t for t in labels if t >= 0])
        assert "<|im_start|>" not in trained and trained.endswith("<|im_end|>")  # the template's end, no EOS


def test_overwrite_replaces_only_pack_data_folders(tmp_path: Path, pretok: Path):
    out = tmp_path / "o"
    args = (pretok, "--tokenizer", TOKENIZER, "--max-len", 32, "--out", out)
    assert run(*args).exit_code == 0
    again = run(*args)
    assert again.exit_code == 1 and "already exists: pass --overwrite" in again.output
    assert run(*args, "--overwrite", "--limit", 2).exit_code == 0
    assert read_manifest(out).counts.examples_read == 2 and leftovers(tmp_path) == []
    other = tmp_path / "mine"
    other.mkdir()
    (other / "thesis.txt").write_text("precious")
    refused = run(pretok, "--tokenizer", TOKENIZER, "--max-len", 32, "--out", other, "--overwrite")
    assert refused.exit_code == 1 and "did not write" in refused.output
    assert (other / "thesis.txt").read_text() == "precious"
    (other / "manifest.json").write_text('{"name": "my web app"}')  # a manifest, but not ours
    refused = run(pretok, "--tokenizer", TOKENIZER, "--max-len", 32, "--out", other, "--overwrite")
    assert refused.exit_code == 1 and "did not write" in refused.output
    assert (other / "thesis.txt").read_text() == "precious"


def test_overwrite_never_deletes_what_pack_data_did_not_write(tmp_path: Path, pretok: Path):
    """A pack-data folder the user added files to is refused whole, naming the first foreign file;
    once they are moved out, --overwrite replaces it."""
    out = tmp_path / "o"
    args = (pretok, "--tokenizer", TOKENIZER, "--max-len", 32, "--out", out, "--overwrite")
    assert run(*args).exit_code == 0
    (out / "MY_NOTES.txt").write_text("precious")
    (out / "eval").mkdir()
    (out / "eval" / "results.json").write_text("{}")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    refused = run(*args)
    lines = refused.output.strip().splitlines()
    assert refused.exit_code == 1 and len(lines) == 1 and "holds 'MY_NOTES.txt', which pack-data did not write" in lines[0]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before and leftovers(tmp_path) == []
    (out / "MY_NOTES.txt").unlink()
    assert "holds 'eval'" in run(*args).output
    shutil.rmtree(out / "eval")
    assert run(*args).exit_code == 0


def test_packed_output_is_refused_as_input(tmp_path: Path, pretok: Path):
    """Packed rows read as input would each become one example (their boundaries lost): a packed
    folder, one of its shards, or a shard copied elsewhere are refused in one line, and nothing
    is written or replaced."""
    packed = tmp_path / "packed"
    assert run(pretok, "--tokenizer", TOKENIZER, "--max-len", 32, "--out", packed).exit_code == 0
    shard = next(packed.glob("shard-*.arrow"))
    loose = tmp_path / "loose.arrow"
    shutil.copy(shard, loose)
    manifest = (packed / "manifest.json").read_bytes()
    for source, out in [(packed, tmp_path / "again"), (shard, tmp_path / "again"), (loose, tmp_path / "again"), (shard, packed)]:
        result = run(source, "--tokenizer", TOKENIZER, "--max-len", 64, "--out", out, "--overwrite")
        lines = result.output.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1 and "is packed output of pack-data" in lines[0], result.output
        assert not (tmp_path / "again").exists() and (packed / "manifest.json").read_bytes() == manifest


def test_examples_that_train_nothing_are_counted_and_a_job_of_only_those_refused(tmp_path: Path):
    """Chat rows without an assistant turn have no loss token: counted in the manifest, warned
    about in the summary and the report; when no example has one the job stops in one line."""
    from pipeline.cli import pack_report

    talk = [{"role": "user", "content": "hello there"}]
    answered = talk + [{"role": "assistant", "content": "hi"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": answered}] * 3 + [{"messages": talk}] * 2)
    out = tmp_path / "o"
    result = run(data, "--tokenizer", TOKENIZER, "--max-len", 256, "--out", out)
    assert result.exit_code == 0, result.output
    assert "warning: 2 packed example(s) have no token that carries a loss" in result.output
    assert read_manifest(out).counts.no_loss == 2 and verify_folder(out).counts.no_loss == 2
    report = CliRunner().invoke(pack_report, [str(out)])
    assert report.exit_code == 0 and "2 with no loss token" in report.output
    # the count is checked against the shards
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["counts"]["no_loss"] = 0
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="counts.no_loss is 0 but the shards hold 2"):
        verify_folder(out, check_hashes=False)

    silent = write_jsonl(tmp_path / "silent.jsonl", [{"messages": talk}] * 4)
    refused = run(silent, "--tokenizer", TOKENIZER, "--max-len", 256, "--out", tmp_path / "none")
    lines = refused.output.strip().splitlines()
    assert refused.exit_code == 1 and len(lines) == 1 and "nothing to train on" in lines[0], refused.output
    assert not (tmp_path / "none").exists() and leftovers(tmp_path) == []


def test_help_explains_options_with_an_example():
    result = CliRunner().invoke(pack_data, ["--help"])
    assert result.exit_code == 0
    for option in (
        "--format",
        "--text-field",
        "--prompt-field",
        "--response-field",
        "--messages-field",
        "--template",
        "--train-on-prompt",
        "--strategy",
        "--overlong",
        "--num-proc",
        "--seed",
        "--rows-per-shard",
        "--overwrite",
        "--limit",
        "Examples:",
    ):
        assert option in result.output


# ------------------------------------------------------------------------------------ bad input


def _no_template(tmp: Path) -> Path:
    folder = tmp / "plain-tokenizer"
    shutil.copytree(TOKENIZER, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def _bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (CLI args before the common ones, text the one-line error must contain)."""
    good = write_jsonl(tmp / "good.jsonl", [{"text": "fine"}])
    broken = tmp / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{"text": oops}\n')
    (tmp / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    (tmp / "data.xyz").write_text("what")
    latin = tmp / "latin.jsonl"
    latin.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    empty = tmp / "empty.json"
    empty.write_text("[]")
    return {
        "missing file": ([str(tmp / "nope.jsonl")], "nope.jsonl"),
        "corrupt json": ([str(broken)], "line 2"),
        "corrupt parquet": ([str(tmp / "bad.parquet")], "bad.parquet"),
        "unknown file format": ([str(tmp / "data.xyz")], "data.xyz"),
        "unknown columns": ([str(write_jsonl(tmp / "cols.jsonl", [{"foo": 1}]))], "cannot tell the format"),
        "missing field": ([str(good), "--text-field", "body"], "--text-field"),
        "null field": ([str(write_jsonl(tmp / "null.jsonl", [{"text": "a"}, {"text": None}]))], "line 2"),
        "empty dataset": ([str(empty)], "empty.json"),
        "all empty": ([str(write_jsonl(tmp / "blank.jsonl", [{"text": ""}, {"text": " "}]))], "empty"),
        "all dropped": ([str(good), "--max-len", "2", "--overlong", "drop"], "dropped"),
        "bad tokenizer": ([str(good), "--tokenizer", str(tmp / "no-tokenizer")], "no-tokenizer"),
        "non-utf8": ([str(latin)], "UTF-8"),
        "id outside vocabulary": (
            [str(write_jsonl(tmp / "ids.jsonl", [{"input_ids": [5, 6]}, {"input_ids": [7, 99999]}]))],
            "ids.jsonl line 2: token id 99999 is outside",
        ),
        "mixed fields": (
            [str(good), str(write_jsonl(tmp / "other.jsonl", [{"body": "x"}]))],
            "cannot tell the format from the columns of " + str(tmp / "other.jsonl"),
        ),
        "explicit field misses one file": (
            [str(good), str(write_jsonl(tmp / "pairs.jsonl", [{"question": "q", "answer": "a"}])), "--text-field", "text"],
            "column 'text' not found in " + str(tmp / "pairs.jsonl"),
        ),
        "explicit format misses one file": (
            [str(write_jsonl(tmp / "pairs.jsonl", [{"question": "q", "answer": "a"}])), str(good), "--format", "instruction"],
            "column 'prompt' not found in " + str(good),
        ),
        "chat without template": (
            [
                str(write_jsonl(tmp / "chat.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])),
                "--tokenizer",
                str(_no_template(tmp)),
            ],
            "no chat template",
        ),
        "mixed formats in one file": (
            [
                str(
                    write_jsonl(
                        tmp / "mixed.jsonl",
                        [{"messages": [{"role": "user", "content": "hi"}]}] * 3 + [{"instruction": "add 2 and 2", "output": "4"}],
                    )
                )
            ],
            "mixed.jsonl line 4: the file mixes formats: this row has the fields instruction, output (instruction "
            "format), but the file is read as chat, which needs 'messages' in every row: split it into one file per "
            "format",
        ),
        "text too long to cut": (
            [str(write_jsonl(tmp / "long.jsonl", [{"text": "fine"}, {"text": "x" * (MAX_PIECE_CHARS + 1)}]))],
            f"long.jsonl line 2: the text of {MAX_PIECE_CHARS + 1:,} characters has no place within",
        ),
        "zero batch rows": ([str(good), "--batch-rows", "0"], "--batch-rows must be >= 1"),
        "zero group size": ([str(good), "--group-size", "0"], "--group-size must be >= 1"),
        "zero workers": ([str(good), "--num-proc", "0"], "--num-proc must be between 1 and 1024, got 0"),
    }


CASES = [
    "missing file",
    "corrupt json",
    "corrupt parquet",
    "unknown file format",
    "unknown columns",
    "missing field",
    "null field",
    "empty dataset",
    "all empty",
    "all dropped",
    "bad tokenizer",
    "non-utf8",
    "chat without template",
    "id outside vocabulary",
    "mixed fields",
    "explicit field misses one file",
    "explicit format misses one file",
    "zero batch rows",
    "zero group size",
    "zero workers",
    "mixed formats in one file",
    "text too long to cut",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_nonzero_exit_and_no_output(tmp_path: Path, case: str):
    args, needle = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    tokenizer = [] if "--tokenizer" in args else ["--tokenizer", TOKENIZER]
    max_len = [] if "--max-len" in args else ["--max-len", "64"]
    result = CliRunner().invoke(pack_data, [*args, *tokenizer, *max_len, "--out", str(out), "--no-progress"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert needle in lines[0], lines[0]
    assert not out.exists() and leftovers(tmp_path) == []


def test_disk_full_leaves_nothing_behind(tmp_path: Path, pretok: Path, monkeypatch: pytest.MonkeyPatch):
    def full(path, table):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(pipeline.write.shard_writer, "write_shard", full)
    out = tmp_path / "o"
    result = run(pretok, "--tokenizer", TOKENIZER, "--max-len", 32, "--out", out)
    assert result.exit_code == 1 and "disk full" in result.output and "Traceback" not in result.output
    assert not out.exists() and leftovers(tmp_path) == []


def test_final_check_does_not_rehash_but_catches_a_changed_shard(tmp_path: Path, pretok: Path, monkeypatch: pytest.MonkeyPatch):
    calls: list[bool] = []
    real = pipeline.engines.job.verify_folder

    def spy(folder, *, check_hashes=True, checked=None):
        calls.append(check_hashes)
        assert checked and all(s.tokens > 0 for s in checked.values())  # each shard checked as written
        return real(folder, check_hashes=check_hashes, checked=checked)

    monkeypatch.setattr(pipeline.engines.job, "verify_folder", spy)
    monkeypatch.setattr(pipeline.shards.verify, "file_sha256", lambda path: pytest.fail("final check re-hashed a shard"))
    out = tmp_path / "o"
    result = run(pretok, "--tokenizer", TOKENIZER, "--max-len", 32, "--out", out)
    assert result.exit_code == 0, result.output
    assert calls == [False]
    monkeypatch.undo()
    assert verify_folder(out, check_hashes=True).rows >= 1  # the recorded sha256 are right

    def spy_and_grow(folder, *, check_hashes=True, checked=None):  # a shard changes after the checks
        manifest = real(folder, check_hashes=check_hashes, checked=checked)
        with open(Path(folder) / manifest.shards[0].file, "ab") as handle:
            handle.write(b"\0" * 8)
        return manifest

    monkeypatch.setattr(pipeline.engines.job, "verify_folder", spy_and_grow)
    result = run(pretok, "--tokenizer", TOKENIZER, "--max-len", 32, "--out", tmp_path / "o2")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "shard-00000.arrow: shard is" in result.output and "were written" in result.output
    assert not (tmp_path / "o2").exists() and leftovers(tmp_path) == []


def test_shard_checked_as_written_names_shard_and_row(tmp_path: Path, pretok: Path, monkeypatch: pytest.MonkeyPatch):
    """What is checked is the file on disk: a bad shard written by the writer thread is caught."""
    real = pipeline.write.shard_writer.write_shard

    def write_bad(path, table):  # shard 1 reaches the disk with row 0's position_ids not restarting
        if path.name == "shard-00001.arrow":
            col = table.column("position_ids").combine_chunks()
            flat = col.values.to_numpy().copy()
            flat[1] += 7
            new = pa.ListArray.from_arrays(col.offsets, pa.array(flat, pa.int32()))
            table = table.set_column(2, table.schema.field("position_ids"), new)
        real(path, table)

    monkeypatch.setattr(pipeline.write.shard_writer, "write_shard", write_bad)
    out = tmp_path / "o"
    result = CliRunner().invoke(
        pack_data, [str(pretok), "--tokenizer", TOKENIZER, "--max-len", "8", "--rows-per-shard", "1", "--out", str(out), "--no-progress"]
    )
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "shard-00001.arrow row 0 example 0 " in lines[0] and "token 1: position_ids" in lines[0]
    assert not out.exists() and leftovers(tmp_path) == []


def test_shard_changed_after_its_check_is_checked_again(tmp_path: Path, pretok: Path, monkeypatch: pytest.MonkeyPatch):
    """A shard rewritten (same size) after the checker thread saw it is re-read by the final step."""
    import time

    from packed_factory import rewrite_shard, shard_arrays

    real = pipeline.engines.job.verify_folder
    rechecked: list[str] = []
    real_summarize = pipeline.shards.verify.summarize_shard

    def spy_summarize(path, *args, **kwargs):
        rechecked.append(Path(path).name)
        return real_summarize(path, *args, **kwargs)

    def tamper_then_verify(folder, *, check_hashes=True, checked=None):
        time.sleep(0.05)  # past the file system's timestamp granularity
        arrays = shard_arrays(Path(folder) / "shard-00001.arrow")
        arrays["labels"][1] = arrays["input_ids"][1] + 1  # neither -100 nor the input id
        rewrite_shard(folder, 1, arrays, update_hash=False)
        monkeypatch.setattr(pipeline.shards.verify, "summarize_shard", spy_summarize)
        return real(folder, check_hashes=check_hashes, checked=checked)

    monkeypatch.setattr(pipeline.engines.job, "verify_folder", tamper_then_verify)
    out = tmp_path / "o"
    result = run(pretok, "--tokenizer", TOKENIZER, "--max-len", 8, "--rows-per-shard", 1, "--out", out)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "shard-00001.arrow row 0 example 0 " in result.output
    assert "is neither -100 nor the input id" in result.output
    assert rechecked == ["shard-00001.arrow"]  # the unchanged shards were not read again
    assert not out.exists() and leftovers(tmp_path) == []


def test_interrupt_leaves_no_folder_that_looks_finished(tmp_path: Path, pretok: Path, monkeypatch: pytest.MonkeyPatch):
    def interrupted(path, table):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.write.shard_writer, "write_shard", interrupted)
    out = tmp_path / "o"
    result = CliRunner().invoke(pack_data, [str(pretok), "--tokenizer", TOKENIZER, "--max-len", "32", "--out", str(out), "--no-progress"])
    assert result.exit_code == 130
    assert not out.exists() and leftovers(tmp_path) == []


def test_progress_total_is_estimated_from_metadata_or_newlines(tmp_path: Path):
    from pipeline.progress import estimate_rows
    from pipeline.read.sources import resolve_inputs

    a = write_jsonl(tmp_path / "a.jsonl", [{"text": str(i)} for i in range(7)])
    pq.write_table(pa.table({"text": ["x"] * 5}), tmp_path / "b.parquet")
    files = resolve_inputs([str(a), str(tmp_path / "b.parquet")])
    assert estimate_rows(files) == 12
    assert estimate_rows(files, limit=3) == 3
    (tmp_path / "c.json").write_text(json.dumps([{"text": "x"}]))
    assert estimate_rows(resolve_inputs([str(tmp_path / "c.json")])) is None  # unknown without parsing


def test_spill_read_in_one_window_or_many_gives_the_same_shards(tmp_path: Path, monkeypatch):
    import pipeline.tokenize.spill

    shas = []
    for window in (pipeline.tokenize.spill.MAP_WINDOW_BYTES, 4096):  # the whole spill mapped at once / a page at a time
        monkeypatch.setattr(pipeline.tokenize.spill, "MAP_WINDOW_BYTES", window)
        out = tmp_path / f"o{window}"
        result = run(
            SAMPLE / "instructions.jsonl",
            "--tokenizer",
            TOKENIZER,
            "--max-len",
            512,
            "--out",
            out,
            "--overlong",
            "split",
            "--rows-per-shard",
            50,
        )
        assert result.exit_code == 0, result.output
        shas.append([s.sha256 for s in read_manifest(out).shards])
    assert len(shas[0]) > 1 and shas[0] == shas[1]


def test_a_later_run_removes_what_killed_runs_left(tmp_path: Path):
    """A run killed outright leaves its hidden temporary folder; the next run with the same --out
    removes those of this host whose process is gone, and nothing else."""
    import os
    import socket
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid now names no process
    host = socket.gethostname()
    stale = tmp_path / f".o.tmp-{host}-{gone.pid}-0123abcd"
    kept = [
        tmp_path / f".o.tmp-{host}-{os.getpid()}-0123abcd",  # a process that exists
        tmp_path / f".o.tmp-other-host-{gone.pid}-0123abcd",  # another host's
        tmp_path / f".other.tmp-{host}-{gone.pid}-0123abcd",  # another output's
        tmp_path / f".o.old-{gone.pid}-0123abcd",
    ]  # an old output being replaced: never touched
    for folder in [stale, *kept]:
        (folder / "_spill").mkdir(parents=True)
        (folder / "_spill" / "input_ids.bin").write_bytes(b"\0" * 64)
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": f"example {i} " * (i + 1)} for i in range(30)])
    result = run(data, "--tokenizer", TOKENIZER, "--max-len", 64, "--out", tmp_path / "o")
    assert result.exit_code == 0, result.output
    assert not stale.exists()
    assert all(folder.exists() for folder in kept)
    verify_folder(tmp_path / "o")


def test_the_no_loss_warning_names_the_causes_this_data_can_have(tmp_path: Path):
    """Instruction examples cut at --max-len before their response are blamed on the cut, not on
    chat rows (there are none); a chat file's warning names the missing assistant turn."""
    long = {"instruction": "word " * 200, "output": "the answer"}
    data = write_jsonl(tmp_path / "inst.jsonl", [{"instruction": "hi", "output": "hello"}] * 3 + [long] * 2)
    result = run(data, "--tokenizer", TOKENIZER, "--max-len", 64, "--out", tmp_path / "o")
    assert result.exit_code == 0, result.output
    warning = next(line for line in result.output.splitlines() if line.startswith("warning: "))
    assert warning.startswith("warning: 2 packed example(s) have no token that carries a loss"), warning
    assert "cut at --max-len 64 before their response begins: 2 were truncated" in warning, warning
    assert "chat" not in warning, warning

    talk = [{"role": "user", "content": "hello there"}]
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": talk + [{"role": "assistant", "content": "hi"}]}] * 3 + [{"messages": talk}])
    result = run(chat, "--tokenizer", TOKENIZER, "--max-len", 256, "--out", tmp_path / "c")
    warning = next(line for line in result.output.splitlines() if line.startswith("warning: "))
    assert "(likely chat rows without an assistant turn)" in warning and "truncated" not in warning, warning


def test_num_proc_is_capped_at_the_cpus_this_process_may_use(tmp_path: Path, monkeypatch):
    """--num-proc 64 where the affinity mask allows 2 CPUs: 2 tokenizer processes (recorded in the
    manifest), said in one line; within the CPUs, the value is kept, without a line. pack-report's
    what-if gets the same cap."""
    import os

    from pipeline.cli import pack_report

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    data = SAMPLE / "instructions.jsonl"
    capped = CliRunner().invoke(
        pack_data,
        [
            str(data),
            "--tokenizer",
            TOKENIZER,
            "--max-len",
            "2048",
            "--limit",
            "50",
            "--num-proc",
            "64",
            "--no-progress",
            "--out",
            str(tmp_path / "a"),
        ],
    )
    assert capped.exit_code == 0, capped.output
    assert "pack-data: --num-proc 64 capped at 2, the CPUs this process may use\n" in capped.stderr
    assert read_manifest(tmp_path / "a").config["num_proc"] == 2
    kept = CliRunner().invoke(
        pack_data,
        [
            str(data),
            "--tokenizer",
            TOKENIZER,
            "--max-len",
            "2048",
            "--limit",
            "50",
            "--num-proc",
            "2",
            "--no-progress",
            "--out",
            str(tmp_path / "b"),
        ],
    )
    assert kept.exit_code == 0 and "capped" not in kept.output
    assert read_manifest(tmp_path / "b").config["num_proc"] == 2
    report = CliRunner().invoke(
        pack_report, ["--input", str(data), "--tokenizer", TOKENIZER, "--limit", "50", "--max-len", "2048", "--num-proc", "1000"]
    )
    assert report.exit_code == 0, report.output
    assert "pack-report: --num-proc 1000 capped at 2, the CPUs this process may use\n" in report.stderr
