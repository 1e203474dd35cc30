"""Optimizer state by parameter name: saved with each trainer checkpoint, so that a run can resume at another
tensor/pipeline/data-parallel layout, and with or without the distributed optimizer.

A megatron-core optimizer's own ``state_dict()`` keys Adam's moments by position in its parameter groups, which
means nothing under another layout. :func:`named_optimizer_state` stores, for every parameter of this rank's
model under its stage-local name (the names of the model's state dict): each per-parameter state tensor (Adam's
``exp_avg``, ``exp_avg_sq``), the fp32 main copy that mixed-precision training steps (``main``), and the step
count. These dicts have exactly the shape of a model state dict, so the trainer reshards them with the same
machinery as the weights (:class:`megatron_fp4.rl.checkpoint_weights.TrainerCheckpointWeights`,
:func:`megatron_fp4.models.checkpoint_io.rank_state`) and :func:`load_named_optimizer_state` puts them back.

Under megatron-core's distributed optimizer (``--use-distributed-optimizer``, ZeRO-1) each data-parallel rank
steps only its contiguous range of the flattened gradient buffer: a shard of some parameters' main copies and
Adam moments (``DistributedOptimizer._get_model_param_range_map``). :func:`named_optimizer_state` then gathers
every parameter's whole tensors across the distributed optimizer's data-parallel group (each rank writes its range
into zeros, one all-reduce sums the disjoint ranges: exact), so the saved dicts are the same as without it; and
:func:`load_named_optimizer_state` copies each rank's range back out of the whole tensors. A checkpoint thus
resumes with the distributed optimizer on or off and at any data-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["named_optimizer_state", "load_named_optimizer_state", "parameter_names", "uses_distributed_optimizer"]

STEP = "step"
MAIN = "main"


def _sub_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _is_distributed(sub: Any) -> bool:
    """Whether ``sub`` is megatron-core's DistributedOptimizer (state sharded over data-parallel ranks)."""
    try:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    except ImportError:  # megatron-core absent: plain torch optimizers only
        return False
    return isinstance(sub, DistributedOptimizer)


def uses_distributed_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or one of a chained optimizer's parts) shards its state over data-parallel ranks."""
    return any(_is_distributed(sub) for sub in _sub_optimizers(optimizer))


@dataclass
class _Slot:
    """One optimized parameter: its stage-local name, the model parameter, and either the tensor the optimizer
    steps (``main``: its fp32 main copy under mixed precision, else the parameter itself) with the torch optimizer
    holding its state, or (``dist``) the distributed optimizer that steps a range of it."""

    name: str
    param: torch.nn.Parameter
    main: Optional[torch.Tensor] = None
    opt: Optional[torch.optim.Optimizer] = None
    dist: Any = None


def _slots(optimizer: Any, module: torch.nn.Module) -> list[_Slot]:
    """Every optimized parameter of ``module``, in the module's order."""
    owner, dist_of = {}, {}
    for sub in _sub_optimizers(optimizer):
        if _is_distributed(sub):
            if getattr(sub, "is_stub_optimizer", False):
                continue
            if sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                raise NotImplementedError("optimizer state by name: the precision-aware distributed optimizer (state "
                                          "held inside FusedAdam) is not supported")
            for buf in sub.buffers:  # every parameter of its buffers, whether or not this rank steps a range of it
                dist_of.update({id(p): sub for p in buf.param_index_map})
        else:
            opt = getattr(sub, "optimizer", sub)
            owner.update({id(p): opt for g in opt.param_groups for p in g["params"]})
    out = []
    for name, p in module.named_parameters():
        if id(p) in dist_of:
            out.append(_Slot(name, p, dist=dist_of[id(p)]))
            continue
        main = getattr(p, "main_param", p)
        if id(main) in owner:
            out.append(_Slot(name, p, main, owner[id(main)]))
    return out


def parameter_names(optimizer: Any, module: torch.nn.Module) -> list[str]:
    """The stage-local names of the parameters ``optimizer`` steps (under the distributed optimizer: all of them,
    also those of which this rank steps no range: it needs whole tensors to cut its range from)."""
    return [s.name for s in _slots(optimizer, module)]


def _local_range(slot: _Slot) -> Optional[tuple[int, int, dict]]:
    """(start, end) of the flattened parameter that this rank steps under the distributed optimizer, with its main
    shard and Adam state ({"param": main shard, "exp_avg": ..., "step": ...}); None when it steps none of it."""
    d, p = slot.dist, slot.param
    if p not in d.model_param_gbuf_map:
        return None
    r = d._get_model_param_range_map(p)["param"]
    return r.start, r.end, d._get_main_param_and_optimizer_states(p)


def _has_own_main(p: torch.nn.Parameter) -> bool:
    """Whether the distributed optimizer keeps an fp32 main copy of ``p`` (bf16/fp16 parameters); for fp32
    parameters it steps a view of the parameter itself, so there is no separate main copy to save. Decided by the
    dtype, the same on every rank (``p.main_param`` is set only where this rank steps a range of ``p``)."""
    return p.dtype in (torch.float16, torch.bfloat16)


def _gather_distributed(slots: list[_Slot], out: dict[str, dict[str, torch.Tensor]]) -> None:
    """Whole main copies and Adam state of the distributed optimizer's parameters (collective over each
    distributed optimizer's data-parallel group; every rank gets the whole tensors)."""
    for d in {id(s.dist): s.dist for s in slots}.values():
        mine = [s for s in slots if s.dist is d]
        group = d.data_parallel_group
        local = {s.name: _local_range(s) for s in mine}
        kinds, step = set(), torch.full((), -1.0)  # -1: no per-parameter step count on this rank
        for rng in local.values():
            if rng is not None:
                kinds |= {k for k, v in rng[2].items() if k not in ("param", STEP) and isinstance(v, torch.Tensor)}
                if STEP in rng[2]:
                    step = torch.maximum(step, torch.as_tensor(rng[2][STEP], dtype=torch.float32).cpu())
        every = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(every, sorted(kinds), group=group)
        kinds = sorted(set().union(*map(set, every)))
        from megatron_fp4.parallel.cpu_compat import collective_device

        dev = collective_device()
        step = step.to(dev)
        torch.distributed.all_reduce(step, op=torch.distributed.ReduceOp.MAX, group=group)
        stepped = float(step) >= 0  # a step was taken (Adam's state exists on every rank that steps a range)
        for s in mine:
            names = ([MAIN] if _has_own_main(s.param) else []) + kinds
            if not names:
                continue
            whole = torch.zeros(len(names), s.param.numel(), dtype=torch.float32, device=dev)
            rng = local[s.name]
            if rng is not None:
                start, end, tensors = rng
                for i, kind in enumerate(names):
                    whole[i, start:end] = tensors["param" if kind == MAIN else kind].detach().reshape(-1)
            torch.distributed.all_reduce(whole, group=group)  # the ranges are disjoint and cover the parameter
            for i, kind in enumerate(names):  # to the CPU at once: the device holds one parameter's whole state
                out.setdefault(kind, {})[s.name] = whole[i].view(s.param.shape).to("cpu", copy=True)
            if stepped:
                out.setdefault(STEP, {})[s.name] = step.detach().cpu().clone()


def named_optimizer_state(optimizer: Any, module: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """``{kind: {local parameter name: tensor}}`` of this rank: every per-parameter state tensor (``exp_avg``,
    ``exp_avg_sq``), ``main`` (the fp32 copies, mixed precision only) and ``step`` (0-d tensors). Whole tensors
    also under the distributed optimizer (then a collective: every rank of its data-parallel group calls it; the
    gathered tensors are on the CPU)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    slots = _slots(optimizer, module)
    for s in slots:
        if s.dist is not None:
            continue
        for kind, value in s.opt.state.get(s.main, {}).items():
            if isinstance(value, torch.Tensor):
                out.setdefault(kind, {})[s.name] = value
        if s.main is not s.param:
            out.setdefault(MAIN, {})[s.name] = s.main.detach()
    sharded = [s for s in slots if s.dist is not None]
    if sharded:
        _gather_distributed(sharded, out)
    # the module's parameter order within each kind, whichever optimizer stepped the parameter
    order = {s.name: i for i, s in enumerate(slots)}
    return {kind: dict(sorted(d.items(), key=lambda kv: order[kv[0]])) for kind, d in out.items()}


def load_named_optimizer_state(optimizer: Any, module: torch.nn.Module,
                               state: dict[str, dict[str, torch.Tensor]]) -> int:
    """Put :func:`named_optimizer_state`'s dicts (this rank's tensors, e.g. resharded) back into ``optimizer``
    (copies): the fp32 main copies wherever saved (also before the first step: the optimizer steps them, not the
    model's bf16 weights), the per-parameter state where a step was saved (else it stays fresh). Under the
    distributed optimizer each rank takes its range of the whole tensors. Returns how many parameters (ranges of
    them under the distributed optimizer) got per-parameter state."""
    loaded = 0
    for s in _slots(optimizer, module):
        if s.dist is None:
            main, opt = s.main, s.opt

            def part(t: torch.Tensor) -> torch.Tensor:
                return t
        else:
            rng = _local_range(s)
            if rng is None:  # this rank steps no range of it
                continue
            start, end, tensors = rng
            main, opt = tensors["param"], s.dist.optimizer

            def part(t: torch.Tensor, start=start, end=end) -> torch.Tensor:
                return t.reshape(-1)[start:end]
        own_main = main is not s.param if s.dist is None else _has_own_main(s.param)
        if own_main and s.name in state.get(MAIN, {}):
            main.data.copy_(part(state[MAIN][s.name]))
        if s.name not in state.get(STEP, {}):
            continue
        slot = opt.state[main]
        for kind, tensors in state.items():
            if kind == MAIN:
                continue
            t = tensors[s.name]
            slot[kind] = t.clone() if kind == STEP else part(t).to(device=main.device, dtype=main.dtype).clone()
        loaded += 1
    return loaded
