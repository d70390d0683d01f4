"""Minimal trainer that streams packed shards into a causal LM with varlen attention.

`train(TrainConfig(...))` is what `pack-train` runs. See docs/DESIGN.md for the modules, in the
order the data goes through them. `train` is imported on first use: importing this package (and
`pack-train --help`) does not import torch.

The packages are floors: each imports only the ones below it (tests/trainer/test_trainer_layout.py
holds the order), lowest first:

    distributed/   process groups, DDP/FSDP2, full state dicts, --context-parallel's groups
    data/          packed folder -> micro-batches: stream, batch, the row split over ranks, shard hashes,
                   evaluation, HF datasets
    attention/     backend choice and HF glue, varlen kernels and references, positions, packed-row
                   boundaries, attention over keys gathered from the context-parallel group
    model/         presets, loading, the packed loss, the start-up exactness check, LoRA, bf16/fp8, long rows
    run/           preflight, start, the Run, loop, optimizer, finiteness, checkpoints, resume, SIGTERM,
                   metrics, profiling
    config.py      TrainConfig: every option, checked (under every floor); cli.py: pack-train, and
                   __init__: train, TrainConfig (above them)

Why this order, from what each needs: the process groups and the data-parallel wrapper need only
torch.distributed, and everything that works across ranks needs them (the evaluation's all-reduce,
the context-parallel attention's gather, the model's start-up check of a share), so distributed is
the lowest. The data needs a rank's place (`DistInfo`) and nothing of a model: it cuts rows into
micro-batches and splits a row over a context-parallel group. Attention reads a micro-batch's row
split and gathers over the groups, but knows no model. The model (its loss, its exactness check,
its loading) runs micro-batches through attention. The run uses all of them. What a lower floor
needs from a higher one at run time is handed down explicitly: the context-parallel groups to
attention (`trainer.model.load.prepare`), a share of a row to the decoder call
(`trainer.model.loss.hidden_states`).
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
