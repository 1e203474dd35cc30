"""The evaluator: held-out accuracy of the rollout policy on one or several evaluation sets, in one or several rollout
precisions: greedy accuracy, or with n samples per prompt mean@n accuracy and pass@k."""

from __future__ import annotations

import math
from typing import Any, Optional

from megatron_fp4.rl.data import Example
from megatron_fp4.rl.distributed import dp_rank_and_size, dp_sum
from megatron_fp4.rl.rollout_manager import RolloutManager

__all__ = ["Evaluator", "pass_at_k", "pass_ks"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate of one prompt with ``c`` correct of ``n`` samples: 1 - C(n - c, k) / C(n, k)
    (Chen et al. 2021, as slime and verl compute it)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(n: int) -> list[int]:
    """The k of the pass@k metrics logged for ``n`` samples per prompt: 1, 2, 4, ... <= n."""
    return [2 ** i for i in range(int(math.log2(n)) + 1)]


class Evaluator:
    """Scores responses to the evaluation sets; each data-parallel rank takes every dp-th example of each set.

    ``sets`` maps a set name to its examples; the set named "" is the held-out split (--eval-samples or
    --eval-dataset), whose metrics carry no prefix (``accuracy``); the others are --eval-prompt-data's
    (``NAME/accuracy``). ``precisions`` maps a metric name to the rollout precision it is measured in (None: the
    engine's own), e.g. ``{"accuracy": None, "accuracy_bf16": RolloutPrecision("bf16", ...)}``. With
    ``n_samples`` > 1 each prompt gets that many responses sampled at ``temperature``: the accuracy is their mean
    (mean@n) and ``pass@k`` (suffixed like the accuracy, e.g. ``pass@4_bf16``) is logged for k = 1, 2, 4, ... <= n."""

    def __init__(self, rollout: RolloutManager, eval_examples: list[Example],
                 precisions: Optional[dict[str, Any]] = None, sets: Optional[dict[str, list[Example]]] = None,
                 n_samples: int = 1, temperature: Optional[float] = None, max_new_tokens: Optional[int] = None,
                 seed: int = 0, debug_data_path: Optional[str] = None) -> None:
        self.rollout = rollout
        self.sets = {"": list(eval_examples), **(sets or {})} if eval_examples else dict(sets or {})
        self.precisions = precisions or {"accuracy": None}
        self.n_samples, self.temperature, self.max_new_tokens, self.seed = n_samples, temperature, max_new_tokens, seed
        self.debug_data_path = debug_data_path  # --save-debug-rollout-data: every evaluation's samples

    @property
    def examples(self) -> list[Example]:
        """The held-out split's examples (else the first evaluation set's; none without evaluation sets)."""
        return next(iter(self.sets.values()), [])

    def evaluate(self, precisions: Optional[dict[str, Any]] = None, held_out_only: bool = False,
                 rollout_id: Optional[str] = None) -> dict[str, float]:
        """Accuracy (and pass@k) per precision and set, averaged over data parallelism (this rank's share of the
        examples). ``held_out_only``: only the first set (what --sft-target-accuracy checks). ``rollout_id``
        (e.g. ``eval_10``): with --save-debug-rollout-data, the file the evaluation's samples go to (collective)."""
        rank, size = dp_rank_and_size()
        n = self.n_samples
        out = {}
        records: list[dict] = []
        for set_name, examples in list(self.sets.items())[:1 if held_out_only else None]:
            prefix = f"{set_name}/" if set_name else ""
            exs = examples[rank::size]
            for name, prec in (precisions or self.precisions).items():
                samples = self.rollout.generate_eval(exs, prec, n=n, temperature=self.temperature,
                                                     max_new_tokens=self.max_new_tokens,
                                                     seed=self.seed + rank if n > 1 else 0)
                rewards = self.rollout.score(exs, samples, n)
                correct = [r >= 1.0 for r in rewards]
                if self.debug_data_path is not None and rollout_id is not None:
                    from megatron_fp4.rl.debug_data import sample_records

                    prompts = [p for p in self.rollout.prompt_ids(exs) for _ in range(n)]
                    records += sample_records(exs, samples, rewards, prompts, self.rollout.tokenizer, n,
                                              group_offset=rank, group_stride=size, eval_set=set_name,
                                              eval_metric=name)
                out[prefix + name] = dp_sum(sum(correct)) / max(dp_sum(len(exs) * n), 1)
                if n > 1:
                    suffix = name[len("accuracy"):] if name.startswith("accuracy") else f"_{name}"
                    per_prompt = [sum(correct[i * n:(i + 1) * n]) for i in range(len(exs))]
                    for k in pass_ks(n):
                        total = sum(pass_at_k(n, c, k) for c in per_prompt)
                        out[f"{prefix}pass@{k}{suffix}"] = dp_sum(total) / max(dp_sum(len(exs)), 1)
        if self.debug_data_path is not None and rollout_id is not None:
            from megatron_fp4.rl.debug_data import save_debug_rollout_data

            save_debug_rollout_data(self.debug_data_path, rollout_id, records)
        return out
