"""scripts/tools/make_long_data.py: long chat and text examples that land at the requested token counts
(as pack-data counts them), the same for the same seed, and packed whole at --max-len 1048576."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.cli import pack_data
from pipeline.shards import IGNORE_INDEX, iter_rows, read_manifest
from pipeline.tokenize.tokenize_inputs import lengths_of

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "data" / "tokenizer")
SHARED = ROOT.parent / "shared"
LLAMA2 = SHARED / "tokenizers" / "llama2"


def _script():
    spec = importlib.util.spec_from_file_location("make_long_data", ROOT / "scripts" / "tools" / "make_long_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _script()


def make(script, out: Path, *args: str) -> list[dict]:
    assert script.main([*args, "--out", str(out)]) == 0
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_examples_land_exactly_at_the_lengths_asked_for(script, tmp_path: Path, kind: str, capsys):
    records = make(script, tmp_path / "a.jsonl", "--kind", kind, "--lengths", "3000,40000", "--count", "2")
    assert len(records) == 4
    assert set(records[0]) == ({"messages"} if kind == "chat" else {"text"})
    assert lengths_of(str(tmp_path / "a.jsonl"), TOKENIZER).tolist() == [3000, 3000, 40000, 40000]
    assert "example 3: 40000 tokens\n" in capsys.readouterr().out
    if kind == "chat":  # a system prompt, then user and assistant turns in turn, ending with an answer
        roles = [m["role"] for m in records[2]["messages"]]
        assert roles[0] == "system" and roles[1::2] == ["user"] * (len(roles) // 2)
        assert roles[2::2] == ["assistant"] * (len(roles) // 2) and len(roles) <= script.MAX_MESSAGES + 3
    assert records[0] != records[1]  # each example takes further units of the source


def test_the_same_options_give_the_same_file_and_another_seed_another(script, tmp_path: Path):
    args = ("--lengths", "2500", "--count", "2")
    make(script, tmp_path / "a.jsonl", *args)
    make(script, tmp_path / "b.jsonl", *args)
    make(script, tmp_path / "c.jsonl", *args, "--seed", "1")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()


def test_a_million_token_conversation_packs_whole_into_one_row(script, tmp_path: Path):
    data = tmp_path / "long.jsonl"
    make(script, data, "--lengths", "1048576,140000")
    out = tmp_path / "packed"
    result = CliRunner().invoke(
        pack_data, [str(data), "--tokenizer", TOKENIZER, "--max-len", "1048576", "--num-proc", "1", "--out", str(out), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    assert (manifest.counts.truncated, manifest.counts.examples_packed) == (0, 2)
    assert manifest.total_tokens == 1048576 + 140000
    rows = sorted(iter_rows(out), key=lambda r: -len(r["input_ids"]))
    assert [r["seq_lens"].tolist() for r in rows] == [[1048576], [140000]]  # a full row alone; the other
    for row in rows:
        np.testing.assert_array_equal(row["position_ids"], np.arange(len(row["input_ids"])))
        labels = row["labels"]
        # the template's rendering as it is: its <|im_start|> 4 first (no BOS: it writes none), its own end
        # of turn (<|im_end|> 5, then its "\n"), no EOS after it
        assert labels[0] == IGNORE_INDEX and row["input_ids"][0] == 4 and row["input_ids"][-2] == 5
        trained = labels != IGNORE_INDEX
        assert 0.3 < trained.mean() < 0.9  # the assistant turns only (answers), not the questions


@pytest.mark.skipif(not (SHARED / "datasets").is_dir(), reason="needs ../shared/datasets")
def test_shared_source_gives_gsm8k_and_codealpaca_turns(script, tmp_path: Path):
    records = make(script, tmp_path / "s.jsonl", "--source", "shared", "--lengths", "4000", "--seed", "3")
    assert lengths_of(str(tmp_path / "s.jsonl"), TOKENIZER).tolist() == [4000]
    questions = {r["question"] for r in map(json.loads, (SHARED / "datasets/gsm8k/train.jsonl").open())}
    questions |= {r["instruction"] for r in json.loads((SHARED / "datasets/codealpaca/code_alpaca.json").read_text())}
    users = [m["content"] for m in records[0]["messages"] if m["role"] == "user"]
    asked = [q.split("\n\n")[0] for u in users for q in u.removeprefix("Question 1: ").split("\n\nQuestion ")]
    asked = [q.split(": ", 1)[1] if q[:1].isdigit() else q for q in asked]
    assert len(asked) > 3 and sum(q in questions for q in asked) >= len(asked) - 1


@pytest.mark.skipif(not LLAMA2.is_dir(), reason="needs ../shared/tokenizers/llama2")
def test_a_tokenizer_without_a_chat_template_is_one_line_and_no_file(script, tmp_path: Path):
    out = tmp_path / "x.jsonl"
    with pytest.raises(SystemExit) as exc:
        script.main(["--lengths", "3000", "--tokenizer", str(LLAMA2), "--out", str(out)])
    message = str(exc.value.code)
    assert message.startswith("error: ") and "has no chat template" in message and "\n" not in message
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--lengths", "4k"], "expected comma-separated integers"),
        (["--lengths", "10"], "each length must be at least 64 tokens"),
        (["--count", "0"], "--count must be at least 1"),
    ],
)
def test_bad_options_are_refused(script, tmp_path: Path, args: list[str], needle: str, capsys):
    with pytest.raises(SystemExit) as exc:
        script.main([*args, "--out", str(tmp_path / "x.jsonl")])
    assert exc.value.code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
