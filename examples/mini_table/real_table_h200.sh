#!/usr/bin/env bash
# The real-model table (issue 22 item 4) on one H200 through the device tool: one call = one run of this script, from
# the repository root on the GPU machine. README.md ("On the H200") has the calls in order.
#
#   bash examples/mini_table/real_table_h200.sh stage                  # setup only (e.g. a call bringing a GGUF half)
#   bash examples/mini_table/real_table_h200.sh test PYTEST_ARGS       # setup, then pytest (e.g. -m gpu tests/...)
#   bash examples/mini_table/real_table_h200.sh run JOBS SEEDS [FLAGS]  # the table's runs until the call's end
#
# Setup, every call (cheap once done): the wheels of .whl/ into /tmp/site (megatron-core, gguf first on the path;
# sentencepiece, pyyaml, safetensors, tqdm after the image's own packages); the GGUF halves a call carried
# (.smol/gguf.part00, .smol/gguf.part01) copied to /tmp/smol, outside the checkout, where they outlive the next
# call's sync, and joined there once both have come; the CUDA MPS daemon. `run` starts run_mini_table.py --preset
# smollm2 with --time-budget set so that the call ends within CALL_S seconds (default 575 of the 600 allowed), one
# shard of the runs per GPU (JOBS runs at once on each),
# prints each run's last step every 45 s, then the status table, and leaves runs/real_table (small files) in
# $OUT/real_table.tgz. FLAGS go to run_mini_table.py (e.g. "--only bf16_bf16 -- --lr 1e-5"); TABLE_OUT=DIR puts the
# runs in DIR instead of runs/real_table (a trial schedule apart from the table). MACHINE_LEFT=S (the device tool's
# budget_left_s before the call): new runs that would not finish before the machine goes back are not started.
# MAX_TOKENS=N: packed tokens per training micro-batch (run_mini_table.py --max-tokens-per-gpu; default 5120, 0 =
# session 33's padded micro-batches of 8 sequences).
set -u
T0=$(date +%s)
MODE=${1:-run}
SITE=${SITE_DIR:-/tmp/site}  # SITE_DIR, SMOL_DIR: other places (tests/test_real_table.py runs this on a CPU)
SMOL=${SMOL_DIR:-/tmp/smol}
if [ ! -f $SITE/.ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE \
    .whl/megatron_core*.whl .whl/gguf*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ${SITE}2 \
    .whl/sentencepiece*.whl .whl/pyyaml*.whl .whl/safetensors*.whl .whl/tqdm*.whl || exit 1
  touch $SITE/.ok
fi
export PYTHONPATH=$SITE:$PWD:${SITE}2
GGUF=$SMOL/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p $SMOL runs /tmp/mps /tmp/mpslog
cp .smol/gguf.part0? $SMOL/ 2>/dev/null
if [ ! -f $GGUF ] && [ -f $SMOL/gguf.part00 ] && [ -f $SMOL/gguf.part01 ]; then
  cat $SMOL/gguf.part00 $SMOL/gguf.part01 > $GGUF.tmp && mv $GGUF.tmp $GGUF && rm $SMOL/gguf.part0?
fi
ls -l $SMOL
export SMOLLM2_GGUF_DIR=$SMOL CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
pgrep -f nvidia-cuda-mps-control >/dev/null || nvidia-cuda-mps-control -d
[ "$MODE" = stage ] && exit 0
if [ "$MODE" = test ]; then  # the GPU tests with the same wheels and GGUF (SMOLLM2_GGUF_DIR) as the runs
  shift
  python3 -m pytest -q -p no:cacheprovider "$@"
  exit $?
fi
[ "$MODE" = run ] || { echo "mode: stage, test or run, not '$MODE'"; exit 2; }
[ -f $GGUF ] || { echo "no $GGUF yet: bring .smol/gguf.part00 and .smol/gguf.part01 first (two calls)"; exit 2; }
JOBS=${2:?JOBS}; SEEDS=${3:?SEEDS}; shift 3
TABLE=${TABLE_OUT:-runs/real_table}
mkdir -p "$TABLE"  # its console logs (shard0.log, ...) live in it: carrying the folder carries them
BUDGET=$(( ${CALL_S:-575} - 25 - ($(date +%s) - T0) ))
NGPU=$(nvidia-smi -L | wc -l)
echo "time budget ${BUDGET}s, $NGPU GPU(s), --jobs $JOBS per GPU, --seeds $SEEDS $*"
pids=()
for g in $(seq 0 $((NGPU - 1))); do  # one shard of the planned runs per GPU
  CUDA_VISIBLE_DEVICES=$g python3 examples/mini_table/run_mini_table.py --preset smollm2 --out "$TABLE" \
    --seeds "$SEEDS" --shard $g/$NGPU --jobs "$JOBS" --time-budget $BUDGET \
    ${MACHINE_LEFT:+--machine-left $(( MACHINE_LEFT - ($(date +%s) - T0) ))} \
    ${MAX_TOKENS:+--max-tokens-per-gpu $MAX_TOKENS} "$@" >> "$TABLE/shard$g.log" 2>&1 &
  pids+=($!)
done
running() { for p in "${pids[@]}"; do kill -0 $p 2>/dev/null && return 0; done; return 1; }
while running; do
  for _ in $(seq 9); do sleep 5; running || break; done
  echo "== $(( $(date +%s) - T0 ))s, GPU memory, use: $(nvidia-smi --query-gpu=memory.used,utilization.gpu \
    --format=csv,noheader | paste -sd' ')"
  TABLE=$TABLE python3 - <<'PY'
import glob, json, os
table = os.environ["TABLE"]
for f in sorted(glob.glob(f"{table}/seed*/*/*/train.jsonl")):
    rows = [json.loads(line) for line in open(f) if '"kind": "train"' in line]
    if rows:
        r = rows[-1]
        print(f"  {f[len(table) + 1:-12]:32s} step {r['step']:3d}", {k: round(r[k], 3) for k in
              ("step_s", "rollout_s", "train_s", "train/ref_logprobs_s", "train/forward_backward_s", "reward_mean",
               "response_length_mean", "logp_abs_diff_mean", "mem/peak_allocated_gib")
              if isinstance(r.get(k), (int, float))})
PY
done
for g in "${!pids[@]}"; do
  wait ${pids[$g]}
  echo "run_mini_table.py --shard $g/$NGPU exit $?"
  tail -n 12 "$TABLE/shard$g.log"
done
python3 examples/mini_table/run_mini_table.py --preset smollm2 --out "$TABLE" --seeds "$SEEDS" --list \
  ${MAX_TOKENS:+--max-tokens-per-gpu $MAX_TOKENS} "$@" \
  2>/dev/null | grep -v " todo"
tar czf "$OUT/real_table.tgz" "$TABLE"
