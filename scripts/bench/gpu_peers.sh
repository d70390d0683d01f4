#!/usr/bin/env bash
# The peers of issue 57's measurements on a CUDA box, from the repository root:
#
#   OUT=folder bash scripts/bench/gpu_peers.sh trl|trl1b|trl8b|longest|ring
#
# trl:   scripts/bench/bench_trl.py on one GPU, rows of 16,384 tokens (GSM8K + CodeAlpaca, pack-data):
#        TRL's SFTTrainer (Liger, FlashAttention-2, with and without recompute) against pack-train,
#        the 1B shape full fine-tune (trl1b) then the 8B shape with LoRA r16 (trl8b)
#        -> $OUT/trl-llama-1b.json, $OUT/trl-llama-8b.json (PATHS: other paths, e.g. with TRL's
#        +compile; TAG: a suffix for those files' names)
# longest: the longest example TRL's SFTTrainer and pack-train each train on one GPU, 8B shape, LoRA
#        r16: scripts/bench/bench_trl.py --lengths (LENGTHS, default 32,768 to 262,144), TRL with Liger and
#        recompute, with and without its activation offloading, against pack-train with recompute,
#        --tile-mlp 8192 --offload-activations (a host with room for the offload: one GPU of a
#        two- or four-GPU box) -> $OUT/trl-longest-llama-8b$TAG.json; GPU_MEMORY_GIB caps each path's
#        GPU memory (78 on an H200 stands in for an H100 80GB), STEPS/WARMUP (default 2/1)
# ring:  NPROC GPUs (default 2): rows of one 32,768- and one 131,072-token example
#        (bench_context_parallel.py data; LENGTHS to change), ring-flash-attn's HF adapter
#        (bench_context_parallel.py peer) and pack-train --context-parallel NPROC on the same
#        folders: the 8B shape, LoRA r16, every layer recomputed, no compile; WARMUP steps then
#        STEPS timed -> $OUT/peer-L.json, $OUT/ring-packlm.json
# Each first installs the carried wheels (.devcarry/peers: trl, datasets, dill, multiprocess,
# liger-kernel, ring-flash-attn; .devcarry/flash_attn-*.whl) into /tmp/site. Logs: $OUT/MODE.log,
# every command's stderr in full.
set -o pipefail
set -u
export PYTHONUNBUFFERED=1
OUT="${OUT:-out/gpu_peers}"
mode="${1:?usage: OUT=folder bash scripts/bench/gpu_peers.sh trl|trl1b|trl8b|longest|ring}"
mkdir -p "$OUT"

install() {  # once a box: a second run beside the first would rewrite files the first imports
  [ -f /tmp/site/.installed ] || python3 -m pip install -q --no-deps --no-compile --target /tmp/site \
    .devcarry/peers/*.whl .devcarry/flash_attn-*.whl && touch /tmp/site/.installed \
    || { echo "installing the carried wheels failed"; return 1; }
  export PYTHONPATH="/tmp/site:$PWD"
  python3 - <<'PY' || { echo "a carried package does not import (above)"; return 1; }
import importlib, importlib.metadata as md
for name in ("transformers", "torch", "peft", "accelerate", "pyarrow", "fsspec", "huggingface_hub"):
    print(f"{name} {md.version(name)}")
for name in ("trl", "datasets", "liger_kernel", "flash_attn"):
    module = importlib.import_module(name)
    print(f"{name} {getattr(module, '__version__', md.version(name.replace('_', '-')))} from {module.__file__}")
import sys; sys.path.insert(0, ".")
from scripts.benchlib import ring_attention
print("ring_flash_attn adapter", ring_attention.import_adapter().__file__)
PY
}

trl() {  # MODEL LORA_R
  python3 scripts/bench/bench_trl.py --model "$1" --lora-r "$2" --max-len "${MAX_LEN:-16384}" --steps "${STEPS:-8}" \
    --warmup "${WARMUP:-3}" --limit "${LIMIT:-3000}" --path-timeout "${PATH_TIMEOUT:-240}" \
    --paths "${PATHS:-trl+liger+ckpt,trl+liger,trl+ckpt,packlm+ckpt,packlm}" --json "$OUT/trl-$1${TAG:-}.json"
  echo "== bench_trl $1 exit $?"
}

longest() {
  python3 scripts/bench/bench_trl.py --model llama-8b --lora-r 16 --lengths "${LENGTHS:-32768,65536,131072,196608,262144}" \
    --steps "${STEPS:-2}" --warmup "${WARMUP:-1}" --path-timeout "${PATH_TIMEOUT:-900}" --no-compile \
    ${GPU_MEMORY_GIB:+--gpu-memory-gib "$GPU_MEMORY_GIB"} --workdir "/tmp/bench_trl${TAG:-}" \
    --paths "${PATHS:-trl+liger+ckpt,trl+liger+ckpt+offload,packlm+ckpt+long}" --json "$OUT/trl-longest-llama-8b${TAG:-}.json"
  echo "== bench_trl --lengths exit $?"
}

ring() {
  local nproc="${NPROC:-2}" steps="${STEPS:-3}" warmup="${WARMUP:-2}" lengths="${LENGTHS:-32768,131072}"
  local data=/tmp/long-rows runs=()
  python3 scripts/bench/bench_context_parallel.py data "$data" --lengths "$lengths" --rows 3 || return 1
  for l in ${lengths//,/ }; do
    timeout 540 torchrun --nproc-per-node "$nproc" scripts/bench/bench_context_parallel.py peer --data "$data/len-$l" \
      --model llama-8b --lora-r 16 --steps "$steps" --warmup "$warmup" --json "$OUT/peer-$l.json"
    echo "== peer $l on $nproc GPUs exit $?"
    rm -rf "/tmp/runs/cp$nproc-$l"
    timeout 540 torchrun --nproc-per-node "$nproc" -m trainer.cli --data "$data/len-$l" --model llama-8b \
      --lora-r 16 --grad-checkpointing --no-compile --context-parallel "$nproc" --tokens-per-step "$l" \
      --max-steps $((steps + warmup)) --lr 1e-4 --log-every 1 --no-progress --out "/tmp/runs/cp$nproc-$l"
    echo "== pack-train --context-parallel $nproc $l exit $?"
    runs+=("/tmp/runs/cp$nproc-$l")
  done
  python3 scripts/bench/bench_context_parallel.py report "${runs[@]}" --warmup "$warmup" --json "$OUT/ring-packlm.json"
}

case "$mode" in
  trl) install && trl llama-1b 0 && trl llama-8b 16 ;;
  trl1b) install && trl llama-1b 0 ;;
  trl8b) install && trl llama-8b 16 ;;
  longest) install && longest ;;
  ring) install && ring ;;
  *)
    echo "usage: OUT=folder bash scripts/bench/gpu_peers.sh trl|trl1b|trl8b|longest|ring (got '$mode')" >&2
    exit 2
    ;;
esac 2>&1 | tee "$OUT/$mode${TAG:-}.log"
