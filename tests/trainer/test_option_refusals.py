"""Options that a run cannot honour end in one line naming the option, before anything is written:
the Python API (`TrainConfig`, `PackConfig`) checks what the flags check, a resume refuses a changed
learning rate or schedule, an eval folder that holds training examples is refused, and so are
--save-best / --eval-every with nothing to evaluate on. Each with its negative control."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from packed_factory import random_packed_folder  # noqa: E402

from pipeline.api_errors import parameter_names  # noqa: E402
from pipeline.engines.job import PackConfig, run_pack_data  # noqa: E402
from pipeline.errors import UserError  # noqa: E402
from trainer import TrainConfig, train  # noqa: E402
from trainer.config import validate  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = str(ROOT / "data" / "sample" / "instructions.jsonl")
TEXT = str(ROOT / "data" / "sample" / "text.jsonl")
TOKENIZER = str(ROOT / "data" / "tokenizer")

pytestmark = pytest.mark.usefixtures("one_thread")


def api(message: str) -> str:
    """A pack-train line as `train()` says it to a Python caller: parameter names, not flags."""
    return parameter_names(message, TrainConfig)


# ------------------------------------------------------------------------------ the Python API


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"warmup": -1}, "--warmup must be >= 0, got -1"),
        ({"min_lr_ratio": 2}, "--min-lr-ratio must be between 0 and 1, got 2"),
        ({"lr": "3e-4"}, "--lr must be a number, got '3e-4' (str)"),
        ({"lr": 0.0}, "--lr must be > 0, got 0.0"),
        ({"max_steps": 2.9}, "--max-steps must be an integer, got 2.9 (float)"),
        ({"seed": True}, "--seed must be an integer, got True (bool)"),
        ({"tokens_per_step": 0}, "--tokens-per-step must be >= 1, got 0"),
        ({"schedule": "cosin"}, "unknown --schedule 'cosin': choose one of cosine, linear, constant"),
        ({"stop_at": 5, "max_steps": 3}, "--stop-at 5 is past --max-steps 3"),
        ({"lora_dropout": 1.0}, "--lora-dropout must be >= 0 and < 1, got 1.0"),
        ({"activation_memory_budget": 0.0}, "--activation-memory-budget must be > 0 and <= 1, got 0.0"),
        ({"seed": 2**64}, f"--seed must be a 64-bit integer (at most {2**63 - 1} either side of 0), got {2**64}"),
        ({"max_steps": 10**30}, "--max-steps must be a 64-bit integer"),
        ({"num_workers": 10**9}, "--num-workers must be between 0 and 1024, got 1000000000"),
        ({"lr": float("inf")}, "--lr must be a number, got inf"),
    ],
)
def test_train_refuses_what_pack_train_refuses(tmp_path: Path, change: dict, needle: str):
    """The same check as the flag's, in the API's words (parameter names, not flags)."""
    with pytest.raises(UserError, match=re.escape(parameter_names(needle, TrainConfig))):
        train(TrainConfig(data=str(tmp_path), model="tiny", out=str(tmp_path / "run"), **change))
    assert not (tmp_path / "run").exists()


def test_train_config_accepts_what_pack_train_accepts(tmp_path: Path):
    validate(TrainConfig(data=str(tmp_path), model="tiny", out=tmp_path / "run"))  # a Path is a path
    validate(
        TrainConfig(
            data="d",
            model="tiny",
            out="o",
            lr=1,
            min_lr_ratio=1,
            warmup=0,
            max_steps=3,
            stop_at=3,
            compile=None,
            resume="strict",
            lora_dropout=0.5,
        )
    )


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"inputs": SAMPLE}, "inputs must be a list of paths, e.g. ['a.jsonl'] (not one string), got '"),
        ({"max_len": 1024.7}, "--max-len must be an integer, got 1024.7 (float)"),
        ({"max_len": 1}, "--max-len must be between 2 and 16777216, got 1"),
        ({"seed": True}, "--seed must be an integer, got True (bool)"),
        ({"num_proc": "4"}, "--num-proc must be an integer, got '4' (str)"),
        ({"eval_fraction": 1}, "--eval-fraction must be between 0 and 1 (exclusive), got 1"),
        ({"strategy": "best"}, "unknown --strategy 'best'"),
        ({"train_on_prompt": "yes"}, "--train-on-prompt must be true or false, got 'yes'"),
        ({"max_len": 2**40}, f"--max-len must be between 2 and 16777216, got {2**40}"),
        ({"seed": 10**20}, "--seed must be a 64-bit integer"),
        ({"num_proc": 3 * 10**9}, "--num-proc must be between 1 and 1024, got 3000000000"),
    ],
)
def test_pack_config_refuses_what_pack_data_refuses(tmp_path: Path, change: dict, needle: str):
    config = PackConfig(
        **{
            **dict(inputs=[SAMPLE], tokenizer=TOKENIZER, max_len=512, out=str(tmp_path / "o"), limit=20, num_proc=1, progress=False),
            **change,
        }
    )
    with pytest.raises(UserError, match=re.escape(parameter_names(needle, PackConfig))):
        run_pack_data(config)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------ resume


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_packed_folder(tmp_path_factory.mktemp("rows"), 64, count=50, low=4, high=40, rows_per_shard=7)


def _config(data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        data=str(data),
        model="tiny",
        out=str(out),
        tokens_per_step=128,
        grad_accum=1,
        lr=2e-3,
        warmup=1,
        schedule="linear",
        max_steps=2,
        log_every=1,
        num_workers=0,
        progress=False,
    )
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"lr": 1e-3}, "trained with --lr 0.002 but this run has --lr 0.001"),
        ({"schedule": "cosine"}, "trained with --schedule linear but this run has --schedule cosine"),
        ({"warmup": 0}, "trained with --warmup 1 but this run has --warmup 0"),
        ({"min_lr_ratio": 0.5}, "trained with --min-lr-ratio 0.1 but this run has --min-lr-ratio 0.5"),
        ({"weight_decay": 0.0}, "trained with --weight-decay 0.1 but this run has --weight-decay 0.0"),
    ],
)
def test_resume_refuses_a_changed_learning_rate_or_schedule(rows: Path, tmp_path: Path, change: dict, needle: str):
    """The checkpoint's optimizer and scheduler states would go on with the old values while
    config.json recorded the new ones: refused, naming both values and the way on."""
    run = tmp_path / "run"
    train(_config(rows, run))
    before = (run / "config.json").read_text()
    with pytest.raises(UserError, match=re.escape(api(needle)) + r".*resume with [a-z_]+ \S+, or start a new run"):
        train(_config(rows, run, max_steps=4, resume="newest", **change))
    assert (run / "config.json").read_text() == before  # the record still tells what the checkpoint trained with
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def test_resume_with_the_same_schedule_still_continues(rows: Path, tmp_path: Path):
    run = tmp_path / "run"
    train(_config(rows, run))
    summary = train(_config(rows, run, max_steps=4, resume="newest", grad_clip=0.5))  # grad_clip is read per step
    assert summary["steps"] == 4
    lrs = [json.loads(line)["lr"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    # warmup 1, then linear from 2e-3 towards 0.1 x 2e-3 over the remaining 3 of 4 steps
    assert lrs == pytest.approx([2e-3, 2e-3, 2e-3 * (1 - 0.9 / 3), 2e-3 * (1 - 0.9 * 2 / 3)])
    assert json.loads((run / "config.json").read_text())["grad_clip"] == 0.5


# ------------------------------------------------------------------------------- eval folders


def _pack(out: Path, inputs: str = SAMPLE, **kw) -> Path:
    run_pack_data(PackConfig(inputs=[inputs], tokenizer=TOKENIZER, max_len=512, out=str(out), limit=120, num_proc=1, progress=False, **kw))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("eval")
    return {
        "train": _pack(base / "train", eval_fraction=0.1),  # train/eval: its own held-out split
        "other_job": _pack(base / "other", eval_fraction=0.1, seed=1),  # the same input, another split
        "text": _pack(base / "text", TEXT),
    }  # other data, no eval folder


def _run(data: Path, out: Path, **kw) -> dict:
    return train(
        TrainConfig(
            **{
                **dict(
                    data=str(data),
                    model="tiny",
                    tokenizer=TOKENIZER,
                    out=str(out),
                    tokens_per_step=1024,
                    max_steps=1,
                    num_workers=0,
                    progress=False,
                ),
                **kw,
            }
        )
    )


def test_an_eval_folder_holding_training_examples_is_refused(folders: dict[str, Path], tmp_path: Path):
    data = folders["train"]
    with pytest.raises(UserError, match=re.escape(api(f"--eval-data {data} is the training folder --data {data} itself"))):
        _run(data, tmp_path / "a", eval_data=str(data))
    other = folders["other_job"] / "eval"  # another job's eval split of the same input: examples we train on
    with pytest.raises(
        UserError,
        match=re.escape(api(f"--eval-data {other} overlaps the training folder --data {data}: both were packed from the same input "))
        + r".*instructions\.jsonl",
    ):
        _run(data, tmp_path / "b", eval_data=str(other))
    copy = tmp_path / "copy"  # a copy of the training shards
    shutil.copytree(data, copy, ignore=shutil.ignore_patterns("eval"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["inputs"], manifest["eval"] = [], {}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        UserError,
        match=r"overlaps the training folder .*: its shard-00000\.arrow is a shard of the "
        r"training data",
    ):
        _run(data, tmp_path / "c", eval_data=str(copy))
    assert not any((tmp_path / name).exists() for name in "abc")


def test_an_eval_file_holding_some_training_examples_is_refused_example_by_example(folders: dict[str, Path], tmp_path: Path):
    """Another file (other bytes, another pack-data run): most of its examples are new, a few are
    training examples; the per-example hashes find them."""
    new = [json.dumps({"instruction": f"Name the number {i}.", "input": "", "output": f"It is {i}."}) for i in range(30)]
    training = Path(SAMPLE).read_text().splitlines()[:20]  # at least 18 of these are not in DATA/eval
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join(new + training) + "\n")
    held = _pack(tmp_path / "held", str(mixed))
    with pytest.raises(
        UserError,
        match=r"overlaps the training folder .*: \d+ of its examples \(same tokens\) are "
        r"training examples",
    ):
        _run(folders["train"], tmp_path / "run", eval_data=str(held))
    assert not (tmp_path / "run").exists()


def test_a_held_out_eval_folder_is_still_evaluated(folders: dict[str, Path], tmp_path: Path):
    data = folders["train"]
    assert _run(data, tmp_path / "own", eval_data=str(data / "eval"))["eval_loss"] > 0  # its own split
    shutil.copytree(data / "eval", tmp_path / "moved")  # ... copied elsewhere
    assert _run(data, tmp_path / "moved-run", eval_data=str(tmp_path / "moved"))["eval_loss"] > 0
    assert _run(data, tmp_path / "text", eval_data=str(folders["text"]))["eval_loss"] > 0  # other data


def test_save_best_or_eval_every_with_nothing_to_evaluate_is_refused(folders: dict[str, Path], tmp_path: Path):
    text, data = folders["text"], folders["train"]
    with pytest.raises(UserError, match=re.escape(api(f"--save-best needs held-out data to evaluate on, but {text} holds no eval folder"))):
        _run(text, tmp_path / "a", save_best=True)
    with pytest.raises(
        UserError, match=re.escape(api("--eval-every 1 needs held-out data to evaluate on, but --eval-data none turns evaluation off"))
    ):
        _run(data, tmp_path / "b", eval_data="none", eval_every=1)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert _run(data, tmp_path / "c", eval_data="none")["eval_loss"] is None  # off without them: fine
    summary = _run(text, tmp_path / "d", eval_every=1, save_best=True, eval_data=str(data / "eval"))
    assert summary["eval_loss"] > 0 and (tmp_path / "d" / "best.json").is_file()
