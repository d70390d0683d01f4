"""Stop the processes of a local Ray that pack-data started, even when pack-data itself is killed
outright (kill -9, the OOM killer), which no code of its own survives to handle.

Ray makes its GCS server, raylet and workers share the driver's fate, but not the agents the raylet
starts (ray::DashboardAgent, ray::RuntimeEnvAgent): they outlive a killed driver. So the job marks
every process of its Ray with an environment variable (`RAY_MARK=<token>`, set while `ray.init`
starts them: children inherit it) and starts a watchdog, this module's `main`, in a session of its
own. The watchdog holds the read end of a pipe whose only write end the driver holds: when the
driver exits, however it exits, the read returns and the watchdog stops every process of that Ray
(SIGTERM, then SIGKILL after a grace period), then exits.

A process's environment as /proc shows it is the memory its program started with, which a process
may overwrite: Ray's agents rename themselves (setproctitle), and the mark is then sometimes gone
from what /proc shows. So while the driver runs, the watchdog also keeps, every half second, the
family of the marked processes: each of them and their descendants, by parent pid, each with its
start time (so a pid the system reuses later is never taken for one of them). At the end it stops
that family, whatever /proc then shows of their environment.

    with reaped_ray() as env:   # env: the variable to set while ray.init starts Ray's processes
        ...
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

RAY_MARK = "PACKLM_RAY_JOB"
GRACE_S = 3.0


@contextmanager
def reaped_ray() -> Iterator[dict[str, str]]:
    """Start the watchdog; yield {RAY_MARK: token} for the environment of the processes to stop.
    Leaving the block closes the pipe, so the watchdog stops what is left of them then, too."""
    if not os.path.isdir("/proc"):  # the mark is found through /proc (Linux)
        yield {}
        return
    token = uuid.uuid4().hex
    read, write = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != RAY_MARK}
    try:
        watchdog = subprocess.Popen(
            [sys.executable, "-m", "pipeline.engines.ray_reaper", token, str(read)],
            pass_fds=(read,),
            start_new_session=True,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    finally:
        os.close(read)
    try:
        yield {RAY_MARK: token}
    finally:
        os.close(write)
        try:
            watchdog.wait(GRACE_S + 5)
        except subprocess.TimeoutExpired:
            pass


def marked(token: str) -> list[int]:
    """Pids of this user's processes whose environment holds RAY_MARK=token."""
    needle = f"{RAY_MARK}={token}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:  # gone, or another user's
            continue
    return found


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every process, from /proc/PID/stat."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)", which may hold spaces
        except (OSError, IndexError):
            continue
        table[int(name)] = (int(fields[1]), int(fields[19]))  # stat fields 4 (ppid) and 22 (starttime)
    return table


def family(token: str, known: dict[int, int]) -> dict[int, int]:
    """pid -> start time of the Ray processes to stop: those in `known` that still run (the same
    start time), the marked ones, and every descendant of either."""
    table = _proc_table()
    found = {pid: start for pid, start in known.items() if table.get(pid, (0, -1))[1] == start}
    found.update({pid: table[pid][1] for pid in marked(token) if pid in table})
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found and child != os.getpid():
                found[child] = table[child][1]
                todo.append(child)
    return found


def stop(token: str, known: dict[int, int] | None = None, grace: float = GRACE_S, settle: float = 10.0) -> None:
    """SIGTERM the Ray processes (`family`), then SIGKILL those left after `grace` seconds, and keep
    killing for up to `settle` seconds more: a raylet that outlived the first pass may still start an
    agent."""
    pids = family(token, known or {})
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = family(token, pids)
    deadline = time.monotonic() + settle
    while pids and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)
        pids = family(token, pids)


def main(argv: list[str]) -> None:
    """The watchdog: keep the family of the marked processes up to date every half second until the
    pipe's write end closes (the driver exited), then `stop` it."""
    token, fd = argv[0], int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal is the driver's to handle
    known: dict[int, int] = {}
    while True:
        try:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready and not os.read(fd, 1 << 10):
                break
        except InterruptedError:
            continue
        except OSError:
            break
        if not ready:
            known = family(token, known)
    stop(token, known)


if __name__ == "__main__":
    main(sys.argv[1:])
