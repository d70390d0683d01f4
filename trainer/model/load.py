"""Causal LMs for the trainer: Llama presets with seeded random weights, or a Hugging Face model
folder: a preset (`trainer.model.presets`), a folder on disk holding `config.json` and safetensors
weights, or a Hub id whose snapshot `trainer.model.presets.model_folder` finds in (or downloads to) the
local Hugging Face cache.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from pipeline.contract import UserError
from trainer.attention import backend as attention
from trainer.attention import positions
from trainer.distributed.context_parallel import ContextGroups
from trainer.model.check import check_model
from trainer.model.keep_attention import KeptAttention, checkpoint_kwargs
from trainer.model.loss import find_decoder
from trainer.model.presets import PRESETS, model_folder

_COMMON = dict(
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
    use_cache=False,
)


def preset_config(name: str, vocab_size: int | None = None) -> LlamaConfig:
    """The LlamaConfig of preset `name`, with `vocab_size` overriding the preset's if given."""
    if name not in PRESETS:
        raise UserError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    kwargs = {**_COMMON, **PRESETS[name]}
    if vocab_size is not None:
        kwargs["vocab_size"] = int(vocab_size)
    config = LlamaConfig(**kwargs)
    # rope_theta moved into rope_parameters in transformers 5; set both spellings harmlessly.
    if getattr(config, "rope_parameters", None) is None:
        config.rope_parameters = {"rope_type": "default", "rope_theta": kwargs["rope_theta"]}
    return config


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def _load_local(path: Path, vocab_size: int | None, dtype: torch.dtype, added_tokens: int = 0, seed: int = 0) -> PreTrainedModel:
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - config validation raises its own exception types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"cannot load the model in {path}: {first}: check that the folder holds a complete "
            "Hugging Face model (config.json and its weights), or download it again"
        ) from None
    have = model.get_input_embeddings().num_embeddings
    if vocab_size is not None and vocab_size > have:
        if vocab_size - added_tokens > have:
            raise UserError(
                f"the tokenizer has {vocab_size} tokens but the model in {path} only embeds {have}: "
                "use the tokenizer the model was trained with"
            )
        # tokens pack-data added (--add-token, --special-token): new rows, drawn from `seed`, as HF draws them
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model.resize_token_embeddings(vocab_size)
        head = "" if model.config.tie_word_embeddings else " and its LM head"
        print(
            f"pack-train: the data's tokenizer has {vocab_size} tokens ({added_tokens} added by pack-data): the "
            f"embeddings{head} of {path} grown from {have} to {vocab_size} rows",
            file=sys.stderr,
        )
    return model


def load_model(
    name_or_path: str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    vocab_size: int | None = None,
    seed: int = 0,
    added_tokens: int = 0,
) -> PreTrainedModel:
    """A causal LM on `device` in `dtype`, attention not yet packed (see `prepare`).

    A preset name ("tiny", "llama-100m", "llama-1b") gives a LlamaForCausalLM with random weights
    drawn on the CPU from `seed` (identical on every device and rank); a local folder, or a Hub
    id's snapshot folder, is loaded with from_pretrained(local_files_only=True). `vocab_size`
    overrides a preset's vocabulary so the model matches any tokenizer; a local model's embeddings
    (and an untied LM head) grow to it when it is larger by no more than the `added_tokens` pack-data
    added to the tokenizer, said in one line on stderr.
    """
    path = model_folder(name_or_path)
    if path is None:
        config = preset_config(name_or_path, vocab_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
    else:
        model = _load_local(path, vocab_size, dtype, added_tokens, seed)
    return model.to(device=device, dtype=dtype)


def prepare(
    model: PreTrainedModel,
    attn: str = "auto",
    device: torch.device | str = "cpu",
    groups: ContextGroups | None = None,
) -> tuple[str, str]:
    """Make `model` train on packed rows exactly, or refuse it: prove packing leaves its logits
    unchanged and find the attention features it uses (`trainer.model.check`), pick the backend
    that reproduces them (`attn`: "auto" or a backend name) and install it, gathering keys over the
    context-parallel `groups` of a run that has them. Returns (backend, one line saying which and
    why). The model is left in train mode.
    """
    try:  # boundaries and position features per example
        positions.install(model, find_decoder(model))
    except UserError as exc:
        raise UserError(f"{type(model).__name__} cannot be trained on packed rows: {exc}") from None
    features = check_model(model)
    # no dtype: float32 weights are usually trained under bf16 autocast, where attention runs in bf16
    backend = attention.select_backend(attn, device, features=features)
    attention.install(model, backend, groups)
    model.train()
    return backend, attention.explain_choice(attn, backend, device, features=features)


def build_model(
    name_or_path: str,
    *,
    attn: str = "auto",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    vocab_size: int | None = None,
    seed: int = 0,
) -> tuple[PreTrainedModel, str]:
    """`load_model` then `prepare`: a causal LM in train mode that trains on packed rows exactly;
    returns (model, backend)."""
    device = torch.device(device)
    if attn != "auto":  # an impossible request fails before any model is loaded
        attention.select_backend(attn, device)
    model = load_model(name_or_path, device=device, dtype=dtype, vocab_size=vocab_size, seed=seed)
    backend, _ = prepare(model, attn, device)
    return model, backend


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's layers (what `--compile` compiles and FSDP2 shards one by one), or the whole
    decoder where it has no `layers`."""
    decoder = find_decoder(model)
    layers = getattr(decoder, "layers", None)
    return list(layers) if layers is not None else [decoder]


def allow_recompiles(graphs: int) -> None:
    """Room in dynamo's recompile limit (which counts the graphs of one compiled function) for
    `graphs` graphs and 8 more: past the limit dynamo runs the function uncompiled."""
    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, graphs + 8)


def compile_decoder_layers(model: torch.nn.Module) -> None:
    """`--compile`: each decoder layer as its own `torch.compile`d module, with dynamic shapes (every
    packed micro-batch has its own token count), so that one graph serves every row length.

    Two settings keep it at one graph per layer for a whole run, or two where rows get long:
    - dynamo's recompile limit makes room for two graphs per layer: a model with per-layer
      attention kinds (`config.layer_types`) compiles the attention call once per layer index, and
      inductor indexes with 32-bit integers while every tensor has fewer than 2**31 elements and
      guards on that, so the first row past it (an 8B's [T, 4096] at T = 524,288) compiles each
      layer again with 64-bit indexing. Past the limit dynamo would run the later layers eagerly.
    - inductor's mix-order reduction (the RMSNorm backward's two reductions fused into one
      kernel) is taken without its size checks (`mix_order_reduction_non_strict_mode`). Those
      checks compare the first micro-batch's token count with thresholds (2 x hidden size, 4096
      tokens) and guard on the answer: at the 8B shape (hidden 4096) a first row of 8,192
      tokens puts in the guard `8192 <= tokens`, and the first shorter row compiles the layer
      again. Under DDP or FSDP each rank meets that row at another step, and the others wait in
      their collectives for its compile. Without the checks the kernel is the same for every
      length and nothing is guarded. (A Triton setting: CPU runs compile no such kernel.)
    """
    import torch._inductor.config as inductor_config

    layers = decoder_layers(model)
    allow_recompiles(2 * len(layers))
    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):  # older torch: no such fusion
        inductor_config.triton.mix_order_reduction_non_strict_mode = True
    for layer in layers:
        layer.compile(dynamic=True)


def enable_grad_checkpointing(model: PreTrainedModel, every: int = 1, keep: KeptAttention | None = None) -> None:
    """Non-reentrant activation checkpointing of every `every`-th decoder layer: layers 0, every,
    2 x every, ... recompute their activations in the backward, the others keep them.

    every=1 checkpoints all layers (least memory). every=2 on 16 layers checkpoints layers 0, 2, ...,
    14: the other 8 keep their activations (more memory), and the backward recomputes half as many
    layer forwards. Which layers recompute changes memory and time, never the gradients.
    Per-layer choice needs decoder layers that checkpoint themselves (transformers'
    `GradientCheckpointingLayer`, which reads each layer's own `gradient_checkpointing`); a model
    whose decoder checkpoints its layers from its own loop gets a UserError for every > 1.
    With `keep` the recomputed layers keep their attention output (`trainer.model.keep_attention`).
    (transformers 5 renamed the enabling method; both spellings are supported.)
    """
    kwargs = checkpoint_kwargs(keep)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if every == 1:
        return
    layers = decoder_layers(model)
    if not all(getattr(layer, "gradient_checkpointing", False) is True for layer in layers):
        raise UserError(
            f"--grad-checkpointing {every}: this model's decoder layers do not checkpoint "
            "themselves, so it cannot checkpoint only some of them: use --grad-checkpointing "
            "(every layer)"
        )
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i % every == 0
