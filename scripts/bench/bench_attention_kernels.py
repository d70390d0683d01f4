"""The packed-attention kernels alone, forward and backward, on the same rows (issue 69, Deliver 2).

    python scripts/bench/bench_attention_kernels.py --lengths 32768,131072,1048576 --kernels fa4,flash_attn,torch,cudnn \
        --json bench_attention_kernels_h200.json

Each case is one packed row of T tokens in the 8B shape's attention (32 query heads, 8 key/value
heads, head dim 128, bf16): `--examples` equal examples back to back (1: one long example, the long-row
case). Every kernel gets the same q, k, v and output gradient. Per kernel and case: the median time of
`--reps` forward calls and of `--reps` forward+backward calls (after one untimed call of each, which
also compiles FlashAttention-4's kernels; rows past `--max-reps-tokens`: one timed call each, no untimed
one, so run a shorter length first), their causal attention TFLOP/s, and the peak memory the
forward+backward allocates beyond its inputs (K/V gradients kept at the 8 key/value heads or expanded
to 32 show here).

FLOPs are counted as pack-train counts them (`pipeline.report.flops`): per causal (query, key) pair
4 x heads x head_dim in the forward (QK^T and PV), twice that in the backward; a row's pairs are the
sum over its examples of L (L + 1) / 2, never T^2 / 2.

Kernels: `fa4`, `flash_attn`, `torch` and `flex` through `trainer.attention.kernels.varlen_attention`
(what pack-train's layers call); `cudnn` is PyTorch's cuDNN attention (`F.scaled_dot_product_attention`
under `SDPBackend.CUDNN_ATTENTION`, grouped-query heads native) run on each example alone, which
pack-train does not offer: it is here to see whether it would be worth adding. A kernel that fails
(not installed, out of memory) is a result with its reason; the others still run. The JSON is written
after every case, so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from pipeline.report.flops import causal_pairs  # noqa: E402
from scripts.benchlib import add_bench_args, check_output, write_json  # noqa: E402
from trainer.attention.kernels import varlen_attention  # noqa: E402

HQ, HKV, D = 32, 8, 128  # the 8B shape (Llama-3-8B's attention)


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """cuDNN's fused attention on each example alone ([T, H, D] in, [T, H, D] out)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    outs = []
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for a, b in zip(cu[:-1], cu[1:]):
            qe, ke, ve = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, enable_gqa=True)
            outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def timed(fn, reps: int, warm: bool) -> float:
    """Median milliseconds of `reps` calls of fn (CUDA events), after one untimed call if `warm`."""
    if warm:
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_case(kernel: str, tokens: int, examples: int, reps: int, seed: int, warm: bool = True) -> dict:
    device = torch.device("cuda")
    length = tokens // examples
    lengths = [length] * examples
    cu = [i * length for i in range(examples + 1)]
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(tokens, HQ, D, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(tokens, HKV, D, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(tokens, HKV, D, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    dout = torch.randn(tokens, HQ, D, device=device, dtype=torch.bfloat16, generator=gen)
    cu_t = torch.tensor(cu, device=device, dtype=torch.int32)

    def forward() -> torch.Tensor:
        if kernel == "cudnn":
            return cudnn_attention(q, k, v, cu)
        return varlen_attention(q, k, v, cu_t, length, backend=kernel)

    def forward_backward() -> None:
        q.grad = k.grad = v.grad = None
        forward().backward(dout)

    pairs = causal_pairs(lengths)
    fwd_flops = 4 * HQ * D * pairs
    result = {"kernel": kernel, "tokens": tokens, "examples": examples, "example_len": length, "causal_pairs": pairs, "ok": False}
    try:
        with torch.no_grad():
            fwd_ms = timed(forward, reps, warm)
        if warm:
            forward_backward()  # the gradients exist before the peak is measured
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fb_ms = timed(forward_backward, reps, warm=False)
        result.update(
            ok=True,
            fwd_ms=fwd_ms,
            fwd_bwd_ms=fb_ms,
            bwd_ms=fb_ms - fwd_ms,
            fwd_tflops=fwd_flops / fwd_ms / 1e9,
            fwd_bwd_tflops=3 * fwd_flops / fb_ms / 1e9,
            bwd_tflops=2 * fwd_flops / max(fb_ms - fwd_ms, 1e-9) / 1e9,
            extra_peak_gib=(torch.cuda.max_memory_allocated() - base) / 2**30,
        )
    except Exception as exc:  # noqa: BLE001 - one failing kernel must not lose the others
        result["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    finally:
        del q, k, v, dout
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="32768,131072", help="row lengths T, comma-separated")
    p.add_argument("--examples", default="1", help="examples per row, comma-separated (each case runs every one)")
    p.add_argument("--kernels", default="fa4,flash_attn,torch,cudnn")
    p.add_argument("--reps", type=int, default=5, help="timed calls per case (rows of 1M tokens: 1 is enough)")
    p.add_argument("--max-reps-tokens", type=int, default=262144, help="rows longer than this are timed with one call")
    add_bench_args(p, seed=0, json=None)
    args = p.parse_args()
    if args.json:
        check_output(args.json, "--json")
    results = []
    header = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bf16"},
    }
    for tokens in (int(x) for x in args.lengths.split(",")):
        for examples in (int(x) for x in args.examples.split(",")):
            for kernel in args.kernels.split(","):
                short = tokens <= args.max_reps_tokens  # longer rows: one call each, no untimed one
                res = run_case(kernel, tokens, examples, args.reps if short else 1, args.seed, warm=short)
                results.append(res)
                if res["ok"]:
                    print(
                        f"[{kernel}] T={tokens:,} x{examples}: fwd {res['fwd_ms']:.1f} ms "
                        f"({res['fwd_tflops']:.0f} TFLOP/s), fwd+bwd {res['fwd_bwd_ms']:.1f} ms "
                        f"({res['fwd_bwd_tflops']:.0f} TFLOP/s; bwd {res['bwd_tflops']:.0f}), "
                        f"+{res['extra_peak_gib']:.2f} GiB",
                        flush=True,
                    )
                else:
                    print(f"[{kernel}] T={tokens:,} x{examples}: FAILED {res.get('note')}", flush=True)
                if args.json:
                    write_json(args.json, {**header, "results": results})


if __name__ == "__main__":
    main()
