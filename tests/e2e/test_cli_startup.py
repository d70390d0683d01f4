"""What a user waits for before anything runs: `pack-train --help` and its bad arguments answer
without importing torch (seconds of imports), in one line where the mistake is the user's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# pack-train as its console script runs it; the last line says whether torch was imported
PACK_TRAIN = (
    "import sys\nfrom trainer.cli import main\nsys.argv[0] = 'pack-train'\ntry:\n    main()\n"
    "finally:\n    print('imported torch:', 'torch' in sys.modules, 'transformers' in sys.modules)"
)


def _pack_train(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PACK_TRAIN, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


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
    make_packed_folder(packed, pack_lengths([5, 7, 9], 32, vocab=300), 32, tokenizer={"name": "another", "fingerprint": "0" * 64})
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

    import trainer.run.loop
    from trainer.cli import pack_train

    packed = tmp_path / "packed"
    make_packed_folder(packed, pack_lengths([5, 7, 9], 32, vocab=300), 32)
    seen = []
    summary = dict(
        steps=1,
        total_steps=1,
        tokens=21,
        tokens_this_run=21,
        tokens_per_s=1.0,
        final_loss=1.0,
        attention="sdpa",
        checkpoint="c",
        stopped_by_sigterm=False,
        rank=0,
    )
    monkeypatch.setattr(trainer.run.loop, "train", lambda config, opened: seen.append(os.environ.get("OMP_WAIT_POLICY")) or summary)
    monkeypatch.setenv("OMP_WAIT_POLICY", "restored after the test")
    args = ["--data", str(packed), "--model", "tiny", "--out", str(tmp_path / "r")]
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert CliRunner().invoke(pack_train, args).exit_code == 0
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert CliRunner().invoke(pack_train, args).exit_code == 0
    assert seen == ["PASSIVE", "ACTIVE"]


def test_what_cannot_run_is_refused_before_torch_in_one_line(tmp_path: Path):
    """--attn flash_attn / fa4 without their package, --dtype fp8 where no NVIDIA GPU can be seen,
    an --out holding another run's checkpoints: one line, status 1, no torch imported, no run
    folder written."""
    import importlib.util
    import os

    from packed_factory import make_packed_folder, pack_lengths

    packed = tmp_path / "packed"
    make_packed_folder(packed, pack_lengths([5, 7, 9], 32, vocab=300), 32)
    used = tmp_path / "used"
    (used / "checkpoints" / "step-00000002").mkdir(parents=True)
    no_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cases = [
        (
            ["--dtype", "fp8", "--device", "cpu"],
            None,
            "--dtype fp8 needs an NVIDIA GPU with float8 tensor cores "
            "(sm89 or newer: Ada, Hopper, Blackwell); this run is on cpu: use --dtype bf16-weights",
        ),
        (["--dtype", "fp8"], no_gpu, "Blackwell); CUDA_VISIBLE_DEVICES='' hides every GPU: use --dtype bf16-weights"),
        (["--out", str(used)], None, f"{used} already holds checkpoints: pass --resume to continue that run, or choose a new --out"),
    ]
    if importlib.util.find_spec("flash_attn") is None:
        cases.append(
            (
                ["--attn", "flash_attn"],
                None,
                '--attn flash_attn: the flash-attn package is not installed here: pip install -e ".[flash]", or use --attn auto',
            )
        )
        cases.append(
            (
                ["--attn", "fa4"],
                None,
                '--attn fa4: the flash-attn-4 package is not installed here: pip install -e ".[fa4]", or use --attn auto',
            )
        )
    for args, env, message in cases:
        proc = _pack_train("--data", str(packed), "--model", "tiny", "--out", str(tmp_path / "r"), *args, env=env)
        assert proc.returncode == 1, (args, proc.stderr)
        assert proc.stderr.count("\n") == 1 and message in proc.stderr, (args, proc.stderr)
        # before torch: how soon that is on an idle machine is bench_startup.py's, not a test's
        assert proc.stdout.splitlines()[-1] == "imported torch: False False", args
    assert not (tmp_path / "r").exists()
    assert [p.name for p in (used / "checkpoints").iterdir()] == ["step-00000002"]


def test_a_data_only_install_says_pack_train_needs_torch(tmp_path: Path):
    """Without PyTorch (tests/no_torch hides it), pack-train names the extra to install."""
    import os

    from packed_factory import make_packed_folder, pack_lengths

    make_packed_folder(tmp_path / "packed", pack_lengths([5, 7, 9], 32, vocab=300), 32)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "no_torch"), str(ROOT)])}
    proc = _pack_train("--data", str(tmp_path / "packed"), "--model", "tiny", "--out", str(tmp_path / "r"), env=env)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == (
        'Error: pack-train needs PyTorch, which this install lacks: pip install -e ".[train]" '
        "(install the torch build for your machine first: "
        "https://pytorch.org/get-started/locally/)\n"
    ), proc.stderr
    assert not (tmp_path / "r").exists()


def test_on_a_terminal_pack_train_says_what_its_first_seconds_do(tmp_path: Path):
    """On a terminal, a line says that torch is being imported (a few silent seconds otherwise);
    logs (stderr not a terminal) get no such line."""
    import os
    import pty
    import threading

    from packed_factory import make_packed_folder, pack_lengths

    make_packed_folder(tmp_path / "packed", pack_lengths([5, 7, 9], 32, vocab=300), 32)
    args = ["--data", str(tmp_path / "packed"), "--model", "tiny", "--max-steps", "1", "--no-progress", "--num-workers", "0"]
    leader, follower = pty.openpty()
    seen: list[bytes] = []

    def read() -> None:  # while the run writes (a full terminal buffer would stop it)
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed
                return
            if not chunk:
                return
            seen.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", PACK_TRAIN, *args, "--out", str(tmp_path / "tty")],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=follower,
            text=True,
            timeout=300,
        )
    finally:
        os.close(follower)
        reader.join(10)
        os.close(leader)
    terminal = b"".join(seen).decode()
    assert proc.returncode == 0, terminal
    assert terminal.splitlines()[0].startswith("pack-train: options and data checked; importing torch and building the model"), terminal
    piped = _pack_train(*args, "--out", str(tmp_path / "piped"))
    assert piped.returncode == 0 and "importing torch" not in piped.stderr, piped.stderr
