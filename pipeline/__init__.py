"""The data side of packlm: read, tokenize, plan and write packed Arrow shards, then verify them.

    from pipeline import PackConfig, run_pack_data, verify_folder, read_manifest, assign_bins

    manifest = run_pack_data(PackConfig(inputs=["data/sample/instructions.jsonl"],
                                        tokenizer="data/tokenizer", max_len=8192, out="out/sample"))
    verify_folder("out/sample") == read_manifest("out/sample")   # True: the folder is intact
    assign_bins([5, 3, 8, 1], max_len=8)                          # row of each example: [0, 0, 2, 1]

The path data takes, one module per step: sources -> formats -> tokenize (segments, long_texts,
encode_pool) -> spill -> plan (binpack) -> write -> shards (format, manifest, checks, verify) ->
job (the whole run) -> cli (pack-data, pack-verify, pack-report). docs/DESIGN.md draws the map.
"""

from importlib import import_module
from typing import Any

# Imported on first use, so that importing one module of the package (pipeline.errors, say, from
# pack-train's command line) does not import numba, pyarrow and the rest.
_EXPORTS = {"assign_bins": "pipeline.binpack", "PackConfig": "pipeline.job", "run_pack_data": "pipeline.job",
            "read_manifest": "pipeline.shards", "verify_folder": "pipeline.shards"}

__all__ = ["PackConfig", "assign_bins", "read_manifest", "run_pack_data", "verify_folder"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
