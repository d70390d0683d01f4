"""Minimal trainer that streams packed shards into a causal LM with varlen attention.

`train(TrainConfig(...))` is what `pack-train` runs. See docs/DESIGN.md for the modules, in the
order the data goes through them. `train` is imported on first use: importing this package (and
`pack-train --help`) does not import torch.
"""

from typing import Any

from trainer.config import TrainConfig

__all__ = ["TrainConfig", "train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from trainer.loop import train

        return train
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
