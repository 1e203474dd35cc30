#!/usr/bin/env bash
# Run the GPU mini table for several seeds across the GPUs of one machine (measured on 4 x H200: three seeds,
# 57 runs, in 234-261 s). Per seed: its shard 0 makes the shared warm start on one GPU; once that exists, the
# seed's other shards start on the other GPUs. Runs share each GPU through CUDA MPS (without MPS, processes
# time-slice the GPU and each run is several times slower).
#
#   examples/mini_table/run_seeds_multi_gpu.sh [SEEDS] [NGPU] [OUT]     # defaults: "1 2 3", 4, runs/mini_table
#
# Finished runs (results.json present) are skipped, so re-running the same command continues a table.
# JOBS (default 5): runs at once per shard; MINI_TABLE_FLAGS: extra run_mini_table.py flags (e.g. "--tiny");
# PYTHON (default python): the interpreter.
set -euo pipefail
SEEDS=${1:-"1 2 3"}
NGPU=${2:-4}
OUT=${3:-runs/mini_table}
cd "$(dirname "$0")/../.."
LOGS=$OUT/logs
mkdir -p "$LOGS"
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/mps} CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/mpslog}
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d 2>/dev/null || true  # already running is fine
M="${PYTHON:-python} examples/mini_table/run_mini_table.py --out $OUT --jobs ${JOBS:-5} ${MINI_TABLE_FLAGS:-}"

one_seed() {  # $1 seed, $2 GPU for its warm start
  local s=$1 g=$2 warm_pid i
  CUDA_VISIBLE_DEVICES=$g $M --seeds "$s" --shard "0/$NGPU" > "$LOGS/seed$s.shard0.log" 2>&1 &
  warm_pid=$!
  while [ ! -f "$OUT/seed$s/warm/results.json" ] && kill -0 $warm_pid 2>/dev/null; do sleep 2; done
  for ((i = 1; i < NGPU; i++)); do
    CUDA_VISIBLE_DEVICES=$(((g + i) % NGPU)) $M --seeds "$s" --shard "$i/$NGPU" > "$LOGS/seed$s.shard$i.log" 2>&1 &
  done
  wait
}

n=0
for s in $SEEDS; do
  one_seed "$s" $((n % NGPU)) &
  n=$((n + 1))
done
wait
$M --seeds "$(echo $SEEDS | tr ' ' ,)" --list
