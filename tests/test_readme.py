"""README.md is a manual: at most 450 lines, every command of its quick start in a code block (the
set-up line and the test command exactly as CI runs them), every link into docs/ (and every other
relative link of the README and the guides, with its #anchor) leading to a file and heading that
exist, every file and module it names existing (`trainer/model/loss.py`, `pipeline.shards.verify_folder`),
and no benchmark figure inside the option tables (figures live in BENCHMARKS.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

MAX_LINES = 450
SETUP = (
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[dev]" && '
    "pack-data data/sample/instructions.jsonl --tokenizer data/tokenizer --max-len 8192 --out out/sample --overwrite"
)
TEST_COMMAND = "python -m pytest -q -n 2 --dist loadgroup"
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```\n", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"^(pack-(data|train|report|verify)|python3? |pip |torchrun )")


def _readme(repo_root: Path) -> str:
    return (repo_root / "README.md").read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of `markdown` (lowercase, punctuation but - and _
    dropped, spaces as -, a repeated heading numbered -1, -2 ...); headings in code blocks are none."""
    found: set[str] = set()
    for line in FENCE.sub("", markdown).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1).strip())  # a link's text
        base = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        slug, n = base, 0
        while slug in found:
            n += 1
            slug = f"{base}-{n}"
        found.add(slug)
    return found


def test_slugs_follow_githubs_rule():
    text = "# A\n## Long examples: `--max-len` up to 1,048,576\n## A\n```\n# not a heading\n```\n"
    assert slugs(text) == {"a", "long-examples---max-len-up-to-1048576", "a-1"}


def test_readme_is_a_manual_of_at_most_450_lines(repo_root: Path):
    lines = _readme(repo_root).splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move long text into docs/"


def loose_commands(section: str) -> list[str]:
    """Command lines of `section` outside its code blocks: a line that starts with one, or a console
    command with arguments written inline (`pack-verify out/sample`)."""
    prose = FENCE.sub("", section)
    lines = [line for line in prose.splitlines() if COMMAND.match(line.strip())]
    inline = [c for c in re.findall(r"`([^`]+)`", prose) if re.match(r"pack-(data|train|report|verify) \S", c)]
    return lines + inline


def test_every_quick_start_command_is_in_a_code_block(repo_root: Path):
    quick = _section(_readme(repo_root), "## Quick start")
    fenced = [line.strip() for block in FENCE.findall(quick) for line in block.splitlines()]
    assert SETUP in fenced and TEST_COMMAND in fenced  # byte for byte what CI and users run
    assert loose_commands(quick) == []
    # the negative control: commands in the prose are found, a flag or a bare name is not
    prose = "## Quick start\nthen `pack-verify out/sample`, `--max-steps 20` or `pack-data`;\npip install -e .\n"
    assert loose_commands(prose) == ["pip install -e .", "pack-verify out/sample"]


def test_ci_runs_the_readmes_test_command(repo_root: Path):
    ci = (repo_root / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert TEST_COMMAND in [line.strip() for line in ci]


def _links(repo_root: Path) -> list[tuple[Path, str]]:
    files = [repo_root / "README.md", *sorted((repo_root / "docs").glob("*.md"))]
    out = []
    for source in files:
        text = FENCE.sub("", source.read_text(encoding="utf-8"))
        out += [(source, target) for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]
    return out


def broken(source: Path, target: str) -> str | None:
    """Why the relative link `target` of the Markdown file `source` leads nowhere, or None."""
    path, _, anchor = target.partition("#")
    file = (source.parent / path).resolve() if path else source
    if not file.exists():
        return f"{source.name}: {target} (no such file)"
    if anchor and file.suffix == ".md" and anchor not in slugs(file.read_text(encoding="utf-8")):
        return f"{source.name}: {target} (no such heading)"
    return None


def test_every_docs_link_resolves(repo_root: Path):
    links = _links(repo_root)
    readme_docs = [t for s, t in links if s.name == "README.md" and t.startswith("docs/")]
    assert len(readme_docs) >= 10  # the guides are linked from the README
    assert [b for s, t in links if (b := broken(s, t))] == []


def test_a_broken_link_is_found(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n## Long rows: `--tile-mlp`\n")
    source = tmp_path / "README.md"
    source.write_text("# packlm\n")
    assert broken(source, "docs/guide.md#long-rows---tile-mlp") is None
    assert broken(source, "#packlm") is None
    assert "no such file" in broken(source, "docs/gide.md")
    assert "no such heading" in broken(source, "docs/guide.md#long-rows")
    assert "no such heading" in broken(source, "#results")


def test_every_guide_is_linked_from_the_readme(repo_root: Path):
    linked = {t.partition("#")[0] for s, t in _links(repo_root) if s.name == "README.md"}
    guides = {f"docs/{p.name}" for p in (repo_root / "docs").glob("*.md")}
    assert guides <= linked, sorted(guides - linked)


PATH = re.compile(r"(?<![\w./-])((?:pipeline|trainer|scripts|tests)/[\w/.-]*)")
MODULE = re.compile(r"(?<![\w./-])((?:pipeline|trainer)(?:\.[A-Za-z_]\w*)+)")


def missing_names(text: str, root: Path) -> list[str]:
    """The paths (`pipeline/shards/`, `scripts/benchlib.py`) and dotted names (`trainer.data.hf`,
    `pipeline.report.flops.train_flops`: a module, or a module and a name its source defines or
    imports) in `text` that do not exist under `root`."""
    missing = [p for p in PATH.findall(text) if not (root / p.rstrip(".")).exists()]
    for name in MODULE.findall(text):
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            base = root.joinpath(*parts[:k])
            source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if source.is_file():
                rest = parts[k:]
                if len(rest) > 1 or (rest and not re.search(rf"\b{rest[0]}\b", source.read_text(encoding="utf-8"))):
                    missing.append(name)
                break
        else:
            missing.append(name)
    return missing


def test_every_file_and_module_the_manual_names_exists(repo_root: Path):
    files = [repo_root / "README.md", *sorted((repo_root / "docs").glob("*.md"))]
    missing = {f.name: m for f in files if (m := missing_names(f.read_text(encoding="utf-8"), repo_root))}
    assert missing == {}


def test_a_name_that_moved_is_found(tmp_path: Path):
    (tmp_path / "trainer" / "data").mkdir(parents=True)
    (tmp_path / "trainer" / "__init__.py").write_text("")
    (tmp_path / "trainer" / "data" / "__init__.py").write_text("")
    (tmp_path / "trainer" / "data" / "hf.py").write_text("def packed_dataset(folder): ...\n")
    text = (
        "`trainer/data/hf.py`, `trainer.data.hf.packed_dataset`, `trainer.data.hf`, `trainer/data/`, and the "
        "moved `trainer/data/check.py`, `trainer.data.hf.PackedCollator`, `trainer.run.loop.train`."
    )
    assert missing_names(text, tmp_path) == ["trainer/data/check.py", "trainer.data.hf.PackedCollator", "trainer.run.loop.train"]


@pytest.mark.parametrize("command", ["pack-data", "pack-train"])
def test_option_tables_hold_no_benchmark_figures(repo_root: Path, command: str):
    readme = _readme(repo_root)
    start, end = f"<!-- options:{command} -->", f"<!-- /options:{command} -->"
    assert start in readme and end in readme
    table = readme[readme.index(start) : readme.index(end)]
    assert table.count("\n|") > 20
    figures = re.findall(r"\d(?:\.\d+)?x (?:faster|slower|the|bf16|HF)|\d+(?:\.\d+)?% (?:MFU|faster|slower)|tokens/s", table)
    assert not figures, figures
