#!/usr/bin/env bash
# Fits the semantic cache's pair classifier on the GPU machine (device tool, carry [".gpupair"]): minutes
# there against ~15-25 on 2 CPU cores. The fp32 base (90 MB) cannot travel, so a half-precision copy does;
# the file is stamped with the fp32 base's SHA-256, which is what serving loads the delta onto.
#   here, once:  python -m cache.pair_training --write-half-copy .gpupair/minilm-fp16   # prints the SHA-256
#   there:       bash scripts/gpu/pair_fit.sh SHA256 NAME "TRAINING ARGS" [NAME "TRAINING ARGS" ...]
# Each fit runs beside the others on the one GPU and writes $OUT/NAME.safetensors and $OUT/NAME.log.
# PAIR_FIT_DEVICE (cuda), PAIR_FIT_MODEL_DIR (.gpupair/minilm-fp16) and PYTHON (python3: the image's,
# which holds torch) change where, from what and with which interpreter.
set -uo pipefail
export PYTHONUNBUFFERED=1
sha=${1:-}; shift || true
if [ -z "$sha" ] || [ $# -eq 0 ] || [ $(( $# % 2 )) -ne 0 ]; then
  echo "usage: bash scripts/gpu/pair_fit.sh SHA256 NAME \"TRAINING ARGS\" [NAME \"TRAINING ARGS\" ...]" >&2
  exit 2
fi
pids=()
while [ $# -ge 2 ]; do
  name=$1 args=$2; shift 2
  # shellcheck disable=SC2086  # the training args are words
  "${PYTHON:-python3}" -m cache.pair_training $args --device "${PAIR_FIT_DEVICE:-cuda}" \
    --model-dir "${PAIR_FIT_MODEL_DIR:-.gpupair/minilm-fp16}" --base-sha256 "$sha" \
    --out "$OUT/$name.safetensors" > "$OUT/$name.log" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
tail -n 2 "$OUT"/*.log
exit $rc
