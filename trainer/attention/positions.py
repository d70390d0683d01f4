"""Position features that transformers computes from the whole row, made per example.

Some models compute a position feature from the longest position of the batch, or from the index
of a token in the row, which a packed row does not equal each example's own:

- dynamic NTK RoPE (`rope_type` "dynamic"): the frequencies are stretched for a sequence longer
  than `max_position_embeddings`, by an amount set by its length, and transformers takes that
  length from the batch's largest position;
- `longrope` (Phi-3/3.5 128k): the long factors are used for a sequence longer than
  `original_max_position_embeddings`, the short ones otherwise, again chosen once for the batch;
- Llama 4's attention temperature tuning: its NoPE layers scale the queries by
  `1 + attn_scale * log1p(floor((p + 1) / floor_scale))` with p the index in the row.

`install(model)` makes each of them what the example gets alone during a packed forward (one
whose decoder call carries boundaries, `trainer.attention.packed_row`), and leaves the stock behaviour for
any other call: RoPE modules of those types compute their cos/sin per example (each token gets
the frequencies of its own example's length, read from the restarting `position_ids`), and the
temperature is computed from `position_ids` in the packed attention call (`packed_queries`; the
layer's own row-index scaling is switched off for packed calls). `thresholds(model)` names the lengths past
which these features change, so that `trainer.model.check` proves them on a probe that passes
them. A RoPE of these types in a form this module does not know is refused in one line.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from pipeline.contract import UserError
from trainer.attention import packed_row

PER_EXAMPLE_ROPE = ("dynamic", "longrope")
_PATCHED = "_packlm_per_example"
_TEMPERATURE = "_packlm_temperature"


def _rope_parameters(config: Any) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params if isinstance(params, dict) else {}


def _rope_type(config: Any) -> str | None:
    params = _rope_parameters(config)
    return params.get("rope_type", params.get("type"))


def _temperature_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Llama 4 style attention modules that scale their queries by the row index (NoPE layers)."""
    return [
        m
        for m in model.modules()
        if (getattr(m, "attn_temperature_tuning", False) or getattr(m, _TEMPERATURE, False))
        and hasattr(m, "use_rope")
        and not m.use_rope
        and hasattr(m, "floor_scale")
    ]


def thresholds(model: torch.nn.Module) -> dict[str, int]:
    """The position features of `model` that change past a length, each with that length: a probe
    whose examples pass it (and whose row passes it before a later example) exercises them."""
    found: dict[str, int] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        kind = _rope_type(config) if config is not None else None
        rope_type = getattr(module, "rope_type", None)
        if rope_type is None or kind is None:
            continue
        if isinstance(rope_type, str) and "dynamic" in rope_type:
            found["dynamic NTK RoPE (rope_type 'dynamic')"] = int(config.max_position_embeddings)
        elif rope_type == "longrope":
            params = _rope_parameters(config)
            original = params.get("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
            if original:
                found["longrope RoPE"] = int(original)
    for layer in _temperature_layers(model):
        found["attention temperature tuning (attn_temperature_tuning)"] = int(layer.floor_scale)
    return found


def example_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """For each token of [B, T] restarting positions, the length of its example (its example's
    largest position + 1), computed on the device without a sync."""
    batch, n = position_ids.shape
    starts = (position_ids == 0).long()
    segment = (starts.cumsum(-1) - 1).clamp_min(0)
    segment = segment + torch.arange(batch, device=position_ids.device)[:, None] * n
    flat = segment.reshape(-1)
    largest = torch.zeros(batch * n, dtype=position_ids.dtype, device=position_ids.device)
    largest = largest.scatter_reduce(0, flat, position_ids.reshape(-1), reduce="amax", include_self=False)
    return largest.index_select(0, flat).reshape(batch, n) + 1


def _with_inv_freq(
    module: torch.nn.Module, raw: Callable, inv_freq: torch.Tensor, x: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The undecorated RoPE forward with `inv_freq` in place of the module's frequencies."""
    saved = module._buffers["inv_freq"]
    module._buffers["inv_freq"] = inv_freq
    try:
        return raw(module, x, position_ids)
    finally:
        module._buffers["inv_freq"] = saved


def _per_example_rope(module: torch.nn.Module) -> None:
    """Replace the RoPE module's forward with one that gives every example of a packed row the
    frequencies it gets alone: the original (short) ones, or for an example past the threshold
    the ones transformers computes for its length (longrope: the long factors)."""
    raw = getattr(type(module).forward, "__wrapped__", None)
    name = type(module).__name__
    if raw is None or "inv_freq" not in module._buffers or not hasattr(module, "original_inv_freq"):
        raise UserError(
            f"{name} uses a {module.rope_type!r} RoPE, whose frequencies depend on the sequence "
            "length, in a form the trainer cannot compute per packed example: refused rather "
            "than letting every example get the frequencies of the row's longest one; use a "
            "static RoPE scaling (rope_type 'linear', 'yarn' or 'default') in the config"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[module.rope_type]
    config = module.config
    if module.rope_type == "longrope":
        params = _rope_parameters(config)
        threshold = int(params.get("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", 0)))
    else:
        threshold = int(module.original_max_seq_len)

    def forward(self: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any):
        if packed_row.current() is None or kwargs:
            return type(self).forward(self, x, position_ids, **kwargs)
        row = packed_row.current()
        if row.context is not None:  # a share of a row split over ranks: its positions do not tell
            lengths = row.context.lengths_on(position_ids.device).reshape(position_ids.shape)
        else:
            lengths = example_lengths(position_ids)
        cos, sin = _with_inv_freq(self, raw, self.original_inv_freq.to(x.device), x, position_ids)
        if self.rope_type == "longrope":  # the long factors, as transformers computes them
            variants = [(threshold + 1, lengths > threshold)]
        else:  # one set of frequencies per distinct length past the threshold (a host sync), from
            # the length as a tensor, as transformers computes them from the batch's largest position
            variants = [(torch.tensor(n, device=x.device), lengths == n) for n in torch.unique(lengths[lengths > threshold]).tolist()]
        for length, pick in variants:
            inv_freq, _ = init(config, x.device, seq_len=length)
            other_cos, other_sin = _with_inv_freq(self, raw, inv_freq, x, position_ids)
            cos = torch.where(pick[..., None], other_cos, cos)
            sin = torch.where(pick[..., None], other_sin, sin)
        return cos, sin

    module.forward = types.MethodType(forward, module)


def packed_queries(module: torch.nn.Module, query: torch.Tensor) -> torch.Tensor:
    """The queries [1, H, T, D] of an attention call, scaled by Llama 4's attention temperature
    from the packed row's `position_ids` where `module` is a NoPE layer whose own row-index
    scaling `install` switched off for this call (the same formula and rounding as the layer's:
    float32 scales, the product cast back to the query's dtype); otherwise `query` unchanged."""
    if not getattr(module, _TEMPERATURE, False) or getattr(module, "attn_temperature_tuning", True):
        return query
    row = packed_row.current()
    if row is None or row.position_ids is None:
        return query
    positions = row.position_ids.reshape(1, 1, -1, 1)
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
    return (query * scales).to(query.dtype)


def install(model: torch.nn.Module, decoder: torch.nn.Module) -> None:
    """Record the packed rows of `decoder` (`trainer.attention.packed_row`) and make the model's row-length
    position features per example (idempotent)."""
    packed_row.install(decoder)
    for module in list(model.modules()):
        if getattr(module, _PATCHED, False):
            continue
        rope_type = getattr(module, "rope_type", None)
        if isinstance(rope_type, dict) and any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in rope_type.values()):
            raise UserError(
                f"{type(module).__name__} uses per-layer-type RoPE with a length-dependent type "
                f"({rope_type}), which the trainer cannot compute per packed example: refused; "
                "use a static RoPE scaling (rope_type 'linear', 'yarn' or 'default')"
            )
        if isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope"):
            _per_example_rope(module)
            setattr(module, _PATCHED, True)
    kind = _rope_type(getattr(model, "config", None))
    if (
        isinstance(kind, str)
        and ("dynamic" in kind or kind == "longrope")
        and not any(getattr(m, _PATCHED, False) for m in model.modules())
    ):
        raise UserError(
            f"its config asks for a {kind!r} RoPE, whose frequencies depend on the sequence length, "
            "but no RoPE module of the model is one the trainer can compute per packed example: "
            "refused; use a static RoPE scaling (rope_type 'linear' or 'yarn')"
        )
    layers = [layer for layer in _temperature_layers(model) if not getattr(layer, _TEMPERATURE, False)]
    for layer in layers:
        setattr(layer, _TEMPERATURE, True)
    if layers:
        # an attribute, not a closure, so that a deep copy of the model switches its own layers
        decoder._packlm_temperature_layers = layers
        decoder.register_forward_pre_hook(_switch_temperature, with_kwargs=True)


def _switch_temperature(decoder: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Decoder pre-hook (the decoder runs uncompiled): packed calls switch the NoPE layers' own
    row-index scaling off (`packed_queries` scales from position_ids instead), others leave it on."""
    row = packed_row.current()
    packed = row is not None and row.position_ids is not None
    for layer in decoder._packlm_temperature_layers:
        layer.attn_temperature_tuning = not packed
