"""Before training, prove on a small batch that packing does not change what the model computes.

`check_model(model)` runs three random examples (`probe_lengths`) packed into one row through the
trainer's own path (`trainer.model.loss`: the decoder it finds, the packed attention glue with the sdpa
reference kernel, the output head and the logit post-processing it knows) and each example alone
through the stock model with transformers' eager attention, in float32, and compares every
logit. It returns the attention features the model's layers use (`trainer.attention.features.Features`
names), so that `trainer.attention.backend.select_backend` can pick a backend that reproduces them.

The probe is 7 + 12 + 9 tokens, unless the model has position features that change past a length
(`trainer.attention.positions.thresholds`: dynamic NTK RoPE past `max_position_embeddings`, longrope past
`original_max_position_embeddings`, Llama 4's attention temperature past `floor_scale`): then its
middle example is longer than that length, so the probe has an example past it and a short one
that starts past it in the row; a probe that would exceed PROBE_MAX_TOKENS is refused instead.

What it catches, each as one UserError line naming the model:
- layers that never get the example boundaries (the attention glue refuses them);
- sequence state shared across a row outside attention: convolutions, SSM or linear-attention
  layers (LFM2, Granite hybrids, Qwen3-Next), and position features computed from the row, found
  as a difference in the packed examples' logits;
- a head whose logits the loss would compute differently (an unknown logit scale, a prediction
  head before the output Linear), found as a difference on the first example run through the
  trainer's path alone in a row;
- anything the packed glue refuses (attention dropout, a dense mask) and any error the model
  raises on a packed batch.
Attention features that only matter on examples longer than the probe's (a 4096-token window,
say) are not exercised here; they are read per layer and the backends are proven on them by the
tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from pipeline.contract import UserError
from trainer.attention import backend as attention
from trainer.attention import positions
from trainer.data.batch import collate_flat
from trainer.data.row_split import shard_microbatch
from trainer.distributed.context_parallel import Layout
from trainer.model.loss import hidden_states, output_logits

PROBE_LENGTHS = (7, 12, 9)
# The longest probe row built to pass a position threshold (`probe_lengths`); the default tokens
# per step, so a model trained with it has its rows checked past every threshold they reach.
PROBE_MAX_TOKENS = 16384
THRESHOLD_FIXES = {
    "dynamic NTK RoPE (rope_type 'dynamic')": "use a static RoPE scaling (rope_type 'linear' or 'yarn')",
    "longrope RoPE": "use a static RoPE scaling (rope_type 'linear' or 'yarn')",
    "attention temperature tuning (attn_temperature_tuning)": "train a model without it",
}
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


def probe_lengths(model: torch.nn.Module) -> tuple[int, ...]:
    """PROBE_LENGTHS, or where the model has position features that change past a length
    (`trainer.attention.positions.thresholds`), a short example, one longer than the largest such length and
    a short one that starts past it in the row. Raises UserError when that row would be longer
    than PROBE_MAX_TOKENS."""
    found = positions.thresholds(model)
    if not found:
        return PROBE_LENGTHS
    feature, threshold = max(found.items(), key=lambda item: item[1])
    lengths = (PROBE_LENGTHS[0], threshold + 2, PROBE_LENGTHS[2])
    if sum(lengths) > PROBE_MAX_TOKENS:
        raise UserError(
            f"its {feature} changes past {threshold} tokens, and proving that per packed example "
            f"would take a {sum(lengths)}-token probe row (the check's limit is {PROBE_MAX_TOKENS}): "
            f"refused unchecked; {THRESHOLD_FIXES.get(feature, 'use a model without it')}"
        )
    return lengths


def _probe_examples(vocab: int, device: torch.device, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=generator).to(device) for n in lengths]


def _mixers(model: torch.nn.Module) -> list[str]:
    """The model's own layer classes whose names say they mix tokens outside attention."""
    names = {type(m).__name__ for m in model.modules() if not type(m).__module__.startswith("torch.")}
    return sorted(n for n in names if any(word in n for word in SEQUENCE_MIXERS))


def check_model(model: torch.nn.Module) -> set[str]:
    """Prove that packed rows give `model` each example's own logits; returns the names of the
    attention features its layers use. Raises UserError (one line) when they do not."""
    name = type(model).__name__
    device = next(model.parameters()).device
    try:
        probe = probe_lengths(model)
    except UserError as exc:
        raise UserError(f"{name} cannot be trained on packed rows: {exc}") from None
    examples = _probe_examples(model.get_input_embeddings().num_embeddings, device, probe)
    ids = torch.cat(examples).cpu().numpy()
    lengths = np.array(probe)
    batch = collate_flat(ids, ids, np.concatenate([np.arange(n) for n in lengths]), lengths).to(device)
    head_ids = ids[: probe[0]]  # the first example in a row of its own: the trainer's head, no packing
    head_batch = collate_flat(head_ids, head_ids, np.arange(probe[0]), lengths[:1]).to(device)
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
            head = output_logits(model, hidden_states(model, head_batch))
            attention.set_implementation(model, "eager")
            alone = torch.cat([model(input_ids=x[None], use_cache=False).logits[0] for x in examples])
    except UserError as exc:
        raise UserError(f"{name} cannot be trained on packed rows: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - whatever the model raises, the user gets one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{name} cannot be trained on packed rows: a packed forward pass failed ({type(exc).__name__}: {first})") from None
    tolerance = TOLERANCE.get(next(model.parameters()).dtype, TOLERANCE_16BIT)
    _compare(name, packed, head, alone.float(), _mixers(model), tolerance)
    return seen


def _compare(name: str, packed: torch.Tensor, head: torch.Tensor, alone: torch.Tensor, mixers: list[str], tolerance: float) -> None:
    """`head`: the first example's logits from the trainer's decoder + head on a row of its own."""
    scale = max(1.0, float(alone.abs().max()))
    head_error = float((head - alone[: len(head)]).abs().max()) / scale
    if head_error > tolerance:
        raise UserError(
            f"{name} cannot be trained on packed rows: its logits differ from the trainer's "
            f"decoder + output head by {head_error:.1e} (relative) even on an example alone in a row; "
            "it post-processes its hidden states or logits in a way the chunked loss does not know"
        )
    leak = float((packed - alone).abs().max()) / scale
    if leak > tolerance:
        why = (
            f"its {', '.join(mixers)} layers carry state from one example to the next"
            if mixers
            else "something in the model carries state from one example to the next"
        )
        raise UserError(
            f"{name} cannot be trained on packed rows: a packed example's logits differ from the "
            f"example run alone by {leak:.1e} (relative); {why}"
        )


def check_context_parallel(model: torch.nn.Module, layout: Layout) -> None:
    """Prove that a share of a row split over the ranks of this rank's context-parallel group
    (`layout`: its place and its groups, `trainer.distributed.context_parallel`) gives the hidden
    states the whole row gives, on the probe row and one example of 32 tokens per rank, which spans
    several shares; collective over the group (every rank raises, or none). A model that mixes
    tokens outside attention, within an example, is refused here in one line."""
    name, rank, n_ranks, groups = type(model).__name__, layout.cp_rank, layout.cp_size, layout.groups
    assert groups is not None, "check_context_parallel needs the layout of a context-parallel run"
    device = next(model.parameters()).device
    lengths = np.array(probe_lengths(model) + (32 * n_ranks,))
    ids = torch.cat(_probe_examples(model.get_input_embeddings().num_embeddings, device, tuple(lengths)))
    ids = ids.cpu().numpy()
    row = collate_flat(ids, ids, np.concatenate([np.arange(n) for n in lengths]), lengths)
    share = shard_microbatch(row, rank, n_ranks)
    attention.register("sdpa", PROBE_NAME, groups=groups)
    error = torch.tensor(float("inf"), device=device)
    failure = ""
    try:
        with _exact_float32(model):
            attention.set_implementation(model, PROBE_NAME)
            model.eval()  # a router that samples in training (PhiMoE) would pick other experts each call
            whole = hidden_states(model, row.to(device))
            part = hidden_states(model, share.to(device))
            index = torch.from_numpy(share.context.tokens).to(device)
            scale = max(1.0, float(whole.abs().max()))
            error = ((part - whole.index_select(0, index)).abs().max() / scale).float().reshape(())
    except Exception as exc:  # noqa: BLE001 - every rank must reach the reduction below
        failure = f" ({type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]})"
    groups.reduce_max(error)
    tolerance = TOLERANCE.get(next(model.parameters()).dtype, TOLERANCE_16BIT)
    if not float(error) <= tolerance:
        found = failure or f": a share's hidden states differ from the whole row's by {float(error):.1e} (relative)"
        raise UserError(
            f"{name} cannot be trained with --context-parallel{found}; it mixes tokens outside "
            "attention (or fails on a share of a row): train it without --context-parallel"
        )
