"""Full-model weights from a pipeline-parallel model, for a rollout engine that needs every layer on every rank.

    full_names = [n for n, _ in rollout_model.named_parameters()]          # a full-depth GPTModel (config PP = 1)
    named = gather_pipeline_parameters(policy_stage, full_names)           # collective over the pipeline group
    engine.update_weights(named)

Each pipeline stage of a megatron-core GPTModel names its parameters with LOCAL layer indices
(``decoder.layers.0`` is the stage's first layer). :func:`gather_pipeline_parameters` renames them to global
indices (megatron's layer offset of the stage) and broadcasts every stage's tensors to all ranks of the pipeline
group (the same tensor-parallel shard: PP peers share their TP rank), as RL frameworks (verl, slime) gather
weights for rollout. :func:`copy_stage_from_full_model` goes the other way without communication (a stage
initialized with the weights of a full model). With tied embeddings, the last stage's ``output_layer.weight``
(megatron's copy of the embedding) has no counterpart in a full model with PP = 1 and is left out / taken from
the embedding.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from megatron_fp4.models.checkpoint_io import to_global_name
from megatron_fp4.parallel import collective_device

__all__ = ["copy_stage_from_full_model", "gather_pipeline_parameters", "stage_layer_offset",
           "stage_named_parameters"]

_TIED_OUTPUT, _EMBEDDING = "output_layer.weight", "embedding.word_embeddings.weight"


def _unwrap(model: Any) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP / Float16Module
        model = model.module
    return model


def stage_layer_offset(model: Any) -> int:
    """Global index of the model's first decoder layer (megatron-core's layer offset for this stage; 0 for a
    model whose config has pipeline_model_parallel_size 1)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    module = _unwrap(model)
    return int(get_transformer_layer_offset(module.config, vp_stage=getattr(module, "vp_stage", None)))


def stage_named_parameters(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The stage's parameters under their global names (``decoder.layers.{offset + i}...``)."""
    module = _unwrap(model)
    offset = stage_layer_offset(module)
    return [(to_global_name(n, offset), p) for n, p in module.named_parameters()]


@torch.no_grad()
def gather_pipeline_parameters(model: Any, full_names: Collection[str] | None = None,
                               group: torch.distributed.ProcessGroup | None = None
                               ) -> list[tuple[str, torch.Tensor]]:
    """Every stage's parameters, global names, on every rank of the pipeline ``group`` (default: megatron's).

    A collective: all ranks of the group call it. ``full_names``: the parameter names of the full model the
    result is for; a stage tensor whose global name is not among them (the tied ``output_layer.weight`` of the
    last stage) is not sent, and a name of ``full_names`` that no stage holds raises KeyError. This rank's own
    tensors are returned as they are (no copy); the others are fresh tensors on the collective device (the
    current GPU under NCCL, the CPU under gloo).
    """
    from megatron.core import parallel_state as ps

    group = group if group is not None else ps.get_pipeline_model_parallel_group()
    keep = None if full_names is None else set(full_names)
    mine = [(n, p.detach()) for n, p in stage_named_parameters(model) if keep is None or n in keep]
    me = torch.distributed.get_rank()
    device = collective_device()
    out: list[tuple[str, torch.Tensor]] = []
    for src in torch.distributed.get_process_group_ranks(group):
        meta = [[(n, tuple(t.shape), t.dtype) for n, t in mine] if src == me else None]
        torch.distributed.broadcast_object_list(meta, src=src, group=group)
        for i, (name, shape, dtype) in enumerate(meta[0]):
            if src == me:
                t = mine[i][1]
                buf = t if (t.device == device and t.is_contiguous()) else t.to(device).contiguous()
            else:
                buf = torch.empty(shape, dtype=dtype, device=device)
            torch.distributed.broadcast(buf, src=src, group=group)
            out.append((name, mine[i][1] if src == me else buf))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"gather_pipeline_parameters: several stages hold {dup[:4]}")
    if keep is not None and keep - set(names):
        raise KeyError(f"gather_pipeline_parameters: no pipeline stage holds {sorted(keep - set(names))[:8]}")
    return out


@torch.no_grad()
def copy_stage_from_full_model(stage_model: Any, full_model: Any) -> int:
    """Copy a full model's weights (same TP shard) into this pipeline stage's parameters (no communication);
    returns the number of tensors copied. The tied ``output_layer.weight`` of a last stage takes the embedding."""
    full = dict(_unwrap(full_model).named_parameters())
    n = 0
    for name, p in stage_named_parameters(stage_model):
        src = full.get(name)
        if src is None and name == _TIED_OUTPUT:
            src = full.get(_EMBEDDING)
        if src is None:
            raise KeyError(f"copy_stage_from_full_model: the full model has no parameter {name!r}")
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"copy_stage_from_full_model: {name} has shape {tuple(src.shape)} in the full model, "
                             f"{tuple(p.shape)} in the stage")
        p.copy_(src)
        n += 1
    return n
