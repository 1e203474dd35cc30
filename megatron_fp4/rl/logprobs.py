"""Next-token log-probabilities and entropy from vocab-parallel logits, without a full-vocabulary fp32 copy.

With tensor parallelism the output layer leaves each TP rank its shard of the vocabulary (``parallel_output=True``):
logits ``[..., V / TP]`` for the ids ``rank * V / TP`` up to ``(rank + 1) * V / TP`` (megatron-core's
VocabUtility). A log-prob needs the row's max, its sum of exp and the target's logit over the whole vocabulary:
each is a local reduction, then one all-reduce over the TP group (MAX of the maxima; SUM of [sum-exp, target
logit] together), as megatron-core's vocab-parallel cross-entropy. Rows are taken in chunks of at most
:data:`CHUNK_ELEMENTS` logits, so the fp32 temporaries are one chunk's, never ``[tokens, V / TP]``; the logits stay
in their own dtype (bf16 on a GPU).

Backward (:class:`VocabParallelLogProb`): d logp / d logits = onehot(target) - softmax, per chunk from the saved
logits and log-normalizer, written into one gradient buffer in the logits' dtype (the one full-size tensor, which
any backward needs). It has no communication: every TP rank computes the same loss and so gets the same upstream
gradient, and the output layer's backward all-reduces its input gradient.

With one shard (TP = 1) each chunk is ``log_softmax`` of the chunk in fp32 (and its backward ``log_softmax``'s),
bit for bit :func:`megatron_fp4.rl.grpo.token_logprobs` / :func:`~megatron_fp4.rl.grpo.entropy_from_logits`, the
full-vocabulary references; at TP > 1 the results equal them up to fp32 rounding.

On CUDA tensors (``fused=None``: where Triton runs; ``MEGATRON_FP4_FUSED_LOGPROBS=0`` turns it off) the fused
kernels of :mod:`megatron_fp4.kernels.logprobs` replace the chunks: one read of the logits for the per-row statistics
(max, sum of exp, the target's logit and, for the entropy, sum of exp times logit), one read and one write for the
gradient, instead of fp32 copies and a dozen elementwise passes. Same formulas, fp32 accumulation: equal to the
chunked computation up to fp32 summation order (gradients: up to one rounding of the logits' dtype).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["CHUNK_ELEMENTS", "vocab_parallel_logprobs", "vocab_parallel_entropy", "VocabParallelLogProb"]

#: Most logits per chunk: the fp32 temporaries of one chunk are a few times 4 bytes x this (256 MiB each).
CHUNK_ELEMENTS = 1 << 26


def _shards(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """(number of vocabulary shards, this rank's shard) of ``group`` (None: one shard)."""
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _chunks(rows: int, vocab: int, chunk_rows: Optional[int]):
    step = chunk_rows if chunk_rows is not None else max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def _normalizer(x: torch.Tensor, group, chunk_rows, target_local: Optional[torch.Tensor] = None):
    """(row max, log of the row's sum of exp(x - max)) over the whole vocabulary, fp32 [N]; with ``target_local``
    (local column or -1 when another shard holds it) also the target's logit [N]."""
    m = x.amax(dim=-1).to(torch.float32)  # exact in any dtype
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    stats = torch.empty((2 if target_local is not None else 1, x.shape[0]), dtype=torch.float32, device=x.device)
    for c in _chunks(x.shape[0], x.shape[1], chunk_rows):
        stats[0, c] = torch.exp(x[c].to(torch.float32) - m[c, None]).sum(dim=-1)
    if target_local is not None:
        here = target_local >= 0
        picked = x.gather(-1, target_local.clamp(min=0)[:, None]).squeeze(-1).to(torch.float32)
        stats[1] = torch.where(here, picked, torch.zeros((), dtype=torch.float32, device=x.device))
    dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    return m, torch.log(stats[0]), (stats[1] if target_local is not None else None)


def _kernels():
    """:mod:`megatron_fp4.kernels.logprobs` (Triton: imported only where the fused path may run)."""
    from megatron_fp4.kernels import logprobs

    return logprobs


def _use_fused(x: torch.Tensor, fused: Optional[bool]) -> bool:
    """Whether the fused kernels serve ``x``: ``fused`` if given (True where they cannot run is an error), else on
    CUDA where Triton runs, unless ``MEGATRON_FP4_FUSED_LOGPROBS=0``."""
    if fused is None and (not x.is_cuda or os.environ.get("MEGATRON_FP4_FUSED_LOGPROBS", "1") == "0"):
        return False
    if fused is None:
        return _kernels().usable(x)
    if fused and not _kernels().usable(x):
        raise ValueError(f"fused=True: the fused log-prob kernels cannot run on a {x.device.type} tensor here (CUDA "
                         f"with Triton, or Triton's CPU interpreter)")
    return fused


def _fused_stats(x: torch.Tensor, group, world: int, target: Optional[torch.Tensor] = None):
    """(lse, target logit, entropy) per row over the whole vocabulary from the fused row statistics of this shard."""

    def reduce(t, op):
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)

    return _kernels().combine_stats(_kernels().row_stats(x, target), reduce if world > 1 else None)


def _local_targets(target: torch.Tensor, vocab_local: int, rank: int) -> torch.Tensor:
    """Column of each target in this rank's shard, -1 where another shard holds it."""
    t = target.long() - rank * vocab_local
    return torch.where((t >= 0) & (t < vocab_local), t, torch.full_like(t, -1))


class VocabParallelLogProb(torch.autograd.Function):
    """log p(target) [N] of logits [N, V / TP] (this rank's vocabulary shard), chunked over rows; see the module
    docstring."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, chunk_rows: Optional[int],
                fused: bool = False) -> torch.Tensor:
        world, rank = _shards(group)
        n, vocab = logits.shape
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        ctx.group, ctx.chunk_rows, ctx.world, ctx.fused = group, chunk_rows, world, fused
        if fused:
            t = _local_targets(target, vocab, rank) if world > 1 else target.long()
            lse, picked, _ = _fused_stats(logits, group, world, t)
            ctx.save_for_backward(logits, t, lse)
            return picked - lse
        if world == 1:
            t = target.long()
            for c in _chunks(n, vocab, chunk_rows):
                lsm = torch.log_softmax(logits[c].to(torch.float32), dim=-1)
                out[c] = lsm.gather(-1, t[c, None]).squeeze(-1)
            ctx.save_for_backward(logits, t)
            return out
        t = _local_targets(target, vocab, rank)
        m, log_s, picked = _normalizer(logits, group, chunk_rows, t)
        out = (picked - m) - log_s
        ctx.save_for_backward(logits, t, m, log_s)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, t = ctx.saved_tensors[:2]
        if ctx.fused:
            return _kernels().logprob_grad(logits, t, ctx.saved_tensors[2], grad_out), None, None, None, None
        grad = torch.empty_like(logits)
        g = grad_out.to(torch.float32)
        n, vocab = logits.shape
        for c in _chunks(n, vocab, ctx.chunk_rows):
            x = logits[c].to(torch.float32)
            if ctx.world == 1:  # log_softmax's own backward: bit for bit the reference's gradient
                lsm = torch.log_softmax(x, dim=-1)
                go = torch.zeros_like(lsm).scatter_(-1, t[c, None], g[c, None])
                grad[c] = torch._log_softmax_backward_data(go, lsm, -1, torch.float32)
            else:
                m, log_s = ctx.saved_tensors[2:]
                gi = torch.exp((x - m[c, None]) - log_s[c, None]).mul_(-g[c, None])
                tc = t[c]
                here = tc >= 0
                rows = torch.arange(gi.shape[0], device=gi.device)[here]
                gi[rows, tc[here]] += g[c][here]
                grad[c] = gi
        return grad, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor,
                            group: Optional[dist.ProcessGroup] = None,
                            chunk_rows: Optional[int] = None, fused: Optional[bool] = None) -> torch.Tensor:
    """log p(target) (fp32, target's shape) from ``logits [..., V / TP]``, this rank's vocabulary shard over
    ``group`` (None or one rank: the whole vocabulary); differentiable. ``chunk_rows`` rows per chunk (default: as
    many as fit in :data:`CHUNK_ELEMENTS`); ``fused``: the fused kernels (None: on CUDA, see the module doc)."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} must agree on every "
                         f"dimension but the vocabulary")
    flat = logits.reshape(-1, logits.shape[-1])
    return VocabParallelLogProb.apply(flat, target.reshape(-1), group, chunk_rows,
                                      _use_fused(flat, fused)).view(target.shape)


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                           chunk_rows: Optional[int] = None, fused: Optional[bool] = None) -> torch.Tensor:
    """Entropy (fp32, ``logits.shape[:-1]``) of softmax over the whole vocabulary, from this rank's shard
    ``logits [..., V / TP]`` over ``group``; no gradient. -sum p log p, chunked as the log-probs (``fused``: lse -
    sum p x from the fused row statistics, see the module doc)."""
    world, _ = _shards(group)
    flat = logits.detach().reshape(-1, logits.shape[-1])
    if _use_fused(flat, fused):
        return _fused_stats(flat, group, world)[2].view(logits.shape[:-1])
    n, vocab = flat.shape
    out = torch.empty(n, dtype=torch.float32, device=flat.device)
    m = log_s = None
    if world > 1:
        m, log_s, _ = _normalizer(flat, group, chunk_rows)
    for c in _chunks(n, vocab, chunk_rows):
        x = flat[c].to(torch.float32)
        lsm = torch.log_softmax(x, dim=-1) if world == 1 else (x - m[c, None]) - log_s[c, None]
        out[c] = -(lsm.exp() * lsm).sum(dim=-1)
    if world > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out.view(logits.shape[:-1])
