"""The scripts in scripts/ keep the product's rules: a file they write is replaced whole or not at
all (`benchlib.write_output`, over `pipeline.files.durable.write_atomic`), a target that is no regular
file (a device such as /dev/null, a FIFO, a folder, a path below a file) is refused before any
work, a full disk is one line with nothing left behind, and an absurd option ends at once in one
line. The cases run the scripts as a user does (their own process) where the line itself is the
point, and in this process for the variants of one class.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from small_disk import small_disk

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
# every script: the benchmarks, the tools, the library they share and the GPU checks
SCRIPT_FILES = sorted([*SCRIPTS.rglob("*.py"), *(ROOT / "tests" / "gpu").glob("check_*.py")])


def _path(name: str) -> Path:
    """The script file called `name` (its folder under scripts/ or tests/gpu/)."""
    (path,) = [p for p in SCRIPT_FILES if p.name == name]
    return path


def _load(name: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(name, _path(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def long_data():  # noqa: ANN201
    return _load("make_long_data")


@pytest.fixture(scope="module")
def benchlib():  # noqa: ANN201
    sys.path.insert(0, str(ROOT))
    return importlib.import_module("scripts.benchlib")


def _script(name: str, *args: object, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(_path(name)), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _one_line(proc: subprocess.CompletedProcess, status: int = 1) -> str:
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr


def _device(tmp_path: Path) -> Path:
    """A character device like /dev/null, made beside `tmp_path` (a script that wrongly wrote to it
    would replace the test's own node, never the machine's /dev/null, which root could replace); where
    nodes cannot be made (not root), /dev/null itself, which such a user cannot replace either."""
    import stat

    node = tmp_path.parent / f"{tmp_path.name}-null"
    if not node.exists():
        try:
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except OSError:
            return Path("/dev/null")
    return node


def _targets(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Targets no script may write: (path, a phrase of its refusal)."""
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "mine.txt").write_text("the user's")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    note = tmp_path / "note.txt"
    note.write_text("the user's")
    link = tmp_path / "to-null"
    link.symlink_to(_device(tmp_path))
    return {
        "device": (_device(tmp_path), "is not a regular file"),
        "fifo": (fifo, "is not a regular file"),
        "link to a device": (link, "is not a regular file"),
        "folder": (folder, "is a folder"),
        "below a file": (note / "x.jsonl", "is a file, not a folder"),
    }


def _unchanged(tmp_path: Path) -> None:
    assert (tmp_path / "folder" / "mine.txt").read_text() == "the user's"
    assert sorted(p.name for p in (tmp_path / "folder").iterdir()) == ["mine.txt"]
    assert (tmp_path / "note.txt").read_text() == "the user's"
    assert (tmp_path / "fifo").is_fifo() and (tmp_path / "to-null").is_symlink()
    assert _device(tmp_path).is_char_device()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file


def test_make_long_data_refuses_a_device_in_one_line_before_any_work(tmp_path: Path):
    device = _device(tmp_path)
    proc = _script("make_long_data.py", "--lengths", "3000", "--out", device, cwd=tmp_path)
    assert f"error: --out {device} is not a regular file" in _one_line(proc)
    assert proc.stdout == ""  # no example was built


@pytest.mark.parametrize("what", ["device", "fifo", "link to a device", "folder", "below a file"])
def test_make_long_data_refuses_every_target_that_is_no_regular_file(long_data, tmp_path: Path, what: str):
    path, phrase = _targets(tmp_path)[what]
    with pytest.raises(SystemExit) as exc:
        long_data.main(["--lengths", "3000", "--out", str(path)])
    message = str(exc.value.code)
    assert message.startswith("error: --out ") and phrase in message and "\n" not in message
    _unchanged(tmp_path)


@pytest.mark.parametrize(
    "args, phrase",
    [
        (["--lengths", "99999999999999999999"], "at most 16777216"),
        (["--lengths", "3000,16777217"], "at most 16777216"),
        (["--lengths", "1e308"], "expected comma-separated integers"),
        (["--lengths", "9" * 5000], "expected comma-separated integers"),  # past int()'s digit limit
        (["--lengths", "-64"], "each length must be at least 64 tokens"),
        (["--lengths", "1048576", "--count", "99999999999999999999"], "tokens in all, which are held in memory"),
        (["--lengths", "16777216", "--count", "9"], "tokens in all, which are held in memory"),
    ],
)
def test_make_long_data_refuses_an_absurd_size_at_once(long_data, tmp_path: Path, args: list[str], phrase: str, capsys):
    with pytest.raises(SystemExit) as exc:
        long_data.main([*args, "--out", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and phrase in err and err.count("\n") == 1 and len(err) < 400, err
    assert list(tmp_path.iterdir()) == []


def test_make_long_data_an_absurd_length_is_one_line_as_a_user_runs_it(tmp_path: Path):
    proc = _script("make_long_data.py", "--lengths", "99999999999999999999", "--out", "x.jsonl", cwd=tmp_path)
    assert "at most 16777216" in _one_line(proc, status=2)
    assert list(tmp_path.iterdir()) == []


def test_make_long_data_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path):
    with small_disk(tmp_path / "small", "64k") as small:
        proc = _script("make_long_data.py", "--lengths", "40000", "--out", small / "long.jsonl", cwd=tmp_path)
        line = _one_line(proc)
        assert line.startswith(f"error: disk full while writing {small / 'long.jsonl'}: ") and "--out" in line
        assert list(small.iterdir()) == []


def test_make_long_data_replaces_a_regular_file_whole_and_keeps_a_link(long_data, tmp_path: Path):
    """The control: a regular file is a target (replaced), and a link to one stays a link to it."""
    real = tmp_path / "real.jsonl"
    real.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real.name)
    assert long_data.main(["--lengths", "3000", "--out", str(link)]) == 0
    assert link.is_symlink() and json.loads(real.read_text().splitlines()[0])["messages"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "real.jsonl"]


@pytest.mark.parametrize("what", ["device", "fifo", "link to a device", "folder", "below a file"])
def test_benchlib_write_output_refuses_what_check_output_refuses(benchlib, tmp_path: Path, what: str):
    path, phrase = _targets(tmp_path)[what]
    with pytest.raises(SystemExit) as exc:
        benchlib.write_json(path, {"a": 1})
    assert str(exc.value.code).startswith(f"error: --json {path}") and phrase in str(exc.value.code)
    _unchanged(tmp_path)


def test_benchlib_write_output_on_a_full_disk_keeps_the_old_file(benchlib, tmp_path: Path):
    with small_disk(tmp_path / "small", "64k") as small:
        (small / "r.json").write_text("old")
        with pytest.raises(SystemExit) as exc:
            benchlib.write_text_output(small / "r.json", "x" * 200_000)
        assert str(exc.value.code) == (
            f"error: disk full while writing {small / 'r.json'}: free some space or choose another --json; nothing was written"
        )
        assert [p.name for p in small.iterdir()] == ["r.json"] and (small / "r.json").read_text() == "old"
        benchlib.write_text_output(small / "r.json", "new")  # the control: what fits is written
        assert (small / "r.json").read_text() == "new"


@pytest.mark.parametrize(
    "script, args",
    [
        ("scale_table.py", ["runs", "--json"]),
        ("scale_table.py", ["runs", "--md"]),
        ("make_sample_data.py", ["--out"]),
    ],
)
def test_other_scripts_refuse_a_device_in_one_line(tmp_path: Path, script: str, args: list[str]):
    device = _device(tmp_path)
    proc = _script(script, *args, device, cwd=tmp_path)
    assert f"{device} is not a" in _one_line(proc) and device.is_char_device()
    assert list(tmp_path.iterdir()) == []


def _writes(tree: ast.AST) -> list[str]:
    """The calls in `tree` that write a file other than through benchlib's writers."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            mode = next((a.value for a in node.args if isinstance(a, ast.Constant) and a.value in ("w", "wb")), None)
            if name in ("write_text", "write_bytes", "savefig") or (name == "open" and mode):
                found.append(f"{name} at line {node.lineno}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open":
            if any(isinstance(a, ast.Constant) and a.value in ("w", "wb") for a in node.args):
                found.append(f"open at line {node.lineno}")
    return found


# Writes left as they are: each into a temporary file or folder the script itself made.
OWN_TEMPORARY = {
    "benchlib/output.py": 2,  # write_output's own writers (a temporary file)
    "benchlib/machine.py": 1,  # /proc/self/clear_refs
    "bench/bench_loss.py": 1,  # savefig into write_output's temporary file
    "benchlib/pack_data_runs.py": 2,  # make_copies and replicate: inputs in the benchmark's temporary folder
    "tools/make_long_data.py": 1,  # one example counted in its temporary folder
    "tools/make_sample_data.py": 1,  # write_jsonl's writer of write_output's temporary file
    "benchlib/alst_child.py": 1,  # the peak-memory JSON in bench_alst's own work folder (runs without packlm)
}


def test_every_script_writes_its_outputs_through_benchlib():
    """The class, not the cases: a new script that writes a file with write_text or open(..., "w")
    fails here until it uses benchlib's `write_output` (or is a temporary file of its own, listed)."""
    assert len(SCRIPT_FILES) > 20  # the control: the scripts are found where they live
    for path in SCRIPT_FILES:
        name = path.relative_to(SCRIPTS).as_posix() if path.is_relative_to(SCRIPTS) else path.name
        writes = _writes(ast.parse(path.read_text(encoding="utf-8")))
        assert len(writes) == OWN_TEMPORARY.get(name, 0), (name, writes)


# ------------------------------------------------------------- text and options of pack-data itself

TOKENIZER = ROOT / "data" / "tokenizer"


def _pack(tmp_path: Path, *inputs: Path, extra: tuple[str, ...] = ()):  # noqa: ANN202
    from click.testing import CliRunner

    from pipeline.cli import pack_data

    return CliRunner().invoke(
        pack_data,
        [
            *map(str, inputs),
            "--tokenizer",
            str(TOKENIZER),
            "--max-len",
            "64",
            "--num-proc",
            "1",
            "--no-progress",
            "--out",
            str(tmp_path / "out"),
            *extra,
        ],
    )


def test_a_lone_surrogate_is_one_line_naming_its_file_line_and_field(tmp_path: Path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "a\\ud800b"}\n{"text": "four"}\n')
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pipeline.cli import pack_data; pack_data()",
            str(data),
            "--tokenizer",
            str(TOKENIZER),
            "--max-len",
            "64",
            "--no-progress",
            "--out",
            "out",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert _one_line(proc) == (
        f"Error: {data} line 3: field 'text' holds a lone surrogate \\ud800 (half of a "
        "UTF-16 pair, not a character): fix the text, e.g. replace it with \\ufffd or remove it\n"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name, text, where",
    [
        ("low.jsonl", '{"text": "x"}\n{"text": "a\\udc00"}\n', "line 2: field 'text' holds a lone surrogate \\udc00"),
        ("unpaired.jsonl", '{"text": "\\ud83d\\u0041"}\n', "line 1: field 'text' holds a lone surrogate \\ud83d"),
        (
            "chat.jsonl",
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\\ud800"}]}\n',
            "line 1: field 'messages[1].content' holds",
        ),
        ("key.jsonl", '{"text": "x", "meta": {"\\udfff": 1}}\n', "line 1: a key of 'meta' holds a lone surrogate \\udfff"),
        ("array.json", '[{"text": "x"},\n {"text": "y"},\n {"text": "\\ud800"}]\n', "line 3: field 'text' holds"),
    ],
)
def test_a_lone_surrogate_anywhere_in_a_record_is_named(tmp_path: Path, name: str, text: str, where: str):
    data = tmp_path / name
    data.write_text(text)
    result = _pack(tmp_path, data)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert f"{data} {where}" in result.output and "nested fields" not in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_a_surrogate_pair_and_an_escaped_backslash_pack(tmp_path: Path):
    """The control: a pair (an emoji) is text, and `\\\\ud800` is a backslash and five letters."""
    data = tmp_path / "fine.jsonl"
    data.write_text('{"text": "smile \\ud83d\\ude00"}\n{"text": "a\\\\ud800b"}\n')
    result = _pack(tmp_path, data)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]["examples_packed"] == 2


@pytest.mark.parametrize("weight", ["1e308", "1e400", "inf", "-inf", "nan", "0", "-0", "-1", "1099511627777", "9" * 400])
def test_an_absurd_mix_weight_is_one_line(tmp_path: Path, weight: str):
    result = _pack(tmp_path, ROOT / "data" / "sample" / "text.jsonl", extra=("--mix", f"text.jsonl={weight}"))
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "a weight must be a number above 0 and at most 1099511627776" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_the_largest_mix_weight_is_parsed_and_refused_by_the_plan_s_memory(tmp_path: Path):
    """The control of the bound: 2**40 passes the parse, and the plan's size check names its memory."""
    result = _pack(tmp_path, ROOT / "data" / "sample" / "text.jsonl", extra=("--mix", "text.jsonl=1099511627776"))
    assert result.exit_code == 1 and "planning them needs about" in result.output, result.output
    assert not (tmp_path / "out").exists()
