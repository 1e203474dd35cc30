"""slime's ``--save-debug-rollout-data PATH``: every rollout's samples, and every evaluation's, as a file.

``PATH`` holds ``{rollout_id}``, replaced by the GRPO step's rollout index (0 for the first rollout) or, for an
evaluation, by ``eval_N`` (the evaluation after N GRPO steps; ``eval_0``: before training). Each file is what slime
writes, ``torch.save({"rollout_id": ..., "samples": [dict, ...]})``, with slime's ``Sample.to_dict`` key names
(``group_index``, ``index``, ``prompt``, ``tokens`` = prompt + response ids, ``response``, ``response_length``,
``label``, ``reward``, ``status``, ``metadata``, ``rollout_log_probs``); evaluation samples also name their
evaluation set (``eval_set``: --eval-prompt-data's NAME, "" for the held-out split) and the accuracy metric they
were scored for (``eval_metric``: ``accuracy`` in the rollout precision, ``accuracy_bf16`` in BF16). Only plain
Python values: ``torch.load(path, weights_only=True)`` reads it. Rank 0 writes the samples of all data-parallel
ranks (gathered); training rollouts hold the samples of the batch trained on.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch

from megatron_fp4.rl.data import Example
from megatron_fp4.rollout import RolloutSample

__all__ = ["ROLLOUT_ID", "check_template", "sample_records", "save_debug_rollout_data"]

ROLLOUT_ID = "{rollout_id}"


def check_template(path: Optional[str]) -> None:
    """ValueError naming --save-debug-rollout-data unless ``path`` is None or holds ``{rollout_id}``."""
    if path is not None and ROLLOUT_ID not in path:
        raise ValueError(f"--save-debug-rollout-data={path!r} must contain {ROLLOUT_ID} (replaced by the rollout "
                         f"index, or eval_N for the evaluation after N steps), e.g. runs/x/debug/{ROLLOUT_ID}.pt")


def sample_records(examples: Sequence[Example], samples: Sequence[RolloutSample], rewards: Sequence[float],
                   prompt_ids: Sequence[Sequence[int]], tokenizer: Any, group_size: int = 1,
                   group_offset: int = 0, group_stride: int = 1, **extra: Any) -> list[dict]:
    """One dict per sample (``group_size`` contiguous samples per example), slime's keys, plus ``extra``. The
    k-th example's samples get ``group_index`` = group_offset + k * group_stride (its index in the whole batch or
    evaluation set when this rank holds a share of it)."""
    out = []
    for i, (s, ids, r) in enumerate(zip(samples, prompt_ids, rewards)):
        e = examples[i // group_size]
        out.append({"group_index": group_offset + (i // group_size) * group_stride, "index": i, "prompt": e.prompt,
                    "tokens": [int(t) for t in ids] + [int(t) for t in s.token_ids],
                    "response": tokenizer.decode(s.token_ids), "response_length": len(s.token_ids),
                    "label": e.reference if e.label is None else e.label, "reward": float(r),
                    "status": "truncated" if s.finish_reason == "length" else "completed",
                    "metadata": dict(e.metadata or {}), "rollout_log_probs": [float(x) for x in s.logprobs],
                    **extra})
    return out


def save_debug_rollout_data(template: Optional[str], rollout_id: int | str, records: list[dict]) -> Optional[str]:
    """Gather ``records`` over data parallelism and write them on rank 0 (collective over the data-parallel group;
    every rank calls it). Returns the path written on rank 0, else None. The gathered samples are ordered by
    evaluation set and metric (in the order they come), then ``group_index``; ``index`` numbers them in that order."""
    if template is None:
        return None
    from megatron.core import parallel_state as ps

    gathered: list = [None] * ps.get_data_parallel_world_size()
    torch.distributed.all_gather_object(gathered, records, group=ps.get_data_parallel_group())
    if torch.distributed.get_rank() != 0:
        return None
    merged = [r for part in gathered for r in part]
    blocks: dict[tuple, int] = {}
    for r in merged:
        blocks.setdefault((r.get("eval_set"), r.get("eval_metric")), len(blocks))
    merged.sort(key=lambda r: (blocks[(r.get("eval_set"), r.get("eval_metric"))], r["group_index"]))
    samples = [{**r, "index": i} for i, r in enumerate(merged)]
    path = template.format(rollout_id=rollout_id)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save({"rollout_id": rollout_id, "samples": samples}, path)
    return path
