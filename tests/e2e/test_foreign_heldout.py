"""Held-out real Axolotl example configs (tests/data/foreign_configs/axolotl, copied unchanged from
the examples/ of Axolotl 0.19.0's PyPI sdist after the rest of the foreign-config work: olmo3, phi-3.5,
mistral, llama-3 instruct, a Qwen2.5-based cogito and gemma2), each read as a migrating user brings
it: what the start-up check says of it (runs, or ONE line naming every key it cannot honour), then
each trained end to end on CPU with only the model, the data and that line's own fix changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from test_foreign_recipes import AXOLOTL_DEFAULTS, EXAMPLES, nf4_model, run  # noqa: F401 (nf4_model: a fixture)

from pipeline.cli import pack_data
from trainer.cli import pack_train

# file -> the keys (and the words of the reason) its one-line refusal names; {} where it runs unchanged
HELD_OUT = {
    "olmo3_olmo3-7b-qlora.yaml": {},
    "phi_lora-3.5.yaml": {},  # these four: load_in_8bit with adapter: lora, an int8 base (--int8-base)
    "mistral_lora.yml": {},
    "llama-3_instruct-lora-8b.yml": {},
    "deepcogito_cogito-v1-preview-qwen-14B-lora.yml": {},
    "gemma2_qlora.yml": {},  # drop_system_message: through its chat template (tests/e2e/test_foreign_slices.py)
}
# the fix each refusal's line names, as the user applies it (none left: every held-out file runs)
FIXES: dict[str, dict] = {}


@pytest.mark.parametrize("name", sorted(HELD_OUT))
def test_the_start_up_check_runs_or_names_every_key_in_one_line(name: str):
    refused = HELD_OUT[name]
    for command in (pack_data, pack_train):
        result = CliRunner().invoke(command, ["--config", str(EXAMPLES / "axolotl" / name), "--help"])
        keys = {k: why for k, why in refused.items() if (k == "datasets") == (command is pack_data)}
        if not keys:
            assert result.exit_code == 0, result.output
            continue
        assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
        assert "Traceback" not in result.output
        for key, why in keys.items():
            assert f"key '{key}'" in result.stderr and why in result.stderr


def _fixed(name: str, tmp_path: Path) -> str:
    """The example with its refusal's own fix applied (the file otherwise unchanged)."""
    settings = yaml.safe_load((EXAMPLES / "axolotl" / name).read_text())
    for key in HELD_OUT[name]:
        settings.update(FIXES.get(key, {}))
    folder = tmp_path / "fixed" / "axolotl"
    folder.mkdir(parents=True)
    (folder / name).write_text(yaml.safe_dump(settings, sort_keys=False))
    return str(folder / name)


# gemma2 needs a tokenizer with gemma's turn markers (the local sample's has none): checked by the
# start-up test above only
@pytest.mark.parametrize("name", sorted(set(HELD_OUT) - {"gemma2_qlora.yml"}))
def test_each_held_out_example_trains_its_recipe(tmp_path: Path, name: str, request):
    settings = yaml.safe_load((EXAMPLES / "axolotl" / name).read_text())
    source = _fixed(name, tmp_path) if HELD_OUT[name] else name
    qlora, int8 = settings.get("adapter") == "qlora", settings.get("load_in_8bit") is True
    saved, stderr = run(source, tmp_path, request.getfixturevalue("nf4_model") if qlora else "tiny")
    assert "Axolotl defaults for the keys the file leaves out" in stderr
    assert ("--int8-base: 14 linear layers of the decoder stored in int8" in stderr) == int8  # tiny: 2 x 7
    expected = {
        "lr": settings["learning_rate"],
        "lora_r": settings["lora_r"],
        "qlora": qlora,
        "int8_base": int8,
        "lora_alpha": float(settings["lora_alpha"]),
        "optimizer": {"adamw_bnb_8bit": "adamw8bit", "adamw_8bit": "adamw8bit"}[settings["optimizer"]],
        **{k: AXOLOTL_DEFAULTS[k] for k in ("beta1", "beta2", "adam_eps", "schedule")},
    }
    assert {k: saved[k] for k in expected} == expected
