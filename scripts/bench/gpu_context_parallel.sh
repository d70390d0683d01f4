#!/usr/bin/env bash
# Context parallelism and long rows on CUDA boxes (issue 57), from the repository root:
#
#   OUT=folder bash scripts/bench/gpu_context_parallel.sh check|short|long|one|four|full
#
# Every run recomputes every layer and, unless COMPILE=1, runs eager (--no-compile); ATTN=KERNEL passes --attn KERNEL
# (default auto: fa4 where installed, one GPU or context-parallel).
# check: scripts/bench/bench_context_parallel.py check (fa4 where installed and flash_attn in bf16, sdpa fp32, context-parallel
#        against the whole row) -> $OUT/check.json
# short: the 8B shape, LoRA r16, every layer recomputed, no compile, rows of one 32,768-token example:
#        one GPU, then two with --context-parallel 2 -> $OUT/short.json
# long:  the same at 131,072 tokens on two GPUs with --context-parallel 2 (one GPU runs out of memory
#        there), then 262,144 with --tile-mlp 8192 --offload-activations -> $OUT/long.json
# one:   one GPU (GPU, default 0), 8B LoRA, one LENGTH-token example (LENGTH, default 262,144) with
#        --tile-mlp 8192 --offload-activations: the start-up memory check's line and one step ->
#        $OUT/one-LENGTH[-compiled].json, the host's used memory every 5 s -> $OUT/host_mem-GPU.log.
#        524,288 tokens offload 128 GiB of layer inputs: run it on one GPU of a box with more host
#        memory than that (a two- or four-GPU one).
# four:  four GPUs, 8B LoRA r16 at 65,536 tokens: one GPU, then --context-parallel 4 (scaling)
#        -> $OUT/four.json
# full:  the 8B full fine-tune (AdamW), FSDP2 over NPROC GPUs (default 4) with --context-parallel
#        NPROC, --tile-mlp 8192 --offload-activations: the memory check's line and one step of one
#        LENGTH-token example (default 1,048,576) -> $OUT/full.json, the host's used memory every 5 s
#        -> $OUT/host_mem.log (OFFLOAD_STATES=1: with --offload-states, the weights' shards,
#        gradients and AdamW moments in CPU memory). The run ends by writing an 8B checkpoint with its fp32
#        weights and AdamW moments (minutes): its LIMIT (default 1,700 s) covers that. Attention
#        grows with the square of the length: a step at 1,048,576 takes about four times one at
#        524,288 (BENCHMARKS.md, "Context parallelism"), so run it detached (setsid) and poll.
# Logs: $OUT/PART.log (each run's whole stderr: /tmp/runs/NAME.log). flash-attn must import (PYTHONPATH).
set -o pipefail
set -u
export PYTHONUNBUFFERED=1
OUT="${OUT:-out/gpu_context_parallel}"
DATA="${DATA:-/tmp/long-rows}"
STEPS="${STEPS:-3}"
mkdir -p "$OUT"
part="${1:?usage: OUT=folder bash scripts/bench/gpu_context_parallel.sh check|short|long|one|four|full}"

train() {  # NAME NPROC LENGTH [extra pack-train flags...]: 8B LoRA r16 (FULL=1: a full fine-tune)
  local name=$1 nproc=$2 length=$3
  shift 3
  local lora=(--lora-r 16)
  [ -n "${FULL:-}" ] && lora=()
  mkdir -p /tmp/runs
  local flags=()
  [ -z "${COMPILE:-}" ] && flags+=(--no-compile)
  [ -n "${ATTN:-}" ] && flags+=(--attn "$ATTN")
  timeout "${LIMIT:-540}" torchrun --nproc-per-node "$nproc" --master-port "${PORT:-29500}" -m trainer.cli \
    --data "$DATA/len-$length" --model llama-8b --grad-checkpointing "${flags[@]}" --tokens-per-step "$length" \
    --max-steps "$STEPS" --log-every 1 --no-progress --out "/tmp/runs/$name" "${lora[@]}" "$@" > "/tmp/runs/$name.log" 2>&1
  local rc=$?
  grep -v "^W1" "/tmp/runs/$name.log" | grep -v "^\s*$" | tail -40
  echo "== $name exit $rc"
}

sample_host() {  # the host's used memory (MiB, `free -m`) every 5 s, with the time -> $OUT/host_mem${1:-}.log
  while sleep 5; do echo "$(date +%s) $(free -m | awk '/Mem:/{print $3}')"; done > "$OUT/host_mem${1:-}.log"
}

case "$part" in
  check)
    torchrun --nproc-per-node 2 scripts/bench/bench_context_parallel.py check --json "$OUT/check.json" 2>&1 | tail -40
    ;;
  short)
    python scripts/bench/bench_context_parallel.py data "$DATA" --lengths 32768 --rows 3
    train one-32768 1 32768
    train cp2-32768 2 32768 --context-parallel 2
    python scripts/bench/bench_context_parallel.py report /tmp/runs/one-32768 /tmp/runs/cp2-32768 --json "$OUT/short.json"
    ;;
  long)
    python scripts/bench/bench_context_parallel.py data "$DATA" --lengths 131072,262144 --rows 3
    train cp2-131072 2 131072 --context-parallel 2
    train cp2-262144-tiled 2 262144 --context-parallel 2 --tile-mlp 8192 --offload-activations
    python scripts/bench/bench_context_parallel.py report /tmp/runs/cp2-131072 /tmp/runs/cp2-262144-tiled \
      --json "$OUT/long.json"
    ;;
  one)
    length="${LENGTH:-262144}" gpu="${GPU:-0}"
    name="one-$length${COMPILE:+-compiled}"
    [ -d "$DATA/len-$length" ] || python scripts/bench/bench_context_parallel.py data "$DATA" --lengths "$length" --rows 2
    sample_host "-$gpu" & sampler=$!
    CUDA_VISIBLE_DEVICES=$gpu PORT=$((29500 + gpu)) STEPS=1 LIMIT="${LIMIT:-1700}" train "$name" 1 "$length" \
      --tile-mlp 8192 --offload-activations
    kill "$sampler"
    python scripts/bench/bench_context_parallel.py report --warmup 0 "/tmp/runs/$name" --json "$OUT/$name.json"
    ;;
  four)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python scripts/bench/bench_context_parallel.py data "$DATA" --lengths 65536 --rows 4
    CUDA_VISIBLE_DEVICES=0 train one-65536 1 65536
    train cp4-65536 4 65536 --context-parallel 4
    python scripts/bench/bench_context_parallel.py report /tmp/runs/one-65536 /tmp/runs/cp4-65536 --json "$OUT/four.json"
    ;;
  full)
    nproc="${NPROC:-4}" length="${LENGTH:-1048576}"
    name="fsdp-cp$nproc-$length"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python scripts/bench/bench_context_parallel.py data "$DATA" --lengths "$length" --rows 1
    sample_host & sampler=$!
    states=()
    [ -n "${OFFLOAD_STATES:-}" ] && states=(--offload-states) && name="$name-states"
    FULL=1 STEPS=1 LIMIT="${LIMIT:-1700}" train "$name" "$nproc" "$length" --parallel fsdp \
      --context-parallel "$nproc" --tile-mlp 8192 --offload-activations "${states[@]}"
    kill "$sampler"
    python scripts/bench/bench_context_parallel.py report --warmup 0 "/tmp/runs/$name" --json "$OUT/full.json"
    ;;
  *)
    echo "usage: OUT=folder bash scripts/bench/gpu_context_parallel.sh check|short|long|one|four|full (got '$part')" >&2
    exit 2
    ;;
esac 2>&1 | tee "$OUT/$part${GPU:+-$GPU}.log"
