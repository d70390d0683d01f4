"""Held-out evaluation: the token-mean loss over a whole packed folder, without gradients, exact
across ranks.

The eval folder (`pack-data --eval-fraction` writes it as `DATA/eval`) is cut, in row order, into
micro-batches of at most `tokens_per_step` tokens, exactly as training cuts its rows; micro-batch i
goes to rank i % world_size. Each rank sums its token losses and loss tokens; one all-reduce gives
sum / count over every loss token of the folder, the same number on every rank and for any number
of ranks. Every rank runs the same number of forward passes (a rank short of micro-batches runs the
first one again and does not count it), since DDP and FSDP forwards are collective.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline.errors import UserError
from pipeline.shards import Manifest, verify_folder
from trainer.parallel import DistInfo
from trainer.integrity import shard_problem
from trainer.stream import ShardReader, greedy_cuts


class Evaluator:
    """`evaluator(module, autocast)` -> (eval loss, loss tokens) over the whole folder."""

    def __init__(self, folder: str | os.PathLike[str], train_manifest: Manifest, tokens_per_step: int,
                 info: DistInfo, device: torch.device) -> None:
        manifest = verify_folder(folder, check_hashes=False)
        # mapped now (read from these files only); their sha256 checked here, of these same files
        self.reader = ShardReader(folder, manifest)
        for shard, path, identity in zip(manifest.shards, self.reader.paths, self.reader.identities):
            problem = shard_problem(Path(path), shard.sha256, identity)
            if problem is not None:
                raise UserError(problem)
        want, have = train_manifest.tokenizer.get("fingerprint"), manifest.tokenizer.get("fingerprint")
        if want != have:
            raise UserError(f"eval data {folder} was packed with another tokenizer than the training data "
                            f"(fingerprint {str(have)[:12]} vs {str(want)[:12]}): pack both with the same one")
        if manifest.loss_tokens == 0:
            raise UserError(f"eval data {folder} has no token that carries a loss: nothing to evaluate")
        self.folder, self.info, self.device = str(folder), info, device
        cuts = greedy_cuts(self.reader.row_lengths(), tokens_per_step)
        self.batches = [np.arange(a, b) for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist())]
        per_rank = math.ceil(len(self.batches) / info.world_size)
        self.mine = [i * info.world_size + info.rank for i in range(per_rank)]

    def __call__(self, module: torch.nn.Module, autocast: Any = None) -> tuple[float, int]:
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                for index in self.mine:
                    counted = index < len(self.batches)
                    batch = self.reader.microbatch(self.batches[index if counted else 0]).to(self.device)
                    with autocast if autocast is not None else contextlib.nullcontext():
                        loss_sum = module(batch)
                    if counted:
                        total[0] += loss_sum.double()
                        total[1] += batch.n_loss_tokens
        finally:
            module.train(was_training)
        if self.info.enabled:
            dist.all_reduce(total)
        return float(total[0] / total[1]), int(total[1])
