"""Packed folders in Hugging Face's trainers: a dataset over the shards and a collator for it.

`packed_dataset(folder)` is a map-style `datasets.Dataset` over the folder's shards, memory-mapped
in place (`Dataset.from_file`: nothing is copied into the datasets cache), one packed row per item,
after `verify_folder` proved the folder intact. `PackedCollator` concatenates the rows of a batch
into one flat sequence, as `transformers.DataCollatorWithFlattening` does and as pack-train's own
micro-batches are (`trainer.data.batch`):

    >>> collate = PackedCollator()
    >>> batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 2]},
    ...                  {"input_ids": [8, 9], "labels": [-100, 9], "position_ids": [0, 1]}])
    >>> batch["input_ids"].tolist(), batch["position_ids"].tolist(), batch["cu_seq_lens_q"].tolist()
    ([[5, 6, 7, 8, 9]], [[0, 1, 2, 0, 1]], [0, 3, 5])

- `labels` are the shards' labels, unshifted, as Hugging Face's causal-LM loss expects (it shifts
  them itself). The first label of every example is -100 in the shards, so no token is trained to
  predict the next example's first token, across rows or within one.
- The example boundaries come from `position_ids` (0 starts an example), so the collator needs no
  column a model's forward lacks: `Trainer`'s `remove_unused_columns` may stay on.
- `cu_seq_lens_q/k` and `max_length_q/k` are the kwargs transformers' `flash_attention_2` reads for
  packed input, and pack-train's own attention backends too (`trainer.model.load.prepare`); `sdpa`,
  `eager` and `flex_attention` find the boundaries from `position_ids` themselves, but only when
  the model runs without a KV cache: with one (`use_cache`, on in most model configs, also while
  training) transformers skips that and every example attends to the ones before it in the batch.
  So the batch carries `use_cache=False`.
- With `Trainer`, the loss over a step is the token mean over all its micro-batches and ranks
  (`num_items_in_batch`), the same quantity pack-train optimises.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pipeline.contract import shard_paths, verify_folder

# TRL's SFTConfig turns `gradient_checkpointing` on by default, an argument transformers 5 renamed
# `activation_checkpointing`, so every SFTConfig() warns of a name its user never wrote; only that
# message is silenced.
warnings.filterwarnings("ignore", message="`gradient_checkpointing` is deprecated", category=FutureWarning)


def packed_dataset(folder: str | os.PathLike[str], *, check_hashes: bool = True) -> Any:
    """A `datasets.Dataset` of the packed rows of `folder` (columns input_ids, labels, position_ids,
    seq_lens, example_ids), memory-mapped from the shards, after `verify_folder` (with the sha256 of
    every shard unless `check_hashes` is False). Items come back as numpy arrays."""
    import datasets

    manifest = verify_folder(folder, check_hashes=check_hashes)
    parts = [datasets.Dataset.from_file(str(path)) for path in shard_paths(folder, manifest)]
    data = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return data.with_format("numpy")


class PackedCollator:
    """Rows of a packed folder -> one flat batch of shape [1, T] (see the module docstring).

    `return_flash_attn_kwargs` (default True) adds `cu_seq_lens_q/k` and `max_length_q/k`;
    turn it off for a model whose forward refuses unknown keyword arguments."""

    def __init__(self, return_flash_attn_kwargs: bool = True) -> None:
        if not isinstance(return_flash_attn_kwargs, bool):
            raise ValueError(f"PackedCollator(return_flash_attn_kwargs=...) must be True or False, got {return_flash_attn_kwargs!r}")
        self.return_flash_attn_kwargs = return_flash_attn_kwargs

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if isinstance(rows, (Mapping, str, bytes)) or not isinstance(rows, Sequence):
            raise ValueError(f"PackedCollator takes a list of rows (dicts of input_ids, labels, position_ids), got {type(rows).__name__}")
        if not rows:
            raise ValueError("PackedCollator needs at least one row")
        flat = {name: np.concatenate([_column(r, name, i) for i, r in enumerate(rows)]) for name in ("input_ids", "labels", "position_ids")}
        if not len(flat["input_ids"]) or not len(flat["labels"]) == len(flat["position_ids"]) == len(flat["input_ids"]):
            raise ValueError("rows need input_ids, labels and position_ids of one equal, non-zero length each")
        starts = np.flatnonzero(flat["position_ids"] == 0)
        if not len(starts) or starts[0] != 0:
            raise ValueError("position_ids must start every row's first example at 0")
        batch: dict[str, Any] = {name: torch.from_numpy(values)[None] for name, values in flat.items()}
        batch["use_cache"] = False  # with a cache, transformers' masks ignore the packed position_ids
        if self.return_flash_attn_kwargs:
            cu = np.append(starts, len(flat["input_ids"])).astype(np.int32)
            longest = int(np.diff(cu).max())
            batch.update(
                cu_seq_lens_q=torch.from_numpy(cu), cu_seq_lens_k=torch.from_numpy(cu.copy()), max_length_q=longest, max_length_k=longest
            )
        return batch


def _column(row: Any, name: str, index: int) -> np.ndarray:
    """Column `name` of row number `index` of a batch as int64, or ValueError naming the row."""
    if not isinstance(row, Mapping):
        raise ValueError(f"PackedCollator: row {index} is a {type(row).__name__}, not a dict of input_ids, labels and position_ids")
    if name not in row:
        raise ValueError(
            f"PackedCollator: row {index} has no {name!r} (it has {', '.join(map(str, row))}); "
            "rows need input_ids, labels and position_ids, as packed_dataset's items have"
        )
    values = np.asarray(row[name])
    if values.ndim != 1 or not (np.issubdtype(values.dtype, np.integer) or values.size == 0):
        raise ValueError(
            f"PackedCollator: row {index}'s {name!r} must be a flat list of integers, got {values.dtype} of shape {values.shape}"
        )
    return values.astype(np.int64)
