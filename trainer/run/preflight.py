"""What pack-train refuses before it imports torch (seconds): each check reads only the options,
the file system, the packed folder's manifest and the installed packages' metadata, so a run that
cannot work ends in under a second with one line.

- The packed folder's fast checks and its tokenizer's fingerprint (`open_data`; the sha256 of its
  shards is checked beside training, `trainer.data.integrity`).
- PyTorch itself missing (a data-only install): `pip install -e ".[train]"`.
- `--attn flash_attn` / `--attn fa4` whose package is not installed.
- `--dtype fp8` on a machine that shows no NVIDIA GPU: `--device cpu`, CUDA_VISIBLE_DEVICES set to
  no device, or no NVIDIA device file (/dev/nvidia0..., or /dev/dxg under WSL). Whether a GPU that is
  there has float8 tensor cores needs torch: trainer.model.fp8.check_fp8 asks later. torchao missing.
- A new run (no `--resume`) in an `--out` that already holds checkpoints.
- An `--out` that is not a run folder of pack-train's (`refuse_foreign_out`): pack-train writes only
  into a folder it creates, an empty one, or one it wrote before (its config.json says so); the
  --model, --data and --eval-data folders, any other folder of the user's and `--out ''` are refused.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from pipeline.contract import CHECKPOINTS, RUN_CONFIG, RUN_LOCK, Manifest, UserError, hub, verify_folder
from pipeline.contract import tokenizer as hf_tokenizer
from trainer.config import TrainConfig
from trainer.model.presets import model_folder

# keys of the config.json every pack-train run writes first into its folder (`start_run_files`)
RUN_CONFIG_KEYS = frozenset({"data", "model", "out", "tokens_per_step", "grad_accum"})
RUN_CONFIG_MAX_BYTES = 1 << 20  # pack-train's config.json is a few kB: a larger one is not its

# --attn backend -> (distribution, import name, extra)
ATTN_PACKAGES = {"flash_attn": ("flash-attn", "flash_attn", "flash"), "fa4": ("flash-attn-4", "flash_attn", "fa4")}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The checkpoint folders of a run (intact or not), oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step-*") if p.is_dir()), key=lambda p: p.name)


def is_run_folder(folder: Path) -> bool:
    """Whether `folder` (an existing folder) is a run folder pack-train wrote: its config.json is
    the one pack-train writes (a JSON object with the run's options, `RUN_CONFIG_KEYS`), or it holds
    nothing but the lock of a run that stopped before writing config.json (and the temporary file of
    that write, `.config.json.*.tmp`), and checkpoints/ with checkpoint folders of pack-train's names
    (step-...) in it."""
    config = folder / RUN_CONFIG
    if not (config.exists() or config.is_symlink()):
        names = {p.name for p in folder.iterdir() if not (p.name.startswith(f".{RUN_CONFIG}.") and p.name.endswith(".tmp"))}
        return names <= {RUN_LOCK} or (names <= {RUN_LOCK, CHECKPOINTS} and bool(list_checkpoints(folder)))
    try:
        if config.is_symlink() or not config.is_file() or config.stat().st_size > RUN_CONFIG_MAX_BYTES:
            return False
        record = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and RUN_CONFIG_KEYS <= set(record)


def refuse_foreign_out(config: TrainConfig) -> None:
    """One line, before anything is written, for an `--out` pack-train must not write into: an
    empty name (the working folder), the --model / --data / --eval-data folder, an existing folder
    that is neither empty nor a run folder of pack-train's (`is_run_folder`), a file, or a run folder
    whose checkpoints/ holds symbolic links (pack-train writes and removes checkpoints there, and
    never makes a link)."""
    text = str(config.out)
    if not text.strip():
        raise UserError(
            "--out is empty: name the run folder to create (e.g. --out runs/first); pack-train "
            "does not write a run into the working folder unnamed"
        )
    out = Path(text).expanduser()
    for option, value in (
        ("--model", config.model),
        ("--data", config.data),
        ("--eval-data", config.eval_data),
        ("--tokenizer", config.tokenizer),
    ):
        other = Path(str(value)).expanduser() if value else None
        if other is None or not other.is_dir():
            continue
        if out.exists() and os.path.samefile(out, other):
            raise UserError(
                f"--out {text} is the {option} folder: the run would write its config.json, "
                f"metrics and checkpoints into it; choose a new folder for --out"
            )
        if out.resolve().is_relative_to(other.resolve()) and any(other.iterdir()):  # inside it, links followed
            raise UserError(
                f"--out {text} is inside the {option} folder {value}: the run would write its "
                "config.json, metrics and checkpoints into it; choose a folder outside it for --out"
            )
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"--out {text} is a file, not a folder: choose another --out")
    if not is_run_folder(out):
        names = sorted(p.name for p in out.iterdir())
        held = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise UserError(
            f"--out {text} is an existing folder that is not a pack-train run folder (it holds "
            f"{held}): pack-train writes only into a new or empty folder, or a run folder it wrote "
            "before; choose another --out"
        )
    refuse_linked_checkpoints(out)


def refuse_linked_checkpoints(out: Path) -> None:
    """One line when `out`/checkpoints, or anything in it, is a symbolic link: pack-train never makes
    one, and would otherwise resume, replace or remove (--keep-last) what the link points to."""
    root = out / CHECKPOINTS
    links = [root] if root.is_symlink() else ([p for p in root.iterdir() if p.is_symlink()] if root.is_dir() else [])
    if links:
        link = links[0]
        raise UserError(
            f"{link} is a symbolic link (to {os.readlink(link)}): pack-train reads, replaces and "
            f"removes only the checkpoints it wrote into {root}; remove the link, and to continue "
            "the checkpoint it points to, give that folder itself: --resume FOLDER with a new --out"
        )


def refuse_reused_out(config: TrainConfig) -> None:
    """A new run may not write over another run's checkpoints."""
    if not config.resume and list_checkpoints(config.out):
        raise UserError(f"{config.out} already holds checkpoints: pass --resume to continue that run, or choose a new --out")


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
        raise UserError(
            'pack-train needs PyTorch, which this install lacks: pip install -e ".[train]" (install the '
            "torch build for your machine first: https://pytorch.org/get-started/locally/)"
        )
    if config.attn in ATTN_PACKAGES:
        distribution, module, extra = ATTN_PACKAGES[config.attn]
        if not _installed(distribution, module):
            raise UserError(
                f"--attn {config.attn}: the {distribution} package is not installed here: "
                f'pip install -e ".[{extra}]", or use --attn auto (the fastest backend that runs here)'
            )
    if config.dtype == "fp8":
        why = no_nvidia_gpu(config.device)
        if why:
            raise UserError(
                f"--dtype fp8 needs an NVIDIA GPU with float8 tensor cores (sm89 or newer: Ada, Hopper, "
                f"Blackwell); {why}: use --dtype bf16-weights"
            )
        if importlib.util.find_spec("torchao") is None:
            raise UserError('--dtype fp8 needs the torchao package: pip install -e ".[fp8]"')
    refuse_foreign_out(config)
    refuse_reused_out(config)


def open_data(config: TrainConfig) -> tuple[Manifest, Any]:
    """Verify the packed folder (fast checks; the sha256 of its shards is checked beside training,
    `trainer.data.integrity`) and its tokenizer fingerprint; returns (manifest, tokenizer or None). The
    tokenizer is `--tokenizer`, else the one inside the model's folder (local or a Hub id's). A Hub
    tokenizer at a commit other than the manifest's is named in one line on stderr (and refused, as
    any tokenizer is, when it tokenizes differently). Data packed with `pack-data --chat-template`
    records the template: the tokenizer takes it before the fingerprints are compared."""
    manifest = verify_folder(config.data, check_hashes=False)
    if manifest.loss_tokens == 0:
        raise UserError(
            f"{config.data} has no token that carries a loss: training on it would learn "
            "nothing; re-pack data with responses (assistant turns) to train on"
        )
    source, named = config.tokenizer, config.tokenizer
    model_dir = Path(config.model).expanduser()
    if hub.hub_ref(config.model) is not None:  # (an existing folder is a path, never an id)
        model_dir = model_folder(config.model) or model_dir  # the Hub id's snapshot folder
    if source is None and model_dir.is_dir() and any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        source, named = str(model_dir), config.model
    if source is None:
        return manifest, None
    # pack-data --chat-template, --add-token, --special-token: checkpoints carry them
    tokenizer = hf_tokenizer.apply_recorded(hf_tokenizer.load_tokenizer(source), manifest.tokenizer)
    have = hf_tokenizer.tokenizer_fingerprint(tokenizer)
    want = manifest.tokenizer.get("fingerprint")
    changed = _changed_revision(named, source, manifest)
    if want != have and not _recorded_by_files(manifest, tokenizer, want, have):
        raise UserError(
            f"{config.data} was packed with tokenizer {manifest.tokenizer.get('name', '?')!r} "
            f"(fingerprint {str(want)[:12]}) but the model's tokenizer {named} has fingerprint "
            f"{have[:12]}{f' ({changed})' if changed else ''}: re-run pack-data with this tokenizer, "
            "or pass the right --tokenizer"
        )
    if changed:  # the same tokenizer at another commit: what it does is unchanged, so training goes on
        print(f"pack-train: {changed}", file=sys.stderr)
    return manifest, tokenizer


def _changed_revision(named: str, source: str, manifest: Manifest) -> str | None:
    """One line naming a commit of the Hub tokenizer (or model) `named` other than the one the
    manifest records for the tokenizer the data was packed with; None when the same, or not Hub-named."""
    ref = hub.hub_ref(named)
    if ref is None:
        return None
    commit = Path(source).name if source != named else (hf_tokenizer.hub_record(named) or {}).get("commit")
    return hub.changed_revision("tokenizer", ref, str(commit), manifest.tokenizer.get("hub"))


def _recorded_by_files(manifest: Manifest, tokenizer: Any, want: str, have: str) -> bool:
    """Manifests written before fingerprints described what a tokenizer does hold the sha256 of its
    folder's files (`file_fingerprint`). The same folder matches them; so does a tokenizer that does
    what the folder the manifest names does, while that folder still holds those very files (data
    packed then, and a checkpoint's re-saved copy of its tokenizer)."""
    if want == hf_tokenizer.file_fingerprint(tokenizer):
        return True
    name = manifest.tokenizer.get("name")
    if not isinstance(name, str) or not Path(name).expanduser().is_dir():
        return False
    try:
        recorded = hf_tokenizer.load_tokenizer(name)
    except UserError:
        return False
    return hf_tokenizer.file_fingerprint(recorded) == want and hf_tokenizer.tokenizer_fingerprint(recorded) == have
