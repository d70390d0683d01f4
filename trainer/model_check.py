"""Before training, prove on a small batch that packing does not change what the model computes.

`check_model(model)` runs three short random examples (PROBE_LENGTHS) packed into one row through
the trainer's own path (`trainer.loss`: the decoder it finds, the packed attention glue with the
sdpa reference kernel, the output head and the logit post-processing it knows) and each example
alone through the stock model with transformers' eager attention, in float32, and compares every
logit. It returns the attention features the model's layers use (`trainer.kernels.Features`
names), so that `trainer.attention.select_backend` can pick a backend that reproduces them.

What it catches, each as one UserError line naming the model:
- layers that do not pass the example boundaries on to attention (StableLM);
- sequence state shared across a row outside attention: convolutions, SSM or linear-attention
  layers (LFM2, Granite hybrids, Qwen3-Next), found as a difference in the later examples' logits;
- a head whose logits the loss would compute differently (an unknown logit scale), found as a
  difference in the first example's logits;
- anything the packed glue refuses (attention dropout, a dense mask) and any error the model
  raises on a packed batch.
Features that only matter on examples longer than the probe's (a 4096-token window, say) are
not exercised here; they are read per layer and the backends are proven on them by the tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from pipeline.errors import UserError
from trainer import attention
from trainer.batch import collate_flat
from trainer.loss import hidden_states, output_logits

PROBE_LENGTHS = (7, 12, 9)
# max |packed - alone| / max(1, max |alone|): float32 rounding, or 16-bit weights' rounding
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}
TOLERANCE_16BIT = 3e-2
PROBE_NAME = "packlm_probe"
# Layer classes that mix tokens outside attention; named in the refusal when the logits differ.
SEQUENCE_MIXERS = ("Mamba", "Conv", "GatedDeltaNet", "LinearAttention", "Ssm", "SSM", "Rwkv")


@contextlib.contextmanager
def _exact_float32(model: torch.nn.Module) -> Iterator[None]:
    """No gradients, float32 matmuls without TF32, eval mode; the model's mode and attention
    implementation are restored afterwards."""
    training = model.training
    implementation = getattr(model.config, "_attn_implementation", None)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_float32_matmul_precision(precision)
        model.train(training)
        if implementation is not None:
            attention.set_implementation(model, implementation)


def _probe_examples(vocab: int, device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=generator).to(device) for n in PROBE_LENGTHS]


def _mixers(model: torch.nn.Module) -> list[str]:
    """The model's own layer classes whose names say they mix tokens outside attention."""
    names = {type(m).__name__ for m in model.modules() if not type(m).__module__.startswith("torch.")}
    return sorted(n for n in names if any(word in n for word in SEQUENCE_MIXERS))


def check_model(model: torch.nn.Module) -> set[str]:
    """Prove that packed rows give `model` each example's own logits; returns the names of the
    attention features its layers use. Raises UserError (one line) when they do not."""
    name = type(model).__name__
    device = next(model.parameters()).device
    examples = _probe_examples(model.get_input_embeddings().num_embeddings, device)
    ids = torch.cat(examples).cpu().numpy()
    lengths = np.array(PROBE_LENGTHS)
    batch = collate_flat(ids, ids, np.concatenate([np.arange(n) for n in lengths]), lengths).to(device)
    seen: set[str] = set()
    attention.register("sdpa", PROBE_NAME, observe=lambda module, features: seen.update(features.used()))
    try:
        with _exact_float32(model):
            attention.set_implementation(model, PROBE_NAME)
            model.train()  # as in training: dropout and other training-only paths reach the glue
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                hidden_states(model, batch)
            model.eval()
            packed = output_logits(model, hidden_states(model, batch))
            attention.set_implementation(model, "eager")
            alone = torch.cat([model(input_ids=x[None], use_cache=False).logits[0] for x in examples])
    except UserError as exc:
        raise UserError(f"{name} cannot be trained on packed rows: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - whatever the model raises, the user gets one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{name} cannot be trained on packed rows: a packed forward pass failed "
                        f"({type(exc).__name__}: {first})") from None
    tolerance = TOLERANCE.get(next(model.parameters()).dtype, TOLERANCE_16BIT)
    _compare(name, packed, alone.float(), _mixers(model), tolerance)
    return seen


def _compare(
    name: str, packed: torch.Tensor, alone: torch.Tensor, mixers: list[str], tolerance: float
) -> None:
    scale = max(1.0, float(alone.abs().max()))
    first = PROBE_LENGTHS[0]
    head_error = float((packed[:first] - alone[:first]).abs().max()) / scale
    if head_error > tolerance:
        raise UserError(
            f"{name} cannot be trained on packed rows: its logits differ from the trainer's "
            f"decoder + output head by {head_error:.1e} (relative) even on a row's first example; "
            "it post-processes its hidden states or logits in a way the chunked loss does not know"
        )
    leak = float((packed[first:] - alone[first:]).abs().max()) / scale
    if leak > tolerance:
        why = (f"its {', '.join(mixers)} layers carry state from one example to the next"
               if mixers else "something in the model carries state from one example to the next")
        raise UserError(
            f"{name} cannot be trained on packed rows: a packed example's logits differ from the "
            f"example run alone by {leak:.1e} (relative); {why}"
        )
