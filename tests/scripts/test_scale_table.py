"""scripts/bench/scale_table.py on fabricated pack-train run folders (CPU, milliseconds)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "scale_table.py"
spec = importlib.util.spec_from_file_location("scale_table", SCRIPT)
scale_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scale_table)


def make_run(
    root: Path,
    name: str,
    *,
    world: int,
    parallel: str,
    step_time: float,
    tokens_per_step: int,
    steps: int = 10,
    exit_code: int | None = 0,
    summary: bool = True,
    mfu: float = 0.4,
    warm_step_time: float = 5.0,
) -> Path:
    """A run folder as pack-train writes it: global cumulative `tokens`, per-step time; steps 1-2
    are slow (warmup) so a wrong warmup cut shows in the numbers."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"world_size": world, "parallel": parallel, "peak_flops": 989e12}))
    lines, tokens = [], 0
    for step in range(1, steps + 1):
        tokens += tokens_per_step
        t = warm_step_time if step <= 2 else step_time
        lines.append(
            json.dumps(
                {
                    "step": step,
                    "tokens": tokens,
                    "tokens_per_s": tokens_per_step / t,
                    "mfu": mfu if step > 2 else 0.01,
                    "step_time_s": t,
                    "peak_mem_gib": 10.0 + step / 10,
                    "attention": "sdpa",
                    "loss": 1.0,
                }
            )
        )
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary:
        (run / "summary.json").write_text(json.dumps({"steps": steps, "total_steps": steps, "params": 1000, "world_size": world}))
    if exit_code is not None:
        (run / "exit_code").write_text(f"{exit_code}\n")
    return run


def test_global_tokens_warmup_and_efficiency(tmp_path: Path) -> None:
    single = make_run(tmp_path, "single", world=1, parallel="ddp", step_time=0.5, tokens_per_step=8000)
    # 4 ranks, 4 x the tokens per step (global count), 0.625 s per step: 80% per-GPU efficiency
    ddp = make_run(tmp_path, "ddp", world=4, parallel="ddp", step_time=0.625, tokens_per_step=32000)
    rows = [scale_table.summarize_run(d, warmup=2) for d in (single, ddp)]
    base = scale_table.add_efficiency(rows)
    assert base is rows[0]
    s, d = rows
    assert s["parallel"] == "single" and d["parallel"] == "ddp"
    assert s["steps_measured"] == 8 and s["tokens_measured"] == 8 * 8000
    assert s["tokens_per_s"] == pytest.approx(16000.0)
    assert d["tokens_per_s"] == pytest.approx(32000 / 0.625)
    assert d["tokens_per_s_per_gpu"] == pytest.approx(32000 / 0.625 / 4)
    assert d["scaling_efficiency"] == pytest.approx(0.8)
    assert d["mfu"] == pytest.approx(0.4)  # warmup steps' MFU (0.01) excluded
    assert d["step_time_ms"] == pytest.approx(625.0)
    assert d["peak_mem_gib"] == pytest.approx(11.0)
    assert d["steps_logged"] == 10 and d["steps_summary"] == 10 and d["ok"]


def test_log_every_greater_than_one_weights_by_steps(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"world_size": 2, "parallel": "fsdp"}))
    recs = [
        {"step": 5, "tokens": 500, "step_time_s": 10.0, "mfu": 0.0},
        {"step": 10, "tokens": 1500, "step_time_s": 1.0, "mfu": 0.3},
        {"step": 12, "tokens": 1900, "step_time_s": 2.0, "mfu": 0.1},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    row = scale_table.summarize_run(run, warmup=5)
    assert row["steps_measured"] == 7 and row["tokens_measured"] == 1400
    assert row["seconds_measured"] == pytest.approx(5 * 1.0 + 2 * 2.0)
    assert row["tokens_per_s"] == pytest.approx(1400 / 9.0)
    assert row["mfu"] == pytest.approx((0.3 * 5 + 0.1 * 4) / 9)
    assert not row["ok"]  # no summary.json: the run did not finish


def test_main_writes_files_and_flags_failed_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    single = make_run(tmp_path, "single", world=1, parallel="ddp", step_time=0.5, tokens_per_step=8000)
    fsdp = make_run(tmp_path, "fsdp", world=2, parallel="fsdp", step_time=0.5, tokens_per_step=16000, exit_code=1, summary=False)
    empty = tmp_path / "ddp"
    empty.mkdir()
    (empty / "exit_code").write_text("137\n")
    md, js = tmp_path / "scale.md", tmp_path / "scale.json"
    rc = scale_table.main([str(single), str(empty), str(fsdp), "--warmup", "2", "--md", str(md), "--json", str(js)])
    assert rc == 1
    out, err = capsys.readouterr()
    assert "ddp, fsdp" in err
    table = md.read_text()
    assert table == out
    lines = table.splitlines()
    assert "tokens/s total (all GPUs" in lines[0]
    assert lines[2].startswith("| single | 1 | 0 | 10 / 10 | 8 | 16,000 | 16,000 | 100.0% |")
    assert lines[3].startswith("| ddp (?) | - | 137 | 0 / - | 0 | - | - | - |")
    assert lines[4].startswith("| fsdp | 2 | 1 | 10 / - | 8 | 32,000 | 16,000 | 100.0% |")
    payload = json.loads(js.read_text())
    assert payload["baseline"] == "single"
    assert [r["ok"] for r in payload["runs"]] == [True, False, False]


def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert scale_table.main([str(tmp_path / "missing")]) == 1
    assert "no such run folder" in capsys.readouterr().err
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "tokens": 3, "step_time_s": 1}\nnot json\n')
    assert scale_table.main([str(run)]) == 1
    err = capsys.readouterr().err
    assert "metrics.jsonl:2: not a JSON line" in err and "Traceback" not in err
