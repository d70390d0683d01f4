"""Loading a Hugging Face tokenizer (in this process, never touching the network for a local
folder), and what the manifest records of it: its facts and a fingerprint of what it does.

Which class loads a folder is transformers' decision, made by `AutoTokenizer`. Importing
`AutoTokenizer` imports torch (through transformers' model configs), which takes seconds and which a
tokenizer never needs. So when the folder's `tokenizer_config.json` names a transformers tokenizer
class and nothing else could change AutoTokenizer's choice (no `config.json` with a model type, no
custom code, not a `LlamaTokenizer` over a byte-level `tokenizer.json`), that class is loaded
directly: the same class AutoTokenizer would pick, the same files, the same ids
(`tests/pipeline/tokenize/test_tokenizer.py` compares the two on every kind of folder this project tests).
Anything else goes through AutoTokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.read import hub

TOKENIZER_FILE_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "chat_template")
RUST_THREADS = "TOKENIZERS_PARALLELISM"  # the tokenizers library's switch for its own thread pool


def load_tokenizer(
    name_or_path: str,
    chat_template: str | None = None,
    add_tokens: Sequence[str] = (),
    special_tokens: Mapping[str, str] | Sequence[tuple[str, str]] = (),
) -> Any:
    """Load a fast Hugging Face tokenizer from a local folder, or a Hub id's (`org/name[@revision]`)
    files: from the local Hugging Face cache, downloaded when not there and not offline
    (`pipeline.read.hub`). A path that names no folder fails at once, never asking the Hub.
    `chat_template` (`--chat-template`: a name, a Jinja file or text, or a TRL file's
    assistant_only_loss: `pipeline.tokenize.chat_templates.chosen_template`) replaces the tokenizer's
    own template; `add_tokens` and `special_tokens` (`--add-token`, `--special-token`) are added to
    it (`grow_tokenizer`)."""
    folder = tokenizer_folder(name_or_path) or hub_folder(str(name_or_path))
    try:
        loader = declared_class(folder) or _auto_tokenizer()
        tok = loader.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError/ValueError/... with long messages
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"cannot load tokenizer {name_or_path!r} ({first[:200]}): pass a folder holding tokenizer.json / tokenizer_config.json"
        ) from None
    if not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        raise UserError(f"tokenizer {name_or_path!r} is not a fast (Rust) tokenizer: provide tokenizer.json")
    # A tokenizer.json saved with truncation or padding on would cut or pad every text its backend
    # encodes here (and in workers, which get the backend as JSON). transformers' own calls set both
    # anew each time, so turning them off changes nothing for them.
    tok.backend_tokenizer.no_truncation()
    tok.backend_tokenizer.no_padding()
    if isinstance(tok.chat_template, dict):  # named variants: the one apply_chat_template uses by default
        from pipeline.tokenize.chat_templates import default_variant

        tok.chat_template = default_variant(tok.chat_template, str(name_or_path))
    if chat_template is not None:
        from pipeline.tokenize.chat_templates import chosen_template

        # how errors and the manifest name it
        tok.chat_template, tok._packlm_template_label = chosen_template(chat_template, tok.chat_template)
    grow_tokenizer(tok, add_tokens, special_tokens)
    return tok


SPECIAL_NAMES = tuple(f"{name}_token" for name in ("bos", "eos", "unk", "pad", "sep", "cls", "mask"))


def check_token_options(add_tokens: Any, special_tokens: Any, source: str = "") -> dict[str, str]:
    """`--special-token` / `--add-token` values as a dict of special tokens (from a mapping or
    NAME=TEXT pairs); a name that is no special token's, or an empty text, is a UserError."""
    pairs = special_tokens.items() if isinstance(special_tokens, Mapping) else special_tokens
    specials = dict(pairs)
    for name, text in specials.items():
        if name not in SPECIAL_NAMES:
            raise UserError(
                f"--special-token {name}={text}{source}: {name!r} is not a special token's name: use one of {', '.join(SPECIAL_NAMES)}"
            )
        if not isinstance(text, str) or not text:
            raise UserError(f"--special-token {name}{source}: give the token's text, e.g. {name}=<|im_end|>")
    for text in add_tokens:
        if not isinstance(text, str) or not text:
            raise UserError(f"--add-token {text!r}{source}: give the token's text, e.g. --add-token '<|im_start|>'")
    return specials


def grow_tokenizer(
    tokenizer: Any, add_tokens: Sequence[str] = (), special_tokens: Mapping[str, str] | Sequence[tuple[str, str]] = (), source: str = ""
) -> None:
    """Add tokens to the tokenizer as Axolotl does: `special_tokens` (eos_token=...) set as the
    tokenizer's and added to its vocabulary when missing, `add_tokens` added as new tokens (both
    matched in raw text, no spaces taken); `len(tokenizer)` (the manifest's vocab_size) grows."""
    specials = check_token_options(add_tokens, special_tokens, source)
    if not specials and not add_tokens:
        return
    from tokenizers import AddedToken

    def token(text: str, special: bool) -> Any:
        return AddedToken(text, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)

    if specials:
        tokenizer.add_special_tokens({name: token(text, True) for name, text in specials.items()})
    if add_tokens:
        tokenizer.add_tokens([token(text, False) for text in add_tokens])


def apply_recorded(tokenizer: Any, recorded: Any) -> Any:
    """Give `tokenizer` what pack-data gave its own, as a manifest's `tokenizer` entry records it
    (`tokenizer_info`): the `--chat-template` text and the added tokens. A value of the wrong type
    (a manifest is a file from others) is a UserError."""
    recorded = recorded if isinstance(recorded, dict) else {}
    text = recorded.get("chat_template_text")
    if text is not None:
        if not isinstance(text, str):
            raise UserError("the manifest's tokenizer.chat_template_text is not text: pack the data again")
        tokenizer.chat_template = text
    added, specials = recorded.get("added_tokens", []), recorded.get("special_tokens", {})
    if not isinstance(added, list) or not isinstance(specials, dict):
        raise UserError("the manifest's tokenizer.added_tokens must be a list and special_tokens a mapping: pack the data again")
    grow_tokenizer(tokenizer, added, specials, source=" (recorded in the manifest)")
    return tokenizer


def added_count(recorded: Any) -> int:
    """How many tokens pack-data added to the tokenizer, by a manifest's `tokenizer` entry: the
    `--add-token`s and `--special-token`s (an upper bound: a special token may have been in the
    vocabulary already)."""
    recorded = recorded if isinstance(recorded, dict) else {}
    added, specials = recorded.get("added_tokens"), recorded.get("special_tokens")
    return (len(added) if isinstance(added, list) else 0) + (len(specials) if isinstance(specials, dict) else 0)


def _auto_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer


def declared_class(folder: Path) -> type | None:
    """The fast transformers tokenizer class that `folder`'s tokenizer_config.json names, when that
    is certainly AutoTokenizer's choice too; else None (AutoTokenizer decides).

    AutoTokenizer prefers the class `tokenizer_config.json` names (its fast variant, `X` -> `XFast`
    where transformers has one), except when the folder has custom code (`auto_map`), a model
    `config.json` (whose model type it weighs against the named class), or names `LlamaTokenizer`
    over a byte-level `tokenizer.json` (loaded as a generic tokenizer instead)."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if not isinstance(name, str) or not name or "auto_map" in config or (folder / "config.json").exists():
        return None
    if name.removesuffix("Fast") == "LlamaTokenizer" and _byte_level(folder / "tokenizer.json"):
        return None
    import transformers

    for candidate in (name if name.endswith("Fast") else name + "Fast", name):
        try:
            cls = getattr(transformers, candidate)
        except (AttributeError, ImportError):
            continue
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerFast):
            return cls
    return None


def _byte_level(tokenizer_json: Path) -> bool:
    """Whether a tokenizer.json declares a ByteLevel pre-tokenizer or decoder (unreadable: True,
    so that AutoTokenizer decides)."""
    try:
        spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True
    return '"ByteLevel"' in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])


def tokenizer_folder(name_or_path: str) -> Path | None:
    """The local folder `name_or_path` names, or None for a Hub id (`pipeline.read.hub.hub_ref`: decided
    without the network); a path that names no folder is a UserError. Cheap (no imports), so a job
    can check it before starting any work."""
    path = Path(os.path.expanduser(str(name_or_path)))
    if path.is_dir():
        return path
    if hub.hub_ref(str(name_or_path)) is None:
        raise UserError(
            f"tokenizer folder {name_or_path} not found: pass a folder with tokenizer.json "
            "(e.g. data/tokenizer) or a Hub id (org/name, e.g. meta-llama/Llama-2-7b-hf)"
        )
    return None


def hub_folder(name: str) -> Path:
    """The folder holding Hub tokenizer `name`'s files (`org/name[@revision]`): in the local Hugging
    Face cache, downloaded there first when missing and not offline (`pipeline.read.hub.resolve`)."""
    ref = hub.hub_ref(name)
    if ref is None:
        raise UserError(
            f"tokenizer {name!r} is neither a folder nor a Hub id (org/name): pass a folder with tokenizer.json (e.g. data/tokenizer)"
        )
    return _resolve(ref)[0]


def hub_record(name: str) -> dict[str, Any] | None:
    """For a tokenizer given by Hub id: its id, the revision asked for and the commit used (None
    for a local folder: `hub_ref` takes an existing path for a path)."""
    ref = hub.hub_ref(str(name))
    return None if ref is None else hub.record(ref, _resolve(ref)[1])


def _resolve(ref: hub.HubRef) -> tuple[Path, str]:
    return hub.resolve(ref, "model", "tokenizer", allow_patterns=hub.TOKENIZER_PATTERNS)


SPECIAL_TOKENS = ("bos", "eos", "unk", "pad", "sep", "cls", "mask")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of what the tokenizer does, not of how its files are written: its Rust backend as
    the tokenizers library serialises it once loaded (normaliser, pre-tokenizer, vocabulary and
    merges, post-processor with any BOS/EOS it adds, decoder, added tokens; truncation and padding
    left out, as `load_tokenizer` turns them off), its named special tokens with their ids, and its
    chat template. A folder re-saved by `save_pretrained` (a checkpoint's `model/`) keeps the
    fingerprint of the folder it was saved from; a changed merge, vocabulary entry, special token or
    template changes it."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    backend["truncation"] = backend["padding"] = None
    specials = {
        name: [_token_text(getattr(tokenizer, f"{name}_token", None)), getattr(tokenizer, f"{name}_token_id", None)]
        for name in SPECIAL_TOKENS
    }
    facts = {"backend": backend, "special_tokens": specials, "chat_template": getattr(tokenizer, "chat_template", None)}
    text = json.dumps(facts, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _token_text(token: Any) -> str | None:
    return None if token is None else str(token)


def file_fingerprint(tokenizer: Any) -> str | None:
    """The fingerprint manifests recorded before `tokenizer_fingerprint` described behaviour: sha256
    over the tokenizer files of the folder it was loaded from (None when it was not loaded from a
    folder). Trainers accept it too, so data packed then still trains with the same tokenizer folder."""
    name = str(getattr(tokenizer, "name_or_path", "") or "")
    source = Path(name)
    if not name or not source.is_dir():
        return None
    files = sorted(p for p in source.iterdir() if p.is_file() and (p.name.startswith(TOKENIZER_FILE_PREFIXES) or p.suffix == ".model"))
    if not files:
        return None
    digest = hashlib.sha256()
    for p in files:
        digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return digest.hexdigest()


def tokenizer_info(
    tokenizer: Any,
    name: str,
    chat_template: str | None = None,
    add_tokens: Sequence[str] = (),
    special_tokens: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What the manifest records about the tokenizer; with `chat_template` (`--chat-template`, already
    set on `tokenizer` by `load_tokenizer`), its name and text too; the tokens pack-data added
    (`added_tokens`, `special_tokens`: pack-train adds them to the model's tokenizer and grows its
    embeddings to `vocab_size`)."""
    from pipeline.tokenize.chat_templates import template_label
    from pipeline.tokenize.template_sandbox import PINNED_DATE

    template = getattr(tokenizer, "chat_template", None)
    return {
        "name": str(name),
        "fingerprint": tokenizer_fingerprint(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "vocab_size": len(tokenizer),
        "has_chat_template": bool(template),
        **({"template_date": PINNED_DATE} if isinstance(template, str) and "strftime_now" in template else {}),
        **({"added_tokens": list(add_tokens)} if add_tokens else {}),
        **({"special_tokens": dict(special_tokens)} if special_tokens else {}),
        **(
            {
                "chat_template": getattr(tokenizer, "_packlm_template_label", None) or template_label(chat_template),
                # a tokenizer's own named variants (a dict) are its files', not recorded: as without the option
                "chat_template_text": template if isinstance(template, str) else None,
            }
            if chat_template is not None
            else {}
        ),
        **({"hub": record} if (record := hub_record(name)) else {}),
    }


@dataclass
class BackendOnly:
    """What tokenizing text and instruction data takes from a tokenizer: its Rust backend (as
    JSON) and the BOS/EOS ids. Cheap to send to another process and rebuilt there with the
    `tokenizers` library alone, never importing transformers (which may import torch: seconds per
    process). Chat data also needs the chat template, hence the whole tokenizer.

    >>> tok = BackendOnly.of(load_tokenizer("data/tokenizer"))
    >>> tok.backend_tokenizer.encode("hello").ids == load_tokenizer("data/tokenizer").backend_tokenizer.encode("hello").ids
    True
    """

    backend_json: str
    bos_token_id: int | None
    eos_token_id: int | None

    @classmethod
    def of(cls, tokenizer: Any) -> BackendOnly:
        return cls(tokenizer.backend_tokenizer.to_str(), tokenizer.bos_token_id, tokenizer.eos_token_id)

    @cached_property
    def backend_tokenizer(self) -> Any:
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.backend_json)

    @cached_property
    def key(self) -> str:
        return hashlib.sha256(self.backend_json.encode()).hexdigest()

    def __getstate__(self) -> dict[str, Any]:  # the fields only, not the built backend
        return {k: getattr(self, k) for k in ("backend_json", "bos_token_id", "eos_token_id")}
