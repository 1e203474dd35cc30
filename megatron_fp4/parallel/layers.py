"""Tensor-parallel FP4 linears: megatron-core's ColumnParallelLinear / RowParallelLinear with an FP4 local GEMM.

Only ``_forward_impl`` (megatron's hook that runs the local GEMM and its backward communication) is overridden;
constructors, parameters, initialization, output gather / reduce and checkpoint sharding are megatron-core's.
With no recipe (or for a layer kept in high precision) the call goes straight to megatron-core's own
implementation, so the layers are bit-identical to megatron-core's.

Which recipe applies: an active ``fp4_autocast`` (including ``enabled=False``) wins; otherwise
``config.megatron_fp4_recipe`` (see :class:`megatron_fp4.parallel.FP4TransformerConfig`). A layer whose
``fp4_layer_number`` (set by :class:`FP4TransformerLayer`) falls in the recipe's high-precision first/last layers
runs in high precision.

The recipe is read at forward time and kept for that call's backward. With activation recomputation the
recomputed forward reads it again, so keep the recipe in ``config.megatron_fp4_recipe`` (or run the whole
forward-backward inside the ``fp4_autocast`` block, as megatron's forward_backward_func does).

Communication under FP4 reuses megatron-core's own region functions: sequence parallel all-gathers the input
(reduce-scatter of dX in backward), otherwise a column layer all-reduces dX over the TP group. Gradient
accumulation fusion is not used for the FP4 GEMMs: the weight gradient is returned as ``param.grad`` and
megatron's DDP hook adds it to ``main_grad`` (correct, just not fused).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.utils import get_tensor_model_parallel_group_if_none

from megatron_fp4.linear import current_recipe, fp4_linear
from megatron_fp4.recipe import FP4Recipe

__all__ = ["FP4ColumnParallelLinear", "FP4RowParallelLinear", "FP4ParallelLinearMixin"]


def _fp4_local_linear(
    recipe: FP4Recipe,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool = False,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    grad_output_buffer=None,
    wgrad_deferral_limit=None,
    tp_group=None,
    async_grad_allreduce=None,
) -> torch.Tensor:
    """Same contract as megatron's ``linear_with_grad_accumulation_and_async_allreduce``, FP4 GEMMs."""
    if grad_output_buffer is not None:
        raise NotImplementedError(
            "defer_embedding_wgrad_compute (grad_output_buffer) is not supported by the FP4 linears; "
            "it only concerns the output layer, which stays in high precision")
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    if sequence_parallel:
        # all-gather along the sequence in forward, reduce-scatter of dX in backward
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    elif allreduce_dgrad:
        # identity in forward, all-reduce of dX over the TP group in backward
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return fp4_linear(input, weight, bias, recipe)


class FP4ParallelLinearMixin:
    """Adds FP4 dispatch to a megatron-core parallel linear (must come first in the bases)."""

    #: Global 1-based transformer layer number (set by FP4TransformerLayer); None = not inside a layer.
    fp4_layer_number: Optional[int] = None

    def fp4_recipe_for_forward(self) -> Optional[FP4Recipe]:
        """The recipe the next forward uses (None: high precision, i.e. megatron-core's own GEMM)."""
        recipe = current_recipe(getattr(self.config, "megatron_fp4_recipe", None))
        if recipe is None:
            return None
        if self.fp4_layer_number is not None and recipe.keeps_layer_in_high_precision(
            self.fp4_layer_number, self.config.num_layers
        ):
            return None
        return recipe

    def _forward_impl(self, input, weight, *args, **kwargs):
        recipe = self.fp4_recipe_for_forward()
        if recipe is None:
            return super()._forward_impl(input, weight, *args, **kwargs)
        if kwargs.get("tp_group") is None:  # RowParallelLinear passes None (it needs no group here)
            kwargs["tp_group"] = self.tp_group
        return _fp4_local_linear(recipe, input, weight, *args, **kwargs)


class FP4ColumnParallelLinear(FP4ParallelLinearMixin, ColumnParallelLinear):
    """megatron-core ColumnParallelLinear (same arguments, parameters, communication) with FP4 GEMMs."""


class FP4RowParallelLinear(FP4ParallelLinearMixin, RowParallelLinear):
    """megatron-core RowParallelLinear (same arguments, parameters, communication) with FP4 GEMMs."""
