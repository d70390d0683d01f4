"""Datasets and tokenizers named by Hugging Face Hub id (`pipeline.read.hub`): they pack exactly as the
same files given by path, the manifest records id, revision and commit, pack-verify --deep reads the
recorded commit, and every failure (not cached offline, not found, gated, a typo'd path) is one line
within seconds. Everything runs offline on a Hugging Face cache the tests build (`hf_cache`), or
against a local fake Hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_cache import C1, C2, add_snapshot, fake_hub, folder_files, hf_home  # noqa: F401 - hf_home is a fixture

from pipeline.engines.job import PackConfig, run_pack_data
from pipeline.errors import UserError
from pipeline.read import hub
from pipeline.read.sources import resolve_inputs
from pipeline.report.deep_check import deep_check
from pipeline.shards import read_manifest, verify_folder
from pipeline.tokenize.tokenize_inputs import tokenize_examples

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "data" / "sample" / "instructions.jsonl"
TOKENIZER = ROOT / "data" / "tokenizer"

pytestmark = pytest.mark.skipif(
    not (SAMPLE.is_file() and (TOKENIZER / "tokenizer.json").is_file()), reason="embedded sample data not present"
)


def _rows() -> list[dict]:
    return [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]


def _parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=16)
    return path


@pytest.fixture
def dataset_files(tmp_path: Path) -> dict[str, Path]:
    """A Hub-style dataset: train in two parquet files, test in one (`data/<split>-*.parquet`)."""
    rows = _rows()
    src = tmp_path / "dataset-src"
    return {
        "data/train-00000-of-00002.parquet": _parquet(src / "data" / "train-00000-of-00002.parquet", rows[:40]),
        "data/train-00001-of-00002.parquet": _parquet(src / "data" / "train-00001-of-00002.parquet", rows[40:80]),
        "data/test-00000-of-00001.parquet": _parquet(src / "data" / "test-00000-of-00001.parquet", rows[80:100]),
    }


def _pack(tmp_path: Path, name: str, inputs: list[str], tokenizer: str, **kw: object) -> Path:
    out = tmp_path / name
    run_pack_data(PackConfig(inputs=inputs, tokenizer=tokenizer, max_len=512, out=str(out), num_proc=1, progress=False, **kw))  # type: ignore[arg-type]
    return out


def _shard_hashes(folder: Path) -> list[str]:
    return [s.sha256 for s in read_manifest(folder).shards]


# ------------------------------------------------------------------------------------ id or path


@pytest.mark.parametrize(
    "spec, want",
    [
        ("meta-llama/Llama-2-7b-hf", hub.HubRef("meta-llama/Llama-2-7b-hf")),
        ("Qwen/Qwen2.5-7B@v1.0", hub.HubRef("Qwen/Qwen2.5-7B", "v1.0")),
        ("org/name@refs/pr/1", hub.HubRef("org/name", "refs/pr/1")),
        ("./org/name", None),
        ("/org/name", None),
        ("~/org/name", None),
        ("org/name.jsonl", None),
        ("org/data.parquet", None),
        ("gpt2", None),
        ("a/b/c", None),
        ("org/", None),
        ("org/name@", None),
        ("org--x/name", None),
        ("org/na me", None),
        ("data/tokenizr", None),  # data/ is a folder here (the repository root): a typo'd path
    ],
)
def test_path_or_id_is_decided_without_the_network(spec: str, want: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert hub.hub_ref(spec) == want


@pytest.mark.parametrize(
    "spec, want",
    [
        ("org/data", hub.HubRef("org/data")),
        ("org/data:test", hub.HubRef("org/data", split="test")),
        ("org/data@v2:cfg:test", hub.HubRef("org/data", "v2", "cfg", "test")),
        ("org/data::test", None),
        ("org/data:a:b:c", None),
        ("org/x.jsonl:train", None),
    ],
)
def test_dataset_ids_take_a_config_and_a_split(spec: str, want: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert hub.hub_ref(spec, dataset=True) == want


def test_an_existing_path_is_a_path_even_when_it_looks_like_an_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert hub.hub_ref("org/name") == hub.HubRef("org/name")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.hub_ref("org/name") is None


# ------------------------------------------------------------------------------------ same bytes


def test_dataset_and_tokenizer_by_id_pack_exactly_as_the_same_files_by_path(
    hf_home: Path, dataset_files: dict[str, Path], tmp_path: Path
) -> None:
    add_snapshot(hf_home, "dataset", "someone/sample-sft", dataset_files, C1)
    add_snapshot(hf_home, "model", "someone/tok", folder_files(TOKENIZER), C2)
    by_id = _pack(tmp_path, "by-id", ["someone/sample-sft"], "someone/tok")
    train = [str(dataset_files[k]) for k in sorted(dataset_files) if "/train-" in k]
    by_path = _pack(tmp_path, "by-path", train, str(TOKENIZER))
    assert _shard_hashes(by_id) == _shard_hashes(by_path)
    manifest = read_manifest(by_id)
    assert manifest.counts.examples_read == 80  # train only: the test split's 20 rows are not in it
    assert manifest.config["inputs"] == ["someone/sample-sft"] and manifest.config["tokenizer"] == "someone/tok"
    assert [Path(e["path"]).name for e in manifest.inputs] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    assert [e["sha256"] for e in manifest.inputs] == [e["sha256"] for e in read_manifest(by_path).inputs]
    assert all(
        e["hub"]
        == {"input": "someone/sample-sft", "id": "someone/sample-sft", "revision": None, "commit": C1, "config": None, "split": "train"}
        for e in manifest.inputs
    )
    assert manifest.tokenizer["hub"] == {"id": "someone/tok", "revision": None, "commit": C2}
    assert "hub" not in read_manifest(by_path).tokenizer
    assert manifest.tokenizer["fingerprint"] == read_manifest(by_path).tokenizer["fingerprint"]
    # the test split by name, at a revision by name
    (hf_home / "hub" / "datasets--someone--sample-sft" / "refs" / "v1").write_text(C1)
    test = _pack(tmp_path, "test-split", ["someone/sample-sft@v1:test"], "someone/tok@" + C2)
    assert read_manifest(test).counts.examples_read == 20
    assert read_manifest(test).inputs[0]["hub"]["revision"] == "v1"
    assert _shard_hashes(test) == _shard_hashes(
        _pack(tmp_path, "test-path", [str(dataset_files["data/test-00000-of-00001.parquet"])], str(TOKENIZER))
    )


def test_the_dataset_cards_configs_choose_the_files(hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _rows()
    card = (
        "---\nconfigs:\n- config_name: short\n  data_files:\n  - split: train\n    path: short/*.parquet\n"
        "  default: true\n- config_name: long\n  data_files:\n  - split: train\n    path: long/train.jsonl\n"
        "  - split: validation\n    path: long/val.jsonl\n---\n# a card\n"
    )
    long_train = tmp_path / "src" / "train.jsonl"
    long_train.parent.mkdir()
    long_train.write_text("".join(json.dumps(r) + "\n" for r in rows[:30]))
    files = {
        "README.md": card.encode(),
        "short/x.parquet": _parquet(tmp_path / "src" / "x.parquet", rows[:5]),
        "long/train.jsonl": long_train,
        "long/val.jsonl": long_train,
    }
    add_snapshot(hf_home, "dataset", "someone/configs", files, C1)
    monkeypatch.chdir(tmp_path)
    assert [Path(f.path).name for f in resolve_inputs(["someone/configs"])] == ["x.parquet"]  # the default
    assert [Path(f.path).parent.name + "/" + Path(f.path).name for f in resolve_inputs(["someone/configs:long:validation"])] == [
        "long/val.jsonl"
    ]
    assert _shard_hashes(_pack(tmp_path, "long", ["someone/configs:long:train"], str(TOKENIZER))) == _shard_hashes(
        _pack(tmp_path, "long-path", [str(long_train)], str(TOKENIZER))
    )
    with pytest.raises(UserError, match=r"has no split 'test': choose one of train, validation") as err:
        resolve_inputs(["someone/configs:long:test"])
    assert "\n" not in str(err.value)
    with pytest.raises(
        UserError,
        match=r"has configs short, long: name one as someone/configs:CONFIG:SPLIT "
        r"\('nope' is none of them\)",
    ):
        resolve_inputs(["someone/configs:nope:train"])


@pytest.mark.parametrize(
    "card, spec, field",
    [
        ("configs:\n- config_name: c\n  data_dir: ../../../outside\n", "someone/hostile:c:train", "data_dir"),
        ("configs:\n- config_name: c\n  data_dir: OUTSIDE\n", "someone/hostile:c:train", "data_dir"),
        (
            "configs:\n- config_name: c\n  data_files:\n  - split: train\n    path: ../../../outside/*.jsonl\n",
            "someone/hostile:c:train",
            "data_files",
        ),
        (
            "configs:\n- config_name: c\n  data_files:\n  - split: train\n    path: OUTSIDE/*.jsonl\n",
            "someone/hostile:c:train",
            "data_files",
        ),
        ("configs:\n- config_name: c\n  data_files:\n  - split: train\n    path: linked/*.jsonl\n", "someone/hostile:c:train", "file"),
        ("", "someone/hostile:../../../outside:train", "config"),
    ],
    ids=["data_dir climbs", "data_dir absolute", "data_files climb", "data_files absolute", "a linked folder", "config climbs"],
)
def test_a_dataset_card_path_that_leaves_the_snapshot_is_one_line(hf_home: Path, tmp_path: Path, card: str, spec: str, field: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.jsonl").write_text(json.dumps({"text": "not in the dataset"}) + "\n")
    card = card.replace("OUTSIDE", str(outside))
    files = {"README.md": f"---\n{card}---\n".encode(), "data/train.jsonl": SAMPLE}
    snapshot = add_snapshot(hf_home, "dataset", "someone/hostile", files, C1)
    (snapshot / "linked").symlink_to(outside)
    with pytest.raises(UserError) as err:
        resolve_inputs([spec])
    line = str(err.value)
    assert "\n" not in line and "dataset someone/hostile" in line and field in line, line
    assert "which leaves" in line and ("climbs out" in line or "absolute" in line or "symbolic link" in line), line


def test_a_revision_that_climbs_is_one_line(hf_home: Path) -> None:
    with pytest.raises(UserError, match=r"revision '../../x' is no branch, tag or commit \(it climbs out"):
        resolve_inputs(["someone/hostile@../../x:train"])


# ------------------------------------------------------------------------------------ revisions


def test_pack_verify_deep_reads_the_recorded_commit(hf_home: Path, dataset_files: dict[str, Path], tmp_path: Path) -> None:
    add_snapshot(hf_home, "dataset", "someone/sample-sft", dataset_files, C1)
    add_snapshot(hf_home, "model", "someone/tok", folder_files(TOKENIZER), C1)
    out = _pack(tmp_path, "packed", ["someone/sample-sft"], "someone/tok")
    # main moves on: other rows, another tokenizer commit; --deep still reads what was packed
    rows = _rows()
    changed = {"data/train-00000-of-00001.parquet": _parquet(tmp_path / "new" / "t.parquet", rows[::-1][:50])}
    add_snapshot(hf_home, "dataset", "someone/sample-sft", changed, C2)
    hub._RESOLVED.clear()  # as in a new process, which would see the new main
    from pipeline.report.deep_check import pinned_config

    manifest = verify_folder(out)
    assert pinned_config(manifest)["inputs"] == [f"someone/sample-sft@{C1}:train"]
    assert pinned_config(manifest)["tokenizer"] == f"someone/tok@{C1}"
    assert deep_check(out, manifest, None, sample=30) == 30
    # the control: main's files (the manifest's config as written) are not what was packed
    fresh = tokenize_examples(dict(manifest.config), [0])
    assert fresh[0][0].tolist() != tokenize_examples(pinned_config(manifest), [0])[0][0].tolist()


# ------------------------------------------------------------------------------------ failures


def _pack_data_cli(tmp_path: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    """pack-data in its own process. "At once" is asserted as what the command asks of the Hub (once,
    or never), not as its seconds: those depend on the machine's load."""
    code = "import sys; from pipeline.cli import pack_data; sys.argv[0] = 'pack-data'; pack_data()"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def _env(hf_home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    return {**env, "PYTHONPATH": str(ROOT), "HF_HOME": str(hf_home), **extra}


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


@pytest.mark.parametrize("flag", [[], ["--offline"]])
def test_an_id_not_in_the_cache_fails_offline_in_one_line_within_seconds(hf_home: Path, tmp_path: Path, flag: list[str]) -> None:
    with fake_hub(404, "RepoNotFound") as (url, asked):  # (offline, nothing may ask it)
        env = _env(hf_home, HF_ENDPOINT=url, **({} if flag else {"HF_HUB_OFFLINE": "1"}))
        proc = _pack_data_cli(
            tmp_path,
            str(SAMPLE),
            "--tokenizer",
            "someone/not-cached",
            "--max-len",
            "64",
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
            *flag,
            env=env,
        )
        line = _one_line(proc)
        assert "tokenizer someone/not-cached is not in the local Hugging Face cache" in line
        assert "downloads are off (--offline / HF_HUB_OFFLINE=1)" in line and "hf download someone/not-cached" in line
        assert not (tmp_path / "o").exists()
        proc = _pack_data_cli(
            tmp_path,
            "someone/no-data:train",
            "--tokenizer",
            str(TOKENIZER),
            "--max-len",
            "64",
            "--out",
            str(tmp_path / "o"),
            *flag,
            env=env,
        )
        assert "dataset someone/no-data is not in the local Hugging Face cache" in _one_line(proc)
    assert [p for p in asked if "someone/" in p] == []  # at once: the Hub was never asked
    assert "--repo-type dataset" in proc.stderr


@pytest.mark.parametrize("spec, what", [("./tokenizer-typo", "tokenizer"), ("data/tokenizr", "tokenizer"), ("data/x.jsonl", "input")])
def test_a_typod_path_is_a_path_and_the_hub_is_never_asked(hf_home: Path, tmp_path: Path, spec: str, what: str) -> None:
    (tmp_path / "data").mkdir()
    with fake_hub(404, "RepoNotFound") as (url, asked):
        env = _env(hf_home, HF_ENDPOINT=url)  # online: only the path rule keeps the Hub out
        inputs, tokenizer = ([spec], str(TOKENIZER)) if what == "input" else ([str(SAMPLE)], spec)
        proc = _pack_data_cli(tmp_path, *inputs, "--tokenizer", tokenizer, "--max-len", "64", "--out", str(tmp_path / "o"), env=env)
    line = _one_line(proc)
    assert (f"tokenizer folder {spec} not found" if what == "tokenizer" else f"input not found: {spec}") in line
    assert asked == []


@pytest.mark.parametrize(
    "status, code, want",
    [
        (404, "RepoNotFound", "is neither a local path nor a model repo on the Hugging Face Hub"),
        (401, None, "the Hugging Face Hub refused access (401)"),
        (403, "GatedRepo", "the Hugging Face Hub refused access (403)"),
    ],
)
def test_not_found_and_gated_answers_are_one_line_at_once(hf_home: Path, tmp_path: Path, status: int, code: str | None, want: str) -> None:
    with fake_hub(status, code) as (url, asked):
        proc = _pack_data_cli(
            tmp_path,
            str(SAMPLE),
            "--tokenizer",
            "someone/private-tok",
            "--max-len",
            "64",
            "--out",
            str(tmp_path / "o"),
            env=_env(hf_home, HF_ENDPOINT=url),
        )
    line = _one_line(proc)
    assert "tokenizer someone/private-tok" in line and want in line, line
    if status != 404:
        assert f"log in with `hf auth login` or set HF_TOKEN, and accept the license at {url}/someone/private-tok" in line
    repo = [p for p in asked if "someone/" in p]  # (huggingface_hub may also ask for its own things)
    assert len(repo) == 1 and repo[0].startswith("/api/models/someone/private-tok"), asked  # no retries
    assert not (tmp_path / "o").exists()


def test_a_dataset_that_is_not_on_the_hub_is_one_line(hf_home: Path, tmp_path: Path) -> None:
    with fake_hub(404, "RepoNotFound") as (url, asked):
        proc = _pack_data_cli(
            tmp_path,
            "someone/no-such-data:train",
            "--tokenizer",
            str(TOKENIZER),
            "--max-len",
            "64",
            "--out",
            str(tmp_path / "o"),
            env=_env(hf_home, HF_ENDPOINT=url),
        )
    assert "dataset someone/no-such-data is neither a local path nor a dataset repo" in _one_line(proc)
    repo = [p for p in asked if "someone/" in p]
    assert len(repo) == 1 and repo[0].startswith("/api/datasets/someone/no-such-data"), asked


def test_a_revision_the_hub_does_not_have_and_a_hub_that_is_down_are_one_line(hf_home: Path, tmp_path: Path) -> None:
    with fake_hub(404, "RevisionNotFound") as (url, asked):
        proc = _pack_data_cli(
            tmp_path,
            str(SAMPLE),
            "--tokenizer",
            "someone/tok@no-such-branch",
            "--max-len",
            "64",
            "--out",
            str(tmp_path / "o"),
            env=_env(hf_home, HF_ENDPOINT=url),
        )
    assert "tokenizer someone/tok has no revision 'no-such-branch' on the Hugging Face Hub" in _one_line(proc)
    assert len([p for p in asked if "someone/" in p]) == 1
    with fake_hub(503) as (url, asked):  # down: the cache would do; here it holds nothing
        proc = _pack_data_cli(
            tmp_path,
            str(SAMPLE),
            "--tokenizer",
            "someone/tok",
            "--max-len",
            "64",
            "--out",
            str(tmp_path / "o"),
            env=_env(hf_home, HF_ENDPOINT=url),
        )
    assert (
        "tokenizer someone/tok is not in the local Hugging Face cache" in _one_line(proc)
        and "the Hugging Face Hub cannot be reached (it answered 503)" in proc.stderr
    )
    assert len([p for p in asked if "someone/" in p]) == 1
    # the control: with the tokenizer in the cache, a Hub that is down does not stop the job
    add_snapshot(hf_home, "model", "someone/tok", folder_files(TOKENIZER), C1)
    with fake_hub(503) as (url, asked):
        proc = _pack_data_cli(
            tmp_path,
            str(SAMPLE),
            "--tokenizer",
            "someone/tok",
            "--max-len",
            "512",
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
            env=_env(hf_home, HF_ENDPOINT=url),
        )
    assert proc.returncode == 0, proc.stderr
    assert read_manifest(tmp_path / "o").tokenizer["hub"] == {"id": "someone/tok", "revision": None, "commit": C1}
