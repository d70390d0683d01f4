"""Attention of a rank's share of a row split over a context-parallel group: its queries against
the keys and values of the whole row, gathered from the group.

Which tokens a rank holds, and the pieces its queries are cut into, each with its keys, are the
row split's (`trainer.data.row_split.RowShard`, on the decoder's current call:
`trainer.attention.packed_row`); the group is the one the run formed
(`trainer.distributed.context_parallel.ContextGroups`), handed to `attention` by the glue it was
installed with (`trainer.attention.backend.install(model, backend, groups)`).
"""

from __future__ import annotations

import torch

from trainer.attention import packed_row
from trainer.attention.features import Features
from trainer.attention.kernels import half_inputs, varlen_attention
from trainer.data.row_split import RowShard
from trainer.distributed.context_parallel import ContextGroups


@torch.compiler.disable
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    backend: str,
    scale: float | None,
    features: Features,
    sinks: torch.Tensor | None,
    groups: ContextGroups,
) -> torch.Tensor:
    """Packed attention of this rank's share of the row ([L, H, D] each), its queries against the
    keys of the whole row gathered over `groups` (see `trainer.data.row_split`); a call without a
    share (evaluation, the start-up probe) is plain `varlen_attention` over its own boundaries."""
    row = packed_row.current()
    shard: RowShard | None = row.context if row is not None and row.n_tokens == q.shape[0] else None
    if shard is None:
        return varlen_attention(q, k, v, cu_seqlens, max_seqlen, backend=backend, scale=scale, features=features, sinks=sinks)
    if backend != "sdpa":  # gathered in the kernel's 16-bit dtype (under autocast RoPE hands over float32)
        q, k, v = half_inputs(q, k, v)
    cu_q, cu_k, slots = shard.on(q.device, features.window, features.chunk)
    pieces = shard.pieces(features.window, features.chunk)
    # keys and values in one collective and one copy: [L, Hkv, Dk + Dv]
    both = groups.gather_tokens(torch.cat([k, v], dim=-1), shard.width).index_select(0, slots)
    keys, values = both.split([k.shape[-1], v.shape[-1]], dim=-1)
    # chunks are cut into the pieces now; the window also masks within a piece
    whole = Features(window=features.window, softcap=features.softcap)
    return varlen_attention(
        q,
        keys,
        values,
        cu_q,
        pieces.max_q,
        backend=backend,
        scale=scale,
        features=whole,
        sinks=sinks,
        cu_seqlens_k=cu_k,
        max_seqlen_k=pieces.max_k,
    )
