"""The Axolotl / TRL keys of long rows, FSDP and plugins (`pipeline.foreign.config.KEYS`): Axolotl's
tiled MLP and activation offloading, FSDP's version, words and settings, and the plugins whose
kernels compute what pack-train computes; each refuses in one line a value with no exact equivalent."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.foreign.keys import NotUsed, _yes_no
from pipeline.foreign.keys import refuse as _refuse

TILE_TOKENS = 8192  # --tile-mlp for `tiled_mlp: true` without tiled_mlp_num_shards (tiles change no number)


def _tiled_mlp(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Axolotl's tiled MLP as --tile-mlp TOKENS: its tiles only bound memory (the MLP works token by
    token), so any tile length computes the same; tiled_mlp_num_shards gives sequence_len / shards."""
    if not _yes_no("tiled_mlp", value):
        raise NotUsed("false: the MLP runs over the whole row")
    shards, length = settings.get("tiled_mlp_num_shards"), settings.get("sequence_len")
    if isinstance(shards, int) and shards > 0 and isinstance(length, int) and not isinstance(length, bool):
        return {"tile_mlp": max(1, -(-length // shards))}
    return {"tile_mlp": TILE_TOKENS}


def _activation_offloading(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value in (True, "legacy"):
        return {"offload_activations": True}
    if value is False:
        raise NotUsed("false: activations stay on the GPU")
    raise _refuse("activation_offloading", value, "use true (CPU memory); disk offloading is not done here")


# Axolotl plugins whose kernels compute the same numbers (the loss, norms, RoPE, SwiGLU fused; the
# Hub's kernels), and SwanLab, a metrics logger
SAME_MATH_PLUGINS = ("cut_cross_entropy", "liger", "integrations.kernels", "swanlab")


def _plugins(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    """Cut Cross Entropy and Liger are kernels; any other plugin changes what Axolotl runs
    (Spectrum freezes layers, others distil or evaluate) and is refused."""
    names = value if isinstance(value, list) else [value]
    other = [n for n in names if not (isinstance(n, str) and any(k in n for k in SAME_MATH_PLUGINS))]
    if other:
        raise _refuse(
            "plugins",
            other,
            "only Axolotl's kernel plugins (Cut Cross Entropy, Liger, Kernels) are "
            "known to compute what pack-train computes: remove the others",
        )
    raise NotUsed(
        "kernels that compute the same (the loss here is chunked and exact), or SwanLab's logging: "
        "metrics go to metrics.jsonl and --report-to"
    )


def _fsdp_version(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value not in (1, 2):
        raise _refuse("fsdp_version", value, "use 1 or 2")
    return {"parallel": "fsdp"}  # FSDP2; FSDP1's sharding computes the same


def _fsdp_words(value: Any) -> list[str]:
    """TRL's `fsdp: "full_shard auto_wrap offload"` or Axolotl's list of the same words."""
    if isinstance(value, str):
        return value.split()
    return [str(v) for v in value] if isinstance(value, list) else []


def _fsdp(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if not value:
        raise NotUsed("empty: no FSDP")
    if "offload" in _fsdp_words(value):
        return {"parallel": "fsdp", "offload_states": True}
    return {"parallel": "fsdp"}


def _fsdp_config(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """`offload_params: true` (TRL/accelerate; Axolotl: `fsdp_offload_params`) is --offload-states."""
    offload = isinstance(value, Mapping) and any(value.get(k) is True for k in ("offload_params", "fsdp_offload_params"))
    if not offload:
        raise NotUsed("FSDP2 wraps each decoder layer; its settings are --reshard-after-forward and --offload-states")
    if "offload" in _fsdp_words(settings.get("fsdp")):
        raise NotUsed("fsdp's offload sets --offload-states already")
    return {"offload_states": True}
