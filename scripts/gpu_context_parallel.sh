#!/usr/bin/env bash
# Context parallelism on a 2-GPU CUDA box (issue 57), from the repository root:
#
#   OUT=folder bash scripts/gpu_context_parallel.sh check|short|long
#
# check: scripts/bench_context_parallel.py check (flash_attn bf16 and sdpa fp32, context-parallel
#        against the whole row) -> $OUT/check.json
# short: the 8B shape, LoRA r16, every layer recomputed, no compile, rows of one 32,768-token example:
#        one GPU, then two with --context-parallel 2 -> $OUT/short.json
# long:  the same at 131,072 tokens on two GPUs with --context-parallel 2 (one GPU runs out of memory
#        there), then 262,144 with --tile-mlp 8192 --offload-activations -> $OUT/long.json
# Logs: $OUT/PART.log. flash-attn must import (PYTHONPATH).
set -o pipefail
set -u
export PYTHONUNBUFFERED=1
OUT="${OUT:-out/gpu_context_parallel}"
DATA="${DATA:-/tmp/long-rows}"
STEPS="${STEPS:-3}"
mkdir -p "$OUT"
part="${1:?usage: OUT=folder bash scripts/gpu_context_parallel.sh check|short|long}"

train() {  # NAME NPROC LENGTH [extra pack-train flags...]
  local name=$1 nproc=$2 length=$3
  shift 3
  timeout 540 torchrun --nproc-per-node "$nproc" -m trainer.cli --data "$DATA/len-$length" --model llama-8b \
    --lora-r 16 --grad-checkpointing --no-compile --tokens-per-step "$length" --max-steps "$STEPS" \
    --log-every 1 --no-progress --out "/tmp/runs/$name" "$@" 2>&1 | grep -v "^W1" | tail -25
  echo "== $name exit ${PIPESTATUS[0]}"
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
  *)
    echo "usage: OUT=folder bash scripts/gpu_context_parallel.sh check|short|long (got '$part')" >&2
    exit 2
    ;;
esac 2>&1 | tee "$OUT/$part.log"
