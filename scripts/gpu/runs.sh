#!/usr/bin/env bash
# The GPU checks, one device call each (each stays under the tool's 10-minute limit):
#   bash scripts/gpu/runs.sh tests      # the CUDA-only tests
#   bash scripts/gpu/runs.sh coldstart  # bench.coldstart, 3 warm starts, primed
#   bash scripts/gpu/runs.sh prefix     # bench.prefix_cache, one-server (b) with its A/A control
#   bash scripts/gpu/runs.sh prefix-b   # bench.prefix_cache's (b) alone, 30 rounds each way (~400 s);
#                                       # pool several with python -m bench.prefix_cache_pool (here)
#   bash scripts/gpu/runs.sh prefix-load # (b) under load: 45 rounds (+15 A/A), 4 one at a time (~420 s)
#   bash scripts/gpu/runs.sh prefix-capacity # (b) at capacity: 16 clients for the 8 slots, 36 rounds (+12 A/A)
#   bash scripts/gpu/runs.sh store      # bench.store_cost: a prefix-cache store's host time, in-process (~20 s)
#   bash scripts/gpu/runs.sh warmup     # bench.warmup (cold / v1 / planned)
#   bash scripts/gpu/runs.sh replica    # bench.replica_prefill: (c), a new replica with / without L3 prefill
# Results land in $OUT (the device tool's output folder); copy them to bench/results/.
set -uo pipefail
. scripts/gpu/env.sh
t0=$(date +%s)
case "${1:-}" in
  tests) python3 -m pytest -q -p no:cacheprovider tests/test_engine_cuda.py tests/test_cuda_*.py 2>&1 | tail -3 ;;
  coldstart) python3 -m bench.coldstart $GPU_ARGS --lengths 12,48,200,900,1800,3500 --starts 3 --idle-s 1 2>&1 |
    grep -v "Loading weights" | grep "|\|^- \|READY in\|target" ;;
  prefix) python3 -m bench.prefix_cache $GPU_ARGS --lengths 512,2048,3500 --throughput-rounds 20 \
    --throughput-concurrent-requests 96 \
    --control-rounds 10 2>&1 | grep -v "Loading weights" | grep "|\|^- \|target\|median" ;;
  prefix-b) python3 -m bench.prefix_cache $GPU_ARGS --throughput-only --throughput-rounds 30 \
    --control-rounds 15 --throughput-concurrent-requests 96 2>&1 | grep -v "Loading weights" |
    grep "|\|^- \|median" ;;
  prefix-load) python3 -m bench.prefix_cache $GPU_ARGS --throughput-only --throughput-rounds 4 \
    --control-rounds 2 --load-rounds 45 --load-control-rounds 15 --throughput-concurrent-requests 96 2>&1 |
    grep -v "Loading weights" | grep "|\|^- \|median" ;;
  prefix-capacity) python3 -m bench.prefix_cache $GPU_ARGS --throughput-only --throughput-rounds 2 \
    --control-rounds 1 --load-rounds 36 --load-control-rounds 12 --throughput-concurrency 16 \
    --throughput-concurrent-requests 96 2>&1 | grep -v "Loading weights" | grep "|\|^- \|median" ;;
  store) python3 -m bench.store_cost $GPU_ARGS 2>&1 | grep -v "Loading weights" | grep "|" ;;
  warmup) python3 -m bench.warmup $GPU_ARGS --median-tokens 300 --sigma 1.2 2>&1 |
    grep -v "Loading weights" | grep "|\|^- \|prompt lengths" ;;
  replica) python3 -m bench.replica_prefill $GPU_ARGS 2>&1 | grep -v "Loading weights" | grep "|\|^- \|target" ;;
  *) echo "usage: bash scripts/gpu/runs.sh tests|coldstart|prefix|prefix-b|prefix-load|prefix-capacity|store|warmup|replica" >&2; exit 2 ;;
esac
echo "[gpu] $1: $(( $(date +%s) - t0 )) s"
