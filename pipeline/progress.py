"""Progress bars of the pack-data job (on stderr), and the row count their ETA needs."""

from __future__ import annotations

import sys
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm


def bar(enabled: bool, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr (a disabled one when `enabled` is False)."""
    return tqdm(file=sys.stderr, disable=not enabled, dynamic_ncols=True, mininterval=0.5, **kwargs)


def estimate_rows(files: list[Any], limit: int | None = None, max_scan_bytes: int = 1 << 30) -> int | None:
    """Rows in the inputs for the progress bar's ETA: file metadata (Parquet, Arrow) or a newline
    count (JSONL, CSV, under `max_scan_bytes` in all); None when it cannot be known cheaply."""
    total = 0
    scanned = 0
    for f in files:
        try:
            if getattr(f, "rows", None):  # a share of the file's rows (`pipeline.read.splits`)
                total += f.rows[1] - f.rows[0]
            elif f.kind == "parquet":
                total += pq.ParquetFile(f.path).metadata.num_rows
            elif f.kind == "arrow":
                with pa.memory_map(f.path) as source:
                    total += _ipc_rows(source)
            elif f.kind in ("jsonl", "csv") and not f.path.lower().endswith((".gz", ".zst")) and scanned + f.size <= max_scan_bytes:
                scanned += f.size
                with open(f.path, "rb") as handle:
                    lines = sum(block.count(b"\n") for block in iter(lambda: handle.read(1 << 22), b""))
                total += lines - (1 if f.kind == "csv" else 0)
            else:
                return limit
        except Exception:  # noqa: BLE001 - only an estimate: the reader reports real problems
            return limit
        if limit is not None and total >= limit:
            return limit
    return total if limit is None else min(total, limit)


def _ipc_rows(source: Any) -> int:
    try:
        reader = pa.ipc.open_file(source)
        return sum(reader.get_record_batch(i).num_rows for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        raise ValueError("not an IPC file") from None
