"""Cross-entropy for packed batches: token-loss sum + count, with the logits' memory bounded.

The decoder (`find_decoder`) runs once over the flat batch; only the positions that carry a loss
(targets != -100) are gathered, and the output head, the model's own logit post-processing
(`logit_transform`) and the cross-entropy run over them `chunk_tokens` at a time.
When the micro-batch's logits are small (loss tokens x vocab <= `KEEP_LOGITS_UP_TO`, e.g. 16,384
tokens of a 32,000-token vocabulary), they are one chunk kept for the backward pass, as an
unchunked loss would keep them. Larger ones are cut into chunks, each wrapped in activation
checkpointing, so neither the forward nor the backward keeps more than one chunk of logits alive:
peak extra memory is chunk_tokens x vocab fp32 instead of T x vocab, paid for by running each
chunk's head matmul again in the backward. `LossModule(model, compiled=True)` runs each chunk (head matmul, logit post-processing,
fp32 cast, cross-entropy) as one `torch.compile`d function, so the cast and the softmax fuse
instead of writing the fp32 logits out and reading them back several times.

The loss is a SUM plus a token count so the training loop can normalise across micro-batches and
ranks by the global number of loss tokens (the only normalisation under which packing changes
nothing compared with unpacked training).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pipeline.contract import IGNORE_INDEX, UserError
from trainer.attention import packed_row
from trainer.attention.features import segment_ids
from trainer.data.batch import MicroBatch


def find_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a causal LM: the module that turns input ids into the hidden states
    its output head reads. `get_decoder()` is tried first, but not trusted when it returns the
    model itself (Llama 4's CausalLM does); then the usual attribute names. `trainer.model.check`
    proves the choice: head(decoder(x)) must give the model's own logits."""
    getter = getattr(model, "get_decoder", None)
    candidates = [getter() if getter is not None else None]
    candidates += [getattr(model, name, None) for name in ("model", "transformer", "gpt_neox", "base_model")]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for candidate in candidates:
        # not the output head, which get_decoder() returns where it is named `decoder` (ModernBERT)
        if isinstance(candidate, torch.nn.Module) and candidate is not model and candidate is not head:
            return candidate
    raise UserError(f"{type(model).__name__} has no decoder (get_decoder() / .model / .transformer) to run")


# Logits of at most this many elements (loss tokens x vocabulary) are kept for the backward pass
# rather than recomputed there: 2**29 is 1 GiB in bf16 (what a compiled chunk keeps), 2 GiB in fp32.
KEEP_LOGITS_UP_TO = 2**29

LogitTransform = Callable[[torch.Tensor], torch.Tensor]
# Model types whose forward multiplies the logits by `config.logits_scaling` (Granite divides).
MULTIPLIES_LOGITS_SCALING = frozenset({"hyperclovax"})


def logit_transform(model: torch.nn.Module) -> LogitTransform | None:
    """What the model's forward does to its output head's result before the loss, or None.

    Known, from the config: Granite divides by `logits_scaling` (HyperCLOVA X, whose model types
    are in MULTIPLIES_LOGITS_SCALING, multiplies by it), Cohere multiplies by
    `logit_scale`, Falcon-H1 by `lm_head_multiplier`, Gemma 2/3/4 soft-cap with
    `final_logit_softcapping` (c * tanh(logits / c)). `trainer.model.check` compares the result
    with the model's own logits, so a post-processing not listed here is refused, not ignored.
    """
    config = model.config
    steps: list[LogitTransform] = []
    scaling = getattr(config, "logits_scaling", None)
    if scaling not in (None, 1, 1.0) and getattr(config, "model_type", None) in MULTIPLIES_LOGITS_SCALING:
        steps.append(lambda x, s=float(scaling): x * s)
    elif scaling not in (None, 1, 1.0):
        steps.append(lambda x, s=float(scaling): x / s)
    for attr in ("logit_scale", "lm_head_multiplier"):
        scale = getattr(config, attr, None)
        if scale not in (None, 1, 1.0):
            steps.append(lambda x, s=float(scale): x * s)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        steps.append(lambda x, c=float(cap): c * torch.tanh(x / c))
    if not steps:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        for step in steps:
            logits = step(logits)
        return logits

    return transform


def output_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits of hidden states [N, hidden] exactly as the model's forward makes them."""
    logits = model.get_output_embeddings()(hidden).float()
    transform = logit_transform(model)
    return logits if transform is None else transform(logits)


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the output head's weight: the number of logits per token."""
    return int(model.get_output_embeddings().weight.shape[0])


def hidden_states(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """Final decoder hidden states of the flat batch, [T, hidden]; a share of a row split over a
    context-parallel group hands its RowShard to the attention with the call (`packed_row.SHARD_KWARG`)."""
    shard = {} if batch.context is None else {packed_row.SHARD_KWARG: batch.context}
    out = find_decoder(model)(**batch.model_kwargs(), use_cache=False, **shard)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden.reshape(-1, hidden.shape[-1])


def loss_positions(batch: MicroBatch) -> torch.Tensor:
    """Flat indices of the tokens that carry a loss, without a device sync where possible
    (the count is known on the host: batch.n_loss_tokens)."""
    mask = batch.targets.reshape(-1) != IGNORE_INDEX
    if hasattr(torch, "nonzero_static"):
        try:
            return torch.nonzero_static(mask, size=batch.n_loss_tokens).reshape(-1)
        except (RuntimeError, NotImplementedError):
            pass
    return torch.nonzero(mask).reshape(-1)


def _chunk_token_losses(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output_logits(model, hidden), targets, reduction="none")


ChunkLosses = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def token_losses(
    model: torch.nn.Module,
    batch: MicroBatch,
    chunk_tokens: int = 4096,
    chunk_losses: ChunkLosses = _chunk_token_losses,
    keep_logits_up_to: int = KEEP_LOGITS_UP_TO,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 cross-entropy of every loss token [n_loss], their flat positions [n_loss]);
    `chunk_losses(model, hidden, targets)` computes one chunk's (a compiled one in training).

    With gradients on and at most `keep_logits_up_to` logits, all loss tokens are one chunk whose
    logits the backward reuses; otherwise chunks of `chunk_tokens`, each recomputed in the
    backward (see the module)."""
    if chunk_tokens < 1:
        raise UserError(f"chunk_tokens must be positive, got {chunk_tokens}")
    hidden = hidden_states(model, batch)
    positions = loss_positions(batch)
    targets = batch.targets.reshape(-1).index_select(0, positions)
    selected = hidden.index_select(0, positions)
    recompute = torch.is_grad_enabled() and selected.requires_grad
    if recompute and batch.n_loss_tokens * vocab_size(model) <= keep_logits_up_to:
        recompute, chunk_tokens = False, max(batch.n_loss_tokens, 1)
    pieces = []
    for start in range(0, batch.n_loss_tokens, chunk_tokens):
        h = selected[start : start + chunk_tokens]
        t = targets[start : start + chunk_tokens]
        if recompute:
            pieces.append(checkpoint(chunk_losses, model, h, t, use_reentrant=False))
        else:
            pieces.append(chunk_losses(model, h, t))
    if not pieces:
        # No loss token at all: the output layer still runs, on zero tokens, so that every
        # parameter gets a (zero) gradient. DDP and FSDP2 reduce gradients parameter by parameter
        # on every rank; a rank whose lm_head had no gradient would skip its share of a collective
        # and the ranks would deadlock or mismatch.
        return _chunk_token_losses(model, selected, targets), positions
    return torch.cat(pieces), positions


def packed_loss(
    model: torch.nn.Module,
    batch: MicroBatch,
    chunk_tokens: int = 4096,
    chunk_losses: ChunkLosses = _chunk_token_losses,
    keep_logits_up_to: int = KEEP_LOGITS_UP_TO,
) -> tuple[torch.Tensor, int]:
    """(sum of token cross-entropies as a 0-d fp32 tensor, number of loss tokens).

    Divide the sum by the global loss-token count of the optimizer step (not per micro-batch) to
    get the mean token loss.
    """
    losses, _ = token_losses(model, batch, chunk_tokens, chunk_losses, keep_logits_up_to)
    return losses.sum(), batch.n_loss_tokens


def compiled_chunk_losses(backend: str | Callable = "inductor") -> ChunkLosses:
    """The per-chunk loss under torch.compile (dynamic shapes: the last chunk is shorter).

    Each chunk is copied before the compiled call. A chunk is a view into the gathered hidden
    states, and torch.compile guards on a view's storage offset (0 or not) and on whether it spans
    its whole base, so views would compile again for each new arrangement: one chunk or several,
    first or later. A run whose micro-batches vary in size meets such arrangements late and then
    stalls for a recompile. A fresh tensor of any length runs the one graph.
    """
    compiled = torch.compile(_chunk_token_losses, dynamic=True, backend=backend)

    def chunk_losses(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return compiled(model, hidden.clone(), targets.clone())

    return chunk_losses


class LossModule(torch.nn.Module):
    """The causal LM with `packed_loss` as its forward (the sum of the micro-batch's token losses),
    so that DDP and FSDP wrap the whole loss computation. `compiled`: each loss chunk runs as one
    compiled function (`compiled_chunk_losses`)."""

    def __init__(self, model: torch.nn.Module, compiled: bool = False) -> None:
        super().__init__()
        self.model = model
        self.chunk_losses = compiled_chunk_losses() if compiled else _chunk_token_losses

    def forward(self, batch: MicroBatch) -> torch.Tensor:
        loss_sum, _ = packed_loss(self.model, batch, chunk_losses=self.chunk_losses)
        return loss_sum


def per_example_losses(model: torch.nn.Module, batch: MicroBatch, chunk_tokens: int = 4096) -> torch.Tensor:
    """Mean token loss of each example of the batch, fp32 [n_examples] (NaN for an example that
    has no loss token). Differentiable; meant for tests and evaluation."""
    losses, positions = token_losses(model, batch, chunk_tokens)
    cu = batch.cu_seqlens.to(positions.device)
    example = segment_ids(cu, batch.n_tokens).index_select(0, positions).long()
    sums = torch.zeros(batch.n_examples, dtype=torch.float32, device=losses.device)
    sums = sums.index_add(0, example, losses)
    counts = torch.bincount(example, minlength=batch.n_examples).to(torch.float32)
    return sums / counts
