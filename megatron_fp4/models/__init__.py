"""Model builders on megatron-core with the FP4 layer spec."""

from megatron_fp4.models.gpt import GPTModelArgs, build_gpt_model, gpt_transformer_config

__all__ = ["GPTModelArgs", "build_gpt_model", "gpt_transformer_config"]
