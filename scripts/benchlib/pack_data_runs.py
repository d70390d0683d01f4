"""pack-data and its baselines, each in a fresh child process (its imports, its peak RSS): pack-data's
job (`pipeline.engines.job.run_pack_data`, cold then warm runs), the raw tokenizer's first pass and
the two TRL-style pipelines (a batched map + `pack_dataset`; SFTTrainer's per-example steps), on
the same rendered texts. The children run from the repository's root and import this module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .shared import LLAMA2, REPO, read_records, shared_dir

SHARED = shared_dir()
TOKENIZER = SHARED / LLAMA2


CHILD = r"""
import json, resource, sys, time
from scripts.benchlib.machine import vmhwm_mb
from pipeline.tokenize.encode_pool import close_pool
from pipeline.engines.job import PackConfig, run_pack_data
cfg = json.loads(sys.argv[1])
repeat = int(sys.argv[2])
runs = []
for i in range(repeat):  # run 1 is cold (fresh process); later runs reuse its imports, numba kernels, worker pool
    stats = {}
    t = time.perf_counter()
    m = run_pack_data(PackConfig(**{**cfg, "overwrite": True}), stats=stats)
    stats["wall"] = time.perf_counter() - t
    runs.append(stats)
stats = runs[0]
stats["warm_runs"] = runs[1:]
# this process's own peak: VmHWM. Its ru_maxrss would count the benchmark's RSS too, which Linux
# keeps across the exec that started it (the benchmark holds GBs of token lists at times)
hwm = vmhwm_mb()
stats["maxrss_self_mb"] = hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
# the largest forked child's peak (the tokenizer worker processes, text input only; none for
# pre-tokenized input): pages it shares with this process count in full, so this is an upper bound
# of what it adds. The job keeps its worker pool for later jobs; only children that have exited and
# been waited for count, so the pool is closed (its workers joined) first
close_pool()
stats["maxrss_children_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
stats["efficiency"] = m.efficiency
stats["loss_tokens"] = m.loss_tokens
print("STATS " + json.dumps(stats))
"""


def run_child(code: str, *argv: str, what: str) -> dict:
    """Run `python -c code argv...` in a fresh interpreter (repo root, this SHARED); return the JSON
    it prints on its `STATS ` line."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, check=False, env=child_env())
    process_s = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("STATS "))[6:])
    return {**out, "process_s": process_s}


def child_env() -> dict[str, str]:
    """The environment of a child process: this one's, with this SHARED."""
    return {**os.environ, "SHARED": str(SHARED)}


def pack_in_child(repeat: int = 1, **config) -> dict:
    """Run run_pack_data(PackConfig(**config)) `repeat` times in a fresh interpreter; return the stats.

    The returned stats are the first (cold) run's; later (warm) runs are under "warm_runs".
    """
    config.setdefault("progress", False)
    return run_child(CHILD, json.dumps(config), str(repeat), what="pack-data child")


def rendered_texts(path: Path, tokenizer) -> list[str]:
    """Exactly the texts pack-data tokenizes for this file: each example's rendered segments
    (prompt, response) joined into its whole text."""
    from itertools import groupby

    from pipeline.read.batches import column_names, iter_batches
    from pipeline.read.formats import FormatOptions, detect_format
    from pipeline.read.sources import resolve_inputs
    from pipeline.tokenize.render import render

    files = resolve_inputs([str(path)])
    fmt = detect_format(column_names(files), FormatOptions())
    texts: list[str] = []
    for batch in iter_batches(files):
        segs = render(batch.table, fmt, batch.where, tokenizer)
        pairs = zip(segs.example.tolist(), segs.texts)
        texts.extend("".join(t for _, t in group) for _, group in groupby(pairs, key=lambda p: p[0]))
    return texts


def trl_pipeline(path: Path, tokenizer, tmp: Path, max_len: int, num_proc: int) -> dict:
    """datasets.map tokenization + trl pack_dataset(bfd) + save_to_disk, same texts and labels rule."""
    import datasets
    from trl.data_utils import pack_dataset

    from pipeline.read.formats import FormatOptions, detect_format
    from pipeline.tokenize.render import render, rows_where

    t0 = time.perf_counter()
    kind = "json"
    ds = datasets.load_dataset(kind, data_files=str(path), split="train", cache_dir=str(tmp / f"hf-cache-batched-{path.stem}"))
    fmt = detect_format(ds.column_names, FormatOptions())
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id

    def tok(batch):
        import pyarrow as pa

        segs = render(pa.table({k: batch[k] for k in batch}), fmt, rows_where(str(path)), tokenizer)
        enc = tokenizer(segs.texts, add_special_tokens=False)["input_ids"]
        ids, labels = [], []
        for i in range(0, len(enc), 2):
            p, r = enc[i], enc[i + 1]
            ids.append([bos, *p, *r, eos])
            labels.append([-100] * (len(p) + 1) + r + [eos])
        return {"input_ids": ids, "labels": labels}

    ds = ds.map(tok, batched=True, remove_columns=ds.column_names, num_proc=num_proc if num_proc > 1 else None)
    t1 = time.perf_counter()
    packed = pack_dataset(ds, seq_length=max_len, strategy="bfd")
    t2 = time.perf_counter()
    packed.save_to_disk(str(tmp / f"trl-out-{path.stem}"))
    t3 = time.perf_counter()
    tokens = sum(len(x) for x in ds["input_ids"])
    return {
        "tokens": tokens,
        "rows": len(packed),
        "seconds": t3 - t0,
        "phases": {"load+map": t1 - t0, "pack_dataset": t2 - t1, "save_to_disk": t3 - t2},
    }


def trl_sft_pipeline(path: Path, tokenizer, tmp: Path, max_len: int, num_proc: int) -> dict:
    """What trl.SFTTrainer._prepare_dataset does to a prompt/completion dataset with packing (bfd),
    step by step with TRL's own helpers and its `map` calls (per example, as TRL runs them), + save_to_disk."""
    import datasets
    from trl.data_utils import _tokenize, common_prefix_length, pack_dataset

    from pipeline.read.formats import FormatOptions, detect_format
    from pipeline.tokenize.render import render, rows_where

    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp / f"hf-cache-sft-{path.stem}"))
    fmt = detect_format(ds.column_names, FormatOptions())
    map_kwargs = {"num_proc": num_proc if num_proc > 1 else None}

    def to_prompt_completion(batch):  # the user's preparation: the same rendered texts as pack-data
        import pyarrow as pa

        segs = render(pa.table({k: batch[k] for k in batch}), fmt, rows_where(str(path)), tokenizer)
        return {"prompt": segs.texts[0::2], "completion": segs.texts[1::2]}

    ds = ds.map(to_prompt_completion, batched=True, remove_columns=ds.column_names, **map_kwargs)
    t1 = time.perf_counter()

    # --- from here on, what SFTTrainer runs (trl/trainer/sft_trainer.py) ---
    def add_eos(example, eos_token):  # non-conversational prompt/completion: EOS appended to the completion
        if not example["completion"].endswith(eos_token):
            example["completion"] = example["completion"] + eos_token
        return example

    ds = ds.map(add_eos, fn_kwargs={"eos_token": tokenizer.eos_token}, **map_kwargs)

    def tokenize_fn(example, processing_class):  # the prompt-completion, non-conversational branch
        prompt_ids = _tokenize(processing_class, example["prompt"], chat_template=None)["input_ids"]
        prompt_completion_ids = _tokenize(processing_class, example["prompt"] + example["completion"], chat_template=None)["input_ids"]
        prompt_len = common_prefix_length(prompt_ids, prompt_completion_ids)
        completion_mask = [0] * prompt_len + [1] * (len(prompt_completion_ids) - prompt_len)
        return {"input_ids": prompt_completion_ids, "completion_mask": completion_mask}

    ds = ds.map(tokenize_fn, fn_kwargs={"processing_class": tokenizer}, **map_kwargs)

    def build_labels(example, mask_columns):
        masks = [example[column] for column in mask_columns]
        labels = [token_id if all(bits) else -100 for token_id, *bits in zip(example["input_ids"], *masks, strict=False)]
        return {"labels": labels}

    ds = ds.map(build_labels, fn_kwargs={"mask_columns": ["completion_mask"]}, remove_columns=["completion_mask"], **map_kwargs)
    t2 = time.perf_counter()
    ds = ds.select_columns(["input_ids", "labels"])
    packed = pack_dataset(ds, max_len, "bfd", map_kwargs)
    t3 = time.perf_counter()
    packed.save_to_disk(str(tmp / f"trl-sft-out-{path.stem}"))
    t4 = time.perf_counter()
    tokens = sum(len(x) for x in ds["input_ids"])
    return {
        "tokens": tokens,
        "rows": len(packed),
        "seconds": t4 - t0,
        "phases": {"load+render": t1 - t0, "eos+tokenize+labels maps": t2 - t1, "pack_dataset": t3 - t2, "save_to_disk": t4 - t3},
    }


BASELINE_CHILD = r"""
import json, sys, time
from pathlib import Path
from scripts.benchlib import pack_data_runs as b
import datasets, trl.data_utils  # imported before the clock, as pack-data's setup is excluded
from transformers import AutoTokenizer
kind, path, tmp, max_len = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
tokenizer = AutoTokenizer.from_pretrained(str(b.TOKENIZER), local_files_only=True)  # fresh: caches cold
if kind == "raw":
    texts = b.rendered_texts(path, tokenizer)
    backend = tokenizer.backend_tokenizer
    t = time.perf_counter()
    n = sum(len(e.ids) for e in backend.encode_batch_fast(texts, add_special_tokens=False))
    out = {"tokens": n, "seconds": time.perf_counter() - t}
elif kind == "trl":
    out = b.trl_pipeline(path, tokenizer, tmp, max_len, 1)
else:
    out = b.trl_sft_pipeline(path, tokenizer, tmp, max_len, 1)
print("STATS " + json.dumps(out))
"""


def baseline_in_child(kind: str, path: Path, tmp: Path, max_len: int) -> dict:
    """One cold baseline (`raw`: the first encode_batch_fast call over the texts; `trl`; `sft`) in a
    fresh interpreter with a freshly loaded tokenizer, timed after its imports, like pack-data's child
    (and, as `process_s`, the whole process)."""
    return run_child(BASELINE_CHILD, kind, str(path), str(tmp / f"cold-{kind}"), str(max_len), what=f"cold {kind} baseline")


def make_copies(path: Path, copies: int, out: Path) -> Path:
    """`path`'s records `copies` times over as JSONL at `out`, copy k's first field prefixed "k. "."""
    records = read_records(path)
    first = next(iter(records[0]))
    with out.open("w") as f:
        for k in range(copies):
            for r in records:
                f.write(json.dumps({**r, first: f"{k}. {r[first]}"}) + "\n")
    return out


def make_pretokenized(path: Path, tokens: int, seed: int = 0, vocab: int = 32000) -> int:
    """Write `input_ids` rows (lengths 16..4096, about `tokens` in all) as Parquet or Arrow IPC (by suffix)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    schema = pa.schema([pa.field("input_ids", pa.list_(pa.int32()))])
    written = 0
    if path.suffix == ".parquet":
        writer_cm = pq.ParquetWriter(str(path), schema, compression="none")
    else:
        writer_cm = pa.ipc.new_file(pa.OSFile(str(path), "wb"), schema)
    with writer_cm as writer:
        while written < tokens:
            lens = rng.integers(16, 4097, size=8192).astype(np.int32)
            lens = lens[np.cumsum(lens) <= tokens - written] if lens.sum() > tokens - written else lens
            if len(lens) == 0:
                lens = np.array([max(1, tokens - written)], np.int32)
            values = rng.integers(3, vocab, size=int(lens.sum()), dtype=np.int32)
            offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
            arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
            if path.suffix == ".parquet":
                writer.write_table(pa.table([arr], schema=schema), row_group_size=len(lens))
            else:
                writer.write_batch(pa.record_batch([arr], schema=schema))
            written += int(lens.sum())
    return written


SAMPLE = REPO / "data" / "sample" / "instructions.jsonl"


def replicate(target_mb: int, out: Path) -> Path:
    """SAMPLE's records, copy k's instruction prefixed with "k: ", until the file holds target_mb MB."""
    records = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    path = out / f"long-{target_mb}mb.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        copy = 0
        while f.tell() < target_mb << 20:
            for r in records:
                f.write(json.dumps({**r, "instruction": f"{copy}: {r['instruction']}"}) + "\n")
            copy += 1
    return path
