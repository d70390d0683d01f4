"""No cross-contamination: a packed row gives every example exactly the loss and the gradients it
gets when run alone through the stock Hugging Face model (eager attention, its own causal mask).
The same comparison against deliberately wrong packing must fail, so the test has teeth. And the
chunked loss equals the naive full-logits cross-entropy."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer.data.batch import MicroBatch, collate_flat
from trainer.model.load import build_model
from trainer.model.loss import packed_loss, per_example_losses, token_losses

LENGTHS = [9, 4, 14, 2, 7]
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def models():
    """The packed model (sdpa reference backend) and an independent stock-HF eager copy."""
    torch.manual_seed(0)
    model, backend = build_model("tiny", attn="sdpa", dtype=torch.float32, seed=11)
    assert backend == "sdpa"
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    return model, reference


@pytest.fixture(scope="module")
def examples():
    rng = np.random.default_rng(5)
    out = []
    for n in LENGTHS:
        ids = rng.integers(3, 4096, n)
        labels = ids.copy()
        labels[0] = -100
        if n > 5:
            labels[1:3] = -100  # a masked prompt, as in instruction data
        out.append((ids, labels))
    return out


def pack(examples, *, restart_positions: bool = True) -> MicroBatch:
    ids = np.concatenate([e[0] for e in examples])
    labels = np.concatenate([e[1] for e in examples])
    if restart_positions:
        positions = np.concatenate([np.arange(len(e[0])) for e in examples])
    else:
        positions = np.arange(len(ids))
    return collate_flat(ids, labels, positions, np.asarray([len(e[0]) for e in examples]))


def as_one_example(batch: MicroBatch) -> MicroBatch:
    """The WRONG packing: one causal example spanning the whole row."""
    whole = torch.tensor([0, batch.n_tokens], dtype=torch.int32)
    return dataclasses.replace(batch, cu_seqlens=whole, max_seqlen=batch.n_tokens, n_examples=1)


def alone_loss_sum(reference, ids, labels) -> torch.Tensor:
    """Stock HF forward on one unpacked example; sum of shifted token cross-entropies."""
    logits = reference(input_ids=torch.from_numpy(ids)[None]).logits[0]
    return F.cross_entropy(logits[:-1].float(), torch.from_numpy(labels[1:]), ignore_index=-100, reduction="sum")


def n_loss(labels) -> int:
    return int((labels[1:] != -100).sum())


def params_grad(model, loss) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)


def per_example_packed(model, batch, examples):
    means = per_example_losses(model, batch)
    counts = torch.tensor([n_loss(e[1]) for e in examples], dtype=torch.float32)
    return means, means * counts


def test_packed_losses_and_gradients_equal_each_example_alone(models, examples):
    model, reference = models
    batch = pack(examples)
    means, sums = per_example_packed(model, batch, examples)
    for i, (ids, labels) in enumerate(examples):
        alone = alone_loss_sum(reference, ids, labels)
        torch.testing.assert_close(sums[i], alone, **TOL)
        torch.testing.assert_close(means[i], alone / n_loss(labels), **TOL)
        packed_grads = params_grad(model, sums[i])
        alone_grads = params_grad(reference, alone)
        for (name, _), g_packed, g_alone in zip(model.named_parameters(), packed_grads, alone_grads):
            g_packed = torch.zeros_like(g_alone) if g_packed is None else g_packed
            torch.testing.assert_close(g_packed, g_alone, **TOL, msg=lambda m: f"example {i}, {name}: {m}")


def true_example_sums(model, batch) -> torch.Tensor:
    """Per-example loss sums, split by the TRUE example lengths whatever cu_seqlens says."""
    losses, positions = token_losses(model, batch)
    seg = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    return torch.zeros(len(LENGTHS)).index_add(0, seg[positions], losses)


def alone_sums(reference, examples) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([alone_loss_sum(reference, ids, labels) for ids, labels in examples])


def test_plain_causal_mask_over_the_row_is_caught(models, examples):
    """Attending over the whole packed row (one causal example) contaminates later examples."""
    model, reference = models
    alone = alone_sums(reference, examples)
    with torch.no_grad():
        right = true_example_sums(model, pack(examples))
        wrong = true_example_sums(model, as_one_example(pack(examples)))
    torch.testing.assert_close(right, alone, **TOL)
    assert float((wrong - alone).abs().max()) > 1e-2
    torch.testing.assert_close(wrong[0], alone[0], **TOL)  # only the first example is still right
    # gradients are contaminated too: example 2 (third in the row) sees examples 0 and 1
    g_wrong = params_grad(model, true_example_sums(model, as_one_example(pack(examples)))[2])
    g_alone = params_grad(reference, alone_loss_sum(reference, *examples[2]))
    assert max(float((a - b).abs().max()) for a, b in zip(g_wrong, g_alone)) > 1e-1


def test_hf_mask_from_non_restarting_positions_is_caught(models, examples):
    """Stock HF sdpa infers packing from position_ids: positions that do not restart make it a
    plain causal mask over the row, and the comparison must fail."""
    model, reference = models
    stock = copy.deepcopy(reference)
    stock.set_attn_implementation("sdpa")
    batch = pack(examples, restart_positions=False)
    with torch.no_grad():
        logits = stock(input_ids=batch.input_ids, position_ids=batch.position_ids).logits[0]
        token = F.cross_entropy(logits, batch.targets[0], ignore_index=-100, reduction="none")
    alone = alone_sums(reference, examples)
    seg = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    sums = torch.zeros(len(LENGTHS)).index_add(0, seg, token)
    assert float((sums - alone).abs().max()) > 1e-2
    # ... while with restarting positions stock HF sdpa agrees (its own packing detection)
    good = pack(examples)
    with torch.no_grad():
        logits = stock(input_ids=good.input_ids, position_ids=good.position_ids).logits[0]
        token = F.cross_entropy(logits, good.targets[0], ignore_index=-100, reduction="none")
    torch.testing.assert_close(torch.zeros(len(LENGTHS)).index_add(0, seg, token), alone, **TOL)


def test_with_cu_seqlens_rope_makes_positions_irrelevant(models, examples):
    """With explicit boundaries, non-restarting position_ids change nothing beyond rounding: RoPE
    scores depend only on position differences. Boundaries, not positions, stop contamination."""
    model, reference = models
    with torch.no_grad():
        shifted = true_example_sums(model, pack(examples, restart_positions=False))
    assert float((shifted - alone_sums(reference, examples)).abs().max()) < 1e-3


@pytest.mark.parametrize("chunk_tokens", [4096, 7, 1])
def test_packed_loss_equals_naive_full_logits_cross_entropy(models, examples, chunk_tokens):
    model, _ = models
    batch = pack(examples)
    total, count = packed_loss(model, batch, chunk_tokens=chunk_tokens, keep_logits_up_to=0)
    assert total.dim() == 0 and total.dtype == torch.float32
    assert count == batch.n_loss_tokens == sum(n_loss(labels) for _, labels in examples)
    logits = model(**batch.model_kwargs()).logits[0]
    naive = F.cross_entropy(logits.float(), batch.targets[0], ignore_index=-100, reduction="sum")
    torch.testing.assert_close(total, naive, **TOL)
    for g_chunked, g_naive in zip(params_grad(model, total), params_grad(model, naive)):
        torch.testing.assert_close(g_chunked, g_naive, **TOL)


def test_small_logits_are_kept_for_the_backward_instead_of_recomputed(models, examples):
    """Below KEEP_LOGITS_UP_TO the loss is one chunk computed once, forward only; its sum and
    gradients equal the recomputed chunks'. Control: chunked, every chunk runs again in the backward."""
    from trainer.model.loss import KEEP_LOGITS_UP_TO, _chunk_token_losses, vocab_size

    model, _ = models
    batch = pack(examples)
    assert batch.n_loss_tokens * vocab_size(model) <= KEEP_LOGITS_UP_TO
    calls: list[int] = []

    def counted(model, hidden, targets):  # noqa: ANN001, ANN202
        calls.append(len(targets))
        return _chunk_token_losses(model, hidden, targets)

    kept, _ = packed_loss(model, batch, chunk_tokens=7, chunk_losses=counted)
    kept_grads = params_grad(model, kept)
    assert calls == [batch.n_loss_tokens]
    calls.clear()
    chunked, _ = packed_loss(model, batch, chunk_tokens=7, chunk_losses=counted, keep_logits_up_to=0)
    chunked_grads = params_grad(model, chunked)
    chunks = -(-batch.n_loss_tokens // 7)
    assert len(calls) == 2 * chunks and sum(calls) == 2 * batch.n_loss_tokens
    torch.testing.assert_close(kept, chunked, **TOL)
    for a, b in zip(kept_grads, chunked_grads):
        torch.testing.assert_close(a, b, **TOL)


def test_packed_loss_without_loss_tokens_is_zero_and_differentiable(models):
    model, _ = models
    ids = np.array([5, 6, 7])
    batch = collate_flat(ids, np.full(3, -100), np.arange(3), np.array([3]))
    total, count = packed_loss(model, batch)
    assert count == 0 and float(total.detach()) == 0.0
    total.backward()  # must not raise
    model.zero_grad(set_to_none=True)


def test_packed_loss_with_hf_gradient_checkpointing(examples):
    """The trainer may turn on HF activation checkpointing: the cu_seq_lens kwargs must survive it."""
    model, _ = build_model("tiny", attn="sdpa", seed=11)
    batch = pack(examples)
    total, _ = packed_loss(model, batch)
    plain = params_grad(model, total)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    total_ckpt, _ = packed_loss(model, batch)
    torch.testing.assert_close(total_ckpt, total, atol=0, rtol=0)
    for a, b in zip(params_grad(model, total_ckpt), plain):
        torch.testing.assert_close(a, b, **TOL)


def test_compiled_chunk_loss_equals_the_eager_one(models, examples):
    """pack-train compiles each loss chunk (head matmul + fp32 cast + cross-entropy) on CUDA; the
    compiled function must give the same sum and gradients, for full and ragged chunks (dynamic
    shapes: chunks of 7 and the shorter last one). Control: dynamo really compiled a graph."""
    from trainer.model.loss import LossModule, compiled_chunk_losses

    model, _ = models
    batch = pack(examples)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = compiled_chunk_losses()
    total_c, _ = packed_loss(model, batch, chunk_tokens=7, chunk_losses=compiled, keep_logits_up_to=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    total, _ = packed_loss(model, batch, chunk_tokens=7, keep_logits_up_to=0)
    torch.testing.assert_close(total_c, total, **TOL)
    params = [p for p in model.parameters() if p.requires_grad]
    # no retain_graph: a compiled backward donates its buffers
    for g_c, g in zip(torch.autograd.grad(total_c, params, allow_unused=True), params_grad(model, total)):
        torch.testing.assert_close(g_c, g, **TOL)
    assert LossModule(model, compiled=False).chunk_losses is not compiled
    torch._dynamo.reset()


def test_compiled_chunk_loss_compiles_once_whatever_the_chunking(models, examples):
    """Micro-batches of varying size cut their loss tokens into one chunk or several; the compiled
    chunk loss must not compile again for each new arrangement (a stall in the middle of a run).
    Control: the same compiled function given the chunks as views compiles more than once."""
    import torch._dynamo

    from trainer.model.loss import _chunk_token_losses, compiled_chunk_losses

    model, _ = models
    batch = pack(examples)
    n = batch.n_loss_tokens
    # one chunk, exactly one, several, ragged; none leaves a 1-token chunk (dynamo specialises
    # sizes 0 and 1, so such a chunk compiles once more, once per run)
    chunkings = [c for c in (n + 5, n, n // 3, n // 2 + 1, n // 2 - 3) if n % c != 1]
    assert len(chunkings) >= 4

    def graphs(chunk_losses_of) -> int:
        compiles = []

        def backend(gm, example_inputs):  # noqa: ANN001, ANN202
            compiles.append(1)
            return gm.forward

        torch._dynamo.reset()
        chunk_losses = chunk_losses_of(backend)
        for chunk in chunkings:
            total, _ = packed_loss(model, batch, chunk_tokens=chunk, chunk_losses=chunk_losses, keep_logits_up_to=0)
            total.backward()
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        return len(compiles)

    assert graphs(compiled_chunk_losses) == 1
    assert graphs(lambda b: torch.compile(_chunk_token_losses, dynamic=True, backend=b)) > 1
