"""The options the benchmarks share, declared once: `add_bench_args(parser, model="llama-1b", steps=30)`
adds --model and --steps with those defaults, their type and a shared help. A value may be a
(default, help) pair where a script says more than the shared help. The flag names, types and
defaults a script passes are its own; only the declaration is shared."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

AUTO_DEVICE = "auto"  # --device's default "cuda" where torch sees a CUDA device, else "cpu"

# flag -> (type, shared help); a flag's destination is its name with "_" for "-"
SHARED_OPTIONS: dict[str, tuple[Any, str | None]] = {
    "device": (str, None),
    "model": (str, "packlm preset (tests: tiny)"),
    "steps": (int, "timed optimizer steps"),
    "warmup": (int, "untimed steps before timing"),
    "lr": (float, None),
    "seed": (int, None),
    "lora-r": (int, "LoRA rank on every linear layer (0: full fine-tune)"),
    "max-len": (int, "pack-data --max-len"),
    "limit": (int, "first N examples of each dataset"),
    "shared": (Path, "shared data folder (default $SHARED, .devcarry/shared or ../shared)"),
    "workdir": (Path, "where the prepared data are kept (reused when the parameters match)"),
    "tokenizer": (Path, "default SHARED/tokenizers/llama2"),
    "peak-tflops": (float, "dense bf16 peak for MFU (H100 SXM: 989)"),
    "pack-procs": (int, "pack-data --num-proc"),
    "json": (Path, "write the results here"),
}


def default_pack_procs(share: int) -> int:
    """pack-data workers for a benchmark's data: a `share`-th of the CPUs, 1 to 8."""
    return max(1, min(8, (os.cpu_count() or 1) // share))


def default_workdir(name: str) -> Path:
    """A benchmark's data folder under the system's temporary folder."""
    return Path(tempfile.gettempdir()) / name


def add_bench_args(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Add each shared option named by a keyword (`lora_r=` is --lora-r) with that default: a value,
    or a (default, help) pair. `device=AUTO_DEVICE` is "cuda" where torch sees a CUDA device, else
    "cpu"; `json=str` keeps --json a string (default None) where a script writes it as text."""
    for key, value in defaults.items():
        flag = key.replace("_", "-")
        kind, help_text = SHARED_OPTIONS[flag]
        default = value
        if isinstance(value, tuple):
            default, help_text = value
        if flag == "device" and default == AUTO_DEVICE:
            import torch

            default = "cuda" if torch.cuda.is_available() else "cpu"
        if flag == "json" and default is str:
            kind, default = str, None
        parser.add_argument(f"--{flag}", type=kind, default=default, help=help_text)
