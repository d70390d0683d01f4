"""The shard contract between `pipeline/` (which writes packed folders) and `trainer/` (which reads
them), defined in this package only:

- `format`:   the shard files: schema, writing, memory-mapped reading (`load_shard`, `iter_rows`)
- `manifest`: `manifest.json`: configuration, tokenizer and input fingerprints, counts, shard hashes
- `checks`:   every per-row and per-token rule, on one shard
- `verify`:   a whole folder: manifest, files, hashes, totals (`verify_folder`)

Everything a reader needs is importable from here: `from pipeline.shards import read_manifest`.
"""

from pipeline.shards.checks import ShardSummary, check_shard, first_beyond_vocab, summarize_shard
from pipeline.shards.format import (
    EXAMPLE_COLUMNS,
    IGNORE_INDEX,
    MAX_SHARD_TOKENS,
    SCHEMA,
    SHARD_GLOB,
    TOKEN_COLUMNS,
    FlatColumn,
    ShardColumns,
    flat_column,
    iter_rows,
    load_shard,
    open_shard,
    rows_table,
    shard_name,
    shard_paths,
    write_shard,
)
from pipeline.shards.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Counts,
    Manifest,
    ShardInfo,
    file_sha256,
    manifest_checksum,
    pack_data_files,
    read_manifest,
    write_manifest,
)
from pipeline.shards.verify import check_checksum, manifest_vocab, verify_eval_folder, verify_folder

__all__ = [
    "EXAMPLE_COLUMNS",
    "FORMAT_NAME",
    "check_checksum",
    "FORMAT_VERSION",
    "IGNORE_INDEX",
    "MANIFEST_NAME",
    "MAX_SHARD_TOKENS",
    "SCHEMA",
    "SHARD_GLOB",
    "TOKEN_COLUMNS",
    "Counts",
    "FlatColumn",
    "Manifest",
    "ShardColumns",
    "ShardInfo",
    "ShardSummary",
    "check_shard",
    "file_sha256",
    "first_beyond_vocab",
    "flat_column",
    "iter_rows",
    "load_shard",
    "manifest_checksum",
    "manifest_vocab",
    "open_shard",
    "pack_data_files",
    "read_manifest",
    "rows_table",
    "verify_eval_folder",
    "shard_name",
    "shard_paths",
    "summarize_shard",
    "verify_folder",
    "write_manifest",
    "write_shard",
]
