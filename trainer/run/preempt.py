"""SIGTERM while training: finish the optimizer step under way, write a checkpoint, exit 143.

Clusters stop a job with SIGTERM and a grace period before SIGKILL (Slurm's `scancel`, Kubernetes'
pod deletion, `timeout`). Within the training loop `StopOnSigterm` only notes the signal; the loop
asks `agreed()` after each optimizer step and, when it says stop, saves a checkpoint at that step
and leaves. `pack-train --resume` then continues exactly as if the run had not stopped.

Ranks of a distributed run must stop at the same step (a checkpoint is collective), so they agree
by an all-reduce, at the loop's sync points only (log steps: `--log-every`); a single process reads
its own flag after every step, at no cost.
"""

from __future__ import annotations

import signal
import threading
from types import TracebackType

import torch
import torch.distributed as dist


class StopOnSigterm:
    """Context manager: while inside, SIGTERM sets `requested` instead of ending the process."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: object = None

    def __enter__(self) -> StopOnSigterm:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)
        return self

    def __exit__(self, kind: type | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]

    def _note(self, signum: int, frame: object) -> None:
        self.requested = True

    def agreed(self, distributed: bool, device: torch.device, at_sync: bool) -> bool:
        """Whether every rank stops after this step (collective when `distributed` and `at_sync`)."""
        if not distributed:
            return self.requested
        if not at_sync:
            return False
        flag = torch.tensor([int(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
