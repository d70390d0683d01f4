"""Batch sizes of Axolotl / TRL files (`pipeline.foreign.config.KEYS`): with packing a token budget per
micro-batch; without it (both tools' default) padded batches of B examples a step, which pack-data
packs as groups (`--strategy minibatch --group-size B`) and pack-train takes one a step
(`--step-by-group`): the same examples each step, so the same gradient."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.foreign.keys import DATA, PACKED, Convert, NotUsed
from pipeline.foreign.keys import refuse as _refuse


def padded(settings: Mapping[str, Any]) -> bool:
    """The file trains padded batches: neither TRL's `packing` nor Axolotl's `sample_packing` is true
    (both tools' default). Such a step is exactly B examples; pack-data packs them as one group
    (`--strategy minibatch --group-size B`) and pack-train takes one group a step (`--step-by-group`),
    which computes the same gradient."""
    return settings.get("packing") is not True and settings.get("sample_packing") is not True


def _whole_rows(key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _refuse(key, value, "give a whole number of rows")
    return value


def group_size(batch: Any, batch_key: str, settings: Mapping[str, Any]) -> int:
    """B of a padded-batch file: its per-device batch x gradient_accumulation_steps (one process)."""
    accum = settings.get("gradient_accumulation_steps")
    return _whole_rows(batch_key, batch) * (1 if accum is None else _whole_rows("gradient_accumulation_steps", accum))


def _tokens_per_step(key: str, length_keys: tuple[str, ...], packing_key: str, default_len: int | None, padded_len: int) -> Convert:
    """A batch size in rows is exact as a token budget only when every row is packed to the full
    length: `rows * length` tokens per micro-batch. A padded batch (no packing) is a group of
    examples instead: each optimizer step one group (--step-by-group), cut into micro-batches of
    `rows * length` tokens (`padded_len` when the file gives no length), which only bound memory."""

    def convert(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        _whole_rows(key, value)
        length = next((settings[k] for k in length_keys if settings.get(k) is not None), None)
        if isinstance(length, bool) or not isinstance(length, (int, type(None))):
            raise _refuse(f"its {length_keys[0]}", length, "it is a row length: give a whole number of tokens")
        if padded(settings):
            return {"tokens_per_step": value * (length or padded_len), "step_by_group": True}
        length = length or default_len
        if not isinstance(length, int):
            raise _refuse(
                key,
                value,
                f"with {packing_key}: true a batch of {value} rows is a token budget only with "
                f"the row length: set {length_keys[0]}, or give tokens_per_step "
                "(tokens per micro-batch)",
            )
        return {"tokens_per_step": value * length}

    return convert


def _groups(key: str) -> Convert:
    """pack-data's side of a batch size: with padded batches, the group of examples of each step."""

    def convert(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        if not padded(settings):
            raise NotUsed("pack-train's token budget, with packing")
        return {"strategy": "minibatch", "group_size": group_size(value, key, settings)}

    return convert


def _grad_accum(command: str) -> Convert:
    """gradient_accumulation_steps: --grad-accum with packing; with padded batches part of the group
    size (the whole group is the optimizer step, pack-train's --grad-accum stays 1)."""

    def convert(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
        if padded(settings):
            _whole_rows("gradient_accumulation_steps", value)
            raise NotUsed("padded batches: a factor of the group size, each group one optimizer step")
        if command == DATA:
            raise NotUsed("pack-train's")
        return {"grad_accum": value}

    return convert


def _packing(value: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    if value is True:
        raise NotUsed(PACKED)
    raise NotUsed("padded batches: trained as packed groups of the same examples (the same gradient)")


# Axolotl's excess_length_strategy as --overlong (its schema: None means drop, "for backward compatibility")
EXCESS_LENGTH = {"drop": "drop", "truncate": "truncate", "raise": "error"}


def _excess_length(value: Any, _: Mapping[str, Any]) -> dict[str, Any]:
    if value not in EXCESS_LENGTH:
        raise _refuse("excess_length_strategy", value, "give drop, truncate or raise")
    return {"overlong": EXCESS_LENGTH[value]}
