"""Before training: the packed folder's fast checks and its tokenizer's fingerprint. No torch, so
that pack-train makes these checks (and reports what is wrong in one line) before importing it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pipeline.read import hub
from pipeline.tokenize import tokenizer as hf_tokenizer
from pipeline.errors import UserError
from pipeline.shards import Manifest, verify_folder
from trainer.config import TrainConfig
from trainer.model.presets import model_folder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def open_data(config: TrainConfig) -> tuple[Manifest, Any]:
    """Verify the packed folder (fast checks; the sha256 of its shards is checked beside training,
    `trainer.data.integrity`) and its tokenizer fingerprint; returns (manifest, tokenizer or None). The
    tokenizer is `--tokenizer`, else the one inside the model's folder (local or a Hub id's). A Hub
    tokenizer at a commit other than the manifest's is named in one line on stderr (and refused, as
    any tokenizer is, when it tokenizes differently). Data packed with `pack-data --chat-template`
    records the template: the tokenizer takes it before the fingerprints are compared."""
    manifest = verify_folder(config.data, check_hashes=False)
    if manifest.loss_tokens == 0:
        raise UserError(f"{config.data} has no token that carries a loss: training on it would learn "
                        "nothing; re-pack data with responses (assistant turns) to train on")
    source, named = config.tokenizer, config.tokenizer
    model_dir = Path(config.model).expanduser()
    if hub.hub_ref(config.model) is not None:  # (an existing folder is a path, never an id)
        model_dir = model_folder(config.model) or model_dir  # the Hub id's snapshot folder
    if source is None and model_dir.is_dir() and any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        source, named = str(model_dir), config.model
    if source is None:
        return manifest, None
    # pack-data --chat-template, --add-token, --special-token: checkpoints carry them
    tokenizer = hf_tokenizer.apply_recorded(hf_tokenizer.load_tokenizer(source), manifest.tokenizer)
    have = hf_tokenizer.tokenizer_fingerprint(tokenizer)
    want = manifest.tokenizer.get("fingerprint")
    changed = _changed_revision(named, source, manifest)
    if want != have and not _recorded_by_files(manifest, tokenizer, want, have):
        raise UserError(
            f"{config.data} was packed with tokenizer {manifest.tokenizer.get('name', '?')!r} "
            f"(fingerprint {str(want)[:12]}) but the model's tokenizer {named} has fingerprint "
            f"{have[:12]}{f' ({changed})' if changed else ''}: re-run pack-data with this tokenizer, "
            "or pass the right --tokenizer"
        )
    if changed:  # the same tokenizer at another commit: what it does is unchanged, so training goes on
        print(f"pack-train: {changed}", file=sys.stderr)
    return manifest, tokenizer


def _changed_revision(named: str, source: str, manifest: Manifest) -> str | None:
    """One line naming a commit of the Hub tokenizer (or model) `named` other than the one the
    manifest records for the tokenizer the data was packed with; None when the same, or not Hub-named."""
    ref = hub.hub_ref(named)
    if ref is None:
        return None
    commit = Path(source).name if source != named else (hf_tokenizer.hub_record(named) or {}).get("commit")
    return hub.changed_revision("tokenizer", ref, str(commit), manifest.tokenizer.get("hub"))


def _recorded_by_files(manifest: Manifest, tokenizer: Any, want: str, have: str) -> bool:
    """Manifests written before fingerprints described what a tokenizer does hold the sha256 of its
    folder's files (`file_fingerprint`). The same folder matches them; so does a tokenizer that does
    what the folder the manifest names does, while that folder still holds those very files (data
    packed then, and a checkpoint's re-saved copy of its tokenizer)."""
    if want == hf_tokenizer.file_fingerprint(tokenizer):
        return True
    name = manifest.tokenizer.get("name")
    if not isinstance(name, str) or not Path(name).expanduser().is_dir():
        return False
    try:
        recorded = hf_tokenizer.load_tokenizer(name)
    except UserError:
        return False
    return hf_tokenizer.file_fingerprint(recorded) == want and hf_tokenizer.tokenizer_fingerprint(recorded) == have
