#!/usr/bin/env bash
# GRPO on GSM8K for Qwen2.5-3B, mirroring the paper's main setting (SPEC §1): AdamW lr 1e-6, group size 16,
# 32 prompts per step, prompt/response 512/1024, clip 0.2/0.2, TIS cap 5, KL penalty; HiF4 training and
# HiF4 W4A4 rollout with Rollout-ResQ 2:4. One node of 8 GPUs (TP=2 x DP=4); change FORMAT/ROLLOUT/RESQ for the
# other rows of the table (e.g. FORMAT=mxfp4, ROLLOUT=bf16 RESQ=none, or --no-fp4-train).
#
#   1. convert:  python tools/convert_hf_to_megatron.py --hf-path $HF --save $CKPT --tensor-model-parallel-size 2
#   2. train:    bash examples/qwen2.5_3b_gsm8k.sh
set -euo pipefail
HF=${HF:-/models/Qwen2.5-3B}
CKPT=${CKPT:-checkpoints/qwen2.5-3b-tp2}
RUN=${RUN:-runs/qwen2.5-3b-gsm8k-hif4-resq24}
FORMAT=${FORMAT:-hif4}
ROLLOUT=${ROLLOUT:-w4a4}
RESQ=${RESQ:-2:4}
GSM8K=${GSM8K:-../shared/data/gsm8k}
NPROC=${NPROC:-8}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

torchrun --nproc-per-node "$NPROC" ${NNODES:+--nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}"} pretrain_rl.py \
  --ref-load "$CKPT" --load "$RUN/checkpoints" --save "$RUN/checkpoints" --save-interval 20 \
  --tensorboard-dir "$RUN/tensorboard" \
  --tensor-model-parallel-size 2 --bf16 \
  --dataset "gsm8k:$GSM8K/train.jsonl" --eval-dataset "gsm8k:$GSM8K/test.jsonl" --eval-interval 20 \
  --fp4-block-format "$FORMAT" --rollout-precision "$ROLLOUT" --resq "$RESQ" \
  --group-size 16 --rollout-batch-size 32 --micro-batch-size 4 \
  --max-prompt-length 512 --max-response-length 1024 \
  --lr 1e-6 --min-lr 1e-6 --weight-decay 0.01 --kl-beta 0.001 --clip-low 0.2 --clip-high 0.2 --tis-cap 5.0 \
  --temperature 1.0 --sft-iters 0 --train-iters 200 --seed 1234 \
  --log-jsonl "$RUN/metrics.jsonl" --results-json "$RUN/results.json"
