"""The layout of `trainer/`: its packages are floors, each importing only the floors below it.

- PACKAGES, lowest floor first (why this order: trainer/__init__'s docstring); under them
  `trainer.config` (the options, which imports no floor), above them the commands (`trainer.cli`,
  `trainer`'s own `__init__`);
- a module imports only its own floor and the floors below: no import upward, so no two packages
  import each other and no cycle among packages;
- every package of trainer/ has an `__init__` whose docstring is one line (what it is for);
- no module of trainer/ is over 450 lines (tests/pipeline/test_layout.py checks that limit for both
  packages);
- no import cycle among trainer's modules;
- trainer imports pipeline only through its one door, `pipeline.contract` (DOOR, named in
  pipeline/__init__), and the door imports nothing of trainer;
- `pack-train` and `python -m trainer.cli` stay where they were.
Every import counts, anywhere in a module: inside functions, under `if TYPE_CHECKING:` (an import for
type hints only still says the module depends on the other), and `importlib.import_module("...")` or
`__import__("...")` of a written name.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from import_graph import find_cycle, modules

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["distributed", "data", "attention", "model", "run"]  # the floors, lowest first
GROUND = "trainer.config"  # below every floor: the options every floor reads
COMMANDS = ("trainer", "trainer.cli")  # above every floor
DOOR = "pipeline.contract"  # all trainer/ may use of pipeline/, named by group in its __init__


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module a module imports, anywhere in it: the longest name of `known` that each import
    names (`from pipeline.read import hub` is pipeline.read.hub), or the import itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [[alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [[f"{base}.{alias.name}", base] for alias in node.names]
        elif _imported_by_call(node) is not None:
            targets = [[_imported_by_call(node)]]
        else:
            continue
        for candidates in targets:
            found = next((c for c in candidates if c in known), None)
            target = found or candidates[-1]
            while found is None and target and target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _imported_by_call(node: ast.AST) -> str | None:
    """The module `import_module("x")` / `__import__("x")` names, for a name written in the call."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    name = node.args[0].value
    return name if called in ("import_module", "__import__") and isinstance(name, str) else None


def _graph() -> dict[str, set[str]]:
    known = set(modules(ROOT, "trainer")) | set(modules(ROOT, "pipeline"))
    # `from trainer import TrainConfig` reaches the package's own __init__: no edge of a cycle
    return {name: _imports(path, name, known) - {"trainer"} for name, path in modules(ROOT, "trainer").items()}


def _is_face(module: str) -> bool:
    """Whether an import of trainer's reaches pipeline through the door: the door itself, never a
    module behind it (`pipeline.contract.run_folder` included)."""
    return module == DOOR


def _floor(module: str) -> int:
    """Where a module of trainer sits: 0 the ground (`trainer.config`), 1.. the packages of PACKAGES
    in order, then the commands; -1 for a module outside trainer (no floor)."""
    parts = module.split(".")
    if module in COMMANDS:
        return len(PACKAGES) + 1
    if module == GROUND:
        return 0
    if parts[0] == "trainer" and len(parts) > 1 and parts[1] in PACKAGES:
        return PACKAGES.index(parts[1]) + 1
    return -1


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of `graph` from a floor to a higher one ("trainer.data.x imports trainer.model.y");
    of two packages that import each other, one import is upward."""
    return sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps if _floor(m) >= 0 and _floor(d) > _floor(m))


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The packages of PACKAGES -> the other packages their modules import."""
    package = lambda m: m.split(".")[1] if _floor(m) in range(1, len(PACKAGES) + 1) else None  # noqa: E731
    out: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for m, deps in graph.items():
        if package(m) is not None:
            out[package(m)] |= {package(d) for d in deps if package(d) not in (None, package(m))}
    return out


def test_packages_are_the_concerns_each_said_in_one_line():
    found = {p.name for p in (ROOT / "trainer").iterdir() if (p / "__init__.py").is_file()}
    assert found == set(PACKAGES)
    for package in PACKAGES:
        doc = ast.get_docstring(ast.parse((ROOT / "trainer" / package / "__init__.py").read_text()))
        assert doc and "\n" not in doc.strip(), f"trainer/{package}/__init__.py: one line of docstring"
    tops = sorted(p.name for p in (ROOT / "trainer").glob("*.py"))
    assert tops == ["__init__.py", "cli.py", "config.py"]


def test_packages_are_floors_importing_only_downward():
    """No module imports a floor above its own (nor the commands), so no two packages import each
    other and the packages have no cycle; the run uses every floor below it."""
    graph = _graph()
    assert {m.split(".")[1] for m in graph if _floor(m) in range(1, len(PACKAGES) + 1)} == set(PACKAGES)
    assert _upward(graph) == []
    packages = _package_graph(graph)
    assert sorted((a, b) for a in packages for b in packages[a] if a in packages[b]) == []
    assert find_cycle(packages) is None
    assert packages["run"] >= set(PACKAGES) - {"run"}


def test_the_floor_rule_itself():
    """Negative controls: a synthetic graph with an import upward, a pair importing each other, an
    import of the commands and a type-only import upward are caught; imports downward, of the
    ground and outside trainer are not."""
    good = {
        "trainer.data.stream": {"trainer.distributed.parallel", "trainer.config", "numpy"},
        "trainer.run.loop": {"trainer.model.load", "trainer.data.stream"},
        "trainer.config": {"pipeline.errors"},
        "trainer.cli": {"trainer.run.loop", "trainer.config"},
    }
    assert _upward(good) == [] and find_cycle(_package_graph(good)) is None
    up = {**good, "trainer.distributed.parallel": {"trainer.model.loss"}}
    assert _upward(up) == ["trainer.distributed.parallel imports trainer.model.loss"]
    pair = {**good, "trainer.data.stream": {"trainer.attention.backend"}, "trainer.attention.backend": {"trainer.data.batch"}}
    assert _upward(pair) == ["trainer.data.stream imports trainer.attention.backend"]
    assert find_cycle(_package_graph(pair)) == ["attention", "data", "attention"]
    assert _upward({"trainer.config": {"trainer.data.stream"}, "trainer.run.x": {"trainer.cli"}}) == [
        "trainer.config imports trainer.data.stream",
        "trainer.run.x imports trainer.cli",
    ]
    known = set(modules(ROOT, "trainer"))
    hinted = _imports_of_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainer.run.state import Run\n", known, name="trainer.model.x"
    )
    assert _upward({"trainer.model.x": hinted}) == ["trainer.model.x imports trainer.run.state"]


def test_no_import_cycle_among_modules():
    cycle = find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_trainer_imports_pipeline_only_through_its_faces():
    """The one face is the door, `pipeline.contract`: every import of pipeline in trainer/ is of it."""
    graph = _graph()
    wrong = sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps if d.split(".")[0] == "pipeline" and not _is_face(d))
    assert wrong == []
    assert sum(DOOR in deps for deps in graph.values()) > 20  # the trainer does use pipeline, through the door
    import pipeline

    assert f"`{DOOR.removeprefix('pipeline.')}`" in " ".join(pipeline.__doc__.split())


def test_the_face_rule_itself():
    """Negative controls: what `_imports` and `_is_face` make of imports of the door and around it."""
    known = set(modules(ROOT, "pipeline")) | {"trainer.x"}
    text = (
        "from pipeline.read import hub\nfrom pipeline.plan import binpack\nimport pipeline.shards.format\n"
        "from pipeline.contract import UserError, hub as h\nfrom pipeline.contract.run_folder import METRICS\n"
        "import pipeline\nimportlib.import_module('pipeline.shards')\n__import__('pipeline.errors')\n"
    )
    found = _imports_of_text(text, known)
    assert found == {
        "pipeline.read.hub",
        "pipeline.plan.binpack",
        "pipeline.shards.format",
        DOOR,
        "pipeline.contract.run_folder",
        "pipeline",
        "pipeline.shards",
        "pipeline.errors",
    }
    hinted = _imports_of_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pipeline.plan\n", known)
    assert hinted == {"typing", "pipeline.plan"}  # an import for type hints only is an edge too
    assert _imports_of_text("from pipeline import contract\nimport_module(name)\n", known) == {DOOR}
    assert {m for m in found if _is_face(m)} == {DOOR}


def test_the_contract_says_each_group_in_one_line_and_each_name_once():
    """Each group of the door says what it is in one line; a name is exported once (a second entry
    would silently replace the first); the trainer uses every name, so none is exported for nothing."""
    import pipeline.contract as contract

    assert all(doc and "\n" not in doc and doc.endswith(".") for doc, _ in contract.GROUPS)
    listed = [name for _, modules in contract.GROUPS for names in modules.values() for name in names] + list(contract.WHOLE)
    assert sorted(listed) == sorted(set(listed)) == contract.__all__
    used = {
        alias.name
        for path in (ROOT / "trainer").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == DOOR
        for alias in node.names
    }
    assert set(listed) - used == set()


def test_the_contract_imports_nothing_of_trainer():
    """pipeline.contract's modules import no trainer module, name none as a source, and taking every
    name it exports loads no trainer module; each name is the very object its module defines (a
    module taken whole is that module)."""
    known = set(modules(ROOT, "pipeline")) | set(modules(ROOT, "trainer"))
    inside = {name: path for name, path in modules(ROOT, "pipeline").items() if name.split(".")[:2] == ["pipeline", "contract"]}
    assert set(inside) == {DOOR, "pipeline.contract.run_folder"}
    imported = {d for name, path in inside.items() for d in _imports(path, name, known)}
    assert imported and not {d for d in imported if d.split(".")[0] == "trainer"}
    code = (
        "import importlib, json, sys\nimport pipeline.contract as c\nfor name, source in c.SOURCES.items():\n"
        "    module = importlib.import_module(source)\n"
        "    assert getattr(c, name) is (module if name in c.WHOLE else getattr(module, name)), name\n"
        "    assert (type(getattr(c, name)) is type(sys)) == (name in c.WHOLE), name\n"
        "print(json.dumps([sorted(set(c.SOURCES.values())), [n for n in sys.modules if n.split('.')[0] == 'trainer']]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sources, loaded = json.loads(proc.stdout.splitlines()[-1])
    assert "pipeline.shards" in sources and not [s for s in sources if s.split(".")[0] != "pipeline"]
    assert loaded == []


def test_the_cycle_search_itself():
    """Negative controls of `find_cycle`: a cycle found, a chain or an outside import is none."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "torch"}, "b": {"c"}, "c": set()}) is None


def _imports_of_text(text: str, known: set[str], name: str = "trainer.x") -> set[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "probe.py"
        path.write_text(text)
        return _imports(path, name, known)


def test_commands_stay_where_they_were():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pack-train"] == "trainer.cli:main"
    assert (ROOT / "trainer" / "cli.py").is_file()
