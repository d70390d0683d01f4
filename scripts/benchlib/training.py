"""The pieces the training benchmarks share: devices, the Hugging Face baseline model, AdamW,
autocast, right-padded batches, a held-out loss over them, FLOP rates. torch, numpy and the product
are imported by the functions that use them."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch


def resolve_device(name: str) -> torch.device:
    """`cuda` -> `cuda:<current>` (torch.cuda.set_device, which pack-train calls, needs an index)."""
    import torch

    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing on CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_config(preset: str, vocab_size: int | None) -> Any:
    """The transformers config of a packlm preset (or a local model folder)."""
    from trainer.model.load import PRESETS, preset_config

    if preset in PRESETS:
        return preset_config(preset, vocab_size)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(preset, local_files_only=True)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    return config


def build_hf_model(preset: str, attn: str, device: torch.device, vocab_size: int | None, seed: int) -> torch.nn.Module:
    """A plain HF causal LM with a stock attention implementation, fp32 weights, seeded init."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(preset, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # drawn on the CPU like build_model: the same initial weights
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.to(device).train()


def make_optimizer(
    model: torch.nn.Module, lr: float, device: torch.device, optimizer: str = "adamw", master_weights: bool = False
) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA, or torch's Adafactor (the same settings for every path).
    `master_weights`: AdamW as pack-train's --dtype bf16-weights runs it (`trainer.model.precision.MasterAdamW`,
    which turns the model's weights into bf16 and keeps their fp32 masters)."""
    import torch

    if master_weights:
        from trainer.model.precision import MasterAdamW

        return MasterAdamW([{"params": list(model.parameters()), "weight_decay": 0.1}], lr=lr, betas=(0.9, 0.95))
    if optimizer == "adafactor":
        trained = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.Adafactor(trained, lr=lr, weight_decay=0.1, foreach=True)
    kwargs: dict[str, Any] = {"lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if device.type == "cuda":
        kwargs["fused"] = True
    return torch.optim.AdamW(model.parameters(), **kwargs)


def optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """Backward, gradient norm clipped at 1 (the HF Trainer's default, pack-train's --grad-clip 1),
    AdamW step, gradients dropped. A `MasterAdamW` clips its fp32 masters inside its step, as in
    pack-train."""
    import torch

    from trainer.model.precision import MasterAdamW

    loss.backward()
    if isinstance(opt, MasterAdamW):
        opt.clip_grad_norm_(1.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def autocast_ctx(device: torch.device, dtype: str) -> Any:
    """bf16 autocast (weights stay fp32) or nothing."""
    import torch

    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def pad_collate(examples: Sequence[dict[str, np.ndarray]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad examples to the longest: input_ids (pad_id), attention_mask, labels (-100)."""
    import numpy as np
    import torch

    from pipeline.shards import IGNORE_INDEX

    lens = [len(e["input_ids"]) for e in examples]
    longest = max(lens)
    input_ids = np.full((len(examples), longest), pad_id, dtype=np.int64)
    labels = np.full((len(examples), longest), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((len(examples), longest), dtype=np.int64)
    for i, (e, n) in enumerate(zip(examples, lens)):
        input_ids[i, :n] = e["input_ids"]
        labels[i, :n] = e["labels"]
        mask[i, :n] = 1
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(mask),
        "labels": torch.from_numpy(labels),
    }


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A batch's tensors on `device` (pinned, non-blocking copies to CUDA); other values (a
    flattening collator's `max_length_q`) as they are."""
    import torch

    def move(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        return v.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else v.to(device)

    return {k: move(v) for k, v in batch.items()}


def heldout_loss(
    model: torch.nn.Module, examples: Sequence[dict[str, np.ndarray]], pad_id: int, device: torch.device, dtype: str, batch_size: int = 32
) -> float:
    """Mean token loss over all the examples' loss tokens, without gradients: right-padded batches,
    `sdpa` attention, the same code for every model (a packlm model is switched to sdpa first)."""
    import torch

    from pipeline.shards import IGNORE_INDEX

    try:
        model.set_attn_implementation("sdpa")
    except (AttributeError, ValueError, KeyError, ImportError):  # older transformers
        model.config._attn_implementation = "sdpa"
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = to_device(pad_collate(examples[start : start + batch_size], pad_id), device)
            labels = batch.pop("labels")
            with autocast_ctx(device, dtype):
                logits = model(**batch).logits
            targets = labels[:, 1:]
            ce = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            total += float(ce)
            count += int((targets != IGNORE_INDEX).sum())
    model.train()
    return total / max(count, 1)


def flop_rates(model: float, attention: float, seconds: float, peak_tflops: float = 989.0) -> dict[str, float]:
    """Model TFLOP/s a device from FLOPs counted by `pipeline.report.flops` (dense and causal
    attention from the examples' lengths) over `seconds` of one device (a run on N devices: N x its
    wall time), its MFU against `peak_tflops` (an H100/H200's bf16 dense peak by default), and
    attention's share of the FLOPs.

    >>> flop_rates(989e12, 98.9e12, 2.0)
    {'tflops': 494.5, 'mfu': 0.5, 'attn_flop_share': 0.1}
    """
    tflops = model / seconds / 1e12 if seconds > 0 else 0.0
    return {"tflops": tflops, "mfu": tflops / peak_tflops, "attn_flop_share": attention / model if model else 0.0}
