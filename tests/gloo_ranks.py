"""Ranks in child processes that a test can always end: `fork_ranks` runs a function on N forked
ranks, each the leader of its own process group, and kills every group (the rank and whatever it
started) when a rank fails or the deadline passes, so a process group that deadlocks (gloo's
teardown has) fails the test instead of hanging the suite. `run_killable` does the same for a
command (torchrun and its ranks). `train_on_two_ranks` trains on two gloo ranks (CPU) for the
trainer's DDP/FSDP tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

# A rank's deadline: a tiny model's DDP/FSDP run takes seconds; a slow CI machine, a minute or two.
RANK_DEADLINE_S = 300.0


def _die_with_parent() -> None:
    """Linux: the kernel kills this process if the test process dies (a hard stop of the suite
    leaves no rank behind)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill_groups(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def fork_ranks(fn: Callable[..., Any], args: tuple = (), nprocs: int = 2, deadline_s: float = RANK_DEADLINE_S) -> None:
    """`fn(rank, *args)` on `nprocs` forked ranks (fork: they inherit the imported modules; spawn
    would re-import torch + transformers), each in a process group of its own. Returns when every
    rank has returned; raises AssertionError naming the rank and its traceback as soon as one
    fails (the others are killed: they would wait on it in a collective), or naming the ranks
    still running at the deadline (killed, with everything they started)."""
    errors = Path(tempfile.mkdtemp(prefix="ranks-"))
    running: dict[int, int] = {}  # pid -> rank
    try:
        for rank in range(nprocs):
            pid = os.fork()
            if pid == 0:  # the rank
                code = 1
                try:
                    os.setpgid(0, 0)
                    _die_with_parent()
                    fn(rank, *args)
                    code = 0
                except BaseException:
                    (errors / f"rank{rank}.txt").write_text(traceback.format_exc())
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            try:
                os.setpgid(pid, pid)  # also here: kill may come before the child ran its own setpgid
            except (ProcessLookupError, PermissionError):
                pass  # the child has already set it (PermissionError after its exec/exit) or exited
            running[pid] = rank
        end = time.monotonic() + deadline_s
        while running:
            for pid in list(running):
                done, status = os.waitpid(pid, os.WNOHANG)  # this rank only: other children are not ours
                if done:
                    rank = running.pop(pid)
                    code = os.waitstatus_to_exitcode(status)
                    if code != 0:
                        log = errors / f"rank{rank}.txt"
                        why = log.read_text() if log.exists() else f"exit status {code}"
                        raise AssertionError(f"rank {rank} of {nprocs} failed (the others were killed):\n{why}")
            if running and time.monotonic() > end:
                stuck = sorted(running.values())
                raise AssertionError(
                    f"rank(s) {stuck} of {nprocs} still running after {deadline_s:.0f} s: "
                    f"killed with their process groups (a deadlock, or a test too slow for "
                    f"its deadline)"
                )
            time.sleep(0.05)
    finally:
        _kill_groups(list(running))
        for log in errors.iterdir():
            log.unlink()
        errors.rmdir()


def run_killable(argv: list[str], timeout_s: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True) in a session of its own; at the timeout
    the whole process group is killed (subprocess.run's own timeout kills the direct child only,
    then waits for its pipes, which the ranks it started still hold) and AssertionError says so
    with the output so far."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"{' '.join(map(str, argv[:4]))} ... still running after {timeout_s:.0f} s: killed "
            f"with its process group\n{(err or '')[-3000:]}"
        ) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the ranks' MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, config, record: str) -> None:
    import torch
    import torch.distributed as dist

    from trainer import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    Path(record, f"rank{rank}.json").write_text(json.dumps(train(config)))
    assert not dist.is_initialized(), "train() left its process group open"


def train_on_two_ranks(config, record: Path) -> list[dict]:
    """`train(config)` on two gloo ranks; each rank's summary (also left in record/rank{r}.json)."""
    fork_ranks(_rank, (2, free_port(), config, str(record)))
    return [json.loads((Path(record) / f"rank{r}.json").read_text()) for r in range(2)]


def _gloo_rank(rank: int, fn: Callable[..., Any], world: int, port: int, args: tuple, record: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = fn(rank, world, *args)
    dist.barrier()  # every rank is past its last collective; the process ends without a teardown
    Path(record, f"rank{rank}.json").write_text(json.dumps(result))


def run_on_ranks(fn: Callable[..., Any], world: int, args: tuple = (), deadline_s: float = RANK_DEADLINE_S) -> list:
    """`fn(rank, world, *args)` on `world` forked ranks in one gloo process group (made before it
    runs); the list of what each returned (JSON-able), killed and failed as `fork_ranks` does."""
    with tempfile.TemporaryDirectory() as record:
        fork_ranks(_gloo_rank, (fn, world, free_port(), args, record), nprocs=world, deadline_s=deadline_s)
        return [json.loads((Path(record) / f"rank{r}.json").read_text()) for r in range(world)]
