"""GPT builder: HF Qwen2/Llama configs map to the right megatron-core TransformerConfig (no process group needed;
building and training the model is covered under torchrun by tests/test_parallel.py)."""

import pytest
import torch
import torch.nn.functional as F

from megatron_fp4.models import GPTModelArgs, gpt_transformer_config
from megatron_fp4.parallel import FP4TransformerConfig, get_gpt_layer_fp4_spec
from megatron_fp4.parallel.layers import FP4ColumnParallelLinear, FP4RowParallelLinear
from megatron_fp4.parallel.spec import FP4TransformerLayer
from megatron_fp4.recipe import HiF4BlockScaling

QWEN25_3B = dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                 num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu")


def test_from_hf_qwen2_dict_and_config():
    args = GPTModelArgs.from_hf_config(QWEN25_3B, fp4_recipe=HiF4BlockScaling())
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (36, 2048, 11008)
    assert (args.num_attention_heads, args.num_query_groups, args.kv_channels) == (16, 2, 128)
    assert args.add_qkv_bias and args.tie_embeddings and args.swiglu and args.rotary_base == 1e6
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2Config(**{k: v for k, v in QWEN25_3B.items() if k != "model_type"})
    args2 = GPTModelArgs.from_hf_config(hf, fp4_recipe=HiF4BlockScaling())
    assert args2 == args


def test_from_hf_llama():
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=4, vocab_size=1000)
    args = GPTModelArgs.from_hf_config(hf)
    assert not args.add_qkv_bias and args.num_query_groups == 4 and args.kv_channels == 32
    with pytest.raises(ValueError, match="rope_type"):
        GPTModelArgs.from_hf_config(dict(QWEN25_3B, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_transformer_config_fields():
    recipe = HiF4BlockScaling(high_precision_first_layers=1)
    args = GPTModelArgs(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                        num_query_groups=2, vocab_size=100, max_seq_len=32, add_qkv_bias=True, fp4_recipe=recipe,
                        config_overrides={"init_method_std": 0.01})
    cfg = gpt_transformer_config(args)
    assert isinstance(cfg, FP4TransformerConfig) and cfg.megatron_fp4_recipe is recipe
    assert cfg.fp4_recipe == "nvfp4" and cfg.fp4 is None  # megatron-core's own FP4 fields keep their meaning
    assert cfg.gated_linear_unit and cfg.activation_func is F.silu and cfg.normalization == "RMSNorm"
    assert cfg.num_query_groups == 2 and cfg.add_qkv_bias and not cfg.add_bias_linear
    assert cfg.init_method_std == 0.01
    if not torch.cuda.is_available():
        assert cfg.use_cpu_initialization and not cfg.gradient_accumulation_fusion
    with pytest.raises(TypeError, match="megatron_fp4_recipe must be an FP4Recipe"):
        FP4TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, megatron_fp4_recipe="hif4")


def test_fp4_spec_swaps_only_the_four_linears():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec, local = get_gpt_layer_fp4_spec(attention_backend="local"), get_gpt_layer_local_spec(normalization="RMSNorm")
    assert spec.module is FP4TransformerLayer
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    assert attn.linear_qkv is FP4ColumnParallelLinear and attn.linear_proj is FP4RowParallelLinear
    assert mlp.linear_fc1 is FP4ColumnParallelLinear and mlp.linear_fc2 is FP4RowParallelLinear
    # everything else is megatron-core's local spec
    assert spec.submodules.input_layernorm is local.submodules.input_layernorm
    assert attn.core_attention is local.submodules.self_attention.submodules.core_attention
    assert spec.submodules.self_attention.module is local.submodules.self_attention.module
    assert spec.submodules.mlp.module is local.submodules.mlp.module
    # the local spec itself is untouched
    assert local.submodules.mlp.submodules.linear_fc1.__name__ == "ColumnParallelLinear"


def test_norms_take_the_params_dtype_except_the_first_graphed_input_norm():
    """``_norms_to_params_dtype``: every torch norm in bf16 (the fused kernel), except, under megatron-core's local
    CUDA graphs, the first layer's input norm, which stays fp32 so that its backward reads a graph-owned copy of
    the graph's input buffer (megatron-core does not restore that buffer before the backward replay)."""
    from megatron_fp4.models.gpt import _norms_to_params_dtype

    def model():
        layer = lambda: torch.nn.ModuleDict(  # noqa: E731
            {"input_layernorm": torch.nn.RMSNorm(8), "pre_mlp_layernorm": torch.nn.RMSNorm(8)})
        m = torch.nn.Module()
        m.decoder = torch.nn.Module()
        m.decoder.layers = torch.nn.ModuleList([layer(), layer()])
        m.decoder.final_layernorm = torch.nn.RMSNorm(8)
        return m

    eager, graphed = model(), model()
    _norms_to_params_dtype(eager, torch.bfloat16)
    _norms_to_params_dtype(graphed, torch.bfloat16, graphed=True)
    assert {p.dtype for p in eager.parameters()} == {torch.bfloat16}
    fp32 = [n for n, p in graphed.named_parameters() if p.dtype == torch.float32]
    assert fp32 == ["decoder.layers.0.input_layernorm.weight"]
