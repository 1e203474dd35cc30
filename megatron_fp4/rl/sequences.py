"""The batch that flows from the rollout manager to the actor: prompt+response sequences on the next-token grid."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["Sequences", "pack_sequences"]


@dataclass
class Sequences:
    """A right-padded batch of prompt+response sequences (inputs predict labels), groups of G contiguous."""

    inputs: torch.Tensor        # [N, T] token ids fed to the model
    labels: torch.Tensor        # [N, T] the next token at each position
    mask: torch.Tensor          # [N, T] 1.0 where the label is a response token that enters the loss
    logp_rollout: torch.Tensor  # [N, T] rollout engine logprobs of the labels (0 outside the responses)
    rewards: torch.Tensor       # [N] per-response reward
    advantages: torch.Tensor    # [N] per-response (or [N, T] per-token) advantage, computed by the actor
    num_tokens: float = 0.0     # loss tokens of the whole global batch (all data-parallel ranks)

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def select(self, index: slice) -> "Sequences":
        """The sequences ``index`` (e.g. one optimizer step's share of a rollout); ``num_tokens`` is kept."""
        return Sequences(self.inputs[index], self.labels[index], self.mask[index], self.logp_rollout[index],
                         self.rewards[index], self.advantages[index], self.num_tokens)


def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                   rollout_logprobs: Sequence[Sequence[float]], rewards: torch.Tensor, pad_id: int,
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
    rewards = rewards.to(torch.float32)
    return Sequences(inputs, labels, mask, lp, rewards, torch.zeros_like(rewards))
