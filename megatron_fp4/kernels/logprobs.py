"""Fused next-token log-probabilities and entropy over a vocabulary (shard), one read of the logits per pass.

The RL loss needs, per token row of logits ``x [N, V]`` (bf16 on a GPU, V ~ 150k): log p(target) = x[t] - lse(x),
its gradient g (onehot(t) - softmax(x)), and the entropy lse(x) - sum softmax(x) x. PyTorch computes each from fp32
copies of the logits (a cast, log_softmax, exp, products, sums: ~10 full passes over [N, V] per step; about a fifth
of a BF16 training step of the Qwen2.5-1.5B shape on the H200, docs/PERFORMANCE.md). Here:

- :func:`row_stats` reads each row once (online max / rescaled sums, fp32 accumulation) and returns, per row, the
  max ``m``, ``s = sum exp(x - m)``, ``w = sum exp(x - m) x`` and the target's logit (0 where ``target < 0``: another
  vocabulary shard holds it). Shards combine them exactly as one row would (:func:`combine_stats`).
- :func:`logprob_grad` writes ``g (onehot(t) - exp(x - lse))`` in the logits' dtype, reading the logits once.

PyTorch twins (what CPU runs and the tests compare with): :func:`row_stats_reference`,
:func:`logprob_grad_reference`. The results equal ``torch.log_softmax`` in fp32 up to fp32 summation order (not
bit for bit); ``megatron_fp4.rl.logprobs`` uses them on CUDA tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_fp4.kernels._common import HAS_TRITON, cdiv, interpreting, kernels_usable, tl, triton

__all__ = ["row_stats", "row_stats_reference", "combine_stats", "logprob_grad", "logprob_grad_reference",
           "usable"]

#: Vocabulary elements per program step (a power of two).
BLOCK_V = 2048

if HAS_TRITON:

    @triton.jit
    def _row_stats_kernel(X, T, OUT, stride_x, V, HAS_T: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        row = X + r * stride_x
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        w = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            ok = idx < V
            x = tl.load(row + idx, mask=ok, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, x, propagate_nan=tl.PropagateNan.ALL)
            # lanes still at -inf keep their (zero) sums; exp(-inf - -inf) would be NaN
            scale = tl.where(m_new == -float("inf"), 1.0, tl.exp(m - m_new))
            e = tl.where(m_new == -float("inf"), 0.0, tl.exp(x - m_new))
            s = s * scale + e
            w = w * scale + e * tl.where(e > 0, x, 0.0)
            m = m_new
        mx = tl.max(m, axis=0)
        f = tl.where(m == -float("inf"), 0.0, tl.exp(m - mx))
        tl.store(OUT + r * 4 + 0, mx)
        tl.store(OUT + r * 4 + 1, tl.sum(s * f, axis=0))
        tl.store(OUT + r * 4 + 2, tl.sum(w * f, axis=0))
        if HAS_T:
            t = tl.load(T + r)
            here = (t >= 0) & (t < V)
            picked = tl.load(row + tl.where(here, t, 0)).to(tl.float32)
            tl.store(OUT + r * 4 + 3, tl.where(here, picked, 0.0))
        else:
            tl.store(OUT + r * 4 + 3, 0.0)

    @triton.jit
    def _logprob_grad_kernel(X, T, LSE, G, DX, stride_x, stride_d, V, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = idx < V
        x = tl.load(X + r * stride_x + idx, mask=ok, other=0.0).to(tl.float32)
        lse = tl.load(LSE + r)
        g = tl.load(G + r)
        t = tl.load(T + r)
        p = tl.exp(x - lse)
        d = g * (tl.where(idx == t, 1.0, 0.0) - p)
        tl.store(DX + r * stride_d + idx, d.to(DX.dtype.element_ty), mask=ok)


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels can run on ``x`` (a CUDA tensor with Triton, or a CPU tensor under Triton's
    interpreter)."""
    return kernels_usable(x)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def row_stats(x: torch.Tensor, target: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 ``[N, 4]``: per row of ``x [N, V]`` its max m, sum exp(x - m), sum exp(x - m) x, and x[target] (0 where
    ``target`` is negative or absent). One read of ``x``."""
    x = _rows(x)
    n, v = x.shape
    out = torch.empty((n, 4), dtype=torch.float32, device=x.device)
    if n == 0:
        return out
    t = target.reshape(-1).to(torch.int64).contiguous() if target is not None else out
    _row_stats_kernel[(n,)](x, t, out, x.stride(0), v, HAS_T=target is not None, BLOCK=BLOCK_V,
                            **({} if interpreting() else {"num_warps": 8}))
    return out


def row_stats_reference(x: torch.Tensor, target: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`row_stats` in PyTorch (fp32)."""
    xf = x.to(torch.float32)
    m = xf.amax(-1)
    e = torch.exp(xf - m[:, None])
    picked = torch.zeros_like(m)
    if target is not None:
        t = target.reshape(-1).long()
        here = (t >= 0) & (t < x.shape[1])
        picked = torch.where(here, xf.gather(-1, t.clamp(0, x.shape[1] - 1)[:, None]).squeeze(-1), picked)
    return torch.stack([m, e.sum(-1), (e * torch.where(e > 0, xf, 0.0)).sum(-1), picked], dim=-1)


def combine_stats(stats: torch.Tensor, all_reduce=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, the target's logit, entropy) per row, fp32, from :func:`row_stats` of this shard; ``all_reduce(t, op)``
    (``"max"`` or ``"sum"``, in place) combines the shards (None: one shard holds the whole vocabulary)."""
    m = stats[:, 0].clone()
    if all_reduce is not None:
        all_reduce(m, "max")
    f = torch.where(stats[:, 0] == -float("inf"), torch.zeros_like(m), torch.exp(stats[:, 0] - m))
    sums = torch.stack([stats[:, 1] * f, stats[:, 2] * f, stats[:, 3]])
    if all_reduce is not None:
        all_reduce(sums, "sum")
    s, w, picked = sums
    lse = m + torch.log(s)
    return lse, picked, lse - w / s


def logprob_grad(x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """``grad_out[r] (onehot(target[r]) - exp(x[r] - lse[r]))`` in ``x``'s dtype and shape (targets outside
    [0, V): no one-hot term). One read of ``x``."""
    x = _rows(x)
    n, v = x.shape
    dx = torch.empty_like(x)
    if n == 0:
        return dx
    t = target.reshape(-1).to(torch.int64).contiguous()
    _logprob_grad_kernel[(n, cdiv(v, BLOCK_V))](x, t, lse.to(torch.float32).contiguous(),
                                                grad_out.to(torch.float32).contiguous(), dx, x.stride(0),
                                                dx.stride(0), v, BLOCK=BLOCK_V,
                                                **({} if interpreting() else {"num_warps": 8}))
    return dx


def logprob_grad_reference(x, target, lse, grad_out) -> torch.Tensor:
    """:func:`logprob_grad` in PyTorch (fp32, rounded once to ``x``'s dtype)."""
    xf = x.to(torch.float32)
    d = -torch.exp(xf - lse[:, None].float())
    t = target.reshape(-1).long()
    here = (t >= 0) & (t < x.shape[1])
    rows = torch.arange(x.shape[0], device=x.device)[here]
    d[rows, t[here]] += 1.0
    return (d * grad_out.float()[:, None]).to(x.dtype)
