"""Where does a packed llama-1b training step spend its time? (GPU; one-off profiling helper)

Times fwd+bwd+AdamW on synthetic packed micro-batches (lengths like GSM8K+CodeAlpaca) for a few
configurations and prints the top CUDA kernels of the eager step.
"""
import argparse, time
import numpy as np, torch
from trainer.batch import collate_flat
from trainer.model import build_model
from trainer.loss import packed_loss

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="llama-1b")
ap.add_argument("--tokens", default="8192,16384")
ap.add_argument("--variants", default="eager,compile")
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--profile", action="store_true")
args = ap.parse_args()
dev = torch.device("cuda", 0)
rng = np.random.default_rng(0)

def batch(T):
    lens = []
    while sum(lens) < T:
        lens.append(int(min(2000, max(16, rng.lognormal(5.2, 0.7)))))
    lens[-1] -= sum(lens) - T
    lens = np.array([l for l in lens if l > 0])
    ids = rng.integers(3, 32000, T)
    labels = ids.copy(); starts = np.r_[0, np.cumsum(lens)[:-1]]; labels[starts] = -100
    pos = np.concatenate([np.arange(l) for l in lens])
    return collate_flat(ids, labels, pos, lens).to(dev)

for variant in args.variants.split(","):
    model, backend = build_model(args.model, attn="torch", device=dev, dtype=torch.float32)
    if variant == "compile":
        for layer in model.model.layers:
            layer.compile(dynamic=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    for T in map(int, args.tokens.split(",")):
        b = batch(T)
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                s, n = packed_loss(model, b)
            (s / n).backward(); opt.step(); opt.zero_grad(set_to_none=True)
        for _ in range(3): step()
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(args.steps): step()
        torch.cuda.synchronize(); dt = (time.perf_counter() - t0) / args.steps
        n = sum(p.numel() for p in model.parameters())
        print(f"{variant:8s} T={T:6d} step {dt*1e3:7.1f} ms  {T/dt:9.0f} tok/s  MFU {6*n*T/dt/989e12:.1%}  peak {torch.cuda.max_memory_allocated()/2**30:.1f} GiB", flush=True)
        if args.profile and variant == "eager" and T == 8192:
            from torch.profiler import profile, ProfilerActivity
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3): step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    del model, opt; torch.cuda.empty_cache()
