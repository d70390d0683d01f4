"""Inputs and --out on remote storage (pipeline.read.remote): an S3 server (moto, on 127.0.0.1) started
by the tests, and file:// URIs. Both engines give the shards of the same job on local files."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.cli import pack_data, pack_verify
from pipeline.engines.job import PackConfig, run_pack_data
from pipeline.shards import read_manifest, verify_folder

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = str(ROOT / "data" / "tokenizer")
SAMPLE = ROOT / "data" / "sample"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 (skipped without moto); yields a pyarrow S3 filesystem."""
    server_mod = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    patch = pytest.MonkeyPatch()
    for k, v in env.items():
        patch.setenv(k, v)
    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket="data")
    fs = pafs.S3FileSystem(endpoint_override=env["AWS_ENDPOINT_URL"], access_key="test", secret_key="test", region="us-east-1")
    yield fs
    patch.undo()
    server.stop()


def upload(fs, local: Path, key: str) -> None:
    pafs.copy_files(str(local), f"data/{key}", source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def fetch(fs, key: str, local: Path) -> Path:
    pafs.copy_files(f"data/{key}", str(local), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    return local


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*.arrow"))}


def pack(inputs: list[str], out: str, **options):
    config = PackConfig(
        inputs=inputs, tokenizer=TOKENIZER, max_len=options.pop("max_len", 1024), out=out, progress=False, num_proc=2, **options
    )
    return run_pack_data(config)


@pytest.fixture(scope="module")
def corpus(s3, tmp_path_factory) -> Path:
    """The sample instructions as s3://data/corpus/{a.jsonl, b.parquet, README.txt}; local copies beside."""
    local = tmp_path_factory.mktemp("corpus")
    shutil.copy(SAMPLE / "instructions.jsonl", local / "a.jsonl")
    rows = [json.loads(line) for line in (SAMPLE / "chat.jsonl").read_text().splitlines() if line.strip()]
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows[:500]), local / "b.parquet", row_group_size=100)
    (local / "README.txt").write_text("not data")
    for name in ("a.jsonl", "b.parquet", "README.txt"):
        upload(s3, local / name, f"corpus/{name}")
    return local


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_s3_inputs_and_out_give_the_local_jobs_shards(s3, corpus: Path, tmp_path: Path, engine: str) -> None:
    if engine == "ray":
        pytest.importorskip("ray")
    local = tmp_path / "local"
    pack([str(corpus)], str(local), mix="b.parquet=2", eval_examples=50)
    uri = f"s3://data/out-{engine}"
    manifest = pack(["s3://data/corpus"], uri, engine=engine, mix="b.parquet=2", eval_examples=50, tmp_dir=str(tmp_path))
    got = tmp_path / "got"
    pafs.copy_files(f"data/out-{engine}", str(got), source_filesystem=s3, destination_filesystem=pafs.LocalFileSystem())
    assert digests(got) == digests(local) and len(digests(got)) >= 2  # the eval folder's shards too
    verify_folder(got)
    m = read_manifest(got)
    assert [i["path"] for i in m.inputs] == ["s3://data/corpus/a.jsonl", "s3://data/corpus/b.parquet"]
    assert [i["sha256"] for i in m.inputs] == [hashlib.sha256((corpus / n).read_bytes()).hexdigest() for n in ("a.jsonl", "b.parquet")]
    assert [s["input"] for s in m.sources] == ["s3://data/corpus/a.jsonl", "s3://data/corpus/b.parquet"]
    assert m.config["inputs"] == ["s3://data/corpus"] and manifest.rows == m.rows
    assert sorted(p.name for p in tmp_path.iterdir()) == ["got", "local"]  # nothing staged is left
    deep = CliRunner().invoke(pack_verify, [str(got), "--deep", "--sample", "20"])  # re-reads the s3 inputs
    assert deep.exit_code == 0 and "20 examples re-tokenized and matched" in deep.output, deep.output


def test_a_glob_and_a_single_file(s3, corpus: Path, tmp_path: Path) -> None:
    local = tmp_path / "local"
    pack([str(corpus / "a.jsonl")], str(local))
    for given in ("s3://data/corpus/*.jsonl", "s3://data/corpus/a.jsonl"):
        out = tmp_path / given.rsplit("/", 1)[1].replace("*", "all")
        m = pack([given], str(out))
        assert digests(out) == digests(local)
        assert [i["path"] for i in m.inputs] == ["s3://data/corpus/a.jsonl"]


def test_an_error_in_a_remote_input_names_its_uri_and_nothing_is_written(s3, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{broken\n')
    upload(s3, bad, "broken/bad.jsonl")
    result = CliRunner().invoke(
        pack_data,
        ["s3://data/broken/bad.jsonl", "--tokenizer", TOKENIZER, "--max-len", "64", "--out", "s3://data/out-broken", "--no-progress"],
    )
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: s3://data/broken/bad.jsonl line 2: malformed JSON"), result.output
    assert s3.get_file_info(pafs.FileSelector("data/out-broken", allow_not_found=True)) == []


def test_remote_out_overwrite_rules(s3, corpus: Path, tmp_path: Path) -> None:
    uri = "s3://data/out-rules"
    pack([str(corpus / "a.jsonl")], uri, max_len=512, rows_per_shard=100)
    first = {i.path for i in s3.get_file_info(pafs.FileSelector("data/out-rules"))}
    assert len(first) > 3
    args = [str(corpus / "a.jsonl"), "--tokenizer", TOKENIZER, "--max-len", "2048", "--out", uri, "--no-progress"]
    result = CliRunner().invoke(pack_data, args)
    assert result.exit_code != 0 and "already exists: pass --overwrite" in result.output
    result = CliRunner().invoke(pack_data, [*args, "--overwrite"])
    assert result.exit_code == 0, result.output
    got = fetch(s3, "out-rules/manifest.json", tmp_path / "manifest.json")
    data = json.loads(got.read_text())
    assert data["max_len"] == 2048
    now = {i.path for i in s3.get_file_info(pafs.FileSelector("data/out-rules"))}
    assert now == {"data/out-rules/manifest.json"} | {f"data/out-rules/{s['file']}" for s in data["shards"]}  # old shards gone
    (tmp_path / "notes.txt").write_text("mine")
    upload(s3, tmp_path / "notes.txt", "out-rules/notes.txt")
    result = CliRunner().invoke(pack_data, [*args, "--overwrite"])
    assert result.exit_code != 0 and "holds 'notes.txt', which pack-data did not write" in result.output
    assert "data/out-rules/notes.txt" in {i.path for i in s3.get_file_info(pafs.FileSelector("data/out-rules"))}


def test_file_uris(tmp_path: Path) -> None:
    local = tmp_path / "local"
    pack([str(SAMPLE / "text.jsonl")], str(local))
    m = pack([f"file://{SAMPLE / 'text.jsonl'}"], f"file://{tmp_path / 'out'}")
    assert digests(tmp_path / "out") == digests(local)
    assert m.inputs[0]["path"] == f"file://{SAMPLE / 'text.jsonl'}"


def test_a_missing_remote_input_is_one_line(s3, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        pack_data,
        ["s3://data/nothing/here.jsonl", "--tokenizer", TOKENIZER, "--max-len", "64", "--out", str(tmp_path / "o"), "--no-progress"],
    )
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == ["Error: input not found: s3://data/nothing/here.jsonl: check the bucket and key"], (
        result.output
    )


def test_a_remote_glob_is_recorded_as_its_uri_and_deep_verify_re_reads_it(s3, corpus: Path, tmp_path: Path) -> None:
    """The manifest's config keeps a remote glob as the URI given (not `<cwd>/file:/...`), so
    `pack-verify --deep` downloads and re-tokenizes from it; for s3:// and file:// alike."""
    for given in ("s3://data/corpus/*.jsonl", f"file://{SAMPLE}/te*.jsonl"):
        out = tmp_path / given.split("://")[0]
        m = pack([given], str(out))
        assert m.config["inputs"] == [given] and read_manifest(out).config["inputs"] == [given]
        deep = CliRunner().invoke(pack_verify, [str(out), "--deep", "--sample", "5"])
        assert deep.exit_code == 0 and "5 examples re-tokenized and matched" in deep.output, deep.output


def test_pack_verify_and_pack_report_read_a_packed_folder_by_its_uri(s3, corpus: Path, tmp_path: Path) -> None:
    """A packed folder on remote storage is checked and reported where it is (downloaded to a
    temporary folder, which goes); its defects and a missing folder are one line naming the URI."""
    from pipeline.cli import pack_report

    uri = "s3://data/packed-to-read"
    pack([str(corpus / "a.jsonl")], uri, max_len=512, eval_examples=20)
    local = tmp_path / "local"
    pafs.copy_files("data/packed-to-read", str(local), source_filesystem=s3, destination_filesystem=pafs.LocalFileSystem())
    for folder in (uri, f"file://{local}"):
        ok = CliRunner().invoke(pack_verify, [folder, "--deep", "--sample", "5"])
        assert ok.exit_code == 0 and ok.output.startswith("ok: ") and "eval ok: " in ok.output, ok.output
        report = CliRunner().invoke(pack_report, [folder, "--json", str(tmp_path / "r.json")])
        assert report.exit_code == 0, report.output
        assert json.loads((tmp_path / "r.json").read_text())["rows"] == read_manifest(local).rows
    shard = sorted(local.glob("shard-*.arrow"))[0]
    data = bytearray(shard.read_bytes())
    data[-200] ^= 1
    (tmp_path / "bad.arrow").write_bytes(bytes(data))
    upload(s3, tmp_path / "bad.arrow", f"packed-to-read/{shard.name}")
    for command in (pack_verify, pack_report):
        bad = CliRunner().invoke(command, [uri])
        lines = bad.output.strip().splitlines()
        assert bad.exit_code == 1 and f"{uri}/{shard.name}" in lines[-1] and "packlm-read-" not in bad.output, bad.output
    missing = CliRunner().invoke(pack_verify, ["s3://data/no-such-folder"])
    assert missing.exit_code == 1 and missing.output.strip().splitlines() == [
        "Error: s3://data/no-such-folder: no folder there (expected the --out folder of pack-data): check the bucket and key"
    ], missing.output
    leftovers = [p for p in Path(tempfile.gettempdir()).glob("packlm-read-*")]
    assert not leftovers, leftovers
