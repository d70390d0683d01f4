"""Minimal trainer that streams packed shards into a causal LM with varlen attention.

`train(TrainConfig(...))` is what `pack-train` runs. See docs/DESIGN.md for the modules, in the
order the data goes through them. `train` is imported on first use: importing this package (and
`pack-train --help`) does not import torch.

The packages, in the order a training step uses them:

    data/          packed folder -> micro-batches: checks, stream, batch, shard hashes, evaluation, HF datasets
    model/         presets, loading, the packed loss, the start-up exactness check, LoRA, bf16/fp8, long rows
    attention/     backend choice and HF glue, varlen kernels and references, positions, packed-row boundaries
    distributed/   process groups, DDP/FSDP2, full state dicts, --context-parallel
    run/           preflight, start, loop, optimizer, finiteness, checkpoints, resume, SIGTERM, metrics, profiling
    config.py      TrainConfig: every option, checked; cli.py: pack-train; __init__: train, TrainConfig
"""

import warnings
from typing import Any

from trainer.config import TrainConfig

# peft reads `model.is_gradient_checkpointing` whenever it wraps a model (in `--lora-r` runs, and in a
# user's own `PeftModel.from_pretrained` on a model from `trainer.model.load`), a property transformers 5
# deprecates with a FutureWarning that no user of packlm or peft can act on; only that message is
# silenced, for any import of this package.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

__all__ = ["TrainConfig", "train"]


def _quiet_optional_imports() -> None:
    """transformers imports torchao whenever it is installed (the [fp8] extra), also for runs that
    never use it; a torchao built for another torch release then logs that its C++ kernels did not
    load (float8 training needs none of them) and torch logs a deprecation for each of its enums.
    Those two loggers' warnings are lowered to errors for any import of this package, so that
    `from trainer import train` and pack-train print only their own lines."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


_quiet_optional_imports()


def __getattr__(name: str) -> Any:
    if name == "train":
        from trainer.run.loop import train

        return train
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
