"""The actor: the policy being trained (megatron-core GPTModel in megatron DDP), its optimizer and LR schedule, and
the frozen reference; computes advantages and runs the GRPO loss through megatron's forward/backward schedule.

Megatron's per-token loss accounting (``calculate_per_token_loss``) makes the loss a token-level mean over the
whole global batch, exactly, whatever the micro-batching and data parallelism. With pipeline parallelism the
policy and the reference hold this rank's stage; loss statistics come from the last stage.

A rollout of --rollout-batch-size x G samples feeds rollout x G / --global-batch-size optimizer steps (slime's
meaning of the global batch), each on the next --global-batch-size samples, with the importance ratio taken
against the policy that sampled the rollout. The LR schedule counts optimizer steps: --lr-warmup-iters of linear
warm-up from 0, then cosine decay to --min-lr over the rest (Megatron-LM's schedule).

The policy and the reference output vocab-parallel logits (``parallel_output=True``: each TP rank its vocabulary
shard); log-probs and entropy are computed from the shards over the TP group, chunked over tokens
(:mod:`megatron_fp4.rl.logprobs`), so no rank holds full-vocabulary logits or a [tokens, vocab] fp32 copy.

With --pack-sequences each micro-batch runs as one THD pack (:func:`pack_index`): every sequence's tokens up to its
last loss token, one after another, positions restarting per sequence, and attention kept within each sequence
(``packed_seq_params``; the SDPA core attention, FlashAttention varlen on a GPU), so no compute goes to padding.
Log-probs and entropy are scattered back to the [B, T] grid the loss works on; losses and gradients equal the
padded batch's up to fp32 rounding.
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Any, Callable, Optional

import torch

from megatron_fp4 import ops
from megatron_fp4.rl import grpo
from megatron_fp4.rl.config import ActorConfig
from megatron_fp4.rl.distributed import TOKEN_STAT_MAXIMA, any_rank, dp_sum, from_last_stage, reduce_token_stats
from megatron_fp4.rl.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from megatron_fp4.rl.monitor import NonFiniteGuard
from megatron_fp4.rl.sequences import Sequences

__all__ = ["Actor", "run_schedule", "microbatches", "pad_batch", "lr_schedule", "pack_index"]


def lr_schedule(it: int, *, lr: float, min_lr: Optional[float], warmup_iters: int, total_iters: int) -> float:
    """The learning rate of optimizer step ``it`` (0-based): lr * it / warmup_iters during the warm-up (Megatron-LM's
    linear warm-up from 0), then cosine decay from lr to min_lr over the remaining steps (constant when min_lr is
    None)."""
    if warmup_iters > 0 and it < warmup_iters:
        return lr * it / warmup_iters
    if min_lr is None:
        return lr
    frac = min((it - warmup_iters) / max(total_iters - warmup_iters, 1), 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * frac))


def pack_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Each row's length in a THD pack: its last loss position + 1 (0 for a row without loss tokens)."""
    m = mask.bool()
    return (m * torch.arange(1, m.shape[1] + 1, device=m.device)).amax(dim=1)


def pack_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(rows, columns, cu_seqlens, longest) of the THD pack of a right-padded micro-batch with loss ``mask [B, T]``:
    each row's positions up to its last loss token (rows without one are left out), row after row; cu_seqlens
    (int32) bounds the sequences in the pack."""
    m = mask.bool()
    lengths = pack_lengths(m)
    if int(lengths.sum()) == 0:  # nothing enters the loss: pack one token so that the forward still runs
        lengths[0] = 1
    rows, cols = (torch.arange(m.shape[1], device=m.device)[None, :] < lengths[:, None]).nonzero(as_tuple=True)
    kept = lengths[lengths > 0]
    cu = torch.zeros(kept.numel() + 1, dtype=torch.int32, device=m.device)
    cu[1:] = kept.cumsum(0)
    return rows, cols, cu, int(kept.max())


def _to_device(batch: dict, dev: torch.device) -> dict:
    """A micro-batch's CPU tensors on ``dev``. To a GPU through pinned memory, asynchronously: a copy from pageable
    memory would wait for everything queued on the stream (the previous micro-batch's backward) first."""
    if dev.type != "cuda":
        return {k: v.to(dev) for k, v in batch.items()}
    return {k: v.to(dev) if v.device.type != "cpu" else v.pin_memory().to(dev, non_blocking=True)
            for k, v in batch.items()}


def run_schedule(model, batches: list[dict], loss_fn: Callable, forward_only: bool, pack: bool = False
                 ) -> list[dict]:
    """Megatron's forward(/backward) schedule over micro-batches; returns the last stage's loss dicts. ``pack``: each
    micro-batch as one THD pack of its sequences (:func:`pack_index`; the loss functions read ``batch["pack"]``). The
    FP4 linears quantize each weight once for the whole schedule (``ops.quantized_weight_cache``; under CUDA graphs
    ``ops.refresh_persistent_weights``)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model_chunk):
        batch = next(data_iterator)
        dev = next(model_chunk.parameters()).device  # batches are built on the CPU; the model may be on a GPU
        if pack:
            rows, cols, cu, longest = pack_index(batch["mask"])  # on the CPU: no device sync
            batch = _to_device(batch, dev)
            rows, cols, cu = _to_device({"r": rows, "c": cols, "cu": cu}, dev).values()
            batch["pack"] = (rows, cols)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                     max_seqlen_kv=longest)
            out = model_chunk(batch["inputs"][rows, cols][None], cols[None], None, packed_seq_params=params)
            return out, partial(loss_fn, batch)
        batch = _to_device(batch, dev)
        T = batch["inputs"].shape[1]
        pos = torch.arange(T, device=dev).unsqueeze(0).expand_as(batch["inputs"])
        out = model_chunk(batch["inputs"], pos, None)
        return out, partial(loss_fn, batch)

    fb = get_forward_backward_func()
    if not forward_only:  # the training passes' CUDA graphs read the FP4 weights from buffers: this step's weights
        ops.refresh_persistent_weights()
    # the weights hold still over one schedule: FP4-quantize each once (W and W^T together when dgrad follows)
    with ops.quantized_weight_cache(both_layouts=not forward_only):
        return fb(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                  num_microbatches=len(batches), seq_length=batches[0]["inputs"].shape[1],
                  micro_batch_size=batches[0]["inputs"].shape[0], forward_only=forward_only)


def microbatches(seqs: Sequences, size: int, extra: Optional[dict[str, torch.Tensor]] = None) -> list[dict]:
    """``seqs`` (and per-sequence ``extra`` tensors) cut into micro-batch dicts of ``size`` sequences."""
    return [_microbatch(seqs, slice(start, start + size), extra) for start in range(0, len(seqs), size)]


def microbatches_by_tokens(seqs: Sequences, max_tokens: int, extra: Optional[dict[str, torch.Tensor]] = None
                           ) -> list[dict]:
    """``seqs`` cut into micro-batches of consecutive sequences holding at most ``max_tokens`` tokens as
    :func:`pack_index` packs them (:func:`pack_lengths`; --use-dynamic-batch-size). A sequence
    longer than ``max_tokens`` is an error naming the flag."""
    lengths = pack_lengths(seqs.mask).tolist() if len(seqs) else []
    if lengths and max(lengths) > max_tokens:
        raise ValueError(f"--max-tokens-per-gpu={max_tokens} is less than a sequence of this batch ({max(lengths)} "
                         f"tokens up to its last loss token): raise it to at least the longest prompt + response")
    out, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if used + n > max_tokens:
            out.append(_microbatch(seqs, slice(start, i), extra))
            start, used = i, 0
        used += n
    if start < len(lengths):
        out.append(_microbatch(seqs, slice(start, len(lengths)), extra))
    return out


def _microbatch(seqs: Sequences, sl: slice, extra: Optional[dict[str, torch.Tensor]]) -> dict:
    mb = {"inputs": seqs.inputs[sl], "labels": seqs.labels[sl], "mask": seqs.mask[sl],
          "logp_rollout": seqs.logp_rollout[sl], "advantages": seqs.advantages[sl]}
    for k, v in (extra or {}).items():
        mb[k] = v[sl]
    return mb


def pad_batch(batch: dict, rows: int, cols: int) -> dict:
    """A micro-batch dict padded with zeros to ``rows`` sequences (dim 0 of every tensor) and ``cols`` positions
    (dim 1 of the [B, T] ones): padding token 0, mask 0, so the loss and its statistics are unchanged."""
    out = {}
    for k, v in batch.items():
        if not torch.is_tensor(v) or v.dim() == 0:
            out[k] = v
            continue
        if v.shape[0] > rows or (v.dim() > 1 and v.shape[1] > cols):
            raise ValueError(f"micro-batch {k!r} of shape {tuple(v.shape)} does not fit the fixed shape "
                             f"({rows}, {cols}) (--micro-batch-size, --seq-length)")
        shape = (rows,) + ((cols,) + tuple(v.shape[2:]) if v.dim() > 1 else ())
        padded = v.new_zeros(shape)
        padded[tuple(slice(0, n) for n in v.shape[:2])] = v
        out[k] = padded
    return out


def _tp_group():
    """The tensor-parallel group the output layer splits the vocabulary over (None without parallel_state)."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group() if ps.model_parallel_is_initialized() else None


def _unpack(batch, packed: torch.Tensor) -> torch.Tensor:
    """Values of a THD pack (``[t]``, in ``batch["pack"]``'s order) on the micro-batch's [B, T] grid, 0 elsewhere."""
    rows, cols = batch["pack"]
    grid = torch.zeros(batch["labels"].shape, dtype=packed.dtype, device=packed.device)
    return grid.index_put((rows, cols), packed)


def _logprobs(batch, logits: torch.Tensor) -> torch.Tensor:
    """log p(labels) [B, T] (fp32) from this rank's vocab-parallel logits [B, T, V / TP] (or [1, t, V / TP] of a
    THD pack: 0 at the positions left out of it)."""
    if "pack" not in batch:
        return vocab_parallel_logprobs(logits, batch["labels"], _tp_group())
    rows, cols = batch["pack"]
    return _unpack(batch, vocab_parallel_logprobs(logits[0], batch["labels"][rows, cols], _tp_group()))


def _entropy(batch, logits: torch.Tensor) -> torch.Tensor:
    """Entropy [B, T] (fp32, no gradient) from this rank's vocab-parallel logits, packed or not (as _logprobs)."""
    if "pack" not in batch:
        return vocab_parallel_entropy(logits, _tp_group())
    return _unpack(batch, vocab_parallel_entropy(logits[0], _tp_group()))


def _nll_loss(batch, logits):
    """Cross-entropy of the masked labels (supervised warm-up), summed; megatron divides by the token count."""
    lp = _logprobs(batch, logits)
    m = batch["mask"]
    return -(lp * m).sum(), m.sum().to(torch.int), {"nll_sum": (-(lp * m).sum()).detach(), "tokens": m.sum().detach()}


def _grpo_loss(cfg: grpo.GRPOConfig, batch, logits):
    """The GRPO token loss of one micro-batch (summed) and its token-weighted statistics."""
    lp = _logprobs(batch, logits)
    m = batch["mask"]
    logp_ref = batch.get("logp_ref")
    kw = cfg.loss_kwargs()
    if logp_ref is None:  # no reference model (kl_beta == 0): no KL term
        kw["kl_beta"] = 0.0
    tok = grpo.grpo_token_loss(lp, batch.get("logp_old"), batch["logp_rollout"], batch["advantages"], m,
                               logp_ref=logp_ref, **kw)
    with torch.no_grad():  # tensors, no host sync: reduce_token_stats reads them once per optimizer step
        ent = _entropy(batch, logits)
        mets = grpo.grpo_metric_tensors(lp, batch.get("logp_old"), batch["logp_rollout"], batch["advantages"], m,
                                        logp_ref=logp_ref, entropy=ent, **kw)
        n = mets.pop("num_tokens")
        mets = {k: v if k in TOKEN_STAT_MAXIMA else v * n for k, v in mets.items()}  # means token-weighted
        mets["num_tokens"] = n
    return tok.sum(), m.sum().to(torch.int), mets


class _PhaseClock:
    """Wall time per phase of an update, summed into ``metrics[key]`` by :meth:`lap` (the time since the previous
    lap). On a GPU each lap waits for the device first, so a phase is charged for its own kernels."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.t = time.monotonic()

    def lap(self, metrics: dict, key: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.monotonic()
        metrics[key] = metrics.get(key, 0.0) + now - self.t
        self.t = now


def _combine_stats(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Token-weighted means (maxima: the largest) of several optimizer steps' loss statistics."""
    total = max(sum(n for _, n in parts), 1.0)
    keys = {k for s, _ in parts for k in s}
    return {k: (max(s.get(k, 0.0) for s, _ in parts) if k in TOKEN_STAT_MAXIMA
                else sum(s.get(k, 0.0) * n for s, n in parts) / total) for k in sorted(keys)}


class Actor:
    """Policy + optimizer + reference: ``update(sequences)`` is one GRPO update (``steps_per_rollout`` optimizer
    steps per epoch, ``ppo_epochs`` epochs)."""

    def __init__(self, cfg: ActorConfig, policy, optimizer, reference, *, group_size: int, train_iters: int,
                 max_nonfinite_steps: int, steps_per_rollout: int = 1,
                 fixed_shape: Optional[tuple[int, int]] = None) -> None:
        """``fixed_shape``: (sequences, positions) every training micro-batch is padded to (fully masked rows and
        positions), the one shape CUDA graphs of the training passes replay (``--cuda-graph-impl local``)."""
        self.cfg, self.policy, self.optimizer, self.reference = cfg, policy, optimizer, reference
        self.fixed_shape = fixed_shape
        self.train_iters, self.steps_per_rollout = train_iters, steps_per_rollout
        self.guard = NonFiniteGuard(max_nonfinite_steps)
        self.grpo = grpo.GRPOConfig(
            group_size=group_size, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
            tis_cap=cfg.tis_cap if cfg.tis_cap > 0 else 5.0, use_tis=cfg.tis_cap > 0,
            kl_beta=cfg.kl_beta if cfg.use_kl_loss else 0.0, normalize_std=cfg.advantage in ("grpo", "gspo"),
            ratio_level="sequence" if cfg.advantage == "gspo" else "token", clip_c=cfg.clip_c)

    @property
    def module(self) -> torch.nn.Module:
        """The policy's megatron-core model (unwrapped from DDP)."""
        return self.policy.module

    # -- LR schedule ------------------------------------------------------------------------------------------------
    def lr_at(self, step: int, sub: int = 0) -> float:
        """The LR of optimizer step ``sub`` of GRPO step ``step`` + 1 (:func:`lr_schedule` over the run's
        --train-iters x steps-per-rollout optimizer steps)."""
        c, k = self.cfg, self.steps_per_rollout
        return lr_schedule(step * k + sub, lr=c.lr, min_lr=c.min_lr, warmup_iters=c.lr_warmup_iters,
                           total_iters=self.train_iters * k)

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    # -- one optimizer step -----------------------------------------------------------------------------------------
    def optimizer_step(self) -> tuple[bool, float]:
        """Megatron's optimizer step (gradient clipping included); (applied, grad norm)."""
        ok, grad_norm, _ = self.optimizer.step()
        return ok, float(grad_norm) if grad_norm is not None else float("nan")

    def grads_finite(self) -> bool:
        """Whether every (data-parallel reduced) gradient of every rank is finite: one decision on all ranks. Asked
        of every rank, not only the model-parallel peers: under --use-distributed-optimizer the gradient buffers
        are reduce-scattered, so each data-parallel rank holds only its own range reduced (the rest its local
        gradients) and data-parallel ranks could otherwise disagree, one stepping (a collective) and one not."""
        finite = []
        for p in self.module.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                finite.append(torch.isfinite(g).all())
        bad = bool(finite) and not bool(torch.stack(finite).all())  # one host read, not one per parameter
        return not any_rank(bad)

    def microbatches(self, seqs: Sequences, extra: Optional[dict[str, torch.Tensor]] = None) -> list[dict]:
        """The micro-batches of a pass: by tokens with --use-dynamic-batch-size, else --micro-batch-size sequences."""
        if self.cfg.use_dynamic_batch_size:
            return microbatches_by_tokens(seqs, self.cfg.max_tokens_per_gpu, extra)
        return microbatches(seqs, self.cfg.micro_batch_size, extra)

    def _backward(self, batches: list[dict], loss_fn: Callable) -> list[dict]:
        self.policy.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.fixed_shape is not None:
            batches = [pad_batch(b, *self.fixed_shape) for b in batches]
        return run_schedule(self.policy, batches, loss_fn, forward_only=False, pack=self.cfg.pack_sequences)

    @torch.no_grad()
    def logprobs(self, model, seqs: Sequences) -> Optional[torch.Tensor]:
        """Next-token logprobs [N, T] of the labels under ``model`` (on the last pipeline stage; None elsewhere)."""

        def loss_fn(batch, logits):
            lp = _logprobs(batch, logits)
            return lp.sum() * 0, torch.tensor(1, dtype=torch.int), {"logp": lp}

        store = run_schedule(model, self.microbatches(seqs), loss_fn, forward_only=True,
                             pack=self.cfg.pack_sequences)
        if not store:
            return None
        return torch.cat([d["logp"] for d in store], dim=0)

    # -- the two kinds of update ------------------------------------------------------------------------------------
    def supervised_update(self, seqs: Sequences) -> float:
        """One cross-entropy step on the masked labels; returns the NLL per token (on every rank)."""
        store = self._backward(self.microbatches(seqs), _nll_loss)
        self.optimizer_step()
        nll = sum(float(d["nll_sum"]) for d in store) if store else 0.0
        ntok = sum(float(d["tokens"]) for d in store) if store else 0.0
        return from_last_stage(nll / max(ntok, 1.0))

    def advantages(self, seqs: Sequences) -> torch.Tensor:
        """Per-response group advantages (grpo, gspo: normalized by the group std; drgrpo: not), or REINFORCE++'s
        per-token discounted returns whitened over the global batch (every data-parallel rank's loss tokens)."""
        if self.cfg.advantage != "reinforce_plus_plus":
            return grpo.group_advantages(seqs.rewards, **self.grpo.advantage_kwargs())
        returns = grpo.discounted_returns(seqs.rewards, seqs.mask, self.cfg.gamma)
        moments = torch.tensor([dp_sum(float(v)) for v in grpo.masked_moments(returns, seqs.mask)],
                               dtype=torch.float64)
        return grpo.whiten(returns, seqs.mask, moments)

    def update(self, seqs: Sequences, step: int, last_checkpoint: Optional[str]) -> dict[str, float]:
        """One GRPO update on a rollout batch: advantages, reference/old logprobs, then per epoch (``ppo_epochs``)
        ``steps_per_rollout`` optimizer steps on consecutive shares of the batch (the update stops at a non-finite
        loss or gradient, before the optimizer touches the weights). ``step`` is the step being made, 1-based."""
        seqs.advantages = self.advantages(seqs)
        metrics: dict[str, Any] = {}
        clock = _PhaseClock()
        t0 = time.monotonic()
        extra = {}
        if self.reference is not None and self.grpo.kl_beta > 0:
            extra["logp_ref"] = self.logprobs(self.reference, seqs)
            clock.lap(metrics, "train/ref_logprobs_s")
        k = self.steps_per_rollout
        if self.cfg.ppo_epochs > 1 or k > 1:  # the ratio is taken against the policy that sampled the rollout
            extra["logp_old"] = self.logprobs(self.policy, seqs)
            clock.lap(metrics, "train/old_logprobs_s")
        extra = {name: v for name, v in extra.items() if v is not None}
        loss_fn = partial(_grpo_loss, self.grpo)
        stats: dict[str, float] = {}
        share = len(seqs) // k
        done = []  # (epoch, statistics, loss tokens, grad norm) of every optimizer step taken
        for epoch in range(self.cfg.ppo_epochs):
            for i in range(k):
                part, part_extra = seqs, extra
                if k > 1:
                    sl = slice(i * share, (i + 1) * share)
                    part, part_extra = seqs.select(sl), {name: v[sl] for name, v in extra.items()}
                    if dp_sum(float(part.mask.sum())) == 0:  # every sample of this share filtered out
                        continue
                    self.set_lr(self.lr_at(step - 1, i))
                stats = reduce_token_stats(self._backward(self.microbatches(part, part_extra),
                                                          loss_fn))
                clock.lap(metrics, "train/forward_backward_s")
                # one decision per optimizer step, before the optimizer touches the weights
                grads_ok = self.grads_finite()
                if self.guard.should_skip(step, stats.get("loss", 0.0), 0.0 if grads_ok else float("nan"),
                                          last_checkpoint):
                    metrics["skipped"] = 1.0
                    break
                _, grad_norm = self.optimizer_step()
                clock.lap(metrics, "train/optimizer_s")
                done.append((epoch, stats, dp_sum(float(part.mask.sum())) if k > 1 else 0.0, grad_norm))
            if "skipped" in metrics:
                break
        last = [d for d in done if d[0] == done[-1][0]] if done else []
        if k == 1 and done:
            metrics["grad_norm"] = done[-1][3]
        elif last:  # the last epoch's optimizer steps: mean grad norm, token-weighted statistics
            metrics["grad_norm"] = sum(d[3] for d in last) / len(last)
            if "skipped" not in metrics:
                stats = _combine_stats([(d[1], d[2]) for d in last])
        if k > 1:
            metrics["optimizer_steps"] = float(len(done))
        t_train = time.monotonic() - t0
        metrics.update(stats)
        metrics["train_tokens_per_s"] = seqs.num_tokens * self.cfg.ppo_epochs / max(t_train, 1e-9)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def copy_policy_to_reference(self) -> None:
        """The reference becomes a frozen copy of the policy's current weights (the warm start)."""
        if self.reference is not None:
            self.reference.load_state_dict(self.module.state_dict())

    def reload_main_params(self) -> None:
        """Refresh the optimizer's main (fp32) copies from the model weights after loading them."""
        self.optimizer.reload_model_params()
