"""ArcticTraining's ALST recipe (Arctic Long Sequence Training, arctic-training 0.8.0) on pack-train's
long rows (issue 69 item 4): the same token ids and labels, one example a row, the 8B Llama shape with
random weights; its tokens/s, peak GPU memory and loss as one JSON file.

    python3 scripts/bench/bench_context_parallel.py data /tmp/long --lengths 131072 --rows 2
    python3 scripts/bench/bench_alst.py setup --site /tmp/alst-site --extra .devcarry/fa2
    python3 scripts/bench/bench_alst.py run --data /tmp/long/len-131072 --model llama-8b --lora-r 16 \
        --steps 2 --gpu-memory-gib 78 --timeout 470 --json $OUT/alst_131072_8b_lora_h200_cap78.json

On the CPU (no Liger, no flash-attn there: the recipe's Hugging Face model type and sdpa instead),
with --site a folder `setup` filled for this interpreter:

    python3 scripts/bench/bench_context_parallel.py data /tmp/cpu --lengths 512 --rows 2 --vocab 4096
    python3 scripts/bench/bench_alst.py run --data /tmp/cpu/len-512 --model tiny --lora-r 4 --steps 3 \
        --attn sdpa --model-type huggingface --json /tmp/alst-cpu.json

`setup`: pip-installs the wheels of .devcarry/alst/wheels (arctic-training 0.8.0, deepspeed 0.19.8 built
without ops, transformers 4.57.6 with the tokenizers / huggingface_hub it accepts, pydantic, datasets
4.x, peft 0.17.1, liger-kernel 0.7.0, loguru, devtools ...) into --site with --no-deps, and copies
.devcarry/alst/stubs beside them: `wandb`, which ArcticTraining imports at module level but calls
only with `wandb.enable: true` (left off here), is a stub that refuses any call. Idempotent (a
stamp names the wheels installed).

`run`: the rows of --data (pack-train's reader: one example a row, else refused) go to an .npz file
that `scripts/benchlib/alst_source.py`, registered through the recipe's `code:` key, hands to
ArcticTraining's SFT data factory untouched (`process: false`, `div_length: 1`: no template, no
truncation, no padding); the model folder gets the preset's config.json (written here from
pack-train's preset) and seeded random bf16 weights (made once under the ALST packages, reused);
the YAML is ALST's one-GPU Llama-8B recipe (projects/sequence-parallelism/run-h100-sp1-llama-8b.yml:
ZeRO-3 with parameters and optimizer offloaded to the CPU, cpu_adam, tiled MLP, activation
checkpoints offloaded to the CPU, Liger's fused logits+loss, flash_attention_2, bf16 communication)
plus, with --lora-r R > 0, LoRA r=R, alpha 16 on every linear layer (pack-train's LoRA) on ZeRO-1
(the optimizer still offloaded, cpu_adam; the frozen bf16 weights on the GPU, as pack-train keeps
them): under ZeRO-3 deepspeed 0.19.8 stops at the first backward (`assert len(set(p.ds_id ...)) ==
len(params_in_bucket)` in stage3.py) because the tiled MLP's shards each hand it the same LoRA
gradient, and ZeRO-2 refuses a gradient reduced twice; ZeRO-1 reduces once after the backward.
--lora-r 0 is the recipe's full fine-tune on ZeRO-3 (its fp32 master weights, Adam states and
gradients, ~128 GB for the 8B, are beyond a 128 GiB host). ArcticTraining's entry point runs in one
child process (scripts/benchlib/alst_child.py, `python -P`, --site first on PYTHONPATH so
transformers 4.x shadows the system's 5.x for that process only) with --gpu-memory-gib applied
inside it first; the child's process group is killed when --timeout (seconds, for the weights and
the training together) runs out. The JSON: every step's loss, step time and tokens (ArcticTraining's
train-log-metrics.jsonl), tokens/s over the steps after the first, the peak GPU memory
(torch.cuda.max_memory_allocated in the child; nvidia-smi's and the host's used memory sampled every
2 s beside it), the versions, the YAML, the stubbed modules and, when it failed, the log's last
lines (and the exit code is 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from scripts.benchlib import (  # noqa: E402
    LLAMA2,
    REPO,
    OneLineParser,
    add_bench_args,
    check_output,
    jsonable,
    read_records,
    shared_dir,
    write_json,
    write_text_output,
)
from scripts.benchlib.alst_results import counted_flops, summarize  # noqa: E402

CARRY = REPO / ".devcarry" / "alst"
CHILD = REPO / "scripts" / "benchlib" / "alst_child.py"
SOURCE = REPO / "scripts" / "benchlib" / "alst_source.py"
STUBBED = ["wandb"]
STAMP = ".packlm-alst-site"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_dropout",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "hidden_act",
)


def setup(carry: Path, site: Path, extra: tuple[Path, ...] = ()) -> Path:
    """Install the carried wheels (and those of the `extra` folders: flash-attn's) and the stubs into
    `site` (made by this function; left alone when its stamp already names the same wheels). A
    folder without the stamp is not ours: refused."""
    wheels = sorted((carry / "wheels").glob("*.whl"))
    if not wheels:
        raise SystemExit(f"error: no wheels in {carry / 'wheels'}: carry .devcarry/alst (see this script's docstring)")
    for folder in extra:
        found = sorted(folder.glob("*.whl"))
        if not found:
            raise SystemExit(f"error: --extra {folder} holds no wheels: name a folder of .whl files")
        wheels += found
    want = "\n".join(w.name for w in wheels) + "\n"
    stamp = site / STAMP
    if stamp.is_file() and stamp.read_text() == want:
        return site
    if site.exists() and not stamp.is_file():
        raise SystemExit(f"error: --site {site} exists and was not made by this script: name a new folder")
    tmp = site.with_name(site.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-compile", "--target", str(tmp)]
    proc = subprocess.run([*pip, *map(str, wheels)], capture_output=True, text=True)
    if proc.returncode:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: pip could not install the wheels of {carry / 'wheels'} into {site}: {last}")
    shutil.copytree(carry / "stubs", tmp, dirs_exist_ok=True)
    write_text_output(tmp / STAMP, want, "--site")
    shutil.rmtree(site, ignore_errors=True)  # an older install of ours (its stamp was checked above)
    tmp.rename(site)
    return site


def model_config_json(preset: str, vocab: int | None) -> dict[str, Any]:
    """The Llama config.json of a pack-train preset, spelled for transformers 4.x (rope_theta at the
    top level: transformers 5 keeps it in rope_parameters)."""
    from trainer.model.load import preset_config

    config = preset_config(preset, vocab)
    values = {key: getattr(config, key) for key in CONFIG_KEYS}
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **values,
        "rope_theta": theta,
        "torch_dtype": "bfloat16",
        "use_cache": False,
    }


def read_packed_rows(folder: Path) -> tuple[dict[str, Any], list[int], int, int | None]:
    """The rows of a packed folder as the arrays of a rows.npz file (`ids_<i>` and `labels_<i>`,
    int64, as written: `alst_source.read_rows` reads them back); their lengths, loss tokens, and the
    vocab the manifest records (None: the preset's)."""
    import numpy as np

    from pipeline.errors import UserError
    from pipeline.shards import iter_rows, read_manifest
    from pipeline.shards.verify import manifest_vocab

    arrays: dict[str, Any] = {}
    lengths, loss_tokens = [], 0
    try:
        vocab = manifest_vocab(read_manifest(folder).tokenizer)
        for i, row in enumerate(iter_rows(folder)):
            if len(row["seq_lens"]) != 1:
                raise SystemExit(
                    f"error: --data {folder}: row {i} packs {len(row['seq_lens'])} examples; ArcticTraining's SFT path "
                    "trains one example a row: give a folder of one-example rows (bench_context_parallel.py data)"
                )
            arrays[f"ids_{i}"] = np.asarray(row["input_ids"], dtype=np.int64)
            arrays[f"labels_{i}"] = np.asarray(row["labels"], dtype=np.int64)
            lengths.append(int(row["input_ids"].size))
            loss_tokens += int((row["labels"][1:] != -100).sum())
    except UserError as exc:
        raise SystemExit(f"error: --data {folder}: {exc}") from None
    if not lengths:
        raise SystemExit(f"error: --data {folder} holds no rows: give a packed folder with rows")
    return arrays, lengths, loss_tokens, vocab


def write_tokenizer(source: Path, out: Path) -> None:
    """The Llama-2 tokenizer for transformers 4.x: its tokenizer.json as it is, beside a minimal
    tokenizer_config.json (the shared one is transformers 5's, whose list of extra special tokens 4.x
    cannot read). ArcticTraining only loads it (its pad id pads nothing here: `div_length: 1`)."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "tokenizer.json", out / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    write_text_output(out / "tokenizer_config.json", json.dumps(config, indent=1), "--work")


def recipe(a: argparse.Namespace, work: Path, model_dir: Path, tokenizer: Path, max_length: int) -> dict[str, Any]:
    """ALST's one-GPU Llama-8B recipe (run-h100-sp1-llama-8b.yml) on these rows; LoRA with --lora-r."""
    model: dict[str, Any] = {"type": a.model_type, "name_or_path": str(model_dir), "attn_implementation": a.attn}
    if a.lora_r > 0:
        model["peft_config"] = {
            "peft_type": "Lora",
            "task_type": "CAUSAL_LM",
            "r": a.lora_r,
            "lora_alpha": 16,
            "lora_dropout": 0.0,
            "target_modules": LORA_TARGETS,
        }
    offload = {"device": "cpu"}
    zero: dict[str, Any] = {"stage": a.zero_stage, "offload_optimizer": offload}
    if a.zero_stage == 3:
        zero["offload_param"] = offload
    return {
        "type": "sft",
        "code": str(work / SOURCE.name),
        "micro_batch_size": 1,
        "exit_iteration": a.steps,
        "min_iterations": a.steps,
        "activation_checkpoint_cpu_offload": True,
        "tiled_mlp_compute": True,
        "sequence_parallel_size": 1,
        "seed": a.seed,
        "train_log_metrics_path": str(work / "train-log-metrics.jsonl"),
        "deepspeed": {
            "zero_optimization": zero,
            "seq_parallel_communication_data_type": "bf16",
        },
        "optimizer": {"type": "cpu_adam", "learning_rate": a.lr},
        "model": model,
        "tokenizer": {"name_or_path": str(tokenizer)},
        "data": {
            "sources": [{"type": "packlm_rows", "path": str(work / "rows.npz"), "process": False}],
            "max_length": max_length,
            "div_length": 1,
            "num_proc": 1,
            "dl_num_workers": 1,
            "cache_dir": str(work / "data-cache"),
        },
        "logger": {"level": "WARNING", "output_dir": str(work / "logs")},
    }


def sample_memory(peaks: dict[str, int]) -> None:
    """Raise `peaks` to the host's used memory (MemTotal - MemAvailable) and the GPUs' used memory as
    nvidia-smi reads it (MiB; nvidia-smi only where there is one)."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        used = (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) // 1024
        peaks["host_used_mib"] = max(peaks.get("host_used_mib", 0), used)
    except (OSError, KeyError, ValueError):
        pass
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        try:
            out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.split()
            peaks["nvidia_smi_used_mib"] = max([peaks.get("nvidia_smi_used_mib", 0), *map(int, out)])
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass


def run_child(
    cmd: list[str], env: dict[str, str], log: Path, deadline: float, peaks: dict[str, int] | None = None
) -> tuple[int | None, bool]:
    """Run `cmd` in its own process group, output appended to `log`, sampling memory into `peaks`
    every 2 s; the group is ended (TERM, then KILL 15 s later) at `deadline` (time.monotonic).
    Returns (exit code, timed out)."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                try:
                    return proc.wait(timeout=max(0.1, min(2.0, deadline - time.monotonic()))), False
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        raise
                    if peaks is not None:
                        sample_memory(peaks)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return proc.returncode, True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(a: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import numpy as np
    import yaml

    deadline = time.monotonic() + a.timeout
    site = Path(a.site)
    if not (site / STAMP).is_file() and not a.no_site_check:
        raise SystemExit(f"error: --site {site} is not set up: run `bench_alst.py setup --site {site}` first")
    tokenizer = Path(a.tokenizer) if a.tokenizer else shared_dir() / LLAMA2
    if not (tokenizer / "tokenizer.json").is_file():
        raise SystemExit(f"error: --tokenizer {tokenizer} has no tokenizer.json: name the Llama-2 tokenizer's folder")
    if a.work and Path(a.work).exists() and (not Path(a.work).is_dir() or any(Path(a.work).iterdir())):
        raise SystemExit(f"error: --work {a.work} is not an empty folder: name a new or empty one")
    arrays, lengths, loss_tokens, vocab = read_packed_rows(Path(a.data))  # before anything is written
    work = Path(a.work or tempfile.mkdtemp(prefix="alst-run-"))
    work.mkdir(parents=True, exist_ok=True)
    np.savez(work / "rows.npz", **arrays)
    shutil.copy(SOURCE, work / SOURCE.name)
    write_tokenizer(tokenizer, work / "tokenizer")
    model_dir = Path(a.model_dir or f"/tmp/alst-model-{a.model}-v{vocab or 'preset'}-s{a.seed}")
    config = model_config_json(a.model, vocab)
    model_dir.mkdir(parents=True, exist_ok=True)
    write_text_output(model_dir / "config.json", json.dumps(config, indent=1), "--model-dir")
    cfg = recipe(a, work, model_dir, work / "tokenizer", max(lengths))
    write_text_output(work / "alst.yaml", yaml.safe_dump(cfg, sort_keys=False), "--work")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=str(site.resolve()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",  # ALST's USAGE.md
        DS_SKIP_CUDA_CHECK="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
    )
    python = a.python or sys.executable
    log = work / "alst.log"
    record: dict[str, Any] = {
        "tool": "arctic-training ALST (projects/sequence-parallelism run-h100-sp1-llama-8b.yml)",
        "command": ["bench_alst.py", *sys.argv[1:]],
        "args": jsonable(a),
        "data": str(a.data),
        "row_lengths": lengths,
        "loss_tokens": loss_tokens,
        "model": a.model,
        "model_config": config,
        "lora_r": a.lora_r,
        "fine_tune": f"LoRA r={a.lora_r} alpha 16 on every linear layer" if a.lora_r else "full fine-tune",
        "gpu_memory_gib_cap": a.gpu_memory_gib,
        "stubbed_modules": STUBBED,
        "yaml": cfg,
        "work": str(work),
    }
    rc, timed_out = run_child([python, "-P", str(CHILD), "weights", str(model_dir), "--seed", str(a.seed)], env, log, deadline)
    if rc == 0 and not timed_out:
        cmd = [python, "-P", str(CHILD), "train", str(work / "alst.yaml"), "--peak-json", str(work / "peak.json")]
        if a.gpu_memory_gib is not None:
            cmd += ["--gpu-memory-gib", str(a.gpu_memory_gib)]
        peaks: dict[str, int] = {}
        rc, timed_out = run_child(cmd, env, log, deadline, peaks)
        record["memory_sampled_every_2s"] = peaks
    metrics = work / "train-log-metrics.jsonl"
    steps = read_records(metrics) if metrics.is_file() else []
    record["steps"] = steps
    record.update(summarize(steps))
    record.update(counted_flops(a, vocab, lengths, record))
    peak = json.loads((work / "peak.json").read_text()) if (work / "peak.json").is_file() else {}
    record["versions"] = peak.pop("versions", {})
    for key in ("max_memory_allocated", "max_memory_reserved", "total_memory"):
        if key in peak:
            record[f"peak_{key}_gib" if key != "total_memory" else "gpu_total_gib"] = round(peak[key] / 2**30, 2)
    record["status"] = "timeout" if timed_out else ("ok" if rc == 0 and len(steps) >= a.steps else "failed")
    record["returncode"] = rc
    if record["status"] != "ok":
        record["log_tail"] = log.read_text(errors="replace").splitlines()[-40:]
    return record


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    set_up = sub.add_parser("setup", help="install the carried wheels and stubs into --site")
    set_up.add_argument("--site", default="/tmp/alst-site")
    set_up.add_argument("--carry", default=str(CARRY), help="the folder holding wheels/ and stubs/")
    set_up.add_argument("--extra", action="append", default=[], help="another folder of wheels (.devcarry/fa2: flash-attn)")
    r = sub.add_parser("run", help="ALST's recipe on a packed folder of one-example rows")
    r.add_argument("--data", required=True, help="a packed folder of one-example rows (bench_context_parallel.py data)")
    add_bench_args(
        r,
        model=("llama-8b", "a pack-train preset (llama-8b; tiny for a CPU check)"),
        lora_r=(16, "LoRA rank on every linear layer; 0: the recipe's full fine-tune"),
        steps=(3, "steps (the first is left out of tokens/s)"),
        lr=(1e-5, "the recipe's learning rate"),
        seed=0,
        json=str,
        tokenizer=None,
    )
    r.add_argument(
        "--zero-stage", type=int, choices=[1, 2, 3], default=None, help="3: the recipe's (default for --lora-r 0); 1: default with LoRA"
    )
    r.add_argument("--gpu-memory-gib", type=float, default=None, help="cap the child's CUDA allocator (GiB)")
    r.add_argument("--timeout", type=float, default=480, help="seconds for weights + training; then the child group is killed")
    r.add_argument("--site", default="/tmp/alst-site", help="the folder `setup` filled")
    r.add_argument("--work", default=None, help="a new folder for the YAML, rows, cache and log (default: a fresh /tmp one)")
    r.add_argument("--model-dir", default=None, help="where the random weights are made once and reused")
    r.add_argument("--python", default=None, help="the interpreter of the ALST child (default: this one)")
    r.add_argument("--attn", default="flash_attention_2", help="the recipe's attention (sdpa for a CPU check)")
    r.add_argument("--model-type", default="liger", choices=["liger", "huggingface"], help="liger: the recipe's fused loss")
    r.add_argument("--no-site-check", action="store_true", help="--site need not be setup's (a venv with the packages)")
    a = parser.parse_args(argv)
    if a.command == "setup":
        print(setup(Path(a.carry), Path(a.site), tuple(map(Path, a.extra))))
        return None
    if not a.json:
        parser.error("run needs --json: the result file")
    if a.steps < 2:
        parser.error("--steps must be at least 2: the first step is left out of tokens/s")
    check_output(a.json, "--json")
    if a.zero_stage is None:
        a.zero_stage = 1 if a.lora_r > 0 else 3
    record = run(a)
    write_json(a.json, record)
    print(json.dumps({k: record.get(k) for k in ("status", "tokens_per_s", "peak_max_memory_allocated_gib", "loss_first", "loss_last")}))
    return record


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result is None or result["status"] == "ok" else 1)  # the JSON says why
