"""The rollout manager: prompts in, scored and filtered sequences out, through a RolloutEngine; and the weight sync
from the trainer's policy into that engine.

One step draws --over-sampling-batch-size prompts (default --rollout-batch-size), samples a group of G responses per
prompt and scores them (the built-in graders or --custom-rm-path). With --dynamic-sampling (DAPO) only groups whose
rewards are not all equal are kept, and rounds repeat until --rollout-batch-size groups pass (surplus groups are
dropped; after --dynamic-sampling-max-rounds the filtered groups fill the batch, masked out of the loss). DAPO's
overlong reward shaping (--overlong-buffer-len) is added to the rewards the advantages see; accuracy and the
filter use the verifier's reward.

The engine (--rollout-backend: the in-process native one, or one SGLang Engine per tensor-parallel group on the
group's GPUs, behind the same interface) holds its own copy of the weights in the rollout precision, refreshed
after every optimizer step and re-quantized once per update; with --offload-rollout its memory is released while
the policy trains and restored at the sync. SGLang serves one precision: evaluations in others (``accuracy_bf16``)
and the underflow diagnostics run on a native engine beside it, whose weights are copied only when it is used
(at every sync with pipeline parallelism).
Every rank of a tensor-parallel group gets the same samples (the native engine: generated in lockstep with the
same seed; SGLang: broadcast from the group's first rank); data-parallel ranks take different prompts. With
pipeline parallelism the sync gathers the stages' parameters over the pipeline group first
(megatron_fp4.models.pp_gather), and the first stage's samples are used everywhere so that all stages train on the
same data: the native engine holds the whole model on every rank and the stages generate in lockstep; SGLang runs
only on the first stage (one Engine per TP group there, holding the whole depth), the later stages receive its
samples.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional, Sequence

import torch

from megatron_fp4.rl import grpo
from megatron_fp4.rl.config import SGLANG_MAX_GRAPH_BS, SGLANG_PORTS_PER_RANK, RolloutConfig, sglang_server_args
from megatron_fp4.rl.data import Example, PromptSampler
from megatron_fp4.rl.distributed import any_rank, dp_max, dp_rank_and_size, dp_sum, from_first_stage
from megatron_fp4.rl.monitor import TrainingDivergedError
from megatron_fp4.rl.rewards import RewardFunction, RewardSample
from megatron_fp4.rl.sequences import Sequences, pack_sequences
from megatron_fp4.rl.tokenizer import Tokenizer
from megatron_fp4.rollout import RolloutEngine, RolloutSample, SamplingParams

__all__ = ["RolloutManager", "make_engines", "sglang_engine_kwargs"]


def make_engines(cfg: RolloutConfig, rollout_model: torch.nn.Module, precision, *, hf_dir: Optional[str] = None,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0
                 ) -> tuple[RolloutEngine, Optional[RolloutEngine]]:
    """The engine of ``--rollout-backend`` serving ``precision``, and the engine for what it cannot do (evaluation
    in other precisions, the underflow diagnostics): None for the native engine, which does both; for SGLang the
    native engine on ``rollout_model`` (synced lazily, only when used). ``hf_dir``: the folder of the config.json
    SGLang starts from (no weights are read: the policy's arrive at the first sync)."""
    from megatron_fp4.rollout import NativeRolloutEngine

    backend = cfg.rollout_backend
    if backend == "native":
        return NativeRolloutEngine(rollout_model, precision, decode=cfg.rollout_decode,
                                   offload_on_release=cfg.offload_rollout), None
    if backend == "sglang":
        return _sglang_engine(cfg, precision, hf_dir, dtype, seed), NativeRolloutEngine(
            rollout_model, precision, decode=cfg.rollout_decode)
    raise ValueError(f"--rollout-backend {backend!r} is not valid; allowed: native, sglang")


def _sglang_engine(cfg: RolloutConfig, precision, hf_dir: Optional[str], dtype: torch.dtype, seed: int
                   ) -> RolloutEngine:
    """This rank's view of its SGLang Engine: the Engine itself at TP = PP = 1; else a TPGroupEngine over the Engine
    the first rank of the (first stage's) tensor-parallel group starts with tp_size = TP on the group's GPUs, and
    with PP > 1 a FirstStageEngine over that, through which the later stages get the first stage's samples."""
    from megatron.core import parallel_state as ps

    from megatron_fp4.rollout.sglang_engine import SGLangRolloutEngine
    from megatron_fp4.rollout.tp_group import FirstStageEngine, TPGroupEngine

    if hf_dir is None:
        raise ValueError("--rollout-backend sglang needs the folder of a config.json to start its Engine from")
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    first_stage = ps.is_pipeline_first_stage(ignore_virtual=True)
    engine, error = None, None
    if first_stage and ps.get_tensor_model_parallel_rank() == 0:
        try:
            engine = SGLangRolloutEngine(hf_dir, precision, tp_size=tp,
                                         weight_bucket_bytes=cfg.update_weight_buffer_size,
                                         **sglang_engine_kwargs(cfg, dtype, seed))
        except Exception as e:  # the group stops together, not waiting for an Engine that never started
            error = e
    if tp == 1 and pp == 1:
        if error is not None:
            raise error
        return engine
    if any_rank(error is not None, group=ps.get_model_parallel_group()):
        raise RuntimeError(f"the SGLang Engine of this model-parallel group did not start"
                           f"{f': {error}' if error is not None else ' (see its first rank)'}")
    if tp > 1 and first_stage:
        with open(os.path.join(hf_dir, "config.json")) as f:
            hf_config = json.load(f)
        engine = TPGroupEngine(engine, precision, hf_config, ps.get_tensor_model_parallel_group())
    if pp > 1:
        engine = FirstStageEngine(engine, precision, ps.get_pipeline_model_parallel_group())
    return engine


def sglang_engine_kwargs(cfg: RolloutConfig, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments of this rank's Engine, beside ``SGLangRolloutEngine.engine_args``' own:
    on this rank's GPU, its own ports (apart from the other local ranks' Engines), the memory share and kernels of
    the ``--sglang-*`` flags, the memory saver with --offload-rollout."""
    port = cfg.sglang_base_port + SGLANG_PORTS_PER_RANK * int(os.environ.get("LOCAL_RANK", "0"))
    gpu = torch.cuda.current_device() if torch.cuda.is_available() else 0
    kwargs: dict[str, Any] = dict(
        device="cuda", base_gpu_id=gpu, port=port, nccl_port=port + 8, random_seed=seed,
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32", enable_memory_saver=cfg.offload_rollout,
        mem_fraction_static=cfg.sglang_mem_fraction_static, attention_backend=cfg.sglang_attention_backend,
        sampling_backend="pytorch", grammar_backend="none", disable_cuda_graph=cfg.sglang_disable_cuda_graph,
        # no prefill graphs: capturing SGLang 0.5.17's 58 token counts took 70 s of each start on the H200 (57 s of
        # it compiling), for a rollout whose time is decode (--sglang-server-args can turn them back on)
        disable_prefill_cuda_graph=True,
        load_format="dummy")  # the weights come from the policy at the first sync
    # decode graphs up to one step's samples (SGLang's default stops at 256 on an H200: above, decode ran eagerly)
    kwargs["cuda_graph_max_bs_decode"] = (cfg.sglang_cuda_graph_max_bs or  # its name in 0.5.17 and 0.5.23
                                          min(max(cfg.rollout_batch_size * cfg.group_size, 8), SGLANG_MAX_GRAPH_BS))
    kwargs.update(sglang_server_args(cfg.sglang_server_args))
    return kwargs


class RolloutManager:
    """Samples groups of responses for the training prompts, scores and filters them, and keeps the engine's
    weights in sync with the policy. ``sampler`` holds the data position (checkpointed)."""

    def __init__(self, cfg: RolloutConfig, engine: RolloutEngine, tokenizer: Tokenizer,
                 train_examples: list[Example], seed: int, reward_fn: Optional[RewardFunction] = None,
                 debug_data_path: Optional[str] = None, diagnostics_engine: Optional[RolloutEngine] = None) -> None:
        """``diagnostics_engine``: where evaluations in precisions ``engine`` does not serve and the underflow
        diagnostics run (see :func:`make_engines`); None: on ``engine``."""
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.diagnostics_engine = diagnostics_engine
        self._diagnostics_policy: Optional[torch.nn.Module] = None  # set while the diagnostics engine is stale
        self._released = False
        self.train_examples, self.seed = train_examples, seed
        self.debug_data_path = debug_data_path  # --save-debug-rollout-data (megatron_fp4.rl.debug_data)
        self.reward_fn = reward_fn if reward_fn is not None else RewardFunction()
        self.sampler = PromptSampler(len(train_examples), seed=seed)
        self.dp_rank, self.dp_size = dp_rank_and_size()

    # -- generation ---------------------------------------------------------------------------------------------------
    def sampling_params(self, greedy: bool, seed: int, temperature: Optional[float] = None,
                        max_new_tokens: Optional[int] = None) -> SamplingParams:
        """Greedy, or sampling at --temperature (or ``temperature``) with --top-p/--top-k."""
        c = self.cfg
        return SamplingParams(temperature=0.0 if greedy else (c.temperature if temperature is None else temperature),
                              top_p=1.0 if greedy else c.top_p, top_k=0 if greedy else c.top_k,
                              max_new_tokens=c.max_response_length if max_new_tokens is None else max_new_tokens,
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

    def generate_greedy(self, examples: Sequence[Example], precision: Any = None,
                        max_new_tokens: Optional[int] = None) -> list[RolloutSample]:
        """Greedy responses to ``examples``, in ``precision`` when given (the engine's own precision after)."""
        return self.generate_eval(examples, precision, max_new_tokens=max_new_tokens)

    def generate_eval(self, examples: Sequence[Example], precision: Any = None, n: int = 1,
                      temperature: Optional[float] = None, max_new_tokens: Optional[int] = None,
                      seed: int = 0) -> list[RolloutSample]:
        """Evaluation responses: greedy when ``n`` is 1, else ``n`` samples per example (contiguous) at
        ``temperature``; in ``precision`` when given (the engine's own precision after)."""
        engine = self.engine
        if precision is not None and precision != engine.precision and self.diagnostics_engine is not None:
            engine = self._diagnostics()
        previous = engine.precision
        if precision is not None and precision != previous:
            engine.set_precision(precision)
        try:
            prompts = [p for p in self.prompt_ids(examples) for _ in range(n)]
            params = self.sampling_params(greedy=n == 1, seed=seed, temperature=temperature,
                                          max_new_tokens=max_new_tokens)
            return engine.generate(prompts, params)
        finally:
            if engine.precision != previous:
                engine.set_precision(previous)

    def score(self, examples: Sequence[Example], samples: Sequence[RolloutSample], group_size: int = 1,
              prompt_ids: Optional[Sequence[Sequence[int]]] = None) -> list[float]:
        """Rewards of ``samples`` (``group_size`` contiguous samples per example) from the reward function."""
        decoded = [self.tokenizer.decode(s.token_ids) for s in samples]
        exs = [e for e in examples for _ in range(group_size)]
        batch = [RewardSample(prompt=e.prompt, response=text, label=e.reference if e.label is None else e.label,
                              metadata=dict(e.metadata or {}), index=i, group_index=i // group_size,
                              response_length=len(s.token_ids),
                              status="truncated" if s.finish_reason == "length" else "completed",
                              tokens=(list(prompt_ids[i]) if prompt_ids is not None else []) + list(s.token_ids))
                 for i, (e, s, text) in enumerate(zip(exs, samples, decoded))]
        return self.reward_fn(batch, [e.reference for e in exs], [e.kind for e in exs], group_size)

    def _sample_groups(self, examples: list[Example], seed: int) -> tuple[list, list, torch.Tensor, float]:
        """G sampled responses per example: (prompt ids, samples, rewards, seconds), groups contiguous."""
        G = self.cfg.group_size
        group_prompts = [p for p in self.prompt_ids(examples) for _ in range(G)]
        t0 = time.monotonic()
        samples = self.engine.generate(group_prompts, self.sampling_params(greedy=False, seed=seed))
        # pipeline stages generate in lockstep with the same seed; training on the first stage's samples
        # everywhere keeps them consistent even if generation were not bitwise reproducible across ranks
        samples = from_first_stage(samples)
        t = time.monotonic() - t0
        rewards = torch.tensor(self.score(examples, samples, G, group_prompts), dtype=torch.float32)
        return group_prompts, samples, rewards, t

    def rollout(self, step: int) -> tuple[Sequences, dict[str, float]]:
        """Step ``step``'s batch: this rank's share of --rollout-batch-size prompts, G sampled responses each,
        rewards (with overlong shaping), dynamic sampling with refill and the overlong filter applied; and the
        rollout metrics (reduced over data parallelism; computed over every sampled response)."""
        c, G = self.cfg, self.cfg.group_size
        want = c.rollout_batch_size // self.dp_size          # groups this rank trains on
        per_round = c.over_sampling_batch_size // self.dp_size
        kept, spare = [], []                                   # (prompt ids, samples, rewards) per group
        all_prompts, all_samples, all_rewards = [], [], []
        t_rollout, rounds = 0.0, 0
        while True:
            idx = self.sampler.next_indices(c.over_sampling_batch_size)
            mine = idx[self.dp_rank * per_round:(self.dp_rank + 1) * per_round]
            need = want - len(kept)
            if need > 0:  # a rank that has enough still draws the round: every rank's data position stays the same
                exs = [self.train_examples[i] for i in (mine if c.dynamic_sampling else mine[:need])]
                seed = (self.seed * 1_000_003 + step * 9973 + self.dp_rank + rounds * 104_729) % (2 ** 31)
                prompts, samples, rewards, t = self._sample_groups(exs, seed)
                t_rollout += t
                all_prompts += prompts
                all_samples += samples
                all_rewards.append(rewards)
                passed = (grpo.dynamic_sampling_keep(rewards, G) if c.dynamic_sampling
                          else torch.ones(len(exs), dtype=torch.bool))
                for g in range(len(exs)):
                    group = (prompts[g * G:(g + 1) * G], samples[g * G:(g + 1) * G], rewards[g * G:(g + 1) * G],
                             exs[g])
                    (kept if bool(passed[g]) and len(kept) < want else spare).append(group)
            rounds += 1
            if not c.dynamic_sampling or rounds >= c.dynamic_sampling_max_rounds or not any_rank(len(kept) < want):
                break
        n_passed = len(kept)
        groups = kept + spare[:want - n_passed]  # too few passed: filtered groups fill the batch, masked out

        rewards = torch.cat(all_rewards)
        lengths = torch.tensor([len(s.token_ids) for s in all_samples], dtype=torch.float32)
        truncated = torch.tensor([s.finish_reason == "length" for s in all_samples])
        metrics = grpo.rollout_metrics(rewards, lengths, truncated, G)
        metrics = {k: (dp_max(v) if k.endswith("_max") else dp_sum(v) / self.dp_size) for k, v in metrics.items()}
        metrics["rollout_tokens_per_s"] = dp_sum(float(lengths.sum())) / max(dp_max(t_rollout), 1e-9)
        metrics["rollout_s"] = t_rollout

        prompts = [p for g in groups for p in g[0]]
        samples = [s for g in groups for s in g[1]]
        raw = torch.cat([g[2] for g in groups])
        responses = [s.token_ids for s in samples]
        truncated = torch.tensor([s.finish_reason == "length" for s in samples])
        shaped = raw
        if c.overlong_buffer_len > 0:
            penalty = grpo.overlong_penalty(torch.tensor([len(r) for r in responses]), c.max_response_length,
                                            c.overlong_buffer_len, c.overlong_penalty_factor)
            shaped = raw + penalty
            metrics["overlong_penalty_mean"] = dp_sum(float(penalty.mean())) / self.dp_size
        if self.debug_data_path is not None:
            from megatron_fp4.rl.debug_data import sample_records, save_debug_rollout_data

            records = sample_records([g[3] for g in groups], samples, raw.tolist(), prompts, self.tokenizer, G,
                                     group_offset=self.dp_rank * want)
            save_debug_rollout_data(self.debug_data_path, step, records)
        seqs = pack_sequences(prompts, responses, [s.logprobs for s in samples], shaped, self.tokenizer.pad_id)
        if c.overlong_filter:
            seqs.mask = grpo.overlong_filter(seqs.mask, truncated)
        keep = torch.zeros(len(groups), dtype=torch.bool)
        keep[:n_passed] = True
        keep = keep.repeat_interleave(G)
        seqs.mask = seqs.mask * keep.unsqueeze(1).to(seqs.mask.dtype)
        seqs.num_tokens = dp_sum(float(seqs.mask.sum()))
        metrics["kept_groups_frac"] = dp_sum(float(keep.float().mean())) / self.dp_size
        if c.dynamic_sampling:
            generated = len(all_samples) // G
            metrics["dynamic_sampling_rounds"] = float(rounds)
            metrics["dynamic_sampling_pass_frac"] = (dp_sum(float((grpo.dynamic_sampling_keep(rewards, G)).sum()))
                                                     / max(dp_sum(float(generated)), 1.0))
        return seqs, metrics

    # -- memory and weights -------------------------------------------------------------------------------------------
    def release_memory(self) -> None:
        """With --offload-rollout: free the engine's accelerator memory for the training phase (the next
        :meth:`sync_weights` restores it); otherwise nothing."""
        if self.cfg.offload_rollout and not self._released:
            self.engine.release_memory()
            self._released = True

    def _diagnostics(self) -> RolloutEngine:
        """The diagnostics engine, with the policy's current weights (copied on first use after a sync)."""
        engine = self.diagnostics_engine
        if self._diagnostics_policy is not None:
            engine.update_weights(self._diagnostics_policy.named_parameters())
            self._diagnostics_policy = None
        return engine

    def sync_weights(self, policy: torch.nn.Module, step: int, last_checkpoint: Optional[str]) -> dict[str, float]:
        """Push ``policy``'s weights (megatron-core names) into the engine, re-quantized once; timing metrics.

        Non-finite weights on any rank stop the run (TrainingDivergedError naming ``step`` and the last good
        checkpoint) before they reach the sampler. With pipeline parallelism the stages' parameters are gathered
        first (a collective; ``rollout/weight_sync_gather_s`` times it), and a diagnostics engine beside SGLang gets
        them at once (a pipeline stage's policy alone does not hold the whole depth)."""
        from megatron.core import parallel_state as ps

        self._check_finite(policy, step, last_checkpoint)
        metrics: dict[str, float] = {}
        if self._released:
            t0 = time.perf_counter()
            self.engine.resume_memory()
            self._released = False
            metrics["rollout/resume_memory_s"] = time.perf_counter() - t0
        if ps.get_pipeline_model_parallel_world_size() == 1:
            if self.diagnostics_engine is not None:
                self._diagnostics_policy = policy
            return {**metrics, **self.engine.update_weights(policy.named_parameters()).as_metrics()}
        from megatron_fp4.models.pp_gather import gather_pipeline_parameters

        t0 = time.perf_counter()
        whole = getattr(self.engine, "model", None)  # a full-depth model: the native engine's, or the one beside SGLang
        if whole is None:
            whole = getattr(self.diagnostics_engine, "model", None)
        full_names = None if whole is None else [n for n, _ in whole.named_parameters()]
        named = gather_pipeline_parameters(policy, full_names)
        t_gather = time.perf_counter() - t0
        if self.diagnostics_engine is not None:
            self.diagnostics_engine.update_weights(named)
        metrics.update(self.engine.update_weights(named).as_metrics())
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
        engine = self.engine if self.diagnostics_engine is None else self._diagnostics()
        rates = engine.measure_underflow(self.prompt_ids(examples), self.sampling_params(greedy=True, seed=0),
                                         sparsity)
        return {f"{name}/{k}": v for name, d in sorted(rates.items()) for k, v in d.items()}
