"""The manifest of a packed folder: what `manifest.json` holds (configuration, tokenizer and input
fingerprints, counts, one entry per shard with its sha256), read and written here only."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.contract.run_folder import METRICS, RUN_CONFIG
from pipeline.errors import ShardFormatError
from pipeline.files.contained import contained, escape
from pipeline.files.durable import fsync_path

FORMAT_NAME = "packlm-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


@dataclass
class ShardInfo:
    """One shard file as recorded in the manifest."""

    file: str
    rows: int
    tokens: int
    sha256: str


@dataclass
class Counts:
    """What happened to the input examples."""

    examples_read: int = 0
    examples_packed: int = 0
    empty_skipped: int = 0
    truncated: int = 0
    split: int = 0
    dropped: int = 0
    too_short: int = 0  # examples of fewer tokens than --min-len, dropped before the overlong policy
    duplicates: int = 0  # examples equal to an earlier one in tokens and labels, dropped by --dedup
    no_loss: int | None = None  # examples (pieces) packed with no token that carries a loss; None: not recorded
    passes: int = 1  # --mix: uses per example at most; use k of example i has id k * examples_read + i


@dataclass
class Manifest:
    """Everything known about a packed folder; serialised as `manifest.json`."""

    max_len: int
    strategy: str
    seed: int
    rows: int
    total_tokens: int
    loss_tokens: int
    efficiency: float
    counts: Counts
    shards: list[ShardInfo]
    tokenizer: dict[str, Any] = field(default_factory=dict)  # name, fingerprint, bos/eos/pad ids, vocab_size
    inputs: list[dict[str, Any]] = field(default_factory=list)  # path, bytes, sha256
    # per input file: input, weight (--mix), first_id, examples_read, examples_used, uses
    sources: list[dict[str, Any]] = field(default_factory=list)
    # held-out examples: the training folder's {"folder": "eval", "examples": n}; the eval folder's {"role": "eval"}
    eval: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)  # the full command configuration
    # --strategy minibatch: rows of each group of `group_size` examples (the last may hold fewer),
    # in row order; pack-train takes one group per optimizer step. Empty for other strategies.
    groups: list[int] = field(default_factory=list)
    group_size: int | None = None  # examples (pieces) per group; None without groups
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    # sha256 of every other field (`manifest_checksum`), written by `to_json`: covers the figures no
    # shard can prove (max_len, counts, strategy, ...); None in a manifest written without one
    checksum: str | None = None

    def to_json(self) -> str:
        data = asdict(self)
        data["checksum"] = manifest_checksum(data)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = MANIFEST_NAME) -> Manifest:
        """Build from parsed JSON, raising ShardFormatError naming the first missing/bad field."""
        if not isinstance(data, dict):
            raise ShardFormatError(f"{where}: expected a JSON object")
        if data.get("format") != FORMAT_NAME:
            raise ShardFormatError(
                f"{where}: format is {data.get('format')!r}, expected {FORMAT_NAME!r}: not a folder written by pack-data"
            )
        if data.get("format_version") != FORMAT_VERSION:
            raise ShardFormatError(
                f"{where}: format_version {data.get('format_version')!r} is not supported "
                f"(this version reads {FORMAT_VERSION}): re-run pack-data"
            )
        ints = ("max_len", "seed", "rows", "total_tokens", "loss_tokens")
        for key in (*ints, "strategy", "efficiency", "counts", "shards"):
            if key not in data:
                raise ShardFormatError(f"{where}: missing field {key!r}")
        _check_types(data, ints, where)
        try:
            counts = Counts(**data["counts"])
            shards = [ShardInfo(**s) for s in data["shards"]]
        except TypeError as exc:
            raise ShardFormatError(f"{where}: malformed counts or shards entry ({exc})") from None
        fields = {k: v for k, v in data.items() if k not in ("counts", "shards")}
        try:
            return cls(counts=counts, shards=shards, **fields)
        except TypeError as exc:
            raise ShardFormatError(f"{where}: unexpected field ({exc})") from None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_types(data: dict[str, Any], ints: tuple[str, ...], where: str) -> None:
    """Every field of a parsed manifest has the type pack-data writes (a count an integer, a sha256 64
    hex digits, a shard's file and the eval folder strings: `read_manifest` keeps them inside), else ShardFormatError
    naming the field: a value of another type never reaches a computation or a report."""

    def bad(field_: str, value: Any, want: str) -> ShardFormatError:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        return ShardFormatError(
            f"{where}: field {field_} is {shown}, but must be {want}: the manifest was "
            "altered or written by something else; re-run pack-data"
        )

    for key in ints:
        if not _count(data[key]):
            raise bad(repr(key), data[key], "a non-negative integer")
    if not isinstance(data["strategy"], str):
        raise bad("'strategy'", data["strategy"], "a string")
    eff = data["efficiency"]
    if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not math.isfinite(eff):
        raise bad("'efficiency'", eff, "a number")
    if not isinstance(data["counts"], dict):
        raise bad("'counts'", data["counts"], "an object")
    for key, value in data["counts"].items():
        if not (_count(value) or (key == "no_loss" and value is None)):
            raise bad(f"'counts.{key}'", value, "a non-negative integer")
    if not isinstance(data["shards"], list):
        raise bad("'shards'", data["shards"], "a list")
    for i, shard in enumerate(data["shards"]):
        if not isinstance(shard, dict):
            raise bad(f"'shards[{i}]'", shard, "an object")
        file = shard.get("file")
        if not isinstance(file, str):
            raise bad(f"'shards[{i}].file'", file, "a file name")
        for key in ("rows", "tokens"):
            if key in shard and not _count(shard[key]):
                raise bad(f"'shards[{i}].{key}'", shard[key], "a non-negative integer")
        digest = shard.get("sha256")
        if "sha256" in shard and not (isinstance(digest, str) and _HEX64.fullmatch(digest)):
            raise bad(f"'shards[{i}].sha256'", digest, "64 hex digits")
    for key in ("tokenizer", "eval", "config"):
        if key in data and not isinstance(data[key], dict):
            raise bad(repr(key), data[key], "an object")
    for key in ("inputs", "sources"):
        if key in data and not (isinstance(data[key], list) and all(isinstance(x, dict) for x in data[key])):
            raise bad(repr(key), data[key], "a list of objects")
    groups = data.get("groups", [])
    if not (isinstance(groups, list) and all(_count(g) and g > 0 for g in groups)):
        raise bad("'groups'", groups, "a list of positive row counts")
    size = data.get("group_size")
    if size is not None and not (_count(size) and size > 0):
        raise bad("'group_size'", size, "a positive integer")
    held = data.get("eval", {}).get("folder")
    if held is not None and not isinstance(held, str):
        raise bad("'eval.folder'", held, "a folder name")
    if data.get("checksum") is not None and not (isinstance(data["checksum"], str) and _HEX64.fullmatch(data["checksum"])):
        raise bad("'checksum'", data["checksum"], "64 hex digits")


_HEX64 = re.compile(r"[0-9a-f]{64}")


def manifest_checksum(data: dict[str, Any]) -> str:
    """Hex sha256 of a manifest's fields other than `checksum`, as canonical JSON (sorted keys, no
    spaces): the same for the dict written and the dict read back."""
    body = {k: v for k, v in data.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_manifest(folder: str | os.PathLike[str]) -> Manifest:
    """Load and validate `folder/manifest.json`."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        if (Path(folder) / METRICS).is_file() and (Path(folder) / RUN_CONFIG).is_file():
            raise ShardFormatError(
                f"{folder} is a pack-train run folder, not a packed folder: give the folder "
                "pack-data wrote (the run's config.json names it as data)"
            )
        raise ShardFormatError(f"{path}: no manifest: is {folder} a folder written by pack-data?")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardFormatError(f"{path}: not valid JSON ({exc})") from None
    manifest = Manifest.from_dict(data, where=str(path))
    for i, shard in enumerate(manifest.shards):  # resolved: a shard that is a link out of the folder
        contained(folder, shard.file, f"{path} shards[{i}].file")
    if manifest.eval.get("folder"):
        contained(folder, manifest.eval["folder"], f"{path} eval.folder")
    return manifest


def write_manifest(folder: str | os.PathLike[str], manifest: Manifest) -> None:
    """Write `folder/manifest.json`, fsynced (the caller makes the folder visible atomically)."""
    path = Path(folder) / MANIFEST_NAME
    path.write_text(manifest.to_json(), encoding="utf-8")
    fsync_path(path)


def file_sha256(path: str | os.PathLike[str], chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks into one reused buffer (no allocation per chunk, which
    several hashing threads would otherwise spread over the allocator's per-thread arenas)."""
    digest = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as handle:
        while n := handle.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def pack_data_files(folder: str | os.PathLike[str]) -> set[str] | None:
    """The names pack-data wrote into `folder` (its manifest and the shards the manifest lists),
    or None when the folder holds no manifest that pack-data wrote (any format version)."""
    try:
        data = json.loads((Path(folder) / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        return None
    shards = data.get("shards") if isinstance(data.get("shards"), list) else []
    names = {MANIFEST_NAME} | {s["file"] for s in shards if isinstance(s, dict) and escape(s.get("file")) is None}
    held = data.get("eval") if isinstance(data.get("eval"), dict) else {}
    sub = held.get("folder")
    if isinstance(sub, str) and sub and "/" not in sub and sub not in (".", ".."):
        inner = pack_data_files(Path(folder) / sub)  # the eval folder counts only when it is all ours
        if inner is not None and {p.name for p in (Path(folder) / sub).iterdir()} <= inner:
            names.add(sub)
    return names
