"""The peer of `pack-train --context-parallel N` (issue 57): ring-flash-attn's Hugging Face adapter
fed the same rows, one row a step, each of the N ranks holding a contiguous 1/N of it.

Run through `scripts/bench/bench_context_parallel.py peer` (under torchrun). Per step, on every rank:

- the row (one or more examples; `pipeline.shards` rows) is padded to a multiple of N with one
  extra "example" of pad tokens that carries no loss and is not counted; the next-token labels are
  taken on the whole row (`labels[1:]`, pack-data's -100 at each example's first token keeps an
  example's last token from predicting the next example), then each rank takes its contiguous slice
  of the ids, the position ids (restarting at each example) and those labels (`row_share`);
- the model: the preset's Llama config, random weights (seeded), the frozen base in bf16 on CUDA
  (as pack-train stores a LoRA base), peft LoRA on every linear layer of the decoder (fp32
  adapters), HF gradient checkpointing of every decoder layer (use_reentrant=False), bf16 autocast;
  its attention is ring-flash-attn's llama3 varlen function (`install_ring`: the adapter's
  `substitute_hf_flash_attn`, boundaries from `update_ring_flash_attn_params` with the padded row's
  cu_seqlens, so each example attends only within itself across the ranks);
- loss = this rank's summed token losses / the whole row's loss tokens (the LM head and cross
  entropy in chunks, each recomputed in the backward, so the logits of a long share are never whole);
  backward; the adapters' gradients are partial sums, all-reduced (SUM); AdamW step.

The first forward must call the ring function once per decoder layer, else the run stops
(`ring_attention.RingCalls.check`): a transformers release whose flash_attention_2 path bypasses
the patch would otherwise time plain per-rank flash attention.

`fake=True` (CPU, gloo) replaces the ring function by an exact reference (`ring_attention.fake_ring`:
K and V all-gathered over the group, attention with each example's causal mask at global
positions) under the sdpa slot; it needs no ring_flash_attn, so the slicing, the loss and the
gradient sync are checked on the CPU against the examples run one by one (tests/scripts).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .ring_attention import ReferenceRing, RingCalls, fake_ring, install_ring, set_ring_row

IGNORE = -100
LOSS_CHUNK = 8192  # tokens whose logits exist at once in the loss


@dataclass
class Share:
    """One rank's slice of a row, and what the whole row holds."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    targets: np.ndarray  # next-token labels of the slice (-100: no loss)
    cu_seqlens: np.ndarray  # the padded row's example boundaries (int32), the same on every rank
    row_tokens: int  # tokens of the row, padding excluded
    loss_tokens: int  # loss tokens of the whole row


def row_share(row: dict[str, np.ndarray], rank: int, world: int, pad_id: int = 0) -> Share:
    """Rank `rank`'s contiguous 1/`world` of `row` (see the module).

    >>> row = {"input_ids": np.arange(10, 15), "labels": np.array([-100, 11, 12, -100, 14]),
    ...        "position_ids": np.array([0, 1, 2, 0, 1]), "seq_lens": np.array([3, 2])}
    >>> s = row_share(row, 1, 2)
    >>> s.input_ids.tolist(), s.position_ids.tolist(), s.targets.tolist(), s.cu_seqlens.tolist()
    ([13, 14, 0], [0, 1, 0], [14, -100, -100], [0, 3, 5, 6])
    >>> s.row_tokens, s.loss_tokens
    (5, 3)
    """
    ids, labels = np.asarray(row["input_ids"]), np.asarray(row["labels"])
    positions, seq_lens = np.asarray(row["position_ids"]), np.asarray(row["seq_lens"])
    n = len(ids)
    pad = -n % world
    targets = np.concatenate([labels[1:], [IGNORE]]).astype(np.int64)
    if pad:
        ids = np.concatenate([ids, np.full(pad, pad_id, dtype=ids.dtype)])
        positions = np.concatenate([positions, np.arange(pad, dtype=positions.dtype)])
        targets = np.concatenate([targets, np.full(pad, IGNORE, dtype=np.int64)])
        seq_lens = np.concatenate([seq_lens, [pad]])
    width = (n + pad) // world
    part = slice(rank * width, (rank + 1) * width)
    return Share(
        input_ids=ids[part],
        position_ids=positions[part],
        targets=targets[part],
        cu_seqlens=np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32),
        row_tokens=int(n),
        loss_tokens=int((targets != IGNORE).sum()),
    )


# -------------------------------------------------------------------------- the model and a step


def build_peer_model(
    preset: str, vocab: int | None, device: torch.device, *, lora_r: int, seed: int, attn: str, init_lora_weights: bool = True
) -> Any:
    """The peft model (see the module): bf16 base on CUDA, fp32 on the CPU; gradient checkpointing."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from .training import model_config

    torch.manual_seed(seed)
    with torch.device(device):  # initialized where it trains: an 8B model's random init is slow on the CPU
        model = AutoModelForCausalLM.from_config(
            model_config(preset, vocab), attn_implementation=attn, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(
        r=lora_r, lora_alpha=16.0, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM", init_lora_weights=init_lora_weights
    )
    return get_peft_model(model, lora).train()  # peft keeps the adapters in fp32 over a bf16 base


def loss_sum(model: Any, ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed token losses of one sequence (1-D tensors); the LM head and cross entropy run in
    chunks of LOSS_CHUNK tokens, each recomputed in the backward."""
    from torch.utils.checkpoint import checkpoint

    base = model.get_base_model()
    hidden = base.model(input_ids=ids[None], position_ids=positions[None]).last_hidden_state[0]

    def chunk(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(base.lm_head(h).float(), t, ignore_index=IGNORE, reduction="sum")

    return sum(
        checkpoint(chunk, hidden[s : s + LOSS_CHUNK], targets[s : s + LOSS_CHUNK], use_reentrant=False)
        for s in range(0, len(targets), LOSS_CHUNK)
    )


def sync_grads(params: list[torch.nn.Parameter], group: Any) -> None:
    """Sum the trainable parameters' gradients over the group (one flat all-reduce)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def peer_backward(
    model: Any, share: Share, device: torch.device, group: Any, *, calls: RingCalls | None = None, layers: int | None = None, what: str = ""
) -> torch.Tensor:
    """Forward and backward of one rank's share, gradients synced; returns the whole row's mean loss
    (all-reduced). With `calls`, stops unless the forward called the ring function `layers` times."""
    ids = torch.from_numpy(share.input_ids.astype(np.int64)).to(device)
    positions = torch.from_numpy(share.position_ids.astype(np.int64)).to(device)
    targets = torch.from_numpy(share.targets).to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    if calls is not None:
        calls.n = 0
    with autocast:
        loss = loss_sum(model, ids, positions, targets) / share.loss_tokens
    if calls is not None:
        calls.check(layers, what)
    loss.backward()
    sync_grads([p for p in model.parameters() if p.requires_grad], group)
    loss = loss.detach().float().reshape(1)
    dist.all_reduce(loss, group=group)
    return loss[0]


def run_peer(
    rows: list[dict[str, np.ndarray]],
    *,
    preset: str,
    vocab: int | None,
    lora_r: int,
    steps: int,
    warmup: int,
    lr: float,
    seed: int,
    fake: bool,
    heads_k_stride: int,
) -> dict[str, Any]:
    """W warm-up steps then S timed steps of the peer on `rows` (row k at step k, cyclically), in the
    default process group (made by the caller); the record (rank 0's is the one to keep)."""
    import transformers

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if fake else torch.device("cuda", torch.cuda.current_device())
    calls = RingCalls()
    state = ReferenceRing(group=None)
    if fake:
        ctx: Any = fake_ring(state, calls)
        how = "fake ring: exact reference attention (all-gathered K/V, per-example causal masks)"
    else:
        ctx = contextlib.nullcontext()
        how = install_ring(None, heads_k_stride, calls)
    model = build_peer_model(preset, vocab, device, lora_r=lora_r, seed=seed, attn="sdpa" if fake else "flash_attention_2")
    layers = model.get_base_model().config.num_hidden_layers
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, fused=device.type == "cuda")
    times, tokens, losses = [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with ctx:
        for step in range(warmup + steps):
            _sync(device)
            start = time.perf_counter()  # the share and the ring's row state are part of a step
            share = row_share(rows[step % len(rows)], rank, world)
            cu = torch.from_numpy(share.cu_seqlens).to(device)
            if fake:
                state.cu_seqlens = cu.cpu()
            else:
                set_ring_row(cu, None)
            loss = peer_backward(
                model, share, device, None, calls=calls if step == 0 else None, layers=layers, what="the ring attention function"
            )
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            times.append(time.perf_counter() - start)
            tokens.append(share.row_tokens)
            losses.append(float(loss))
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0], device=device)
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    seconds, timed = sum(times[warmup:]), sum(tokens[warmup:])
    rate = timed / seconds if seconds > 0 else 0.0
    from .training import flop_rates

    flops = timed_flops([rows[step % len(rows)] for step in range(warmup, warmup + steps)], model.get_base_model().config, lora_r)
    return {
        "peer": "ring-flash-attn HF adapter (llama3 varlen)",
        "attention": how,
        "world_size": world,
        "model": preset,
        "lora_r": lora_r,
        "grad_checkpointing": "every layer (HF, use_reentrant=False)",
        "heads_k_stride": heads_k_stride,
        "transformers": transformers.__version__,
        "row_tokens": tokens[0],
        "steps": steps,
        "warmup": warmup,
        "step_s": [round(t, 4) for t in times],
        "tokens_per_s": rate,
        "tokens_per_s_per_gpu": rate / world,
        **flop_rates(flops.model, flops.attention, seconds * world),  # a GPU's share of the time
        "peak_mem_gib": [float(p) for p in peaks] if device.type == "cuda" else None,
        "final_loss": losses[-1],
        "ring_calls_first_forward": layers,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


def timed_flops(rows: list[dict[str, np.ndarray]], config: Any, lora_r: int) -> Any:
    """The model FLOPs of these rows (`pipeline.report.flops`, every layer recomputed as the peer
    does): the same count pack-train's metrics give its own steps."""
    from pipeline.report.flops import StepFlops, step_flops

    from .train_results import flop_shape, loss_tokens_of

    shape = flop_shape(config, lora_r, 1)
    return sum((step_flops(shape, row["seq_lens"], loss_tokens=loss_tokens_of([row["labels"]])) for row in rows), StepFlops())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peer_main(
    data: str,
    *,
    preset: str,
    lora_r: int,
    steps: int,
    warmup: int,
    lr: float,
    seed: int,
    fake: bool,
    heads_k_stride: int,
    json_path: str | None,
) -> None:
    """`bench_context_parallel.py peer`: the rows of a packed folder, the process group (nccl, or
    gloo with `fake`), `run_peer`, rank 0's record printed and written to `json_path`."""
    import os

    from pipeline.shards import iter_rows, read_manifest
    from pipeline.shards.verify import manifest_vocab

    if not fake:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo" if fake else "nccl")
    rows = list(iter_rows(data))
    vocab = manifest_vocab(read_manifest(data).tokenizer)  # as pack-train sizes the model (None: the preset's)
    record = run_peer(
        rows,
        preset=preset,
        vocab=vocab,
        lora_r=lora_r,
        steps=steps,
        warmup=warmup,
        lr=lr,
        seed=seed,
        fake=fake,
        heads_k_stride=heads_k_stride,
    )
    if dist.get_rank() == 0:
        record["data"] = str(data)
        print(json.dumps(record, indent=1))
        if json_path:
            from .output import write_text_output

            write_text_output(json_path, json.dumps(record, indent=1))
    dist.barrier()
    dist.destroy_process_group()
