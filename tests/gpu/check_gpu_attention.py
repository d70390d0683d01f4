#!/usr/bin/env python
"""Check every packed-attention backend available on this CUDA machine against the reference.

For a tiny (4 query / 2 kv heads, head_dim 16) and a llama-1b-shaped (16 heads, head_dim 128)
attention, a GQA 1b-like one (32 / 8 heads, head_dim 64) and a phi-2-like one (32 heads, head_dim
80), on a packed batch of random-length
examples in bfloat16, each backend's output and its q/k/v gradients are compared PER EXAMPLE with
float32 attention computed on that example alone (relative Frobenius error must be < 2e-2). It also
checks that changing one example's keys/values leaves every other example's output unchanged, and
runs the tiny Llama end to end (packed loss + gradients) with each backend against the sdpa backend.

Prints a table; exits 1 on any mismatch (or when there is no CUDA device). Takes seconds on an H100.

    python tests/gpu/check_gpu_attention.py [--tokens 4096] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: pipeline, trainer
from pipeline.errors import UserError  # noqa: E402
from trainer.attention import backend as attention  # noqa: E402
from trainer.attention import kernels
from trainer.attention.backend import BACKENDS, select_backend, varlen_attention  # noqa: E402
from trainer.attention.features import row_kernel

TOL = 2e-2
LEAK_TOL = 1e-3
SHAPES = {  # name: (query heads, kv heads, head dim)
    "tiny": (4, 2, 16),
    "llama-1b": (16, 16, 128),
    "gqa-1b": (32, 8, 64),
    "phi-2": (32, 32, 80),  # a head dim fa4 pads (to 96)
}
# shapes checked on a row of two long examples (16x --tokens in all), where a pair such as auto's
# "flash_attn+cudnn" hands the row to its second kernel (trainer.attention.features.row_kernel)
LONG_SHAPES = {"llama-1b-long": (16, 16, 128)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def random_lengths(total: int, rng: np.random.Generator) -> list[int]:
    """Example lengths summing to `total`, including a 1-token example and a long one."""
    lengths = [1, min(total // 4, 1024)]
    while sum(lengths) < total:
        lengths.append(int(rng.integers(2, 600)))
    lengths[-1] -= sum(lengths) - total
    lengths = [n for n in lengths if n > 0]
    rng.shuffle(lengths)
    return lengths


def reference_per_example(q, k, v, dout, lengths):
    """float32 attention on each example alone; returns output and q/k/v gradients."""
    outs, dqs, dks, dvs = [], [], [], []
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        qi, ki, vi = (x[sl].float().detach().requires_grad_() for x in (q, k, v))
        cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        oi = varlen_attention(qi, ki, vi, cu, n, backend="sdpa")
        oi.backward(dout[sl].float())
        outs.append(oi.detach())
        dqs.append(qi.grad)
        dks.append(ki.grad)
        dvs.append(vi.grad)
        start += n
    return [torch.cat(x) for x in (outs, dqs, dks, dvs)]


def run_backend(backend, q, k, v, dout, cu, max_len):
    qb, kb, vb = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = varlen_attention(qb, kb, vb, cu, max_len, backend=backend)
    out.backward(dout)
    return out.detach(), qb.grad, kb.grad, vb.grad


def time_backend(backend, q, k, v, dout, cu, max_len, iters=5) -> float:
    for _ in range(2):
        run_backend(backend, q, k, v, dout, cu, max_len)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        run_backend(backend, q, k, v, dout, cu, max_len)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def check_kernels(backends, row_tokens, seed, device) -> list[tuple]:
    rows = []
    rng = np.random.default_rng(seed)
    for shape_name, (hq, hkv, d) in {**SHAPES, **LONG_SHAPES}.items():
        if shape_name in LONG_SHAPES:
            lengths = [8 * row_tokens + 1000, 8 * row_tokens - 1000]
        else:
            lengths = random_lengths(row_tokens, rng)
        tokens = sum(lengths)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
        g = torch.Generator(device=device).manual_seed(seed)
        mk = lambda h: torch.randn(tokens, h, d, device=device, dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
        ref = reference_per_example(q, k, v, dout, lengths)
        # the same inputs with the FIRST example's keys/values changed, to catch leaks
        k2, v2 = k.clone(), v.clone()
        k2[: lengths[0]] += 3.0
        v2[: lengths[0]] -= 3.0
        first = lengths[0]
        for backend in backends:
            if shape_name in LONG_SHAPES and backend == "flex":  # uncompiled, flex materializes the scores
                continue
            if "+" in backend:
                print(
                    f"  {shape_name} ({len(lengths)} examples, {tokens} tokens): {backend} runs "
                    f"{row_kernel(backend, tokens, len(lengths), d)}"
                )
            try:
                got = run_backend(backend, q, k, v, dout, cu, max(lengths))
            except UserError as exc:  # a shape the kernel has no kernel for: refused in one line, not wrong
                print(f"  {shape_name} {hq}/{hkv}x{d} {backend}: refused: {exc}")
                continue
            errors = []
            start = 0
            for n in lengths:  # worst example, for output and each gradient
                sl = slice(start, start + n)
                # A 1-token example has dq = dk = 0 exactly, so a plain relative error divides
                # bf16 rounding noise by zero: floor the denominator at 1% of the norm an example
                # of this size has on average.
                floors = [1e-2 * b.float().norm() * (n / tokens) ** 0.5 for b in ref]
                errors.append(
                    [
                        float((a[sl].float() - b[sl].float()).norm() / torch.maximum(b[sl].float().norm(), f))
                        for a, b, f in zip(got, ref, floors)
                    ]
                )
                start += n
            worst = np.max(np.asarray(errors), axis=0)
            with torch.no_grad():
                leaked = varlen_attention(q, k2, v2, cu, max(lengths), backend=backend)
            leak = rel(leaked[first:], got[0][first:])
            ms = time_backend(backend, q, k, v, dout, cu, max(lengths))
            ok = bool((worst < TOL).all() and leak < LEAK_TOL)
            rows.append((shape_name, f"{hq}/{hkv}x{d}", len(lengths), backend, *worst, leak, ms, ok))
    return rows


def check_model(backends, device) -> list[tuple]:
    """Tiny Llama end to end: packed loss and all gradients of each backend vs the sdpa backend,
    with bf16 weights, and with float32 weights under bf16 autocast (what pack-train does)."""
    import contextlib

    from trainer.data.batch import collate_flat
    from trainer.model.load import build_model
    from trainer.model.loss import packed_loss

    rng = np.random.default_rng(1)
    lengths = [1, 37, 300, 5, 129, 40]
    ids = np.concatenate([rng.integers(3, 4096, n) for n in lengths])
    labels = ids.copy()
    labels[np.concatenate([[0], np.cumsum(lengths)[:-1]])] = -100
    positions = np.concatenate([np.arange(n) for n in lengths])
    batch = collate_flat(ids, labels, positions, np.asarray(lengths)).to(device)
    rows = []
    modes = {
        "bf16": (torch.bfloat16, contextlib.nullcontext),
        "fp32+autocast": (torch.float32, lambda: torch.autocast("cuda", dtype=torch.bfloat16)),
    }
    for mode, (dtype, ctx) in modes.items():
        results = {}
        for backend in ["sdpa", *[b for b in backends if b != "sdpa"]]:
            # a pair is what auto resolves to: asked for as auto, as a user would
            model, _ = build_model("tiny", attn="auto" if "+" in backend else backend, device=device, dtype=dtype, seed=0)
            try:
                with ctx():
                    total, _ = packed_loss(model, batch)
            except UserError as exc:
                print(f"  tiny model {mode} {backend}: refused: {exc}")
                continue
            total.backward()
            grad = torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])
            results[backend] = (total.detach().float(), grad)
        ref_loss, ref_grad = results["sdpa"]
        for backend, (loss, grad) in results.items():
            lerr, gerr = rel(loss, ref_loss), rel(grad, ref_grad)
            rows.append((mode, backend, float(loss), lerr, gerr, lerr < TOL and gerr < TOL))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the packed batch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (this script is for GPU machines)")
        return 1
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}")
    fn = kernels.torch_varlen_fn()
    print(f"torch varlen_attn: {kernels.varlen_signature(fn) if fn else 'absent (aten op fallback)'}")
    backends = []
    for backend in BACKENDS:
        try:
            backends.append(select_backend(backend, device, torch.bfloat16))
            print(f"  {backend:10s} available: {attention.DESCRIPTIONS[backend]}")
        except UserError as exc:
            print(f"  {backend:10s} SKIPPED: {exc}")
    auto = select_backend("auto", device, torch.bfloat16)
    print(f"auto picks: {auto}")
    if "+" in auto:  # a pair: checked as a backend of its own, on short and on long rows
        backends.append(auto)

    rows = check_kernels(backends, args.tokens, args.seed, device)
    print(f"\nper-example relative error vs float32 per-example reference (bf16, tolerance {TOL}):")
    header = f"{'shape':9s} {'heads':9s} {'ex':>3s} {'backend':10s} {'out':>8s} {'dq':>8s} {'dk':>8s} {'dv':>8s} {'leak':>8s} {'fwd+bwd ms':>10s}  ok"
    print(header)
    print("-" * len(header))
    for shape, heads, n, backend, o, dq, dk, dv, leak, ms, ok in rows:
        print(
            f"{shape:9s} {heads:9s} {n:3d} {backend:10s} {o:8.1e} {dq:8.1e} {dk:8.1e} {dv:8.1e} {leak:8.1e} {ms:10.3f}  {'OK' if ok else 'FAIL'}"
        )

    model_rows = check_model(backends, device)
    print(f"\ntiny Llama, packed_loss + all parameter gradients vs the sdpa backend (bf16, tolerance {TOL}):")
    for name, backend, loss, lerr, gerr, ok in model_rows:
        print(f"{name:14s} {backend:10s} loss {loss:10.4f}  rel err loss {lerr:8.1e}  grads {gerr:8.1e}  {'OK' if ok else 'FAIL'}")

    failed = [r for r in rows if not r[-1]] + [r for r in model_rows if not r[-1]]
    print("\nALL OK" if not failed else f"\n{len(failed)} MISMATCH(ES)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
