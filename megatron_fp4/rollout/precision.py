"""Rollout precision on a megatron-core model: swap the transformer-layer linears to their rollout form.

    with rollout_precision(model, RolloutPrecision("w4a4", "hif4", "2:4")):
        logits = model(input_ids, position_ids, None)     # every linear_qkv/proj/fc1/fc2 computes W4A4 + ResQ

The swap changes the *class* of each megatron-core ``ColumnParallelLinear`` / ``RowParallelLinear`` inside the
model (the FP4 ones of ``megatron_fp4.parallel`` included; the output head is left alone) to a subclass whose
``_forward_impl`` (megatron's local-GEMM hook) computes :func:`megatron_fp4.resq.rollout_linear`; parameters,
names and communication stay megatron-core's, and leaving the context restores the original classes. The
training recipe (``config.fp4_recipe`` / ``fp4_autocast``) is ignored by swapped layers: rollout precision is
configured independently of training. "bf16" runs megatron-core's own high-precision GEMM.

FP4 weights come from a :class:`~megatron_fp4.resq.QuantizedWeightCache` shared by the model's swapped layers
(quantized once per weight update, not per token).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron_fp4.resq import QuantizedWeightCache, RolloutPrecision, rollout_linear

__all__ = [
    "RolloutLinearMixin",
    "apply_rollout_precision",
    "remove_rollout_precision",
    "rollout_precision",
    "rollout_linear_modules",
    "get_weight_cache",
]

_MEGATRON_LINEARS = (ColumnParallelLinear, RowParallelLinear)
_SWAPPED: dict[type, type] = {}
_CACHE_ATTR = "_rollout_weight_cache"


class RolloutLinearMixin:
    """Makes a megatron-core parallel linear compute a rollout form (set by :func:`apply_rollout_precision`)."""

    rollout_precision: RolloutPrecision
    rollout_cache: Optional[QuantizedWeightCache]
    rollout_original_class: type

    def _megatron_forward_impl(self, *args, **kwargs):
        for cls in type(self).__mro__:
            if cls in _MEGATRON_LINEARS:
                return cls._forward_impl(self, *args, **kwargs)
        raise TypeError(f"{type(self).__name__} is not a megatron-core parallel linear")

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None,
                      **kwargs):
        precision = self.rollout_precision
        if precision.mode == "bf16":
            return self._megatron_forward_impl(
                input, weight, bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit,
                tp_group=tp_group, **kwargs)
        group = tp_group if tp_group is not None else getattr(self, "tp_group", None)
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=group)
        return rollout_linear(input, weight, bias, precision, cache=self.rollout_cache)


def _rollout_class(cls: type) -> type:
    if cls not in _SWAPPED:
        _SWAPPED[cls] = type(f"Rollout{cls.__name__}", (RolloutLinearMixin, cls), {
            "__doc__": f"{cls.__name__} computing the rollout form of its GEMM (see megatron_fp4.rollout)."})
    return _SWAPPED[cls]


def rollout_linear_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Name -> module of the linears that rollout precision applies to (transformer-layer linears, no head)."""
    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, _MEGATRON_LINEARS):
            continue
        if name.split(".")[-1] == "output_layer":
            continue  # the output head stays high precision (SPEC §3)
        out[name] = m
    return out


def get_weight_cache(model: torch.nn.Module) -> QuantizedWeightCache:
    """The model's shared rollout weight cache (created on first use)."""
    cache = getattr(model, _CACHE_ATTR, None)
    if cache is None:
        cache = QuantizedWeightCache()
        object.__setattr__(model, _CACHE_ATTR, cache)  # plain attribute, not a submodule/state
    return cache


def apply_rollout_precision(model: torch.nn.Module, precision: RolloutPrecision) -> int:
    """Switch the model's transformer-layer linears to ``precision`` (idempotent); returns how many."""
    if not isinstance(precision, RolloutPrecision):
        raise TypeError(f"precision must be a RolloutPrecision, got {type(precision).__name__}")
    cache = get_weight_cache(model)
    modules = rollout_linear_modules(model)
    for name, m in modules.items():
        if not isinstance(m, RolloutLinearMixin):
            original = type(m)
            m.__class__ = _rollout_class(original)
            m.rollout_original_class = original
        m.rollout_precision = precision
        m.rollout_cache = cache
        m.rollout_name = name
    return len(modules)


def remove_rollout_precision(model: torch.nn.Module) -> int:
    """Restore the original classes of swapped linears (the weight cache is kept); returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, RolloutLinearMixin):
            m.__class__ = m.rollout_original_class
            n += 1
    return n


@contextlib.contextmanager
def rollout_precision(model: torch.nn.Module, precision: RolloutPrecision) -> Iterator[torch.nn.Module]:
    """Run ``model`` in ``precision`` inside the block; the previous state is restored on exit."""
    previous = {m: m.rollout_precision for m in model.modules() if isinstance(m, RolloutLinearMixin)}
    apply_rollout_precision(model, precision)
    try:
        yield model
    finally:
        if previous:
            for m, p in previous.items():
                m.rollout_precision = p
        else:
            remove_rollout_precision(model)


def quantized_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weight parameters of the rollout linears (what the cache quantizes)."""
    return [m.weight for m in rollout_linear_modules(model).values() if getattr(m, "weight", None) is not None]
