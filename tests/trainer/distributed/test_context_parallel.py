"""Context parallelism (`trainer.data.row_split`, `trainer.distributed.context_parallel`,
`trainer.attention.gathered`): the split of a row over ranks, the pieces each rank attends, and, on
2 and 4 gloo ranks, every example's loss and gradients against the single-process packed row
(float32, 1e-5 relative), with a negative control that must fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gloo_ranks import run_on_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from run_metrics import logged_losses

from pipeline.errors import UserError
from trainer.attention.features import Features
from trainer.attention.kernels import varlen_attention
from trainer.data import row_split as rs
from trainer.data.batch import collate_flat
from trainer.distributed import context_parallel as cp

lengths_st = st.lists(st.integers(1, 400), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, n=st.sampled_from([2, 3, 4, 8]))
def test_split_holds_every_token_once(lengths: list[int], n: int) -> None:
    """Every token lands on exactly one rank, in row order there, and shares differ by at most
    the chunks a rank holds; each token's slot in the gathered row points back at it."""
    total = sum(lengths)
    if total < n:
        with pytest.raises(UserError, match="cannot be split over"):
            rs.split_row(np.array(lengths), n)
        return
    split = rs.split_row(np.array(lengths), n)
    shares = [split.tokens(r) for r in range(n)]
    assert sorted(np.concatenate(shares).tolist()) == list(range(total))
    assert all(np.all(np.diff(s) > 0) for s in shares)
    sizes = [len(s) for s in shares]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= split.chunks.shape[1]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    shard = rs.RowShard.of(split, cu, 0)
    gathered = np.full(n * shard.width, -1)
    for r, share in enumerate(shares):
        gathered[r * shard.width : r * shard.width + len(share)] = share
    assert np.array_equal(gathered[shard.slots], np.arange(total))


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 20000), min_size=1, max_size=30), n=st.sampled_from([2, 4, 8]))
def test_split_balances_causal_work(lengths: list[int], n: int) -> None:
    """No rank's causal work (keys its queries attend) is more than 10% above the mean, on rows of
    mixed lengths of at least 256 tokens per chunk of the finest split."""
    if sum(lengths) < 256 * n * max(rs.CHUNKS_PER_RANK):
        return
    split = rs.split_row(np.array(lengths), n)
    positions = rs.token_positions(np.array(lengths))
    work = [int((positions[split.tokens(r)] + 1).sum()) for r in range(n)]
    assert sum(work) == int((positions + 1).sum())
    assert max(work) <= rs.WORK_SLACK * np.mean(work), (split.chunks.shape, work)


def test_one_example_is_split_as_a_zigzag() -> None:
    split = rs.split_row(np.array([8]), 2)
    assert split.chunks.tolist() == [[0, 3], [1, 2]] and split.imbalance == 1.0
    assert rs.split_row(np.array([16]), 4).chunks.tolist() == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_pieces_worked_example() -> None:
    """The docstring's example: one 8-token example, this rank holds tokens 2, 3, 6, 7."""
    split = rs.RowSplit(np.array([0, 2, 4, 6, 8]), np.array([[0, 3], [1, 2]]), np.array([1, 1]))
    shard = rs.RowShard.of(split, np.array([0, 8]), 1)
    assert shard.tokens.tolist() == [2, 3, 4, 5]
    shard0 = rs.RowShard.of(split, np.array([0, 8]), 0)
    p = shard0.pieces()
    assert shard0.tokens.tolist() == [0, 1, 6, 7]
    assert p.cu_q.tolist() == [0, 2, 4] and p.cu_k.tolist() == [0, 2, 10]
    windowed = shard0.pieces(window=3)  # token 6 sees 4..6: keys [4, 8)
    assert windowed.cu_k.tolist() == [0, 2, 6]
    chunked = shard0.pieces(chunk=3)  # attention chunks [0, 3) [3, 6) [6, 8): token 6 starts one
    assert chunked.cu_q.tolist() == [0, 2, 4] and chunked.cu_k.tolist() == [0, 2, 4]


def _simulate(q, k, v, lengths, n, features, sinks=None, backend="sdpa"):
    """Every rank's attention, in one process: each rank's queries against the gathered row."""
    cu_np = np.concatenate([[0], np.cumsum(lengths)])
    split = rs.split_row(np.array(lengths), n)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    shards = [rs.RowShard.of(split, cu_np, r) for r in range(n)]
    width = shards[0].width

    def gathered(x):
        parts = []
        for s in shards:
            part = x[torch.from_numpy(s.tokens)]
            parts.append(torch.cat([part, part.new_zeros((width - len(part), *part.shape[1:]))]))
        return torch.cat(parts)

    pieces_out = []
    for s in shards:
        p = s.pieces(features.window, features.chunk)
        slots = torch.from_numpy(p.key_slots)
        whole = Features(window=features.window, softcap=features.softcap)
        pieces_out.append(
            (
                s.tokens,
                varlen_attention(
                    q[torch.from_numpy(s.tokens)],
                    gathered(k)[slots],
                    gathered(v)[slots],
                    torch.from_numpy(p.cu_q),
                    p.max_q,
                    backend=backend,
                    features=whole,
                    sinks=sinks,
                    cu_seqlens_k=torch.from_numpy(p.cu_k),
                    max_seqlen_k=p.max_k,
                ),
            )
        )
    for tokens, o in pieces_out:
        out = out.index_copy(0, torch.from_numpy(tokens), o)
    return out


FEATURES = [Features(), Features(window=5), Features(chunk=6), Features(softcap=0.5), Features(window=7, softcap=1.0)]


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: ",".join(sorted(f.used())) or "causal")
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("sinks", [False, True])
def test_pieces_attend_as_the_whole_row(features: Features, n: int, sinks: bool) -> None:
    """Each rank's queries against the gathered keys give the whole row's attention output and
    gradients (sdpa, float32): examples spanning every rank, shorter than a share, several in
    one share, a row that does not divide evenly; grouped-query heads."""
    lengths = [37, 3, 1, 5, 19, 2, 24]
    torch.manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, 4, 8, requires_grad=True)
    k = torch.randn(total, 2, 8, requires_grad=True)
    v = torch.randn(total, 2, 8, requires_grad=True)
    s = torch.linspace(-2, 2, 4) if sinks else None
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    expected = varlen_attention(q, k, v, cu, max(lengths), backend="sdpa", features=features, sinks=s)
    got = _simulate(q, k, v, lengths, n, features, s)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    weights = torch.randn_like(expected)
    want = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    have = torch.autograd.grad((got * weights).sum(), (q, k, v))
    for a, b in zip(have, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: ",".join(sorted(f.used())) or "causal")
@pytest.mark.parametrize("n", [2, 4])
def test_fa4_pieces_attend_as_the_whole_row(monkeypatch, features: Features, n: int) -> None:
    """FlashAttention-4 attends each rank's pieces to keys of their own (its kernel faked on the CPU
    with FlashAttention's documented bottom-right causal mask, float16 in and out): the whole row's
    output and gradients (sdpa on the same values in float64), every call with key boundaries of its
    own. Negative control: the same pieces with the keys' boundaries dropped are far off."""
    from fake_fa4 import fake_fa4

    from trainer.attention import kernels

    calls: list[dict] = []
    fake_fa4(monkeypatch, calls)
    lengths = [37, 3, 1, 5, 19, 2, 24]
    torch.manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, 8).half().requires_grad_() for h in (4, 2, 2))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = varlen_attention(*exact, cu, max(lengths), backend="sdpa", features=features)
    got = _simulate(q, k, v, lengths, n, features, backend="fa4")
    assert len(calls) == n and all(c["cu_k"] != c["cu"] for c in calls)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-3)
    weights = torch.randn(expected.shape, dtype=torch.float64)
    want = torch.autograd.grad((expected * weights).sum(), exact)
    have = torch.autograd.grad((got.double() * weights).sum(), (q, k, v))
    for a, b in zip(have, want):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-2 * float(b.abs().max()))
    fa4 = kernels._KERNELS["fa4"]
    monkeypatch.setitem(kernels._KERNELS, "fa4", lambda *args: fa4(*args[:8]))  # the keys' boundaries dropped
    wrong = _simulate(q, k, v, lengths, n, features, backend="fa4")
    assert float((wrong.double() - expected).abs().max().detach()) > 0.1


def test_pieces_without_earlier_keys_differ() -> None:
    """Negative control: attending each piece only to its own tokens (no gathered earlier keys) is
    visibly wrong, so the comparison above can fail."""
    lengths = [37, 3, 19]
    torch.manual_seed(0)
    q, k, v = torch.randn(59, 2, 8), torch.randn(59, 2, 8), torch.randn(59, 2, 8)
    cu = torch.tensor([0, 37, 40, 59], dtype=torch.int32)
    expected = varlen_attention(q, k, v, cu, 37, backend="sdpa")
    split = rs.split_row(np.array(lengths), 2)
    for rank in range(2):
        shard = rs.RowShard.of(split, cu.numpy(), rank)
        p = shard.pieces()
        index = torch.from_numpy(shard.tokens)
        local = varlen_attention(q[index], k[index], v[index], torch.from_numpy(p.cu_q), p.max_q, backend="sdpa")
        if rank == 1:  # its first piece starts inside the first example
            assert shard.tokens[0] > 0 and shard.tokens[0] < 37
            assert not torch.allclose(local, expected[index], rtol=1e-3, atol=1e-3)


def test_only_kernels_with_key_boundaries_run_shares() -> None:
    q = torch.randn(4, 2, 8)
    with pytest.raises(UserError, match="cannot attend a piece"):
        varlen_attention(q, q, q, torch.tensor([0, 4]), 4, backend="flex", cu_seqlens_k=torch.tensor([0, 4]), max_seqlen_k=4)


def test_a_share_reaches_attention_with_its_decoder_call_only() -> None:
    """The share a decoder call carries (`packed_row.SHARD_KWARG`) is what attention reads during
    that call, taken out before the decoder sees it (the glue would refuse it as an unknown
    keyword); the next call without one has none: no share lingers from one call to the next."""
    from trainer.attention import packed_row
    from trainer.model.load import load_model, prepare
    from trainer.model.loss import find_decoder

    model = load_model("tiny", vocab_size=300)
    prepare(model, "sdpa", "cpu")
    decoder = find_decoder(model)
    seen = []
    decoder.layers[0].register_forward_pre_hook(lambda module, args: seen.append(packed_row.current().context))
    lengths = np.array([5, 3])
    ids = np.arange(3, 11)
    kwargs = collate_flat(ids, ids, np.concatenate([np.arange(n) for n in lengths]), lengths).model_kwargs()
    share = object()
    with torch.no_grad():
        decoder(**kwargs, use_cache=False, **{packed_row.SHARD_KWARG: share})
        decoder(**kwargs, use_cache=False)
    assert seen == [share, None]


# --------------------------------------------------------------------------- on gloo ranks

ROW = [97, 5, 3, 2, 7, 41, 1]  # 156 tokens: one example spans every share, several share one, uneven


def _row(vocab: int = 256):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocab, sum(ROW))
    labels = ids.copy()
    starts = np.concatenate([[0], np.cumsum(ROW)[:-1]])
    labels[starts] = -100
    labels[starts[0] + 10 : starts[0] + 14] = -100  # a masked prompt inside the long example
    positions = np.concatenate([np.arange(n) for n in ROW])
    return collate_flat(ids, labels, positions, np.array(ROW))


def _per_example(model, batch, shard):
    """Each example's token-loss sum (this rank's tokens only) and loss-token count, both [E]."""
    from trainer.model.loss import token_losses

    losses, where = token_losses(model, batch)
    rows = torch.from_numpy(shard.tokens)[where] if shard is not None else where
    example = torch.searchsorted(torch.tensor(np.cumsum(ROW)), rows, right=True)
    sums = torch.zeros(len(ROW)).index_add(0, example, losses)
    counts = torch.bincount(example, minlength=len(ROW)).float()
    return sums, counts


def _compare_rank(rank: int, world: int, family: str, broken: bool) -> dict:
    """On one rank: each example's loss and gradients, context-parallel against the whole row."""
    import torch.distributed as dist
    from families import FAMILIES

    from trainer.model.load import prepare

    torch.manual_seed(0)
    layout = cp.setup(rank, world, True, world)
    spec = next(f for f in FAMILIES if f.name == family)
    model = spec.build().eval()
    prepare(model, "sdpa", "cpu", layout.groups)
    from trainer.model.check import check_context_parallel

    check_context_parallel(model, layout)
    row = _row()
    share = rs.shard_microbatch(row, layout.cp_rank, layout.cp_size)
    if broken:  # negative control: each piece sees only its own keys
        pieces = share.context.pieces()
        own = rs.Pieces(pieces.cu_q, pieces.cu_q, share.context.slots[share.context.tokens], pieces.max_q, pieces.max_q)
        share.context._cache[("pieces", None, None)] = own
    params = [p for p in model.parameters() if p.requires_grad]
    worst_loss, worst_grad = 0.0, 0.0
    for e in range(len(ROW)):
        model.zero_grad()
        sums, counts = _per_example(model, row, None)
        (sums[e] / counts[e]).backward()
        want = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        want_loss = float(sums[e] / counts[e])
        model.zero_grad()
        sums, counts = _per_example(model, share, share.context)
        counts_all = counts.clone()
        dist.all_reduce(counts_all)
        (sums[e] / counts_all[e]).backward()
        loss = sums[e].detach().clone()
        dist.all_reduce(loss)
        have = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        for g in have:
            dist.all_reduce(g)
        worst_loss = max(worst_loss, abs(float(loss / counts_all[e]) - want_loss) / abs(want_loss))
        for a, b in zip(have, want):
            worst_grad = max(worst_grad, float((a - b).norm() / b.norm().clamp_min(1e-12)))
    return {"loss": worst_loss, "grad": worst_grad}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_example_matches_the_single_process_row(world: int) -> None:
    """Llama on 2 and 4 gloo ranks: every example's loss and gradients (all parameters, summed
    over the group) equal the single-process packed row's, float32, within 1e-5 relative."""
    results = run_on_ranks(_compare_rank, world, args=("llama", False), deadline_s=240)
    for r in results:
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5, results


@pytest.mark.slow
def test_negative_control_pieces_without_gathered_keys_fail() -> None:
    results = run_on_ranks(_compare_rank, 2, args=("llama", True), deadline_s=240)
    assert all(r["loss"] > 1e-3 for r in results), results


# --------------------------------------------------------------------------- train() end to end


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory: pytest.TempPathFactory):
    """Rows of up to 256 tokens whose examples run to 200 tokens: several span every share."""
    from packed_factory import make_packed_folder, pack_lengths

    folder = tmp_path_factory.mktemp("long")
    lengths = np.random.default_rng(1).integers(3, 200, size=40).tolist()
    make_packed_folder(folder, pack_lengths(lengths, 256, vocab=300), 256, rows_per_shard=5)
    return folder


def _train_rank(rank: int, world: int, config: dict) -> dict:
    from trainer import TrainConfig, train

    return train(TrainConfig(**config))


@pytest.mark.slow
@pytest.mark.parametrize("world,parallel", [(2, "ddp"), (4, "fsdp")])
def test_train_under_context_parallel_gives_the_single_process_losses(long_rows, tmp_path, world, parallel):
    """pack-train's loop with each row split over 2 ranks (2 ranks; and 4 ranks as 2 data-parallel
    x 2 context-parallel under FSDP2) logs the losses of one process that takes the same micro-batches
    (grad_accum = the data-parallel ranks) at every step, and the same held-out loss (its rows split
    the same way), float32 on the CPU."""
    from packed_factory import make_packed_folder, pack_lengths

    from trainer import TrainConfig, train

    held = tmp_path / "held"
    lengths = np.random.default_rng(7).integers(30, 250, size=9).tolist()
    make_packed_folder(held, pack_lengths(lengths, 256, vocab=300, seed=7), 256)
    base = dict(
        data=str(long_rows),
        model="tiny",
        tokens_per_step=256,
        lr=1e-3,
        warmup=1,
        max_steps=4,
        log_every=1,
        num_workers=0,
        progress=False,
        attn="sdpa",
        eval_data=str(held),
    )
    ranks = run_on_ranks(
        _train_rank, world, args=(dict(base, out=str(tmp_path / "cp"), context_parallel=2, parallel=parallel),), deadline_s=400
    )
    one = train(TrainConfig(**base, out=str(tmp_path / "one"), grad_accum=world // 2))
    got, want = logged_losses(tmp_path / "cp"), logged_losses(tmp_path / "one")
    assert len(got) == len(want) == 4
    assert got == pytest.approx(want, rel=1e-5)
    assert all(r["eval_loss_tokens"] == one["eval_loss_tokens"] for r in ranks)
    assert all(r["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5) for r in ranks)


def _refused_rank(rank: int, world: int, config: dict) -> str:
    from trainer import TrainConfig, train

    with pytest.raises(UserError) as refused:
        train(TrainConfig(**config))
    return str(refused.value)


@pytest.mark.slow
def test_a_row_shorter_than_the_group_is_refused_at_start(tmp_path) -> None:
    """A row of 1 token cannot be split over 2 ranks: one line on every rank before any step."""
    from packed_factory import make_packed_folder

    make_packed_folder(tmp_path / "data", [[(0, [5, 6, 7, 8])], [(1, [9])]], 8)
    config = dict(
        data=str(tmp_path / "data"), model="tiny", out=str(tmp_path / "run"), context_parallel=2, max_steps=1, num_workers=0, progress=False
    )
    lines = run_on_ranks(_refused_rank, 2, args=(config,), deadline_s=300)
    assert all("holds a row of 1 token(s), too short to split over 2 ranks" in line for line in lines), lines
    assert not (tmp_path / "run").exists()


def test_context_parallel_refusals(long_rows, tmp_path) -> None:
    """One line each: without torchrun, a number that does not divide the ranks, another kernel."""
    from trainer import TrainConfig, train

    base = dict(data=str(long_rows), model="tiny", max_steps=1, num_workers=0, progress=False)
    with pytest.raises(UserError, match="start pack-train with torchrun --nproc-per-node 2"):
        train(TrainConfig(**base, out=str(tmp_path / "a"), context_parallel=2))
    with pytest.raises(UserError, match="does not divide the 4 ranks"):
        cp.setup(0, 4, True, 3)
    with pytest.raises(UserError, match="needs (--)?attn fa4 or flash_attn"):
        train(TrainConfig(**base, out=str(tmp_path / "b"), context_parallel=2, attn="flex"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# --------------------------------------------------------------------------- the family matrix


def _families_rank(rank: int, world: int) -> dict:
    """Every family of tests/families.py that trains packed, on this rank: the start-up probe, then
    each example's loss and the gradients of a random mix of them, context-parallel against the
    whole row (relative to the largest entry); a family refused packed is refused in one line."""
    import torch.distributed as dist
    from families import FAMILIES, examples
    from transformers import CONFIG_MAPPING

    from trainer.model.check import check_context_parallel
    from trainer.model.load import prepare

    layout = cp.setup(rank, world, True, world)
    data = examples()
    lengths = np.array([len(d[0]) for d in data])
    row = collate_flat(
        np.concatenate([d[0] for d in data]), np.concatenate([d[1] for d in data]), np.concatenate([np.arange(n) for n in lengths]), lengths
    )
    share = rs.shard_microbatch(row, layout.cp_rank, layout.cp_size)
    ends = torch.tensor(np.cumsum(lengths))
    mix = torch.linspace(0.5, 2.0, len(lengths), dtype=torch.float64)
    results = {}
    for family in FAMILIES:
        if family.model_type not in CONFIG_MAPPING:
            continue
        model = family.build().double().eval()  # float64: a mistake shows far above the rounding
        try:
            try:
                prepare(model, "sdpa", "cpu", layout.groups)
            except UserError as exc:
                if "Double" not in str(exc):
                    raise
                model = family.build().eval()  # MoE's grouped matmul takes no float64: float32
                prepare(model, "sdpa", "cpu", layout.groups)
        except UserError as exc:
            results[family.name] = {"refused": str(exc)}
            continue
        check_context_parallel(model, layout)
        model.eval()  # PhiMoE's router samples in training
        params = [p for p in model.parameters() if p.requires_grad]
        found = []
        for batch, tokens in ((row, None), (share, torch.from_numpy(share.context.tokens))):
            from trainer.model.loss import token_losses

            losses, where = token_losses(model, batch)
            example = torch.searchsorted(ends, where if tokens is None else tokens[where], right=True)
            sums = torch.zeros(len(lengths), dtype=torch.float64).index_add(0, example, losses.double())
            counts = torch.bincount(example, minlength=len(lengths)).to(torch.float64)
            if tokens is not None:
                dist.all_reduce(counts)
            grads = torch.autograd.grad((mix * sums / counts).sum(), params, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
            sums = sums.detach()
            if tokens is not None:
                dist.all_reduce(sums)
                for g in grads:
                    dist.all_reduce(g)
            found.append((sums / counts, grads))
        (want, want_grads), (got, got_grads) = found
        top = max(float(g.abs().max()) for g in want_grads)
        results[family.name] = {
            "loss": float(((got - want).abs() / want.abs()).max()),
            "grad": max(float((a - b).abs().max()) for a, b in zip(got_grads, want_grads)) / top,
        }
    return results


@pytest.mark.slow
def test_every_family_trains_under_context_parallel_or_is_refused() -> None:
    """The family matrix on 2 gloo ranks: each family that trains packed passes the start-up probe
    and gives every example's loss (1e-5 relative) and the gradients (1e-5 of the largest) of the
    whole row, in float64 (float32 rounding alone reaches 1.6e-5 on gemma4's gradients; float32 for
    the mixture-of-experts families, whose grouped matmul takes no float64); each family
    refused packed is refused in one line, as without context parallelism."""
    from families import FAMILIES

    results = run_on_ranks(_families_rank, 2, deadline_s=500)[0]
    for family in FAMILIES:
        if family.name not in results:
            continue  # not in this transformers
        result = results[family.name]
        if family.refused:
            assert "refused" in result and "\n" not in result["refused"], (family.name, result)
            continue
        assert "refused" not in result, (family.name, result)
        assert result["loss"] < 1e-5 and result["grad"] < 1e-5, (family.name, result)
