"""Token sampling from logits: temperature, top-k, top-p; logprobs of the chosen tokens."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_fp4.rollout.base import SamplingParams

__all__ = ["sample_tokens", "filter_logits", "token_logprobs"]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) at ``tokens`` (fp32; T = 1 when temperature is 0): ``[..., V]`` -> ``[...]``."""
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / t, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _top_k_applies(top_k: int, vocab: int) -> bool:
    return bool(top_k) and 0 < top_k < vocab


def filters(top_k: int, top_p: float, vocab: int) -> bool:
    """Whether :func:`filter_logits` changes anything over ``vocab`` tokens with these settings."""
    return _top_k_applies(top_k, vocab) or top_p < 1.0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k / top-p (nucleus) set to -inf; the most likely token always survives."""
    if _top_k_applies(top_k, logits.shape[-1]):
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of fp32 ``logits [B, V]``; returns (tokens [B], logprobs [B]) (see
    :class:`~megatron_fp4.rollout.base.RolloutSample` for which distribution the logprob refers to)."""
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p)
        probs = torch.softmax(scaled, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, token_logprobs(logits, tokens, params.temperature)
