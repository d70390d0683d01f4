"""TRL's training chat templates under a TRL file's `assistant_only_loss: true` (issue 68).

TRL 1.16's SFTTrainer renders a template it ships (Qwen3, Llama 3, Gemma 3, Phi-3, ...) with its
training version (prefix-preserving, `{% generation %}` blocks): pack-data does the same from its
vendored copies (`pipeline.tokenize.templates_trl`), so the ids and masks equal TRL's own
`_prepare_dataset`, here on the Llama-2 tokenizer given each template; the manifest records the
text used and pack-verify --deep re-renders with it. A template one character away from TRL's is
not TRL's: it is used as it is, as before. The vendored files are the installed TRL's, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_trl_chat_parity import LLAMA2, MARKERS, ROWS, THINKING, _packed, _trl_config, _trl_prepared

from pipeline.cli import pack_data, pack_verify
from pipeline.foreign.keys import TRL_TRAINING
from pipeline.tokenize.templates_trl import FOLDER, PAIRS, training_version

pytestmark = pytest.mark.skipif(not (LLAMA2 / "tokenizer.json").is_file(), reason="no shared Llama-2 tokenizer")
EXTRA = ["<start_of_turn>", "<end_of_turn>", "<|user|>", "<|assistant|>", "<|end|>", "<|system|>"]  # gemma3's, phi3's


def _tokenizer(folder: Path, template: str | None):
    """The Llama-2 tokenizer with the templates' markers as tokens and `template` as its chat
    template, saved in `folder`/tok where a TRL file's model_name_or_path names it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(LLAMA2))
    tok.add_special_tokens({"additional_special_tokens": MARKERS + EXTRA})
    tok.chat_template = template
    tok.save_pretrained(folder / "tok")
    return AutoTokenizer.from_pretrained(str(folder / "tok"))


def _original(name: str) -> str:
    return pytest.importorskip("trl.chat_template_utils").__dict__[f"{name}_chat_template"]


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "packed" / "manifest.json").read_text())


@pytest.mark.parametrize("name", ["qwen3", "llama3", "gemma3", "phi3"])
def test_a_template_trl_ships_packs_with_its_training_version(tmp_path: Path, name: str):
    """Token by token and mask by mask against TRL's own preparation, which swaps the template; for
    qwen3 a multi-turn conversation with reasoning in an earlier reply (not prefix by prefix under
    the plain template). The manifest holds the training text and names the swap; --deep agrees."""
    from trl.chat_template_utils import get_training_chat_template

    rows = THINKING + ROWS if name == "qwen3" else ROWS
    tok = _tokenizer(tmp_path, _original(name))
    training = get_training_chat_template(tok)
    want = _trl_prepared(tok, rows, tmp_path, assistant_only_loss=True)
    assert _packed(tmp_path, _trl_config(tmp_path, rows, "assistant_only_loss: true\n")) == want
    assert not all(m for _, mask in want for m in mask[1:])  # the prompts are masked
    recorded = _manifest(tmp_path)["tokenizer"]
    assert recorded["chat_template_text"] == training != tok.chat_template
    assert recorded["chat_template"].startswith(f"TRL's {name} training template")
    verified = CliRunner().invoke(pack_verify, [str(tmp_path / "packed"), "--deep"])
    assert verified.exit_code == 0, verified.output


def test_conversational_prompt_completion_data_is_swapped_too(tmp_path: Path):
    """TRL swaps the template for prompt/completion lists of messages as well: qwen3's, each reply
    the completion of the turns before it."""
    pytest.importorskip("trl")
    tok = _tokenizer(tmp_path, _original("qwen3"))
    rows = [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in THINKING + ROWS]
    want = _trl_prepared(tok, rows, tmp_path, assistant_only_loss=True)
    assert _packed(tmp_path, _trl_config(tmp_path, rows, "assistant_only_loss: true\n")) == want
    assert _manifest(tmp_path)["tokenizer"]["chat_template_text"] == training_version(_original("qwen3"))[1]


def test_the_mapping_line_names_it_and_chat_template_path_is_swapped_too(tmp_path: Path):
    """The start-up mapping says it in one line; a TRL file's chat_template_path (a .jinja file,
    which TRL sets before it swaps) holding TRL's qwen3 gets the training version as well."""
    pytest.importorskip("trl")
    tok = _tokenizer(tmp_path / "want", _original("qwen3"))
    want = _trl_prepared(tok, THINKING, tmp_path, assistant_only_loss=True)
    _tokenizer(tmp_path, None)  # the file's template only: Llama-2's tokenizer has none
    (tmp_path / "qwen3.jinja").write_text(_original("qwen3"))
    args = _trl_config(tmp_path, THINKING, f"assistant_only_loss: true\nchat_template_path: {tmp_path / 'qwen3.jinja'}\n")
    result = CliRunner().invoke(pack_data, [*args, "--out", str(tmp_path / "mapped"), "--no-progress", "--num-proc", "1"])
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.output.splitlines() if x.strip().startswith("assistant_only_loss")]
    assert "--chat-template {#- TRL's training version where TRL ships it" in line
    assert _packed(tmp_path, args) == want
    assert _manifest(tmp_path)["tokenizer"]["chat_template_text"] == training_version(_original("qwen3"))[1]


def test_a_template_one_character_off_stays_as_today(tmp_path: Path):
    """Negative control: TRL's qwen3 with a newline added at its end (rendering the same: Jinja drops
    one trailing newline) is not TRL's template: it renders as it is, so a reply's reasoning before a
    later turn still stops in one line (as any multi-turn conversation does), and a one-turn
    conversation records that very template."""
    pytest.importorskip("trl")
    off = _original("qwen3") + "\n"
    assert training_version(off) is None and training_version(_original("qwen3")) is not None
    tok = _tokenizer(tmp_path, off)
    plain = _tokenizer(tmp_path / "plain", _original("qwen3"))
    messages = THINKING[1]["messages"]
    assert tok.apply_chat_template(messages, tokenize=False) == plain.apply_chat_template(messages, tokenize=False)
    args = _trl_config(tmp_path, THINKING[1:], "assistant_only_loss: true\n")
    result = CliRunner().invoke(pack_data, [*args, "--out", str(tmp_path / "packed"), "--no-progress", "--num-proc", "1"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "prefix" in result.output.strip().splitlines()[-1]  # the one error line, after the mapping
    _packed(tmp_path, _trl_config(tmp_path, ROWS[:1], "assistant_only_loss: true\n"))  # one turn renders
    recorded = _manifest(tmp_path)["tokenizer"]
    assert recorded["chat_template_text"] == off and "not one TRL 1.16 swaps" in recorded["chat_template"]


def test_a_tokenizer_with_named_template_variants(tmp_path: Path):
    """A tokenizer whose template is a dict of named variants: TRL looks at its `default` and, that
    being TRL's llama3, renders with the training text instead of the whole dict; so does pack-data."""
    pytest.importorskip("trl")
    tok = _tokenizer(tmp_path, {"default": _original("llama3"), "tool_use": "{{ messages[0].content }}"})
    assert isinstance(tok.chat_template, dict)
    want = _trl_prepared(tok, ROWS, tmp_path, assistant_only_loss=True)
    assert _packed(tmp_path, _trl_config(tmp_path, ROWS, "assistant_only_loss: true\n")) == want
    assert _manifest(tmp_path)["tokenizer"]["chat_template_text"] == training_version(_original("llama3"))[1]


def test_text_data_with_no_template_to_swap_verifies(tmp_path: Path):
    """assistant_only_loss: true over text data and a tokenizer without a chat template: nothing to
    swap, the manifest holds no template text, and pack-verify --deep re-checks it (the marker alone
    names no template to read)."""
    _tokenizer(tmp_path, None)
    data = tmp_path / "text.jsonl"
    data.write_text('{"text": "hello there"}\n{"text": "more text"}\n')
    cfg = tmp_path / "trl.yaml"
    cfg.write_text(f"model_name_or_path: {tmp_path / 'tok'}\ndataset_name: {data}\nmax_length: 64\nassistant_only_loss: true\n")
    packed = CliRunner().invoke(pack_data, ["--config", str(cfg), "--out", str(tmp_path / "packed"), "--no-progress", "--num-proc", "1"])
    assert packed.exit_code == 0, packed.output
    assert _manifest(tmp_path)["tokenizer"]["chat_template_text"] is None
    verified = CliRunner().invoke(pack_verify, [str(tmp_path / "packed"), "--deep"])
    assert verified.exit_code == 0 and "2 examples re-tokenized and matched" in verified.output, verified.output


def test_the_vendored_templates_are_the_installed_trls():
    """Each pair's SHA-256 is the installed TRL's file's, and the pairs are every original TRL ships
    with a training version (skipped without trl)."""
    trl = pytest.importorskip("trl")
    shipped = Path(trl.__file__).parent / "chat_templates"
    pairs = {p.name.removesuffix("_training.jinja") for p in shipped.glob("*_training.jinja")}
    assert set(PAIRS) == {n for n in pairs if (shipped / f"{n}.jinja").is_file()}
    for name, digests in PAIRS.items():
        for stem, digest in zip((name, f"{name}_training"), digests):
            assert hashlib.sha256((shipped / f"{stem}.jinja").read_bytes()).hexdigest() == digest, stem
            assert (FOLDER / f"{stem}.jinja").read_bytes() == (shipped / f"{stem}.jinja").read_bytes(), stem
    assert TRL_TRAINING.startswith("{#") and TRL_TRAINING.endswith("#}")  # renders nothing if ever left in
