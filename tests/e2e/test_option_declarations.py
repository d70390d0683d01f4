"""Each option of pack-train and pack-data is declared once (`pipeline.option_checks.opt` on its
config field): the click options, the checks of `validate` and of `--config FILE`, and the README's
option tables are generated from it, so adding an option touches its declaration and its use."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pipeline.cli import pack_data
from pipeline.config_file import config_option, read_config_file
from pipeline.engines.pack_config import PACK_CHECKS, PackConfig
from pipeline.errors import UserError
from pipeline.option_checks import checks_of, click_options, declarations, opt, option_table, param_fields
from trainer.cli import pack_train
from trainer.config import TRAIN_CHECKS, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [(pack_train, TrainConfig), (pack_data, PackConfig)]
BY_HAND = {"config", "offline", "inputs"}  # --config, --offline (no field) and pack-data's INPUT... argument


def undeclared(config_type: type) -> list[str]:
    """The fields of `config_type` without a complete declaration (help, section, kind)."""
    declared = declarations(config_type)
    return [
        f.name
        for f in fields(config_type)
        if f.name not in declared or not declared[f.name].help or not declared[f.name].section or declared[f.name].check.kind is None
    ]


@pytest.mark.parametrize("config_type", [TrainConfig, PackConfig])
def test_every_field_is_declared_once_with_help_type_and_default(config_type: type):
    assert undeclared(config_type) == []
    assert list(declarations(config_type)) == [f.name for f in fields(config_type)]


def test_an_undeclared_field_is_found():
    """Negative control of `undeclared`: a plain field, and one declared without help."""

    @dataclass
    class Partly:
        a: int = opt(1, help="A.", section="S")
        b: int = 2
        c: int = opt(3, help="", section="S")

    assert undeclared(Partly) == ["b", "c"]


@pytest.mark.parametrize(("command", "config_type"), COMMANDS)
def test_every_click_option_comes_from_its_declaration(command: click.Command, config_type: type):
    declared = declarations(config_type)
    names = {param: name for name, param in ((n, n) for n in declared)} | {p: f for p, f in param_fields(config_type).items()}
    params = [p for p in command.params if p.name not in BY_HAND]
    assert sorted(names[p.name] for p in params) == sorted(n for n, d in declared.items() if d.cli)
    for param in params:
        d = declared[names[param.name]]
        assert param.help == d.help
        if d.check.choices:
            assert tuple(param.type.choices) == d.check.choices


def test_the_checks_are_generated_not_written_by_hand():
    assert TRAIN_CHECKS == checks_of(TrainConfig) and PACK_CHECKS == checks_of(PackConfig)
    for path in [*(ROOT / "trainer").rglob("*.py"), *(ROOT / "pipeline").rglob("*.py")]:
        if path.relative_to(ROOT).as_posix() in ("pipeline/option_checks.py", "pipeline/config_file.py"):
            continue  # the machinery: a kind alone (`Check(int)`) checks a value's type
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Check"]
        assert not calls, f"{path}: a Check written by hand; declare the option with opt()"


def test_adding_an_option_is_its_declaration(tmp_path: Path):
    """One field with `opt()` is a flag with its help and default, refused out of range on the
    command line, in a --config file and from Python alike."""

    @dataclass
    class Config:
        depth: int = opt(3, low=1, high=8, section="Model", help="Layers to stack.")

    @click.command()
    @config_option(checks=checks_of(Config))
    @click_options(Config, ranges=True)
    def command(depth: int) -> None:
        click.echo(f"depth={depth}")

    runner = CliRunner()
    assert "Layers to stack." in runner.invoke(command, ["--help"]).output
    assert runner.invoke(command, []).output == "depth=3\n"
    assert runner.invoke(command, ["--depth", "9"]).exit_code == 2  # click's range
    (tmp_path / "c.yaml").write_text("depth: 9\n")
    with pytest.raises(UserError, match=r"--depth must be between 1 and 8, got 9"):
        read_config_file(tmp_path / "c.yaml", command, checks_of(Config))
    assert "| `--depth` | 3 | integer between 1 and 8 | Layers to stack. |" in option_table(Config)


def test_a_hidden_option_takes_its_flag_but_stays_out_of_help_and_tables():
    @dataclass
    class Config:
        shown: bool = opt(False, section="S", help="Seen.")
        secret: int = opt(0, low=0, hidden=True, section="S", help="Not for users.")

    @click.command()
    @click_options(Config, ranges=True)
    def command(shown: bool, secret: int) -> None:
        click.echo(f"{shown} {secret}")

    runner = CliRunner()
    assert runner.invoke(command, ["--secret", "4", "--shown"]).output == "True 4\n"
    assert "--secret" not in runner.invoke(command, ["--help"]).output
    assert "--secret" not in option_table(Config) and "| `--shown` | off | on/off | Seen. |" in option_table(Config)


def marked(readme: str, name: str) -> str | None:
    """The text of `readme` between `<!-- options:NAME -->` and `<!-- /options:NAME -->`, or None."""
    found = re.search(rf"<!-- options:{name} -->\n(.*?)<!-- /options:{name} -->", readme, re.S)
    return found.group(1).strip() if found else None


@pytest.mark.parametrize(("name", "config_type"), [("pack-train", TrainConfig), ("pack-data", PackConfig)])
def test_the_readme_tables_are_the_generated_ones(name: str, config_type: type):
    """README.md's tables between its markers are `option_table`'s output (regenerate them with
    python -m pipeline.option_checks pack-train, and pack-data)."""
    found = marked((ROOT / "README.md").read_text(encoding="utf-8"), name)
    if found is None:
        pytest.skip(f"README.md has no <!-- options:{name} --> markers")
    assert found == option_table(config_type).strip()


def test_the_readme_markers_are_read_exactly():
    """Negative control of `marked`: a table edited by hand differs, other commands' are apart."""
    table = option_table(PackConfig)
    readme = f"intro\n<!-- options:pack-data -->\n{table}<!-- /options:pack-data -->\nrest\n"
    assert marked(readme, "pack-data") == table.strip()
    assert marked(readme.replace("| 32 |", "| 64 |"), "pack-data") != table.strip()
    assert marked(readme, "pack-train") is None


@pytest.mark.parametrize(("name", "config_type"), [("pack-train", TrainConfig), ("pack-data", PackConfig)])
def test_the_tables_command_prints_the_generated_tables(name: str, config_type: type):
    done = subprocess.run([sys.executable, "-m", "pipeline.option_checks", name], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout == option_table(config_type) and done.stderr == ""
    wrong = subprocess.run([sys.executable, "-m", "pipeline.option_checks", "pack-verify"], capture_output=True, text=True, cwd=ROOT)
    assert wrong.returncode == 1 and wrong.stdout == "" and "usage:" in wrong.stderr


def test_the_table_shows_sections_flags_and_defaults():
    table = option_table(TrainConfig)
    assert table.index("**Optimizer**") < table.index("| `--beta1` | 0.9 | number >= 0 and < 1 |")
    assert "| `--compile` / `--no-compile` | - | on/off |" in table
    assert "| `--no-progress` | off | on/off | No progress bar. |" in table
    assert "| `--data` | required | path |" in table
    assert "--prefetch" not in table  # a field without a flag
