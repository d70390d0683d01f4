#!/usr/bin/env bash
# The GPU benchmark suite of issue 6, run from the repository root on a CUDA box.
#
#   OUT=/some/folder bash scripts/bench/gpu_suite.sh [all|attn|train|loss]
#
# Writes at most 7 files into $OUT (default out/gpu_suite):
#   env.log                 nvidia-smi, torch / transformers versions, flash-attn presence
#   attn.log                python tests/gpu/check_gpu_attention.py
#   bench_train.json/.log   scripts/bench/bench_train.py on llama-1b (all paths)
#   bench_loss.json/.log    scripts/bench/bench_loss.py on llama-100m (pad, minibatch, shuffle, ffd)
#   loss_curves.png         the loss plot (copy into docs/ for BENCHMARKS.md)
#
# Data: SHARED (default .devcarry/shared when it exists, else ../shared) must hold
#   datasets/gsm8k/train.jsonl, datasets/codealpaca/code_alpaca.json, tokenizers/llama2/
# (about 11 MB: copy them into .devcarry/shared/ and carry that folder to the box).
# Extra flags: TRAIN_ARGS="--compile --ffd-tokens 16384" LOSS_ARGS="--limit 2000" PYTHON=python3.
# Nothing needs the network, pip, polars, datasets or flash-attn (flash-attn is used if present).
set -o pipefail
set -u
export PYTHONUNBUFFERED=1

part="${1:-all}"
case "$part" in
  all | attn | train | loss) ;;
  *)
    echo "usage: OUT=folder bash scripts/bench/gpu_suite.sh [all|attn|train|loss] (got '$part')" >&2
    exit 2
    ;;
esac

cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-out/gpu_suite}"
mkdir -p "$OUT"
if [[ -z "${SHARED:-}" ]]; then
  if [[ -d .devcarry/shared ]]; then SHARED=.devcarry/shared; else SHARED=../shared; fi
fi
export SHARED
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repo is not pip-installed on the box
PY="${PYTHON:-python}"
WORK="${WORK:-${TMPDIR:-/tmp}/packlm-gpu-suite}"
failed=()

run_part() {  # name, log file, command...
  local name="$1" log="$2"
  shift 2
  echo "=== $name: $* (log: $log)"
  local t0=$SECONDS
  if "$@" 2>&1 | tee "$log"; then
    echo "=== $name: ok in $((SECONDS - t0)) s"
  else
    echo "=== $name: FAILED (exit ${PIPESTATUS[0]}) after $((SECONDS - t0)) s"
    failed+=("$name")
  fi
}

{
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  part: $part  SHARED=$SHARED"
  if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi not available"; fi
  "$PY" - <<'EOF'
import importlib.util, platform, sys
import torch, transformers
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| transformers", transformers.__version__)
print("gpu:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for mod in ("flash_attn", "numba", "pyarrow", "polars", "datasets"):
    print(f"  {mod}: {'present' if importlib.util.find_spec(mod) else 'absent'}")
EOF
} 2>&1 | tee "$OUT/env.log"

if [[ ! -f "$SHARED/datasets/gsm8k/train.jsonl" && "$part" != attn ]]; then
  echo "SHARED=$SHARED lacks datasets/gsm8k/train.jsonl: copy the shared files (see the header)" >&2
  exit 2
fi

if [[ "$part" == all || "$part" == attn ]]; then
  if [[ -f tests/gpu/check_gpu_attention.py ]]; then
    run_part attn "$OUT/attn.log" "$PY" tests/gpu/check_gpu_attention.py
  else
    echo "tests/gpu/check_gpu_attention.py is missing: attention check skipped" | tee "$OUT/attn.log"
  fi
fi

if [[ "$part" == all || "$part" == train ]]; then
  # shellcheck disable=SC2086  # TRAIN_ARGS is a list of flags
  run_part train "$OUT/bench_train.log" "$PY" scripts/bench/bench_train.py --device cuda --model llama-1b \
    --shared "$SHARED" --workdir "$WORK/train" --json "$OUT/bench_train.json" ${TRAIN_ARGS:-}
fi

if [[ "$part" == all || "$part" == loss ]]; then
  # shellcheck disable=SC2086
  run_part loss "$OUT/bench_loss.log" "$PY" scripts/bench/bench_loss.py --device cuda --model llama-100m \
    --shared "$SHARED" --workdir "$WORK/loss" --json "$OUT/bench_loss.json" \
    --plot "$OUT/loss_curves.png" ${LOSS_ARGS:-}
fi

if ((${#failed[@]})); then
  echo "gpu_suite: FAILED parts: ${failed[*]}"
  exit 1
fi
echo "gpu_suite: all requested parts passed; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
