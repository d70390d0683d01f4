"""scripts/ kept like the product: its folders, the 450-line cap, a docstring that says what each
file is for (and, for a script, the command that runs it), the product reached only through the
modules listed in PRODUCT_FACES, and no script importing another one except through the one shared
library (scripts/benchlib/). Reads the files' text and syntax trees only: nothing is run.

Layout (each script runs as `python3 scripts/<folder>/<name>.py` from the repository's root):
- scripts/bench/    the benchmarks (bench_*.py, scale_table.py) and their shell drivers (*.sh)
- scripts/tools/    the data generators (make_*.py)
- scripts/benchlib/ the library they share (a package; no command of its own)
- tests/gpu/        the GPU correctness checks (check_gpu_*.py), run by tests/gpu/test_gpu_checks.py
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
GPU = ROOT / "tests" / "gpu"
MAX_LINES = 450

FOLDERS = {
    "bench": re.compile(r"(bench_\w+|scale_table)\.py|\w+\.sh"),
    "tools": re.compile(r"make_\w+\.py"),
    "benchlib": re.compile(r"\w+\.py"),
}
GPU_CHECK = re.compile(r"check_gpu_\w+\.py")

# The product modules the scripts may import (pipeline's steps and trainer's packages, by module):
# a script reaching for another one adds it here, where the list of what the scripts depend on is
# reviewed; an entry no script uses any more, or that no longer exists, fails below.
PRODUCT_FACES = sorted([
    "pipeline.cli", "pipeline.files.durable", "pipeline.engines.job", "pipeline.errors", "pipeline.files.folder_lock",
    "pipeline.plan.binpack", "pipeline.plan.rows", "pipeline.read.batches", "pipeline.read.formats",
    "pipeline.read.sources", "pipeline.report.flops", "pipeline.shards", "pipeline.shards.verify",
    "pipeline.tokenize.encode_pool", "pipeline.tokenize.render", "pipeline.tokenize.spill",
    "pipeline.tokenize.tokenize_inputs", "pipeline.tokenize.tokenizer",
    "trainer", "trainer.attention.backend", "trainer.attention.features", "trainer.attention.kernels",
    "trainer.config", "trainer.data.batch", "trainer.data.hf", "trainer.data.row_split", "trainer.data.stream",
    "trainer.distributed.context_parallel", "trainer.distributed.parallel", "trainer.model.fp8",
    "trainer.model.load", "trainer.model.long_rows", "trainer.model.lora", "trainer.model.loss",
    "trainer.model.precision", "trainer.run.loop", "trainer.run.metrics", "trainer.run.profiling",
])  # fmt: skip


def _files() -> list[Path]:
    return sorted([*(p for p in SCRIPTS.rglob("*") if p.is_file() and "__pycache__" not in p.parts), *GPU.glob("check_gpu_*.py")])


def _scripts() -> list[Path]:
    """The files that run as a command: the benchmarks, the tools and the GPU checks."""
    return [p for p in _files() if p.suffix == ".py" and p.parent.name in ("bench", "tools", "gpu")]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _is_module(dotted: str) -> bool:
    """Whether `dotted` names a module or package of the repository."""
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every absolute import in `path`, at any depth; `from a.b import c` counts
    as a.b.c where c is a module of the repository."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = [f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")]
            found += [(m, node.lineno) for m in subs] or [(node.module, node.lineno)]
    return found


def _product_imports(path: Path) -> list[tuple[str, int]]:
    return [(m, n) for m, n in _imports(path) if m.split(".")[0] in ("pipeline", "trainer")]


def test_scripts_live_in_their_folders():
    files = _files()
    assert len(files) > 30  # the control: the walk finds them
    for path in files:
        rel = path.relative_to(SCRIPTS).parts if path.is_relative_to(SCRIPTS) else ("gpu", path.name)
        if rel == ("__init__.py",):
            continue
        assert len(rel) == 2, f"{_rel(path)}: a script lives in one of scripts/{'|'.join(FOLDERS)}/ or tests/gpu/"
        folder, name = rel
        pattern = GPU_CHECK if folder == "gpu" else FOLDERS.get(folder)
        assert pattern is not None and pattern.fullmatch(name), f"{_rel(path)}: not where its kind lives"


def test_no_script_is_over_the_line_cap():
    long = {_rel(p): n for p in _files() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"over {MAX_LINES} lines: split by concern"


@pytest.mark.parametrize("path", _scripts(), ids=_rel)
def test_a_script_says_what_it_is_for_and_its_command(path: Path):
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    assert len(doc.split()) >= 8, f"{_rel(path)}: a module docstring says what it is for"
    assert re.search(rf"python3? (-u )?{re.escape(_rel(path))}\b", doc), (
        f"{_rel(path)}: its docstring shows the command that runs it (python3 {_rel(path)} ...)"
    )


def test_library_modules_and_shell_drivers_say_what_they_are_for():
    for path in _files():
        if path.suffix == ".sh":
            head = path.read_text(encoding="utf-8").splitlines()[:8]
            assert any(f"bash {_rel(path)}" in line for line in head), f"{_rel(path)}: its header shows its command"
        elif path.parent.name == "benchlib" or path == SCRIPTS / "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
            assert len(doc.split()) >= 8, f"{_rel(path)}: a module docstring says what it holds"


def test_scripts_reach_the_product_only_through_its_listed_faces():
    used = set()
    for path in _files():
        if path.suffix != ".py":
            continue
        for module, line in _product_imports(path):
            assert module in PRODUCT_FACES, f"{_rel(path)}:{line} imports {module}, not one of PRODUCT_FACES"
            used.add(module)
    assert used == set(PRODUCT_FACES), f"listed but not imported by any script: {set(PRODUCT_FACES) - used}"
    assert all(_is_module(m) for m in PRODUCT_FACES)


def test_no_script_imports_another_except_through_the_library():
    script_names = {p.stem for p in _scripts()}
    for path in _files():
        if path.suffix != ".py":
            continue
        for module, line in _imports(path):
            top = module.split(".")[0]
            assert top not in script_names, f"{_rel(path)}:{line} imports the script {module}"
            if top == "scripts":
                assert module.startswith("scripts.benchlib"), f"{_rel(path)}:{line}: only scripts.benchlib is shared"
        if path.parent.name == "benchlib":  # the library never reaches back into a script
            tree = ast.parse(path.read_text(encoding="utf-8"))
            relative = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 1]
            assert relative == [], f"{_rel(path)} imports {relative} from outside the library"


def test_shared_options_are_declared_once_in_the_library():
    """The options every benchmark has (--model, --steps, --warmup, --json ...) come from
    `scripts.benchlib.args.add_bench_args`; a script declaring one itself is listed here with why."""
    from_args = ast.parse((SCRIPTS / "benchlib" / "args.py").read_text(encoding="utf-8"))
    table = next(n for n in ast.walk(from_args) if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "SHARED_OPTIONS")
    shared = {f"--{k.value}" for k in table.value.keys}
    own = {
        # a string, not a Path: its default is the tokenizer's name, resolved later
        ("bench_pack_data_memory.py", "--tokenizer"),
        ("make_long_data.py", "--tokenizer"),
        ("bench_unsloth.py", "--workdir"),  # required: bench_train.py's folder, not a default one
        ("make_long_data.py", "--seed"),  # the order of the source's units, with its own help
        # the GPU checks keep their own few options (a check, not a benchmark)
        ("check_gpu_attention.py", "--seed"),
        ("check_gpu_families.py", "--json"),
        ("check_gpu_hf.py", "--max-len"),
        ("check_gpu_hf.py", "--json"),
    }
    declared = set()
    for path in _scripts():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", "") == "add_argument"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in shared
            ):
                declared.add((path.name, node.args[0].value))
    assert declared == own


def test_the_library_face_imports_the_standard_library_only():
    """`import scripts.benchlib` (what bench_pack_data's and bench_ray's timed child processes do
    first) loads no numpy, torch, transformers or product module: they are imported where used."""
    import subprocess
    import sys

    code = (
        "import sys; import scripts.benchlib; heavy = {'numpy', 'torch', 'transformers', 'pipeline', 'trainer'}; "
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"
