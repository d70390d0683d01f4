"""Packed attention backends: the sdpa reference against naive per-example attention, the
Hugging Face glue through a real Llama, backend selection, and the GPU branches' dispatch logic
(kernels replaced by the reference so it runs on CPU)."""

from __future__ import annotations

import copy
import inspect
import sys
import types

import numpy as np
import pytest
import torch
from fake_fa4 import fake_fa4, flash_semantics

from pipeline.errors import UserError
from trainer.attention import backend as attention
from trainer.attention import features as kernel_features
from trainer.attention import kernels, reference_kernels
from trainer.attention.backend import BACKENDS, install, select_backend, varlen_attention
from trainer.data.batch import collate_flat
from trainer.model.load import build_model

LENGTHS = [5, 1, 9, 3, 12]
FP16_TOL = 4e-3  # the GPU kernels take 16-bit inputs; fakes compute in float64 and round to fp16


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def qkv(lengths, hq=6, hkv=2, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    mk = lambda h: torch.randn(t, h, d, generator=g, dtype=dtype)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def naive_attention(q, k, v, lengths, scale=None):
    """Per-example, per-head softmax attention written out by hand (float64)."""
    q, k, v = q.double(), k.double(), v.double()
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        for h in range(hq):
            kh = h // (hq // hkv)  # HF grouping: query head h reads kv head h // groups
            scores = (q[sl, h] @ k[sl, kh].T) * scale
            scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
            out[sl, h] = torch.softmax(scores, dim=-1) @ v[sl, kh]
        start += n
    return out


# --------------------------------------------------------------------------- reference kernel


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_sdpa_reference_matches_naive_per_example_attention(hq, hkv, scale):
    q, k, v = qkv(LENGTHS, hq, hkv)
    out = varlen_attention(q, k, v, cu_of(LENGTHS), max(LENGTHS), backend="sdpa", scale=scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, LENGTHS, scale), atol=1e-6, rtol=0)


def test_sdpa_reference_never_attends_across_examples():
    q, k, v = qkv(LENGTHS)
    cu = cu_of(LENGTHS)
    base = varlen_attention(q, k, v, cu, max(LENGTHS), backend="sdpa")
    k2, v2 = k.clone(), v.clone()
    k2[: LENGTHS[0]] += 100.0  # change the first example's keys/values only
    v2[: LENGTHS[0]] -= 50.0
    out = varlen_attention(q, k2, v2, cu, max(LENGTHS), backend="sdpa")
    assert not torch.allclose(out[: LENGTHS[0]], base[: LENGTHS[0]])
    torch.testing.assert_close(out[LENGTHS[0] :], base[LENGTHS[0] :], atol=0, rtol=0)


@pytest.mark.parametrize(
    "features",
    [kernel_features.Features(), kernel_features.Features(window=4), kernel_features.Features(chunk=5)],
    ids=["causal", "window", "chunk"],
)
def test_sdpa_reference_runs_on_the_fused_cpu_kernel_alone(features):
    """The reference hands PyTorch 4-D [B, H, L, D] batches, which its fused (flash) CPU kernel
    takes: with only that kernel allowed it still runs and matches naive attention, gradients
    included. (3-D per-example calls have no fused CPU kernel, so PyTorch materialised the L x L
    scores of every example: 7 GB and minutes for the quick start's 8192-token examples.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lengths = [5, 1, 9, 3, 12, 70, 66, 90]
    q, k, v = (x.requires_grad_() for x in qkv(lengths, 4, 2))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = varlen_attention(q, k, v, cu_of(lengths), max(lengths), backend="sdpa", features=features)
        out.square().sum().backward()
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = varlen_attention(*leaves, cu_of(lengths), max(lengths), backend="sdpa", features=features)
    expected.square().sum().backward()
    if not features.used():
        torch.testing.assert_close(expected, naive_attention(q, k, v, lengths), atol=1e-10, rtol=0)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=0)
    for got, want in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-5, rtol=1e-5)


def test_sdpa_reference_batches_examples_of_similar_length(monkeypatch):
    """One attention call per length bucket, not per example; padding to the bucket's longest
    changes no output or gradient: each example's result equals the example attended alone."""
    lengths = [100, 90, 100, 7, 300, 260, 12, 3, 81]
    assert reference_kernels.length_buckets(lengths) == [[4, 5], [0, 2, 1, 8], [6, 3, 7]]
    assert reference_kernels.length_buckets([4, 0, 2]) == [[0, 2]]  # empty examples attend to nothing
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        reference_kernels.F, "scaled_dot_product_attention", lambda q, *a, **kw: calls.append(tuple(q.shape)) or sdpa(q, *a, **kw)
    )
    q, k, v = (x.requires_grad_() for x in qkv(lengths, 4, 2))
    out = varlen_attention(q, k, v, cu_of(lengths), max(lengths), backend="sdpa")
    out.square().sum().backward()
    assert calls == [(2, 4, 300, 8), (4, 4, 100, 8), (3, 4, 12, 8)]
    start = 0
    for n in lengths:  # each example alone: one call of its own, no padding
        sl = slice(start, start + n)
        parts = [x[sl].detach().requires_grad_() for x in (q, k, v)]
        alone = varlen_attention(*parts, cu_of([n]), n, backend="sdpa")
        alone.square().sum().backward()
        torch.testing.assert_close(out[sl], alone, atol=1e-6, rtol=0)
        for whole, part in zip((q, k, v), parts):
            torch.testing.assert_close(whole.grad[sl], part.grad, atol=1e-5, rtol=1e-5)
        start += n


def test_segment_ids_and_chunk_splits():
    cu = cu_of([2, 3])
    assert kernel_features.segment_ids(cu, 5).tolist() == [0, 0, 1, 1, 1]
    split, longest = kernel_features.split_chunks(cu_of([10, 3, 8]), 4)
    assert split.tolist() == [0, 4, 8, 10, 13, 17, 21] and longest == 4
    assert split.dtype == torch.int32


def test_varlen_attention_rejects_bad_shapes():
    q, k, v = qkv(LENGTHS, 6, 4)  # 6 is not a multiple of 4
    with pytest.raises(ValueError, match="multiple"):
        varlen_attention(q, k, v, cu_of(LENGTHS), 12, backend="sdpa")
    with pytest.raises(UserError, match="unknown attention backend"):
        varlen_attention(*qkv(LENGTHS), cu_of(LENGTHS), 12, backend="xformers")


# --------------------------------------------------------------------------- selection


def test_select_backend_on_cpu():
    assert select_backend("auto", "cpu") == "sdpa"
    assert select_backend("sdpa", "cpu") == "sdpa"
    for backend in ("fa4", "torch", "flash_attn"):
        with pytest.raises(UserError, match="needs a CUDA device.*sdpa"):
            select_backend(backend, "cpu")
    with pytest.raises(UserError, match="unknown attention backend 'xla'.*auto, fa4, flash_attn, torch, flex, sdpa"):
        select_backend("xla", "cpu")


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend a CUDA sm90 GPU is present (the selection logic only asks these functions)."""
    state = {"capability": (9, 0), "fa4": True, "flash_attn": True, "torch_varlen": True}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["capability"])
    monkeypatch.setattr(attention, "fa4_importable", lambda: state["fa4"])
    monkeypatch.setattr(attention, "flash_attn_importable", lambda: state["flash_attn"])
    monkeypatch.setattr(attention, "torch_varlen_fn", lambda: (lambda: None) if state["torch_varlen"] else None)
    monkeypatch.setattr(attention, "torch_flash_op", lambda: None)
    return state


def test_select_backend_auto_order_on_cuda(fake_cuda):
    assert select_backend("auto", "cuda", torch.bfloat16) == "fa4"
    fake_cuda["capability"] = (8, 0)  # FlashAttention-4 does not train on Ampere
    assert select_backend("auto", "cuda", torch.bfloat16) == "flash_attn"
    with pytest.raises(UserError, match="Hopper or newer.*sm80"):
        select_backend("fa4", "cuda", torch.bfloat16)
    fake_cuda["capability"] = (9, 0)
    fake_cuda["fa4"] = False
    assert select_backend("auto", "cuda", torch.bfloat16) == "flash_attn"
    with pytest.raises(UserError, match="flash-attn-4 package is not installed.*flash_attn / torch / flex / sdpa"):
        select_backend("fa4", "cuda", torch.bfloat16)
    fake_cuda["flash_attn"] = False
    assert select_backend("auto", "cuda:0", torch.bfloat16) == "torch"
    with pytest.raises(UserError, match="flash-attn package is not installed.*torch / flex / sdpa"):
        select_backend("flash_attn", "cuda", torch.bfloat16)
    fake_cuda["torch_varlen"] = False
    assert select_backend("auto", "cuda", torch.bfloat16) == "flex"
    with pytest.raises(UserError, match="no FlashAttention varlen kernel"):
        select_backend("torch", "cuda", torch.bfloat16)


def test_context_parallel_takes_the_fastest_kernel_that_attends_pieces(fake_cuda):
    """--context-parallel with --attn auto: FlashAttention-4 where it runs, else flash_attn (which
    says what is missing when it is not there either), sdpa on the CPU; never a kernel that cannot
    attend a piece to keys of its own (torch, flex, cudnn)."""
    from trainer.attention.backend import piece_backend
    from trainer.attention.features import PIECE_KERNELS
    from trainer.config import PIECE_ATTENTION

    assert piece_backend("cuda") == "fa4" and piece_backend("cpu") == "sdpa"
    fake_cuda["fa4"] = False
    assert piece_backend("cuda:0") == "flash_attn"
    fake_cuda["flash_attn"] = False
    assert piece_backend("cuda") == "flash_attn"
    with pytest.raises(UserError, match="flash-attn package is not installed"):
        select_backend(piece_backend("cuda"), "cuda")
    assert set(PIECE_KERNELS) == {"fa4", "flash_attn", "sdpa"}
    assert PIECE_KERNELS == PIECE_ATTENTION  # what the config accepts with --context-parallel


def test_select_backend_cuda_float32_and_old_gpu(fake_cuda):
    assert select_backend("auto", "cuda", torch.float32) == "flex"
    with pytest.raises(UserError, match="bfloat16 or float16"):
        select_backend("torch", "cuda", torch.float32)
    fake_cuda["capability"] = (7, 5)
    with pytest.raises(UserError, match="sm80"):
        select_backend("flash_attn", "cuda", torch.bfloat16)
    assert select_backend("auto", "cuda", torch.bfloat16) == "flex"


# --------------------------------------------------------------------------- GPU-branch glue on CPU


def test_varlen_signature_of_installed_torch():
    fn = kernels.torch_varlen_fn()
    if fn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    sig = kernels.varlen_signature(fn)
    # exactly one way to ask for causality must exist, or the torch backend refuses to run
    assert sig["window_size"] or sig["is_causal"]
    assert sig == {k: k in inspect.signature(fn).parameters for k in sig}


def _reference(q, k, v, cu, max_len, scale=None):
    lengths = (cu[1:] - cu[:-1]).tolist()
    return naive_attention(q, k, v, lengths, scale).to(q.dtype)


def fake_varlen_new(calls):
    """torch 2.13-style varlen_attn: causal via window_size, scale and enable_gqa keywords."""

    def varlen_attn(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        calls.append(dict(window_size=window_size, enable_gqa=enable_gqa, scale=scale, heads=(query.shape[1], key.shape[1])))
        assert window_size == (-1, 0), "must ask for causal attention"
        assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
        assert enable_gqa or key.shape[1] == query.shape[1]
        return _reference(query, key, value, cu_seq_q, max_q, scale)

    return varlen_attn


def fake_varlen_old(calls):
    """torch ~2.9-2.11-style varlen_attn: is_causal flag, no scale, no GQA."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        calls.append(dict(is_causal=is_causal, heads=(query.shape[1], key.shape[1])))
        assert is_causal
        assert key.shape[1] == query.shape[1], "old varlen_attn needs repeated kv heads"
        return _reference(query, key, value, cu_seq_q, max_q)

    return varlen_attn


@pytest.mark.parametrize("scale", [None, 0.2])
@pytest.mark.parametrize("flavour", ["new", "old"])
def test_torch_backend_dispatch_per_signature(monkeypatch, flavour, scale):
    calls: list[dict] = []
    fake = fake_varlen_new(calls) if flavour == "new" else fake_varlen_old(calls)
    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: fake)
    q, k, v = qkv(LENGTHS, 6, 2, dtype=torch.float16)
    out = varlen_attention(q, k, v, cu_of(LENGTHS), max(LENGTHS), backend="torch", scale=scale)
    expected = naive_attention(q, k, v, LENGTHS, scale)
    torch.testing.assert_close(out.double(), expected, atol=FP16_TOL, rtol=0)
    assert len(calls) == 1
    if flavour == "new":
        assert calls[0]["enable_gqa"] and calls[0]["heads"] == (6, 2) and calls[0]["scale"] == scale
    else:
        assert calls[0]["heads"] == (6, 6)


def test_torch_backend_refuses_varlen_without_causal_flag(monkeypatch):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("must not be called")

    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: varlen_attn)
    with pytest.raises(UserError, match="cannot do causal attention"):
        varlen_attention(*qkv(LENGTHS, dtype=torch.float16), cu_of(LENGTHS), 12, backend="torch")


def test_torch_backend_falls_back_to_aten_flash_op(monkeypatch):
    calls = []

    def op(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None):
        calls.append((dropout_p, is_causal, return_debug_mask, cum_seq_q.dtype))
        assert is_causal and dropout_p == 0.0
        out = _reference(q, k, v, cum_seq_q, max_q, scale)
        return out, None, None, None, None

    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: None)
    monkeypatch.setattr(kernels, "torch_flash_op", lambda: op)
    q, k, v = qkv(LENGTHS, 4, 2, dtype=torch.float16)
    cu64 = cu_of(LENGTHS).long()  # int64 offsets must be converted to int32 for the kernel
    out = varlen_attention(q, k, v, cu64, max(LENGTHS), backend="torch")
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, LENGTHS), atol=FP16_TOL, rtol=0)
    assert calls == [(0.0, True, False, torch.int32)]


def test_flash_attn_backend_dispatch(monkeypatch):
    calls = []

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, **_
    ):
        calls.append((causal, dropout_p, softmax_scale, q.is_contiguous()))
        assert causal
        return _reference(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    q, k, v = qkv(LENGTHS, 6, 3, dtype=torch.float16)
    out = varlen_attention(
        q.transpose(0, 1).contiguous().transpose(0, 1), k, v, cu_of(LENGTHS), max(LENGTHS), backend="flash_attn", scale=0.25
    )
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, LENGTHS, 0.25), atol=FP16_TOL, rtol=0)
    assert calls == [(True, 0.0, 0.25, True)]


@pytest.mark.parametrize(
    "features",
    [
        kernel_features.Features(),
        kernel_features.Features(window=4),
        kernel_features.Features(softcap=0.5),
        kernel_features.Features(chunk=3),
        kernel_features.Features(window=5, softcap=2.0),
    ],
    ids=lambda f: ",".join(sorted(f.used())) or "plain",
)
def test_fa4_backend_forward_and_backward_match_the_reference(monkeypatch, features):
    """FlashAttention-4's custom ops (kernel faked with its documented semantics): the window in its
    own terms (w - 1 keys to the left), softcap passed on, chunks as extra sequence starts, head dim
    12 zero-padded to 64 and sliced back; output and q/k/v gradients equal the reference's.
    Negative control: the gradients with a window one key wider differ."""
    calls: list[dict] = []
    fake_fa4(monkeypatch, calls)
    q, k, v = (x.requires_grad_() for x in qkv(LENGTHS, 6, 2, d=12, dtype=torch.float16))
    out = varlen_attention(q, k, v, cu_of(LENGTHS), max(LENGTHS), backend="fa4", scale=0.3, features=features)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).half()
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def reference(feats):
        qq, kk, vv = (x.detach().double().requires_grad_() for x in (q, k, v))
        o = varlen_attention(qq, kk, vv, cu_of(LENGTHS), max(LENGTHS), backend="sdpa", scale=0.3, features=feats)
        return o, torch.autograd.grad(o, (qq, kk, vv), dout.double())

    expected, expected_grads = reference(features)
    assert out.shape == (q.shape[0], 6, 12)
    torch.testing.assert_close(out.double(), expected, atol=FP16_TOL, rtol=0)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.double(), want, atol=2 * FP16_TOL, rtol=0)
    left = -1 if features.window is None else features.window - 1
    assert calls[0]["window"] == (left, 0) and calls[0]["softcap"] == (features.softcap or 0.0)
    assert calls[0]["dims"] == {64}
    if features.chunk:
        assert calls[0]["cu"] == kernel_features.split_chunks(cu_of(LENGTHS), features.chunk)[0].tolist()
    if features.window is not None:
        wider = kernel_features.Features(window=features.window + 1, softcap=features.softcap)
        _, wrong = reference(wider)
        assert max(float((g.double() - w).abs().max()) for g, w in zip(grads, wrong)) > 10 * FP16_TOL


def test_fa4_backend_traces_into_one_graph(monkeypatch):
    """The custom ops keep FlashAttention-4 whole under torch.compile (fullgraph=True raises at a
    graph break), forward and backward, across two batch shapes."""
    fake_fa4(monkeypatch, [])

    def attend(q, k, v, cu, max_len):
        return varlen_attention(q, k, v, cu, max_len, backend="fa4")

    compiled = torch.compile(attend, backend="eager", fullgraph=True, dynamic=True)
    for lengths in (LENGTHS, [7, 2, 11, 4]):
        q, k, v = (x.requires_grad_() for x in qkv(lengths, 4, 2, d=8, dtype=torch.float16))
        out = compiled(q, k, v, cu_of(lengths), max(lengths))
        out.float().sum().backward()
        torch.testing.assert_close(out.double(), naive_attention(q, k, v, lengths), atol=FP16_TOL, rtol=0)
        assert q.grad is not None and k.grad.shape == k.shape and v.grad.abs().sum() > 0
    torch._dynamo.reset()


# --------------------------------------------------------------------------- Hugging Face glue


def packed_example_batch(lengths, vocab=4096, seed=1):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, vocab, n) for n in lengths]
    labels = [np.concatenate([[-100], x[1:]]) for x in ids]
    batch = collate_flat(
        np.concatenate(ids),
        np.concatenate(labels),
        np.concatenate([np.arange(n) for n in lengths]),
        np.asarray(lengths),
    )
    return batch, ids


@pytest.fixture(scope="module")
def tiny():
    model, backend = build_model("tiny", attn="sdpa", seed=3)
    assert backend == "sdpa" and model.config._attn_implementation == "packlm_reference"
    model.eval()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    return model, reference


def test_hf_packed_hidden_states_equal_each_example_alone(tiny):
    model, reference = tiny
    lengths = [6, 11, 1, 8]
    batch, ids = packed_example_batch(lengths)
    with torch.no_grad():
        packed = model.model(**batch.model_kwargs()).last_hidden_state[0]
        start = 0
        for x in ids:
            alone = reference.model(input_ids=torch.from_numpy(x)[None]).last_hidden_state[0]
            torch.testing.assert_close(packed[start : start + len(x)], alone, atol=1e-5, rtol=1e-5)
            start += len(x)


def test_hf_attention_without_cu_seqlens_is_refused(tiny):
    """No silent "one example per row" fallback: a call without boundaries is an error."""
    model, _ = tiny
    ids = torch.randint(3, 4096, (2, 7), generator=torch.Generator().manual_seed(0))
    with pytest.raises(UserError, match="LlamaAttention was called without example boundaries"), torch.no_grad():
        model(input_ids=ids)


def test_install_builds_no_dense_mask(tiny, monkeypatch):
    """transformers must not even scan position_ids for packing (a host sync per forward)."""
    model, _ = tiny
    import transformers.masking_utils as mu

    def boom(*a, **k):
        raise AssertionError("mask preprocessing ran")

    if attention._mask_preprocessing_skips_unregistered():
        monkeypatch.setattr(mu, "find_packed_sequence_indices", boom)
    seen = []
    real = attention.varlen_attention

    def spy(q, k, v, cu_seqlens, max_seqlen, **kw):
        seen.append((cu_seqlens.tolist(), max_seqlen))
        return real(q, k, v, cu_seqlens, max_seqlen, **kw)

    monkeypatch.setattr(attention, "varlen_attention", spy)
    batch, _ = packed_example_batch([3, 4])
    with torch.no_grad():
        model.model(**batch.model_kwargs())
    assert seen == [([0, 3, 7], 4)] * model.config.num_hidden_layers


def test_install_registers_every_backend_name():
    model, _ = build_model("tiny", attn="sdpa")
    for backend in BACKENDS:
        name = install(model, backend)
        assert name.startswith("packlm_") and not any(word in name for word in ("flash", "sdpa", "flex", "eager", "paged"))
        assert model.config._attn_implementation == name
    with pytest.raises(UserError, match="unknown attention backend"):
        install(model, "eager")


def test_hf_attention_rejects_dense_masks_and_dropout(tiny):
    fn = attention.make_hf_attention("sdpa")
    module = types.SimpleNamespace(is_causal=True)
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(UserError, match="dense attention_mask"):
        fn(module, q, q, q, torch.ones(1, 1, 3, 3), scaling=0.5)
    with pytest.raises(UserError, match="dropout"):
        fn(module, q, q, q, None, scaling=0.5, dropout=0.1)
    with pytest.raises(UserError, match="KV cache"):
        fn(module, q, torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), None, scaling=0.5)
    with pytest.raises(UserError, match="without example boundaries"):
        fn(module, q, q, q, None, scaling=0.5)
    bounds = dict(cu_seq_lens_q=torch.tensor([0, 1, 3], dtype=torch.int32), max_length_q=2)
    out, weights = fn(module, q, q, q, None, scaling=0.5, **bounds)
    assert out.shape == (1, 3, 2, 4) and weights is None


def test_install_falls_back_to_the_config_attribute(monkeypatch):
    """Older transformers may refuse custom names in set_attn_implementation."""
    model, _ = build_model("tiny", attn="sdpa")

    def refuse(name, *a, **k):
        raise ValueError(f"Specified attn_implementation={name} is not supported")

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    assert install(model, "torch") == "packlm_torch"
    assert model.config._attn_implementation == "packlm_torch"
    assert model.model.layers[0].self_attn.config._attn_implementation == "packlm_torch"


# --------------------------------------------------------------------------- build_model (installs the backend)


def test_presets_sizes_and_gqa():
    from transformers import LlamaForCausalLM

    from trainer.model.load import PRESETS, count_params, preset_config

    with torch.device("meta"):
        sizes = {name: count_params(LlamaForCausalLM(preset_config(name))) for name in PRESETS}
    assert 90e6 < sizes["llama-100m"] < 110e6
    assert 0.9e9 < sizes["llama-1b"] < 1.1e9
    assert 8.0e9 < sizes["llama-8b"] < 8.1e9  # Llama-3-8B: 8.03B
    tiny = preset_config("tiny")
    assert tiny.num_attention_heads > tiny.num_key_value_heads  # GQA exercised by every test
    assert preset_config("tiny", vocab_size=32000).vocab_size == 32000
    big = preset_config("llama-1b")
    assert (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.intermediate_size, big.vocab_size) == (
        2048,
        16,
        16,
        5632,
        32000,
    )


def test_build_model_is_seeded_and_overrides_vocab():
    a, _ = build_model("tiny", attn="auto", seed=1, vocab_size=300)
    b, _ = build_model("tiny", attn="auto", seed=1, vocab_size=300)
    c, _ = build_model("tiny", attn="auto", seed=2, vocab_size=300)
    assert a.get_input_embeddings().num_embeddings == 300
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.training


def test_build_model_from_local_folder(tmp_path):
    saved, _ = build_model("tiny", attn="sdpa", seed=4)
    saved.save_pretrained(tmp_path / "m")
    loaded, backend = build_model(str(tmp_path / "m"), attn="sdpa")
    assert backend == "sdpa" and loaded.config._attn_implementation == "packlm_reference"
    assert all(torch.equal(x, y) for x, y in zip(saved.parameters(), loaded.parameters()))
    with pytest.raises(UserError, match="only embeds 4096"):
        build_model(str(tmp_path / "m"), vocab_size=5000)


def test_build_model_refuses_unknown_names_and_bad_folders(tmp_path):
    with pytest.raises(
        UserError, match="neither a preset \\(tiny, llama-100m, llama-1b, llama-8b\\), a local folder with config.json, nor a Hub id"
    ):
        build_model("tyni")
    with pytest.raises(UserError, match="no config.json"):
        build_model(str(tmp_path))
    with pytest.raises(UserError, match="needs a CUDA device"):
        build_model("tiny", attn="torch")


def test_kernel_backends_get_16bit_inputs_under_autocast(monkeypatch):
    """fp32 weights + bf16 autocast: HF's RoPE hands over fp32 q/k and bf16 v; the kernel must
    receive all three in the autocast dtype, and genuine fp32 activations are refused."""
    seen = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        seen.append((query.dtype, key.dtype, value.dtype))
        return _reference(query, key, value, cu_seq_q, max_q, scale)

    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: varlen_attn)
    q, k, v = qkv(LENGTHS, 4, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = varlen_attention(q, k, v.bfloat16(), cu_of(LENGTHS), max(LENGTHS), backend="torch")
    assert seen == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, LENGTHS), atol=3e-2, rtol=0)
    with pytest.raises(UserError, match="bfloat16/float16 activations.*--attn sdpa"):
        varlen_attention(q, k, v, cu_of(LENGTHS), max(LENGTHS), backend="torch")
    varlen_attention(q.half(), k.half(), v.half(), cu_of(LENGTHS), max(LENGTHS), backend="torch")
    assert seen[-1] == (torch.float16,) * 3


def test_torch_backend_through_llama_under_autocast(monkeypatch):
    """The whole GPU path on CPU: fp32 Llama, bf16 autocast, 'torch' backend (kernel faked by the
    float64 reference): packed losses agree with the float32 sdpa backend to bf16 accuracy."""
    from trainer.model.loss import per_example_losses

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert query.dtype == key.dtype == value.dtype == torch.bfloat16 and window_size == (-1, 0)
        return _reference(query, key, value, cu_seq_q, max_q, scale)

    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: varlen_attn)
    model, _ = build_model("tiny", attn="sdpa", seed=5)
    batch, _ = packed_example_batch([6, 11, 2, 8])
    with torch.no_grad():
        expected = per_example_losses(model, batch)
        install(model, "torch")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = per_example_losses(model, batch)
    torch.testing.assert_close(got, expected, atol=0, rtol=2e-2)


# --------------------------------------------------------------------------- attention features


def test_auto_picks_the_fastest_backend_that_reproduces_the_features(fake_cuda, monkeypatch):
    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: fake_varlen_new([]))  # has window_size
    pick = lambda *features: select_backend("auto", "cuda", features=set(features))  # noqa: E731
    assert pick() == pick("window") == pick("softcap", "window") == pick("chunk", "value_dim") == "fa4"
    assert pick("sinks") == pick("window", "sinks") == pick("wide_head") == "flex"
    fake_cuda["fa4"] = False
    assert pick() == pick("window") == pick("softcap", "window") == pick("chunk", "value_dim") == "flash_attn"
    fake_cuda["flash_attn"] = False
    assert pick("window") == pick("chunk") == "torch"
    assert pick("softcap") == "flex"
    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: fake_varlen_old([]))  # no window_size
    assert pick("window") == "flex"
    with pytest.raises(UserError, match="'torch' cannot be used: it cannot reproduce attention logit soft-capping"):
        select_backend("torch", "cuda", features={"softcap"})
    fake_cuda["flash_attn"] = True
    with pytest.raises(UserError, match="'flash_attn' cannot be used: it cannot reproduce attention sinks.*flex / sdpa"):
        select_backend("flash_attn", "cuda", features={"sinks", "window"})


def test_cpu_trains_with_the_reference_whatever_the_features():
    assert select_backend("auto", "cpu", features={"sinks", "softcap", "window", "chunk"}) == "sdpa"
    with pytest.raises(UserError, match="no FlexAttention backward on the CPU"):
        select_backend("flex", "cpu")
    why = attention.explain_choice("auto", "sdpa", "cpu", features={"sinks"})
    assert "uses attention sinks" in why and "not flex: PyTorch has no FlexAttention backward" in why


@pytest.mark.parametrize(
    "features",
    [
        kernel_features.Features(window=4),
        kernel_features.Features(softcap=0.5),
        kernel_features.Features(chunk=3),
        kernel_features.Features(window=5, softcap=2.0),
        kernel_features.Features(),
    ],
    ids=lambda f: ",".join(sorted(f.used())) or "plain",
)
@pytest.mark.parametrize("value_dim", [8, 6])
def test_flash_attn_gets_the_features_in_its_own_terms(monkeypatch, features, value_dim):
    """window w -> window_size=(w - 1, 0), softcap passed on, chunks as extra sequence starts, a
    narrower value head zero-padded and the output sliced back: the kernel (faked here with
    flash-attn's documented semantics) then matches the reference exactly."""
    calls = []

    def flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, **_
    ):
        calls.append(dict(window_size=window_size, softcap=softcap, dims={q.shape[-1], v.shape[-1]}, cu=cu_q.tolist()))
        assert causal and torch.equal(cu_q, cu_k)
        return flash_semantics(q, k, v, cu_q, softmax_scale, window_size, softcap).to(q.dtype)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    q, k, _ = qkv(LENGTHS, 6, 2, d=8, dtype=torch.float16)
    v = torch.randn(q.shape[0], 2, value_dim, generator=torch.Generator().manual_seed(1)).half()
    out = varlen_attention(q, k, v, cu_of(LENGTHS), max(LENGTHS), backend="flash_attn", scale=0.3, features=features)
    expected = varlen_attention(
        q.double(), k.double(), v.double(), cu_of(LENGTHS), max(LENGTHS), backend="sdpa", scale=0.3, features=features
    )
    assert out.shape == (q.shape[0], 6, value_dim)
    torch.testing.assert_close(out.double(), expected, atol=FP16_TOL, rtol=0)
    left = -1 if features.window is None else features.window - 1
    assert calls[0]["window_size"] == (left, 0) and calls[0]["softcap"] == (features.softcap or 0.0)
    assert calls[0]["dims"] == {8}  # one head dim for q, k and v
    if features.chunk:
        assert calls[0]["cu"] == kernel_features.split_chunks(cu_of(LENGTHS), features.chunk)[0].tolist()
    if features.window is not None:  # negative control: the kernel's own count, w, is one too many
        wrong = flash_semantics(q, k, v, cu_of(LENGTHS), 0.3, (features.window, 0), features.softcap or 0.0)
        assert float((wrong[..., :value_dim] - expected).abs().max()) > 10 * FP16_TOL


def test_torch_backend_gets_the_window_in_its_own_terms(monkeypatch):
    calls: list[dict] = []

    def varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False, **_
    ):
        calls.append(dict(window_size=window_size))
        return flash_semantics(query, key, value, cu_seq_q, scale, window_size).to(query.dtype)

    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: varlen_attn)
    q, k, v = qkv(LENGTHS, 4, 2, dtype=torch.float16)
    feats = kernel_features.Features(window=3)
    out = varlen_attention(q, k, v, cu_of(LENGTHS), max(LENGTHS), backend="torch", features=feats)
    expected = varlen_attention(q.double(), k.double(), v.double(), cu_of(LENGTHS), max(LENGTHS), backend="sdpa", features=feats)
    torch.testing.assert_close(out.double(), expected, atol=FP16_TOL, rtol=0)
    assert calls == [dict(window_size=(2, 0))]
    with pytest.raises(UserError, match="cannot reproduce attention logit soft-capping"):
        varlen_attention(q, k, v, cu_of(LENGTHS), max(LENGTHS), backend="torch", features=kernel_features.Features(softcap=1.0))


@pytest.mark.parametrize(
    "features",
    [
        kernel_features.Features(window=4),
        kernel_features.Features(chunk=3),
        kernel_features.Features(softcap=0.5),
        kernel_features.Features(window=4, softcap=0.5),
    ],
    ids=lambda f: ",".join(sorted(f.used())),
)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_flex_forward_matches_the_reference_on_cpu(features, with_sinks):
    q, k, v = qkv(LENGTHS, 6, 2)
    sinks = torch.linspace(-2.0, 2.0, 6) if with_sinks else None
    args = (q, k, v, cu_of(LENGTHS), max(LENGTHS))
    flex = varlen_attention(*args, backend="flex", scale=0.4, features=features, sinks=sinks)
    reference = varlen_attention(*args, backend="sdpa", scale=0.4, features=features, sinks=sinks)
    torch.testing.assert_close(flex, reference, atol=2e-6, rtol=1e-5)
    plain = varlen_attention(*args, backend="sdpa", scale=0.4)  # negative control
    assert float((plain - reference).abs().max()) > 1e-2


def test_reference_spells_out_each_feature():
    """The sdpa reference against attention written out by hand, one feature at a time."""
    q, k, v = qkv([9], 2, 1, d=4)
    cu = cu_of([9])
    scores = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(2, 1)) * 0.5
    i = torch.arange(9)
    causal = i[None, :] <= i[:, None]
    cases = {
        kernel_features.Features(window=3): (scores, causal & (i[:, None] - i[None, :] < 3)),
        kernel_features.Features(chunk=4): (scores, causal & (i[:, None] // 4 == i[None, :] // 4)),
        kernel_features.Features(softcap=0.7): (0.7 * torch.tanh(scores / 0.7), causal),
    }
    for features, (s, keep) in cases.items():
        probs = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
        expected = torch.einsum("hij,jhd->ihd", probs, v.repeat_interleave(2, 1))
        out = varlen_attention(q, k, v, cu, 9, backend="sdpa", scale=0.5, features=features)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    sinks = torch.tensor([1.5, -0.5])
    s = torch.cat([scores.masked_fill(~causal, float("-inf")), sinks[:, None, None].expand(2, 9, 1)], -1)
    expected = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1)[..., :9], v.repeat_interleave(2, 1))
    out = varlen_attention(q, k, v, cu, 9, backend="sdpa", scale=0.5, sinks=sinks)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_layer_features_reads_the_layer_index_only_where_layers_differ():
    """torch.compile guards on every int module attribute that compiled code reads; on the GPU
    (torch 2.11, whose kernels break the graph inside the attention function) reading `layer_idx`
    in every model compiled the attention once per layer, and past dynamo's recompile limit (8)
    the later layers of llama-1b ran it uncompiled: flex_attention then ran eagerly and ran out of
    memory at 16k tokens. So the index is read only when `config.layer_types` needs it.
    Negative control: the Gemma-style model with layer_types does read it."""

    class Config:
        def __init__(self, layer_types=None):
            self.layer_types = layer_types

    class Layer(torch.nn.Module):
        reads = 0

        def __init__(self, config):
            super().__init__()
            self.config = config

        @property
        def layer_idx(self):
            Layer.reads += 1
            return 1

    q = torch.zeros(1, 2, 4, 8)
    attention.layer_features(Layer(Config()), q, q, {})
    assert Layer.reads == 0
    feats = attention.layer_features(Layer(Config(["full_attention", "sliding_attention"])), q, q, {})
    assert Layer.reads == 1 and feats.window is None  # (no sliding_window in this config)


@torch.library.custom_op("packlm_test::varlen", mutates_args=())
def _custom_op_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """A CPU stand-in for flash-attn's varlen kernel, which flash-attn registers as a custom op
    (torch.library) so that torch.compile traces through it."""
    return reference_kernels.sdpa_varlen(q, k, v, cu, max_seqlen, None, kernel_features.Features(), None).contiguous()


@_custom_op_kernel.register_fake
def _(q, k, v, cu, max_seqlen):
    return torch.empty_like(q)


def test_packed_attention_traces_into_one_graph(monkeypatch):
    """The glue around the kernel (features, checks, casts) must not break a compiled graph: a
    break ends the graph before attention in every layer, so each layer runs as several compiled
    frames with host work between them (on the H100 it left the GPU idle 18-49% of the step).
    With a kernel that is a custom op, as flash-attn's is, a decoder layer compiles whole
    (fullgraph=True raises at a break). Negative control: `supported` reading dataclass fields()
    while traced, as it once did, breaks the graph."""
    monkeypatch.setitem(kernels._KERNELS, "flash_attn", lambda q, k, v, cu, m, scale, feats, sinks: _custom_op_kernel(q, k, v, cu, m))
    model, _ = build_model("tiny", attn="sdpa", seed=0)
    install(model, "flash_attn")
    model.model.compile(backend="eager", fullgraph=True, dynamic=True)
    rng = np.random.default_rng(0)
    for lengths in ([5, 9, 3], [7, 2, 11, 4]):  # another shape and max_seqlen: no recompile needed
        ids = rng.integers(0, 100, sum(lengths))
        pos = np.concatenate([np.arange(n) for n in lengths])
        batch = collate_flat(ids, ids, pos, np.array(lengths))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.model(**batch.model_kwargs(), use_cache=False)

    monkeypatch.setattr(kernels, "supported", lambda kernel: {f.name for f in kernel_features.fields(kernel_features.Features)})
    torch._dynamo.reset()
    model.model.compile(backend="eager", fullgraph=True, dynamic=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.model(**batch.model_kwargs(), use_cache=False)
    torch._dynamo.reset()


def test_auto_on_the_cpu_names_each_reason_once():
    """The backends passed over for one reason are listed together: on the CPU fa4, flash_attn and
    torch all need CUDA, said once; flex's own reason apart."""
    why = attention.explain_choice("auto", "sdpa", "cpu")
    assert why.count("needs a CUDA device") == 1, why
    assert "not fa4, flash_attn, torch: needs a CUDA device, but the model is on 'cpu'" in why, why
    assert "; not flex: PyTorch has no FlexAttention backward" in why, why
