"""The import graph helpers of the layout tests (tests/pipeline/test_layout.py and
tests/trainer/test_trainer_layout.py): a package's modules by dotted name, and a cycle among them."""

from __future__ import annotations

from pathlib import Path


def modules(root: Path, top: str) -> dict[str, Path]:
    """Dotted name -> file of every module of the package `top` under `root` (a package is its
    `__init__`): {"pipeline": .../pipeline/__init__.py, "pipeline.cli": .../pipeline/cli.py, ...}."""
    found = {}
    for path in sorted((root / top).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` (module -> the modules it imports; names outside the graph are ignored)
    as its path, ["a", "b", "a"], or None where there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(d for d in graph[m] if d in graph):
            if state.get(d) == 1:
                return path[path.index(d) :] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None
