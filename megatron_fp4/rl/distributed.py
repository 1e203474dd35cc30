"""The collectives the GRPO roles share, as free functions over megatron's process groups.

Tensor-parallel peers hold the same values (they generate and score the same samples in lockstep), so scalars are
reduced over data parallelism; loss statistics, known on the last pipeline stage only, are reduced over the
pipeline group first. Each works in a single gloo process too (every group of size one).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from megatron_fp4.parallel import collective_device

__all__ = ["dp_rank_and_size", "dp_sum", "dp_max", "from_last_stage", "from_first_stage", "any_rank",
           "any_on_model_parallel", "reduce_token_stats", "TOKEN_STAT_MAXIMA"]

#: Loss statistics that are maxima over tokens (reduced with MAX, not token-weighted).
TOKEN_STAT_MAXIMA = ("logp_abs_diff_max", "ratio_max")


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def dp_rank_and_size() -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of this process."""
    ps = _ps()
    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def dp_sum(x: float, op=torch.distributed.ReduceOp.SUM) -> float:
    """A per-rank scalar reduced (summed by default) over data parallelism, in float64."""
    t = torch.tensor([x], dtype=torch.float64, device=collective_device())
    torch.distributed.all_reduce(t, op=op, group=_ps().get_data_parallel_group())
    return float(t)


def dp_max(x: float) -> float:
    """The largest per-rank value over data parallelism."""
    return dp_sum(x, op=torch.distributed.ReduceOp.MAX)


def from_last_stage(value: float) -> float:
    """A scalar known on the last pipeline stage, on every rank (averaged over data parallelism)."""
    ps = _ps()
    t = torch.tensor([value if ps.is_pipeline_last_stage() else 0.0], dtype=torch.float64,
                     device=collective_device())
    torch.distributed.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
    torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
    return float(t) / ps.get_data_parallel_world_size()


def from_first_stage(obj: Any) -> Any:
    """``obj`` of the first pipeline stage, on every stage (identity without pipeline parallelism)."""
    ps = _ps()
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_first_rank(),
                                            group=ps.get_pipeline_model_parallel_group())
    return box[0]


def any_rank(flag: bool | torch.Tensor, group=None) -> bool:
    """Whether ``flag`` is true on any rank of ``group`` (default: every rank, so that all stop together)."""
    t = torch.as_tensor(flag, dtype=torch.float32).reshape(1).to(collective_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(t.item())


def any_on_model_parallel(flag: bool) -> bool:
    """Whether ``flag`` is true on this rank or any of its tensor/pipeline-parallel peers."""
    return any_rank(flag, _ps().get_model_parallel_group())


def reduce_token_stats(store: Iterable[dict], maxima: tuple[str, ...] = TOKEN_STAT_MAXIMA) -> dict[str, float]:
    """Token-weighted means of per-micro-batch loss statistics over micro-batches, pipeline stages and data
    parallelism. Each dict holds token-weighted sums and ``num_tokens``; the keys in ``maxima`` are maxima."""
    ps = _ps()
    store = list(store)
    # non-last pipeline stages know no keys: take them from the last stage
    obj = [sorted(store[0].keys()) if store else []]
    torch.distributed.broadcast_object_list(obj, src=ps.get_pipeline_model_parallel_last_rank(),
                                            group=ps.get_pipeline_model_parallel_group())
    keys = obj[0]
    dev = collective_device()
    is_max = torch.tensor([k in maxima for k in keys], dtype=torch.bool, device=dev)
    vals = torch.zeros(len(keys), dtype=torch.float64, device=dev)
    if store:  # one [micro-batches, keys] table (the values may be device tensors): one transfer, not one per value
        table = torch.stack([torch.stack([torch.as_tensor(d[k]).to(dev, torch.float64).reshape(()) for k in keys])
                             for d in store])
        vals = torch.where(is_max, table.amax(0).clamp_min(0.0), table.sum(0))
    for group in (ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group()):
        s = vals.clone()
        torch.distributed.all_reduce(s, group=group)
        mx = vals.clone()
        torch.distributed.all_reduce(mx, op=torch.distributed.ReduceOp.MAX, group=group)
        vals = torch.where(is_max, mx, s)
    out = dict(zip(keys, vals.tolist()))
    n = max(out.pop("num_tokens", 1.0), 1.0)
    return {k: (v if k in maxima else v / n) for k, v in out.items()}
