"""The last Axolotl/TRL keys of issue 68 that were refused or differed.

- `unfrozen_parameters` is `pack-train --unfrozen-parameters`: only the parameters a pattern matches
  (as Axolotl 0.19.0's utils/freeze.py matches them) change in a step, the others stay bitwise
  (negative control both ways); the optimizer holds only them; the start-up line counts them;
  config.json records them; a pattern that matches nothing, a range, and the key beside an adapter
  are one line each.
- TRL's prompt/completion data under a chat template: pack-data's ids and loss mask equal TRL's own
  processing (trl/trainer/sft_trainer.py), run in the test.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parents[1]))
from packed_factory import make_packed_folder, pack_lengths  # noqa: E402

from pipeline.config_file import read_config_file  # noqa: E402
from pipeline.errors import UserError  # noqa: E402
from trainer import TrainConfig, train  # noqa: E402
from trainer.cli import pack_train  # noqa: E402
from trainer.config import TRAIN_CHECKS, validate  # noqa: E402
from trainer.model.freeze import pattern_regex, unfreeze_only  # noqa: E402
from trainer.model.load import load_model  # noqa: E402
from trainer.run.optim import make_optimizer  # noqa: E402

VOCAB = 300


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: the tiny model trains many times faster so on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("freeze")
    lengths = np.random.default_rng(0).integers(4, 40, size=24).tolist()
    make_packed_folder(
        folder, pack_lengths(lengths, 64, vocab=VOCAB), 64, tokenizer={"name": "test", "fingerprint": "0" * 64, "vocab_size": VOCAB}
    )
    return folder


def _config(packed: Path, out: Path, **kw: object) -> TrainConfig:
    base = dict(
        data=str(packed),
        model="tiny",
        out=str(out),
        tokens_per_step=128,
        grad_accum=1,
        lr=1e-2,
        max_steps=2,
        log_every=1,
        num_workers=0,
        progress=False,
        attn="sdpa",
        weight_decay=0.1,
    )
    return TrainConfig(**{**base, **kw})


# ---------------------------------------------------------------- patterns, read as Axolotl reads them


@pytest.mark.parametrize(
    ("pattern", "name", "matches"),
    [
        ("model.layers.1.", "model.layers.1.self_attn.q_proj.weight", True),
        ("model.layers.1.", "model.layers.10.mlp.up_proj.weight", False),  # '.' is a dot: not "model.layers.1x"
        ("model.layers.1.", "model.layers_1_mlp", False),
        ("layers.1.", "model.layers.1.mlp.up_proj.weight", False),  # re.match: from the name's start
        ("^lm_head.*", "lm_head.weight", True),
        ("^model.language_model.*", "model.layers.0.mlp.up_proj.weight", False),
        ("model.layers.[0-9]+.mlp", "model.layers.12.mlp.up_proj.weight", True),  # '.+' stays a wildcard
        ("model.norm.weight$", "model.norm.weight", True),
        ("model.norm.weight$", "model.norm.weight_x", False),
    ],
)
def test_a_pattern_matches_a_name_as_axolotls_layer_name_pattern(pattern: str, name: str, matches: bool):
    """axolotl 0.19.0 utils/freeze.py LayerNamePattern: re.compile(re.sub(r"\\.(?!\\+)", "\\\\.", p)).match"""
    assert (pattern_regex(pattern).match(name) is not None) is matches


def test_only_the_matching_parameters_train_and_reach_the_optimizer():
    model = load_model("tiny", vocab_size=VOCAB, seed=0)
    names = [n for n, _ in model.named_parameters()]
    tensors, of, trained, total = unfreeze_only(model, ["model.layers.1.mlp.", "model.norm"])
    want = [n for n in names if n.startswith("model.layers.1.mlp.") or n.startswith("model.norm")]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == want and tensors == len(want) > 1
    assert of == len(names) and trained == sum(p.numel() for p in model.parameters() if p.requires_grad) < total
    config = TrainConfig(data="d", model="tiny", out="o", unfrozen_parameters=("model.layers.1.mlp.",))
    optimizer, _ = make_optimizer(model.parameters(), config, torch.device("cpu"), total_steps=2)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}


def test_after_training_only_matching_parameters_changed(packed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Negative control both ways: every matching tensor changed, every other one is bitwise the
    same (weight decay 0.1 would move any tensor the optimizer held)."""
    from safetensors.torch import load_file

    patterns = ("model.layers.1.", "^model.norm")
    summary = train(_config(packed, tmp_path / "run", unfrozen_parameters=patterns))
    err = capsys.readouterr().err
    saved = {}
    for file in sorted((Path(summary["checkpoint"]) / "model").glob("*.safetensors")):
        saved.update(load_file(str(file)))
    before = dict(load_model("tiny", vocab_size=VOCAB, seed=0).named_parameters())
    matched = [n for n in before if any(pattern_regex(p).match(n) for p in patterns)]
    assert matched and len(matched) < len(before)
    for name, weight in before.items():
        changed = not torch.equal(saved[name], weight.detach())
        assert changed == (name in matched), name
    trained = sum(before[n].numel() for n in matched)
    line = next(x for x in err.splitlines() if "--unfrozen-parameters" in x)
    assert f"{trained / 1e6:.2f}M of" in line and f"({len(matched)} of {len(before)} tensors) train" in line
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["unfrozen_parameters"] == list(patterns)


def test_a_resume_continues_the_same_parameters_bitwise(packed: Path, tmp_path: Path):
    from safetensors.torch import load_file

    patterns = ("model.layers.0.mlp.",)
    full = train(_config(packed, tmp_path / "full", unfrozen_parameters=patterns))
    train(_config(packed, tmp_path / "part", unfrozen_parameters=patterns, stop_at=1))
    rest = train(_config(packed, tmp_path / "part", unfrozen_parameters=patterns, resume="newest"))
    a, b = (load_file(str(next((Path(r["checkpoint"]) / "model").glob("*.safetensors")))) for r in (full, rest))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_with_other_patterns_is_refused(packed: Path, tmp_path: Path):
    train(_config(packed, tmp_path / "run", unfrozen_parameters=("model.layers.1.",), stop_at=1))
    with pytest.raises(
        UserError, match=re.escape("unfrozen_parameters ['model.layers.1.'] but this run has unfrozen_parameters ['model.layers.0.']")
    ):
        train(_config(packed, tmp_path / "run", unfrozen_parameters=("model.layers.0.",), resume="newest"))


@pytest.mark.parametrize(
    ("patterns", "words"),
    [
        (("model.layers.1.", "^vision_tower.*"), "'^vision_tower.*': matches no parameter of the model"),
        (("model.embed_tokens.weight$[:32000]",), "a range [start:end]"),
        (("model.layers.(",), "is not a regular expression"),
    ],
)
def test_patterns_that_cannot_be_honoured_are_one_line(packed: Path, tmp_path: Path, patterns: tuple, words: str):
    args = [
        "--data",
        str(packed),
        "--model",
        "tiny",
        "--out",
        str(tmp_path / "run"),
        "--max-steps",
        "1",
        "--no-progress",
        "--num-workers",
        "0",
        "--tokens-per-step",
        "128",
    ]
    for p in patterns:
        args += ["--unfrozen-parameters", p]
    result = CliRunner().invoke(pack_train, args)
    lines = [x for x in result.stderr.splitlines() if x.strip() and not x.startswith("pack-train: ")]
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert len(lines) == 1 and words in lines[0], result.stderr
    assert not list((tmp_path / "run").glob("checkpoints/*"))


@pytest.mark.parametrize("other", [{"lora_r": 4}, {"parallel": "fsdp"}])
def test_what_does_not_combine_is_refused(other: dict):
    with pytest.raises(UserError, match="unfrozen"):
        validate(TrainConfig(data="d", model="m", out="o", unfrozen_parameters=("x",), **other))


# ---------------------------------------------------------------- the Axolotl key

AXOLOTL = {"base_model": "tiny", "learning_rate": 1e-4, "datasets": [{"path": "d.jsonl", "type": "completion"}]}


def _read(tmp_path: Path, **keys: object) -> dict:
    cfg = tmp_path / "axolotl.yaml"
    cfg.write_text(yaml.safe_dump({**AXOLOTL, **keys}))
    return read_config_file(cfg, pack_train, TRAIN_CHECKS, {"compile_": "compile"}, foreign="pack-train")


def test_axolotls_unfrozen_parameters_is_the_option(tmp_path: Path):
    got = _read(tmp_path, unfrozen_parameters=["^lm_head.*", "model.layers.1[0-9]."])
    assert list(got["unfrozen_parameters"]) == ["^lm_head.*", "model.layers.1[0-9]."]
    assert "unfrozen_parameters" not in _read(tmp_path)  # control: without the key every parameter trains


@pytest.mark.parametrize(
    ("keys", "words"),
    [
        ({"adapter": "lora", "lora_r": 8}, "with an adapter Axolotl matches these patterns against peft's names"),
        ({"adapter": "qlora", "lora_r": 8, "load_in_4bit": True}, "remove the key to train the adapters"),
        ({"unfrozen_parameters": "^lm_head.*"}, "give a list of regular expressions"),  # Axolotl's schema: list[str]
    ],
)
def test_axolotls_unfrozen_parameters_with_an_adapter_is_one_line(tmp_path: Path, keys: dict, words: str):
    keys = {"unfrozen_parameters": ["^model.layers.*"], **keys}
    with pytest.raises(UserError, match=re.escape(words)):
        _read(tmp_path, **keys)


# ---------------------------------------------------------------- TRL's prompt/completion under a chat template

MARKERS = [
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "completion": [{"role": "assistant", "content": "It is 4."}]},
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        "completion": [{"role": "assistant", "content": "Blue"}],
    },
    {
        "prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}],
        "completion": [{"role": "assistant", "content": "see you"}],
    },
]  # (a reply that writes <think>...</think> itself: tests/e2e/test_trl_chat_parity.py)


def _trl_prepared(tok, rows: list[dict], tmp_path: Path) -> list[tuple[list[int], list[bool]]]:
    """TRL's own preparation of a prompt/completion dataset (SFTTrainer._prepare_dataset: tokenize_fn,
    then build_labels with its default completion_only_loss), run on a stand-in for the trainer."""
    import types

    from datasets import Dataset
    from trl import SFTConfig
    from trl.trainer.sft_trainer import SFTTrainer

    trainer = types.SimpleNamespace(_tokenizer=tok, chat_template=None, completion_only_loss=True)
    args = SFTConfig(output_dir=str(tmp_path / "trl"), max_length=None, report_to=[], bf16=False, use_cpu=True)
    prepared = SFTTrainer._prepare_dataset(
        trainer, Dataset.from_list(rows), tok, args, packing=False, formatting_func=None, dataset_name="train"
    )
    return [(list(r["input_ids"]), [label != -100 for label in r["labels"]]) for r in prepared]


@pytest.mark.parametrize("template", ["qwen3", "chatml", "llama3"])
def test_prompt_completion_packs_as_trl_prepares_it(tmp_path: Path, template: str):
    """Token by token and mask by mask: TRL trains what follows its prompt rendered with the generation
    prompt, so under qwen3 (whose generation prompt ends with `<think>\\n\\n`) `</think>\\n\\n` carries
    loss, and so does the `\\n` after `<|im_end|>`; it adds no BOS (this tokenizer's post-processor
    would) and no EOS."""
    pytest.importorskip("trl")
    from transformers import AutoTokenizer

    from pipeline.cli import pack_data
    from pipeline.shards import iter_rows
    from pipeline.tokenize.chat_templates import NAMED

    tok = AutoTokenizer.from_pretrained(str(Path(__file__).parents[2] / "data" / "tokenizer"))
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.chat_template = NAMED[template]
    tok.save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    want = _trl_prepared(tok, ROWS, tmp_path)
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    result = CliRunner().invoke(
        pack_data,
        [
            str(data),
            "--tokenizer",
            str(tmp_path / "tok"),
            "--max-len",
            "512",
            "--out",
            str(tmp_path / "packed"),
            "--no-progress",
            "--num-proc",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    got = {}
    for row in iter_rows(tmp_path / "packed"):
        at = 0
        for n, e in zip(row["seq_lens"].tolist(), row["example_ids"].tolist()):
            got[e] = (row["input_ids"][at : at + n].tolist(), (row["labels"][at : at + n] != -100).tolist())
            at += n
    assert [got[i] for i in range(len(ROWS))] == want
    if template == "qwen3":  # what the brief asked about: TRL itself trains these tokens
        ids, mask = want[0]
        trained = tok.decode([t for t, m in zip(ids, mask) if m])
        assert trained == "</think>\n\nIt is 4.<|im_end|>\n" and bos_free(ids, tok)


def bos_free(ids: list[int], tok) -> bool:
    return tok.bos_token_id is not None and ids[0] != tok.bos_token_id
