"""pipeline.tokenize.tokenizer: loading gives exactly what AutoTokenizer gives, errors, the fingerprint.

`load_tokenizer` loads the class a folder's tokenizer_config.json names directly (no torch import)
when that is certainly AutoTokenizer's choice. These tests build folders of every kind the project
meets (SentencePiece-style, byte-level BPE, WordPiece; generic and model-specific class names,
`Fast` suffixes, a prefix space, a chat template) and compare the loaded tokenizer with
AutoTokenizer's: same class, same Rust backend, same special ids, same ids for the same texts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pipeline.errors import UserError
from pipeline.tokenize.tokenizer import declared_class, load_tokenizer, tokenizer_fingerprint, tokenizer_info

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = ROOT / "data" / "tokenizer"  # byte-level BPE, PreTrainedTokenizerFast, a chat template
LLAMA2 = ROOT.parent / "shared" / "tokenizers" / "llama2"  # real data beside the checkout; skipped without it
TEXTS = ["Hello world", " leading space", "naïve café 🙂\n\tx = 1", "<s> inside </s>", "", "UPPER lower"]
CHAT = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]


def _byte_level_bpe(folder: Path) -> None:
    """A small byte-level BPE (GPT-2 / Llama-3 style) saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|begin|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin|>", eos_token="<|endoftext|>").save_pretrained(folder)


def _metaspace_bpe(folder: Path) -> None:
    """A small SentencePiece-style BPE (Metaspace "▁" word starts, byte fallback: Llama-2 style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    backend.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(folder)


def _wordpiece(folder: Path) -> None:
    """A small BERT-style WordPiece tokenizer (lower-casing normalizer)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    backend.train_from_iterator(TEXTS * 20, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]", pad_token="[PAD]", mask_token="[MASK]"
    ).save_pretrained(folder)


def _folder(tmp_path: Path, base: str, **config: Any) -> Path:
    """A tokenizer folder of kind `base`, its tokenizer_config.json updated with `config`."""
    folder = tmp_path / "tok"
    if base == "data":
        shutil.copytree(TOKENIZER, folder)
    elif base == "llama2":
        if not LLAMA2.is_dir():
            pytest.skip(f"{LLAMA2} is not here")
        shutil.copytree(LLAMA2, folder)
    else:
        {"bytelevel": _byte_level_bpe, "metaspace": _metaspace_bpe, "wordpiece": _wordpiece}[base](folder)
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def _facts(tok: Any) -> dict[str, Any]:
    """Everything pack-data takes from a tokenizer, and the ids it gives."""
    tok.backend_tokenizer.no_truncation()
    tok.backend_tokenizer.no_padding()
    facts = {
        "class": type(tok),
        "backend": tok.backend_tokenizer.to_str(),
        "special": (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id, tok.all_special_ids),
        "len": len(tok),
        "template": tok.chat_template,
        "ids": [tok(t, add_special_tokens=s)["input_ids"] for t in TEXTS for s in (False, True)],
        "fast_ids": [e.ids for e in tok.backend_tokenizer.encode_batch_fast(TEXTS, add_special_tokens=False)],
    }
    if tok.chat_template:
        facts["chat"] = tok.apply_chat_template(CHAT, tokenize=False)
    return facts


def _auto(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


DIRECT = [  # (kind of folder, tokenizer_config.json changes): loaded directly
    ("data", {}),
    ("data", {"tokenizer_class": "GPT2Tokenizer"}),
    ("metaspace", {}),
    ("metaspace", {"tokenizer_class": "LlamaTokenizerFast"}),
    ("metaspace", {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "legacy": False}),
    ("llama2", {}),
    ("bytelevel", {}),
    ("bytelevel", {"tokenizer_class": "GPT2Tokenizer"}),
    ("bytelevel", {"tokenizer_class": "GPT2TokenizerFast", "add_prefix_space": True}),
    ("bytelevel", {"tokenizer_class": "Qwen2Tokenizer"}),
    ("wordpiece", {"tokenizer_class": "BertTokenizer", "do_lower_case": True}),
]
AUTO = [  # left to AutoTokenizer
    ("bytelevel", {"tokenizer_class": "LlamaTokenizer"}),  # Llama-3 style files under Llama's name
    ("data", {"tokenizer_class": "LlamaTokenizerFast"}),
    ("data", {"tokenizer_class": None}),
    ("data", {"tokenizer_class": "NoSuchTokenizer"}),
    ("data", {"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}}),
]


@pytest.mark.parametrize(("base", "config"), DIRECT, ids=[f"{b}-{c}" for b, c in DIRECT])
def test_a_named_class_is_loaded_directly_and_equals_auto_tokenizer(tmp_path: Path, base: str, config: dict):
    folder = _folder(tmp_path, base, **config)
    cls = declared_class(folder)
    assert cls is not None
    tok = load_tokenizer(str(folder))
    assert type(tok) is cls
    assert _facts(tok) == _facts(_auto(folder))


@pytest.mark.parametrize(("base", "config"), AUTO, ids=[f"{b}-{c}" for b, c in AUTO])
def test_folders_auto_tokenizer_may_load_otherwise_are_left_to_it(tmp_path: Path, base: str, config: dict):
    folder = _folder(tmp_path, base, **config)
    assert declared_class(folder) is None
    if "auto_map" not in config:  # custom code is never run
        assert _facts(load_tokenizer(str(folder))) == _facts(_auto(folder))


def test_a_model_config_beside_the_tokenizer_leaves_the_choice_to_auto_tokenizer(tmp_path: Path):
    folder = _folder(tmp_path, "data")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert declared_class(folder) is None
    assert _facts(load_tokenizer(str(folder))) == _facts(_auto(folder))


def test_negative_control_the_comparison_sees_a_different_class_choice(tmp_path: Path):
    """Loading the named class where AutoTokenizer chooses another one changes the result, and the
    comparison above would catch it: Llama's class over byte-level files."""
    import transformers

    folder = _folder(tmp_path, "bytelevel", tokenizer_class="LlamaTokenizer")
    named = transformers.LlamaTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert _facts(named) != _facts(_auto(folder))


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "junk"))
    bad = _folder(tmp_path, "data")
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot load tokenizer"):
        load_tokenizer(str(bad))


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list:
    """An empty Hugging Face cache, offline (HF_HUB_OFFLINE=1), and every socket connection recorded
    and refused."""
    import socket

    import huggingface_hub.constants

    from pipeline.read import hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(hub, "_RESOLVED", {})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(ROOT)
    attempts: list = []

    def refuse(sock: Any, address: Any) -> None:
        attempts.append(address)
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


@pytest.mark.parametrize(
    "name, error",
    [
        ("data/tokenizr", "tokenizer folder data/tokenizr not found"),  # data/ is a folder: a typo'd path
        ("gpt2", "tokenizer folder gpt2 not found"),  # not org/name: a path
        ("someone/missing-tokenizer", "tokenizer someone/missing-tokenizer is not in the local Hugging Face cache"),
    ],
)
def test_a_name_that_is_no_folder_and_not_cached_fails_at_once(no_network: list, name: str, error: str, monkeypatch: pytest.MonkeyPatch):
    """A mistyped folder such as data/tokenizr is a path, and a Hub id that is not cached offline
    fails at once, in one line, without asking the Hub (which retried for 54 s where there is no network):
    no connection is tried and nothing waits (a retry's back-off would sleep)."""
    import time

    waits: list = []
    monkeypatch.setattr(time, "sleep", waits.append)
    with pytest.raises(UserError, match=error):
        load_tokenizer(name)
    assert no_network == [] and waits == []


def test_a_hub_tokenizer_in_the_local_cache_loads_without_the_network(no_network: list, tmp_path: Path):
    """The cache's layout: models--OWNER--NAME/refs/main names the snapshot folder holding the files."""
    import huggingface_hub.constants

    repo = Path(huggingface_hub.constants.HF_HUB_CACHE) / "models--someone--tok"
    shutil.copytree(TOKENIZER, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    tok = load_tokenizer("someone/tok")
    assert _facts(tok) == _facts(load_tokenizer(str(TOKENIZER)))
    assert no_network == []


def test_fingerprint_is_stable_and_tracks_content(tmp_path):
    tok = load_tokenizer(str(TOKENIZER))
    copy = tmp_path / "tok"
    shutil.copytree(TOKENIZER, copy)
    assert tokenizer_fingerprint(load_tokenizer(str(copy))) == tokenizer_fingerprint(tok)
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages }}"
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert tokenizer_fingerprint(load_tokenizer(str(copy))) != tokenizer_fingerprint(tok)
    info = tokenizer_info(tok, "data/tokenizer")
    assert (info["bos_token_id"], info["eos_token_id"], info["vocab_size"]) == (1, 2, len(tok))


def _resaved(tokenizer: Any, folder: Path) -> Path:
    """`tokenizer` saved by save_pretrained beside a model config, as a checkpoint's model/ holds it."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": len(tokenizer)}))
    tokenizer.save_pretrained(folder)
    return folder


def _tokenizer_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "config.json"}


@pytest.mark.parametrize("base", ["data", "bytelevel", "metaspace", "wordpiece", "llama2"])
def test_fingerprint_identifies_what_the_tokenizer_does_not_how_its_files_are_written(tmp_path: Path, base: str):
    """A checkpoint's re-saved tokenizer files differ byte for byte from the folder they came from
    (other files, fields, order), yet encode every text and chat alike: same fingerprint, so a
    checkpoint continues training on data packed with the original folder."""
    folder = _folder(tmp_path, base)
    original = load_tokenizer(str(folder))
    again = load_tokenizer(str(_resaved(original, tmp_path / "ckpt" / "model")))
    assert _tokenizer_files(tmp_path / "ckpt" / "model") != _tokenizer_files(folder)
    assert {k: v for k, v in _facts(again).items() if k != "class"} == {k: v for k, v in _facts(original).items() if k != "class"}
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(original)


def _edit_json(path: Path, edit: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.mark.parametrize("base", ["bytelevel", "metaspace", "data"])
def test_negative_control_a_changed_merge_or_special_token_changes_the_fingerprint(tmp_path: Path, base: str):
    original = load_tokenizer(str(_folder(tmp_path, base)))
    want = tokenizer_fingerprint(original)
    merged = _resaved(original, tmp_path / "merge")

    def drop_first_merge(spec: dict) -> None:
        spec["model"]["merges"] = spec["model"]["merges"][1:]

    _edit_json(merged / "tokenizer.json", drop_first_merge)
    changed = load_tokenizer(str(merged))
    texts = TEXTS + ["the quick brown fox jumps over the lazy dog", "at the top"]
    assert [changed.backend_tokenizer.encode(t).ids for t in texts] != [original.backend_tokenizer.encode(t).ids for t in texts]
    assert tokenizer_fingerprint(changed) != want

    special = _resaved(original, tmp_path / "special")
    other = next(t for t in changed.all_special_tokens if t != original.eos_token)
    _edit_json(special / "tokenizer_config.json", lambda config: config.update(eos_token=other))
    swapped = load_tokenizer(str(special))
    assert swapped.eos_token_id != original.eos_token_id
    assert swapped.backend_tokenizer.to_str() == original.backend_tokenizer.to_str()  # only the special token differs
    assert tokenizer_fingerprint(swapped) != want


def test_negative_control_a_wordpiece_vocabulary_entry_or_special_token_changes_the_fingerprint(tmp_path: Path):
    original = load_tokenizer(str(_folder(tmp_path, "wordpiece")))
    want = tokenizer_fingerprint(original)
    vocab = _resaved(original, tmp_path / "vocab")

    def rename_a_word(spec: dict) -> None:
        words = spec["model"]["vocab"]
        word = next(w for w in words if len(w) > 3 and not w.startswith(("[", "##")))
        words["zzzz"] = words.pop(word)

    _edit_json(vocab / "tokenizer.json", rename_a_word)
    assert tokenizer_fingerprint(load_tokenizer(str(vocab))) != want
    special = _resaved(original, tmp_path / "special")
    _edit_json(special / "tokenizer_config.json", lambda config: config.update(pad_token="[MASK]"))
    assert tokenizer_fingerprint(load_tokenizer(str(special))) != want


def test_loading_a_tokenizer_folder_does_not_import_torch(repo_root: Path):
    """What makes pack-data start in about a second: a named class never pulls torch in."""
    import subprocess
    import sys

    code = (
        "import sys; from pipeline.tokenize.tokenizer import load_tokenizer; "
        "load_tokenizer('data/tokenizer'); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
