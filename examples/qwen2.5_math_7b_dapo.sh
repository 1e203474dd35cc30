#!/usr/bin/env bash
# GRPO for Qwen2.5-Math-7B on DAPO-Math-17K, mirroring the paper's 7B setting (SPEC §1): batch 128 prompts,
# group size 16, prompt/response 2048/4096, clip 0.2/0.28 (clip-higher), TIS cap 5, lr 1e-6; HiF4 training and
# HiF4 W4A4 + ResQ 2:4 rollout. DAPO-Math-17K must be a local jsonl of {"question", "answer"} (answer = the final
# answer, \boxed{} or plain); evaluation sets (AIME24/25, AMC23, MATH500) likewise, one per --eval-dataset run.
# Two nodes of 8 GPUs: TP=4 x DP=4. Set NNODES, NODE_RANK, MASTER_ADDR on each node.
set -euo pipefail
HF=${HF:-/models/Qwen2.5-Math-7B}
CKPT=${CKPT:-checkpoints/qwen2.5-math-7b-tp4}
RUN=${RUN:-runs/qwen2.5-math-7b-dapo-hif4-resq24}
DATA=${DATA:-/data/dapo-math-17k.jsonl}
EVAL=${EVAL:-/data/math500.jsonl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -d "$CKPT" ] || python tools/convert_hf_to_megatron.py --hf-path "$HF" --save "$CKPT" --tensor-model-parallel-size 4

torchrun --nproc-per-node 8 --nnodes "${NNODES:-2}" --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-29500}" pretrain_rl.py \
  --ref-load "$CKPT" --load "$RUN/checkpoints" --save "$RUN/checkpoints" --save-interval 10 \
  --tensorboard-dir "$RUN/tensorboard" \
  --tensor-model-parallel-size 4 --bf16 \
  --dataset "math:$DATA" --eval-dataset "math:$EVAL" --eval-interval 10 \
  --fp4-format hif4 --rollout-precision w4a4 --resq 2:4 \
  --group-size 16 --global-batch-size 128 --micro-batch-size 2 \
  --max-prompt-length 2048 --max-response-length 4096 \
  --lr 1e-6 --min-lr 1e-6 --weight-decay 0.01 --kl-beta 0.001 --clip-low 0.2 --clip-high 0.28 --tis-cap 5.0 \
  --dynamic-sampling --temperature 1.0 --sft-iters 0 --train-iters 300 --seed 1234 \
  --log-jsonl "$RUN/metrics.jsonl" --results-json "$RUN/results.json"
