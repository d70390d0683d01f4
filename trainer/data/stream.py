"""Stream packed shards as seeded, rank-split micro-batches.

`open_data` (`trainer.run.preflight`) checks the packed folder before training (its structure, that
some token carries a loss, the tokenizer's fingerprint). Every epoch the planner takes a seeded permutation of all rows
(of all shards), cuts it greedily into micro-batches of at most `tokens_per_step` tokens (a row
longer than the budget becomes a micro-batch of its own), drops the tail so the count is a multiple
of `world_size * grad_accum`, and gives micro-batch i to rank i % world_size. Every rank therefore
sees the same number of micro-batches and optimizer steps (no hang at the end of an epoch), the
ranks' data are disjoint, and the plan is a pure function of (seed, epoch), so a data cursor of
(epoch, micro-batch index) resumes exactly. A folder of groups (`--strategy minibatch`, stepped by
group) is planned by `trainer.data.plan.group_plan` instead: the groups in a seeded order, one
optimizer step taking the next `world_size` of them, one a rank (`Planner.step_share`).

Loading is a map-style dataset keyed by (epoch, local micro-batch index): the training process maps
the shards at start (`ShardReader`), DataLoader workers forked from it gather the rows with numpy
slices and build a `MicroBatch` (`collate_flat`), whose cu_seqlens / max_seqlen / loss-token count
are computed here on the CPU.
"""

from __future__ import annotations

import os
import re
import signal
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.contract import TOKEN_COLUMNS, Manifest, ShardColumns, UserError, load_shard, shard_paths
from trainer.data.batch import MicroBatch, collate_flat
from trainer.data.plan import EpochPlan, StepShare, greedy_cuts, group_plan, group_share  # noqa: F401 - greedy_cuts: evaluate's
from trainer.data.row_split import shard_microbatch


def row_lengths(folder: str | os.PathLike[str], manifest: Manifest, shards: list[ShardColumns] | None = None) -> np.ndarray:
    """Token count of every row of the folder, in global row order (reads only the offsets);
    `shards`: the folder's shards already open (a `ShardReader`'s), else they are opened here."""
    parts = []
    for i, (path, info) in enumerate(zip(shard_paths(folder, manifest), manifest.shards)):
        offsets = (load_shard(path) if shards is None else shards[i]).row_off
        if len(offsets) - 1 != info.rows:
            raise UserError(
                f"{path}: has {len(offsets) - 1} rows but the manifest says {info.rows}: the folder is damaged, re-run pack-data"
            )
        parts.append(np.diff(offsets))
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


class Planner:
    """Seeded per-epoch micro-batch plans, split across data-parallel ranks.

    With `groups` (the rows of each group of a `--strategy minibatch` folder, in row order) an
    optimizer step is whole groups instead: every epoch takes the groups in a seeded order and cuts
    each group's rows greedily into micro-batches of at most `tokens_per_step` tokens; a step takes
    the next `world_size` groups, one a rank, so it holds exactly the examples of W groups as the
    source tool's padded batches of W processes do (grad_accum 1: a group already holds the file's
    accumulation, `pipeline.foreign.batch.group_size`). The epoch's last step may hold fewer groups
    than ranks (the Hugging Face Trainer's last batch is smaller too: dataloader_drop_last False).
    This rank is `rank`; `even` (FSDP2, whose every forward gathers the weights over the ranks): each
    rank reads as many micro-batches as the step's fullest group, padded with fillers."""

    def __init__(
        self,
        lengths: np.ndarray,
        tokens_per_step: int,
        *,
        seed: int = 0,
        world_size: int = 1,
        grad_accum: int = 1,
        shuffle: bool = True,
        groups: list[int] | None = None,
        rank: int = 0,
        even: bool = False,
    ) -> None:
        if tokens_per_step < 1 or world_size < 1 or grad_accum < 1:
            raise UserError("tokens_per_step, world_size and grad_accum must all be >= 1")
        if groups and grad_accum != 1:
            raise UserError(
                f"--grad-accum {grad_accum} with stepping by group: a group is already a rank's whole "
                "optimizer step (an Axolotl/TRL file's per-device batch x gradient_accumulation_steps "
                "examples): pack with --group-size B x N and drop --grad-accum, or step by token budget "
                "with --no-step-by-group"
            )
        if groups and sum(groups) != len(lengths):
            raise UserError(f"the folder's groups hold {sum(groups)} rows but it has {len(lengths)}: re-run pack-data")
        self.groups = np.asarray(groups or [], dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.tokens_per_step = int(tokens_per_step)
        self.seed = int(seed)
        self.world_size = int(world_size)
        self.grad_accum = int(grad_accum)
        self.shuffle = shuffle
        self.rank, self.even = int(rank), even
        self._cache: OrderedDict[int, EpochPlan] = OrderedDict()

    @property
    def group(self) -> int:
        """Micro-batches per optimizer step over all ranks."""
        return self.world_size * self.grad_accum

    def plan(self, epoch: int) -> EpochPlan:
        """The plan of `epoch` (cached: a pure function of seed and epoch)."""
        if epoch in self._cache:
            return self._cache[epoch]
        n = len(self.lengths)
        if len(self.groups):
            plan = group_plan(self.lengths, self.groups, self.tokens_per_step, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        elif self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(n).astype(np.int64)
        else:
            order = np.arange(n, dtype=np.int64)
        if not len(self.groups):
            cuts = greedy_cuts(self.lengths[order], self.tokens_per_step)
            n_mb = len(cuts) - 1
            keep = n_mb - n_mb % self.group
            plan = EpochPlan(
                epoch=epoch,
                order=order,
                cuts=cuts[: keep + 1],
                n_dropped_microbatches=n_mb - keep,
                n_long_rows=int((self.lengths > self.tokens_per_step).sum()),
            )
        self._cache[epoch] = plan
        while len(self._cache) > 2:
            self._cache.popitem(last=False)
        return plan

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps of `epoch` (the same on every rank)."""
        if len(self.groups):
            return -(-len(self.groups) // self.world_size)
        return self.plan(epoch).n_microbatches // self.group

    def step_share(self, epoch: int, step: int) -> StepShare:
        """This rank's micro-batches of optimizer step `step` of `epoch`: `grad_accum` local indices;
        stepping by group, the micro-batches of this rank's group (global indices of the epoch's plan),
        then fillers (the first micro-batch of the step's first group) where a rank has no group left
        in the epoch's last step, or, `even`, fewer micro-batches than the step's fullest group."""
        plan = self.plan(epoch)
        if plan.group_starts is None:
            return StepShare(list(range(step * self.grad_accum, (step + 1) * self.grad_accum)), self.grad_accum)
        return group_share(plan.group_starts, step, self.world_size, self.rank, even=self.even)

    def local_rows(self, epoch: int, local_index: int, rank: int) -> np.ndarray:
        """Rows of this rank's micro-batch number `local_index` in `epoch` (stepping by group: of the
        epoch's micro-batch `local_index`, whichever rank reads it)."""
        plan = self.plan(epoch)
        return plan.rows(local_index if plan.group_starts is not None else local_index * self.world_size + rank)


@dataclass(frozen=True)
class Largest:
    """The run's largest micro-batch: its tokens (all context-parallel shares together) and, where
    it is one row longer than --tokens-per-step, which row (else None)."""

    tokens: int
    row: str | None = None


def largest_microbatch(planner: Planner, shard_paths: list[str], shard_starts: np.ndarray) -> Largest:
    """The largest micro-batch of the run: the longest row if it exceeds --tokens-per-step (it is
    then a micro-batch of its own, named 'row R of FILE'), else the fullest micro-batch of the
    first epoch's plan (later epochs' are as full, within a row)."""
    lengths = planner.lengths
    longest = int(np.argmax(lengths)) if len(lengths) else 0
    if len(lengths) and lengths[longest] > planner.tokens_per_step:
        shard = int(np.searchsorted(shard_starts, longest, side="right") - 1)
        return Largest(int(lengths[longest]), f"row {longest - int(shard_starts[shard])} of {Path(shard_paths[shard]).name}")
    plan = planner.plan(0)
    if plan.n_microbatches == 0:
        return Largest(int(lengths.max()) if len(lengths) else 0)
    sums = np.add.reduceat(lengths[plan.order], plan.cuts[:-1])[: plan.n_microbatches]
    return Largest(int(sums.max()))


@dataclass
class Cursor:
    """Where the data stream stands: optimizer steps already taken inside `epoch`."""

    epoch: int = 0
    step_in_epoch: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch}


FileIdentity = tuple[int, int, int, int]  # device, inode, size, mtime (ns)


def file_identity(st: os.stat_result) -> FileIdentity:
    """What tells one version of a file from another: a replaced file (a new inode) or one written
    in place (its size or mtime) differ."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def replaced(path: str | os.PathLike[str]) -> UserError:
    """The error for a shard that is no longer the file the run checked at its start."""
    return UserError(
        f"{path} was replaced or changed after pack-train started (e.g. by pack-data --overwrite into "
        "its --data): a run reads only the shards it checked at its start; let it finish before repacking "
        "its data, or pack into another folder"
    )


class ShardReader:
    """Gathers rows from memory-mapped shards.

    The shards are mapped when the reader is made (by the training process, at start), and the
    identity of each file is recorded (`file_identity`). Loader workers forked from that process
    share the maps, so every row comes from the files checked at the start even if the folder is
    replaced meanwhile (pack-data --overwrite renames a new folder in; the old files live on while
    mapped); `trainer.data.integrity` hashes those same files. A process that must map them again (a
    worker not forked) stops in one line if they changed.

    `vocab` (set once the model is built: its embedding's rows) bounds the token ids of every
    micro-batch gathered: a folder from elsewhere may hold ids its manifest does not account
    for, and an id past the embedding would otherwise stop the run in an indexing error (on a GPU, a
    device-side assert) instead of one line naming the shard and row.
    """

    def __init__(self, folder: str | os.PathLike[str], manifest: Manifest) -> None:
        self.folder, self.manifest = folder, manifest
        self.vocab: int | None = None
        self.paths = [str(p) for p in shard_paths(folder, manifest)]
        self.starts = np.cumsum([0] + [s.rows for s in manifest.shards]).astype(np.int64)
        self.identities = [file_identity(os.stat(path)) for path in self.paths]
        self._shards: list[ShardColumns] | None = None
        self._open()

    def _open(self) -> list[ShardColumns]:
        if self._shards is None:
            shards = [load_shard(path) for path in self.paths]
            self.check_unchanged()  # the maps are of the files identified
            self._shards = shards
        return self._shards

    def check_unchanged(self) -> None:
        """Raise a one-line UserError naming the first shard that is no longer the file identified."""
        for path, want in zip(self.paths, self.identities):
            try:
                have = file_identity(os.stat(path))
            except OSError:
                have = None
            if have != want:
                raise replaced(path)

    def row_lengths(self) -> np.ndarray:
        """`row_lengths` of the mapped shards."""
        return row_lengths(self.folder, self.manifest, self._open())

    def __getstate__(self) -> dict:  # workers reopen the memory maps themselves
        return {**self.__dict__, "_shards": None}

    def microbatch(self, rows: np.ndarray) -> MicroBatch:
        """Concatenate global `rows` into one flat MicroBatch (slices per row, no token loops)."""
        shards = self._open()
        shard_of = np.searchsorted(self.starts, rows, side="right") - 1
        parts: dict[str, list[np.ndarray]] = {name: [] for name in (*TOKEN_COLUMNS, "seq_lens")}
        for shard, row in zip(shard_of.tolist(), (rows - self.starts[shard_of]).tolist()):
            cols = shards[shard]
            tokens = slice(cols.row_off[row], cols.row_off[row + 1])
            for name in TOKEN_COLUMNS:
                parts[name].append(getattr(cols, name)[tokens])
            parts["seq_lens"].append(cols.seq_lens[cols.ex_off[row] : cols.ex_off[row + 1]])
        cat = {name: np.concatenate(p).astype(np.int64) for name, p in parts.items()}
        if self.vocab is not None and not ids_fit(cat["input_ids"], self.vocab):
            for shard, row in zip(shard_of.tolist(), (rows - self.starts[shard_of]).tolist()):
                cols = shards[shard]
                ids = cols.input_ids[cols.row_off[row] : cols.row_off[row + 1]]
                if not ids_fit(ids, self.vocab):
                    raise UserError(outside_vocab(self.paths[shard], row, ids, self.vocab))
        return collate_flat(cat["input_ids"], cat["labels"], cat["position_ids"], cat["seq_lens"])


def ids_fit(ids: np.ndarray, vocab: int) -> bool:
    """True when every token id is in 0..vocab-1. (Labels need no check of their own: the folder's
    check at the start, `trainer.run.preflight`, holds each to -100 or its own token's id.)

    >>> ids_fit(np.array([0, 5, 9]), vocab=10), ids_fit(np.array([0, 10]), vocab=10), ids_fit(np.array([-1]), vocab=10)
    (True, False, False)
    """
    return ids.size == 0 or (int(ids.min()) >= 0 and int(ids.max()) < vocab)


def outside_vocab(path: str, row: int, ids: np.ndarray, vocab: int) -> str:
    """The one-line error for a row whose token ids do not fit a `vocab`-token embedding."""
    bad = int(ids[(ids < 0) | (ids >= vocab)][0])
    return (
        f"{path}: row {row} holds token id {bad}, outside the model's vocabulary of {vocab} tokens "
        f"(ids 0..{vocab - 1}): pack the data with the model's tokenizer, or train a model whose vocabulary "
        f"covers its ids"
    )


class MicroBatchDataset(torch.utils.data.Dataset):
    """Map-style dataset: key (epoch, local micro-batch index) -> this rank's MicroBatch."""

    def __init__(self, reader: ShardReader, planner: Planner, rank: int = 0, share: tuple[int, int] = (0, 1)) -> None:
        self.reader = reader
        self.planner = planner
        self.rank = rank  # among the data-parallel ranks
        self.share = share  # (rank, ranks) of the context-parallel group that splits each micro-batch

    def __getitem__(self, key: tuple[int, int]) -> MicroBatch:
        epoch, index = key
        return shard_microbatch(self.reader.microbatch(self.planner.local_rows(epoch, index, self.rank)), *self.share)

    def __len__(self) -> int:  # only the sampler decides what is read
        raise TypeError("MicroBatchDataset is addressed by (epoch, index) keys from CursorSampler")


class CursorSampler(torch.utils.data.Sampler):
    """Yields (epoch, local index) keys for `n_steps` optimizer steps starting at `cursor`."""

    def __init__(self, planner: Planner, cursor: Cursor, n_steps: int) -> None:
        self.planner = planner
        self.cursor = Cursor(cursor.epoch, cursor.step_in_epoch)
        self.n_steps = n_steps

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch, step, left = self.cursor.epoch, self.cursor.step_in_epoch, self.n_steps
        while left > 0:
            steps = self.planner.steps_in_epoch(epoch)
            if steps == 0:
                raise UserError(
                    f"epoch {epoch} has no complete step: the data holds fewer than "
                    f"{self.planner.group} micro-batches of {self.planner.tokens_per_step} tokens "
                    "(world_size * grad_accum); lower --tokens-per-step or --grad-accum"
                )
            take = min(steps - step, left)
            for s in range(step, step + take):
                for index in self.planner.step_share(epoch, s).indices:
                    yield (epoch, index)
            left -= take
            epoch, step = epoch + 1, 0

    def __len__(self) -> int:
        if len(self.planner.groups):
            return sum(1 for _ in self)
        return self.n_steps * self.planner.grad_accum


def _identity(batch: MicroBatch) -> MicroBatch:
    return batch


def make_loader(
    dataset: MicroBatchDataset,
    sampler: CursorSampler,
    *,
    num_workers: int = 2,
    prefetch_factor: int = 4,
) -> torch.utils.data.DataLoader:
    """DataLoader over micro-batch keys: in order, workers prefetching.

    It never pins memory itself: a DataLoader that pins starts a thread that calls
    `torch.set_num_threads(1)`, which changes the thread count every thread started afterwards
    begins with, among them autograd's GPU thread at the first backward. torch.compile guards on that
    count, so a compiled layer that activation checkpointing recomputes in the backward would be
    compiled a second time there, at the first backward; with `--qlora` at the Llama-3-8B layer shape
    that second graph saved other tensors than the forward's, and torch stopped with a
    CheckpointError (BENCHMARKS.md, the 8B LoRA section). `MicroBatch.to` pins in the calling thread
    instead."""
    extra = {}
    if num_workers > 0:
        extra = {"prefetch_factor": prefetch_factor, "persistent_workers": False, "worker_init_fn": _ignore_sigterm}
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        sampler=sampler,
        collate_fn=_identity,
        num_workers=num_workers,
        pin_memory=False,
        **extra,
    )


@contextmanager
def loader_batches(loader: torch.utils.data.DataLoader) -> Iterator[Iterator[MicroBatch]]:
    """Iterate `loader` within the block; its worker processes end when the block does, however it
    ends. (An exception's traceback would keep the iterator, and its workers, alive until exit,
    where multiprocessing waits for them, and they leave SIGTERM to this process.) A UserError raised
    in a worker arrives as one line, as it would without workers."""
    batches = iter(loader)
    try:
        yield _one_line_errors(batches)
    finally:
        if hasattr(batches, "_shutdown_workers"):  # workers, each asked to end, then joined
            batches._shutdown_workers()
            for worker in batches._workers:
                if worker.is_alive():
                    worker.kill()


def _one_line_errors(batches: Iterator[MicroBatch]) -> Iterator[MicroBatch]:
    """`batches`, where a UserError a loader worker raised (which the DataLoader re-raises with the
    worker's traceback in its message) is raised again with only its own message."""
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except UserError as exc:
            raise type(exc)(worker_message(str(exc))) from None
        yield batch


def worker_message(text: str) -> str:
    """The error's own message in the text of an exception a DataLoader worker raised; `text` itself
    when it is no such text.

    >>> worker_message("Caught UserError in DataLoader worker process 0.\\nOriginal Traceback (most recent "
    ...                "call last):\\n  File ...\\npipeline.errors.UserError: a.arrow: row 3 is bad\\n")
    'a.arrow: row 3 is bad'
    >>> worker_message("a.arrow: row 3 is bad")
    'a.arrow: row 3 is bad'
    """
    if not text.startswith("Caught ") or "Original Traceback" not in text:
        return text
    last = text.rstrip().splitlines()[-1]
    return re.sub(r"^[\w.]+: ", "", last, count=1)


def _ignore_sigterm(worker_id: int) -> None:
    """A loader worker leaves SIGTERM to the training process, which finishes its step and then
    ends the workers itself (Slurm sends SIGTERM to every process of a job, not just the first)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def step_cursor(planner: Planner, start: Cursor, steps_done: int) -> Cursor:
    """The cursor after `steps_done` more optimizer steps from `start`."""
    epoch, step = start.epoch, start.step_in_epoch + steps_done
    while step >= (n := planner.steps_in_epoch(epoch)) and n > 0:
        epoch, step = epoch + 1, step - n
    return Cursor(epoch, step)


def data_fingerprint(folder: str | os.PathLike[str], manifest: Manifest) -> dict:
    """What must not change between a run and its resume: the shards' identities and row counts."""
    return {
        "rows": manifest.rows,
        "total_tokens": manifest.total_tokens,
        "shards": [s.sha256 for s in manifest.shards],
    }
