"""A held-out hostile audit of issues 68 and 70's surfaces, one test per class it found: an Axolotl or
TRL true/false key written as quoted text or a number is refused (the tools read "true" and 1 as
true: reading them as false trained every weight where the file asks for LoRA); a config file that
is not UTF-8 is one line naming its line, one that is a FIFO, a device or too large is refused
unread; an --out inside the --model / --data folder is refused like the folder itself; Axolotl
datasets that differ in a sub-key (one at the default) are refused rather than all packed with one
entry's value; chat_template: jinja needs its template; TRL's save_strategy / eval_strategy
epoch and no are honoured (not the every-500-steps default); a chat template that fails on a
conversation is named with the fix; a pack-report file never replaces what the report reads."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from test_hostile_foreign import AXOLOTL, TRL, mapped, one_line
from test_hostile_inputs import SAMPLE, TOKENIZER, cli, error_line, pack, snapshot
from test_hostile_templates import CHAT, pack_chat

from pipeline.cli import pack_data
from pipeline.config_file import MAX_CONFIG_BYTES
from pipeline.errors import UserError
from trainer.cli import pack_train
from trainer.config import TrainConfig
from trainer.run.preflight import refuse_foreign_out


@pytest.mark.parametrize(
    ("command", "text", "needle", "control", "want"),
    [
        # TRL reads use_peft: "true" (and 1) as true: never a full fine-tune for it
        (
            pack_train,
            TRL + 'use_peft: "true"\n',
            "key 'use_peft': 'true' is quoted text where true or false goes",
            TRL + "use_peft: true\n",
            {"lora_r": 16},
        ),
        (
            pack_train,
            TRL + "use_peft: 1\n",
            "key 'use_peft': 1 has no equivalent here: use true or false, unquoted",
            TRL + "use_peft: false\n",
            {"lora_r": None},
        ),
        (
            pack_train,
            AXOLOTL + "adapter: qlora\nlora_r: 8\nload_in_4bit: 'False'\n",
            "key 'load_in_4bit': 'False' is quoted text",
            AXOLOTL + "adapter: qlora\nlora_r: 8\nload_in_4bit: true\n",
            {"lora_r": 8, "qlora": True},
        ),
        (
            pack_train,
            AXOLOTL + "adapter: lora\nlora_r: 8\nlora_target_linear: 1\n",
            "key 'lora_target_linear': 1",
            AXOLOTL + "adapter: lora\nlora_r: 8\nlora_target_linear: true\n",
            {"lora_r": 8, "lora_target": "all"},
        ),
        (pack_train, AXOLOTL + "tiled_mlp: 'true'\n", "key 'tiled_mlp': 'true' is quoted text", AXOLOTL + "tiled_mlp: false\n", {}),
        (pack_train, AXOLOTL + "fp16: 1\n", "key 'fp16': 1", AXOLOTL + "fp16: false\n", {}),
        # a key of no effect in one command is still read as its tool reads it: named, not passed over
        (
            pack_data,
            AXOLOTL + "sample_packing: 'false'\n",
            "key 'sample_packing': 'false' is quoted text",
            AXOLOTL + "sample_packing: false\n",
            {},
        ),
    ],
)
def test_a_yes_no_key_as_quoted_text_or_a_number_is_refused(tmp_path: Path, command, text: str, needle: str, control: str, want: dict):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert needle in one_line(command, cfg, tmp_path)
    cfg.write_text(control)  # the same key unquoted maps as before
    got = mapped(command, cfg)
    assert {k: got.get(k) for k in want} == want


@pytest.mark.parametrize(
    ("entries", "want"),
    [
        # one dataset at Axolotl's default, another not: the default must not become the other's value
        (
            "  - {path: org/a, type: chat_template}\n  - {path: org/b, type: chat_template, roles_to_train: [user, assistant]}\n",
            ["org/b:train:roles-to-train=user,assistant"],
        ),
        (
            "  - {path: org/a, type: chat_template, train_on_eos: none}\n  - {path: org/b, type: chat_template}\n",
            ["org/a:train:train-on-eos=none"],
        ),
        (
            "  - {path: org/a, type: chat_template, field_messages: conversations}\n  - {path: org/b}\n",
            ["org/a:train:messages-field=conversations"],
        ),
        ("  - {path: org/a, type: alpaca:chat}\n  - {path: org/b, type: alpaca}\n", ["org/a:train:template=alpaca:chat"]),
        ("  - {path: org/a, type: completion, field: body}\n  - {path: org/b, type: completion}\n", ["org/a:train:text-field=body"]),
    ],
)
def test_datasets_that_differ_in_a_sub_key_are_each_read_with_their_own(tmp_path: Path, entries: str, want: list[str]):
    """Axolotl gives each dataset its own settings: a sub-key that differs is that entry's --per-input,
    and the entry at Axolotl's default gets no option (the default never becomes the other's value).
    Control: the same sub-key on every entry maps to the option, and a sub-key of another type's entry
    does not count."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(AXOLOTL + "datasets:\n" + entries)
    got = mapped(pack_data, cfg)
    assert got["per_input"] == want
    assert not {"roles_to_train", "train_on_eos", "messages_field", "text_field", "template"} & set(got)
    cfg.write_text(
        AXOLOTL + "datasets:\n  - {path: org/a, type: alpaca}\n  - {path: org/b, type: chat_template, "
        "roles_to_train: [user, assistant], train_on_eos: all}\n  - {path: org/c, roles_to_train: "
        "[user, assistant], train_on_eos: all}\n"
    )
    got = mapped(pack_data, cfg)
    assert (got["roles_to_train"], got["train_on_eos"], got.get("template")) == (["user", "assistant"], "all", None)
    assert got["per_input"] == ["org/a:train:format=instruction", "org/b:train:format=chat", "org/c:train:format=chat"]


def test_chat_template_jinja_without_its_template_is_refused(tmp_path: Path):
    """Never the tokenizer's own template in its place; control: with chat_template_jinja it is that text."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(AXOLOTL + "chat_template: jinja\n")
    assert "key 'chat_template': 'jinja' has no equivalent here: it reads the template from chat_template_jinja" in one_line(
        pack_data, cfg, tmp_path
    )
    cfg.write_text(AXOLOTL + "chat_template: jinja\nchat_template_jinja: '{{ messages }}'\n")
    assert mapped(pack_data, cfg)["chat_template"] == "{{ messages }}"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        # TRL saves and evaluates where its *_strategy says, not every save_steps' default 500 steps
        ("save_strategy: epoch\n", {"saves_per_epoch": 1, "save_every": 0}),
        ("save_strategy: 'no'\n", {"saves_per_epoch": None, "save_every": 0}),
        ("eval_strategy: epoch\n", {"evals_per_epoch": 1, "eval_every": 0}),
        ("save_strategy: steps\nsave_steps: 100\n", {"saves_per_epoch": None, "save_every": 100}),  # control
        ("", {"saves_per_epoch": None, "save_every": 500, "evals_per_epoch": None}),  # control: TRL's defaults
    ],
)
def test_trl_save_and_eval_strategies_are_honoured(tmp_path: Path, text: str, want: dict):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(TRL + text)
    got = mapped(pack_train, cfg)
    assert {k: got.get(k) for k in want} == want
    cfg.write_text(TRL + "save_strategy: best\n")
    assert "key 'save_strategy': 'best' has no equivalent here: use steps, epoch or no" in one_line(pack_train, cfg, tmp_path)


@pytest.mark.parametrize("command", [pack_train, pack_data])
def test_a_config_file_that_is_not_utf8_is_one_line_naming_its_line(tmp_path: Path, command):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(AXOLOTL.encode() + b"note: caf\xe9\n")  # Latin-1
    assert f"--config {cfg} line 3: not UTF-8 text (byte 0xe9): save the file as UTF-8" in one_line(command, cfg, tmp_path)
    cfg.write_bytes("\ufeff".encode() + AXOLOTL.encode() + "wandb_name: café\n".encode())  # control: UTF-8, a BOM
    assert mapped(command, cfg)


@pytest.mark.parametrize("command", [pack_train, pack_data])
@pytest.mark.parametrize("kind", ["fifo", "device", "link to a device", "too large"])
def test_a_config_file_that_could_block_or_never_end_is_refused_unread(tmp_path: Path, command, kind: str):
    """A FIFO without a writer blocked forever, /dev/zero filled the memory: refused before reading."""
    cfg = tmp_path / "c.yaml"
    if kind == "fifo":
        os.mkfifo(cfg)
    elif kind == "too large":
        cfg.write_text("#" * (MAX_CONFIG_BYTES + 1))
    elif kind == "device":
        cfg = Path("/dev/zero")
    else:
        cfg.symlink_to("/dev/zero")
    line = one_line(command, cfg, tmp_path)
    assert ("not a regular file" if kind != "too large" else "larger than a config file can be") in line, line


def test_an_out_inside_the_model_or_data_folder_is_refused(tmp_path: Path) -> None:
    """A new folder inside --data / --model (also through a link) is writing into that folder;
    controls: a folder beside them, and one inside an empty folder (nothing there to spoil)."""
    data, model = tmp_path / "packed", tmp_path / "model"
    data.mkdir()
    model.mkdir()
    (data / "manifest.json").write_text("{}")
    (model / "config.json").write_text("{}")
    (tmp_path / "link").symlink_to(model)
    for out, option in ((data / "run", "--data"), (model / "runs" / "a", "--model"), (tmp_path / "link" / "r", "--model")):
        with pytest.raises(UserError, match=f"is inside the {option} folder"):
            refuse_foreign_out(TrainConfig(data=str(data), model=str(model), out=str(out)))
    refuse_foreign_out(TrainConfig(data=str(data), model=str(model), out=str(tmp_path / "run")))
    empty = tmp_path / "empty"
    empty.mkdir()
    refuse_foreign_out(TrainConfig(data=str(empty), model="tiny", out=str(empty / "run")))  # nothing in it to spoil
    (empty / "manifest.json").write_text("{}")
    with pytest.raises(UserError, match="is inside the --data folder"):
        refuse_foreign_out(TrainConfig(data=str(empty), model="tiny", out=str(empty / "run")))


def test_pack_train_writes_nothing_into_the_data_folder(tmp_path: Path) -> None:
    packed = pack(tmp_path, SAMPLE)
    before = snapshot(tmp_path)
    line = error_line(cli("pack-train", "--data", "packed", "--model", "tiny", "--max-steps", 1, "--out", "packed/run", cwd=tmp_path))
    assert "--out packed/run is inside the --data folder packed" in line, line
    assert snapshot(tmp_path) == before and packed.is_dir()


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{{ raise_exception('roles must alternate') }}", "(roles must alternate)"),
        ("{% include 'other.jinja' %}", "(no loader for this environment specified)"),  # templates read no files
    ],
)
def test_a_template_that_fails_on_a_conversation_is_named_with_the_fix(tmp_path: Path, template: str, says: str):
    (tmp_path / "t.jinja").write_text(template + "{% for m in messages %}{{ m.content }}{% endfor %}")
    (tmp_path / "other.jinja").write_text("{{ 7 }}")
    line = error_line(pack_chat(tmp_path, [CHAT], "--chat-template", "t.jinja"))
    assert (
        "chat.jsonl line 1: the chat template --chat-template t.jinja failed on this conversation "
        + says
        + ": fix the conversation or the template"
        in line
    ), line
    assert not (tmp_path / "packed").exists()


@pytest.fixture(scope="module")
def packed_sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack(tmp_path_factory.mktemp("sample"), SAMPLE)


def _state(folder: Path) -> tuple:
    """What a report must leave as it was: the packed folder, the data file, the link, the FIFO
    (never read: a read would wait for a writer) and the folder's names."""
    return (
        snapshot(folder / "packed"),
        (folder / "data.jsonl").read_bytes(),
        os.readlink(folder / "link.json"),
        stat.S_ISFIFO(os.lstat(folder / "fifo").st_mode),
        sorted(p.name for p in folder.iterdir()),
    )


@pytest.mark.parametrize("target", ["packed/manifest.json", "packed/new.json", "link.json", "data.jsonl", "fifo"])
def test_a_report_file_never_replaces_what_the_report_reads_or_a_device(packed_sample: Path, tmp_path: Path, target: str):
    """pack-report --json naming the packed folder's manifest (or any file in it, also through a
    link), the --input data file, or a FIFO: one line, nothing replaced (the manifest was replaced
    by the report, the data file too, and a device node became a regular file). Control: a report
    file beside them is written."""
    shutil.copytree(packed_sample, tmp_path / "packed")
    (tmp_path / "data.jsonl").write_bytes(SAMPLE.read_bytes())
    (tmp_path / "link.json").symlink_to(tmp_path / "packed" / "manifest.json")
    os.mkfifo(tmp_path / "fifo")
    before = _state(tmp_path)
    args = ["--input", "data.jsonl", "--tokenizer", TOKENIZER, "--max-len", 512] if target == "data.jsonl" else ["packed"]
    line = error_line(cli("pack-report", *args, "--json", target, cwd=tmp_path))
    assert f"--json {target}: " in line and ("which the report reads" in line or "not a regular file" in line), line
    assert _state(tmp_path) == before
    done = cli("pack-report", "packed", "--json", "r.json", "--sources-csv", "r.csv", cwd=tmp_path)
    assert done.returncode == 0 and (tmp_path / "r.json").is_file() and (tmp_path / "r.csv").is_file(), done.stderr_text
