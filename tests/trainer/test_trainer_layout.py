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
- trainer imports pipeline only through pipeline's public faces (FACES, named in pipeline/__init__);
- `pack-train` and `python -m trainer.cli` stay where they were.
Every import counts, anywhere in a module: inside functions, and under `if TYPE_CHECKING:` (an
import for type hints only still says the module depends on the other).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from import_graph import find_cycle, modules

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["distributed", "data", "attention", "model", "run"]  # the floors, lowest first
GROUND = "trainer.config"  # below every floor: the options every floor reads
COMMANDS = ("trainer", "trainer.cli")  # above every floor
FACES = {
    'pipeline.shards',  # the shard format
    'pipeline.errors',  # the one-line errors
    'pipeline.api_errors',  # Python spellings of options
    'pipeline.option_checks',  # option checks
    'pipeline.config_file',  # --config files
    'pipeline.foreign.config',  # other tools' config keys
    'pipeline.files.durable',  # atomic writes
    'pipeline.files.contained',  # paths inside a folder
    'pipeline.files.folder_lock',  # folder locks
    'pipeline.read.hub',  # Hub resolution
    'pipeline.tokenize.tokenizer',  # the tokenizer and its fingerprint
    'pipeline.report.flops',  # the one count of training FLOPs
}


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


def _graph() -> dict[str, set[str]]:
    known = set(modules(ROOT, "trainer")) | set(modules(ROOT, "pipeline"))
    # `from trainer import TrainConfig` reaches the package's own __init__: no edge of a cycle
    return {name: _imports(path, name, known) - {"trainer"} for name, path in modules(ROOT, "trainer").items()}


def _is_face(module: str) -> bool:
    return any(module == face or module.startswith(face + ".") for face in FACES)


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
    return sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps
                  if _floor(m) >= 0 and _floor(d) > _floor(m))


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
    good = {"trainer.data.stream": {"trainer.distributed.parallel", "trainer.config", "numpy"},
            "trainer.run.loop": {"trainer.model.load", "trainer.data.stream"}, "trainer.config": {"pipeline.errors"},
            "trainer.cli": {"trainer.run.loop", "trainer.config"}}
    assert _upward(good) == [] and find_cycle(_package_graph(good)) is None
    up = {**good, "trainer.distributed.parallel": {"trainer.model.loss"}}
    assert _upward(up) == ["trainer.distributed.parallel imports trainer.model.loss"]
    pair = {**good, "trainer.data.stream": {"trainer.attention.backend"}, "trainer.attention.backend": {"trainer.data.batch"}}
    assert _upward(pair) == ["trainer.data.stream imports trainer.attention.backend"]
    assert find_cycle(_package_graph(pair)) == ["attention", "data", "attention"]
    assert _upward({"trainer.config": {"trainer.data.stream"}, "trainer.run.x": {"trainer.cli"}}) == [
        "trainer.config imports trainer.data.stream", "trainer.run.x imports trainer.cli"]
    known = set(modules(ROOT, "trainer"))
    hinted = _imports_of_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainer.run.state import Run\n",
                              known, name="trainer.model.x")
    assert _upward({"trainer.model.x": hinted}) == ["trainer.model.x imports trainer.run.state"]


def test_no_import_cycle_among_modules():
    cycle = find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_trainer_imports_pipeline_only_through_its_faces():
    wrong = sorted(f"{m} imports {d}" for m, deps in _graph().items() for d in deps
                   if d.split(".")[0] == "pipeline" and not _is_face(d))
    assert wrong == []
    import pipeline

    assert all(f"`{face.removeprefix('pipeline.')}`" in " ".join(pipeline.__doc__.split()) for face in FACES)


def test_the_face_rule_itself():
    """Negative controls: what `_imports` and `_is_face` make of imports, faces and not."""
    known = set(modules(ROOT, "pipeline")) | {"trainer.x"}
    text = "from pipeline.read import hub\nfrom pipeline.plan import binpack\nimport pipeline.shards.format\n"
    found = _imports_of_text(text, known)
    assert found == {"pipeline.read.hub", "pipeline.plan.binpack", "pipeline.shards.format"}
    hinted = _imports_of_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pipeline.plan\n", known)
    assert hinted == {"typing", "pipeline.plan"}  # an import for type hints only is an edge too
    assert {m: _is_face(m) for m in found | {"pipeline.read"}} == {
        "pipeline.read.hub": True, "pipeline.shards.format": True, "pipeline.plan.binpack": False, "pipeline.read": False}


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
