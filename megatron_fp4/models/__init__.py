"""Model builders on megatron-core with the FP4 layer spec."""

from megatron_fp4.models.checkpoint_io import (gpt_model_args_from_checkpoint, load_checkpoint_into_model,
                                               save_model_checkpoint)
from megatron_fp4.models.fp4_checkpoint import load_fp4_checkpoint
from megatron_fp4.models.gpt import GPTModelArgs, build_gpt_model, gpt_transformer_config
from megatron_fp4.models.loading import load_gpt

__all__ = ["GPTModelArgs", "build_gpt_model", "gpt_transformer_config", "load_gpt", "load_checkpoint_into_model",
           "gpt_model_args_from_checkpoint", "save_model_checkpoint", "load_fp4_checkpoint"]
