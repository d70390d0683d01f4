"""Errors raised to a Python caller of the API name the config's parameters, never a console
command's flag it cannot pass; the console commands keep their flags."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline import PackConfig, run_pack_data
from pipeline.api_errors import parameter_names
from pipeline.cli import pack_data
from pipeline.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "data" / "tokenizer")


def test_flags_are_spelled_as_parameters() -> None:
    spell = lambda text: parameter_names(text, PackConfig)  # noqa: E731
    assert (
        spell("output folder o already exists: pass --overwrite to replace it, or choose another --out")
        == "output folder o already exists: pass overwrite=True to replace it, or choose another out"
    )
    assert (
        spell("a.jsonl line 3: example is 900 tokens, longer than --max-len 512")
        == "a.jsonl line 3: example is 900 tokens, longer than max_len 512"
    )
    assert spell("--overlong=split; --no-progress; --text-field") == "overlong='split'; progress=False; text_field"
    # not an option of the config, or not a flag at all: unchanged
    assert spell("see pack-data --help; --deep; a--b; ---x") == "see pack-data --help; --deep; a--b; ---x"


def test_run_pack_data_names_its_parameter_and_pack_data_its_flag(tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    config = PackConfig(
        inputs=[str(ROOT / "data" / "sample" / "text.jsonl")], tokenizer=TOKENIZER, max_len=256, out=str(out), limit=10, progress=False
    )
    with pytest.raises(UserError) as err:
        run_pack_data(config)
    assert str(err.value) == f"output folder {out} already exists: pass overwrite=True to replace it, or choose another out"
    assert "--" not in str(err.value)
    result = CliRunner().invoke(
        pack_data, [*config.inputs, "--tokenizer", TOKENIZER, "--max-len", "256", "--out", str(out), "--limit", "10", "--no-progress"]
    )
    assert result.exit_code == 1 and "pass --overwrite to replace it, or choose another --out" in result.output
    assert (out / "mine.txt").read_text() == "keep"
