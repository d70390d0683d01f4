"""Packed attention for Hugging Face models: which backend, and the glue that plugs it in.

`install(model, backend)` registers a varlen kernel (`trainer.attention.kernels`) with transformers'
`AttentionInterface` and switches the model to it. Every attention layer of the model then
receives the example boundaries (`cu_seq_lens_q`, `max_length_q` forward kwargs, see
`trainer.data.batch.MicroBatch.model_kwargs`) and its own features, read per call:

- from what transformers passes the attention function: `sliding_window`, `softcap`, `s_aux`
  (sinks), and the value head dim (from the tensors);
- from the config where the model does not pass it: a layer whose `config.layer_types` entry is
  "sliding_attention" gets `config.sliding_window` (every layer does, in a model without
  layer types), "chunked_attention" gets `config.attention_chunk_size`.

A layer whose decoder layer does not pass the keyword arguments on (StableLM, Nemotron) gets the
boundaries of the decoder's current call from `trainer.attention.packed_row`; a layer called without any
is refused (examples would see each other), and so is a feature the backend cannot reproduce.

Backends, fastest first: fa4 (Hopper or newer), flash_attn, torch (all CUDA, 16-bit), flex (CUDA),
sdpa (the reference, anywhere); then cudnn (CUDA, 16-bit): the fastest on long examples, slower on
many short ones, so never auto's whole choice. `select_backend("auto", device, features)` takes the
first one that runs on the device and reproduces every feature the model uses (`trainer.model.check`
finds those features); on a Hopper GPU where cuDNN runs and reproduces them too, flash_attn or torch
comes paired with it ("flash_attn+cudnn": cuDNN for rows whose examples average 4,096 tokens or more).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface, masking_utils
from transformers.masking_utils import AttentionMaskInterface

from pipeline.contract import UserError
from trainer.attention import gathered, packed_row, positions
from trainer.attention.cudnn_kernel import cudnn_available
from trainer.attention.features import FEATURE_NAMES, KERNELS, LONG_EXAMPLE_TOKENS, Features, with_tensors
from trainer.attention.kernels import (
    fa4_importable,
    flash_attn_importable,
    supported,
    torch_flash_op,
    torch_varlen_fn,
    varlen_attention,
)
from trainer.distributed.context_parallel import ContextGroups

BACKENDS = KERNELS

DESCRIPTIONS = {
    "fa4": "FlashAttention-4 varlen (flash-attn-4: flash_attn.cute)",
    "flash_attn": "flash-attn varlen (flash_attn.flash_attn_varlen_func)",
    "torch": "torch varlen (FlashAttention, built into PyTorch)",
    "flex": "flex_attention with a document-causal block mask",
    "sdpa": "sdpa reference (attention on each example alone)",
    "cudnn": "cuDNN fused attention through PyTorch, on each example alone",
}
# auto on a Hopper GPU where cuDNN runs: the first kernel for rows of short examples, cuDNN for rows
# whose examples average LONG_EXAMPLE_TOKENS or more (`trainer.attention.features.row_kernel`)
PAIRED = ("flash_attn", "torch")
for _first in PAIRED:
    DESCRIPTIONS[f"{_first}+cudnn"] = (
        f"{DESCRIPTIONS[_first]}; cuDNN for rows whose examples average {LONG_EXAMPLE_TOKENS:,} tokens or more"
    )


# --------------------------------------------------------------------------- selection


def _is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def _why_not(backend: str, device: torch.device | str, dtype: torch.dtype | None) -> str | None:
    """Why `backend` cannot train on `device`/`dtype`, or None when it can."""
    if backend == "sdpa":
        return None
    if not _is_cuda(device):
        if backend == "flex":
            return "PyTorch has no FlexAttention backward on the CPU, so it cannot train there"
        return f"needs a CUDA device, but the model is on {torch.device(device).type!r}"
    if not torch.cuda.is_available():
        return "needs CUDA, but torch.cuda.is_available() is False"
    if backend == "flex":
        return None
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return f"FlashAttention kernels need bfloat16 or float16, not {dtype}"
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major < 8:
        return f"FlashAttention needs an Ampere or newer GPU (sm80+), this one is sm{major}{minor}"
    if backend == "fa4" and major < 9:
        return f"FlashAttention-4 trains on Hopper or newer GPUs (sm90+), this one is sm{major}{minor}"
    if backend == "fa4" and not fa4_importable():
        return "the flash-attn-4 package is not installed (or does not import)"
    if backend == "flash_attn" and not flash_attn_importable():
        return "the flash-attn package is not installed (or does not import)"
    if backend == "cudnn" and not cudnn_available():
        return "this PyTorch has no cuDNN (or it does not load)"
    if backend == "torch" and torch_varlen_fn() is None and torch_flash_op() is None:
        return f"this PyTorch ({torch.__version__}) has no FlashAttention varlen kernel"
    return None


def _cannot_reproduce(backend: str, features: set[str]) -> str | None:
    missing = set(features) - supported(backend)
    if not missing:
        return None
    return "it cannot reproduce " + ", ".join(FEATURE_NAMES[m] for m in sorted(missing))


def _reasons(device, dtype, features) -> dict[str, str | None]:
    """Each backend, fastest first, with why it cannot be used here (None: it can)."""
    return {b: _why_not(b, device, dtype) or _cannot_reproduce(b, features) for b in BACKENDS}


def _is_hopper(device: torch.device | str) -> bool:
    """A Hopper or newer GPU (sm90+), where cuDNN's attention was measured ahead on long examples."""
    return _is_cuda(device) and torch.cuda.get_device_capability(torch.device(device))[0] >= 9


def select_backend(
    requested: str = "auto",
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    features: set[str] = frozenset(),
) -> str:
    """Resolve `requested` ("auto" or one of BACKENDS) to a backend that can train on `device` and
    reproduces every one of `features` (names of `trainer.attention.features.Features`, e.g. {"window"}).

    "auto" picks the first usable one of fa4, flash_attn, torch, flex, sdpa (sdpa always is); on a
    Hopper GPU where cuDNN's attention runs too, flash_attn or torch comes paired with it
    ("flash_attn+cudnn": cuDNN for rows of long examples, `row_kernel`). An
    explicit request that cannot be used raises UserError saying why and what to use instead.
    Pass `dtype` only when it is the dtype attention will compute in (a bf16 model); float32
    weights trained under bf16 autocast still get bf16 attention inputs, so leave it None then.
    """
    reasons = _reasons(device, dtype, features)
    if requested == "auto":
        chosen = next(b for b, why in reasons.items() if why is None)
        if chosen in PAIRED and reasons["cudnn"] is None and _is_hopper(device):
            return f"{chosen}+cudnn"
        return chosen
    if requested not in BACKENDS:
        raise UserError(f"unknown attention backend {requested!r}: choose auto, {', '.join(BACKENDS)}")
    if reasons[requested] is not None:
        usable = [b for b, why in reasons.items() if why is None and b != requested]
        raise UserError(
            f"attention backend {requested!r} cannot be used: {reasons[requested]}; use --attn auto or {' / '.join(usable)} instead"
        )
    return requested


def piece_backend(device: torch.device | str) -> str:
    """auto's choice under context parallelism, where a share of a row attends the keys of the whole
    row: on a GPU FlashAttention-4 where it can run there, else flash_attn (whose request then says
    in one line what is missing); sdpa elsewhere."""
    if not _is_cuda(device):
        return "sdpa"
    return "fa4" if _why_not("fa4", device, None) is None else "flash_attn"


def explain_choice(
    requested: str,
    backend: str,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    features: set[str] = frozenset(),
) -> str:
    """One line saying what `backend` is and why it was chosen: the features the model uses and,
    for "auto", the faster backends passed over with their reasons."""
    uses = ", ".join(FEATURE_NAMES[f] for f in sorted(features)) or "no special attention features"
    text = f"{backend} ({DESCRIPTIONS[backend]}); the model uses {uses}"
    if requested != "auto":
        return text + "; as requested"
    reasons = _reasons(device, dtype, features)
    passed_over: dict[str, list[str]] = {}  # reason -> the faster backends it rules out, in order
    for b in list(reasons)[: list(reasons).index(backend.partition("+")[0])]:
        passed_over.setdefault(str(reasons[b]), []).append(b)
    return text + "".join(f"; not {', '.join(bs)}: {why}" for why, bs in passed_over.items())


# --------------------------------------------------------------------------- Hugging Face glue


# What an attention call may carry: read here (boundaries, features) or harmless to a packed
# kernel. Anything else with a value is refused rather than ignored: a new model feature arrives
# this way (as sliding_window, softcap and s_aux did), and ignoring one trains silently wrong.
READ_KWARGS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "sliding_window", "softcap", "s_aux"}
HARMLESS_KWARGS = {
    "position_ids",
    "use_cache",
    "cache_position",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "past_key_values",
    "past_key_value",
    "position_embeddings",
    "num_items_in_batch",
}  # a loss kwarg transformers.Trainer passes down through the model
LAYER_KINDS = {"full_attention", "sliding_attention", "chunked_attention"}


def layer_features(module: torch.nn.Module, query: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]) -> Features:
    """The features of one attention call: window and soft-cap as transformers passed them, else
    as the layer's config says (its `layer_types` entry, or `sliding_window` for every layer of a
    model without layer types, whose mask then applies it everywhere: PhiMoE); sinks when `s_aux`
    is passed; value_dim and wide_head from the tensors. An unknown layer kind, or a keyword that
    is neither read here nor harmless (READ_KWARGS, HARMLESS_KWARGS), is a one-line UserError."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    # the layer's index only where it selects something: torch.compile guards on every int module
    # attribute read, so reading it in every model would compile this function once per layer (and
    # past dynamo's recompile limit, run the later layers uncompiled)
    index = getattr(module, "layer_idx", None) if layer_types else None
    kind = layer_types[index] if layer_types and index is not None and index < len(layer_types) else None
    layer = type(module).__name__
    if kind is not None and kind not in LAYER_KINDS:
        raise UserError(
            f"{layer} is a {kind!r} layer (config.layer_types), which the packed attention "
            f"backends do not know (they know {', '.join(sorted(LAYER_KINDS))}): refused "
            "rather than approximated"
        )
    unknown = sorted(k for k, v in kwargs.items() if k not in READ_KWARGS | HARMLESS_KWARGS and v is not None and v is not False)
    if unknown:
        raise UserError(
            f"{layer} passes {unknown[0]}={kwargs[unknown[0]]!r} to attention, which the "
            "packed backends do not know how to reproduce: refused rather than ignored"
        )
    window = kwargs.get("sliding_window")
    if window is None and (kind == "sliding_attention" or not layer_types):
        window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None) if kind == "chunked_attention" else None
    softcap = kwargs.get("softcap")
    read = Features(
        window=int(window) if window else None,
        chunk=int(chunk) if chunk else None,
        softcap=float(softcap) if softcap else None,
    )
    return with_tensors(read, query, value, kwargs.get("s_aux"))


_HF_NAMES = {
    "fa4": "packlm_fa4",
    "flash_attn": "packlm_fa2",
    "torch": "packlm_torch",
    "flex": "packlm_blockmask",
    "sdpa": "packlm_reference",
    "cudnn": "packlm_cudnn",
    "flash_attn+cudnn": "packlm_fa2_cudnn",
    "torch+cudnn": "packlm_torch_cudnn",
}


def attention_name(backend: str) -> str:
    """The name a backend is registered under in transformers' AttentionInterface.

    The names avoid the substrings "flash", "sdpa", "flex" and "eager" on purpose: transformers
    treats any implementation whose name contains them as its own built-in one (e.g. it tries to
    load a flash-attention kernel from the Hub for "*flash*").
    """
    return _HF_NAMES[backend]


Observer = Callable[[torch.nn.Module, Features], None]


def make_hf_attention(backend: str, observe: Observer | None = None, groups: ContextGroups | None = None) -> Callable:
    """An attention function with the signature transformers' AttentionInterface expects; with
    `groups` (a context-parallel run's), a share of a row attends the keys gathered over them
    (`trainer.attention.gathered`).

    It receives query [B, Hq, S, D], key/value [B, Hkv, S, D(v)] and the forward kwargs, reads the
    example boundaries from `cu_seq_lens_q` / `max_length_q` (a flat packed batch, B == 1; where
    they are absent, from the decoder's current call, `trainer.attention.packed_row`) and the
    layer's features (`layer_features`), and calls `observe(module, features)` first if given.
    Refused, each with one line: no boundaries, attention dropout, a non-causal layer, a dense
    attention mask, a KV cache (generation).
    """

    def packlm_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        layer = type(module).__name__
        if dropout:
            raise UserError(
                f"attention dropout ({dropout}) is not supported by the packed backends; set attention_dropout=0 in the model config"
            )
        if not getattr(module, "is_causal", True):
            raise UserError(f"packed attention backends are causal only; {layer} is not")
        if attention_mask is not None:
            raise UserError(
                f"{layer} got a dense attention_mask; packed attention takes the example boundaries "
                "(cu_seq_lens_q/max_length_q, trainer.data.batch.MicroBatch.model_kwargs) instead"
            )
        batch, n_heads, seq, head_dim = query.shape
        if key.shape[2] != seq:
            raise UserError(
                "packed attention backends do not support a KV cache (generation); switch the model to eager/sdpa attention for generation"
            )
        cu_seqlens, max_seqlen = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
        row = packed_row.current() if cu_seqlens is None else None
        if row is not None and row.n_tokens == seq:  # a layer that does not pass them on (StableLM)
            cu_seqlens, max_seqlen = row.cu_seqlens, row.max_seqlen
        if cu_seqlens is None or max_seqlen is None or batch != 1:
            raise UserError(
                f"{layer} was called without example boundaries (cu_seq_lens_q and max_length_q on "
                "a [1, T] batch): the model's layers do not pass them on to attention, so packed "
                "examples would attend to each other"
            )
        features = layer_features(module, query, value, kwargs)
        if observe is not None:
            observe(module, features)
        query = positions.packed_queries(module, query)  # Llama 4's temperature, per example
        flat = lambda x: x.transpose(1, 2).reshape(seq, x.shape[1], x.shape[3])  # noqa: E731
        q, k, v = flat(query), flat(key), flat(value)
        sinks = kwargs.get("s_aux") if features.sinks else None
        if groups is None:
            out = varlen_attention(q, k, v, cu_seqlens, int(max_seqlen), backend=backend, scale=scaling, features=features, sinks=sinks)
        else:  # a context-parallel run: a share attends the whole row's keys, gathered over the group
            out = gathered.attention(
                q, k, v, cu_seqlens, int(max_seqlen), backend=backend, scale=scaling, features=features, sinks=sinks, groups=groups
            )
        return out.view(batch, seq, n_heads, out.shape[-1]), None

    packlm_attention.__name__ = attention_name(backend)
    return packlm_attention


def _no_dense_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function for AttentionMaskInterface: boundaries come from cu_seq_lens, so no mask."""
    return None


def _mask_preprocessing_skips_unregistered() -> bool:
    """True when transformers skips mask creation for attention names without a mask function.

    Then registering no mask function is strictly better: registering one makes transformers scan
    position_ids for packing on every forward (a device-to-host sync) only to get None back.
    """
    try:
        source = inspect.getsource(masking_utils._preprocess_mask_arguments)
    except Exception:
        return False
    return "ALL_MASK_ATTENTION_FUNCTIONS._global_mapping" in source


def register(backend: str, name: str | None = None, observe: Observer | None = None, groups: ContextGroups | None = None) -> str:
    """Register `backend` with transformers (attention function, and a None mask function only
    where this transformers version needs one) under `name` (default `attention_name(backend)`),
    gathering keys over `groups` when given (`make_hf_attention`). Returns the registered name."""
    name = name or attention_name(backend)
    AttentionInterface.register(name, make_hf_attention(backend, observe, groups))
    if not _mask_preprocessing_skips_unregistered():
        AttentionMaskInterface.register(name, _no_dense_mask)
    return name


def set_implementation(model: torch.nn.Module, name: str) -> None:
    """Switch every attention layer of `model` to the registered (or built-in) implementation
    `name`; refuses models that do not use transformers' AttentionInterface."""
    setter = getattr(model, "set_attn_implementation", None)
    try:
        if setter is None:
            raise AttributeError("no set_attn_implementation")
        setter(name)
    except (AttributeError, ValueError, KeyError, ImportError):
        # older transformers validate names against their own list; the config attribute is what
        # the attention layers actually read (the decoder shares the top-level config)
        model.config._attn_implementation = name
    if getattr(model.config, "_attn_implementation", name) != name:
        raise UserError(
            f"{type(model).__name__} did not accept attention implementation {name!r}; it does not use transformers' AttentionInterface"
        )


def install(model: torch.nn.Module, backend: str, groups: ContextGroups | None = None) -> str:
    """Switch a Hugging Face model's attention to the packed `backend`, over the context-parallel
    `groups` of the run when it has them; returns the registered name.

    After this, call the model (or its decoder) with `cu_seq_lens_q`, `cu_seq_lens_k`,
    `max_length_q`, `max_length_k` and restarting `position_ids` (MicroBatch.model_kwargs()).
    No dense [T, T] mask is ever built except per example inside the "sdpa" reference backend.
    """
    if backend not in DESCRIPTIONS:  # a backend, or auto's pair of one with cudnn
        raise UserError(f"unknown attention backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    name = register(backend, groups=groups)
    set_implementation(model, name)
    return name
