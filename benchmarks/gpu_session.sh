#!/usr/bin/env bash
# One GPU run that measures everything the GPU issue asks for, to run first in a session lent a GPU
# (docs/benchmarks.md §11). Needs, copied into ignored folders of the checkout and carried:
#   .gpu/  the shared gpu-probe (certcmp.py, callback_gpu.py)
#   .whl/  wheels the GPU image lacks (cryptography, cffi, pycparser, jsonschema + its three deps,
#          the transformers the tests use) for CPython 3.12 manylinux x86-64
# Stage limits (seconds) S1 S3 S3C S4 keep the whole run under 600 s; figures and logs go to $OUT.
# A dry run on the CPU exercises every stage's plumbing before device time is spent on it:
#   DEV=cpu SHAPE=tiny METER=sample bash benchmarks/gpu_session.sh
set -u
export PYTHONUNBUFFERED=1 PROJ=$PWD
DEV=${DEV:-cuda} SHAPE=${SHAPE:-gpu}
if [[ $DEV == cuda ]] && ls .whl/*.whl >/dev/null 2>&1; then  # the GPU image's Python (3.12) lacks them
  for whl in .whl/*.whl; do  # one at a time: a wheel this Python cannot take costs only what needs it
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$whl" \
      || echo "could not install $whl on $(python3 -V); the stages that need it will say so"
  done
fi
export PYTHONPATH=/tmp/site:$PROJ
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
G=$PROJ/.gpu W=${WORK:-/tmp/w}; mkdir -p $W
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  lscpu | grep -E "Model name|^CPU\(s\)"; } | tee "$OUT/env.txt"
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

t "stage 1: every CUDA test"
MODS=$(grep -l "cuda" tests/test_*.py | tr '\n' ' ')
# workers and per-test limits where the image has the plugins (the H200 image had both)
PAR=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8"); TMO=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 120")
timeout "${S1:-150}" python3 -m pytest -q --tb=short -p no:cacheprovider -p no:benchmark -rfE $PAR $TMO \
  $MODS -k "cuda and not dispatches and not without_a_gpu" > "$OUT/stage1.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/stage1.log" | tail -12

t "stage 2: certify healthy/deepseek on $DEV vs cpu"
for run in healthy deepseek; do
  for arm in dev cpu; do
    extra=(); [[ $arm == dev ]] && extra=(--device "$DEV")
    timeout 60 python3 -m moeaudit certify "$PROJ/sample_checkpoints/$run" --out "$W/$run-$arm" --no-cache "${extra[@]}" 2>&1 | tail -1
  done
  if [[ -f $G/certcmp.py ]]; then
    python3 "$G/certcmp.py" "$W/$run-dev" "$W/$run-cpu" > "$OUT/certcmp-$run.log" 2>&1; head -8 "$OUT/certcmp-$run.log"
  else echo "no $G/certcmp.py (copy the shared gpu-probe into .gpu/)"; fi
done

t "stage 3: replay speed (fp32, bf16, the weight path's A/B, transformers)"
timeout "${S3:-220}" python3 benchmarks/gpu.py --device "$DEV" --shape "$SHAPE" --precision bf16 --rounds "${ROUNDS:-2}" --work $W/gb --timeout 100 \
  --only cli,cli_low,floor,floor_low,floor_cap,hf_fp32,hf_bf16 --out "$OUT/gpu_bench.json" 2>&1 | grep -v -i warn | tee "$OUT/bench.log"

t "stage 3b: profile of the replay"
timeout 60 python3 benchmarks/profile_replay.py "$W/gb/$SHAPE/ckpt" "$W/gb/$SHAPE/canary.safetensors" "$OUT" --device "$DEV" 2>&1 | grep -v -i warn

t "stage 3c: what counting the FLOPs costs on the GPU (FlopCounterMode, once per shape)"
timeout "${S3C:-50}" python3 benchmarks/flop_meter.py "${METER:-mid}" --device "$DEV" 2>&1 | grep -v -i warn | tee "$OUT/flop_meter.log"

t "stage 4: the Trainer callback's overhead"
if [[ $DEV == cuda ]]; then  # a 795 M model in bf16 mixed precision: a GPU's stage only
  timeout "${S4:-80}" python3 "$G/callback_gpu.py" "${STEPS:-30}" 2 2>&1 | tee "$OUT/callback.log" | grep -v Warning | tail -6
else
  echo "skipped on $DEV" | tee "$OUT/callback.log"
fi
t "done"
