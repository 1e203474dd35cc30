"""GRPO for megatron-fp4 (SPEC 5, 6): rewards, data, advantages/loss/metrics (grpo), atomic checkpoints.

Modules: rewards (score), data (datasets, templates, sampler, synthetic tasks), grpo (advantages, loss, filters,
metrics), checkpoint (atomic save/resume). All are pure PyTorch + stdlib and know nothing about Megatron.
"""
