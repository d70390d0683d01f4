"""The packed row the decoder is running: its example boundaries, for code the model does not hand them.

transformers passes the boundaries (`cu_seq_lens_q`, `max_length_q`) and `position_ids` from the
decoder down to attention as keyword arguments, but some decoder layers do not forward keyword
arguments (StableLM, Nemotron), and some features of a layer are computed before attention from
the row's length rather than the example's (Llama 4's attention temperature, `trainer.attention.positions`).
`install(decoder)` adds a forward pre-hook to the decoder stack that records the keyword arguments
of every call (`current()`); the attention glue and `trainer.attention.positions` read them from there.
A rank's share of a row split over a context-parallel group (`trainer.data.row_split.RowShard`) comes
to it the same way, as the decoder call's argument `SHARD_KWARG` (`trainer.model.loss.hidden_states`
passes it), which the hook takes out before the decoder sees it.

The record stays until the decoder's next call replaces it (a call without boundaries records
None), so that activation checkpointing, which runs a layer's forward again during the backward,
after the decoder's forward has returned, sees the boundaries of the row it recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PackedRow:
    """One flat packed row [1, T]: example boundaries and restarting positions."""

    cu_seqlens: torch.Tensor  # int32 [n_examples + 1]
    max_seqlen: int
    position_ids: torch.Tensor | None  # int64 [1, T]
    n_tokens: int
    context: Any = None  # this rank's share of a row split over ranks (trainer.data.row_split.RowShard)


SHARD_KWARG = "packlm_row_shard"  # the decoder call's share of a row, read here and never passed on
_CURRENT: list[PackedRow | None] = [None]
_HOOKED = "_packlm_packed_row_hook"


def current() -> PackedRow | None:
    """The packed row of the decoder's latest call, or None when that call had no boundaries."""
    return _CURRENT[0]


def _record(kwargs: dict[str, Any], context: Any) -> None:
    cu, max_seqlen = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if cu is None or max_seqlen is None or tokens is None or tokens.shape[0] != 1:
        _CURRENT[0] = None
        return
    _CURRENT[0] = PackedRow(cu, int(max_seqlen), kwargs.get("position_ids"), int(tokens.shape[1]), context)


def install(decoder: torch.nn.Module) -> None:
    """Record every call's boundaries on `decoder` (idempotent)."""
    if getattr(decoder, _HOOKED, False):
        return

    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        if SHARD_KWARG not in kwargs:
            _record(kwargs, None)
            return None
        kwargs = dict(kwargs)
        _record(kwargs, kwargs.pop(SHARD_KWARG))
        return args, kwargs

    decoder.register_forward_pre_hook(pre_hook, with_kwargs=True)
    setattr(decoder, _HOOKED, True)
