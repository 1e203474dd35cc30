"""GPT layer spec with FP4 linears, the TransformerLayer that tells its linears their layer number, and a config
that carries the FP4 recipe.

The recipe lives in its own field, ``megatron_fp4_recipe``, beside megatron-core 0.16's FP4 fields (``fp4`` = the
``--fp4-format e2m1`` of Transformer Engine's NVFP4, ``fp4_recipe`` = the string "nvfp4"/"custom", ``fp4_param``),
which keep their meaning and defaults; none of ours shadows them. An FP4Recipe passed as ``fp4_recipe=`` (what
callers wrote before the field had its own name) is moved into ``megatron_fp4_recipe``, leaving megatron-core's
field at its default.

The spec is megatron-core's local (non-TE) GPT layer spec with linear_qkv, linear_proj, linear_fc1 and linear_fc2
swapped for the FP4 parallel linears; parameter names are unchanged (HF converters rely on them). Norms, embeddings
and the output head stay megatron-core's high-precision modules. The attention core is the spec's
``attention_backend``: "local" keeps megatron-core's unfused DotProductAttention (the reference), "sdpa" takes
:class:`~megatron_fp4.parallel.attention.SDPADotProductAttention` (PyTorch's fused scaled_dot_product_attention),
"auto" (the default) is sdpa on CUDA and local on the CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_fp4.parallel.attention import core_attention_module
from megatron_fp4.parallel.layers import (
    FP4ColumnParallelLinear,
    FP4ParallelLinearMixin,
    FP4RowParallelLinear,
)
from megatron_fp4.recipe import FP4Recipe

__all__ = ["FP4TransformerConfig", "FP4TransformerLayer", "get_gpt_layer_fp4_spec"]


_MCORE_FP4_RECIPE_DEFAULT = next(f.default for f in dataclasses.fields(TransformerConfig) if f.name == "fp4_recipe")


@dataclass
class FP4TransformerConfig(TransformerConfig):
    """megatron-core TransformerConfig plus the FP4 recipe the FP4 linears use (None: high precision)."""

    #: Recipe for every FP4 linear of the model; an active ``fp4_autocast`` overrides it. (megatron-core's own
    #: ``fp4_recipe`` string is Transformer Engine's and stays untouched.)
    megatron_fp4_recipe: Optional[FP4Recipe] = None

    def __post_init__(self) -> None:
        if isinstance(self.fp4_recipe, FP4Recipe):  # the old keyword: move it out of megatron-core's field
            if self.megatron_fp4_recipe is not None:
                raise ValueError("pass the FP4 recipe once, as megatron_fp4_recipe= (fp4_recipe= is megatron-core's "
                                 "Transformer Engine recipe name)")
            self.megatron_fp4_recipe, self.fp4_recipe = self.fp4_recipe, _MCORE_FP4_RECIPE_DEFAULT
        super().__post_init__()
        if self.megatron_fp4_recipe is not None and not isinstance(self.megatron_fp4_recipe, FP4Recipe):
            raise TypeError(f"megatron_fp4_recipe must be an FP4Recipe or None, got "
                            f"{type(self.megatron_fp4_recipe).__name__}")


class FP4TransformerLayer(TransformerLayer):
    """megatron-core TransformerLayer that stamps its global layer number on its FP4 linears.

    The number lets a recipe keep the first/last N layers in high precision
    (``FP4Recipe.high_precision_first_layers`` / ``high_precision_last_layers``).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for module in self.modules():
            if isinstance(module, FP4ParallelLinearMixin):
                module.fp4_layer_number = self.layer_number

    def _should_call_local_cudagraph(self, *args, **kwargs) -> bool:
        """With ``cuda_graph_impl="local"``, only the passes that train (gradients on) go through megatron's CUDA
        graphs; forward-only passes (log-probs, evaluation) run eagerly, in whatever shape they come."""
        return torch.is_grad_enabled() and super()._should_call_local_cudagraph(*args, **kwargs)


def get_gpt_layer_fp4_spec(
    qk_layernorm: bool = False,
    normalization: Optional[str] = "RMSNorm",
    qk_l2_norm: bool = False,
    attention_backend: str = "auto",
) -> ModuleSpec:
    """megatron-core's local GPT layer spec (dense MLP) with FP4 linear_qkv/linear_proj/linear_fc1/linear_fc2 and the
    core attention of ``attention_backend`` ("auto", "sdpa" or "local"; see the module docstring)."""
    core_attention = core_attention_module(attention_backend)
    base = get_gpt_layer_local_spec(
        qk_layernorm=qk_layernorm, normalization=normalization, qk_l2_norm=qk_l2_norm
    )
    layer_sub = base.submodules
    attn = layer_sub.self_attention
    mlp = layer_sub.mlp
    attn = dataclasses.replace(
        attn,
        submodules=dataclasses.replace(
            attn.submodules, linear_qkv=FP4ColumnParallelLinear, linear_proj=FP4RowParallelLinear,
            core_attention=core_attention,
        ),
    )
    mlp = dataclasses.replace(
        mlp,
        submodules=dataclasses.replace(
            mlp.submodules, linear_fc1=FP4ColumnParallelLinear, linear_fc2=FP4RowParallelLinear
        ),
    )
    return dataclasses.replace(
        base,
        module=FP4TransformerLayer,
        submodules=dataclasses.replace(layer_sub, self_attention=attn, mlp=mlp),
    )
