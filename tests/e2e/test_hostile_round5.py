"""Hostile cases of issue 70's fifth round: folders that nest where one command would read back or
remove what another wrote, and YAML 1.1 spellings in config files. The refusals are about what the
command decides, not about its process, so the commands run in this process (`in_process.run_here`):
each case checks the exit status, the one line, and that the user's files are byte for byte as before;
a control next to each shows the same command working where it may.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from in_process import Finished, run_here
from test_hostile_inputs import SAMPLE, TOKENIZER, error_line, snapshot, write_jsonl

from pipeline.cli import pack_data
from pipeline.config_file import read_config_file
from pipeline.errors import UserError
from pipeline.foreign.config import DATA, TRAIN
from trainer.cli import pack_train
from trainer.config import TrainConfig
from trainer.run.nesting import refuse_nested_run
from trainer.run.preflight import refuse_foreign_out

PACK = ("--tokenizer", TOKENIZER, "--max-len", 256)


def one_line(proc: Finished) -> str:
    """The error line of a refused command: exit 1, no traceback, and that line alone on stderr."""
    line = error_line(proc)
    assert len(proc.stderr_text.strip().splitlines()) == 1, proc.stderr_text
    return line


# ------------------------------------------------------------- pack-data: --out among the inputs


def _corpus(tmp: Path) -> Path:
    folder = tmp / "corpus"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", [{"text": f"first file, line {i}"} for i in range(6)])
    write_jsonl(folder / "sub" / "b.jsonl", [{"text": f"second file, line {i}"} for i in range(4)])
    (tmp / "corpus-link").symlink_to(folder, target_is_directory=True)
    return folder


NESTED_OUT = {
    "--out inside the input folder": (("corpus", "--out", "corpus/packed"), "inside the input folder corpus"),
    "--out deep inside the input folder": (("corpus", "--out", "corpus/sub/x/packed"), "inside the input folder"),
    "--out inside the folder, given through a link": (("corpus-link", "--out", "corpus/packed"), "inside the input folder corpus-link"),
    "--out inside the folder, itself through a link": (("corpus", "--out", "corpus-link/packed"), "inside the input folder corpus"),
    "--out the input file's folder": (("corpus/a.jsonl", "--out", "corpus", "--overwrite"), "input corpus/a.jsonl is inside --out corpus"),
    "an input inside --out": (("corpus/sub/b.jsonl", "--out", "corpus", "--overwrite"), "is inside --out corpus"),
    "--out the working folder holding the input": (("corpus/a.jsonl", "--out", ".", "--overwrite"), "is inside --out ."),
    "a glob matching --out": (("corpus/*", "--out", "corpus/packed"), "the input glob 'corpus/*' reaches"),
    "a recursive glob": (("corpus/**/*.jsonl", "--out", "corpus/sub/packed"), "reaches"),
    "a glob matching a folder above --out": (("c*s", "--out", "corpus/packed"), "reaches"),
    "a glob reaching into --out": (("corpus/*/*.arrow", "--out", "corpus/packed"), "reaches"),
}


@pytest.mark.parametrize("case", NESTED_OUT)
def test_an_out_that_nests_with_an_input_is_one_line_and_changes_nothing(tmp_path: Path, case: str) -> None:
    args, needle = NESTED_OUT[case]
    _corpus(tmp_path)
    before = snapshot(tmp_path)
    line = one_line(run_here("pack-data", *args, *PACK, cwd=tmp_path))
    assert needle in line and "choose an --out" in line, line
    assert snapshot(tmp_path) == before  # no output, no temporary folder, no lock left


def _examples(folder: Path) -> int:
    return json.loads((folder / "manifest.json").read_text())["counts"]["examples_read"]


def test_an_out_beside_the_inputs_is_packed_and_a_second_run_reads_the_same_examples(tmp_path: Path) -> None:
    _corpus(tmp_path)
    runs = [
        ("corpus/a.jsonl", "--out", "corpus/packed-a"),  # beside an input file: only that file is read
        ("corpus/*.jsonl", "--out", "corpus/packed-g"),  # a glob that cannot match the output
        ("corpus/sub", "--out", "corpus/sub-packed"),
    ]  # a sibling whose name starts like the folder's
    for args in runs * 2:
        done = run_here("pack-data", *args, *PACK, "--overwrite", cwd=tmp_path)
        assert done.returncode == 0, done.stderr_text
    assert [_examples(tmp_path / args[-1]) for args in runs] == [6, 6, 4]


def test_the_python_api_refuses_the_same(tmp_path: Path) -> None:
    from pipeline import PackConfig, run_pack_data

    _corpus(tmp_path)
    with pytest.raises(UserError, match="inside the input folder"):
        run_pack_data(
            PackConfig(inputs=[str(tmp_path / "corpus")], tokenizer=str(TOKENIZER), max_len=256, out=str(tmp_path / "corpus" / "packed"))
        )
    assert not (tmp_path / "corpus" / "packed").exists()


# ------------------------------------------------------------- pack-train: nested run folders


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("packed")
    done = run_here("pack-data", SAMPLE, *PACK, "--limit", 40, "--out", "packed", cwd=tmp)
    assert done.returncode == 0, done.stderr_text
    return tmp / "packed"


def _run_folder(folder: Path, with_config: bool = True) -> Path:
    """What a run pack-train wrote looks like: its config.json and a checkpoint."""
    (folder / "checkpoints" / "step-00000002").mkdir(parents=True)
    if with_config:
        record = {"data": "packed", "model": "tiny", "out": str(folder), "tokens_per_step": 512, "grad_accum": 1}
        (folder / "config.json").write_text(json.dumps(record))
    return folder


def _layout(tmp: Path, packed: Path) -> None:
    shutil.copytree(packed, tmp / "packed")
    _run_folder(tmp / "runA")
    _run_folder(tmp / "runC", with_config=False)  # a run stopped before it wrote config.json
    shutil.copytree(packed, tmp / "runB" / "checkpoints" / "data")
    _run_folder(tmp / "runB")
    shutil.copytree(packed, tmp / "runB" / "packed")


NESTED_RUN = {
    "--out inside a run folder": (("--data", "packed", "--out", "runA/ablation"), "inside the run folder"),
    "--out inside a run's checkpoints": (("--data", "packed", "--out", "runA/checkpoints/step-00000009"), "inside the run folder"),
    "--out inside a run without config.json": (("--data", "packed", "--out", "runC/sub"), "inside the run folder"),
    "--data inside --out's checkpoints": (
        ("--data", "runB/checkpoints/data", "--out", "runB", "--resume"),
        "--data runB/checkpoints/data is inside runB/checkpoints",
    ),
    "--eval-data inside --out's checkpoints": (
        ("--data", "packed", "--eval-data", "runB/checkpoints/data", "--out", "runB", "--resume"),
        "--eval-data runB/checkpoints/data is inside runB/checkpoints",
    ),
    "--out inside the packed folder": (("--data", "packed", "--out", "packed/run"), "inside the --data folder"),
}


@pytest.mark.parametrize("case", NESTED_RUN)
def test_a_run_folder_that_nests_with_another_is_one_line_and_changes_nothing(packed: Path, tmp_path: Path, case: str) -> None:
    args, needle = NESTED_RUN[case]
    _layout(tmp_path, packed)
    before = snapshot(tmp_path)
    line = one_line(run_here("pack-train", *args, "--model", "tiny", "--max-steps", 1, cwd=tmp_path))
    assert needle in line, line
    assert snapshot(tmp_path) == before


def test_a_run_beside_other_runs_and_data_inside_a_run_folder_are_accepted(packed: Path, tmp_path: Path) -> None:
    """Controls: a sibling of a run folder, and --data in a part of --out the run never writes
    (RUN/packed: a run writes only config.json, metrics, checkpoints/, merged/ ... into RUN)."""
    _layout(tmp_path, packed)
    for data, out in (("packed", "runD"), ("packed", "runA-2"), ("runB/packed", "runB")):
        config = TrainConfig(data=str(tmp_path / data), model="tiny", out=str(tmp_path / out))
        refuse_foreign_out(config)
        refuse_nested_run(config)
    with pytest.raises(UserError, match="inside the run folder"):
        refuse_nested_run(TrainConfig(data=str(tmp_path / "packed"), model="tiny", out=str(tmp_path / "runA" / "x")))


# ------------------------------------------------------------- YAML 1.1 spellings in config files


def _settings(tmp: Path, text: str, command, foreign: str) -> dict:
    cfg = tmp / "c.yaml"
    cfg.write_text(text)
    return read_config_file(cfg, command, foreign=foreign, mapping=[])


MEANT = [  # (file text, command, option -> the value the user meant)
    ("no-progress: yes\n", pack_train, {"no_progress": True}),
    ("no-progress: Off\n", pack_train, {"no_progress": False}),
    ("resume: on\n", pack_train, {"resume": "newest"}),
    ("out: off\nmodel: no\n", pack_train, {"out": "off", "model": "no"}),  # text options keep the text
    ("max-steps: 0o17\n", pack_train, {"max_steps": 15}),  # YAML 1.2's octal, text to YAML 1.1
    ("tokens-per-step: 1_024\n", pack_train, {"tokens_per_step": 1024}),
    ("inputs: [no, '017', 1:30]\ntokenizer: on\n", pack_data, {"inputs": ["no", "017", "1:30"], "tokenizer": "on"}),
    ("text-field: yes\n", pack_data, {"text_field": "yes"}),
    ("base_model: tiny\ngradient_checkpointing: yes\n", pack_train, {"grad_checkpointing": 1}),  # Axolotl reads true
    ("base_model: tiny\ngradient_checkpointing: no\n", pack_train, {"grad_checkpointing": 0}),
    ("model_name_or_path: tiny\nbf16: on\n", pack_train, {"dtype": "bf16"}),  # TRL
]


def _ids(cases: list[tuple]) -> list[str]:
    return [case[0].strip().replace("\n", " ") for case in cases]


@pytest.mark.parametrize(("text", "command", "meant"), MEANT, ids=_ids(MEANT))
def test_a_yaml_1_1_spelling_reaches_the_option_as_meant(tmp_path: Path, text: str, command, meant: dict) -> None:
    foreign = TRAIN if command is pack_train else DATA
    settings = _settings(tmp_path, text, command, foreign)
    got = {k: settings.get(k) for k in meant}
    assert got == meant and all(type(got[k]) is type(meant[k]) for k in meant), settings


REFUSED = [  # (file text, command, the key named, what the line says)
    ("lr: 1:30\n", pack_train, "lr", "base-60 number to YAML 1.1 (90)"),
    ("lr: 1:30.5\n", pack_train, "lr", "(90.5)"),
    ("max-steps: 017\n", pack_train, "max-steps", "write 15 or 17"),
    ("seed: -0_17\n", pack_data, "seed", "octal"),
    ("lr: yes\n", pack_train, "lr", "not a number"),
    ("max-len: off\n", pack_data, "max-len", "not a number"),
    ("no-progress: 1:30\n", pack_train, "no-progress", "not true or false"),
    ("lr: .nan\n", pack_train, "lr", "must be a number, got nan"),
    ("warmup: .inf\n", pack_train, "warmup", "must be an integer, got inf"),
    ("max-len: -.inf\n", pack_data, "max-len", "must be an integer"),
    ("base_model: tiny\nlearning_rate: 1:30\n", pack_train, "learning_rate", "base-60"),
    ("base_model: tiny\nnum_epochs: 010\n", pack_train, "num_epochs", "write 8 or 10"),
    ("base_model: tiny\nmax_steps: 0o17\n", pack_train, "max_steps", "text to YAML 1.1 (Axolotl, TRL): write 15"),
    ("base_model: tiny\nlearning_rate: .inf\n", pack_train, "learning_rate", "must be a number"),
    ("model_name_or_path: tiny\nnum_train_epochs: 1:00\n", pack_train, "num_train_epochs", "base-60"),
    ("datasets:\n  - path: a.jsonl\n    type: alpaca\nsequence_len: 8:32\n", pack_data, "sequence_len", "base-60"),
]


@pytest.mark.parametrize(("text", "command", "key", "needle"), REFUSED, ids=_ids(REFUSED))
def test_a_yaml_1_1_number_is_refused_naming_file_and_key(tmp_path: Path, text: str, command, key: str, needle: str) -> None:
    with pytest.raises(UserError) as caught:
        _settings(tmp_path, text, command, TRAIN if command is pack_train else DATA)
    line = str(caught.value)
    assert f"{tmp_path / 'c.yaml'}" in line and f"key {key!r}" in line and needle in line, line


def test_the_command_says_it_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("lr: 1:30\n")
    line = one_line(run_here("pack-train", "--config", "c.yaml", cwd=tmp_path))
    assert "c.yaml" in line and "'lr'" in line and "90" in line, line
    (tmp_path / "d.yaml").write_text("max-len: 0:30\n")
    line = one_line(run_here("pack-data", "--config", "d.yaml", cwd=tmp_path))
    assert "d.yaml" in line and "'max-len'" in line and "base-60" in line, line
