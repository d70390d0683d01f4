"""What a user waits for before anything runs: `pack-train --help` and its bad arguments answer
without importing torch (seconds of imports), in one line where the mistake is the user's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# pack-train as its console script runs it; the last line says whether torch was imported
PACK_TRAIN = ("import sys\nfrom trainer.cli import main\nsys.argv[0] = 'pack-train'\ntry:\n    main()\n"
              "finally:\n    print('imported torch:', 'torch' in sys.modules, 'transformers' in sys.modules)")


def _pack_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PACK_TRAIN, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_pack_train_help_imports_no_torch_and_states_the_default_budget():
    proc = _pack_train("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "imported torch: False False"
    text = re.sub(r"\s+", " ", proc.stdout)
    assert "--tokens-per-step" in text and "Default: 16384 on a GPU, 8192 on the CPU." in text


def test_pack_train_argument_errors_come_before_torch(tmp_path: Path):
    folder = str(tmp_path)  # any existing folder passes the parser's check of --data
    usage = _pack_train("--data", str(tmp_path / "missing"), "--model", "tiny", "--out", str(tmp_path / "r"))
    assert usage.returncode == 2 and "'--data'" in usage.stderr and "does not exist" in usage.stderr
    assert usage.stdout.splitlines()[-1] == "imported torch: False False"
    cases = {  # mistakes found after parsing: one line, status 1, still no torch
        ("--model", "tyni"): "model 'tyni' is neither a preset (tiny, llama-100m, llama-1b, llama-8b), a local folder",
        ("--model", folder): "is a folder but has no config.json",
        ("--model", "tiny", "--tokenizer", "data/tokenizr"): "tokenizer folder data/tokenizr not found",
        ("--model", "tiny", "--lora-r", "4", "--parallel", "fsdp"): "--lora-r is not supported with --parallel fsdp",
        ("--model", "tiny", "--stop-at", "5", "--max-steps", "2"): "--stop-at 5 is past --max-steps 2",
    }
    for args, message in cases.items():
        proc = _pack_train("--data", folder, "--out", str(tmp_path / "r"), *args)
        assert proc.returncode == 1, (args, proc.stderr)
        assert proc.stderr.count("\n") == 1 and message in proc.stderr, (args, proc.stderr)
        assert proc.stdout.splitlines()[-1] == "imported torch: False False", args
    assert not (tmp_path / "r").exists()


def test_pack_train_data_errors_come_before_torch(tmp_path: Path):
    """The packed folder's checks and the tokenizer's fingerprint need no torch either."""
    from packed_factory import make_packed_folder, pack_lengths

    packed = tmp_path / "packed"
    make_packed_folder(packed, pack_lengths([5, 7, 9], 32, vocab=300), 32,
                       tokenizer={"name": "another", "fingerprint": "0" * 64})
    cases = {
        (str(tmp_path / "empty"), "--tokenizer", str(ROOT / "data" / "tokenizer")): "manifest.json",
        (str(packed), "--tokenizer", str(ROOT / "data" / "tokenizer")): "was packed with tokenizer 'another'",
    }
    (tmp_path / "empty").mkdir()
    for (data, *args), message in cases.items():
        proc = _pack_train("--data", data, "--model", "tiny", "--out", str(tmp_path / "r"), *args)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
        assert proc.stdout.splitlines()[-1].startswith("imported torch: False")  # transformers loads the tokenizer
    assert not (tmp_path / "r").exists()


def test_pack_train_makes_pytorchs_idle_threads_wait_passively(tmp_path: Path, monkeypatch):
    """OMP_WAIT_POLICY=PASSIVE unless the user chose a policy: spinning OpenMP threads took the
    shared 2-core machine's cores (the README's CPU run: 17-52 s spinning, 17-26 s passive)."""
    import os

    from click.testing import CliRunner
    from packed_factory import make_packed_folder, pack_lengths

    import trainer.loop
    from trainer.cli import pack_train

    packed = tmp_path / "packed"
    make_packed_folder(packed, pack_lengths([5, 7, 9], 32, vocab=300), 32)
    seen = []
    summary = dict(steps=1, total_steps=1, tokens=21, tokens_this_run=21, tokens_per_s=1.0, final_loss=1.0,
                   attention="sdpa", checkpoint="c", stopped_by_sigterm=False, rank=0)
    monkeypatch.setattr(trainer.loop, "train", lambda config, opened: seen.append(os.environ.get("OMP_WAIT_POLICY"))
                        or summary)
    monkeypatch.setenv("OMP_WAIT_POLICY", "restored after the test")
    args = ["--data", str(packed), "--model", "tiny", "--out", str(tmp_path / "r")]
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert CliRunner().invoke(pack_train, args).exit_code == 0
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert CliRunner().invoke(pack_train, args).exit_code == 0
    assert seen == ["PASSIVE", "ACTIVE"]
