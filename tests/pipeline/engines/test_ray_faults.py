"""pack-data --engine ray stopped from outside: SIGTERM mid-job is exit 143 and one line (not Ray's
C++ signal dump), and neither SIGTERM nor kill -9 of pack-data leaves a process of the Ray it
started running (the raylet's agents included)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from own_processes import cmdline, tagged

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = str(ROOT / "data" / "tokenizer")


# the banner of a failed internal check in Ray's C++ core (a Ray bug, seen once under load while a
# task reply raced the SIGTERM shutdown): the test then cannot judge what pack-data printed
RAY_INTERNAL_BUG = "You have likely discovered a bug in Ray"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "kill -9"])
def test_a_stopped_ray_job_leaves_no_ray_process(tmp_path: Path, sig: int) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"word {i} " * 60}) + "\n" for i in range(20000)))
    tag = uuid.uuid4().hex
    env = {**os.environ, "TEST_RAY_TAG": tag}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; sys.argv[0] = 'pack-data'; from pipeline.cli import pack_data; pack_data()",
            str(data),
            "--tokenizer",
            TOKENIZER,
            "--max-len",
            "2048",
            "--out",
            str(tmp_path / "o"),
            "--engine",
            "ray",
            "--num-proc",
            "2",
            "--chunk-bytes",
            "200000",
            "--no-progress",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:  # until a tokenize task runs
            if any("ray::_tokenize_chunk" in cmdline(p) for p in tagged(tag)):
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        assert any("raylet" in cmdline(p) for p in tagged(tag))
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        if sig == signal.SIGTERM:
            if RAY_INTERNAL_BUG in err:  # Ray's core worker failed its own check while stopping
                pytest.skip(f"Ray's own internal check failed during shutdown: {err.strip().splitlines()[0][:200]}")
            assert proc.returncode == 143, err
            assert err.strip().splitlines() == ["terminated (SIGTERM): nothing was written to the output folder"], err
        else:
            assert proc.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 120  # a grace for a loaded machine: the watchdog's own stop
        while tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [cmdline(p) for p in tagged(tag)] == []
        assert not (tmp_path / "o").exists()
    finally:
        for pid in tagged(tag):  # what this test started, if the assertion above failed
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
