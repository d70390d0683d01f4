"""The model presets' shapes, and what `--model` names; no torch, so pack-train checks the name
(and finds or downloads a Hub model) before importing it."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.contract import UserError, hub

PRESETS: dict[str, dict] = {
    # Test/CI size. GQA on purpose (4 query heads share 2 kv heads); vocab matches data/tokenizer.
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=4096,
        max_position_embeddings=8192,
    ),
    # ~100M parameters (100.5M with vocab 32000, untied embeddings); head_dim 64.
    "llama-100m": dict(
        hidden_size=640,
        num_hidden_layers=12,
        num_attention_heads=10,
        num_key_value_heads=10,
        intermediate_size=1728,
        vocab_size=32000,
        max_position_embeddings=8192,
    ),
    # ~0.95B parameters (TinyLlama-like width, 16 layers, full multi-head attention); head_dim 128.
    "llama-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=5632,
        vocab_size=32000,
        max_position_embeddings=8192,
    ),
    # Llama-3-8B's shape: 8.03B parameters with its 128,256-token vocabulary (7.25B with a
    # 32,000-token one); grouped-query attention (32 query heads, 8 kv heads), head_dim 128.
    "llama-8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
}


def model_folder(name_or_path: str) -> Path | None:
    """None for a preset name, the folder for a local Hugging Face model folder (one with
    config.json) or a Hub id (`org/name[@revision]`: its snapshot in the local Hugging Face cache,
    downloaded there first when missing and not offline, `pipeline.read.hub`); anything else is a
    UserError."""
    if name_or_path in PRESETS:
        return None
    path = Path(os.path.expanduser(str(name_or_path)))
    if not path.is_dir() and (ref := hub.hub_ref(str(name_or_path))) is not None:
        path = _resolve_model(ref)[0]
    elif not path.is_dir():
        raise UserError(
            f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}), a local folder "
            "with config.json, nor a Hub id (org/name, e.g. Qwen/Qwen2.5-0.5B)"
        )
    if not (path / "config.json").is_file():
        raise UserError(
            f"--model {path} is a folder but has no config.json: not a Hugging Face model folder; "
            "give the folder that holds config.json and the weights, a preset or a Hub id"
        )
    return path


def _resolve_model(ref: hub.HubRef) -> tuple[Path, str]:
    return hub.resolve(ref, "model", "model", allow_patterns=hub.MODEL_PATTERNS, ignore_patterns=hub.MODEL_IGNORE)


def model_hub_record(name_or_path: str) -> dict | None:
    """For a Hub-id `--model`, what the run's config.json records of it (id, revision asked for,
    commit used: `pipeline.read.hub.record`), from the resolution `model_folder` made; else None.
    E.g. "Qwen/Qwen2.5-0.5B" -> {"id": "Qwen/Qwen2.5-0.5B", "revision": None, "commit": "<40 hex>"}."""
    ref = hub.hub_ref(str(name_or_path))  # None for a preset (no "/") and for an existing folder
    return None if ref is None else hub.record(ref, _resolve_model(ref)[1])
