"""Rollout engines behind one interface, and the rollout precision (BF16 / W4A16 / W16A4 / W4A4 [+ ResQ]).

    from megatron_fp4.rollout import NativeRolloutEngine, SamplingParams
    from megatron_fp4.resq import RolloutPrecision
    engine = NativeRolloutEngine(model, RolloutPrecision("w4a4", "hif4", "2:4"))
    samples = engine.generate(prompt_token_ids, SamplingParams(temperature=1.0, max_new_tokens=256, seed=0))
"""

from megatron_fp4.resq import RolloutPrecision, paper_rollout_precisions
from megatron_fp4.rollout.base import (
    FINISH_REASONS,
    RolloutEngine,
    RolloutSample,
    SamplingParams,
    WeightSyncStats,
)
from megatron_fp4.rollout.diagnostics import RolloutUnderflowMonitor, underflow_counts
from megatron_fp4.rollout_kernels import register_kernel_backend, unregister_kernel_backend
from megatron_fp4.rollout.native import NativeRolloutEngine, full_forward_logits, teacher_forced_logprobs
from megatron_fp4.rollout.precision import (
    apply_rollout_precision,
    remove_rollout_precision,
    rollout_linear_modules,
    rollout_precision,
)
from megatron_fp4.rollout.sampling import filter_logits, sample_tokens, token_logprobs

__all__ = [
    "FINISH_REASONS",
    "RolloutEngine",
    "RolloutSample",
    "SamplingParams",
    "WeightSyncStats",
    "RolloutPrecision",
    "paper_rollout_precisions",
    "NativeRolloutEngine",
    "teacher_forced_logprobs",
    "full_forward_logits",
    "RolloutUnderflowMonitor",
    "underflow_counts",
    "apply_rollout_precision",
    "remove_rollout_precision",
    "rollout_linear_modules",
    "rollout_precision",
    "register_kernel_backend",
    "unregister_kernel_backend",
    "filter_logits",
    "sample_tokens",
    "token_logprobs",
]
