"""The layout of `pipeline/`: its folders are the steps of pack-data in the data's order, and the
imports follow that order.

- a step package imports only itself and the steps before it: read < tokenize < plan < write <
  report < engines < cli; `shards/` (the shard format), `contract/run_folder` (the run folder's
  names) and the shared modules at the top of `pipeline/` import no step;
- `pipeline.contract`, the trainer's one door, re-exports from the steps (on first use: its
  `SOURCES` are its imports), so it sits above them beside the commands, and no step imports it;
- no cycle among modules, counting imports inside functions too;
- `pipeline` never imports `trainer`;
- the public API (`from pipeline import ...`, `trainer.train`) is what it was;
- every package is in the wheel (pyproject's package patterns);
- no module of `pipeline/` or `trainer/` is over 450 lines (the developers' guide's limit).
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import tomllib
from pathlib import Path

from import_graph import find_cycle, modules

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["read", "tokenize", "plan", "write", "report", "engines"]  # in the data's order


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of `pipeline`."""
    return modules(ROOT, "pipeline")


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of `known` (and any `trainer` module) that a module imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "trainer":
                out.add(target)
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _rank(module: str) -> int:
    """0: shared modules, the shard format and the run folder's names; 1..6: the steps in order; 7:
    the commands and the trainer's door (`pipeline.contract`)."""
    parts = module.split(".")
    if module in ("pipeline", "pipeline.cli", "pipeline.contract"):
        return len(STEPS) + 1
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in STEPS):
        return STEPS.index(parts[1]) + 1 if parts[1] in STEPS else 0
    return 0


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    # a package's own __init__ is what `import pipeline.x` runs first: count it only where named
    graph = {name: _imports(path, name, known) - {"pipeline"} for name, path in modules.items()}
    from pipeline.contract import SOURCES

    graph["pipeline.contract"] |= set(SOURCES.values())  # imported on first use: its imports all the same
    return graph


def test_no_module_of_pipeline_imports_trainer():
    bad = {m: sorted(t for t in deps if t.split(".")[0] == "trainer") for m, deps in _graph().items()}
    assert not {m: t for m, t in bad.items() if t}
    code = (
        "import importlib, pkgutil, sys, pipeline\n"
        "for m in pkgutil.walk_packages(pipeline.__path__, 'pipeline.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(sorted(n for n in sys.modules if n == 'trainer' or n.startswith('trainer.')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "[]"


def test_steps_import_only_earlier_steps():
    graph = _graph()
    assert {m.split(".")[1] for m in graph if m.count(".") >= 2} >= set(STEPS) | {"shards"}
    wrong = sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps if d.startswith("pipeline") and _rank(d) > _rank(m))
    assert wrong == []


def test_the_rank_rule_itself():
    """Negative controls of `_rank`: what it places where."""
    assert _rank("pipeline.errors") == _rank("pipeline.shards.format") == 0
    assert _rank("pipeline.read.sources") < _rank("pipeline.tokenize.spill") < _rank("pipeline.plan.rows")
    assert _rank("pipeline.write.outdir") < _rank("pipeline.report.stats") < _rank("pipeline.engines.job")
    assert _rank("pipeline.engines.job") < _rank("pipeline.cli")
    assert _rank("pipeline.read") == 1  # a step's own __init__ belongs to it
    assert _rank("pipeline.contract.run_folder") == 0 and _rank("pipeline.contract") > _rank("pipeline.engines.job")


def test_the_contract_is_above_the_steps_and_none_goes_through_it():
    """The door's exports count as its imports (a step among them), and a step importing the door
    is caught (a negative control on a copy of the graph)."""
    graph = _graph()
    assert {"pipeline.report.flops", "pipeline.shards", "pipeline.contract.run_folder"} <= graph["pipeline.contract"]
    assert not [m for m, deps in graph.items() if "pipeline.contract" in deps]
    graph["pipeline.report.run_summary"] = graph["pipeline.report.run_summary"] | {"pipeline.contract"}
    assert [f"{m} imports {d}" for m, deps in graph.items() for d in deps if _rank(d) > _rank(m)] == [
        "pipeline.report.run_summary imports pipeline.contract"
    ]


def test_no_import_cycle_among_modules():
    cycle = find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_public_api_is_unchanged():
    import pipeline
    import trainer

    assert sorted(pipeline.__all__) == ["PackConfig", "assign_bins", "read_manifest", "run_pack_data", "verify_folder"]
    fresh = subprocess.run(
        [sys.executable, "-c", "import pipeline; print(sorted(n for n in dir(pipeline) if n[0] != '_'))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fresh.stdout.strip() == "['Any', 'import_module']", fresh.stderr
    signatures = {
        name: str(inspect.signature(getattr(pipeline, name))) for name in ("assign_bins", "run_pack_data", "read_manifest", "verify_folder")
    }
    assert signatures == {
        "assign_bins": "(lengths: 'np.ndarray', max_len: 'int', strategy: 'str' = 'ffd', seed: 'int' = 0, "
        "group_size: 'int' = 32) -> 'np.ndarray'",
        "run_pack_data": "(config: 'PackConfig', *, echo: 'Callable[[str], None] | None' = None, "
        "stats: 'dict[str, Any] | None' = None) -> 'Manifest'",
        "read_manifest": "(folder: 'str | os.PathLike[str]') -> 'Manifest'",
        "verify_folder": "(folder: 'str | os.PathLike[str]', *, check_hashes: 'bool' = True, "
        "checked: 'dict[str, ShardSummary] | None' = None) -> 'Manifest'",
    }
    assert list(inspect.signature(pipeline.PackConfig).parameters)[:2] == ["format", "text_field"]
    assert trainer.__all__ == ["TrainConfig", "train"]
    assert (
        str(inspect.signature(trainer.train)) == "(config: 'TrainConfig', opened: 'tuple[Manifest, Any] | None' = None) -> 'dict[str, Any]'"
    )


def test_every_package_is_in_the_wheel():
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = set(find_packages(str(ROOT), include=find["include"]))
    packages = {".".join(p.parent.relative_to(ROOT).parts) for top in ("pipeline", "trainer") for p in (ROOT / top).rglob("__init__.py")}
    assert packages <= shipped and {"pipeline.read", "pipeline.shards", "pipeline.engines"} <= shipped
    assert not {p for p in shipped if p.split(".")[0] not in ("pipeline", "trainer")}


def test_modules_are_at_most_450_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for top in ("pipeline", "trainer")
        for p in sorted((ROOT / top).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 450
    }
    assert long == {}


def test_at_most_ten_modules_at_the_top_of_pipeline():
    """pipeline/'s top holds its commands and the few modules every step shares (errors, options,
    config files, progress, background work, datasets' split syntax); the rest lives in packages
    (files/: safe writing, foreign/: other tools' configs, and the steps)."""
    top = sorted(p.name for p in (ROOT / "pipeline").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 10, top
