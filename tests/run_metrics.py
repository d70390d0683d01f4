"""What a finished pack-train run logged, for tests that compare runs.

logged_losses(tmp_path / "run")  # [8.309, 8.321, 8.326]: the loss of each logged step
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def logged_losses(run: str | os.PathLike[str]) -> list[float]:
    """The training losses in RUN/metrics.jsonl, one per logged step, in order (eval lines left out)."""
    rows = map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in rows if r.get("loss") is not None]
