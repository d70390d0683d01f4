"""The process `bench_alst.py run` starts under ArcticTraining's own packages (transformers 4.x,
deepspeed, arctic_training from the carried site folder ahead of the system's): run as a file with
`python -P` (nothing of packlm imported, its folder not on sys.path).

    python -P alst_child.py weights MODEL_DIR --seed 0
        random weights for MODEL_DIR/config.json, saved beside it (bf16 safetensors, seeded; drawn
        on the GPU when there is one), through a temporary folder renamed into place.
    python -P alst_child.py train CONFIG.yaml --peak-json PEAK.json [--gpu-memory-gib 78]
        ArcticTraining's own entry point (`arctic_training_run --mode train`) in this process, one
        rank (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the parent); with
        --gpu-memory-gib the allocator is capped first (torch.cuda.set_per_process_memory_fraction,
        as pack-train's runs stand an H200 in for an 80 GB GPU). The peak GPU memory
        (torch.cuda.max_memory_allocated / max_memory_reserved) and the packages' versions go to
        PEAK.json on the way out, whether training ended, failed or was stopped (SIGTERM).
"""

import argparse
import json
import os
import shutil
import signal
import sys
from pathlib import Path


def make_weights(model_dir: Path, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (model_dir / "model.safetensors.index.json").exists() or (model_dir / "model.safetensors").exists():
        return
    config = AutoConfig.from_pretrained(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = model_dir.with_name(model_dir.name + ".weights-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="4GB")
    for path in sorted(tmp.iterdir(), key=lambda p: p.name.endswith(".index.json")):  # the index last
        if path.name != "config.json":
            path.rename(model_dir / path.name)
    shutil.rmtree(tmp)


def versions() -> dict[str, str | None]:
    """The versions of the packages this process trains with."""
    from importlib.metadata import PackageNotFoundError, version

    names = ("arctic_training", "deepspeed", "transformers", "torch", "peft", "liger_kernel", "flash_attn", "tokenizers", "datasets")
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def train(config: Path, peak_json: Path, gpu_memory_gib: float | None) -> None:
    import torch

    if gpu_memory_gib is not None and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_memory_gib * 2**30 / total), 0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the parent's deadline: still write the peak
    sys.argv = ["arctic_training_run", "--mode", "train", "--config", str(config)]
    try:
        from arctic_training.entrypoint import launch

        launch()
    finally:
        peak = {"cuda": torch.cuda.is_available()}
        if torch.cuda.is_available():
            peak["max_memory_allocated"] = torch.cuda.max_memory_allocated(0)
            peak["max_memory_reserved"] = torch.cuda.max_memory_reserved(0)
            peak["total_memory"] = torch.cuda.get_device_properties(0).total_memory
        peak["gpu_memory_gib_cap"] = gpu_memory_gib
        peak["versions"] = versions()
        peak_json.write_text(json.dumps(peak))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    weights = sub.add_parser("weights")
    weights.add_argument("model_dir", type=Path)
    weights.add_argument("--seed", type=int, default=0)
    trained = sub.add_parser("train")
    trained.add_argument("config", type=Path)
    trained.add_argument("--peak-json", type=Path, required=True)
    trained.add_argument("--gpu-memory-gib", type=float)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.command == "weights":
        make_weights(args.model_dir, args.seed)
    else:
        train(args.config, args.peak_json, args.gpu_memory_gib)


if __name__ == "__main__":
    main()
