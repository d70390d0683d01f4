"""A data-only install (`pip install -e .`, no torch: a CPU box, a Ray worker) runs pack-data,
pack-verify and pack-report: here with PyTorch hidden from the process (tests/no_torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(command: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    module = "pipeline.cli" if command != "pack-train" else "trainer.cli"
    function = command.replace("-", "_") if command != "pack-train" else "main"
    code = (
        f"import sys; sys.argv[0] = {command!r}\ntry:\n    from {module} import {function}; {function}()\n"
        f"finally:\n    print('torch seen:', 'torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "no_torch"), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_pack_data_verify_and_report_run_without_torch(tmp_path: Path) -> None:
    hidden = _run("pack-train", "--help", cwd=tmp_path)  # the stub hides torch indeed
    probe = subprocess.run(
        [sys.executable, "-c", "import torch"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests" / "no_torch")},
    )
    assert probe.returncode == 1 and "No module named 'torch'" in probe.stderr, probe.stderr
    assert hidden.returncode == 0

    rows = [{"instruction": f"Add {i} and {i + 1}.", "output": f"{2 * i + 1}"} for i in range(40)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    packed = _run(
        "pack-data",
        str(tmp_path / "in.jsonl"),
        "--tokenizer",
        str(ROOT / "data" / "tokenizer"),
        "--max-len",
        "256",
        "--out",
        str(tmp_path / "out"),
        cwd=tmp_path,
    )
    assert packed.returncode == 0, packed.stderr
    assert "examples: 40 read, 40 packed" in packed.stdout + packed.stderr, packed.stdout + packed.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["rows"] >= 1

    verified = _run("pack-verify", str(tmp_path / "out"), cwd=tmp_path)
    assert verified.returncode == 0 and verified.stdout.startswith("ok: "), verified.stdout + verified.stderr

    report = _run(
        "pack-report", str(tmp_path / "out"), "--html", str(tmp_path / "report.html"), "--json", str(tmp_path / "report.json"), cwd=tmp_path
    )
    assert report.returncode == 0, report.stderr
    assert json.loads((tmp_path / "report.json").read_text())
    assert "<html" in (tmp_path / "report.html").read_text().lower()
    for proc in (packed, verified, report):
        assert proc.stdout.splitlines()[-1] == "torch seen: False"


def test_chat_and_prompt_completion_data_pack_and_verify_deep_without_torch(tmp_path: Path) -> None:
    """Chat templates need only jinja2 and the tokenizer: chat rows and TRL's conversational
    prompt/completion rows pack, and `pack-verify --deep` re-renders a chat folder, with no torch."""
    chat = [{"messages": [{"role": "user", "content": f"Add {i} and 1."}, {"role": "assistant", "content": f"{i + 1}"}]} for i in range(20)]
    pairs = [
        {"prompt": [{"role": "user", "content": f"Add {i} and 2."}], "completion": [{"role": "assistant", "content": f"{i + 2}"}]}
        for i in range(20)
    ]
    for name, rows in (("chat", chat), ("pairs", pairs)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        packed = _run(
            "pack-data",
            str(tmp_path / f"{name}.jsonl"),
            "--tokenizer",
            str(ROOT / "data" / "tokenizer"),
            "--max-len",
            "256",
            "--out",
            str(tmp_path / name),
            cwd=tmp_path,
        )
        assert packed.returncode == 0, packed.stderr
        assert "examples: 20 read, 20 packed" in packed.stdout + packed.stderr, packed.stdout + packed.stderr
        assert packed.stdout.splitlines()[-1] == "torch seen: False"
    deep = _run("pack-verify", str(tmp_path / "chat"), "--deep", cwd=tmp_path)
    assert deep.returncode == 0 and "20 examples re-tokenized and matched" in deep.stdout, deep.stdout + deep.stderr
    assert deep.stdout.splitlines()[-1] == "torch seen: False"


def test_torch_is_the_train_extras_not_a_base_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("[")[0] for d in project["dependencies"]}
    assert "torch" not in names and "safetensors" not in names
    for extra in ("train", "dev"):  # dev: everything the tests need
        assert {"torch", "safetensors"} <= {d.split(">")[0] for d in project["optional-dependencies"][extra]}
