"""The last dataset keys of Axolotl and TRL files that pack-data refused (issue 68), now packed as those
tools would load them: a share of a split (`split: train[:20%]`, the rows `datasets` selects, for a
local file and a Hub dataset), `data_files` of a Hub dataset (only those files of its snapshot, the
dataset's id kept), and `drop_system_message` (each conversation without its first system message,
said at start-up); and the shapes that cannot be honoured exactly, each one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hf_cache import C1, add_snapshot, hf_home  # noqa: F401 - hf_home is a fixture

from pipeline.cli import pack_data
from pipeline.shards import read_manifest

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = str(ROOT / "data" / "tokenizer")
TEXT = ROOT / "data" / "sample" / "text.jsonl"
CHAT = ROOT / "data" / "sample" / "chat.jsonl"
FLAGS = ["--no-progress", "--num-proc", "1", "--max-len", "256"]


def _config(tmp_path: Path, datasets: list[dict], name: str = "axolotl.yaml", **top: object) -> Path:
    cfg = tmp_path / name
    cfg.write_text(yaml.safe_dump({"base_model": "tiny", "tokenizer_config": TOKENIZER, "datasets": datasets, **top}, sort_keys=False))
    return cfg


def _pack(tmp_path: Path, out: str, *args: str) -> tuple[Path, str]:
    result = CliRunner().invoke(pack_data, [*args, "--out", str(tmp_path / out), *FLAGS])
    assert result.exit_code == 0, result.output
    return tmp_path / out, result.stderr


def _hashes(folder: Path) -> list[str]:
    return [s.sha256 for s in read_manifest(folder).shards]


def _one_line(tmp_path: Path, cfg: Path) -> str:
    result = CliRunner().invoke(pack_data, ["--config", str(cfg), "--out", str(tmp_path / "refused"), *FLAGS])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and "Traceback" not in result.output, result.output
    assert not (tmp_path / "refused").exists()
    return lines[0]


def _selected(files: str | list[str], split: str, to: Path) -> Path:
    """The rows `datasets.load_dataset` selects for `split`, written as JSON Lines."""
    import datasets

    datasets.disable_progress_bars()
    rows = datasets.load_dataset("json", data_files=files, split=split).to_list()
    to.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return to


@pytest.mark.parametrize("split", ["train[:20%]", "train[10:100]", "train[-5%:]", "train[33%:67%]"])
def test_a_share_of_a_local_split_packs_the_rows_datasets_selects(tmp_path: Path, split: str) -> None:
    cfg = _config(tmp_path, [{"path": str(TEXT), "type": "completion", "split": split}])
    folder, stderr = _pack(tmp_path, "sliced", "--config", str(cfg))
    assert f"INPUTS {TEXT}:{split}" in stderr  # the start-up summary names the share
    same = _selected(str(TEXT), split, tmp_path / "selected.jsonl")
    control, _ = _pack(tmp_path, "control", "--config", str(_config(tmp_path, [{"path": str(same), "type": "completion"}], "control.yaml")))
    assert _hashes(folder) == _hashes(control)
    assert read_manifest(folder).counts.examples_read == len(same.read_text().splitlines())
    whole, _ = _pack(tmp_path, "whole", "--config", str(_config(tmp_path, [{"path": str(TEXT), "type": "completion"}], "whole.yaml")))
    assert _hashes(whole) != _hashes(folder)  # negative control: the whole file is another packing


def test_the_first_n_examples_pack_as_limit_did(tmp_path: Path) -> None:
    cfg = _config(tmp_path, [{"path": str(TEXT), "type": "completion", "split": "train[:40]"}])
    folder, _ = _pack(tmp_path, "first", "--config", str(cfg))
    whole = _config(tmp_path, [{"path": str(TEXT), "type": "completion"}], "whole.yaml")
    limited, _ = _pack(tmp_path, "limited", "--config", str(whole), "--limit", "40")
    assert _hashes(folder) == _hashes(limited) and read_manifest(folder).counts.examples_read == 40


def _hub_dataset(home: Path, tmp_path: Path) -> Path:
    """someone/ds in the cache: the train split in data/ (texts 0-99), and pretrain/rp_sub.jsonl (the
    sample's texts), which no split convention reads."""
    rows = [json.loads(line) for line in TEXT.read_text().splitlines()]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:100]))
    return add_snapshot(home, "dataset", "someone/ds", {"data/train-00000-of-00001.jsonl": train, "pretrain/rp_sub.jsonl": TEXT}, C1)


def test_data_files_of_a_hub_dataset_read_only_those_files(hf_home: Path, tmp_path: Path) -> None:
    _hub_dataset(hf_home, tmp_path)
    entry = {"path": "someone/ds", "type": "completion", "data_files": ["pretrain/rp_sub.jsonl"]}
    folder, stderr = _pack(tmp_path, "files", "--config", str(_config(tmp_path, [entry])))
    assert "INPUTS hf://datasets/someone/ds/pretrain/rp_sub.jsonl" in stderr
    manifest = read_manifest(folder)
    assert manifest.counts.examples_read == 300
    assert [e["hub"]["data_files"] for e in manifest.inputs] == ["pretrain/rp_sub.jsonl"]
    assert manifest.inputs[0]["hub"]["id"] == "someone/ds" and manifest.inputs[0]["hub"]["commit"] == C1
    by_path, _ = _pack(tmp_path, "by-path", "--config", str(_config(tmp_path, [{"path": str(TEXT), "type": "completion"}], "by-path.yaml")))
    assert _hashes(folder) == _hashes(by_path)
    split, _ = _pack(tmp_path, "split", "--config", str(_config(tmp_path, [{"path": "someone/ds", "type": "completion"}])))
    assert read_manifest(split).counts.examples_read == 100  # negative control: the dataset's train split
    # a share of one file, in Axolotl's and in TRL's mixture spelling
    entry["split"] = "train[-10%:]"
    sliced, _ = _pack(tmp_path, "sliced", "--config", str(_config(tmp_path, [entry])))
    trl = tmp_path / "trl.yaml"
    trl.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": "tiny",
                "max_length": 256,
                "datasets": [{"path": "someone/ds", "data_files": "pretrain/rp_sub.jsonl", "split": "train[-10%:]"}],
            }
        )
    )
    by_trl, _ = _pack(tmp_path, "trl", "--config", str(trl), "--tokenizer", TOKENIZER, "--format", "text")
    for folder in (by_trl, sliced):  # the last 30 of the file's 300 rows (TRL's own recipe packs them otherwise)
        assert read_manifest(folder).counts.examples_read == 30 and read_manifest(folder).inputs[0]["rows"] == [270, 300]


def test_drop_system_message_renders_each_conversation_without_its_first_system_message(tmp_path: Path) -> None:
    entry = {"path": str(CHAT), "type": "chat_template", "drop_system_message": True}
    folder, stderr = _pack(tmp_path, "dropped", "--config", str(_config(tmp_path, [entry], chat_template="llama2")))
    assert "chat_template: llama2 -> --chat-template {#- drop_system_message: each conversation" in stderr
    rows = [json.loads(line) for line in CHAT.read_text().splitlines()]
    firsts = {r["messages"][0]["role"] for r in rows}
    assert {"system", "user"} <= firsts  # rows with a system message to drop, and rows without
    without = tmp_path / "without-system.jsonl"
    without.write_text("".join(json.dumps({"messages": r["messages"][r["messages"][0]["role"] == "system" :]}) + "\n" for r in rows))
    plain = {"path": str(without), "type": "chat_template"}
    control, _ = _pack(tmp_path, "control", "--config", str(_config(tmp_path, [plain], "plain.yaml", chat_template="llama2")))
    assert _hashes(folder) == _hashes(control)
    assert read_manifest(folder).tokenizer["chat_template"] == "llama2 (its first system message dropped)"
    entry["drop_system_message"] = False  # negative control: the system message is rendered (<<SYS>>)
    kept, _ = _pack(tmp_path, "kept", "--config", str(_config(tmp_path, [entry], chat_template="llama2")))
    assert _hashes(kept) != _hashes(folder)


@pytest.mark.parametrize(
    ("datasets", "top", "needle"),
    [
        (
            [{"path": str(CHAT), "drop_system_message": True}],
            {},
            "datasets[0] drop_system_message: True has no equivalent here: it is applied through the chat template",
        ),
        (
            [{"path": str(CHAT), "drop_system_message": True}, {"path": str(CHAT)}],
            {"chat_template": "llama2"},
            "datasets[1] drop_system_message",
        ),
        ([{"path": str(CHAT), "drop_system_message": "yes"}], {"chat_template": "llama2"}, "use true or false"),
        ([{"path": "org/ds", "split": "train[:10%]+test"}], {}, "pack-data reads one split or one share of it"),
        ([{"path": "org/ds", "split": "train[:200%]"}], {}, "between -100% and 100%"),
        (
            [{"path": "org/ds", "data_files": ["a.jsonl", "b.jsonl"], "split": "train[:10%]"}],
            {},
            "a share of the rows of several data_files",
        ),
        ([{"path": "org/ds", "data_files": "../other/x.jsonl"}], {}, "climbs out"),
        ([{"path": "org/ds", "data_files": "x.jsonl", "split": "test"}], {}, "data_files are read as the split train"),
        ([{"path": "org/ds", "data_files": "x.jsonl", "name": "en"}], {}, "remove name"),
    ],
)
def test_shapes_that_cannot_be_honoured_are_one_line(tmp_path: Path, datasets: list[dict], top: dict, needle: str) -> None:
    datasets = [{"type": "chat_template", **d} for d in datasets]
    assert needle in _one_line(tmp_path, _config(tmp_path, datasets, **top))


def test_a_share_of_a_hub_split_packs_as_datasets_selects(hf_home: Path, tmp_path: Path) -> None:
    snapshot = _hub_dataset(hf_home, tmp_path)
    cfg = _config(tmp_path, [{"path": "someone/ds", "type": "completion", "split": "train[25%:-10]"}])
    folder, stderr = _pack(tmp_path, "hub-share", "--config", str(cfg))
    assert "INPUTS someone/ds:train[25%:-10]" in stderr
    same = _selected(str(snapshot / "data/train-00000-of-00001.jsonl"), "train[25%:-10]", tmp_path / "same.jsonl")
    control, _ = _pack(tmp_path, "control", "--config", str(_config(tmp_path, [{"path": str(same), "type": "completion"}], "control.yaml")))
    assert _hashes(folder) == _hashes(control) and read_manifest(folder).counts.examples_read == 65
    assert read_manifest(folder).inputs[0]["hub"]["split"] == "train[25%:-10]"
    assert read_manifest(folder).inputs[0]["rows"] == [25, 90]


def test_gemma2s_example_packs_system_conversations_that_gemmas_template_refuses(tmp_path: Path) -> None:
    """Axolotl's gemma2 example: gemma's template raises on a system message, which drop_system_message
    takes away first; control: without it the same data is one line naming the conversation."""
    entry = {"path": str(CHAT), "type": "chat_template", "drop_system_message": True}
    top = {"chat_template": "gemma", "tokens": ["<start_of_turn>", "<end_of_turn>"]}
    folder, _ = _pack(tmp_path, "gemma", "--config", str(_config(tmp_path, [entry], **top)))
    assert read_manifest(folder).counts.examples_read == 300
    entry["drop_system_message"] = False
    cfg = _config(tmp_path, [entry], **top)
    result = CliRunner().invoke(pack_data, ["--config", str(cfg), "--out", str(tmp_path / "kept"), *FLAGS])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "System role not supported" in result.stderr.strip().splitlines()[-1]


def test_pack_data_help_spells_a_share_and_hub_files() -> None:
    text = " ".join(CliRunner().invoke(pack_data, ["--help"]).output.split())
    assert "org/name:train[:20%]" in text and "hf://datasets/org/name[@revision]/PATH" in text


def test_alsts_zstd_data_files_of_a_hub_dataset(hf_home: Path, tmp_path: Path) -> None:
    """Axolotl's ALST example: `data_files: [pretrain/rp_sub.jsonl.zst]` of a Hub dataset, field text."""
    import pyarrow as pa

    src = tmp_path / "rp_sub.jsonl.zst"
    with pa.output_stream(src, compression="zstd") as f:
        f.write(TEXT.read_bytes())
    add_snapshot(hf_home, "dataset", "togethercomputer/Long-Data-Collections", {"pretrain/rp_sub.jsonl.zst": src}, C1)
    settings = yaml.safe_load((ROOT / "tests/data/foreign_configs/axolotl/alst_llama3-8b-fsdp2-alst.yaml").read_text())
    entry = settings["datasets"][0]
    assert entry["data_files"] == ["pretrain/rp_sub.jsonl.zst"]
    folder, stderr = _pack(tmp_path, "alst", "--config", str(_config(tmp_path, [entry])))
    assert "INPUTS hf://datasets/togethercomputer/Long-Data-Collections/pret" in stderr  # (shortened)
    plain, _ = _pack(
        tmp_path, "plain", "--config", str(_config(tmp_path, [{**entry, "path": str(TEXT), "data_files": None}], "plain.yaml"))
    )
    assert _hashes(folder) == _hashes(plain) and read_manifest(folder).counts.examples_read == 300


def test_a_datasets_revision_pins_the_hub_dataset(tmp_path: Path) -> None:
    from pipeline.config_file import read_config_file

    for entry, want in [
        ({"path": "org/ds", "revision": "v2", "split": "test[:5%]"}, ["org/ds@v2:test[:5%]"]),
        ({"path": "org/ds", "revision": "abc", "data_files": "x.jsonl"}, ["hf://datasets/org/ds@abc/x.jsonl"]),
        ({"path": str(TEXT), "revision": "v2"}, [str(TEXT)]),
    ]:  # Axolotl ignores it for local data
        cfg = _config(tmp_path, [{"type": "completion", **entry}])
        assert read_config_file(cfg, pack_data, foreign="pack-data")["inputs"] == want


def test_a_save_to_disk_folder_is_read_as_axolotl_reads_it(tmp_path: Path) -> None:
    """load_from_disk, then a DatasetDict's split by name (its own folder); a share there Axolotl does
    not take (it reads the split whole): one line, never taken or dropped unsaid."""
    import datasets

    from pipeline.config_file import read_config_file

    folder = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": ["a", "b"]}), "test": datasets.Dataset.from_dict({"text": ["c"]})}
    ).save_to_disk(str(folder))
    cfg = _config(tmp_path, [{"path": str(folder), "type": "completion", "split": "test"}])
    assert read_config_file(cfg, pack_data, foreign="pack-data")["inputs"] == [str(folder / "test")]
    cfg = _config(tmp_path, [{"path": str(folder), "type": "completion"}])  # control: no split, the train split
    assert read_config_file(cfg, pack_data, foreign="pack-data")["inputs"] == [str(folder)]
    cfg = _config(tmp_path, [{"path": str(folder), "type": "completion", "split": "train[:50%]"}])
    assert "Axolotl reads the save_to_disk folder" in _one_line(tmp_path, cfg)
