"""What pack-train refuses before it imports torch (seconds): each check reads only the options,
the file system and the installed packages' metadata, so a run that cannot work ends in under a
second with one line.

- PyTorch itself missing (a data-only install): `pip install -e ".[train]"`.
- `--attn flash_attn` / `--attn fa4` whose package is not installed.
- `--dtype fp8` on a machine that shows no NVIDIA GPU: `--device cpu`, CUDA_VISIBLE_DEVICES set to
  no device, or no NVIDIA device file (/dev/nvidia0..., or /dev/dxg under WSL). Whether a GPU that is
  there has float8 tensor cores needs torch: trainer.model.fp8.check_fp8 asks later. torchao missing.
- A new run (no `--resume`) in an `--out` that already holds checkpoints.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
from pathlib import Path

from pipeline.errors import UserError
from trainer.config import TrainConfig

CHECKPOINTS = "checkpoints"

# --attn backend -> (distribution, import name, extra)
ATTN_PACKAGES = {"flash_attn": ("flash-attn", "flash_attn", "flash"), "fa4": ("flash-attn-4", "flash_attn", "fa4")}


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The checkpoint folders of a run (intact or not), oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step-*") if p.is_dir()), key=lambda p: p.name)


def refuse_reused_out(config: TrainConfig) -> None:
    """A new run may not write over another run's checkpoints."""
    if not config.resume and list_checkpoints(config.out):
        raise UserError(
            f"{config.out} already holds checkpoints: pass --resume to continue that run, or choose a new --out"
        )


def _installed(distribution: str, module: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return importlib.util.find_spec(module) is not None


def no_nvidia_gpu(device: str) -> str | None:
    """Why this process can see no NVIDIA GPU, as far as the options, the environment and the
    device files tell without torch; None where one may be there."""
    if device == "cpu":
        return "this run is on cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (visible.strip() == "" or visible.split(",")[0].strip() == "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/dxg"):
        return "this machine has no NVIDIA device (/dev/nvidia*)"
    return None


def refuse_before_torch(config: TrainConfig) -> None:
    """UserError (one line) for what is sure to fail once torch is imported; see the module's list."""
    if importlib.util.find_spec("torch") is None:
        raise UserError('pack-train needs PyTorch, which this install lacks: pip install -e ".[train]" (install the '
                        "torch build for your machine first: https://pytorch.org/get-started/locally/)")
    if config.attn in ATTN_PACKAGES:
        distribution, module, extra = ATTN_PACKAGES[config.attn]
        if not _installed(distribution, module):
            raise UserError(f"--attn {config.attn}: the {distribution} package is not installed here: "
                            f'pip install -e ".[{extra}]", or use --attn auto (the fastest backend that runs here)')
    if config.dtype == "fp8":
        why = no_nvidia_gpu(config.device)
        if why:
            raise UserError(f"--dtype fp8 needs an NVIDIA GPU with float8 tensor cores (sm89 or newer: Ada, Hopper, "
                            f"Blackwell); {why}: use --dtype bf16-weights")
        if importlib.util.find_spec("torchao") is None:
            raise UserError('--dtype fp8 needs the torchao package: pip install -e ".[fp8]"')
    refuse_reused_out(config)
