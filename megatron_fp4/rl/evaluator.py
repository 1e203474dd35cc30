"""The evaluator: greedy held-out accuracy of the rollout policy, in one or several rollout precisions."""

from __future__ import annotations

from typing import Any, Optional

from megatron_fp4.rl.data import Example
from megatron_fp4.rl.distributed import dp_rank_and_size, dp_sum
from megatron_fp4.rl.rewards import score
from megatron_fp4.rl.rollout_manager import RolloutManager

__all__ = ["Evaluator"]


class Evaluator:
    """Scores greedy responses to the held-out examples; each data-parallel rank takes every dp-th example.

    ``precisions`` maps a metric name to the rollout precision it is measured in (None: the engine's own), e.g.
    ``{"accuracy": None, "accuracy_bf16": RolloutPrecision("bf16", ...)}``."""

    def __init__(self, rollout: RolloutManager, eval_examples: list[Example],
                 precisions: Optional[dict[str, Any]] = None) -> None:
        self.rollout, self.examples = rollout, eval_examples
        self.precisions = precisions or {"accuracy": None}

    def evaluate(self, precisions: Optional[dict[str, Any]] = None) -> dict[str, float]:
        """Greedy accuracy per precision, averaged over data parallelism (this rank's share of the examples)."""
        rank, size = dp_rank_and_size()
        exs = self.examples[rank::size]
        out = {}
        for name, prec in (precisions or self.precisions).items():
            samples = self.rollout.generate_greedy(exs, prec)
            correct = sum(score(self.rollout.tokenizer.decode(s.token_ids), e.reference, e.kind)
                          for s, e in zip(samples, exs))
            out[name] = dp_sum(correct) / max(dp_sum(len(exs)), 1)
        return out
