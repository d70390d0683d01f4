"""A packed micro-batch: several shard rows concatenated into one flat [1, T] sequence.

Everything the step needs to find example boundaries (`cu_seqlens`, `max_seqlen`, the number of loss
tokens) is computed here on the CPU, so the GPU step never syncs with the host to discover them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from pipeline.contract import IGNORE_INDEX


@dataclass
class MicroBatch:
    """One flat packed micro-batch.

    `targets[t]` is the token to predict at position t (labels shifted left by one); it is -100 at
    the last token of every example because the first label of every example is -100 in the shards.
    """

    input_ids: torch.Tensor  # int64 [1, T]
    targets: torch.Tensor  # int64 [1, T]
    position_ids: torch.Tensor  # int64 [1, T]
    cu_seqlens: torch.Tensor  # int32 [n_examples + 1]
    max_seqlen: int
    n_tokens: int
    n_loss_tokens: int
    n_examples: int
    # under context parallelism, this rank's share of the row (trainer.data.row_split.RowShard):
    # cu_seqlens then cut the share into pieces, and attention reads the rest from it
    context: Any = None

    def to(self, device: torch.device | str, non_blocking: bool = True) -> MicroBatch:
        """Copy tensors to `device`. To a GPU, host tensors are first pinned (page-locked) here, in
        the calling thread, so the copies are asynchronous (`trainer.data.stream.make_loader` says why
        not in the DataLoader)."""
        pin = non_blocking and torch.device(device).type == "cuda"
        return self._map_tensors(lambda t: (t.pin_memory() if pin and t.device.type == "cpu" else t).to(device, non_blocking=non_blocking))

    def _map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return MicroBatch(**{k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in values.items()})

    def model_kwargs(self) -> dict:
        """Keyword arguments for a Hugging Face causal LM whose attention is packed varlen."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }


def collate_rows(rows: Sequence[dict[str, np.ndarray]]) -> MicroBatch:
    """Concatenate shard rows (dicts of numpy arrays as in `pipeline.shards.iter_rows`)."""
    if not rows:
        raise ValueError("collate_rows needs at least one row")
    input_ids = np.concatenate([r["input_ids"] for r in rows]).astype(np.int64)
    labels = np.concatenate([r["labels"] for r in rows]).astype(np.int64)
    position_ids = np.concatenate([r["position_ids"] for r in rows]).astype(np.int64)
    seq_lens = np.concatenate([r["seq_lens"] for r in rows]).astype(np.int64)
    return collate_flat(input_ids, labels, position_ids, seq_lens)


def collate_flat(input_ids: np.ndarray, labels: np.ndarray, position_ids: np.ndarray, seq_lens: np.ndarray) -> MicroBatch:
    """Build a MicroBatch from already concatenated flat arrays."""
    targets = np.full_like(labels, IGNORE_INDEX, dtype=np.int64)
    targets[:-1] = labels[1:]
    cu = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(seq_lens, out=cu[1:])
    if int(cu[-1]) != len(input_ids):
        raise ValueError(f"seq_lens sum to {int(cu[-1])} but the batch has {len(input_ids)} tokens")
    return MicroBatch(
        input_ids=torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64))[None],
        targets=torch.from_numpy(targets)[None],
        position_ids=torch.from_numpy(np.ascontiguousarray(position_ids, dtype=np.int64))[None],
        cu_seqlens=torch.from_numpy(cu),
        max_seqlen=int(seq_lens.max()) if len(seq_lens) else 0,
        n_tokens=len(input_ids),
        n_loss_tokens=int((targets != IGNORE_INDEX).sum()),
        n_examples=len(seq_lens),
    )
