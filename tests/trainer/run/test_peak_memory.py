"""pack-train's CPU peak memory is the process's own, not its starter's."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_cpu_peak_memory_leaves_out_the_starting_process():
    ballast = np.ones(1 << 27, dtype=np.int64)  # 1 GiB resident in this process when the child starts
    code = "import torch; from trainer.run.metrics import peak_memory_gib; print(peak_memory_gib(torch.device('cpu')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    del ballast
    peak = float(out.stdout.split()[-1])
    assert 0.05 < peak < 0.9  # torch and transformers imported: about 0.4 GiB; never this process's 1 GiB
