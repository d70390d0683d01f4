"""Train on two gloo ranks (CPU), forked from the test process, for the trainer's DDP/FSDP tests."""

from __future__ import annotations

import json
import os
import socket
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
