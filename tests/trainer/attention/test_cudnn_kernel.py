"""The "cudnn" kernel's logic on the CPU: the row cut at its example boundaries, grouped-query heads,
the scale, chunks and value heads through `varlen_attention`'s preparation, autograd through the
per-example writes, its selection (never auto's), and its one-line refusals. cuDNN itself needs a
GPU, so `cudnn_kernel.SDPA_SCOPE` is replaced by a scope that lets PyTorch's CPU kernel run the same
`scaled_dot_product_attention` calls (tests/gpu/check_gpu_attention.py checks the real kernel)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pipeline.errors import UserError
from trainer.attention import backend as attention
from trainer.attention import cudnn_kernel
from trainer.attention import features as kernel_features
from trainer.attention.backend import select_backend, varlen_attention

LENGTHS = [5, 1, 9, 0, 3, 12]  # an empty example too: it holds no rows
TOL = 2e-2  # bf16 inputs against a float64 reference


@pytest.fixture
def cpu_scope(monkeypatch):
    calls = []

    @contextlib.contextmanager
    def scope():
        calls.append(1)
        yield

    monkeypatch.setattr(cudnn_kernel, "SDPA_SCOPE", scope)
    return calls


def cu_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def qkv(hq=6, hkv=2, d=8, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    return (
        torch.randn(t, hq, d, generator=g).bfloat16(),
        torch.randn(t, hkv, d, generator=g).bfloat16(),
        torch.randn(t, hkv, dv or d, generator=g).bfloat16(),
    )


def reference(q, k, v, dout, lengths, scale, features):
    qq, kk, vv = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = varlen_attention(qq, kk, vv, cu_of(lengths), max(lengths), backend="sdpa", scale=scale, features=features)
    return out, torch.autograd.grad(out, (qq, kk, vv), dout.double())


@pytest.mark.parametrize(
    "hq,hkv,dv,features",
    [
        (6, 2, None, kernel_features.Features()),
        (4, 4, None, kernel_features.Features()),
        (6, 3, 4, kernel_features.Features()),  # value heads narrower than query heads: zero-padded
        (6, 2, None, kernel_features.Features(chunk=4)),
    ],
    ids=["gqa", "mha", "value_dim", "chunk"],
)
def test_cudnn_kernel_matches_the_reference_per_example(cpu_scope, hq, hkv, dv, features):
    """Output and q/k/v gradients equal the sdpa reference's (each example alone, float64).
    Negative control: the same kernel over one example holding the whole row (boundaries lost)
    gives a different output."""
    q, k, v = (x.requires_grad_() for x in qkv(hq, hkv, dv=dv))
    out = varlen_attention(q, k, v, cu_of(LENGTHS), max(LENGTHS), backend="cudnn", scale=0.3, features=features)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want, want_grads = reference(q, k, v, dout, LENGTHS, 0.3, features)
    assert out.shape == (sum(LENGTHS), hq, dv or 8) and cpu_scope
    torch.testing.assert_close(out.double(), want, atol=TOL, rtol=0)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), expected, atol=2 * TOL, rtol=0)
    merged = varlen_attention(q, k, v, cu_of([sum(LENGTHS)]), sum(LENGTHS), backend="cudnn", scale=0.3, features=features)
    assert float((merged.detach().double() - want.detach()).abs().max()) > 10 * TOL


def test_cudnn_kernel_refuses_what_it_cannot_reproduce(cpu_scope):
    q, k, v = qkv()
    for features, name in ((kernel_features.Features(window=4), "sliding-window"), (kernel_features.Features(softcap=2.0), "soft-capping")):
        with pytest.raises(UserError, match=f"'cudnn' cannot reproduce .*{name}"):
            varlen_attention(q, k, v, cu_of(LENGTHS), max(LENGTHS), backend="cudnn", features=features)
    with pytest.raises(UserError, match="cannot attend a piece of an example"):
        varlen_attention(q, k, v, cu_of(LENGTHS), max(LENGTHS), backend="cudnn", cu_seqlens_k=cu_of(LENGTHS), max_seqlen_k=max(LENGTHS))


def test_a_shape_cudnn_refuses_is_one_line(monkeypatch):
    """cuDNN's own refusal (no kernel for a head dim, a GPU) becomes a UserError naming the fix;
    running out of memory stays what it is."""

    @contextlib.contextmanager
    def refusing():
        raise RuntimeError("No available kernel. Aborting execution.\nmore lines")
        yield

    monkeypatch.setattr(cudnn_kernel, "SDPA_SCOPE", refusing)
    with pytest.raises(
        UserError,
        match=r"cuDNN attention cannot run this layer .*No available kernel\. Aborting "
        r"execution\.; use --attn flash_attn",
    ):
        varlen_attention(*qkv(), cu_of(LENGTHS), max(LENGTHS), backend="cudnn")

    @contextlib.contextmanager
    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory")
        yield

    monkeypatch.setattr(cudnn_kernel, "SDPA_SCOPE", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        varlen_attention(*qkv(), cu_of(LENGTHS), max(LENGTHS), backend="cudnn")


def test_cudnn_is_asked_for_by_name_never_picked_by_auto(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(attention, "cudnn_available", lambda: True)
    for name in ("fa4_importable", "flash_attn_importable"):
        monkeypatch.setattr(attention, name, lambda: False)
    monkeypatch.setattr(attention, "torch_varlen_fn", lambda: None)
    monkeypatch.setattr(attention, "torch_flash_op", lambda: None)
    assert select_backend("auto", "cuda", torch.bfloat16) == "flex"
    assert select_backend("cudnn", "cuda", torch.bfloat16) == "cudnn"
    with pytest.raises(UserError, match="'cudnn' cannot be used: it cannot reproduce sliding-window"):
        select_backend("cudnn", "cuda", torch.bfloat16, {"window"})
    with pytest.raises(UserError, match="'cudnn' cannot be used: needs a CUDA device"):
        select_backend("cudnn", "cpu")
    monkeypatch.setattr(attention, "cudnn_available", lambda: False)
    with pytest.raises(UserError, match="'cudnn' cannot be used: this PyTorch has no cuDNN"):
        select_backend("cudnn", "cuda", torch.bfloat16)


def _gpu_with(monkeypatch, capability=(9, 0), flash_attn=True, cudnn=True):
    """select_backend's view of a CUDA machine (nothing here runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(attention, "cudnn_available", lambda: cudnn)
    monkeypatch.setattr(attention, "fa4_importable", lambda: False)
    monkeypatch.setattr(attention, "flash_attn_importable", lambda: flash_attn)


def test_auto_pairs_flash_attn_with_cudnn_for_long_rows_on_hopper(monkeypatch):
    """On a Hopper GPU with flash-attn and cuDNN, auto is "flash_attn+cudnn" (said in its line);
    not where cuDNN cannot reproduce a feature, on an Ampere GPU, or without cuDNN (controls);
    an explicit --attn flash_attn stays flash_attn alone."""
    _gpu_with(monkeypatch)
    assert select_backend("auto", "cuda", torch.bfloat16) == "flash_attn+cudnn"
    assert "cuDNN for rows whose examples average 4,096 tokens" in attention.explain_choice(
        "auto", "flash_attn+cudnn", "cuda", torch.bfloat16
    )
    assert attention.attention_name("flash_attn+cudnn") == "packlm_fa2_cudnn"
    assert select_backend("flash_attn", "cuda", torch.bfloat16) == "flash_attn"
    assert select_backend("auto", "cuda", torch.bfloat16, {"window"}) == "flash_attn"
    _gpu_with(monkeypatch, capability=(8, 0))
    assert select_backend("auto", "cuda", torch.bfloat16) == "flash_attn"
    _gpu_with(monkeypatch, cudnn=False)
    assert select_backend("auto", "cuda", torch.bfloat16) == "flash_attn"


def test_a_paired_backend_runs_cudnn_on_rows_of_long_examples_only(cpu_scope, monkeypatch):
    """ "flash_attn+cudnn" takes cuDNN for a row whose examples average LONG_EXAMPLE_TOKENS or more
    (exact per example, as cudnn alone), the first kernel otherwise; the choice reads shapes only."""
    from trainer.attention import kernels

    ran = []
    monkeypatch.setitem(kernels._KERNELS, "flash_attn", lambda q, k, v, *args: ran.append("flash_attn") or torch.zeros_like(q))
    q, k, v = qkv()
    dout = torch.randn_like(q, dtype=torch.float64)
    monkeypatch.setattr(kernel_features, "LONG_EXAMPLE_TOKENS", 5)  # LENGTHS average 30 / 6 = 5 tokens
    monkeypatch.setattr(kernel_features, "PAIRED_HEAD_DIMS", (8,))  # qkv()'s head dim
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    out = varlen_attention(qq, kk, vv, cu_of(LENGTHS), max(LENGTHS), backend="flash_attn+cudnn")
    want, want_grads = reference(q, k, v, dout, LENGTHS, None, kernel_features.Features())
    torch.testing.assert_close(out.double(), want, atol=TOL, rtol=TOL)
    for got, exp in zip(torch.autograd.grad(out, (qq, kk, vv), dout.to(out.dtype)), want_grads):
        torch.testing.assert_close(got.double(), exp, atol=TOL, rtol=TOL)
    assert ran == [] and cpu_scope  # cuDNN's scope entered, flash_attn not called
    monkeypatch.setattr(kernel_features, "LONG_EXAMPLE_TOKENS", 6)  # control: the same row is short now
    varlen_attention(q, k, v, cu_of(LENGTHS), max(LENGTHS), backend="flash_attn+cudnn")
    assert ran == ["flash_attn"]
    assert kernel_features.row_kernel("flash_attn", 10**6, 1) == "flash_attn"  # unpaired: as asked
    # a head dim cuDNN was not measured at stays with the first kernel, however long the examples
    assert kernel_features.row_kernel("flash_attn+cudnn", 10**6, 1, head_dim=16) == "flash_attn"


def test_one_token_examples_never_reach_cudnn(cpu_scope, monkeypatch):
    """cuDNN has no kernel for a key length of 1 ("cudnn SDPA does not support key/value sequence
    length 1", seen on an H200): a row holding one-token examples still trains, each of them written
    as its value, with output and q/k/v gradients equal to the sdpa reference's. The stand-in SDPA
    refuses length 1 as cuDNN does (control: it does raise there), and is called once for each of
    the two longer examples only (each at its planned length, `cudnn_kernel.planned_length`)."""
    real = torch.nn.functional.scaled_dot_product_attention
    seen = []

    def like_cudnn(q, k, v, **kwargs):
        seen.append(k.shape[-2])
        if k.shape[-2] == 1:
            raise RuntimeError("No available kernel. Aborting execution.")
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(cudnn_kernel.F, "scaled_dot_product_attention", like_cudnn)
    lengths = [1, 7, 1, 1, 4]
    g = torch.Generator().manual_seed(3)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, 8, generator=g).bfloat16().requires_grad_() for h in (6, 2, 2))
    out = varlen_attention(q, k, v, cu_of(lengths), max(lengths), backend="cudnn", scale=0.5)
    dout = torch.randn(out.shape, generator=g).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert seen == [cudnn_kernel.PLAN_BUCKET] * 2
    want, want_grads = reference(q, k, v, dout, lengths, 0.5, kernel_features.Features())
    torch.testing.assert_close(out.double(), want, atol=TOL, rtol=0)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), expected, atol=2 * TOL, rtol=0)
    assert float(grads[0][0].abs().max()) == 0.0 and float(grads[2][0].abs().max()) > 0  # dq 0, dv not
    with pytest.raises(RuntimeError, match="No available kernel"):
        like_cudnn(q[:1].transpose(0, 1)[None], k[:1].transpose(0, 1)[None], v[:1].transpose(0, 1)[None])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "control_not_causal"])
def test_examples_run_at_bucketed_lengths_and_stay_exact(cpu_scope, monkeypatch, causal):
    """cuDNN builds a plan per sequence length, so examples run at a multiple of PLAN_BUCKET: the
    tokens after an example in the row stand in as padding (a view), zeros where the row ends. Output
    and q/k/v gradients still equal each example alone, and changing the following example leaves an
    earlier one's output unchanged. Negative control: attention that is not causal sees the padding,
    and the same comparison fails."""
    monkeypatch.setattr(cudnn_kernel, "PLAN_BUCKET", 8)
    real = torch.nn.functional.scaled_dot_product_attention
    seen = []

    def stand_in(q, k, v, **kwargs):
        seen.append(k.shape[-2])
        return real(q, k, v, **{**kwargs, "is_causal": causal})

    monkeypatch.setattr(cudnn_kernel.F, "scaled_dot_product_attention", stand_in)
    lengths = [13, 3, 8, 21, 6]  # 13 -> 16 over the next example's tokens; the last, 6 -> 8, zero-padded
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(sum(lengths), h, 8, generator=g).bfloat16().requires_grad_() for h in (4, 2, 2))
    out = varlen_attention(q, k, v, cu_of(lengths), max(lengths), backend="cudnn", scale=0.4)
    dout = torch.randn(out.shape, generator=g).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert seen == [16, 8, 8, 24, 8]
    monkeypatch.setattr(cudnn_kernel.F, "scaled_dot_product_attention", real)
    want, want_grads = reference(q, k, v, dout, lengths, 0.4, kernel_features.Features())
    matches = torch.allclose(out.double(), want, atol=TOL, rtol=0) and all(
        torch.allclose(a.double(), b, atol=2 * TOL, rtol=0) for a, b in zip(grads, want_grads)
    )
    assert matches is causal
    if causal:
        k2 = k.detach().clone()
        k2[13:16] += 5.0  # the tokens that padded the first example
        again = varlen_attention(q, k2, v, cu_of(lengths), max(lengths), backend="cudnn", scale=0.4)
        torch.testing.assert_close(again[:13], out[:13].detach(), atol=0, rtol=0)
