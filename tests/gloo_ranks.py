"""Train on two gloo ranks (CPU), forked from the test process, for the trainer's DDP/FSDP tests."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, config, record: str) -> None:
    import torch.distributed as dist

    from trainer import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    Path(record, f"rank{rank}.json").write_text(json.dumps(train(config)))
    assert not dist.is_initialized(), "train() left its process group open"


def train_on_two_ranks(config, record: Path) -> list[dict]:
    """`train(config)` on two gloo ranks; each rank's summary (also left in record/rank{r}.json).
    fork: the children inherit the imported modules (spawn would re-import torch + transformers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(2, port, config, str(record)), nprocs=2, join=True, start_method="fork")
    return [json.loads((Path(record) / f"rank{r}.json").read_text()) for r in range(2)]


def _run_rank(fn, rank: int, world: int, port: int, args: tuple, record: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    Path(record, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # no interpreter teardown: nothing of the parent's (forked) state runs again


def run_on_ranks(fn, world: int, args: tuple = (), timeout: float = 300) -> list:
    """`fn(rank, world, *args)` on `world` forked gloo ranks (the group made before, destroyed after);
    the list of what each returned (JSON-able). A rank that fails, or the group still running after
    `timeout` seconds (a deadlock), kills every rank and fails the test."""
    import tempfile

    import pytest

    ctx = mp.get_context("fork")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as record:
        procs = [ctx.Process(target=_run_rank, args=(fn, r, world, port, args, record)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            pytest.fail(f"ranks {hung} of {world} still ran after {timeout:.0f} s: killed")
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            pytest.fail(f"ranks {failed} of {world} failed (exit codes {[procs[r].exitcode for r in failed]})")
        return [json.loads((Path(record) / f"rank{r}.json").read_text()) for r in range(world)]
