"""megatron-core integration: tensor/pipeline-parallel FP4 linears, the FP4 GPT layer spec and CPU shims.

    from megatron_fp4.parallel import initialize_parallel, get_gpt_layer_fp4_spec, FP4TransformerConfig
"""

from megatron_fp4.parallel.cpu_compat import (
    apply_cpu_shims,
    cpu_config_overrides,
    destroy_parallel,
    initialize_parallel,
    set_seed,
)
from megatron_fp4.parallel.layers import (
    FP4ColumnParallelLinear,
    FP4ParallelLinearMixin,
    FP4RowParallelLinear,
)
from megatron_fp4.parallel.spec import FP4TransformerConfig, FP4TransformerLayer, get_gpt_layer_fp4_spec

__all__ = [
    "FP4ColumnParallelLinear",
    "FP4RowParallelLinear",
    "FP4ParallelLinearMixin",
    "FP4TransformerConfig",
    "FP4TransformerLayer",
    "get_gpt_layer_fp4_spec",
    "apply_cpu_shims",
    "cpu_config_overrides",
    "initialize_parallel",
    "destroy_parallel",
    "set_seed",
]
