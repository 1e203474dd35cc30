"""Optimizer state by parameter name: saved with each trainer checkpoint, so that a run can resume at another
tensor/pipeline-parallel layout.

A megatron-core optimizer's own ``state_dict()`` keys Adam's moments by position in its parameter groups, which
means nothing under another layout. :func:`named_optimizer_state` stores, for every parameter of this rank's
model under its stage-local name (the names of the model's state dict): each per-parameter state tensor (Adam's
``exp_avg``, ``exp_avg_sq``), the fp32 main copy that mixed-precision training steps (``main``), and the step
count. These dicts have exactly the shape of a model state dict, so the trainer reshards them with the same
machinery as the weights (:class:`megatron_fp4.rl.checkpoint_weights.TrainerCheckpointWeights`,
:func:`megatron_fp4.models.checkpoint_io.rank_state`) and :func:`load_named_optimizer_state` puts them back.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["named_optimizer_state", "load_named_optimizer_state", "parameter_names"]

STEP = "step"
MAIN = "main"


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [getattr(s, "optimizer", s) for s in subs]


def _slots(optimizer: Any, module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, torch.Tensor, Any]]:
    """(stage-local name, model parameter, the tensor the optimizer steps (its fp32 main copy under mixed
    precision, else the parameter itself), the torch optimizer that holds its state) for every optimized
    parameter of ``module``."""
    owner = {id(p): opt for opt in _torch_optimizers(optimizer) for g in opt.param_groups for p in g["params"]}
    out = []
    for name, p in module.named_parameters():
        main = getattr(p, "main_param", p)
        if id(main) in owner:
            out.append((name, p, main, owner[id(main)]))
    return out


def parameter_names(optimizer: Any, module: torch.nn.Module) -> list[str]:
    """The stage-local names of the parameters ``optimizer`` steps."""
    return [name for name, *_ in _slots(optimizer, module)]


def named_optimizer_state(optimizer: Any, module: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """``{kind: {local parameter name: tensor}}`` of this rank: every per-parameter state tensor (``exp_avg``,
    ``exp_avg_sq``), ``main`` (the fp32 copies, mixed precision only) and ``step`` (0-d tensors)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p, main, opt in _slots(optimizer, module):
        for kind, value in opt.state.get(main, {}).items():
            if isinstance(value, torch.Tensor):
                out.setdefault(kind, {})[name] = value
        if main is not p:
            out.setdefault(MAIN, {})[name] = main.detach()
    return out


def load_named_optimizer_state(optimizer: Any, module: torch.nn.Module,
                               state: dict[str, dict[str, torch.Tensor]]) -> int:
    """Put :func:`named_optimizer_state`'s dicts (this rank's tensors, e.g. resharded) back into ``optimizer``
    (copies): the fp32 main copies wherever saved (also before the first step: the optimizer steps them, not the
    model's bf16 weights), the per-parameter state where a step was saved (else it stays fresh). Returns how many
    parameters got per-parameter state."""
    loaded = 0
    for name, p, main, opt in _slots(optimizer, module):
        if main is not p and name in state.get(MAIN, {}):
            main.data.copy_(state[MAIN][name])
        if name not in state.get(STEP, {}):
            continue
        slot = opt.state[main]
        for kind, tensors in state.items():
            if kind == MAIN:
                continue
            t = tensors[name]
            slot[kind] = t.clone() if kind == STEP else t.to(device=main.device, dtype=main.dtype).clone()
        loaded += 1
    return loaded
