"""The kernels that build the mask themselves, and so reproduce every feature
(`trainer.attention.features.Features`): "sdpa", the reference that attends each example alone, and
"flex", FlexAttention with a document-causal block mask (`trainer.attention.kernels` describes both).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from pipeline.contract import UserError
from trainer.attention.features import Features, repeat_kv, segment_ids

# Examples whose attention runs as one batched call: a bucket takes every example at least this
# fraction of its longest as long (right-padded to it), so padding adds at most ~1/0.8^2 = 1.56x
# to an example's attention work; examples of at most SMALL_EXAMPLE tokens share one bucket, where
# a call costs more than the padding.
BUCKET_FILL = 0.8
SMALL_EXAMPLE = 64


def length_buckets(lengths: list[int]) -> list[list[int]]:
    """Indices of the non-empty examples, grouped into buckets of similar length (longest first):
    each bucket's examples are padded to its longest and attended in one batched call."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets:
            longest = lengths[buckets[-1][0]]
            if lengths[i] >= BUCKET_FILL * longest or longest <= SMALL_EXAMPLE:
                buckets[-1].append(i)
                continue
        buckets.append([i])
    return buckets


def sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scale, feats: Features, sinks, cu_seqlens_k=None):
    """Reference: causal attention on each example alone, written the obvious way.

    Examples of similar length (`length_buckets`) are right-padded to the longest of their bucket
    and attended as one [B, H, L, D] batch: padding sits after every real token, so causality keeps
    it out of every real query's attention, and the padded queries' outputs are dropped (their
    gradients are exactly zero). Without soft-capping or sinks each bucket is one
    `F.scaled_dot_product_attention` call (causal, or with the window/chunk mask; 4-D, so that
    PyTorch's fused CPU kernel takes it instead of materialising the scores); with them, the scores,
    mask and softmax are spelled out as transformers' eager attention does.

    `cu_seqlens_k` (context parallelism, `trainer.data.row_split`): key boundaries of their own,
    each piece of keys at least as long as its piece of queries, which are its LAST tokens (the
    causal mask is aligned to the bottom right, as FlashAttention's is): queries [4, 6) of an
    example against its keys [0, 6) give cu_seqlens [0, 2] and cu_seqlens_k [0, 6]."""
    hq = q.shape[1]
    groups = hq // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bounds = cu_seqlens.tolist()
    kbounds = bounds if cu_seqlens_k is None else cu_seqlens_k.tolist()
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    klengths = [e - s for s, e in zip(kbounds[:-1], kbounds[1:])]
    pieces, positions = [], []
    for bucket in length_buckets(klengths):
        if not any(lengths[b] for b in bucket):
            continue
        longest_q = max(lengths[b] for b in bucket)
        longest_k = klengths[bucket[0]]
        iq = torch.arange(longest_q, device=q.device)
        ik = torch.arange(longest_k, device=q.device)
        qstarts = torch.tensor([bounds[b] for b in bucket], device=q.device)
        qsizes = torch.tensor([max(lengths[b], 1) for b in bucket], device=q.device)
        kstarts = torch.tensor([kbounds[b] for b in bucket], device=q.device)
        ksizes = torch.tensor([klengths[b] for b in bucket], device=q.device)
        real = iq[None, :] < torch.tensor([lengths[b] for b in bucket], device=q.device)[:, None]  # [B, Lq]
        # padding repeats a real token
        qindex = qstarts[:, None] + torch.minimum(iq[None, :], qsizes[:, None] - 1)
        kindex = kstarts[:, None] + torch.minimum(ik[None, :], ksizes[:, None] - 1)
        qb = q[qindex].transpose(1, 2)  # [B, H, Lq, D]
        kb, vb = (x[kindex].transpose(1, 2) for x in (k, v))  # [B, H, Lk, D]
        offsets = ksizes - torch.tensor([lengths[b] for b in bucket], device=q.device)
        at = iq[None, :] + offsets[:, None]  # [B, Lq]: the key position each query sits at
        mask = (ik[None, None, :] <= at[:, :, None])[:, None]  # [B, 1, Lq, Lk]
        if feats.window is not None:
            mask = mask & (at[:, None, :, None] - ik < feats.window)
        if feats.chunk is not None:
            mask = mask & (at[:, None, :, None] // feats.chunk == ik // feats.chunk)
        if feats.softcap is None and sinks is None:
            plain = feats.window is None and feats.chunk is None and not bool(offsets.any())
            out = F.scaled_dot_product_attention(
                qb, kb, vb, attn_mask=None if plain else mask, is_causal=plain, scale=scale, enable_gqa=groups > 1
            )
        else:
            kb, vb = repeat_kv(kb, groups), repeat_kv(vb, groups)  # [B, H, L, D]: heads on dim 1 too
            scores = (qb @ kb.transpose(-1, -2)) * scale
            if feats.softcap is not None:
                scores = feats.softcap * torch.tanh(scores / feats.softcap)
            scores = scores.masked_fill(~mask, float("-inf"))
            if sinks is not None:
                sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
                scores = torch.cat([scores, sink], dim=-1)
            probs = torch.softmax(scores.float(), dim=-1)[..., :longest_k].to(vb.dtype)
            out = probs @ vb
        pieces.append(out.transpose(1, 2)[real])  # [query tokens of the bucket, H, Dv]
        positions.append(qindex[real])
    if not pieces:
        return q.new_zeros((*q.shape[:2], v.shape[-1]))
    placed = torch.cat(positions)
    where = torch.empty_like(placed)
    where[placed] = torch.arange(len(placed), device=placed.device)
    return torch.cat(pieces)[where]


_FLEX_MASKS: dict[tuple, tuple[torch.Tensor, Any]] = {}


@torch.compiler.disable
def _flex_block_mask(cu_seqlens: torch.Tensor, n_tokens: int, feats: Features):
    """The document-causal (+ window / chunk) BlockMask of this batch, built once per batch and
    kind of layer: every layer of a forward gets the same cu_seqlens tensor, so masks are cached
    by its identity (the cache holds the tensor, so its id cannot be reused while cached) and by
    window and chunk (Gemma's window and full layers alternate)."""
    key = (n_tokens, feats.window, feats.chunk, cu_seqlens.device)
    cached = _FLEX_MASKS.get(key)
    if cached is not None and cached[0] is cu_seqlens:
        return cached[1]
    if any(tensor is not cu_seqlens for tensor, _ in _FLEX_MASKS.values()):
        _FLEX_MASKS.clear()  # a new batch: the old one's masks are done with
    seg = segment_ids(cu_seqlens, n_tokens)
    pos = torch.arange(n_tokens, device=cu_seqlens.device) - cu_seqlens.long()[seg]
    window, chunk = feats.window, feats.chunk

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (seg[q_idx] == seg[kv_idx]) & (kv_idx <= q_idx)
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        if chunk is not None:
            keep = keep & (pos[q_idx] // chunk == pos[kv_idx] // chunk)
        return keep

    mask = create_block_mask(mask_mod, None, None, n_tokens, n_tokens, device=cu_seqlens.device)
    _FLEX_MASKS[key] = (cu_seqlens, mask)
    return mask


def flex_varlen(q, k, v, cu_seqlens, max_seqlen, scale, feats: Features, sinks):
    """flex_attention over the whole flat batch as one [1, H, T, D] sequence with a block mask.
    Sinks: flex returns log Z (the LSE); a sink logit s turns the softmax's denominator into
    Z + e^s, so the output is scaled by Z / (Z + e^s) = sigmoid(LSE - s)."""
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise UserError("attention backend 'flex' cannot train on the CPU (PyTorch has no FlexAttention backward there); use --attn sdpa")
    n_tokens = q.shape[0]
    block_mask = _flex_block_mask(cu_seqlens, n_tokens, feats)
    softcap = feats.softcap
    score_mod = None
    if softcap is not None:

        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

    lse_kwargs: dict[str, Any] = {}
    if sinks is not None:
        try:
            from torch.nn.attention.flex_attention import AuxRequest

            lse_kwargs = {"return_aux": AuxRequest(lse=True)}
        except ImportError:  # torch < 2.9 returns (out, lse)
            lse_kwargs = {"return_lse": True}
    as_batch = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731  [T, H, D] -> [1, H, T, D]
    with torch.autocast(q.device.type, enabled=False):  # inputs are cast already; score_mod too
        result = flex_attention(
            as_batch(q),
            as_batch(k),
            as_batch(v),
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
            **lse_kwargs,
        )
    if sinks is None:
        out = result
    else:
        out, aux = result
        lse = aux.lse if hasattr(aux, "lse") else aux  # [1, H, T]
        out = out * torch.sigmoid(lse - sinks.float().reshape(1, -1, 1)).unsqueeze(-1).to(out.dtype)
    return out[0].transpose(0, 1)
