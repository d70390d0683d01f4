"""Minimal trainer that streams packed shards into a causal LM with varlen attention.

`train(TrainConfig(...))` is what `pack-train` runs. See docs/DESIGN.md for the modules, in the
order the data goes through them.
"""

from trainer.config import TrainConfig
from trainer.loop import train

__all__ = ["TrainConfig", "train"]
