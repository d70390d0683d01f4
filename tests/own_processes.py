"""The processes a test started, and only those. A shared machine runs other programs' processes
beside the tests (another test run's Ray, a user's own cluster): a test that looks for processes to
count, wait for or kill finds its own by their environment (`tagged`: a variable the test set in
the process it started, which every process that one starts inherits, orphans included) or by
their parentage (`descendants` of this process), never by a name on the whole machine.

    env = {**os.environ, "TEST_RAY_TAG": tag}     # the command and all it starts carry it
    ... subprocess.Popen(..., env=env) ...
    assert tagged(tag) == []                      # none of them is left
"""

from __future__ import annotations

import os


def cmdline(pid: int) -> str:
    """A process's command line, its arguments joined by spaces ("" once it has ended)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def tagged(tag: str, variable: str = "TEST_RAY_TAG") -> list[int]:
    """Pids of the processes whose environment holds `variable`=`tag`."""
    needle = f"{variable}={tag}".encode()
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(name))
            except OSError:
                continue
    return pids


def descendants(root: int | None = None) -> list[int]:
    """Pids of the living processes below `root` (default: this process), children first."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(name))
    found, todo = [], [os.getpid() if root is None else root]
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found
