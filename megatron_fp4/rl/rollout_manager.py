"""The rollout manager: prompts in, scored and filtered sequences out, through a RolloutEngine; and the weight sync
from the trainer's policy into that engine.

The engine (the in-process native one; SGLang behind the same interface) holds its own copy of the weights in
the rollout precision, refreshed after every optimizer step and re-quantized once per update. Every rank of a
tensor-parallel group generates the same samples in lockstep (same seed); data-parallel ranks take different
prompts. With pipeline parallelism every rank's engine holds the whole model: the sync gathers the stages'
parameters over the pipeline group first (megatron_fp4.models.pp_gather), the stages generate in lockstep, and
the first stage's samples are used everywhere so that all stages train on the same data.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from megatron_fp4.rl import grpo
from megatron_fp4.rl.config import RolloutConfig
from megatron_fp4.rl.data import Example, PromptSampler
from megatron_fp4.rl.distributed import any_rank, dp_max, dp_rank_and_size, dp_sum, from_first_stage
from megatron_fp4.rl.monitor import TrainingDivergedError
from megatron_fp4.rl.rewards import score
from megatron_fp4.rl.sequences import Sequences, pack_sequences
from megatron_fp4.rl.tokenizer import Tokenizer
from megatron_fp4.rollout import RolloutEngine, RolloutSample, SamplingParams

__all__ = ["RolloutManager", "make_engine"]


def make_engine(cfg: RolloutConfig, rollout_model: torch.nn.Module, precision) -> RolloutEngine:
    """The rollout engine of ``--rollout-backend`` serving ``rollout_model`` in ``precision``."""
    backend = cfg.rollout_backend
    if backend == "native":
        from megatron_fp4.rollout import NativeRolloutEngine

        return NativeRolloutEngine(rollout_model, precision, decode=cfg.rollout_decode)
    raise ValueError(f"--rollout-backend {backend!r} is not available in pretrain_rl.py yet; allowed: native")


class RolloutManager:
    """Samples groups of responses for the training prompts, scores and filters them, and keeps the engine's
    weights in sync with the policy. ``sampler`` holds the data position (checkpointed)."""

    def __init__(self, cfg: RolloutConfig, engine: RolloutEngine, tokenizer: Tokenizer,
                 train_examples: list[Example], seed: int) -> None:
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.train_examples, self.seed = train_examples, seed
        self.sampler = PromptSampler(len(train_examples), seed=seed)
        self.dp_rank, self.dp_size = dp_rank_and_size()

    # -- generation ---------------------------------------------------------------------------------------------------
    def sampling_params(self, greedy: bool, seed: int) -> SamplingParams:
        c = self.cfg
        return SamplingParams(temperature=0.0 if greedy else c.temperature, top_p=1.0 if greedy else c.top_p,
                              top_k=0 if greedy else c.top_k, max_new_tokens=c.max_response_length,
                              stop_token_ids=(self.tokenizer.eos_id,), seed=seed)

    def prompt_ids(self, examples: Sequence[Example]) -> list[list[int]]:
        """Token ids of the examples' prompts; a prompt longer than --max-prompt-length keeps its end (the
        question's last words and the cue)."""
        out = []
        for e in examples:
            ids = self.tokenizer.encode(e.prompt)
            if len(ids) > self.cfg.max_prompt_length:
                ids = ids[-self.cfg.max_prompt_length:]
            out.append(ids)
        return out

    def generate_greedy(self, examples: Sequence[Example], precision: Any = None) -> list[RolloutSample]:
        """Greedy responses to ``examples``, in ``precision`` when given (the engine's own precision after)."""
        previous = self.engine.precision
        if precision is not None:
            self.engine.set_precision(precision)
        try:
            return self.engine.generate(self.prompt_ids(examples), self.sampling_params(greedy=True, seed=0))
        finally:
            if self.engine.precision != previous:
                self.engine.set_precision(previous)

    def rollout(self, step: int) -> tuple[Sequences, dict[str, float]]:
        """Step ``step``'s batch: this rank's prompts, G sampled responses each, rewards, dynamic-sampling and
        overlong filters applied to the loss mask; and the rollout metrics (reduced over data parallelism)."""
        c, G = self.cfg, self.cfg.group_size
        n_prompts = c.global_batch_size // self.dp_size
        idx = self.sampler.next_indices(c.global_batch_size)
        exs = [self.train_examples[i] for i in idx[self.dp_rank * n_prompts:(self.dp_rank + 1) * n_prompts]]
        group_prompts = [p for p in self.prompt_ids(exs) for _ in range(G)]

        t0 = time.monotonic()
        seed = (self.seed * 1_000_003 + step * 9973 + self.dp_rank) % (2 ** 31)
        samples = self.engine.generate(group_prompts, self.sampling_params(greedy=False, seed=seed))
        # pipeline stages generate in lockstep with the same seed; training on the first stage's samples
        # everywhere keeps them consistent even if generation were not bitwise reproducible across ranks
        samples = from_first_stage(samples)
        t_rollout = time.monotonic() - t0
        responses = [s.token_ids for s in samples]
        refs = [e for e in exs for _ in range(G)]
        rewards = torch.tensor([score(self.tokenizer.decode(r), e.reference, e.kind) for r, e in zip(responses, refs)],
                               dtype=torch.float32)
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.float32)
        truncated = torch.tensor([s.finish_reason == "length" for s in samples])
        metrics = grpo.rollout_metrics(rewards, lengths, truncated, G)
        metrics = {k: (dp_max(v) if k.endswith("_max") else dp_sum(v) / self.dp_size) for k, v in metrics.items()}
        metrics["rollout_tokens_per_s"] = dp_sum(float(lengths.sum())) / max(dp_max(t_rollout), 1e-9)
        metrics["rollout_s"] = t_rollout

        keep = torch.ones(len(samples), dtype=torch.bool)
        if c.dynamic_sampling:
            keep = grpo.dynamic_sampling_keep(rewards, G).repeat_interleave(G)
        seqs = pack_sequences(group_prompts, responses, [s.logprobs for s in samples], rewards, self.tokenizer.pad_id)
        if c.overlong_filter:
            seqs.mask = grpo.overlong_filter(seqs.mask, truncated)
        seqs.mask = seqs.mask * keep.unsqueeze(1).to(seqs.mask.dtype)
        seqs.num_tokens = dp_sum(float(seqs.mask.sum()))
        metrics["kept_groups_frac"] = dp_sum(float(keep.float().mean())) / self.dp_size
        return seqs, metrics

    # -- weights ------------------------------------------------------------------------------------------------------
    def sync_weights(self, policy: torch.nn.Module, step: int, last_checkpoint: Optional[str]) -> dict[str, float]:
        """Push ``policy``'s weights (megatron-core names) into the engine, re-quantized once; timing metrics.

        Non-finite weights on any rank stop the run (TrainingDivergedError naming ``step`` and the last good
        checkpoint) before they reach the sampler. With pipeline parallelism the stages' parameters are gathered
        first (a collective; ``rollout/weight_sync_gather_s`` times it)."""
        from megatron.core import parallel_state as ps

        self._check_finite(policy, step, last_checkpoint)
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return self.engine.update_weights(policy.named_parameters()).as_metrics()
        from megatron_fp4.models.pp_gather import gather_pipeline_parameters

        t0 = time.perf_counter()
        rollout_model = getattr(self.engine, "model", None)
        full_names = None if rollout_model is None else [n for n, _ in rollout_model.named_parameters()]
        named = gather_pipeline_parameters(policy, full_names)
        t_gather = time.perf_counter() - t0
        metrics = self.engine.update_weights(named).as_metrics()
        metrics["rollout/weight_sync_gather_s"] = t_gather
        metrics["rollout/weight_sync_total_s"] += t_gather
        return metrics

    @staticmethod
    def _check_finite(policy: torch.nn.Module, step: int, last_checkpoint: Optional[str]) -> None:
        bad = torch.stack([~torch.isfinite(p.detach()).all() for p in policy.parameters()]).any()
        if any_rank(bad):  # every rank stops together
            raise TrainingDivergedError(
                f"stopping at step {step}: the policy's weights are not finite after the update; last good "
                f"checkpoint: {last_checkpoint or 'none saved'}")

    @torch.no_grad()
    def measure_underflow(self, examples: Sequence[Example], sparsity: str) -> dict[str, float]:
        """Per-layer rollout underflow on ``examples`` (greedy), flat ``{layer}/fp4`` and ``{layer}/resq`` rates in
        the engine's format (see RolloutUnderflowMonitor)."""
        rates = self.engine.measure_underflow(self.prompt_ids(examples), self.sampling_params(greedy=True, seed=0),
                                              sparsity)
        return {f"{name}/{k}": v for name, d in sorted(rates.items()) for k, v in d.items()}
