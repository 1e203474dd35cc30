"""Build megatron-core GPTModels of the Qwen2 / Llama shape (RMSNorm, SwiGLU, RoPE, GQA, optional qkv bias) with
the FP4 layer spec.

    args = GPTModelArgs(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                        num_query_groups=2, vocab_size=256, max_seq_len=64, fp4_recipe=HiF4BlockScaling())
    model = build_gpt_model(args)        # after megatron_fp4.parallel.initialize_parallel(...)

The model is a plain ``megatron.core.models.gpt.GPTModel``; its parameter names are those of megatron-core's local
spec (``decoder.layers.N.self_attention.linear_qkv.weight`` ...). On the pipeline stage this rank runs, the
decoder holds only that stage's layers; ``pre_process`` / ``post_process`` default to the first / last stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron_fp4.parallel.attention import resolve_attention_backend
from megatron_fp4.parallel.cpu_compat import apply_cpu_shims, cpu_config_overrides
from megatron_fp4.parallel.spec import FP4TransformerConfig, get_gpt_layer_fp4_spec
from megatron_fp4.recipe import FP4Recipe

__all__ = ["GPTModelArgs", "gpt_transformer_config", "build_gpt_model"]


@dataclass
class GPTModelArgs:
    """Architecture and numerics of a Qwen2/Llama-shaped decoder (field names follow megatron-core)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    vocab_size: int
    max_seq_len: int
    #: Key/value heads (GQA); None = num_attention_heads (MHA).
    num_query_groups: Optional[int] = None
    #: Head dimension; None = hidden_size // num_attention_heads.
    kv_channels: Optional[int] = None
    #: Bias on the fused QKV projection (True for Qwen2, False for Llama).
    add_qkv_bias: bool = False
    #: Tie the output head to the input embedding.
    tie_embeddings: bool = False
    #: SwiGLU MLP (gated SiLU); False = plain GELU MLP.
    swiglu: bool = True
    #: "RMSNorm" or "LayerNorm".
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-6
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    qk_layernorm: bool = False
    #: FP4 recipe of the transformer-layer linears; None = high precision (an fp4_autocast still applies).
    fp4_recipe: Optional[FP4Recipe] = None
    #: Core attention (not architecture; not saved in checkpoints): "sdpa" (PyTorch's fused
    #: scaled_dot_product_attention), "local" (megatron-core's unfused DotProductAttention, the reference), "auto"
    #: (sdpa on CUDA, local on the CPU). See megatron_fp4.parallel.attention.
    attention_backend: str = "auto"
    #: Parameter dtype (torch.float32 or torch.bfloat16); bf16=True also sets megatron's bf16 flag.
    params_dtype: torch.dtype = torch.float32
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    #: Extra TransformerConfig fields (e.g. sequence_parallel=True, recompute_granularity="full").
    config_overrides: dict[str, Any] = field(default_factory=dict)
    #: Not architecture: the Hugging Face model the weights come from, ``{"config": config.json dict,
    #: "architecture": name, "vocab_size": unpadded vocabulary, "assets_dir": tokenizer files folder}`` (any may be
    #: None). Set by ``gpt_model_args_from_checkpoint`` / ``load_gpt``; ``build_gpt_model`` keeps it on the model
    #: (``model.hf_info``) so that RL checkpoints and HF exports know what to write.
    hf_info: Optional[dict] = None

    @classmethod
    def from_hf_config(cls, hf_config: Any, **changes: Any) -> "GPTModelArgs":
        """Args for a HuggingFace Qwen2 / Llama config (``transformers.PretrainedConfig`` or a dict)."""
        get = (hf_config.get if isinstance(hf_config, dict)
               else lambda k, d=None: getattr(hf_config, k, d))
        model_type = get("model_type", "")
        heads = get("num_attention_heads")
        rope = get("rope_parameters", None) or get("rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in ("default", None):
            raise ValueError(f"rope_type={rope_type!r} is not supported; allowed values: 'default'")
        rope_theta = get("rope_theta", None) or (rope.get("rope_theta") if isinstance(rope, dict) else None)
        args = dict(
            num_layers=get("num_hidden_layers"),
            hidden_size=get("hidden_size"),
            ffn_hidden_size=get("intermediate_size"),
            num_attention_heads=heads,
            num_query_groups=get("num_key_value_heads", None) or heads,
            kv_channels=get("head_dim", None) or get("hidden_size") // heads,
            vocab_size=get("vocab_size"),
            max_seq_len=get("max_position_embeddings", 4096),
            add_qkv_bias=bool(get("attention_bias", False)) or model_type == "qwen2",
            tie_embeddings=bool(get("tie_word_embeddings", False)),
            swiglu=get("hidden_act", "silu") == "silu",
            norm_epsilon=get("rms_norm_eps", 1e-6),
            rotary_base=rope_theta or 10000.0,
        )
        args.update(changes)
        return cls(**args)

    @classmethod
    def from_model(cls, model: Any) -> "GPTModelArgs":
        """The args of a built megatron-core GPTModel (DDP / Float16 wrappers unwrapped), read from its config and
        attributes (a pipeline stage gives the whole model's args); ``hf_info`` from ``model.hf_info``."""
        while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        cfg = model.config
        return cls(
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
            num_attention_heads=cfg.num_attention_heads, vocab_size=int(model.vocab_size),
            max_seq_len=int(model.max_sequence_length), num_query_groups=cfg.num_query_groups,
            kv_channels=cfg.kv_channels, add_qkv_bias=bool(cfg.add_qkv_bias),
            tie_embeddings=bool(model.share_embeddings_and_output_weights), swiglu=bool(cfg.gated_linear_unit),
            normalization=cfg.normalization, norm_epsilon=float(cfg.layernorm_epsilon),
            rotary_base=float(model.rotary_base), rotary_percent=float(model.rotary_percent),
            qk_layernorm=bool(cfg.qk_layernorm), fp4_recipe=getattr(cfg, "megatron_fp4_recipe", None),
            params_dtype=cfg.params_dtype, init_method_std=cfg.init_method_std, hidden_dropout=cfg.hidden_dropout,
            attention_dropout=cfg.attention_dropout, hf_info=getattr(model, "hf_info", None),
            attention_backend=getattr(model, "attention_backend", "auto"))


def gpt_transformer_config(args: GPTModelArgs, **overrides: Any) -> FP4TransformerConfig:
    """The FP4TransformerConfig for ``args`` (CPU-safe settings applied when CUDA is absent)."""
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        add_qkv_bias=args.add_qkv_bias,
        add_bias_linear=False,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        qk_layernorm=args.qk_layernorm,
        params_dtype=args.params_dtype,
        bf16=args.params_dtype == torch.bfloat16,
        init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        # megatron-core's fused SwiGLU (TorchScript; saves only its input for backward) on the GPU; the CPU keeps the
        # unfused reference
        bias_activation_fusion=args.swiglu and torch.cuda.is_available(),
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        fp4_recipe=args.fp4_recipe,
    )
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        fields.update(
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        )
    fields.update(cpu_config_overrides())
    fields.update(args.config_overrides)
    fields.update(overrides)
    if fields.get("pipeline_model_parallel_size", 1) > 1:
        fields.setdefault("pipeline_dtype", args.params_dtype)
    return FP4TransformerConfig(**fields)


def _norms_to_params_dtype(model: torch.nn.Module, dtype: torch.dtype, graphed: bool = False) -> None:
    """Give the norms (torch.nn.RMSNorm / LayerNorm without Transformer Engine or apex, which megatron-core builds
    in fp32 whatever params_dtype says) the model's parameter dtype, as Megatron-LM's Float16Module does under
    --bf16. A bf16 input with an fp32 weight takes torch's unfused norm (about ten elementwise kernels and casts
    per norm and step on the GPU); matching dtypes take the fused one. Megatron's optimizer still keeps fp32 main
    copies of them.

    ``graphed`` (megatron-core's local CUDA graphs): the first layer's input norm stays fp32. Its input is the
    graph's static input buffer, which megatron-core (0.16, without Transformer Engine) does not restore before the
    backward replay; the fused bf16 norm saves that buffer itself for its backward and so read other data there
    (its weight gradient wrong, measured on the H200), while the fp32 norm casts it into a graph-owned copy first.
    Later layers' inputs are the previous graph's outputs, which megatron-core restores."""
    first = None
    if graphed and getattr(model, "decoder", None) is not None and len(model.decoder.layers):
        first = getattr(model.decoder.layers[0], "input_layernorm", None)
    for m in model.modules():
        if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm)) and m is not first:
            m.to(dtype)


def build_gpt_model(
    args: GPTModelArgs,
    config: Optional[FP4TransformerConfig] = None,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    parallel_output: bool = True,
):
    """A megatron-core GPTModel with the FP4 layer spec (parallel_state must be initialized), on the current CUDA
    device when there is one."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if not torch.cuda.is_available():
        apply_cpu_shims()
    if config is None:
        config = gpt_transformer_config(args)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    backend = resolve_attention_backend(args.attention_backend)
    spec = get_gpt_layer_fp4_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization,
                                  attention_backend=backend)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_seq_len,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=args.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
    )
    _norms_to_params_dtype(model, config.params_dtype,
                           graphed=getattr(config, "cuda_graph_impl", "none") == "local")
    model.hf_info = args.hf_info
    model.attention_backend = backend  # "sdpa" or "local" (what "auto" became)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())  # some modules (e.g. torch norms) are built on the CPU
    return model
