"""megatron-core integration: tensor/pipeline-parallel FP4 linears, the FP4 GPT layer spec, fused (SDPA) core
attention and CPU shims.

Training a GPT in FP4 with megatron-core (CPU/gloo or GPU/NCCL; single process or under torchrun):

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron_fp4.models import GPTModelArgs, build_gpt_model
    from megatron_fp4.parallel import initialize_parallel
    from megatron_fp4.recipe import HiF4BlockScaling

    initialize_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, seed=1234)
    model = build_gpt_model(GPTModelArgs(..., fp4_recipe=HiF4BlockScaling()))   # recipe in the config
    config = model.config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-6, clip_grad=1.0), [ddp])
    get_forward_backward_func()(forward_step_func=..., data_iterator=..., model=[ddp], num_microbatches=...,
                                seq_length=..., micro_batch_size=...)
    opt.step()

tests/dist/gpt_parallel.py is a complete, tested example (TP/PP/DP, tied embeddings, bf16).
"""

from megatron_fp4.parallel.attention import (
    ATTENTION_BACKENDS,
    SDPADotProductAttention,
    resolve_attention_backend,
)
from megatron_fp4.parallel.cpu_compat import (
    apply_cpu_shims,
    collective_device,
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
    "ATTENTION_BACKENDS",
    "SDPADotProductAttention",
    "resolve_attention_backend",
    "FP4ColumnParallelLinear",
    "FP4RowParallelLinear",
    "FP4ParallelLinearMixin",
    "FP4TransformerConfig",
    "FP4TransformerLayer",
    "get_gpt_layer_fp4_spec",
    "apply_cpu_shims",
    "collective_device",
    "cpu_config_overrides",
    "initialize_parallel",
    "destroy_parallel",
    "set_seed",
]
