"""The manual as a new user runs it: every command and snippet of the README and then of its guides
in docs/ (GUIDES, in that order), top to bottom, in one fresh folder (the quick start's pack-data
after its set-up, its pack-verify / pack-report / pack-train, the README's pack-data, pack-train,
pack-verify and pack-report sections, then the walkthrough, the config files, the Python API, the
Hugging Face Trainer and TRL examples, the planner and the pack-data guide). A later command must
not collide with what an earlier one wrote, and none may print a warning."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = {
    "pack-data": "pipeline.cli:pack_data",
    "pack-train": "trainer.cli:main",
    "pack-report": "pipeline.cli:pack_report",
    "pack-verify": "pipeline.cli:pack_verify",
}
# The README, then the guides whose commands and snippets run here, in this order (the Trainer and TRL
# examples train on the folder the Python API's snippet packs; the other guides' commands need what
# NOT_HERE names, or are not console commands).
GUIDES = (
    "README.md",
    "docs/fine-tuning.md",
    "docs/config-files.md",
    "docs/python-api.md",
    "docs/hf-trainer.md",
    "docs/planner.md",
    "docs/pack-data.md",
    "docs/long-examples.md",
    "docs/ray.md",
    "docs/hub-and-remote.md",
    "docs/pack-report-verify.md",
    "docs/pack-train.md",
)
# Commands the manual shows for data or machines a fresh clone does not have (a user's corpus, a
# Ray cluster, Hugging Face Hub ids, which need the network, long examples that a script the test does
# not run writes: tests/scripts/test_make_long_data.py packs them); each must still be in the manual, so
# the list cannot go stale. (tests/pipeline/read/test_hub.py packs Hub ids from a cache it builds.)
NOT_HERE = (
    "'corpus/*.parquet'",
    "'/mnt/shared/corpus/*.jsonl'",
    "HuggingFaceH4/ultrachat_200k",
    "--data out/ultrachat",
    "--out packed-long",
)
# pack-train runs here are cut to a few small steps (CPU time); what collides does not depend on it.
SHORT = ["--max-steps", "3", "--tokens-per-step", "1024"]
NOISE = re.compile(r"Warning|warn\(|Traceback", re.I)


def readme_steps(readme: str) -> list[tuple[str, str]]:
    """("bash", one command) and ("python", one snippet) in the order of `readme` (the README, or the
    README and its guides one after the other): every fenced bash and python block, and the console
    commands written inline in the quick start's prose."""
    quick = readme[readme.index("## Quick start") : readme.index("\n## ", readme.index("## Quick start") + 1)]
    found: list[tuple[int, str, str]] = []
    for m in re.finditer(r"```(bash|python)\n(.*?)```", readme, re.S):
        if m.group(1) == "python":
            found.append((m.start(), "python", m.group(2)))
            continue
        for line in m.group(2).replace("\\\n", " ").splitlines():
            for command in line.split("#")[0].split("&&"):  # a set-up line chains pip and pack-data
                command = command.strip()
                if command.split(" ", 1)[0] in SCRIPTS and not any(x in command for x in NOT_HERE):
                    found.append((m.start(), "bash", command))
    start = readme.index("## Quick start")
    for m in re.finditer(r"`(pack-(?:data|verify|report|train) [^`]*)`", quick):
        found.append((start + m.start(), "bash", m.group(1)))
    return [(kind, text) for _, kind, text in sorted(found, key=lambda x: x[0])]


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "OMP_NUM_THREADS": "1",
    }  # tiny models train far faster on one thread of a shared CPU
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_the_readme_runs_top_to_bottom_in_a_fresh_folder(repo_root: Path, tmp_path: Path):
    for module in ("peft", "tensorboard", "accelerate", "trl"):  # the dev extras the README installs
        pytest.importorskip(module)
    readme = "\n".join((repo_root / name).read_text(encoding="utf-8") for name in GUIDES)
    for skipped in NOT_HERE:
        assert skipped in readme
    steps = readme_steps(readme)
    commands = [text for kind, text in steps if kind == "bash"]
    assert commands[0].startswith("pack-data data/sample/instructions.jsonl")  # the set-up line's job
    assert [c.split()[0] for c in commands[1:4]] == ["pack-verify", "pack-report", "pack-train"]  # quick path
    assert sum(kind == "python" for kind, _ in steps) == 5
    (tmp_path / "data").symlink_to(repo_root / "data")  # the README's relative paths
    for kind, text in steps:
        if kind == "python":
            check = '\nassert summary["steps"] == 20, summary\n' if "summary = train(" in text else ""
            proc = _run([sys.executable, "-c", text + check], tmp_path)
        else:
            argv = shlex.split(text)
            module, function = SCRIPTS[argv[0]].split(":")
            code = f"import sys; sys.argv[0] = {argv[0]!r}; from {module} import {function}; sys.exit({function}())"
            extra = (["--no-progress"] if argv[0] in ("pack-data", "pack-train") else []) + (SHORT if argv[0] == "pack-train" else [])
            proc = _run([sys.executable, "-c", code, *argv[1:], *extra], tmp_path)
        assert proc.returncode == 0, (text, proc.stderr[-3000:])
        noise = [line for line in proc.stderr.splitlines() if NOISE.search(line)]
        assert not noise, (text, noise)
        if kind == "python" and "PeftModel" in text:
            assert proc.stdout.split()[-1] == "PeftModelForCausalLM"
        if kind == "python" and ".train()" in text:
            assert "train_loss" in proc.stdout + proc.stderr
    assert (tmp_path / "runs" / "ft" / "loss.png").is_file() and (tmp_path / "runs" / "ft" / "tensorboard").is_dir()
    for folder in ("sample1k", "api"):
        assert json.loads((tmp_path / "out" / folder / "manifest.json").read_text())["config"]["max_len"] == 1024
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(runs) >= 6 and all((tmp_path / "runs" / r).is_dir() for r in runs), runs
