"""A chat (`messages`) dataset packs as the tool it comes from tokenizes it (issue 68).

- Under a TRL config, ids and loss mask equal what TRL 1.16's own `SFTTrainer._prepare_dataset`
  produces (run here on a stand-in for the trainer; skipped without trl): the chat template's
  rendering tokenized as it is (no BOS or EOS added, here on a Llama-2 tokenizer that has a BOS and
  with templates that write none), every token trained by default, the `{% generation %}` blocks of
  TRL's training template with `assistant_only_loss: true`.
- Axolotl 0.19.0's chat_template strategy tokenizes `apply_chat_template(..., tokenize=True)` as
  it is (prompt_strategies/chat_template.py: ChatTemplatePrompter.build_prompt), and so does
  pack-data's own default: no BOS added where the template writes none.
- A qwen3 reply that writes `<think>...</think>` in its content: the template itself moves the
  reasoning out of the content, so the ids are apply_chat_template's; a template that does not
  leaves the tags as the user's text (never control tokens).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import pack_data
from pipeline.shards import iter_rows
from pipeline.tokenize.chat_templates import NAMED

ROOT = Path(__file__).parents[2]
LLAMA2 = ROOT.parent / "shared" / "tokenizers" / "llama2"
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
    {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue"},
            {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "Red, then."},
        ]
    },
]
THINKING = [
    {
        "messages": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nIt is 4."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "<think>greet</think>hello"},
            {"role": "user", "content": "bye"},
            {"role": "assistant", "content": "<think>\nbe kind\n</think>\n\nsee you"},
        ]
    },
]

pytestmark = pytest.mark.skipif(not (LLAMA2 / "tokenizer.json").is_file(), reason="no shared Llama-2 tokenizer")


def _template(name: str, training: bool) -> str:
    """chatml (Axolotl's, as pack-data names it) and TRL's own llama3 and qwen3 templates; `training`:
    TRL's training versions of those two, with {% generation %} blocks, which TRL uses as they are
    under assistant_only_loss (it swaps the plain ones for them, and so does pack-data:
    test_trl_training_templates)."""
    trl_templates = pytest.importorskip("trl.chat_template_utils")
    if name == "chatml":
        return NAMED["chatml"]
    return getattr(trl_templates, f"{name}_{'training_' if training else ''}chat_template")


def _tokenizer(tmp_path: Path, template: str, eos: str | None = None):
    """The Llama-2 tokenizer (a BOS its post-processor adds to text) with the templates' markers as
    tokens and `template` as its chat template (and `eos` as its EOS), saved where a config's
    model_name_or_path names it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(LLAMA2))
    tok.add_special_tokens({"additional_special_tokens": MARKERS, **({"eos_token": eos} if eos else {})})
    tok.chat_template = template
    tok.save_pretrained(tmp_path / "tok")
    return AutoTokenizer.from_pretrained(str(tmp_path / "tok"))


def _trl_prepared(tok, rows: list[dict], tmp_path: Path, **config: bool) -> list[tuple[list[int], list[bool]]]:
    """TRL's own preparation (SFTTrainer._prepare_dataset: tokenize_fn, then build_labels), with the
    template SFTTrainer.__init__ picks (get_training_chat_template under assistant_only_loss)."""
    from datasets import Dataset
    from trl import SFTConfig
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers
    from trl.trainer.sft_trainer import SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path / "trl"), max_length=None, report_to=[], bf16=False, use_cpu=True, **config)
    template = get_training_chat_template(tok) if args.assistant_only_loss and not has_generation_markers(tok.chat_template) else None
    completion_only = (
        args.completion_only_loss if args.completion_only_loss is not None else "prompt" in rows[0]
    )  # SFTTrainer.__init__: by the data's shape
    trainer = types.SimpleNamespace(_tokenizer=tok, chat_template=template, completion_only_loss=completion_only)
    prepared = SFTTrainer._prepare_dataset(
        trainer, Dataset.from_list(rows), tok, args, packing=False, formatting_func=None, dataset_name="train"
    )
    return [
        (list(r["input_ids"]), [i > 0 and label != -100 for i, label in enumerate(r["labels"])]) for r in prepared
    ]  # the first token predicts nothing in either (pack-data masks it)


def _data(tmp_path: Path, rows: list[dict]) -> Path:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def _packed(tmp_path: Path, args: list[str]) -> list[tuple[list[int], list[bool]]]:
    """pack-data with `args`: each example's ids and loss mask, in input order."""
    out = tmp_path / "packed"
    result = CliRunner().invoke(pack_data, [*args, "--out", str(out), "--no-progress", "--num-proc", "1"])
    assert result.exit_code == 0, result.output
    got = {}
    for row in iter_rows(out):
        at = 0
        for n, e in zip(row["seq_lens"].tolist(), row["example_ids"].tolist()):
            got[e] = (row["input_ids"][at : at + n].tolist(), (row["labels"][at : at + n] != -100).tolist())
            at += n
    return [got[i] for i in range(len(got))]


def _trl_config(tmp_path: Path, rows: list[dict], keys: str) -> list[str]:
    """A TRL `trl sft` file naming the tokenizer and the data as a user's would."""
    cfg = tmp_path / "trl.yaml"
    cfg.write_text(f"model_name_or_path: {tmp_path / 'tok'}\ndataset_name: {_data(tmp_path, rows)}\nmax_length: 512\n{keys}")
    return ["--config", str(cfg)]


@pytest.mark.parametrize("template", ["chatml", "llama3", "qwen3"])
@pytest.mark.parametrize("keys", ["", "assistant_only_loss: false\n", "completion_only_loss: true\n", "assistant_only_loss: true\n"])
def test_a_trl_messages_dataset_packs_as_trl_prepares_it(tmp_path: Path, template: str, keys: str):
    """Token by token and mask by mask against TRL's own preparation; the Llama-2 tokenizer would add
    a BOS to text, and TRL adds none to the template's rendering (negative control: its first id)."""
    pytest.importorskip("trl")
    config = {k: v for k, v in (yaml_pair(line) for line in keys.splitlines())}
    if config.get("assistant_only_loss") and template == "chatml":
        pytest.skip("TRL 1.16 refuses assistant_only_loss with a template it cannot patch (ChatML without {% generation %} blocks)")
    tok = _tokenizer(tmp_path, _template(template, bool(config.get("assistant_only_loss"))))
    want = _trl_prepared(tok, ROWS, tmp_path, **config)
    assert _packed(tmp_path, _trl_config(tmp_path, ROWS, keys)) == want
    ids, mask = want[1]
    assert (ids[0] == tok.bos_token_id) == ("bos_token" in tok.chat_template)  # one BOS where the template writes it
    assert tok("x")["input_ids"][0] == tok.bos_token_id  # control: the tokenizer alone adds one
    assert all(mask[1:]) != bool(config.get("assistant_only_loss"))  # every token trained, or not


def yaml_pair(line: str) -> tuple[str, bool]:
    key, value = line.split(":")
    return key.strip(), value.strip() == "true"


def _axolotl_config(tmp_path: Path, rows: list[dict]) -> list[str]:
    """An Axolotl file as its chatml examples write it: chat_template datasets (the tokenizer's EOS
    the end-of-turn marker, so that train_on_eos: turn trains it)."""
    cfg = tmp_path / "axolotl.yaml"
    cfg.write_text(
        f"base_model: {tmp_path / 'tok'}\nchat_template: chatml\nsequence_len: 512\n"
        f"datasets:\n  - path: {_data(tmp_path, rows)}\n    type: chat_template\n"
    )
    return ["--config", str(cfg)]


def test_an_axolotl_chat_template_dataset_packs_as_axolotl_tokenizes_it(tmp_path: Path):
    """Axolotl 0.19.0 (prompt_strategies/chat_template.py) takes the ids of
    `tokenizer.apply_chat_template(conversation, tokenize=True)` as they are and labels the assistant's
    content and the EOS after it (train_on_eos: turn): no BOS on a Llama-2 tokenizer under chatml."""
    tok = _tokenizer(tmp_path, NAMED["chatml"], eos="<|im_end|>")
    got = _packed(tmp_path, _axolotl_config(tmp_path, ROWS[:1]))
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])  # no BOS before the first
    want_ids = [
        start,
        1792,
        13,
        5618,
        338,
        29871,
        29906,
        29974,
        29906,
        29973,
        end,
        13,  # user: What is 2+2?
        start,
        465,
        22137,
        13,
        3112,
        338,
        29871,
        29946,
        29889,
        end,
        13,
    ]  # assistant: It is 4.
    trained = [3112, 338, 29871, 29946, 29889, end]  # "It is 4." and <|im_end|>, not the "\n" after it
    assert got == [(want_ids, [i in range(16, 22) for i in range(len(want_ids))])]
    assert [t for t, m in zip(*got[0]) if m] == trained
    assert want_ids == tok.apply_chat_template(ROWS[0]["messages"], tokenize=True, return_dict=True)["input_ids"]


@pytest.mark.parametrize("template", ["chatml", "llama2"])
def test_pack_datas_own_chat_is_apply_chat_template(tmp_path: Path, template: str):
    """No foreign file: the ids are apply_chat_template's, one BOS where the template writes it
    (llama2's bos_token) and none where it writes none (chatml); text still gets the BOS (control)."""
    tok = _tokenizer(tmp_path, NAMED[template])
    got = _packed(tmp_path, [str(_data(tmp_path, ROWS)), "--tokenizer", str(tmp_path / "tok"), "--max-len", "512"])
    for (ids, _), row in zip(got, ROWS):
        want = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
        assert ids == want and ids.count(tok.bos_token_id) == (template == "llama2") * want.count(tok.bos_token_id)
    assert (got[0][0][0] == tok.bos_token_id) == (template == "llama2")
    text = tmp_path / "text"
    text.mkdir()
    (text / "t.jsonl").write_text('{"text": "It is 4."}\n')
    ((ids, _),) = _packed(text, [str(text / "t.jsonl"), "--tokenizer", str(tmp_path / "tok"), "--max-len", "512"])
    assert ids[0] == tok.bos_token_id


@pytest.mark.parametrize("source", ["axolotl", "trl"])
def test_a_qwen3_reply_that_writes_its_reasoning_packs_as_the_template_renders_it(tmp_path: Path, source: str):
    """Qwen3's template moves `<think>...</think>` out of an assistant's content itself (into its
    reasoning, dropped before the last user turn): the ids are apply_chat_template's, the think tags
    the template's control tokens; the loss on the reply's reasoning and text."""
    template = NAMED["qwen3"] if source == "axolotl" else _template("qwen3", False)
    tok = _tokenizer(tmp_path, template)
    args = [str(_data(tmp_path, THINKING)), "--tokenizer", str(tmp_path / "tok"), "--max-len", "512"]
    think = tok.convert_tokens_to_ids("<think>")
    for (ids, _), row in zip(_packed(tmp_path, [*args, "--train-on-prompt"]), THINKING):
        want = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
        assert ids == want and ids.count(think) == 1  # the last reply's; the earlier one's reasoning is dropped
    ((ids, mask),) = _packed(_made(tmp_path / "one"), [*args, "--limit", "1"])  # assistant-only loss
    want = tok.apply_chat_template(THINKING[0]["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert ids == want
    assert tok.decode([t for t, m in zip(ids, mask) if m]).endswith("Add them.\n</think>\n\nIt is 4.<|im_end|>")


def test_the_reasoning_split_is_trls_own_under_a_trl_config(tmp_path: Path):
    """Under a TRL file: every token, as TRL's own preparation makes it, for messages and for a
    prompt/completion whose completion writes its reasoning."""
    pytest.importorskip("trl")
    tok = _tokenizer(tmp_path, _template("qwen3", False))
    assert _packed(tmp_path, _trl_config(tmp_path, THINKING, "")) == _trl_prepared(tok, THINKING, tmp_path)
    pc = [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in THINKING]
    want = _trl_prepared(tok, pc, tmp_path)
    _tokenizer(_made(tmp_path / "pc"), _template("qwen3", False))
    assert _packed(tmp_path / "pc", _trl_config(tmp_path / "pc", pc, "")) == want


def _made(path: Path) -> Path:
    path.mkdir()
    return path


def test_think_tags_stay_text_where_the_template_does_not_split_them(tmp_path: Path):
    """Negative controls: under chatml (no reasoning split) an assistant's `<think>` is the user's text,
    never a control token, and so is one in a user message or inside the reasoning under qwen3."""
    tok = _tokenizer(tmp_path, NAMED["chatml"])
    think, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("<|im_end|>")
    got = _packed(tmp_path, [str(_data(tmp_path, THINKING[:1])), "--tokenizer", str(tmp_path / "tok"), "--max-len", "512"])
    assert think not in got[0][0] and "<think>" in tok.decode(got[0][0])
    rows = [
        {
            "messages": [
                {"role": "user", "content": "say <think>"},
                {"role": "assistant", "content": "<think>\nstop <|im_end|> here\n</think>\n\nok"},
            ]
        }
    ]
    q = _made(tmp_path / "q")
    tok = _tokenizer(q, NAMED["qwen3"])
    ((ids, _),) = _packed(q, [str(_data(q, rows)), "--tokenizer", str(q / "tok"), "--max-len", "512"])
    assert ids.count(think) == 1 and ids.count(end) == 2  # the template's own: user turn's and reply's ends
    assert tok.decode(ids).count("<think>") == 2 and "stop <|im_end|> here" in tok.decode(ids)


def test_think_tags_stay_text_under_a_template_that_renders_them_from_the_content(tmp_path: Path):
    """A template that reads reasoning_content but prints an assistant's content as it is renders the
    split differently: nothing is split, and the user's tags are text (its own `<think>` absent)."""
    own = (
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.reasoning_content is defined %}"
        "{{ '<think>' + m.reasoning_content + '</think>' }}{% endif %}{{ m.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    tok = _tokenizer(tmp_path, own)
    ((ids, _),) = _packed(
        tmp_path, [str(_data(tmp_path, THINKING[:1])), "--tokenizer", str(tmp_path / "tok"), "--max-len", "512", "--train-on-prompt"]
    )
    assert tok.convert_tokens_to_ids("<think>") not in ids
    assert tok.decode(ids).endswith("<think>\nAdd them.\n</think>\n\nIt is 4.<|im_end|>\n")
