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

from pipeline.contract import Manifest, UserError, example_hashes, read_manifest, shared_examples, verify_folder
from trainer.config import TrainConfig
from trainer.data.integrity import shard_problem
from trainer.data.row_split import shard_microbatch
from trainer.data.stream import ShardReader, greedy_cuts
from trainer.distributed.parallel import DistInfo


def held_out_folder(config: TrainConfig, manifest: Manifest) -> Path | None:
    """--eval-data, else the eval folder pack-data wrote inside --data; "none" turns it off. A folder
    that may hold training examples is refused (`check_held_out`), and so are --save-best and
    --eval-every when there is nothing to evaluate on."""
    folder = None
    off = config.eval_data is not None and str(config.eval_data).lower() == "none"
    if config.eval_data is not None and not off:
        folder = Path(config.eval_data)
        if not folder.is_dir():
            raise UserError(f"--eval-data {config.eval_data}: no such folder (a packed folder, e.g. DATA/eval)")
        check_held_out(folder, Path(config.data), manifest)
    elif not off and manifest.eval.get("folder"):
        folder = Path(config.data) / manifest.eval["folder"]
    wanted = [flag for flag, on in (("--save-best", config.save_best), (f"--eval-every {config.eval_every}", config.eval_every)) if on]
    if folder is None and wanted:
        why = (
            "--eval-data none turns evaluation off"
            if off
            else f"{config.data} holds no eval folder (pack-data --eval-fraction) and no --eval-data is given"
        )
        raise UserError(
            f"{wanted[0]} needs held-out data to evaluate on, but {why}: pass --eval-data FOLDER, or drop {wanted[0].split()[0]}"
        )
    return folder


def check_held_out(folder: Path, data: Path, manifest: Manifest) -> None:
    """Refuse an --eval-data `folder` that may hold examples of the training folder `data` (whose
    manifest is `manifest`): the training folder itself, or a folder packed from an input file (same
    sha256 in both manifests), holding a shard that the training folder holds too, or holding any
    example with the tokens of a training example (`example_hashes`: one pass over both folders'
    tokens at start-up). The training
    folder's own held-out split (pack-data --eval-fraction: DATA/eval, or a copy of it) is kept apart
    example by example by pack-data and is accepted."""
    if folder.resolve() == data.resolve():
        raise UserError(
            f"--eval-data {folder} is the training folder --data {data} itself: its loss would be a "
            "training loss; evaluate on held-out data (pack-data --eval-fraction writes DATA/eval)"
        )
    held = read_manifest(folder)
    own = data / manifest.eval["folder"] if manifest.eval.get("folder") else None
    if own is not None and (own / "manifest.json").is_file():
        if folder.resolve() == own.resolve() or [s.sha256 for s in read_manifest(own).shards] == [s.sha256 for s in held.shards]:
            return
    train_inputs = {e.get("sha256"): e.get("path") for e in manifest.inputs if isinstance(e, dict) and e.get("sha256")}
    for entry in held.inputs:
        if isinstance(entry, dict) and entry.get("sha256") in train_inputs:
            raise UserError(
                f"--eval-data {folder} overlaps the training folder --data {data}: both were packed from the same "
                f"input {entry.get('path')} (sha256 {str(entry['sha256'])[:12]}...), so its examples are training "
                "examples; evaluate on held-out data (pack-data --eval-fraction writes DATA/eval)"
            )
    train_shards = {s.sha256 for s in manifest.shards}
    for shard in held.shards:
        if shard.sha256 in train_shards:
            raise UserError(
                f"--eval-data {folder} overlaps the training folder --data {data}: its {shard.file} is a "
                "shard of the training data; evaluate on held-out data (pack-data --eval-fraction "
                "writes DATA/eval)"
            )
    # example by example (one numpy pass over both folders' tokens): an eval file that holds
    # training examples among others, packed from another file or another pack-data run
    shared = shared_examples(example_hashes(data, manifest), example_hashes(folder, held))
    if shared:
        raise UserError(
            f"--eval-data {folder} overlaps the training folder --data {data}: {shared} of its examples "
            "(same tokens) are training examples, so its loss would be partly a training loss; remove "
            "them from the eval input, or evaluate on held-out data (pack-data --eval-fraction writes "
            "DATA/eval)"
        )


class Evaluator:
    """`evaluator(module, autocast)` -> (eval loss, loss tokens) over the whole folder."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        train_manifest: Manifest,
        tokens_per_step: int,
        info: DistInfo,
        device: torch.device,
        share: tuple[int, int] = (0, 1),
    ) -> None:
        manifest = verify_folder(folder, check_hashes=False)
        # mapped now (read from these files only); their sha256 checked here, of these same files
        self.reader = ShardReader(folder, manifest)
        for shard, path, identity in zip(manifest.shards, self.reader.paths, self.reader.identities):
            problem = shard_problem(Path(path), shard.sha256, identity)
            if problem is not None:
                raise UserError(problem)
        want, have = train_manifest.tokenizer.get("fingerprint"), manifest.tokenizer.get("fingerprint")
        if want != have:
            raise UserError(
                f"eval data {folder} was packed with another tokenizer than the training data "
                f"(fingerprint {str(have)[:12]} vs {str(want)[:12]}): pack both with the same one"
            )
        if manifest.loss_tokens == 0:
            raise UserError(f"eval data {folder} has no token that carries a loss: nothing to evaluate")
        self.folder, self.info, self.device = str(folder), info, device
        cuts = greedy_cuts(self.reader.row_lengths(), tokens_per_step)
        self.batches = [np.arange(a, b) for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist())]
        # under context parallelism (`share`: this rank's place in its group) each group evaluates
        # its micro-batches split over its ranks, as it trains them
        self.share = share
        groups, group = info.world_size // share[1], info.rank // share[1]
        per_rank = math.ceil(len(self.batches) / groups)
        self.mine = [i * groups + group for i in range(per_rank)]

    def __call__(self, module: torch.nn.Module, autocast: Any = None) -> tuple[float, int]:
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                for index in self.mine:
                    counted = index < len(self.batches)
                    batch = self.reader.microbatch(self.batches[index if counted else 0])
                    batch = shard_microbatch(batch, *self.share).to(self.device)
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
