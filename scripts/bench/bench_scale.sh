#!/usr/bin/env bash
# shellcheck disable=SC2012,SC2094  # ls of our own plain file names; the log is only appended to
# Multi-GPU scaling of pack-train: 1 GPU vs N GPUs DDP vs N GPUs FSDP2, same data and flags.
#
#   OUT=/some/folder bash scripts/bench/bench_scale.sh          # on a box with N CUDA GPUs
#   MODEL=tiny DEVICE=cpu NPROC=2 STEPS=4 LIMIT=200 OUT=out/scale bash scripts/bench/bench_scale.sh  # CPU smoke
#
# 1. packs GSM8K + CodeAlpaca once (Llama-2 tokenizer, --strategy ffd --max-len 8192) through
#    scripts/benchlib/'s prepare_data (one instruction/input/output JSONL, as bench_train.py packs);
# 2. runs `pack-train --model $MODEL --compile --dtype bf16 --tokens-per-step 8192 --grad-accum 1
#    --max-steps $STEPS --log-every 1 --no-progress` as: single (1 process, no torchrun),
#    ddp (torchrun N procs, --parallel ddp), fsdp (torchrun N procs, --parallel fsdp),
#    variants named ddp-bf16 / fsdp-bf16 (--grad-reduce bf16), fsdp-keep / fsdp-bf16-keep
#    (--no-reshard-after-forward), ddp-b100 (--ddp-bucket-mb 100: any number), and concurrent: N independent 1-GPU
#    runs at once, one per GPU (no communication at all: what sharing the host costs by itself);
#    each in its own folder under $WORK/runs; pack-train always writes a final checkpoint (it cannot
#    be switched off): it goes to $WORK, is not in the timed steps, and is deleted after each run;
# 3. scripts/bench/scale_table.py turns the runs' metrics.jsonl into the table (steps > WARMUP only).
#
# Writes 3 files into $OUT (default out/bench_scale): scale.md, scale.json, scale.log (everything).
# Knobs (env): NPROC (default: all visible GPUs), STEPS=30, WARMUP=8, MODEL=llama-1b, DEVICE=cuda,
#   DTYPE (bf16 on cuda, fp32 on cpu), COMPILE (1 on cuda, 0 on cpu), TOKENS=8192, MAX_LEN=8192,
#   LIMIT (examples per dataset, default all), CONFIGS="single ddp fsdp" (also: ddp-bf16 ddp-b100
#   fsdp-bf16 fsdp-keep fsdp-bf16-keep concurrent), RUN_TIMEOUT=240 (s per run),
#   NUM_PROC (pack-data processes: 8 on cuda, 1 on cpu), TRAIN_ARGS (extra pack-train flags),
#   SHARED, WORK (default /tmp/packlm-scale), PYTHON=python3.
set -o pipefail
set -u
export PYTHONUNBUFFERED=1
# Mandatory on the H200 boxes: no NVLink multicast / NVLS.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-out/bench_scale}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
if [[ -z "${SHARED:-}" ]]; then
  if [[ -d .devcarry/shared ]]; then SHARED=.devcarry/shared; else SHARED=../shared; fi
fi
export SHARED
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repo is not pip-installed on the box
PY="${PYTHON:-python3}"
MODEL="${MODEL:-llama-1b}"
DEVICE="${DEVICE:-cuda}"
if [[ "$DEVICE" == cpu ]]; then DTYPE="${DTYPE:-fp32}" COMPILE="${COMPILE:-0}"; else DTYPE="${DTYPE:-bf16}" COMPILE="${COMPILE:-1}"; fi
STEPS="${STEPS:-30}"
WARMUP="${WARMUP:-8}"
if ((WARMUP >= STEPS)); then WARMUP=$((STEPS / 2)); fi
TOKENS="${TOKENS:-8192}"
MAX_LEN="${MAX_LEN:-8192}"
LIMIT="${LIMIT:-}"
CONFIGS="${CONFIGS:-single ddp fsdp}"
RUN_TIMEOUT="${RUN_TIMEOUT:-240}"
NUM_PROC="${NUM_PROC:-$([[ "$DEVICE" == cpu ]] && echo 1 || echo 8)}"  # pack-data tokenizer processes
WORK="${WORK:-${TMPDIR:-/tmp}/packlm-scale}"
LOG="$OUT/scale.log"
: >"$LOG"

log() { echo "$*" | tee -a "$LOG"; }

if [[ -z "${NPROC:-}" ]]; then
  NPROC="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
fi
if ((NPROC < 2)); then
  log "bench_scale: NPROC=$NPROC: need at least 2 devices (set NPROC=2 DEVICE=cpu for a CPU smoke run)"
  exit 2
fi
if [[ ! -f "$SHARED/datasets/gsm8k/train.jsonl" ]]; then
  log "bench_scale: SHARED=$SHARED lacks datasets/gsm8k/train.jsonl (see scripts/bench/gpu_suite.sh's header)"
  exit 2
fi

{
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  NPROC=$NPROC MODEL=$MODEL DEVICE=$DEVICE DTYPE=$DTYPE"
  echo "NUM_PROC=$NUM_PROC COMPILE=$COMPILE STEPS=$STEPS WARMUP=$WARMUP TOKENS=$TOKENS MAX_LEN=$MAX_LEN LIMIT=${LIMIT:-all} SHARED=$SHARED WORK=$WORK"
  echo "env: NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS"
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; fi
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "| cuda", torch.version.cuda, "| transformers", transformers.__version__)'
} 2>&1 | tee -a "$LOG"

# ---- 1. data: packed once, reused across runs (and across invocations when the stamp matches)
t0=$SECONDS
log "=== pack-data --strategy ffd --max-len $MAX_LEN (GSM8K + CodeAlpaca, Llama-2 tokenizer)"
DATA="$("$PY" - "$WORK/data" "$SHARED" "$MAX_LEN" "$LIMIT" "$NUM_PROC" 2>>"$LOG" <<'EOF' | tee -a "$LOG" | tail -n 1
import sys
from pathlib import Path
sys.path.insert(0, ".")
from scripts.benchlib import prepare_data
work, shared, max_len, limit, num_proc = sys.argv[1:6]
folders = prepare_data(Path(work), Path(shared), limit=int(limit) if limit else None, seed=0,
                       max_len=int(max_len), strategies=("ffd",), num_proc=int(num_proc))
print(folders["ffd"])
EOF
)"
if [[ ! -f "$DATA/manifest.json" ]]; then
  log "bench_scale: packing failed (see $LOG)"
  exit 1
fi
log "=== data ready in $((SECONDS - t0)) s: $DATA"

# ---- 2. training runs
common=(--data "$DATA" --model "$MODEL" --dtype "$DTYPE" --device "$DEVICE"
  --tokens-per-step "$TOKENS" --grad-accum 1 --max-steps "$STEPS" --log-every 1 --no-progress)
if [[ "$COMPILE" == 1 ]]; then common+=(--compile); fi
# shellcheck disable=SC2206  # TRAIN_ARGS is a list of flags
common+=(${TRAIN_ARGS:-})
# pack-train's click command (trainer/cli.py has no __main__; the console script is not installed)
entry='from trainer.cli import pack_train; pack_train(prog_name="pack-train")'
launch=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" --no-python "$PY" -c "$entry")
run_dirs=()
failed=()
run_one() {  # run_one NAME CMD...: one timed run into $WORK/runs/NAME (its exit code saved there)
  local name=$1 run="$WORK/runs/$1" rc t0=$SECONDS
  shift
  log "=== $name: $*"
  timeout -k 20 "$RUN_TIMEOUT" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  mkdir -p "$run"
  echo "$rc" >"$run/exit_code"
  log "=== $name: exit $rc in $((SECONDS - t0)) s (includes startup, compile and the final checkpoint)"
  ((rc == 0)) || failed+=("$name")
  rm -rf "$run/checkpoints"  # a llama-1b checkpoint with AdamW state is ~13 GB
  run_dirs+=("$run")
}
for cfg in $CONFIGS; do
  rm -rf "$WORK/runs/$cfg"*
  mkdir -p "$WORK/runs"
  case "$cfg" in
    single) run_one "$cfg" "$PY" -c "$entry" "${common[@]}" --out "$WORK/runs/$cfg" ;;
    ddp | fsdp) run_one "$cfg" "${launch[@]}" "${common[@]}" --parallel "$cfg" --out "$WORK/runs/$cfg" ;;
    ddp-* | fsdp-*)  # variants: -bf16 adds --grad-reduce bf16, -keep --no-reshard-after-forward,
      extra=()       # -bN --ddp-bucket-mb N
      [[ "$cfg" == *-bf16* ]] && extra+=(--grad-reduce bf16)
      [[ "$cfg" == *-keep* ]] && extra+=(--no-reshard-after-forward)
      [[ "$cfg" =~ -b([0-9]+) ]] && extra+=(--ddp-bucket-mb "${BASH_REMATCH[1]}")
      run_one "$cfg" "${launch[@]}" "${common[@]}" --parallel "${cfg%%-*}" ${extra[@]+"${extra[@]}"} \
        --out "$WORK/runs/$cfg" ;;
    concurrent)  # N plain processes at once, GPU i each; every one is a row of its own
      pids=()
      for ((i = 0; i < NPROC; i++)); do
        CUDA_VISIBLE_DEVICES=$i run_one "concurrent-gpu$i" "$PY" -c "$entry" "${common[@]}" \
          --out "$WORK/runs/concurrent-gpu$i" >/dev/null &
        pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid"; done
      for ((i = 0; i < NPROC; i++)); do  # run_one ran in subshells: collect here
        run="$WORK/runs/concurrent-gpu$i"
        run_dirs+=("$run")
        [[ "$(cat "$run/exit_code" 2>/dev/null)" == 0 ]] || failed+=("concurrent-gpu$i")
      done ;;
    *) log "bench_scale: unknown config '$cfg' in CONFIGS (single, ddp[-bf16][-bN], fsdp[-bf16][-keep], concurrent)"; exit 2 ;;
  esac
done

# ---- 3. the table
log "=== scale table (steps > $WARMUP measured)"
"$PY" scripts/bench/scale_table.py "${run_dirs[@]}" --warmup "$WARMUP" --md "$OUT/scale.md" \
  --json "$OUT/scale.json" 2>&1 | tee -a "$LOG"
table_rc=${PIPESTATUS[0]}
if ((${#failed[@]})) || ((table_rc != 0)); then
  log "bench_scale: FAILED runs: ${failed[*]:-none} (table exit $table_rc); files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
  exit 1
fi
log "bench_scale: ok; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
