"""Shard sha256 checks that run beside training instead of before it.

Hashing every shard of a large folder takes minutes, so `pack-train` starts at once and a
background thread hashes the shards against the manifest (`ShardHashCheck`); each rank hashes its
share (shard i goes to rank i % world_size). The loop asks at every logged step whether any rank
found a mismatch (`failed`, one all-reduce of a flag), and before every checkpoint and at the end
it waits for the check to finish (`wait`): a run on a damaged shard stops with one line, and no
checkpoint is ever written before every shard has been verified. The files hashed are the ones the
run reads: each must still be the file `trainer.data.stream.ShardReader` mapped at the start.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.contract import Manifest, UserError
from trainer.data.stream import FileIdentity, file_identity, replaced


def shard_problem(path: Path, want: str, identity: FileIdentity | None = None, chunk: int = 1 << 22) -> str | None:
    """What is wrong with the shard at `path` (None: nothing): unreadable, another file than the one
    identified as `identity` when the run started (the one it reads, `ShardReader`), or a sha256
    other than `want`, the manifest's."""
    digest = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as handle:
            if identity is not None and file_identity(os.fstat(handle.fileno())) != identity:
                return str(replaced(path))
            while n := handle.readinto(buf):
                digest.update(view[:n])
    except OSError as exc:
        return f"{path}: cannot read the shard ({exc.strerror or exc})"
    have = digest.hexdigest()
    if have != want:
        return (
            f"{path}: sha256 {have[:12]}... does not match the manifest ({want[:12]}...): the shard changed after packing; re-run pack-data"
        )
    return None


class ShardHashCheck:
    """Hash this rank's share of the shards in a daemon thread, against the manifest."""

    def __init__(
        self, folder: str, manifest: Manifest, rank: int = 0, world_size: int = 1, identities: list[FileIdentity] | None = None
    ) -> None:
        self.problem: str | None = None
        ids = identities or [None] * len(manifest.shards)
        self._shards = [(Path(folder) / s.file, s.sha256, i) for s, i in zip(manifest.shards, ids)][rank::world_size]
        self._thread = threading.Thread(target=self._run, name="shard-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for path, want, identity in self._shards:
            self.problem = shard_problem(path, want, identity)
            if self.problem is not None:
                return

    def failed(self, distributed: bool, device: torch.device) -> bool:
        """True when this rank, or any rank (collective under torch.distributed), found a problem."""
        bad = self.problem is not None
        if distributed:
            flag = torch.tensor([int(bad)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            bad = bool(flag.item())
        return bad

    def raise_if_failed(self, distributed: bool, device: torch.device) -> None:
        if self.failed(distributed, device):
            raise UserError(
                self.problem
                or "another rank found a shard whose sha256 does not match the "
                "manifest: the folder changed after packing; run pack-verify on it"
            )

    def wait(self, distributed: bool, device: torch.device) -> None:
        """Block until every shard of this rank is hashed; then raise_if_failed (collective)."""
        self._thread.join()
        self.raise_if_failed(distributed, device)
