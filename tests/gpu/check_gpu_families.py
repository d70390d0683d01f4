#!/usr/bin/env python
"""The model-family matrix on a CUDA GPU: every packed backend, in bf16, against float32 alone.

1. Kernels: each backend (fa4, flash_attn, torch, flex) on packed random q/k/v with each attention
   feature (window, chunk, soft-cap, sinks, a narrower value head), output and q/k/v gradients
   compared per example with the float32 sdpa reference run on that example alone. Negative
   control: the reference with a window one token wider must differ from every backend by more
   than the tolerance (so the w -> (w - 1, 0) translation is checked, not just the window's
   presence).
2. Families (tests/families.py): for each model and backend, `trainer.model.load.prepare` then the
   per-example losses of a packed row under bf16 autocast, against the stock eager model run on
   each example alone in float32 (tolerance LOSS_TOL). The gradient of their sum is compared
   with the sdpa reference backend's under the same autocast and only reported: in bf16 it moves
   with every rounding that MoE routing or a saturated soft-cap amplifies (up to 0.16 on this
   matrix's exaggerated models), so it cannot tell a kernel error from rounding. What does: for
   families with a feature, flex also runs in float32, where its losses and gradients must be
   within 1e-4 of the stock model's; the FlashAttention kernels, which only run in 16 bits, are
   held to part 1 on every feature.
   A backend that cannot reproduce a
   family's features must refuse it in one line; which backend `auto` picks is recorded.
3. Training: `trainer.run.loop.train` (as pack-train runs it: auto backend, compiled decoder layers,
   bf16 autocast) for a few steps on a small packed folder, for families whose `auto` choice
   differs (flash_attn, flex); the losses must be finite.

Prints tables; writes JSON to --json. Exits 1 on any mismatch or a backend that neither matches
nor refuses.

    python tests/gpu/check_gpu_families.py --json $OUT/check_gpu_families.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: families, packed_factory

from families import FAMILIES, examples, fresh_rope  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from pipeline.errors import UserError  # noqa: E402
from scripts.benchlib import check_output, write_text_output  # noqa: E402
from trainer.attention import backend as attention  # noqa: E402
from trainer.attention.features import Features  # noqa: E402
from trainer.attention.kernels import varlen_attention  # noqa: E402
from trainer.data.batch import collate_flat  # noqa: E402
from trainer.model.load import prepare  # noqa: E402
from trainer.model.loss import per_example_losses  # noqa: E402

LOSS_TOL = 2e-2  # relative, per example: a bf16 kernel against float32
FP32_TOL = 1e-4  # flex in float32 against the stock model: losses and all gradients together
KERNEL_TOL = 2e-2
KERNEL_BACKENDS = ("fa4", "flash_attn", "torch", "flex")
CASES = {  # name: (Features, sinks?, value head dim)
    "plain": (Features(), False, 64),
    "window": (Features(window=48), False, 64),
    "chunk": (Features(chunk=64), False, 64),
    "softcap": (Features(softcap=5.0), False, 64),
    "window+softcap": (Features(window=48, softcap=5.0), False, 64),
    "sinks": (Features(), True, 64),
    "window+sinks": (Features(window=48), True, 64),
    "value_dim": (Features(), False, 48),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def kernel_rows(device: torch.device) -> list[dict]:
    lengths = [1, 200, 37, 130, 64, 90]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    hq, hkv, d, t = 8, 2, 64, sum(lengths)
    rows = []
    for case, (feats, with_sinks, dv) in CASES.items():
        g = torch.Generator(device="cpu").manual_seed(0)
        make = lambda *shape: torch.randn(*shape, generator=g).to(device, torch.bfloat16)  # noqa: E731
        q, k, v, dout = make(t, hq, d), make(t, hkv, d), make(t, hkv, dv), make(t, hq, dv)
        sinks = torch.linspace(-2, 2, hq) if with_sinks else None
        sinks = sinks.to(device) if sinks is not None else None

        def run(backend, f=feats, dtype=None):
            qq, kk, vv = (x.detach().to(dtype or x.dtype).requires_grad_() for x in (q, k, v))
            out = varlen_attention(qq, kk, vv, cu, max(lengths), backend=backend, features=f, sinks=sinks)
            grads = torch.autograd.grad(out, (qq, kk, vv), dout.to(out.dtype))
            return out, grads

        ref_out, ref_grads = run("sdpa", dtype=torch.float32)
        wider = None
        if feats.window is not None:
            wider, _ = run("sdpa", Features(feats.window + 1, feats.chunk, feats.softcap), torch.float32)
        for backend in KERNEL_BACKENDS:
            row = {"case": case, "backend": backend}
            used = feats.used() | ({"sinks"} if with_sinks else set()) | ({"value_dim"} if dv != d else set())
            try:
                attention.select_backend(backend, device, features=used)
            except UserError as exc:
                rows.append({**row, "status": "refused", "why": str(exc)})
                continue
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                out, grads = run(backend)
            except Exception as exc:  # noqa: BLE001 - recorded, and counted as a failure
                rows.append({**row, "status": "MISMATCH", "why": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            torch.cuda.synchronize()
            errors = [rel(out, ref_out)] + [rel(a, b) for a, b in zip(grads, ref_grads)]
            ok = max(errors) < KERNEL_TOL
            if wider is not None:
                row["off_by_one_err"] = rel(out, wider)
                ok = ok and row["off_by_one_err"] > KERNEL_TOL
            rows.append(
                {
                    **row,
                    "status": "ok" if ok else "MISMATCH",
                    "out": errors[0],
                    "dq": errors[1],
                    "dk": errors[2],
                    "dv": errors[3],
                    "ms": 1e3 * (time.perf_counter() - t0),
                }
            )
    return rows


def stock_alone(model, data, device):
    """float32 per-example mean losses and the gradient of their sum, each example alone."""
    model.zero_grad(set_to_none=True)
    losses = []
    for ids, labels in data:
        fresh_rope(model)  # dynamic NTK RoPE: each example on a fresh model's frequencies
        logits = model(input_ids=torch.from_numpy(ids)[None].to(device)).logits[0]
        target = torch.from_numpy(labels[1:]).to(device)
        losses.append(F.cross_entropy(logits[:-1].float(), target, ignore_index=-100))
    losses = torch.stack(losses)
    losses.sum().backward()
    return losses.detach(), _grads(model)


def _grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1) for p in model.parameters()])


def family_rows(device: torch.device) -> list[dict]:
    data = examples()
    ids = np.concatenate([d[0] for d in data])
    labels = np.concatenate([d[1] for d in data])
    positions = np.concatenate([np.arange(len(d[0])) for d in data])
    batch = collate_flat(ids, labels, positions, np.array([len(d[0]) for d in data])).to(device)
    from transformers import CONFIG_MAPPING

    rows = []
    for family in FAMILIES:
        torch._dynamo.reset()  # flex traces its score/mask functions; start each model afresh
        if family.model_type not in CONFIG_MAPPING:
            rows.append({"family": family.name, "status": "absent from this transformers"})
            continue
        base = family.build().to(device)
        if family.refused:
            try:
                prepare(copy.deepcopy(base), "sdpa", device)
                rows.append({"family": family.name, "status": "NOT REFUSED"})
            except UserError as exc:
                rows.append({"family": family.name, "status": "refused", "why": str(exc)})
            continue
        alone, alone_grad = stock_alone(copy.deepcopy(base).eval(), data, device)
        row = {"family": family.name, "features": sorted(family.features | ({"head"} if family.head else set()))}
        reference_grad = None
        try:
            model = copy.deepcopy(base)
            row["auto"], row["auto_why"] = prepare(model, "auto", device)
        except UserError as exc:
            row["auto"] = f"REFUSED: {exc}"
        for backend in ("sdpa", *KERNEL_BACKENDS):
            model = copy.deepcopy(base)
            try:
                prepare(model, backend, device)
            except UserError as exc:
                row[backend] = {"status": "refused", "why": str(exc)}
                continue
            model.eval()
            try:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    packed = per_example_losses(model, batch)
                packed.sum().backward()
            except Exception as exc:  # noqa: BLE001 - recorded, and counted as a failure
                row[backend] = {"status": "MISMATCH", "why": f"{type(exc).__name__}: {str(exc)[:300]}"}
                continue
            loss_err = float(((packed.detach() - alone).abs() / alone.abs()).max())
            if backend == "sdpa":
                reference_grad = _grads(model)
            grad_err = rel(_grads(model), reference_grad)  # reported only, see the docstring
            ok = loss_err < LOSS_TOL
            row[backend] = {"status": "ok" if ok else "MISMATCH", "loss_err": loss_err, "grad_err": grad_err}
        if family.features:  # flex in float32: its losses and gradients against the stock model's
            model = copy.deepcopy(base)
            prepare(model, "flex", device)
            model.eval()
            try:
                packed = per_example_losses(model, batch)
                packed.sum().backward()
            except Exception as exc:  # noqa: BLE001 - recorded, and counted as a failure
                row["flex_fp32"] = {"status": "MISMATCH", "why": f"{type(exc).__name__}: {str(exc)[:300]}"}
            else:
                loss_err = float(((packed.detach() - alone).abs() / alone.abs()).max())
                grad_err = rel(_grads(model), alone_grad)
                ok = loss_err < FP32_TOL and grad_err < FP32_TOL
                row["flex_fp32"] = {"status": "ok" if ok else "MISMATCH", "loss_err": loss_err, "grad_err": grad_err}
        rows.append(row)
    return rows


TRAIN_FAMILIES = ("llama", "gemma2", "gpt_oss", "deepseek_v3", "llama4")


def train_rows(device: torch.device, folder: Path) -> list[dict]:
    from packed_factory import make_packed_folder, pack_lengths

    from trainer import TrainConfig, train

    data = folder / "packed"
    lengths = np.random.default_rng(0).integers(8, 200, size=120).tolist()
    make_packed_folder(data, pack_lengths(lengths, 512, vocab=256), 512, rows_per_shard=16)
    rows = []
    for family in (f for f in FAMILIES if f.name in TRAIN_FAMILIES):
        model_dir = folder / family.name
        family.build().save_pretrained(model_dir)
        config = TrainConfig(
            data=str(data),
            model=str(model_dir),
            out=str(folder / f"run-{family.name}"),
            tokens_per_step=2048,
            max_steps=6,
            log_every=1,
            num_workers=0,
            progress=False,
            lr=1e-3,
        )
        try:
            summary = train(config)
        except Exception as exc:  # noqa: BLE001 - recorded, and counted as a failure
            rows.append({"family": family.name, "status": f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"})
            continue
        metrics = [json.loads(line) for line in (folder / f"run-{family.name}" / "metrics.jsonl").open()]
        losses = [m["loss"] for m in metrics]
        ok = all(np.isfinite(losses)) and summary["compiled"]
        rows.append(
            {
                "family": family.name,
                "attention": summary["attention"],
                "losses": losses,
                "tokens_per_s": summary["tokens_per_s"],
                "status": "ok" if ok else "BAD",
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write every row here")
    args = parser.parse_args()
    if args.json:
        check_output(args.json, "--json")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (this script is for GPU machines)")
        return 1
    device = torch.device("cuda")
    import transformers

    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(device),
        "flash_attn": attention.flash_attn_importable(),
    }
    print(env)
    kernels = kernel_rows(device)
    print(
        f"\nkernels vs float32 reference per example (bf16, tolerance {KERNEL_TOL}; off_by_one: "
        "distance to a window one token wider, must exceed it)"
    )
    for r in kernels:
        if "why" in r:
            print(f"{r['case']:15s} {r['backend']:10s} {r['status']}: {r['why']}")
        else:
            extra = f"  off_by_one {r['off_by_one_err']:.1e}" if "off_by_one_err" in r else ""
            print(
                f"{r['case']:15s} {r['backend']:10s} out {r['out']:.1e} dq {r['dq']:.1e} dk {r['dk']:.1e} "
                f"dv {r['dv']:.1e}{extra}  {r['status']}"
            )
    families = family_rows(device)
    print(
        f"\nfamilies: per-example loss in bf16 vs float32 stock eager alone (rel, tol {LOSS_TOL}) / "
        f"gradient vs the sdpa reference in bf16 (rel, reported only); flex fp32: loss / gradient "
        f"vs the stock model (tol {FP32_TOL})"
    )
    for r in families:
        if "features" not in r:
            print(f"{r['family']:18s} {r['status']}: {r.get('why', '')}")
            continue
        cells = []
        for b in ("sdpa", *KERNEL_BACKENDS):
            c = r[b]
            result = (
                f"{c['status']} ({c['why'][:60]})" if "why" in c else ("{:.1e}/{:.1e} {}".format(c["loss_err"], c["grad_err"], c["status"]))
            )
            cells.append(f"{b} {result}")
        if "flex_fp32" in r:
            c = r["flex_fp32"]
            cells.append(
                f"flex fp32 {c['status']} ({c['why'][:60]})"
                if "why" in c
                else "flex fp32 {:.1e}/{:.1e} {}".format(c["loss_err"], c["grad_err"], c["status"])
            )
        print(f"{r['family']:18s} {','.join(r['features']) or '-':22s} auto={r['auto']:10s} " + " | ".join(cells))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        training = train_rows(device, Path(tmp))
    print("\ntraining steps (auto backend, compiled layers, bf16 autocast):")
    for r in training:
        print(f"{r['family']:12s} {r.get('attention', ''):10s} losses {r.get('losses')}  {r['status']}")
    bad = [r for r in kernels if r["status"] == "MISMATCH"]
    bad += [r for r in training if r["status"] != "ok"]
    bad += [r for r in families if r.get("status") == "NOT REFUSED" or str(r.get("auto", "")).startswith("REFUSED")]
    bad += [
        r
        for r in families
        if any(isinstance(r.get(b), dict) and r[b]["status"] == "MISMATCH" for b in ("sdpa", *KERNEL_BACKENDS, "flex_fp32"))
    ]
    if args.json:
        write_text_output(args.json, json.dumps({"env": env, "kernels": kernels, "families": families, "training": training}, indent=1))
    print("\nALL OK" if not bad else f"\n{len(bad)} PROBLEM(S)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
