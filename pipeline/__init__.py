"""The data side of packlm: read, tokenize, plan and write packed Arrow shards, then verify them.

    from pipeline import PackConfig, run_pack_data, verify_folder, read_manifest, assign_bins

    manifest = run_pack_data(PackConfig(inputs=["data/sample/instructions.jsonl"],
                                        tokenizer="data/tokenizer", max_len=8192, out="out/sample"))
    verify_folder("out/sample") == read_manifest("out/sample")   # True: the folder is intact
    assign_bins([5, 3, 8, 1], max_len=8)                          # row of each example: [0, 0, 2, 1]

The folders are the steps data takes, in order; each imports only the ones before it:

    read/      inputs -> Arrow tables: sources, file readers, formats, remote storage
    tokenize/  tables -> token ids and labels in the spill: tokenizer, encode pool, long texts
    plan/      lengths -> row plan: overlong policy, bin packing, eval split, mixtures
    write/     spill + plan -> shard files in an output folder that appears only when complete
    report/    a finished folder or plan -> figures (pack-report), pack-verify --deep
    engines/   the job (`run_pack_data`) runs those steps here, or on Ray (`--engine ray`)
    cli.py     the commands pack-data, pack-verify, pack-report

`shards/` is the shard format; the modules at this level (`errors`, `api_errors`, `option_checks`,
`config_file`, `progress`, `background`, `splits`), `files/` (safe writing) and `foreign/` (Axolotl
and TRL config files) serve every step and the trainer, and import no step. docs/DESIGN.md draws the map.

The trainer's one door: `trainer/` imports pipeline only through `contract` (`pipeline.contract`),
which names by group what it may use (the shard format, errors, config files, option declarations,
file primitives, the FLOPs count, the tokenizer and the Hub) and defines the run folder's file names
(`contract/run_folder`); tests/trainer/test_trainer_layout.py checks it.
"""

from importlib import import_module
from typing import Any

# Imported on first use, so that importing one module of the package (pipeline.errors, say, from
# pack-train's command line) does not import numba, pyarrow and the rest.
_EXPORTS = {
    "assign_bins": "pipeline.plan.binpack",
    "PackConfig": "pipeline.engines.pack_config",
    "run_pack_data": "pipeline.engines.job",
    "read_manifest": "pipeline.shards",
    "verify_folder": "pipeline.shards",
}

__all__ = ["PackConfig", "assign_bins", "read_manifest", "run_pack_data", "verify_folder"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
