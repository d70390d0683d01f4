"""`pack-train --report-to wandb`: what W&B recorded equals what the run wrote.

The run is offline (WANDB_MODE=offline, every W&B folder under tmp_path) and W&B's record of it is
read back from the run's transaction log (`RUN/wandb/offline-run-*/run-*.wandb`) with W&B's own
reader, `wandb leet inspect --json`. Then:
- every scalar of every metrics.jsonl line (all but "step"; nulls and strings are no scalars) is
  in W&B's history row of that line's step with the same value, and W&B's rows hold nothing else
  (its own "_" keys aside);
- the W&B run config is the run's TrainConfig (config.json without the world size);
- negative controls: a changed value, a dropped key or a shifted step is found by the same
  comparison, so it cannot pass by comparing nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

wandb = pytest.importorskip("wandb", reason="--report-to wandb needs the wandb package (pip install -e '.[dev]')")

sys.path.insert(0, str(Path(__file__).parents[2]))
from packed_factory import make_packed_folder, pack_lengths  # noqa: E402

from trainer.cli import pack_train  # noqa: E402

VOCAB = 300
STEPS = 4

pytestmark = pytest.mark.usefixtures("one_thread")


def _packed(folder: Path, n: int, seed: int) -> Path:
    lengths = np.random.default_rng(seed).integers(4, 40, size=n).tolist()
    make_packed_folder(
        folder,
        pack_lengths(lengths, 64, vocab=VOCAB, seed=seed),
        64,
        tokenizer={"name": "test", "fingerprint": "0" * 64, "vocab_size": VOCAB},
    )
    return folder


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """W&B offline and quiet, with all of its folders under tmp_path; torn down after the test
    (W&B keeps a service process per Python process until then)."""
    home = tmp_path / "wandb-home"
    for name in ("DIR", "CACHE_DIR", "CONFIG_DIR", "DATA_DIR", "ARTIFACT_DIR"):
        (home / name.lower()).mkdir(parents=True)
        monkeypatch.setenv(f"WANDB_{name}", str(home / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")  # no banner or run summary on the console
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # pytest's capture of stdout/stderr is left alone
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB__DISABLE_STATS", "true")  # no system-metrics sampler process
    monkeypatch.setenv("WANDB__DISABLE_MACHINE_INFO", "true")
    monkeypatch.setenv("WANDB__SAVE_REQUIREMENTS", "false")
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    yield
    wandb.teardown()


def wandb_records(run: Path) -> list[dict[str, Any]]:
    """The records of the run's W&B transaction log, one dict each, as `wandb leet inspect --json`
    prints them."""
    logs = list(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 1, logs
    done = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(logs[0])], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def history_rows(records: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(step, the scalars logged at it) of every history row, W&B's own "_" keys left out."""
    rows = [r["history"]["item"] for r in records if r.get("type") == "history"]
    return [(row["_step"], {k: v for k, v in row.items() if not k.startswith("_")}) for row in rows]


def run_config(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run config: the run record's, with the config records after it applied."""
    config: dict[str, Any] = {}
    for r in records:
        change = r["run"].get("config") if r.get("type") == "run" else r.get("config")
        if change:
            config.update(change.get("update", {}))
            for key in change.get("remove", []):
                config.pop(key, None)
    config.pop("_wandb", None)
    return config


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def mismatches(metrics: list[dict[str, Any]], rows: list[tuple[int, dict[str, Any]]]) -> tuple[list[str], int]:
    """Where W&B's history `rows` differ from the `metrics` lines, and how many values matched.
    The lines of one step (a training line and an eval line) make one W&B row."""
    expected: dict[int, dict[str, Any]] = {}
    for line in metrics:
        expected.setdefault(line["step"], {}).update({k: v for k, v in line.items() if k != "step" and _is_scalar(v)})
    got: dict[int, dict[str, Any]] = {}
    problems = []
    for step, row in rows:
        if step in got:
            problems.append(f"step {step}: two W&B history rows")
        got[step] = row
    for step in sorted(expected.keys() - got.keys()):
        problems.append(f"step {step}: in metrics.jsonl, not in W&B")
    for step in sorted(got.keys() - expected.keys()):
        problems.append(f"step {step}: in W&B, not in metrics.jsonl")
    compared = 0
    for step in sorted(expected.keys() & got.keys()):
        want, have = expected[step], got[step]
        for key in sorted(want.keys() | have.keys()):
            if key not in have:
                problems.append(f"step {step}: {key} missing in W&B")
            elif key not in want:
                problems.append(f"step {step}: {key}={have[key]!r} in W&B, not in metrics.jsonl")
            elif not _is_scalar(have[key]) or have[key] != want[key]:
                problems.append(f"step {step}: {key} {have[key]!r} in W&B, {want[key]!r} in metrics.jsonl")
            else:
                compared += 1
    return problems, compared


def test_wandb_records_the_scalars_of_metrics_jsonl_and_the_config(tmp_path: Path, offline_wandb: None):
    data = _packed(tmp_path / "packed", 40, seed=0)
    held = _packed(tmp_path / "held", 12, seed=1)
    run = tmp_path / "run"
    result = CliRunner().invoke(
        pack_train,
        [
            "--data",
            str(data),
            "--model",
            "tiny",
            "--out",
            str(run),
            "--max-steps",
            str(STEPS),
            "--tokens-per-step",
            "256",
            "--log-every",
            "1",
            "--eval-data",
            str(held),
            "--eval-every",
            "2",
            "--report-to",
            "wandb",
            "--num-workers",
            "0",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert not [line for line in result.output.splitlines() if line.startswith("wandb")], result.output  # quiet

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records = wandb_records(run)
    rows = history_rows(records)
    problems, compared = mismatches(metrics, rows)
    assert not problems, problems
    assert [step for step, _ in rows] == list(range(1, STEPS + 1))
    logged = set().union(*(row.keys() for _, row in rows))
    assert {
        "loss",
        "lr",
        "grad_norm",
        "tokens",
        "tokens_per_s",
        "step_time_s",
        "data_wait_s",
        "peak_mem_gib",
        "epoch",
        "eval_loss",
        "eval_ppl",
        "eval_loss_tokens",
    } <= logged, logged
    assert compared >= STEPS * 9 + 2 * 3, compared  # every training line's scalars and two evaluations

    config = json.loads((run / "config.json").read_text())
    assert config.pop("world_size") == 1 and config.pop("model_hub") is None  # a preset, not a Hub id
    assert run_config(records) == config and config["report_to"] == "wandb" and config["max_steps"] == STEPS

    # negative controls: the same comparison finds one value off by an ulp, a dropped key, a shifted step
    changed = [dict(line) for line in metrics]
    line = next(line for line in changed if line["step"] == 3 and "loss" in line)
    loss, line["loss"] = line["loss"], float(np.nextafter(line["loss"], np.inf))
    assert mismatches(changed, rows)[0] == [f"step 3: loss {loss!r} in W&B, {line['loss']!r} in metrics.jsonl"]
    dropped = [(step, {k: v for k, v in row.items() if k != "eval_loss" or step != STEPS}) for step, row in rows]
    assert mismatches(metrics, dropped)[0] == [f"step {STEPS}: eval_loss missing in W&B"]
    shifted = [(step + 1 if step == STEPS else step, row) for step, row in rows]
    assert mismatches(metrics, shifted)[0] == [
        f"step {STEPS}: in metrics.jsonl, not in W&B",
        f"step {STEPS + 1}: in W&B, not in metrics.jsonl",
    ]
