"""The one door from `trainer/` to `pipeline/`: every name pack-train may use of the data side, by group.

    from pipeline.contract import UserError, Manifest, verify_folder, write_text_atomic, METRICS

Each name stays defined where it lives, and pipeline's own modules import it from there (never through
this package); here it is re-exported, imported on first use, so that taking one name (`UserError`, on
pack-train's command line) does not import pyarrow or the Hub client. `run_folder` is the one module
of this package: the names of what a run writes into its folder, which both packages spell.
tests/trainer/test_trainer_layout.py checks that trainer/ imports pipeline only from here.
"""

from importlib import import_module
from typing import Any

# (what the group is, in one line; module -> the names it defines)
GROUPS: tuple[tuple[str, dict[str, tuple[str, ...]]], ...] = (
    (
        "The shard format: its columns, a packed folder's manifest read and verified, example hashes.",
        {
            "pipeline.shards": (
                "IGNORE_INDEX",
                "TOKEN_COLUMNS",
                "Manifest",
                "ShardColumns",
                "file_sha256",
                "load_shard",
                "manifest_vocab",
                "read_manifest",
                "shard_paths",
                "verify_folder",
            ),
            "pipeline.shards.example_hash": ("example_hashes", "shared_examples"),
        },
    ),
    (
        "Errors: UserError (one line, exit 1), how the commands print it, and the Python API's spellings.",
        {
            "pipeline.errors": ("UserError", "cli_errors", "one_line"),
            "pipeline.api_errors": ("python_spelling",),
        },
    ),
    (
        "Config files: --config YAML as the command's defaults, other tools' keys for pack-train's options.",
        {
            "pipeline.config_file": ("HintedCommand", "config_option"),
            "pipeline.foreign.config": ("TRAIN",),
        },
    ),
    (
        "Options declared once (`opt`), and the checks and click options made from the declarations.",
        {
            "pipeline.option_checks": (
                "MAX_PROCS",
                "PATH",
                "check_options",
                "checks_of",
                "click_options",
                "field_values",
                "opt",
                "param_fields",
            ),
        },
    ),
    (
        "File primitives: atomic writes and fsync, a folder's lock, paths that stay inside their folder.",
        {
            "pipeline.files.durable": ("fsync_path", "fsync_tree", "write_atomic", "write_text_atomic"),
            "pipeline.files.folder_lock": ("folder_lock",),
            "pipeline.files.contained": ("leaves",),
        },
    ),
    (
        "FLOPs: the one count of training FLOPs, which pack-train's MFU and pack-report share.",
        {
            "pipeline.report.flops": ("LayerShape", "ModelShape", "StepFlops", "attention_share", "rates_line", "step_flops"),
        },
    ),
    (
        "Tokenizer and Hub: loading a tokenizer and its fingerprint; Hub ids resolved, offline, recorded.",
        {
            "pipeline.tokenize.tokenizer": ("added_count", "tokenizer_folder"),
            "pipeline.read.hub": ("OFFLINE_HELP", "no_progress_bars", "offline_flag"),
        },
    ),
    (
        "The run folder: the names of what pack-train writes into its --out, which pack-report reads.",
        {
            "pipeline.contract.run_folder": (
                "RUN_CONFIG",
                "METRICS",
                "SUMMARY",
                "LOSS_PLOT",
                "RANKS",
                "CHECKPOINTS",
                "LATEST",
                "BEST",
                "SUPERSEDED",
                "MERGED",
                "TENSORBOARD",
                "PROFILE",
                "RUN_LOCK",
                "RUN_ENTRIES",
            ),
        },
    ),
)

# modules taken whole (of the tokenizer and Hub group): the trainer calls through them, so a test
# that replaces a function in one replaces what the trainer calls
WHOLE = {"hub": "pipeline.read.hub", "tokenizer": "pipeline.tokenize.tokenizer"}

# name -> the module that defines it (or, for WHOLE, is it)
SOURCES = {**{name: module for _, modules in GROUPS for module, names in modules.items() for name in names}, **WHOLE}

__all__ = sorted(SOURCES)


def __getattr__(name: str) -> Any:
    if name not in SOURCES:
        raise AttributeError(f"module 'pipeline.contract' has no attribute {name!r}")
    module = import_module(SOURCES[name])
    return module if name in WHOLE else getattr(module, name)


def __dir__() -> list[str]:
    return __all__
