"""The README's Python examples run as printed: the Python API (pack, verify, plan, train), then
the Hugging Face Trainer and TRL examples on the folder it wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path


def test_the_readme_python_api_example_runs_as_printed(repo_root: Path, tmp_path: Path):
    readme = (repo_root / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "run_pack_data" in code and "train(" in code
    (tmp_path / "data").symlink_to(repo_root / "data")  # the example's relative paths
    check = '\nassert summary["steps"] == 20, summary\nprint("OK", manifest.counts.examples_packed)\n'
    proc = subprocess.run([sys.executable, "-c", code + check], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(repo_root)},
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2] == "OK" and int(proc.stdout.split()[-1]) > 0
    assert json.loads((tmp_path / "out" / "sample1k" / "manifest.json").read_text())["config"]["max_len"] == 1024
    assert (tmp_path / "runs" / "tiny" / "summary.json").is_file()

    hf_section = readme[readme.index("## Hugging Face Trainer and TRL"):readme.index("## Bin-packing planner")]
    blocks = re.findall(r"```python\n(.*?)```", hf_section, re.S)
    assert len(blocks) == 2
    try:
        import accelerate  # noqa: F401
        import trl  # noqa: F401
    except ImportError:
        return
    for code in blocks:
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(repo_root)}, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "train_loss" in proc.stdout + proc.stderr


def test_the_fine_tuning_walkthrough_runs_as_printed(repo_root: Path, tmp_path: Path):
    """The README's walkthrough: its bash block command by command, then its Python block."""
    import shlex

    try:
        import peft  # noqa: F401
        import tensorboard  # noqa: F401
    except ImportError:
        return
    readme = (repo_root / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Fine-tuning walkthrough"):readme.index("## Config files")]
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "data").symlink_to(repo_root / "data")
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    scripts = {"pack-data": "pipeline.cli:pack_data", "pack-train": "trainer.cli:main", "pack-report": "pipeline.cli:pack_report"}
    for line in filter(None, (x.split("#")[0].strip() for x in bash.splitlines())):
        argv = shlex.split(line)
        module, function = scripts[argv[0]].split(":")
        code = f"import sys; sys.argv[0] = {argv[0]!r}; from {module} import {function}; sys.exit({function}())"
        proc = subprocess.run([sys.executable, "-c", code, *argv[1:], *(["--no-progress"] if argv[0] != "pack-report" else [])],
                              cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, (line, proc.stderr[-3000:])
    assert (tmp_path / "runs" / "ft" / "loss.png").is_file() and (tmp_path / "runs" / "ft" / "tensorboard").is_dir()
    proc = subprocess.run([sys.executable, "-c", python], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "PeftModelForCausalLM"
