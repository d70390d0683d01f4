#!/usr/bin/env bash
# Context parallelism and long rows on CUDA boxes (issue 57), from the repository root:
#
#   OUT=folder bash scripts/gpu_context_parallel.sh check|short|long|one|four
#
# check: scripts/bench_context_parallel.py check (flash_attn bf16 and sdpa fp32, context-parallel
#        against the whole row) -> $OUT/check.json
# short: the 8B shape, LoRA r16, every layer recomputed, no compile, rows of one 32,768-token example:
#        one GPU, then two with --context-parallel 2 -> $OUT/short.json
# long:  the same at 131,072 tokens on two GPUs with --context-parallel 2 (one GPU runs out of memory
#        there), then 262,144 with --tile-mlp 8192 --offload-activations -> $OUT/long.json
# one:   one GPU, 8B LoRA, one LENGTH-token example (LENGTH, default 262,144) with --tile-mlp 8192
#        --offload-activations: the start-up memory check's line and one step -> $OUT/one.json
# four:  four GPUs: 8B LoRA at 65,536 tokens on one GPU, then with --context-parallel 4 (scaling);
#        then the 8B full fine-tune, FSDP2 over the four with --context-parallel 4, --tile-mlp 8192
#        --offload-activations at FULL_LENGTH (default 262,144) tokens -> $OUT/four.json
# Logs: $OUT/PART.log (each run's whole stderr: /tmp/runs/NAME.log). flash-attn must import (PYTHONPATH).
set -o pipefail
set -u
export PYTHONUNBUFFERED=1
OUT="${OUT:-out/gpu_context_parallel}"
DATA="${DATA:-/tmp/long-rows}"
STEPS="${STEPS:-3}"
mkdir -p "$OUT"
part="${1:?usage: OUT=folder bash scripts/gpu_context_parallel.sh check|short|long|one|four}"

train() {  # NAME NPROC LENGTH [extra pack-train flags...]: 8B LoRA r16 (FULL=1: a full fine-tune)
  local name=$1 nproc=$2 length=$3
  shift 3
  local lora=(--lora-r 16)
  [ -n "${FULL:-}" ] && lora=()
  mkdir -p /tmp/runs
  timeout "${LIMIT:-540}" torchrun --nproc-per-node "$nproc" -m trainer.cli --data "$DATA/len-$length" \
    --model llama-8b --grad-checkpointing --no-compile --tokens-per-step "$length" --max-steps "$STEPS" \
    --log-every 1 --no-progress --out "/tmp/runs/$name" "${lora[@]}" "$@" > "/tmp/runs/$name.log" 2>&1
  local rc=$?
  grep -v "^W1" "/tmp/runs/$name.log" | grep -v "^\s*$" | tail -40
  echo "== $name exit $rc"
}

case "$part" in
  check)
    torchrun --nproc-per-node 2 scripts/bench_context_parallel.py check --json "$OUT/check.json" 2>&1 | tail -40
    ;;
  short)
    python scripts/bench_context_parallel.py data "$DATA" --lengths 32768 --rows 3
    train one-32768 1 32768
    train cp2-32768 2 32768 --context-parallel 2
    python scripts/bench_context_parallel.py report /tmp/runs/one-32768 /tmp/runs/cp2-32768 --json "$OUT/short.json"
    ;;
  long)
    python scripts/bench_context_parallel.py data "$DATA" --lengths 131072,262144 --rows 3
    train cp2-131072 2 131072 --context-parallel 2
    train cp2-262144-tiled 2 262144 --context-parallel 2 --tile-mlp 8192 --offload-activations
    python scripts/bench_context_parallel.py report /tmp/runs/cp2-131072 /tmp/runs/cp2-262144-tiled \
      --json "$OUT/long.json"
    ;;
  one)
    length="${LENGTH:-262144}"
    python scripts/bench_context_parallel.py data "$DATA" --lengths "$length" --rows 2
    STEPS=1 train "one-$length-tiled" 1 "$length" --tile-mlp 8192 --offload-activations
    python scripts/bench_context_parallel.py report "/tmp/runs/one-$length-tiled" --json "$OUT/one.json"
    ;;
  four)
    full="${FULL_LENGTH:-262144}"
    python scripts/bench_context_parallel.py data "$DATA" --lengths "65536,$full" --rows 4
    CUDA_VISIBLE_DEVICES=0 train one-65536 1 65536
    train cp4-65536 4 65536 --context-parallel 4
    FULL=1 STEPS=2 train "fsdp-cp4-$full" 4 "$full" --parallel fsdp --context-parallel 4 --tile-mlp 8192 \
      --offload-activations
    python scripts/bench_context_parallel.py report /tmp/runs/one-65536 /tmp/runs/cp4-65536 \
      "/tmp/runs/fsdp-cp4-$full" --json "$OUT/four.json"
    ;;
  *)
    echo "usage: OUT=folder bash scripts/gpu_context_parallel.sh check|short|long|one|four (got '$part')" >&2
    exit 2
    ;;
esac 2>&1 | tee "$OUT/$part.log"
