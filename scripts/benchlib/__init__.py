"""The one library the scripts share (scripts/bench/, scripts/tools/, tests/gpu/): a script imports
it as `scripts.benchlib` once its first lines put the repository on sys.path, and imports no other
script.

- `shared`: the repository and the shared data (`../shared`: GSM8K, CodeAlpaca, the Llama-2
  tokenizer), one line naming what is missing.
- `machine`: machine facts, timing (best of N), peak memory (RSS high-water mark, CUDA's peak).
- `output`: result files (`check_output` before the work, `write_output`: whole or not at all, one
  line on a refused target or a full disk) and one-line argparse errors.
- `args`: the options the benchmarks share (--model, --steps, --warmup, --json ...), declared once.
- `packing`: pack-data jobs and the packed folders they write, read back as groups, examples, steps.
- `training`: devices, the Hugging Face baseline model, AdamW, autocast, right-padded batches, a
  held-out loss over them.
- imported by name, not from here (numpy, torch or the product at module level, or one benchmark's
  own): `train_steps`, `train_results`, `train_runs` (the training benchmarks' step loop, results and
  pack-train runs), `metrics_rates` (tokens/s from pack-train's metrics lines), `pack_data_runs`
  (pack-data and its baselines in child processes), `trl_data` and `trl_run` (bench_trl.py's
  examples for TRL, its TRL run), `ring_peer` and `ring_attention` (ring-flash-attn's peer of
  pack-train --context-parallel, its attention), `sample_words`, `sample_code` and `sample_text`
  (the sample data's templated text).

Only the standard library is imported at module level by what this file re-exports:
bench_pack_data.py times fresh processes that import it, and the GPU box has neither polars nor
datasets. numpy, torch, transformers and the pipeline/trainer modules are imported by the functions
that use them.
"""

from .args import AUTO_DEVICE, add_bench_args
from .machine import (
    best_of,
    cpu_model,
    cuda_peak_gib,
    device_name,
    fix_malloc,
    free_memory,
    machine_summary,
    reset_cuda_peak,
    reset_rss_peak,
    rss_peak_extra_mb,
    timed,
    vmhwm_mb,
)
from .output import OneLineParser, check_output, check_output_folder, jsonable, write_json, write_jsonl, write_output, write_text_output
from .packing import (
    PREP_STRATEGIES,
    PackJob,
    examples_by_id,
    ffd_steps,
    group_example_ids,
    minibatch_groups,
    pack_data_args,
    prepare_data,
    run_pack_jobs,
    tokenizer_ids,
)
from .shared import CODEALPACA, GSM8K, LLAMA2, REPO, load_source_examples, read_records, require, seeded_order, shared_dir
from .training import (
    autocast_ctx,
    build_hf_model,
    flop_rates,
    heldout_loss,
    make_optimizer,
    model_config,
    optimizer_step,
    pad_collate,
    resolve_device,
    sync,
    to_device,
)

__all__ = [
    "AUTO_DEVICE",
    "CODEALPACA",
    "GSM8K",
    "LLAMA2",
    "PREP_STRATEGIES",
    "REPO",
    "OneLineParser",
    "PackJob",
    "add_bench_args",
    "autocast_ctx",
    "best_of",
    "build_hf_model",
    "check_output",
    "check_output_folder",
    "cpu_model",
    "cuda_peak_gib",
    "device_name",
    "examples_by_id",
    "ffd_steps",
    "fix_malloc",
    "flop_rates",
    "free_memory",
    "group_example_ids",
    "heldout_loss",
    "jsonable",
    "load_source_examples",
    "machine_summary",
    "make_optimizer",
    "minibatch_groups",
    "model_config",
    "optimizer_step",
    "pack_data_args",
    "pad_collate",
    "prepare_data",
    "read_records",
    "require",
    "reset_cuda_peak",
    "reset_rss_peak",
    "resolve_device",
    "rss_peak_extra_mb",
    "run_pack_jobs",
    "seeded_order",
    "shared_dir",
    "sync",
    "timed",
    "to_device",
    "tokenizer_ids",
    "vmhwm_mb",
    "write_json",
    "write_jsonl",
    "write_output",
    "write_text_output",
]
