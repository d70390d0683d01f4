#!/usr/bin/env python
"""Check `trainer.data.hf.PackedCollator` batches on a CUDA machine with every attention a Hugging Face
user would pick, and pack-train's own backends.

A Llama with 4 layers (hidden 512, 8 query / 4 kv heads, random init) runs a collated batch of packed
rows (random example lengths, bfloat16 autocast); for every attention implementation the logits of
each example are compared with that example run alone with `sdpa` (relative Frobenius error < 2e-2),
and so is the loss of the batch against the token mean of the examples' own losses. Then one
`transformers.Trainer` step per implementation must give a finite loss. Prints a table, writes
`--json`, exits 1 on any mismatch or when there is no CUDA device.

    python tests/gpu/check_gpu_hf.py --json docs/results/check_gpu_hf_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer

from scripts.benchlib import check_output, write_text_output  # noqa: E402
from trainer.data.hf import PackedCollator  # noqa: E402

TOL = 2e-2
VOCAB = 1000


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def rows(n_rows: int, max_len: int, rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    """Packed rows of random examples (1..max_len/2 tokens), each example's first label -100."""
    out = []
    for _ in range(n_rows):
        ids, labels, pos, left = [], [], [], max_len
        while left > 0:
            n = int(min(left, rng.integers(1, max_len // 2)))
            tokens = rng.integers(3, VOCAB, n)
            ids.append(tokens)
            labels.append(np.concatenate(([-100], tokens[1:])))
            pos.append(np.arange(n))
            left -= n
        out.append({"input_ids": np.concatenate(ids), "labels": np.concatenate(labels), "position_ids": np.concatenate(pos)})
    return out


def model(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    m = LlamaForCausalLM(config).cuda()
    if attn.startswith("packlm-"):
        from trainer.model.load import prepare

        prepare(m, attn.removeprefix("packlm-"), "cuda")
    else:
        m.config._attn_implementation = attn
    return m


def check(attn: str, batch: dict, reference) -> dict:
    m = model(attn).eval()
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out = m(**cuda)
        cu = batch["cu_seq_lens_q"].tolist()
        worst, total, count = 0.0, 0.0, 0
        for a, b in zip(cu[:-1], cu[1:]):
            alone = reference(input_ids=cuda["input_ids"][:, a:b], labels=cuda["labels"][:, a:b])
            worst = max(worst, rel(out.logits[0, a:b], alone.logits[0]))
            n = int((cuda["labels"][0, a + 1 : b] != -100).sum())
            if n:
                total += float(alone.loss) * n
                count += n
    loss_err = abs(float(out.loss) - total / count) / (total / count)
    return {"attn": attn, "worst_example_logits_rel": worst, "loss_rel": loss_err, "ok": bool(worst < TOL and loss_err < TOL)}


def trainer_step(attn: str, data: list[dict], out: Path) -> float:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        str(out / attn),
        per_device_train_batch_size=2,
        max_steps=2,
        bf16=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
    )
    t = Trainer(model=model(attn), args=args, train_dataset=data, data_collator=PackedCollator())
    t.train()
    return [r["loss"] for r in t.state.log_history if "loss" in r][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.json:
        check_output(args.json, "--json")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    from trainer.attention.kernels import flash_attn_importable

    data = rows(4, args.max_len, np.random.default_rng(0))
    batch = PackedCollator()(data[:2])
    reference = model("sdpa").eval()
    impls = ["sdpa", "eager", "flex_attention", "packlm-torch", "packlm-flex", "packlm-sdpa"]
    if flash_attn_importable():
        impls[:0] = ["flash_attention_2"]
        impls.append("packlm-flash_attn")
    results = []
    for attn in impls:
        try:
            r = check(attn, batch, reference)
            r["trainer_loss"] = trainer_step(attn, data, Path("/tmp/check_gpu_hf"))
            r["ok"] = bool(r["ok"] and np.isfinite(r["trainer_loss"]))
        except Exception as exc:  # noqa: BLE001 - reported per implementation
            r = {"attn": attn, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        results.append(r)
        print(json.dumps(r), flush=True)
    device = torch.cuda.get_device_name()
    if args.json:
        write_text_output(
            args.json,
            json.dumps({"device": device, "torch": torch.__version__, "max_len": args.max_len, "results": results}, indent=2) + "\n",
        )
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
