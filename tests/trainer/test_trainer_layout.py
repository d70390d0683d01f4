"""The layout of `trainer/`: concern packages in the order a training step uses them.

- every package of trainer/ has an `__init__` whose docstring is one line (what it is for);
- no module of trainer/ is over 450 lines (tests/pipeline/test_layout.py checks that limit for both
  packages);
- no import cycle among trainer's modules, counting imports inside functions too (not those under
  `if TYPE_CHECKING:`, for type hints only, which never run);
- trainer imports pipeline only through pipeline's public faces (FACES, named in pipeline/__init__);
- `pack-train` and `python -m trainer.cli` stay where they were.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from import_graph import find_cycle, modules

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ['data', 'model', 'attention', 'distributed', 'run']  # in a step's order
FACES = {
    'pipeline.shards',  # the shard format
    'pipeline.errors',  # the one-line errors
    'pipeline.api_errors',  # Python spellings of options
    'pipeline.option_checks',  # option checks
    'pipeline.config_file',  # --config files
    'pipeline.foreign_config',  # other tools' config keys
    'pipeline.durable',  # atomic writes
    'pipeline.contained',  # paths inside a folder
    'pipeline.folder_lock',  # folder locks
    'pipeline.read.hub',  # Hub resolution
    'pipeline.tokenize.tokenizer',  # the tokenizer and its fingerprint
    'pipeline.report.flops',  # the one count of training FLOPs
}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module a module imports, anywhere in it: the longest name of `known` that each import
    names (`from pipeline.read import hub` is pipeline.read.hub), or the import itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                   for stmt in block.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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


def _is_type_checking(node: ast.AST) -> bool:
    """An `if TYPE_CHECKING:` block: its imports are for type hints only and never run."""
    return isinstance(node, ast.If) and (getattr(node.test, "id", None) == "TYPE_CHECKING"
                                          or getattr(node.test, "attr", None) == "TYPE_CHECKING")


def _graph() -> dict[str, set[str]]:
    known = set(modules(ROOT, "trainer")) | set(modules(ROOT, "pipeline"))
    # `from trainer import TrainConfig` reaches the package's own __init__: no edge of a cycle
    return {name: _imports(path, name, known) - {"trainer"} for name, path in modules(ROOT, "trainer").items()}


def _is_face(module: str) -> bool:
    return any(module == face or module.startswith(face + ".") for face in FACES)


def test_packages_are_the_concerns_each_said_in_one_line():
    found = {p.name for p in (ROOT / "trainer").iterdir() if (p / "__init__.py").is_file()}
    assert found == set(PACKAGES)
    for package in PACKAGES:
        doc = ast.get_docstring(ast.parse((ROOT / "trainer" / package / "__init__.py").read_text()))
        assert doc and "\n" not in doc.strip(), f"trainer/{package}/__init__.py: one line of docstring"
    tops = sorted(p.name for p in (ROOT / "trainer").glob("*.py"))
    assert tops == ["__init__.py", "cli.py", "config.py"]


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
    assert hinted == {"typing"}  # an import for type hints only is no edge
    assert {m: _is_face(m) for m in found | {"pipeline.read"}} == {
        "pipeline.read.hub": True, "pipeline.shards.format": True, "pipeline.plan.binpack": False, "pipeline.read": False}


def test_the_cycle_search_itself():
    """Negative controls of `find_cycle`: a cycle found, a chain or an outside import is none."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "torch"}, "b": {"c"}, "c": set()}) is None


def _imports_of_text(text: str, known: set[str]) -> set[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "probe.py"
        path.write_text(text)
        return _imports(path, "trainer.x", known)


def test_commands_stay_where_they_were():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pack-train"] == "trainer.cli:main"
    assert (ROOT / "trainer" / "cli.py").is_file()
