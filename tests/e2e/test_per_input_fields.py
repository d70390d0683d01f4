"""Inputs whose columns differ pack in one run, each read with its own fields (`--per-input`, issue 68):
every example is exactly what packing its input alone gives; a field an input lacks is one line;
the manifest records each input's own, so pack-verify --deep re-reads them; Axolotl's ALST example
(two completion datasets, `field: text` and `field: chapter`) packs as its two datasets would."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import pack_data, pack_report, pack_verify
from pipeline.shards import read_manifest
from tests.pipeline.test_pack_data import examples, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "data" / "tokenizer")
ALST = ROOT / "tests" / "data" / "foreign_configs" / "axolotl" / "alst_llama3-8b-fsdp2-alst.yaml"
FLAGS = ["--tokenizer", TOKENIZER, "--max-len", "256", "--num-proc", "1", "--no-progress"]


@pytest.fixture()
def data(tmp_path: Path) -> tuple[Path, Path]:
    """a.jsonl: documents in `text`; sub/b.jsonl: documents in `chapter`, with a short `text` column
    beside them that auto-detection would take instead (the wrong column)."""
    (tmp_path / "sub").mkdir()
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"document {i}: " + "words of a page " * (i + 2)} for i in range(9)])
    b = write_jsonl(
        tmp_path / "sub" / "b.jsonl",
        [{"chapter": f"chapter {i}: " + "a textbook chapter " * (i + 3), "text": f"title {i}"} for i in range(7)],
    )
    return a, b


def pack(*args: object, cwd: Path | None = None) -> object:
    here = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        return CliRunner().invoke(pack_data, [*map(str, args), *FLAGS])
    finally:
        os.chdir(here)


def token_lists(folder: Path) -> list[tuple[list[int], list[int]]]:
    """Every example's (ids, labels) in example-id order."""
    got = examples(folder)
    return [(sum((p[0] for p in got[i]), []), sum((p[1] for p in got[i]), [])) for i in sorted(got)]


def test_each_input_packs_exactly_as_it_would_alone(tmp_path: Path, data: tuple[Path, Path]):
    a, b = data
    both = pack(a, b, "--per-input", "b.jsonl:text-field=chapter", "--out", tmp_path / "both")
    assert both.exit_code == 0, both.output
    alone_a = pack(a, "--out", tmp_path / "a")
    alone_b = pack(b, "--text-field", "chapter", "--out", tmp_path / "b")
    assert alone_a.exit_code == alone_b.exit_code == 0
    got, want_a, want_b = token_lists(tmp_path / "both"), token_lists(tmp_path / "a"), token_lists(tmp_path / "b")
    assert (len(want_a), len(want_b)) == (9, 7)
    assert got == want_a + want_b
    formats = {Path(f["file"]).name: f["fields"] for f in read_manifest(tmp_path / "both").config["resolved_formats"]}
    assert formats == {"a.jsonl": {"text": "text"}, "b.jsonl": {"text": "chapter"}}
    # control: without --per-input, b.jsonl is read through its `text` column (the titles)
    auto = pack(a, b, "--out", tmp_path / "auto")
    assert auto.exit_code == 0, auto.output
    assert token_lists(tmp_path / "auto")[:9] == want_a and token_lists(tmp_path / "auto")[9:] != want_b
    # the entry wins over the option given for every input; the other input keeps the option (the entry
    # names the input by another spelling of its path)
    other = f"{tmp_path}/sub/../sub/b.jsonl"
    mixed = pack(a, b, "--text-field", "text", "--per-input", f"{other}:text-field=chapter", "--out", tmp_path / "mixed")
    assert mixed.exit_code == 0, mixed.output
    assert token_lists(tmp_path / "mixed") == want_a + want_b


@pytest.mark.parametrize(
    ("entry", "needles"),
    [
        ("b.jsonl:text-field=nope", ["column 'nope' not found in", "b.jsonl", "--per-input b.jsonl:text-field=COLUMN"]),
        ("c.jsonl:text-field=chapter", ["'c.jsonl' matches no input", "a.jsonl"]),
        ("b.jsonl:txt-field=chapter", ["is not INPUT:OPTION=VALUE", "text-field"]),
        ("b.jsonl:text-field=", ["gives text-field no value"]),
        ("b.jsonl:train-on-eos=sometimes", ["unknown --per-input b.jsonl:train-on-eos 'sometimes'", "turn, last"]),
        (
            "a.jsonl:template={question}",
            ["--per-input 'a.jsonl:template={question}': '{question}': use the placeholders {instruction} (or {prompt})"],
        ),
    ],
)
def test_a_field_an_input_lacks_or_a_bad_entry_is_one_line(tmp_path: Path, data: tuple[Path, Path], entry: str, needles: list[str]):
    a, b = data
    result = pack(a, b, "--per-input", entry, "--out", tmp_path / "out")
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert all(n in lines[0] for n in needles), lines[0]
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_two_values_of_one_option_for_one_input_are_one_line(tmp_path: Path, data: tuple[Path, Path]):
    a, b = data
    result = pack(a, b, "--per-input", "b.jsonl:text-field=chapter", "--per-input", f"{b}:text-field=text", "--out", tmp_path / "out")
    assert result.exit_code == 1 and "two values of --text-field ('chapter', 'text')" in result.stderr
    same = pack(
        a, b, "--per-input", "b.jsonl:text-field=chapter", "--per-input", f"{b}:text-field=chapter", "--out", tmp_path / "out"
    )  # control: the same value twice is one value
    assert same.exit_code == 0, same.output


def test_the_manifest_records_each_inputs_own_and_verify_rereads_them(tmp_path: Path, data: tuple[Path, Path]):
    """Given relative to the folder pack-data ran in, the entries are recorded with absolute inputs,
    so pack-verify --deep re-tokenizes every example the same from anywhere; pack-report names both."""
    result = pack("a.jsonl", "sub/b.jsonl", "--per-input", "sub/b.jsonl:text-field=chapter", "--out", "out", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    config = read_manifest(tmp_path / "out").config
    assert config["per_input"] == [f"{tmp_path / 'sub' / 'b.jsonl'}:text-field=chapter"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    here = os.getcwd()
    os.chdir(elsewhere)
    try:
        verified = CliRunner().invoke(pack_verify, [str(tmp_path / "out"), "--deep"])
        report = CliRunner().invoke(pack_report, [str(tmp_path / "out")])
    finally:
        os.chdir(here)
    assert verified.exit_code == 0 and "16 examples re-tokenized and matched" in verified.output, verified.output
    assert report.exit_code == 0, report.output
    assert str(tmp_path / "a.jsonl") in report.output and str(tmp_path / "sub" / "b.jsonl") in report.output
    # control: re-read without the entry, b.jsonl's examples are its titles, which the shards do not hold
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    from pipeline.tokenize.tokenize_inputs import tokenize_examples

    ids = token_lists(tmp_path / "out")
    assert [t[0].tolist() for t in tokenize_examples(manifest["config"], [12])] == [ids[12][0]]
    without = {**manifest["config"], "per_input": []}
    assert [t[0].tolist() for t in tokenize_examples(without, [12])] != [ids[12][0]]


def _long_documents(path: Path, column: str, words: list[int]) -> Path:
    """Documents of about 4.2 tokens a word under the project's tokenizer, in `column` (and a short
    `text` column beside them, which auto-detection would take)."""
    rng = random.Random(len(words))
    vocab = ["alpha", "beta", "gamma", "delta", "long", "context", "chapter", "page"]
    return write_jsonl(
        path,
        [
            {
                column: " ".join(f"{rng.choice(vocab)}{rng.randrange(1000)}" for _ in range(n)),
                **({"text": "a title"} if column != "text" else {}),
            }
            for n in words
        ],
    )


def test_axolotls_alst_example_packs_its_two_datasets_each_with_its_field(tmp_path: Path):
    """Axolotl 0.19.0's examples/alst/llama3-8b-fsdp2-alst.yaml, unchanged but for paths: its two
    datasets (completion, field: text; completion, field: chapter) swapped for local files of those
    columns, its model's tokenizer for the project's. Its sequence_len 500000 and min_sample_len 200000
    hold: the documents of 200,000 tokens and more pack, each as its dataset alone packs it, the short
    ones are dropped and said."""
    a = _long_documents(tmp_path / "rp_sub.jsonl", "text", [52000, 55000, 50])
    b = _long_documents(tmp_path / "chapters.jsonl", "chapter", [53000, 30])
    settings = yaml.safe_load(ALST.read_text())
    assert [(d["type"], d["field"]) for d in settings["datasets"]] == [("completion", "text"), ("completion", "chapter")]
    settings["datasets"][0]["path"] = str(a)
    del settings["datasets"][0]["data_files"]
    settings["datasets"][1]["path"] = str(b)
    settings["base_model"] = TOKENIZER

    def packed(name: str, datasets: list[dict]) -> object:
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({**settings, "datasets": datasets, "dataset_prepared_path": str(tmp_path / name)}))
        return CliRunner().invoke(pack_data, ["--config", str(cfg), "--num-proc", "1", "--no-progress"])

    result = packed("both", settings["datasets"])
    assert result.exit_code == 0, result.output
    assert "--per-input" in next(line for line in result.stderr.splitlines() if line.startswith("  datasets:"))
    assert "2 shorter than --min-len 200000 dropped" in result.output
    assert packed("a", settings["datasets"][:1]).exit_code == packed("b", settings["datasets"][1:]).exit_code == 0
    got = token_lists(tmp_path / "both")
    assert len(got) == 3 and min(len(ids) for ids, _ in got) >= 200_000
    assert got == token_lists(tmp_path / "a") + token_lists(tmp_path / "b")
    manifest = read_manifest(tmp_path / "both")
    assert (manifest.max_len, manifest.config["per_input"]) == (500_000, [f"{a}:text-field=text", f"{b}:text-field=chapter"])


def test_a_remote_input_is_named_as_given(tmp_path: Path, data: tuple[Path, Path]):
    """A remote input (here file://) is read from a local copy, but its entry names it as given, and
    pack-verify --deep matches the entry to it again."""
    a, b = data
    uri = b.as_uri()
    result = pack(a, uri, "--per-input", f"{uri}:text-field=chapter", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert pack(b, "--text-field", "chapter", "--out", tmp_path / "b").exit_code == 0
    assert token_lists(tmp_path / "out")[9:] == token_lists(tmp_path / "b")
    verified = CliRunner().invoke(pack_verify, [str(tmp_path / "out"), "--deep"])
    assert verified.exit_code == 0 and "16 examples re-tokenized and matched" in verified.output, verified.output
    wrong = pack(a, uri, "--per-input", f"{uri}x:text-field=chapter", "--out", tmp_path / "wrong")
    assert wrong.exit_code == 1 and f"use an INPUT as given ({a}, {uri})" in wrong.stderr, wrong.output


def test_chat_inputs_with_their_own_messages_field_and_loss_settings(tmp_path: Path):
    """One chat file in `messages`, another in `dialog` whose user turns train too and whose
    end-of-turn tokens carry no loss: ids and labels as each packed alone with its options."""
    rows = [json.loads(line) for line in (ROOT / "data" / "sample" / "chat.jsonl").read_text().splitlines()[:12]]
    c1 = write_jsonl(tmp_path / "c1.jsonl", rows[:6])
    c2 = write_jsonl(tmp_path / "c2.jsonl", [{"dialog": r["messages"]} for r in rows[6:]])
    own = ["--messages-field", "dialog", "--roles-to-train", "user", "--roles-to-train", "assistant", "--train-on-eos", "none"]
    both = pack(
        c1,
        c2,
        "--per-input",
        "c2.jsonl:messages-field=dialog",
        "--per-input",
        "c2.jsonl:roles-to-train=user,assistant",
        "--per-input",
        "c2.jsonl:train-on-eos=none",
        "--out",
        tmp_path / "both",
    )
    assert both.exit_code == 0, both.output
    assert pack(c1, "--out", tmp_path / "c1").exit_code == pack(c2, *own, "--out", tmp_path / "c2").exit_code == 0
    want_c2 = token_lists(tmp_path / "c2")
    assert token_lists(tmp_path / "both") == token_lists(tmp_path / "c1") + want_c2
    # control: the field alone, with the default loss settings, gives other labels (the same ids)
    field_only = pack(c1, c2, "--per-input", "c2.jsonl:messages-field=dialog", "--out", tmp_path / "field")
    assert field_only.exit_code == 0, field_only.output
    got = token_lists(tmp_path / "field")[6:]
    assert [g[0] for g in got] == [w[0] for w in want_c2] and [g[1] for g in got] != [w[1] for w in want_c2]


@pytest.mark.parametrize("given", ["sub", "sub/*.jsonl", "sub/b.jsonl:train[2:6]"])
def test_an_entry_names_a_folder_a_glob_or_a_share_as_given(tmp_path: Path, data: tuple[Path, Path], given: str):
    """Every file of a folder or glob input takes the entry; a share of an input's rows is named with it."""
    result = pack("a.jsonl", given, "--per-input", f"{given}:text-field=chapter", "--out", "out", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert pack(data[1], "--text-field", "chapter", "--out", tmp_path / "b").exit_code == 0
    want = token_lists(tmp_path / "b")
    assert token_lists(tmp_path / "out")[9:] == (want[2:6] if "[" in given else want)


def test_pack_report_what_if_reads_each_input_with_its_own(tmp_path: Path, data: tuple[Path, Path]):
    a, b = data
    args = ["--input", str(a), "--input", str(b), "--tokenizer", TOKENIZER, "--max-len", "256"]
    report = CliRunner().invoke(pack_report, [*args, "--per-input", "b.jsonl:text-field=chapter"])
    assert report.exit_code == 0 and "what-if: 16 examples" in report.output, report.output
    tokens = lambda out: next(line for line in out.splitlines() if line.startswith("what-if:"))
    alone_a = CliRunner().invoke(pack_report, ["--input", str(a), *args[4:]])
    alone_b = CliRunner().invoke(pack_report, ["--input", str(b), *args[4:], "--text-field", "chapter"])
    count = lambda out: int(tokens(out).rpartition(", ")[2].split()[0].replace(",", ""))
    assert count(report.output) == count(alone_a.output) + count(alone_b.output)
    auto = CliRunner().invoke(pack_report, args)  # control: b.jsonl's titles
    assert count(auto.output) < count(report.output)
    lacking = CliRunner().invoke(pack_report, [*args, "--per-input", "b.jsonl:text-field=nope"])
    assert lacking.exit_code == 1 and len(lacking.stderr.strip().splitlines()) == 1
    assert "column 'nope' not found in" in lacking.stderr and "b.jsonl" in lacking.stderr
