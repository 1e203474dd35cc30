#!/usr/bin/env bash
# The H200 checks of the GPU paths, one device call (at most 10 minutes) per part, from the repository root of the
# GPU machine's copy:
#
#   bash benchmarks/h200_checks.sh PART
#
#   train-tests   GPU tests of the training quantizers (CUDA and Triton), the kernel backend, graphed training
#   train-bench   bench_train.py --cuda-graph (BF16, MXFP4 fp8 / fp8_fast, HiF4 at 4 x 2048) and the eager rows
#   decode-tests  GPU tests of the CUDA decode GEMMs (every tile of tests/test_cuda_decode.py), the fused decode-step
#                 kernels and the engine's static / graph decode path; then bench_decode_ops.py (those kernels timed
#                 against what they replace)
#   decode-bench  bench_kernels.py --decode --decode-sweep on the 7B and 1.5B MLP shapes
#   issue20-rows  issue 20's rows in one call (about 4 minutes on an H100; what to run first when an H200 comes): the
#                 natural decode GEMM's GPU tests (default tiles), its table on the 7B MLP weights at 16 and 64
#                 tokens, then the native engine's 7B rows
#   engine-bench  bench_rollout.py: the native engine's rows on the 1.5B and 7B shapes (issue 20's engine targets,
#                 --profile; the eager check at the graph's batch, 64: the same tiles, so the same split of K)
#   engine-pdl    programmatic dependent launch (MEGATRON_FP4_PDL=1): the 7B rows without and with it in one JSON
#                 (paths "graph+fused" and "graph+fused+pdl"), then the decode-step kernels' and the engine's GPU
#                 tests with it: whether it becomes the default
#   decode-quantize  the decode step's activation quantizers (W4A4 expansion, ResQ 2:4 bf16 sum: the CUDA kernel
#                 and the Triton tiles) (bench_kernels.py --decode-quantize), then their GPU tests
#   decode-natural  the natural-K-order decode GEMM (the default layout): its GPU tests (CLUSTER's determinism too),
#                 then its tiles (WTMA, CLUSTER, forced splits) against the default tile on 7B and 1.5B MLP shapes
#   decode-ring   the decode GEMM's ring at 16 and 64 tokens over the default tiles, on the 7B and 1.5B MLP weights
#                 (session 56's profile: the consumers wait for a stage's data while the producer waits for a free
#                 stage): deeper rings (XST 8-14), the words read from the ring just in time (WJIT 1: DEPTH more
#                 stages in flight in the same shared memory; with one warpgroup, five stages and four blocks per SM,
#                 more blocks at the lead of today's 64-token tile) and one warpgroup per block (WGS 1: session 55's
#                 1.5B lead), after the GPU tests of XST 10, 14 and WJIT; prebuild those tiles into the carry first:
#                 prebuild_kernels.py --ntoks 8,16,64 --tiles '[{"NATURAL":1,"XST":8},{"NATURAL":1,"XST":10},
#                 {"NATURAL":1,"XST":12},{"NATURAL":1,"XST":14},{"NATURAL":1,"WGS":1},{"NATURAL":1,"WGS":1,"XST":10},
#                 {"NATURAL":1,"WJIT":1},{"NATURAL":1,"WJIT":1,"XST":3},{"NATURAL":1,"WJIT":1,"XST":8},
#                 {"NATURAL":1,"WJIT":1,"WGS":1,"XST":5,"MINB":4}]'
#   decode-profile  Nsight Compute on the decode GEMM (the 7B fused gate + up weight, 3584x37888): the default tiles
#                 at M = 16 and 64, both formats: throughput, memory, warp stall reasons, source counters (hardware
#                 counters: the Firecracker runtime)
#   sglang-bench  bench_rollout.py --backend sglang (issue 19's rows): SHAPE (qwen2.5-7b), PRECISIONS
#                 (bf16,w4a16/mxfp4,w4a16/hif4), BATCH (64), ATTN (the attention backend: triton; flashinfer; fa3 is
#                 not in the bundle) from the environment, PROFILE=1 adds --profile (the Engine's kernels by family);
#                 about three Engines fit one call
#   rl-step       bench_rl_step.py: one GRPO step of the driver per rollout backend (issue 19's 5x target; the GPU
#                 memory an SGLang Engine takes beside training)
#   rl-mismatch   bench_rl_step.py: 20 GRPO steps, native engine vs SGLang (HiF4 W4A4 + ResQ), mismatch per step
#
# The sglang-bench and rl-* parts need the SGLang 0.5.17 bundle in .sgl/ (bash ../shared/tools/build_sglang_bundle.sh
# .sgl, ~54 MB; carry it with .whl/ in the same call: the machine goes back 30 s after a call).
#
# REQUIRE_H200=1 ends the part at once (status 3, before anything is installed or built) on a GPU that is not an
# H200: a call that hunts for the H200's rows then costs the machine's start, not the part's minutes, when an H100
# comes (the device tool's nvidia-h200 kind may give either).
#
# megatron-core comes from wheels carried in .whl/ (made beside the checkout, with pip access: pip download -q
# --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .whl
# megatron-core==0.16.1), installed once into /tmp/site (SITE_DIR: elsewhere). nvcc's builds
# (megatron_fp4/kernels/_build), Triton's cache (.triton_cache) and the site folder stay on a warm machine between
# calls. The decode kernels can come prebuilt: `python3 benchmarks/prebuild_kernels.py` (on the CPU machine, nvcc
# only) writes .device_carry/kernels.tar.xz (PREBUILT_KERNELS: elsewhere); carry .device_carry and every part
# unpacks it into the build folder first, so a fresh machine compiles none of them (one that does not load there is
# dropped and builds on first use). Results JSON go to $OUT (the device tool's folder that comes back) when it is
# set, else to benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash benchmarks/h200_checks.sh train-tests|train-bench|decode-tests|decode-bench|issue20-rows"
usage+="|decode-profile|rl-step|rl-mismatch|decode-natural|decode-quantize|engine-bench|engine-pdl|sglang-bench"
usage+="|decode-ring"
case "${1:-}" in train-tests | train-bench | decode-tests | decode-bench | issue20-rows | decode-profile | rl-step | \
  rl-mismatch | decode-natural | decode-quantize | engine-bench | engine-pdl | sglang-bench | decode-ring) ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
if [ -n "${REQUIRE_H200:-}" ]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1 || true)
  if [[ "$gpu" != *H200* ]]; then
    echo "h200_checks.sh $1: REQUIRE_H200 is set and this GPU is '${gpu:-none found}': stopped" >&2
    exit 3
  fi
fi
prebuilt=${PREBUILT_KERNELS:-.device_carry/kernels.tar.xz}
if [ -f "$prebuilt" ]; then  # the decode kernels, prebuilt (benchmarks/prebuild_kernels.py); each one loaded once
  build=${MEGATRON_FP4_BUILD_DIR:-megatron_fp4/kernels/_build}
  mkdir -p "$build"
  # shellcheck disable=SC2046  # (the archive's names: no spaces)
  python3 - "$build" $(tar -xvJf "$prebuilt" -C "$build") <<'PY'
import ctypes, os, sys
bad = []
for name in sys.argv[2:]:
    try:
        ctypes.CDLL(os.path.join(sys.argv[1], name))
    except OSError:
        bad.append(name)
        os.remove(os.path.join(sys.argv[1], name))
print(f"prebuilt kernels: {len(sys.argv) - 2 - len(bad)} unpacked" + (f", {len(bad)} dropped (they do not load "
      f"here, e.g. {bad[0]}: built on first use instead)" if bad else ""))
PY
fi
SITE=${SITE_DIR:-/tmp/site}
if [ ! -d "$SITE/megatron" ]; then
  if ! ls .whl/*.whl > /dev/null 2>&1; then
    echo "h200_checks.sh: no megatron-core wheel in .whl/ (see the header)" >&2
    exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_CACHE_DIR="$PWD/.triton_cache"
results=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
# A failing test selection does not end the part: the rest of it still runs (one device call should tell all it
# can), and the script ends with status 1 naming what failed. (A hung kernel, e.g. a TMA that never completes its
# barrier, ends its selection at the timeout, not the whole device call.)
failed=()
run_tests() {
  # (unbuffered: a selection that its timeout ends still shows how far it got)
  PYTHONUNBUFFERED=1 timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider "$@" \
    || failed+=("pytest $* (exit $?)")
}
prebuild_tests() {  # the GPU tests' tiles (with "natural": only the natural layout's), compiled in parallel
  python3 - "${1:-all}" <<'PY'
import sys
from megatron_fp4.kernels import cuda_decode as cd
from tests.test_cuda_decode import GPU_TILES, NATURAL_GPU_TILES
tiles = [dict(t, NATURAL=1) for t in NATURAL_GPU_TILES if t] + ([t for t in GPU_TILES if t] if sys.argv[1] == "all" else [])
print("prebuilt", cd.prebuild(tiles, ntoks=(8, 16, 64)), "configurations")
PY
}
sglang_env() {
  if ! ls .sgl/sglang-*.tar.xz > /dev/null 2>&1; then
    echo "h200_checks.sh $1: no SGLang bundle in .sgl/ (see the header)" >&2
    exit 2
  fi
  set +u  # the bundle's script reads unset variables
  source tools/sglang_bundle_env.sh .sgl
  set -u
}
case "$1" in
  train-tests)
    run_tests -m gpu tests/test_cuda_quantize.py tests/test_cuda_graph_train.py
    run_tests tests/test_kernels.py tests/test_linear.py \
      -k "requantize or training_backend or edges or bit_exact or weight_cache"
    ;;
  train-bench)
    python3 benchmarks/bench_train.py --cuda-graph --recipes bf16,mxfp4-fp8,hif4,mxfp4-fp8_fast --batches 4x2048 \
      --warmup 2 --iters 3 --out "$results/train_h200.json"
    python3 benchmarks/bench_train.py --recipes bf16,mxfp4-fp8 --batches 4x2048 --warmup 2 --iters 3 \
      --out "$results/train_h200_eager.json"
    ;;
  decode-tests)  # the tests' tiles compiled first, in parallel (on first use each would compile alone)
    prebuild_tests
    run_tests -m gpu tests/test_cuda_decode.py tests/test_rollout_static.py
    # (the fused decode-step kernels' tests carry no gpu mark: on a GPU they run on CUDA, bf16 included)
    run_tests tests/test_decode_ops.py tests/test_kernels.py::test_linear_bias_is_added_before_the_one_rounding \
      tests/test_kernels.py::test_gpu_rollout_linear_bias_through_the_kernels_at_size
    # each fused decode-step kernel against what it replaces, inside CUDA graphs (~1 minute)
    python3 benchmarks/bench_decode_ops.py --shapes qwen2.5-1.5b,qwen2.5-7b --batch 64 --cache 256 \
      --out "$results/decode_ops_h200.json"
    ;;
  decode-quantize)
    python3 benchmarks/bench_kernels.py --decode-quantize --decode-ms 16,64 --out "$results/decode_quantize_h200.json"
    run_tests tests/test_kernels.py -k "few_rows or resq or expansion_only or prefetch"
    run_tests -m gpu tests/test_cuda_quantize.py -k resq
    ;;
  decode-bench)
    python3 benchmarks/bench_kernels.py --decode --decode-sweep --shapes 3584x18944,18944x3584,1536x8960,8960x1536 \
      --out "$results/decode_h200.json"
    ;;
  issue20-rows)
    prebuild_tests natural
    run_tests -m gpu tests/test_cuda_decode.py \
      -k "(natural_layout_bit_exact and None) or rounded_split or dispatch_decode or blocks_per_sm"
    python3 benchmarks/bench_kernels.py --decode --decode-ms 16,64 --shapes 3584x37888,18944x3584 \
      --out "$results/decode_h200.json"
    python3 benchmarks/bench_rollout.py --backend native --shapes qwen2.5-7b --check-samples 64 \
      --out "$results/rollout_h200_7b.json"
    ;;
  engine-bench)
    python3 benchmarks/bench_rollout.py --backend native --shapes qwen2.5-1.5b,qwen2.5-7b --check-samples 64 \
      --profile --out "$results/rollout_h200_engine.json"
    ;;
  engine-pdl)  # the same tests and rows with the kernels waiting on griddepcontrol (megatron_fp4/kernels/_common.py)
    # (the rows first, so that they come back within the call; each row's own checks compare the graph with eager
    # and with a teacher-forced forward; then the GPU tests with PDL, as long as the call lasts)
    python3 benchmarks/bench_rollout.py --backend native --shapes qwen2.5-7b --check-samples 16 \
      --out "$results/rollout_h200_pdl.json"
    export MEGATRON_FP4_PDL=1
    python3 benchmarks/bench_rollout.py --backend native --shapes qwen2.5-7b --check-samples 16 \
      --append --out "$results/rollout_h200_pdl.json"
    run_tests tests/test_decode_ops.py
    prebuild_tests natural
    run_tests -m gpu tests/test_rollout_static.py
    ;;
  decode-natural)  # the "_cuda" columns: the default (NATURAL_TILE); the sweep: every NATURAL tile of SWEEP_TILES
    # (the engine's shapes: Megatron's fc1 is gate and up in one weight; 7B qkv 3584x4608 and proj; 1.5B fc1, fc2)
    prebuild_tests natural
    run_tests -m gpu tests/test_cuda_decode.py -k "natural or cluster"
    python3 benchmarks/bench_kernels.py --decode --decode-sweep --sweep-keys NATURAL --decode-ms 16,32,64 \
      --shapes 3584x37888,18944x3584,3584x4608,3584x3584,1536x17920,8960x1536 \
      --out "$results/decode_natural_sweep_h200.json"
    ;;
  decode-ring)  # the new rings' GPU tests (every token bucket), then the sweep
    prebuild_tests natural
    run_tests -m gpu tests/test_cuda_decode.py -k "natural_layout_bit_exact and (XST10 or XST14 or WJIT1)"
    tiles='[{"XST":8},{"XST":10},{"XST":12},{"XST":14},{"WGS":1},{"WGS":1,"XST":10},{"WJIT":1},{"WJIT":1,"XST":8},'
    tiles+='{"WJIT":1,"WGS":1,"XST":5,"MINB":4}]'
    python3 benchmarks/bench_kernels.py --decode --decode-sweep --decode-ms 16,64 \
      --shapes 3584x37888,18944x3584,1536x17920,8960x1536 --sweep-tiles "$tiles" --out "$results/decode_ring_h200.json"
    ;;
  decode-profile)  # the third launch of each case (the first builds the kernel); one text report per case: the
    # default tiles (natural layout) at M = 16 and at 64 (the rollout's batch), both formats
    # (DECODE_PROFILE_CASES: other cases, one "format M tile-json" per line)
    cases=${DECODE_PROFILE_CASES:-$'hif4 16 null\nmxfp4 16 null\nhif4 64 null\nmxfp4 64 null'}
    while IFS= read -r case; do
      read -r fmt m tile <<< "$case"
      name=decode_profile_${fmt}_m${m}_$(echo "$tile" | tr -dc 'a-z0-9')
      ncu --clock-control none --kernel-name regex:w4_ --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section Occupancy --section SourceCounters \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active" \
        --export "/tmp/$name" --force-overwrite python3 benchmarks/profile_decode.py --format "$fmt" \
        --shape 3584x37888 --m "$m" --tile "$tile" > "$results/$name.log" 2>&1 || echo "ncu failed for $name (exit $?)"
      # the report's sections and stall metrics (text), and per SASS instruction its executions and warp stall
      # samples (CSV; the source page of the same report)
      ncu --import "/tmp/$name.ncu-rep" --page details > "$results/$name.txt" 2>&1 || true
      ncu --import "/tmp/$name.ncu-rep" --page source --print-source sass --csv > "$results/${name}_sass.csv" 2>&1 ||
        true
      echo "== $name"
      grep -E "Duration|DRAM Throughput|Memory Throughput|Issued Warp|Achieved Occupancy|issue_stalled|pipe_|Pipe" \
        "$results/$name.txt" | head -80 || true
    done <<< "$cases"
    ;;
  sglang-bench)
    sglang_env sglang-bench
    python3 benchmarks/bench_rollout.py --backend sglang --shapes "${SHAPE:-qwen2.5-7b}" \
      --precisions "${PRECISIONS:-bf16,w4a16/mxfp4,w4a16/hif4}" --batch "${BATCH:-64}" --check-samples 16 ${PROFILE:+--profile} \
      --sglang-attention-backend "${ATTN:-triton}" --out "$results/rollout_h200_sglang.json"
    ;;
  rl-step)  # the 5x target's command (64 prompts x 8 samples, 256 new tokens); each run stops after 240 s
    sglang_env rl-step
    python3 benchmarks/bench_rl_step.py --shape qwen2.5-1.5b \
      --runs native-megatron:bf16,sglang:w4a4+resq,sglang:bf16,native:bf16 --prompts 64 --group-size 8 \
      --prompt-len 128 --new-tokens 256 --steps 2 --run-timeout 240 --out "$results/rl_step_h200.json" || true
    tar czf "$results/rl_step_logs.tgz" -C /tmp/bench_rl_step --exclude tokenizer --exclude prompts.jsonl .
    ;;
  rl-mismatch)  # smaller steps (32 prompts x 8, 128 new tokens) so that 20 of both backends fit one call
    sglang_env rl-mismatch
    python3 benchmarks/bench_rl_step.py --shape qwen2.5-1.5b --runs sglang:w4a4+resq,native:w4a4+resq \
      --prompts 32 --group-size 8 --prompt-len 128 --new-tokens 128 --steps 20 --run-timeout 270 \
      --out "$results/rl_mismatch_h200.json" || true
    tar czf "$results/rl_mismatch_logs.tgz" -C /tmp/bench_rl_step --exclude tokenizer --exclude prompts.jsonl .
    ;;
esac
if [ ${#failed[@]} -gt 0 ]; then
  echo "h200_checks.sh $1: FAILED:" >&2
  printf '  %s\n' "${failed[@]}" >&2
  exit 1
fi
