"""The GRPO trainer: rollout -> reward -> advantages -> token-level clipped loss with TIS and KL -> optimizer step
-> weight sync, on megatron-core models (TP/PP/DP; FP4 training recipe) and a rollout engine in its own precision.

Roles, as in slime/verl: the *policy* is the megatron-core GPTModel wrapped in megatron DDP, trained through
megatron's forward/backward schedule with per-token loss accounting (``calculate_per_token_loss``: the loss is a
token-level mean over the whole global batch, exactly, whatever the micro-batching and data parallelism); the
*reference* is a frozen copy of the warm-start weights (KL); the *rollout engine* holds its own copy of the
weights, refreshed after every optimizer step and re-quantized once per update. Every rank of a tensor-parallel
group generates the same samples in lockstep (same seed); data-parallel ranks generate different prompts.

Pipeline parallelism: the policy and reference hold one stage per rank, but the rollout engine needs the whole
model, so every pipeline rank keeps a full-depth rollout copy (tensor-parallel sharded like the policy). The weight
sync gathers the stages' parameters over the pipeline group (megatron_fp4.models.pp_gather) into it; the stages
generate in lockstep, and the first stage's samples are broadcast to the others so they all train on the same data.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_fp4.parallel import collective_device
from megatron_fp4.rl import grpo
from megatron_fp4.rl.checkpoint import (CheckpointError, capture_rng_state, latest_iteration, load_checkpoint,
                                        restore_rng_state, save_checkpoint)
from megatron_fp4.rl.data import Example, PromptSampler
from megatron_fp4.rl.monitor import MetricsLogger, NonFiniteGuard, TrainingDivergedError
from megatron_fp4.rl.optimizer_state import load_named_optimizer_state, named_optimizer_state, parameter_names
from megatron_fp4.rl.rewards import score
from megatron_fp4.rl.tokenizer import Tokenizer


@dataclass
class Sequences:
    """A right-padded batch of prompt+response sequences on the next-token grid (inputs predict labels)."""

    inputs: torch.Tensor        # [N, T] token ids fed to the model
    labels: torch.Tensor        # [N, T] the next token at each position
    mask: torch.Tensor          # [N, T] 1.0 where the label is a response token (the loss positions)
    logp_rollout: torch.Tensor  # [N, T] rollout engine logprobs of the labels (0 outside mask)
    advantages: torch.Tensor    # [N] per-response advantage

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def select(self, idx: torch.Tensor | slice) -> "Sequences":
        return Sequences(self.inputs[idx], self.labels[idx], self.mask[idx], self.logp_rollout[idx],
                         self.advantages[idx])


def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                   rollout_logprobs: Sequence[Sequence[float]], advantages: torch.Tensor, pad_id: int,
                   length: Optional[int] = None) -> Sequences:
    """Right-padded next-token batch: position t of ``inputs`` predicts ``labels[t]``; response labels are masked in."""
    full = [list(p) + list(r) for p, r in zip(prompts, responses)]
    T = max(len(s) for s in full) - 1 if length is None else length
    n = len(full)
    inputs = torch.full((n, T), pad_id, dtype=torch.long)
    labels = torch.full((n, T), pad_id, dtype=torch.long)
    mask = torch.zeros(n, T)
    lp = torch.zeros(n, T)
    for i, (s, p, r, l) in enumerate(zip(full, prompts, responses, rollout_logprobs)):
        k = len(s) - 1
        if k > T:
            raise ValueError(f"sequence {i} has {k + 1} tokens, more than the packing length {T + 1}")
        inputs[i, :k] = torch.tensor(s[:-1])
        labels[i, :k] = torch.tensor(s[1:])
        a, b = len(p) - 1, len(p) - 1 + len(r)
        mask[i, a:b] = 1.0
        if len(r):
            lp[i, a:b] = torch.tensor(list(l), dtype=torch.float32)
    return Sequences(inputs, labels, mask, lp, advantages.to(torch.float32))


class GRPOTrainer:
    """One GRPO run. ``policy`` is megatron DDP-wrapped; ``reference`` may be None when kl_beta == 0."""

    def __init__(self, args, tokenizer: Tokenizer, train_examples: list[Example], eval_examples: list[Example],
                 policy, optimizer, config, reference, engine, precision_name: str) -> None:
        from megatron.core import parallel_state as ps

        self.args, self.tok = args, tokenizer
        self.train_examples, self.eval_examples = train_examples, eval_examples
        self.policy, self.optimizer, self.config = policy, optimizer, config
        self.reference, self.engine, self.precision_name = reference, engine, precision_name
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.rank = torch.distributed.get_rank()
        self.sampler = PromptSampler(len(train_examples), seed=args.seed)
        self.guard = NonFiniteGuard(args.max_nonfinite_steps)
        self.step = 0
        self._sft_rng = None
        self.state_extra: dict[str, Any] = {}
        self.last_checkpoint: Optional[str] = None
        self.logger = MetricsLogger(args.tensorboard_dir, total_steps=args.train_iters, rank=self.rank)
        self.grpo_cfg = grpo.GRPOConfig(
            group_size=args.group_size, clip_low=args.clip_low, clip_high=args.clip_high,
            tis_cap=args.tis_cap if args.tis_cap > 0 else 5.0, use_tis=args.tis_cap > 0, kl_beta=args.kl_beta,
            normalize_std=args.advantage == "grpo", dynamic_sampling=args.dynamic_sampling,
            overlong_filter=args.overlong_filter)

    # ------------------------------------------------------------------------------------------ megatron plumbing
    def _run_schedule(self, model, microbatches: list[dict], loss_fn: Callable, forward_only: bool) -> list[dict]:
        """Run megatron's forward(/backward) schedule over micro-batches; returns the last stage's loss dicts."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model_chunk):
            batch = next(data_iterator)
            dev = next(model_chunk.parameters()).device  # batches are built on the CPU; the model may be on a GPU
            batch = {k: v.to(dev) for k, v in batch.items()}
            T = batch["inputs"].shape[1]
            pos = torch.arange(T, device=dev).unsqueeze(0).expand_as(batch["inputs"])
            out = model_chunk(batch["inputs"], pos, None)
            return out, partial(loss_fn, batch)

        fb = get_forward_backward_func()
        return fb(forward_step_func=forward_step, data_iterator=iter(microbatches), model=[model],
                  num_microbatches=len(microbatches), seq_length=microbatches[0]["inputs"].shape[1],
                  micro_batch_size=microbatches[0]["inputs"].shape[0], forward_only=forward_only)

    def _microbatches(self, seqs: Sequences, extra: Optional[dict[str, torch.Tensor]] = None) -> list[dict]:
        mbs = []
        size = self.args.micro_batch_size
        for start in range(0, len(seqs), size):
            sl = slice(start, start + size)
            mb = {"inputs": seqs.inputs[sl], "labels": seqs.labels[sl], "mask": seqs.mask[sl],
                  "logp_rollout": seqs.logp_rollout[sl], "advantages": seqs.advantages[sl]}
            for k, v in (extra or {}).items():
                mb[k] = v[sl]
            mbs.append(mb)
        return mbs

    @torch.no_grad()
    def logprobs(self, model, seqs: Sequences) -> Optional[torch.Tensor]:
        """Next-token logprobs [N, T] of the labels under ``model`` (on the last pipeline stage; None elsewhere)."""

        def loss_fn(batch, logits):
            lp = grpo.token_logprobs(logits, batch["labels"])
            zero = lp.sum() * 0
            return zero, torch.tensor(1, dtype=torch.int), {"logp": lp}

        store = self._run_schedule(model, self._microbatches(seqs), loss_fn, forward_only=True)
        if not store:
            return None
        return torch.cat([d["logp"] for d in store], dim=0)


    def _optimizer_step(self) -> tuple[bool, float]:
        ok, grad_norm, _ = self.optimizer.step()
        return ok, float(grad_norm) if grad_norm is not None else float("nan")

    def _grads_finite(self) -> bool:
        """Whether every (data-parallel reduced) gradient of this rank and its model-parallel peers is finite."""
        from megatron.core import parallel_state as ps

        bad = torch.zeros(1, device=collective_device())
        for p in self.policy.module.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None and not bool(torch.isfinite(g).all()):
                bad.fill_(1.0)
                break
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX, group=ps.get_model_parallel_group())
        return not bool(bad)

    def _global_sum(self, x: float, op=torch.distributed.ReduceOp.SUM) -> float:
        """Reduce a per-rank scalar over data parallel (model-parallel peers hold the same value)."""
        from megatron.core import parallel_state as ps

        t = torch.tensor([x], dtype=torch.float64, device=collective_device())
        torch.distributed.all_reduce(t, op=op, group=ps.get_data_parallel_group())
        return float(t)

    def _global_max(self, x: float) -> float:
        return self._global_sum(x, op=torch.distributed.ReduceOp.MAX)

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def lr_at(self, step: int) -> float:
        a = self.args
        if a.min_lr is None:
            return a.lr
        frac = min(step / max(a.train_iters, 1), 1.0)
        return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * frac))

    # ------------------------------------------------------------------------------------------ supervised warm-up
    def supervised_warmup(self, iters: int, lr: float, batch_size: int, progress: bool = True) -> list[float]:
        """Cross-entropy on the examples' target completions (response tokens only), through the same schedule."""
        import random

        if iters <= 0:
            return []
        if self._sft_rng is None:  # one stream over calls: warming up in chunks draws the same batches
            self._sft_rng = random.Random(self.args.seed * 1000 + 17 + self.dp_rank)
        rng = self._sft_rng
        self.set_lr(lr)
        losses = []
        per_rank = max(1, batch_size // self.dp_size)

        def loss_fn(batch, logits):
            lp = grpo.token_logprobs(logits, batch["labels"])
            m = batch["mask"]
            return -(lp * m).sum(), m.sum().to(torch.int), {"nll_sum": (-(lp * m).sum()).detach(),
                                                              "tokens": m.sum().detach()}

        t0 = time.monotonic()
        for it in range(iters):
            exs = rng.sample(self.train_examples, min(per_rank, len(self.train_examples)))
            prompts = [self.tok.encode(e.prompt) for e in exs]
            targets = [self.tok.encode(e.target) + [self.tok.eos_id] for e in exs]
            seqs = pack_sequences(prompts, targets, [[0.0] * len(t) for t in targets], torch.zeros(len(exs)),
                                  self.tok.pad_id)
            self.policy.zero_grad_buffer()
            self.optimizer.zero_grad()
            store = self._run_schedule(self.policy, self._microbatches(seqs), loss_fn, forward_only=False)
            ok, _ = self._optimizer_step()
            nll = sum(float(d["nll_sum"]) for d in store) if store else 0.0
            ntok = sum(float(d["tokens"]) for d in store) if store else 0.0
            loss = self._broadcast_last_stage(nll / max(ntok, 1.0))
            losses.append(loss)
            if progress and self.rank == 0 and (it % 25 == 0 or it == iters - 1):
                print(f"[warmup] iter {it + 1}/{iters} | nll {loss:.4f} | {time.monotonic() - t0:.0f}s", flush=True)
        self.set_lr(self.lr_at(0))
        return losses

    def _broadcast_last_stage(self, value: float) -> float:
        """A scalar known on the last pipeline stage, made known to every rank (mean over data parallel)."""
        from megatron.core import parallel_state as ps

        t = torch.tensor([value if ps.is_pipeline_last_stage() else 0.0], dtype=torch.float64,
                         device=collective_device())
        torch.distributed.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
        torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
        return float(t) / self.dp_size

    # ------------------------------------------------------------------------------------------ rollout
    def sync_rollout_weights(self) -> dict[str, float]:
        """Push the policy's weights into the rollout engine (re-quantized once); returns timing metrics.

        With pipeline parallelism the rollout model is the full model: every stage's parameters are gathered
        over the pipeline group first (a collective; ``rollout/weight_sync_gather_s`` times it). Non-finite
        weights on any rank stop the run (TrainingDivergedError naming the step and the last good checkpoint)
        before they reach the sampler."""
        from megatron.core import parallel_state as ps

        self._check_weights_finite()
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return self.engine.update_weights(self.policy.module.named_parameters()).as_metrics()
        from megatron_fp4.models.pp_gather import gather_pipeline_parameters

        t0 = time.perf_counter()
        rollout_model = getattr(self.engine, "model", None)
        full_names = None if rollout_model is None else [n for n, _ in rollout_model.named_parameters()]
        named = gather_pipeline_parameters(self.policy.module, full_names)
        t_gather = time.perf_counter() - t0
        metrics = self.engine.update_weights(named).as_metrics()
        metrics["rollout/weight_sync_gather_s"] = t_gather
        metrics["rollout/weight_sync_total_s"] += t_gather
        return metrics

    def _check_weights_finite(self) -> None:
        params = [p.detach() for p in self.policy.module.parameters()]
        bad = torch.stack([~torch.isfinite(p).all() for p in params]).any().float().reshape(1)
        bad = bad.to(collective_device())
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)  # every rank stops together
        if bool(bad.item()):
            raise TrainingDivergedError(
                f"stopping at step {self.step}: the policy's weights are not finite after the update; last good "
                f"checkpoint: {self.last_checkpoint or 'none saved'}")

    def _same_on_pipeline(self, obj):
        """``obj`` of the first pipeline stage, on every stage (identity without pipeline parallelism)."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_first_rank(),
                                                group=ps.get_pipeline_model_parallel_group())
        return box[0]

    def sampling_params(self, greedy: bool, seed: int):
        from megatron_fp4.rollout import SamplingParams

        a = self.args
        return SamplingParams(temperature=0.0 if greedy else a.temperature, top_p=1.0 if greedy else a.top_p,
                              top_k=0 if greedy else a.top_k, max_new_tokens=a.max_response_length,
                              stop_token_ids=(self.tok.eos_id,), seed=seed)

    def _prompt_ids(self, examples: Sequence[Example]) -> list[list[int]]:
        out = []
        for e in examples:
            ids = self.tok.encode(e.prompt)
            if len(ids) > self.args.max_prompt_length:
                ids = ids[-self.args.max_prompt_length:]  # keep the end (the question's last words and the cue)
            out.append(ids)
        return out

    @torch.no_grad()
    def evaluate(self, precisions: Optional[dict[str, Any]] = None) -> dict[str, float]:
        """Greedy accuracy on the held-out examples (this rank's share, averaged over data parallel)."""
        exs = self.eval_examples[self.dp_rank::self.dp_size]
        prompts = self._prompt_ids(exs)
        out = {}
        previous = self.engine.precision
        for name, prec in (precisions or {"accuracy": None}).items():
            if prec is not None:
                self.engine.set_precision(prec)
            samples = self.engine.generate(prompts, self.sampling_params(greedy=True, seed=0))
            correct = sum(score(self.tok.decode(s.token_ids), e.reference, e.kind) for s, e in zip(samples, exs))
            out[name] = self._global_sum(correct) / max(self._global_sum(len(exs)), 1)
        if self.engine.precision != previous:
            self.engine.set_precision(previous)
        return out

    # ------------------------------------------------------------------------------------------ one GRPO step
    def train_step(self) -> dict[str, float]:
        a, cfg = self.args, self.grpo_cfg
        G = a.group_size
        n_prompts = a.global_batch_size // self.dp_size
        idx = self.sampler.next_indices(a.global_batch_size)
        mine = idx[self.dp_rank * n_prompts:(self.dp_rank + 1) * n_prompts]
        exs = [self.train_examples[i] for i in mine]
        prompts = self._prompt_ids(exs)
        group_prompts = [p for p in prompts for _ in range(G)]

        t0 = time.monotonic()
        seed = (a.seed * 1_000_003 + self.step * 9973 + self.dp_rank) % (2 ** 31)
        samples = self.engine.generate(group_prompts, self.sampling_params(greedy=False, seed=seed))
        # pipeline stages generate in lockstep with the same seed; training on the first stage's samples
        # everywhere keeps them consistent even if generation were not bitwise reproducible across ranks
        samples = self._same_on_pipeline(samples)
        t_rollout = time.monotonic() - t0
        responses = [s.token_ids for s in samples]
        texts = [self.tok.decode(r) for r in responses]
        rewards = torch.tensor([score(t, e.reference, e.kind) for t, e in zip(texts, (e for e in exs for _ in range(G)))],
                               dtype=torch.float32)
        lengths = torch.tensor([len(r) for r in responses], dtype=torch.float32)
        truncated = torch.tensor([s.finish_reason == "length" for s in samples])
        metrics = grpo.rollout_metrics(rewards, lengths, truncated, G)
        metrics = {k: (self._global_max(v) if k.endswith("_max") else self._global_sum(v) / self.dp_size)
                   for k, v in metrics.items()}
        metrics["rollout_tokens_per_s"] = self._global_sum(float(lengths.sum())) / max(self._global_max(t_rollout),
                                                                                       1e-9)
        metrics["rollout_s"] = t_rollout

        adv = grpo.group_advantages(rewards, **cfg.advantage_kwargs())
        keep = torch.ones(len(samples), dtype=torch.bool)
        if cfg.dynamic_sampling:
            keep = grpo.dynamic_sampling_keep(rewards, G).repeat_interleave(G)
        seqs = pack_sequences(group_prompts, responses, [s.logprobs for s in samples], adv, self.tok.pad_id)
        if cfg.overlong_filter:
            seqs.mask = grpo.overlong_filter(seqs.mask, truncated)
        seqs.mask = seqs.mask * keep.unsqueeze(1).to(seqs.mask.dtype)
        num_tokens = self._global_sum(float(seqs.mask.sum()))
        metrics["kept_groups_frac"] = self._global_sum(float(keep.float().mean())) / self.dp_size
        if num_tokens == 0:  # every group filtered out: nothing to learn from this step
            metrics.update(skipped=1.0, loss=0.0)
            self.step += 1
            return metrics

        t1 = time.monotonic()
        extra = {}
        if self.reference is not None and a.kl_beta > 0:
            extra["logp_ref"] = self.logprobs(self.reference, seqs)
        if a.ppo_epochs > 1:
            extra["logp_old"] = self.logprobs(self.policy, seqs)
        loss_fn = partial(self._grpo_loss_fn, cfg)
        stats = {}
        for _ in range(a.ppo_epochs):
            self.policy.zero_grad_buffer()
            self.optimizer.zero_grad()
            mbs = self._microbatches(seqs, {k: v for k, v in extra.items() if v is not None})
            store = self._run_schedule(self.policy, mbs, loss_fn, forward_only=False)
            stats = self._reduce_stats(store)
            # one decision per update, before the optimizer touches the weights
            grads_ok = self._grads_finite()
            if self.guard.should_skip(self.step + 1, stats.get("loss", 0.0), 0.0 if grads_ok else float("nan"),
                                      self.last_checkpoint):
                metrics["skipped"] = 1.0
                break
            _, grad_norm = self._optimizer_step()
            metrics["grad_norm"] = grad_norm
        t_train = time.monotonic() - t1
        metrics.update(stats)
        metrics["train_tokens_per_s"] = num_tokens * a.ppo_epochs / max(t_train, 1e-9)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        self.step += 1
        metrics.update(self.sync_rollout_weights())
        self.set_lr(self.lr_at(self.step))
        return metrics

    def _grpo_loss_fn(self, cfg, batch, logits):
        lp = grpo.token_logprobs(logits, batch["labels"])
        m = batch["mask"]
        logp_ref = batch.get("logp_ref")
        kw = cfg.loss_kwargs()
        if logp_ref is None:  # no reference model (kl_beta == 0): no KL term
            kw["kl_beta"] = 0.0
        tok = grpo.grpo_token_loss(lp, batch.get("logp_old"), batch["logp_rollout"], batch["advantages"], m,
                                   logp_ref=logp_ref, **kw)
        with torch.no_grad():
            ent = grpo.entropy_from_logits(logits)
            mets = grpo.grpo_metrics(lp, batch.get("logp_old"), batch["logp_rollout"], batch["advantages"], m,
                                     logp_ref=logp_ref, entropy=ent, **kw)
        n = m.sum()
        mets = {k: torch.tensor(v * float(n)) for k, v in mets.items() if k != "num_tokens"}  # token-weighted
        mets["num_tokens"] = n.detach()
        for k in ("logp_abs_diff_max", "ratio_max"):  # maxima are not token-weighted
            if k in mets:
                mets[k] = mets[k] / max(float(n), 1.0)
        return tok.sum(), n.to(torch.int), mets

    def _reduce_stats(self, store: list[dict]) -> dict[str, float]:
        """Token-weighted means of the loss-function metrics over micro-batches and data-parallel ranks."""
        from megatron.core import parallel_state as ps

        keys = sorted(store[0].keys()) if store else []
        # non-last pipeline stages know no keys: take them from the last stage
        obj = [keys]
        torch.distributed.broadcast_object_list(obj, src=ps.get_pipeline_model_parallel_last_rank(),
                                                group=ps.get_pipeline_model_parallel_group())
        keys = obj[0]
        maxima = {"logp_abs_diff_max", "ratio_max"}
        dev = collective_device()
        vals = torch.zeros(len(keys), dtype=torch.float64, device=dev)
        for i, k in enumerate(keys):
            for d in store:
                v = float(d[k])
                vals[i] = max(vals[i], v) if k in maxima else vals[i] + v
        for group in (ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group()):
            s = vals.clone()
            torch.distributed.all_reduce(s, group=group)
            mx = vals.clone()
            torch.distributed.all_reduce(mx, op=torch.distributed.ReduceOp.MAX, group=group)
            vals = torch.tensor([float(mx[i]) if k in maxima else float(s[i]) for i, k in enumerate(keys)],
                                dtype=torch.float64, device=dev)
        out = dict(zip(keys, vals.tolist()))
        n = max(out.pop("num_tokens", 1.0), 1.0)
        return {k: (v if k in maxima else v / n) for k, v in out.items()}

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "model": self.policy.module.state_dict(),
            "reference": self.reference.state_dict() if self.reference is not None else None,
            "optimizer_named": named_optimizer_state(self.optimizer, self.policy.module),
            "sampler": self.sampler.state_dict(),
            "guard": self.guard.state_dict(),
            "rng": capture_rng_state(),
            "extra": self.state_extra,
            "layout": self.layout(),
        }

    def layout(self) -> dict:
        """This rank's parallel layout and the model shape, stored with each checkpoint file."""
        from megatron_fp4.rl.checkpoint_weights import layout_record

        return layout_record(self.policy.module, self.tok.vocab_size)

    def save(self) -> str:
        a = self.args
        path = save_checkpoint(a.save, self.step, self.state_dict(), keep_last=a.keep_last, rank=self.rank,
                               world_size=torch.distributed.get_world_size())
        self.last_checkpoint = str(path)
        if self.rank == 0:
            print(f"[checkpoint] saved step {self.step} to {path}", flush=True)
        return str(path)

    def load_model_weights(self, load_dir: str) -> int:
        """Only the model weights of the latest RL checkpoint in ``load_dir`` (a warm start shared by several runs);
        optimizer, step, data position and RNG stay fresh. The checkpoint may come from another TP/PP/DP layout
        (resharded on load). Returns the checkpoint's iteration."""
        from megatron_fp4.rl.checkpoint_weights import describe_layout, same_layout, saved_layout

        it, saved = saved_layout(load_dir)
        mine = self.layout()
        how = "warm start"
        same = saved is None or same_layout(saved, mine)
        self._load_policy_weights(load_dir, it, same)
        if not same:
            how += f", resharded from {describe_layout(saved)} to {describe_layout(mine)}"
        if self.rank == 0:
            print(f"[checkpoint] model weights from {os.path.join(load_dir, f'iter_{it:07d}')} ({how})", flush=True)
        return it

    def _load_policy_weights(self, load_dir: str, it: int, same_layout: bool) -> dict | None:
        """Load the policy weights of checkpoint ``it``: from this rank's file under the layout it was saved with
        (whose whole state is returned), else resharded (None returned). Either way the optimizer's main copies
        are refreshed from them: with --bf16 it steps fp32 copies made when it was built (a no-op for fp32
        parameters), or the first update would start from the old weights."""
        from megatron_fp4.models.checkpoint_io import load_checkpoint_into_model
        from megatron_fp4.rl.checkpoint_weights import TrainerCheckpointWeights

        state = None
        if same_layout:
            _, state = load_checkpoint(load_dir, it, rank=self.rank)
            self.policy.module.load_state_dict(state["model"])
        else:
            load_checkpoint_into_model(self.policy, TrainerCheckpointWeights(load_dir, it))
        self.optimizer.reload_model_params()
        return state

    @torch.no_grad()
    def measure_rollout_underflow(self, sparsity: str, max_prompts: int = 64) -> dict[str, float]:
        """Per-layer rollout underflow on up to ``max_prompts`` held-out prompts (greedy), flat
        ``{layer}/fp4`` and ``{layer}/resq`` rates in the engine's format (see RolloutUnderflowMonitor)."""
        prompts = self._prompt_ids(self.eval_examples[:max_prompts])
        rates = self.engine.measure_underflow(prompts, self.sampling_params(greedy=True, seed=0), sparsity)
        return {f"{name}/{k}": v for name, d in sorted(rates.items()) for k, v in d.items()}

    def try_resume(self, load_dir: str) -> bool:
        """Load the latest RL checkpoint of ``load_dir``; False (start fresh) when it holds none. A checkpoint
        saved at another TP/PP/DP layout is resharded: weights and optimizer state exactly, the data position,
        step and monitors from its rank 0 (they are global), and every rank takes rank 0's RNG state (sampling
        seeds derive from the step and the data-parallel rank, not from it)."""
        if latest_iteration(load_dir) is None:
            if self.rank == 0:
                print(f"[checkpoint] no checkpoint in {load_dir}: starting from scratch", flush=True)
            return False
        from megatron_fp4.rl.checkpoint_weights import describe_layout, same_layout, saved_layout

        it, saved = saved_layout(load_dir)
        mine = self.layout()
        how = ""
        if saved is None or same_layout(saved, mine):
            state = self._load_policy_weights(load_dir, it, True)  # then the saved main copies where stored
            if self.reference is not None and state.get("reference") is not None:
                self.reference.load_state_dict(state["reference"])
            if "optimizer_named" in state:
                load_named_optimizer_state(self.optimizer, self.policy.module, state["optimizer_named"])
            else:  # written before optimizer state was stored by name
                self.optimizer.load_state_dict(state["optimizer"])
        else:
            state = self._load_resharded(load_dir, it, saved, mine)
            how = f", resharded from {describe_layout(saved)} to {describe_layout(mine)}"
        self.sampler.load_state_dict(state["sampler"])
        self.guard.load_state_dict(state["guard"])
        restore_rng_state(state["rng"])
        self.step = int(state["step"])
        self.state_extra = dict(state.get("extra") or {})
        self.last_checkpoint = os.path.join(load_dir, f"iter_{it:07d}")
        self.set_lr(self.lr_at(self.step))
        if self.rank == 0:
            print(f"[checkpoint] resumed from {self.last_checkpoint} (step {self.step}{how})", flush=True)
        return True

    def _load_resharded(self, load_dir: str, it: int, saved: dict, mine: dict) -> dict:
        """Weights, reference and optimizer state of checkpoint ``it`` resharded to this rank; returns rank 0's
        state (the global parts)."""
        from megatron_fp4.models.checkpoint_io import load_checkpoint_into_model, rank_state
        from megatron_fp4.rl.checkpoint_weights import TrainerCheckpointWeights, describe_layout

        _, state0 = load_checkpoint(load_dir, it, rank=0, mmap=True)
        if "optimizer_named" not in state0:
            raise CheckpointError(
                f"cannot resume from {os.path.join(load_dir, f'iter_{it:07d}')} at another layout: it was saved "
                f"with {describe_layout(saved)} (this run has {describe_layout(mine)}) by a version that did not "
                f"store the optimizer state by parameter name. To start from its weights at this layout, pass "
                f"--init-from {load_dir} with a new --save directory (fresh optimizer and schedule)")
        module = self.policy.module
        self._load_policy_weights(load_dir, it, False)  # then the saved main copies where stored
        if self.reference is not None and state0.get("reference") is not None:
            load_checkpoint_into_model(self.reference, TrainerCheckpointWeights(load_dir, it, "reference"))
        saved_opt = state0["optimizer_named"]
        steps = {float(v) for v in saved_opt.get("step", {}).values()}
        if len(steps) > 1:
            raise CheckpointError(f"{load_dir}: parameters at different optimizer steps {sorted(steps)}: cannot "
                                  f"reshard the optimizer state")
        names = parameter_names(self.optimizer, module)
        named = {kind: rank_state(module, TrainerCheckpointWeights(load_dir, it, ("optimizer_named", kind)),
                                  names=names) for kind in saved_opt if kind != "step"}
        if steps:  # (no step: saved before the first update, the per-parameter state stays fresh)
            step = next(iter(saved_opt["step"].values()))
            named["step"] = {n: step for n in names}
        load_named_optimizer_state(self.optimizer, module, named)
        return state0
