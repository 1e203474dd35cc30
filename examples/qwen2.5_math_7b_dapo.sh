#!/usr/bin/env bash
# GRPO for Qwen2.5-Math-7B on DAPO-Math-17K, mirroring the paper's 7B setting (SPEC §1): batch 128 prompts,
# group size 16, prompt/response 2048/4096, clip 0.2/0.28 (clip-higher), TIS cap 5, lr 1e-6; HiF4 training and
# HiF4 W4A4 + ResQ 2:4 rollout; evaluation on AIME24/25, AMC23 and MATH500, mean@32 (and pass@k).
# Spelled with slime's flags (README: "Coming from slime or Megatron-LM RL"): the HF folder gives the tokenizer and
# the starting weights (no conversion), prompts come from a jsonl/parquet file with slime's keys through the chat
# template, rewards from math-verify; DAPO's dynamic sampling over-samples 192 prompts a round and refills the batch,
# with soft overlong reward shaping. Data files hold {"prompt": ..., "label": ...} (the final answer, \boxed{} or
# plain). Two nodes of 8 GPUs: TP=4 x DP=4. Set NNODES, NODE_RANK, MASTER_ADDR on each node.
set -euo pipefail
HF=${HF:-/models/Qwen2.5-Math-7B}
RUN=${RUN:-runs/qwen2.5-math-7b-dapo-hif4-resq24}
DATA=${DATA:-/data/dapo-math-17k.jsonl}
EVAL=${EVAL:-/data}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_DATASETS_OFFLINE=1

torchrun --nproc-per-node 8 --nnodes "${NNODES:-2}" --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-29500}" pretrain_rl.py \
  --hf-checkpoint "$HF" --load "$RUN/checkpoints" --save "$RUN/checkpoints" --save-interval 10 \
  --tensorboard-dir "$RUN/tensorboard" \
  --tensor-model-parallel-size 4 --bf16 \
  --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rm-type math \
  --eval-prompt-data aime24 "$EVAL/aime-2024.jsonl" aime25 "$EVAL/aime-2025.jsonl" amc23 "$EVAL/amc23.jsonl" \
      math500 "$EVAL/math500.jsonl" \
  --n-samples-per-eval-prompt 32 --eval-temperature 1.0 --eval-interval 10 \
  --fp4-block-format hif4 --rollout-precision w4a4 --resq 2:4 \
  --rollout-batch-size 128 --n-samples-per-prompt 16 --global-batch-size 2048 --micro-batch-size 2 \
  --max-prompt-length 2048 --rollout-max-response-len 4096 \
  --dynamic-sampling --over-sampling-batch-size 192 --overlong-buffer-len 1024 --overlong-penalty-factor 1.0 \
  --lr 1e-6 --min-lr 1e-6 --weight-decay 0.01 --use-kl-loss --kl-loss-coef 0.001 --eps-clip 0.2 \
  --eps-clip-high 0.28 --tis-cap 5.0 --rollout-temperature 1.0 --num-rollout 300 --seed 1234 \
  --log-jsonl "$RUN/metrics.jsonl" --results-json "$RUN/results.json"
