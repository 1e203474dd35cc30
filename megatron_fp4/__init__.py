"""megatron-fp4: FP4 (HiF4 / MXFP4) training and rollout for GRPO on megatron-core."""

__version__ = "0.1.0"
