"""TRL's side of bench_trl.py (its child process runs one path): one `trl.SFTTrainer` run on a
packed folder's examples, handed over pre-tokenized (`trl_data.trl_dataset`) and packed by TRL
itself (`packing_strategy="bfd"`, padding-free, `completion_only_loss`), checked to hold the
folder's examples, tokens and loss tokens before it trains; timed by a callback that waits for the
GPU at each step's end, its tokens counted as the collator builds each batch, its FLOPs by the one
count (`pipeline.report.flops`). The path's options: `ckpt` (HF gradient checkpointing), `liger`,
`compile` (`torch_compile=True`), `offload` (`activation_offloading=True`), `fa4` (transformers'
`flash_attention_4` instead of `flash_attention_2`)."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from .trl_data import folder_totals, packed_totals, steady_rate, trl_dataset


def run_trl(a: argparse.Namespace, options: set[str]) -> dict[str, Any]:
    """One TRL SFTTrainer run of `a.folder`'s examples with the path's `options` (see the module);
    the result record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, ProgressCallback, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from .packing import tokenizer_ids
    from .shared import LLAMA2
    from .training import model_config

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    folder = Path(a.folder)
    vocab, _ = tokenizer_ids(folder)
    want = folder_totals(folder)
    tokenizer = AutoTokenizer.from_pretrained(Path(a.shared) / LLAMA2)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    lora = a.lora_r > 0
    attn = ("flash_attention_4" if "fa4" in options else "flash_attention_2") if cuda else "sdpa"
    torch.manual_seed(a.seed)
    with torch.device(device):  # initialized where it trains: an 8B model's random init is slow on the CPU
        model = AutoModelForCausalLM.from_config(
            model_config(a.model, vocab),
            attn_implementation=attn,
            dtype=torch.bfloat16 if lora and cuda else torch.float32,
        )
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=a.lora_r, lora_alpha=16.0, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    out = tempfile.mkdtemp(prefix="trl-", dir=a.workdir)
    args = SFTConfig(
        output_dir=out,
        max_steps=a.steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing="ckpt" in options,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        use_liger_kernel="liger" in options,
        torch_compile="compile" in options,
        activation_offloading="offload" in options,
        packing=True,
        packing_strategy="bfd",
        padding_free=True,
        max_length=a.max_len,
        completion_only_loss=True,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=a.seed,
        dataloader_num_workers=0,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=trl_dataset(folder), processing_class=tokenizer, peft_config=peft_config)
    got = packed_totals(trainer.train_dataset)
    same = all(got[k] == want[k] for k in ("examples", "tokens", "loss_tokens"))
    if not same:
        raise SystemExit(f"TRL's packed dataset {got} does not hold the folder's examples {want}")

    counts: list[tuple[int, int, int]] = []  # per collated batch: tokens, loss tokens, examples
    lengths: list[list[int]] = []  # per collated batch: its examples' lengths (for the FLOP count)
    collate = trainer.data_collator

    def counting(examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = collate(examples)
        counts.append(
            (sum(len(e["input_ids"]) for e in examples), int((batch["labels"] != -100).sum()), sum(len(e["seq_lengths"]) for e in examples))
        )
        lengths.append([int(n) for e in examples for n in e["seq_lengths"]])
        return batch

    trainer.data_collator = counting
    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, D102
            if not times:
                if cuda:
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, D102
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter())

    trainer.add_callback(StepTimes())
    for quiet in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(quiet)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    steps = len(times) - 1
    tokens, seconds, rate = steady_rate([c[0] for c in counts[:steps]], times, a.warmup)
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    from pipeline.report.flops import StepFlops, step_flops

    from .train_results import flop_shape
    from .training import flop_rates

    shape = flop_shape(model_config(a.model, vocab), a.lora_r, 1 if "ckpt" in options else 0)
    flops = sum((step_flops(shape, lengths[k], loss_tokens=counts[k][1]) for k in range(a.warmup, steps)), StepFlops())
    return {
        "status": "ok",
        "steps": steps,
        "timed_steps": steps - a.warmup,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": rate,
        **flop_rates(flops.model, flops.attention, seconds),
        "loss_tokens": int(sum(c[1] for c in counts[:steps])),
        "examples": int(sum(c[2] for c in counts[:steps])),
        "step_tokens": [c[0] for c in counts[:steps]],
        "final_loss": losses[-1] if losses else None,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "dataset": {"folder": want, "trl_packed": got, "same_examples": same},
        "runner": f"trl SFTTrainer, {attn}",
    }
