"""Hugging Face (Qwen2 / Qwen2.5 / Llama) <-> megatron-core GPT weights: config mapping, tensor layout, converters.

Name and layout mapping (global layer index i; megatron names are those of megatron-core's local GPT spec):

    model.embed_tokens.weight                 embedding.word_embeddings.weight       (rows padded to the vocab)
    model.layers.i.input_layernorm.weight     decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.*   decoder.layers.i.self_attention.linear_qkv.{weight,bias}
                                              grouped: per KV group g [q heads of g; k_g; v_g]
    model.layers.i.self_attn.o_proj.weight    decoder.layers.i.self_attention.linear_proj.weight
    model.layers.i.post_attention_layernorm   decoder.layers.i.pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight  decoder.layers.i.mlp.linear_fc1.weight  ([gate; up])
    model.layers.i.mlp.down_proj.weight       decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                         decoder.final_layernorm.weight
    lm_head.weight                            output_layer.weight  (absent when tied, except on the last PP stage)

Both sides use the rotate-half RoPE convention, so Q/K rows need no permutation. Conversion never changes dtypes,
so HF -> megatron -> HF is bit exact. Readers are lazy (memory-mapped safetensors) and converters hold one
output shard (plus one full tensor) in memory at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch

from megatron_fp4.models.checkpoint_io import (
    HF_ASSETS_DIRNAME,
    SHARD_FILENAME,
    MegatronCheckpoint,
    ShardedWeights,
    copy_hf_assets,
    iteration_dirname,
    layer_offset,
    shard_dirname,
    split_tp,
    stage_param_names,
    to_local_name,
    write_checkpoint_metadata,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "TensorSource",
    "HFFolderSource",
    "DictSource",
    "open_hf_source",
    "model_args_from_hf_config",
    "check_parallel_sizes",
    "padded_vocab_size",
    "megatron_tensor_from_hf",
    "iter_hf_tensors_from_megatron",
    "hf_config_from_checkpoint",
    "HF_EXPORT_FIELDS",
    "check_hf_exportable",
    "ShardedSafetensorsWriter",
    "check_hf_shapes",
    "num_hf_tensors",
    "progress_bar",
    "copy_hf_assets",
    "prepare_output_dir",
    "convert_hf_to_megatron",
    "convert_megatron_to_hf",
]

PathLike = Union[str, os.PathLike]

#: HF architecture name -> model_type of the architectures the converters support.
SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
_SUPPORTED_MSG = ("supported: Qwen2ForCausalLM (model_type 'qwen2': Qwen2, Qwen2.5) and LlamaForCausalLM "
                  "(model_type 'llama': Llama 2/3 with default RoPE)")
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MG_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


# -- config ---------------------------------------------------------------------------------------------------------
def _rope_theta(cfg: dict) -> float:
    rp = cfg.get("rope_parameters") or {}
    rs = cfg.get("rope_scaling") or {}
    rope_type = rp.get("rope_type") or rp.get("type") or rs.get("rope_type") or rs.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"unsupported RoPE scaling {rope_type!r} (rope_parameters/rope_scaling in config.json); "
                         f"only the default RoPE is supported by the converter")
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta)


def model_args_from_hf_config(cfg: dict) -> dict:
    """GPTModelArgs keyword arguments (without params_dtype; vocab unpadded) for a Qwen2/Llama config.json dict."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    arch = archs[0] if archs else None
    if model_type not in SUPPORTED_ARCHITECTURES.values() or (arch is not None and arch not in SUPPORTED_ARCHITECTURES):
        raise ValueError(f"unsupported architecture {arch!r} (model_type {model_type!r}); {_SUPPORTED_MSG}")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in cfg:
            raise ValueError(f"config.json has no {key!r}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: only SwiGLU (silu) MLPs are supported")
    if model_type == "qwen2":
        if cfg.get("use_sliding_window"):
            raise ValueError("unsupported: Qwen2 with use_sliding_window=true (megatron-core local attention has "
                             "no sliding window)")
        qkv_bias = True
    else:
        if cfg.get("attention_bias"):
            raise ValueError("unsupported: Llama with attention_bias=true (o_proj bias has no megatron "
                             "counterpart in this model); " + _SUPPORTED_MSG)
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported: Llama with mlp_bias=true")
        qkv_bias = False
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // heads
    return dict(
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=int(head_dim),
        vocab_size=int(cfg["vocab_size"]),
        max_seq_len=int(cfg.get("max_position_embeddings") or 4096),
        add_qkv_bias=qkv_bias,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        swiglu=True,
        normalization="RMSNorm",
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        rotary_base=_rope_theta(cfg),
    )


def check_parallel_sizes(margs: dict, tp: int, pp: int) -> None:
    """Fail fast when TP does not divide the heads / KV groups / FFN, or PP does not divide the layers."""
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size ({pp}) "
                         f"must be >= 1")
    for field, label in (("num_attention_heads", "num_attention_heads"),
                         ("num_query_groups", "num_key_value_heads"), ("ffn_hidden_size", "intermediate_size")):
        if margs[field] % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide {label}={margs[field]}; "
                             f"choose a TP size that divides the number of attention heads and KV heads")
    if margs["num_layers"] % pp:
        raise ValueError(f"--pipeline-model-parallel-size {pp} does not divide num_hidden_layers="
                         f"{margs['num_layers']}")


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = 1) -> int:
    """Vocabulary rounded up to a multiple of ``divisible_by * tp`` (megatron's padding rule)."""
    mult = max(1, divisible_by) * tp
    return int(math.ceil(vocab / mult) * mult)


# -- sources of HF-named tensors -----------------------------------------------------------------------------------
class TensorSource:
    """HF-named tensors plus the config.json dict (lazy access)."""

    config: dict

    def keys(self) -> list[str]:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        return name in self.keys()

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.get(name).dtype

    def where(self, name: str) -> str:
        """Where a tensor comes from (for error messages)."""
        return "the checkpoint"

    def model_args(self, tp: int = 1, make_vocab_size_divisible_by: int = 1) -> dict:
        """GPTModelArgs kwargs (params_dtype = the embedding's dtype, vocab padded for ``tp``), shapes checked."""
        margs = model_args_from_hf_config(self.config)
        check_hf_shapes(self, margs)
        margs["params_dtype"] = self.dtype("model.embed_tokens.weight")
        margs["vocab_size"] = padded_vocab_size(margs["vocab_size"], tp, make_vocab_size_divisible_by)
        return margs


class DictSource(TensorSource):
    """An in-memory HF state dict and its config dict."""

    def __init__(self, config: dict, state_dict: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.state_dict = state_dict

    def keys(self) -> list[str]:
        return list(self.state_dict)

    def has(self, name: str) -> bool:
        return name in self.state_dict

    def get(self, name: str) -> torch.Tensor:
        if name not in self.state_dict:
            raise KeyError(f"tensor {name} is missing from the state dict")
        return self.state_dict[name]


class HFFolderSource(TensorSource):
    """A local HF model folder: config.json + model.safetensors or a sharded model.safetensors.index.json."""

    def __init__(self, path: PathLike) -> None:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"Hugging Face model folder {path} does not exist")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found: {path} is not a Hugging Face model folder")
        self.path = path
        self.config = json.loads(cfg_file.read_text())
        index = path / "model.safetensors.index.json"
        self.weight_map: dict[str, str] = {}
        if index.is_file():
            self.weight_map = dict(json.loads(index.read_text())["weight_map"])
            missing = sorted({f for f in self.weight_map.values() if not (path / f).is_file()})
            if missing:
                raise FileNotFoundError(f"{index} lists shard files that are missing: "
                                        f"{', '.join(str(path / f) for f in missing)}")
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                bins = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
                hint = (f" (found {', '.join(bins)}: re-save with save_pretrained(..., safe_serialization=True))"
                        if bins else "")
                raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}{hint}")
            from safetensors import safe_open

            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        self.weight_map[k] = f.name
        self._handles: dict[str, Any] = {}

    def _handle(self, name: str):
        from safetensors import safe_open

        if name not in self.weight_map:
            raise KeyError(f"tensor {name} is missing from {self.path}")
        f = self.weight_map[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(self.path / f), framework="pt", device="cpu")
        return self._handles[f]

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        st = self._handle(name).get_slice(name).get_dtype()
        return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(st) or self.get(name).dtype

    def where(self, name: str) -> str:
        return str(self.path / self.weight_map.get(name, "?"))


def open_hf_source(path: PathLike) -> TensorSource:
    """The tensor source of an HF folder (plain, or an FP4 export whose weights are dequantized on access)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if cfg_file.is_file():
        qc = json.loads(cfg_file.read_text()).get("quantization_config") or {}
        if qc.get("quant_method") == "megatron_fp4":
            from megatron_fp4.models.fp4_checkpoint import FP4FolderSource

            return FP4FolderSource(path)
    return HFFolderSource(path)


def _hf_expected_shapes(margs: dict, tied: bool) -> dict[str, tuple[int, ...]]:
    h, f, v = margs["hidden_size"], margs["ffn_hidden_size"], margs["vocab_size"]
    q = margs["num_attention_heads"] * margs["kv_channels"]
    kv = margs["num_query_groups"] * margs["kv_channels"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (v, h)
    for i in range(margs["num_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
        })
        if margs["add_qkv_bias"]:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def check_hf_shapes(source: TensorSource, margs: dict) -> None:
    """Every tensor the model needs is present with the shape config.json implies (vocabulary checked first)."""
    expected = _hf_expected_shapes(margs, margs["tie_embeddings"])
    emb = "model.embed_tokens.weight"
    if not source.has(emb):
        raise KeyError(f"tensor {emb} is missing from {source.where(emb)}")
    got = source.shape(emb)
    if got[0] != margs["vocab_size"]:
        raise ValueError(f"vocabulary mismatch: {emb} has {got[0]} rows but config.json vocab_size is "
                         f"{margs['vocab_size']} ({source.where(emb)})")
    if source.has("lm_head.weight") and not margs["tie_embeddings"]:
        lm = source.shape("lm_head.weight")
        if lm[0] != margs["vocab_size"]:
            raise ValueError(f"vocabulary mismatch: lm_head.weight has {lm[0]} rows but config.json vocab_size "
                             f"is {margs['vocab_size']}")
    for name, shape in expected.items():
        if not source.has(name):
            extra = (" (config.json says tie_word_embeddings=false)" if name == "lm_head.weight" else "")
            raise KeyError(f"tensor {name} is missing from {source.where(name)}{extra}")
        got = source.shape(name)
        if tuple(got) != tuple(shape):
            raise ValueError(f"shape mismatch for {name}: {tuple(got)} in {source.where(name)}, config.json "
                             f"implies {tuple(shape)}")
    unknown = sorted(k for k in source.keys() if k not in expected and k != "lm_head.weight"
                     and not k.endswith("rotary_emb.inv_freq"))
    if unknown:
        raise ValueError(f"{len(unknown)} tensors of the checkpoint have no megatron counterpart, e.g. "
                         f"{unknown[:5]}; {_SUPPORTED_MSG}")


# -- HF -> megatron --------------------------------------------------------------------------------------------------
def _pad_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        raise ValueError(f"vocabulary mismatch: tensor has {t.shape[0]} rows, model vocab_size is {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def megatron_tensor_from_hf(global_name: str, source: TensorSource, margs: dict) -> torch.Tensor:
    """The full (TP=1) megatron tensor ``global_name`` built from the HF tensors of ``source``."""
    if global_name == "embedding.word_embeddings.weight":
        return _pad_vocab(source.get("model.embed_tokens.weight"), margs["vocab_size"])
    if global_name == "output_layer.weight":
        name = "model.embed_tokens.weight" if margs["tie_embeddings"] else "lm_head.weight"
        return _pad_vocab(source.get(name), margs["vocab_size"])
    if global_name == "decoder.final_layernorm.weight":
        return source.get("model.norm.weight")
    m = _MG_LAYER_RE.fullmatch(global_name)
    if not m:
        raise KeyError(f"no HF counterpart for megatron tensor {global_name}")
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest == "input_layernorm.weight":
        return source.get(p + "input_layernorm.weight")
    if rest == "pre_mlp_layernorm.weight":
        return source.get(p + "post_attention_layernorm.weight")
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = (source.get(f"{p}self_attn.{x}_proj.{kind}") for x in ("q", "k", "v"))
        ng, d = margs["num_query_groups"], margs["kv_channels"]
        tail = q.shape[1:]
        qkv = torch.cat([q.reshape(ng, -1, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)], dim=1)
        return qkv.reshape(-1, *tail)
    if rest == "self_attention.linear_proj.weight":
        return source.get(p + "self_attn.o_proj.weight")
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([source.get(p + "mlp.gate_proj.weight"), source.get(p + "mlp.up_proj.weight")], dim=0)
    if rest == "mlp.linear_fc2.weight":
        return source.get(p + "mlp.down_proj.weight")
    raise KeyError(f"no HF counterpart for megatron tensor {global_name}")


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar on stderr counting tensors (disabled when ``enabled`` is False)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def prepare_output_dir(path: PathLike, overwrite: bool, megatron_iteration: Optional[Union[int, str]] = None
                       ) -> Path:
    """Create an output directory; refuse (FileExistsError) to mix with an existing checkpoint unless ``overwrite``.

    For a megatron checkpoint only the iteration directory being written counts (other iterations are kept); for
    an HF folder, existing weights / config.json (removed when ``overwrite``).
    """
    path = Path(path)
    if megatron_iteration is not None:
        target = path / iteration_dirname(megatron_iteration)
        if target.exists() and any(target.iterdir()):
            if not overwrite:
                raise FileExistsError(f"{target} already exists; pass --overwrite (overwrite=True) to replace it "
                                      f"or choose another --save")
            shutil.rmtree(target)
        target.mkdir(parents=True, exist_ok=True)
        return target
    if path.exists():
        old = [p for p in path.iterdir() if p.suffix == ".safetensors" or p.name in (
            "config.json", "model.safetensors.index.json")]
        if old and not overwrite:
            raise FileExistsError(f"{path} already holds a model ({old[0].name}); pass --overwrite (overwrite=True) "
                                  f"to replace it or choose another --save")
        for p in old:
            p.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def convert_hf_to_megatron(hf_path: PathLike, save_dir: PathLike, tensor_model_parallel_size: int = 1,
                           pipeline_model_parallel_size: int = 1, make_vocab_size_divisible_by: int = 1,
                           iteration: Union[int, str] = "release", progress: bool = True,
                           overwrite: bool = False, gguf_file: Optional[str] = None) -> Path:
    """Convert an HF Qwen2/Llama folder to a TP x PP sharded megatron-fp4 checkpoint; returns the iteration dir.

    ``gguf_file``: read the model from this GGUF file inside ``hf_path`` instead (through transformers' GGUF
    loader, dequantized to fp32; its tokenizer and chat template go to hf_assets/). Shards are written one at a
    time (each holds one TP rank of one PP stage); the tracker file last.
    """
    from safetensors.torch import save_file

    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    iteration_dirname(iteration)  # validates
    iteration = iteration if iteration == "release" else int(iteration)
    if gguf_file is not None:
        from megatron_fp4.models.gguf import GGUFSource

        source = GGUFSource(hf_path, gguf_file)
    else:
        source = open_hf_source(hf_path)
    margs = model_args_from_hf_config(source.config)
    check_parallel_sizes(margs, tp, pp)
    hf_vocab = margs["vocab_size"]
    margs = source.model_args(tp, make_vocab_size_divisible_by)
    save_dir = Path(save_dir)
    it_dir = prepare_output_dir(save_dir, overwrite, megatron_iteration=iteration)
    per_stage = [stage_param_names(margs, r, pp) for r in range(pp)]
    with progress_bar(sum(len(n) for n in per_stage) * tp, "hf->megatron", progress) as bar:
        for pp_rank in range(pp):
            offset = layer_offset(margs["num_layers"], pp_rank, pp)
            for tp_rank in range(tp):
                bar.set_postfix_str(shard_dirname(tp_rank, pp_rank))
                state = {}
                for g in per_stage[pp_rank]:
                    state[to_local_name(g, offset)] = split_tp(
                        g, megatron_tensor_from_hf(g, source, margs), tp, tp_rank).contiguous()
                    bar.update(1)
                shard = it_dir / shard_dirname(tp_rank, pp_rank)
                shard.mkdir(parents=True, exist_ok=True)
                save_file(state, str(shard / SHARD_FILENAME), metadata={"format": "pt"})
                del state
    if isinstance(source, HFFolderSource):
        copy_hf_assets(source.path, save_dir / HF_ASSETS_DIRNAME)
    elif hasattr(source, "write_assets"):  # a GGUF file: its tokenizer
        source.write_assets(save_dir / HF_ASSETS_DIRNAME)
    archs = source.config.get("architectures") or [
        {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[source.config["model_type"]]]
    hf_config = {k: v for k, v in source.config.items() if k != "quantization_config"}
    write_checkpoint_metadata(save_dir, iteration, margs, tp, pp, hf_config=hf_config, hf_vocab_size=hf_vocab,
                              hf_architecture=archs[0])
    return it_dir


# -- megatron -> HF --------------------------------------------------------------------------------------------------
#: model_args fields an HF export needs (an RL checkpoint written before they were recorded lacks some).
HF_EXPORT_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                    "kv_channels", "vocab_size", "max_seq_len", "add_qkv_bias", "tie_embeddings", "norm_epsilon",
                    "rotary_base")


def check_hf_exportable(ckpt: ShardedWeights) -> None:
    """Fail (ValueError naming the field) when ``ckpt`` does not record what an HF Qwen2/Llama export needs, or
    records a model that has no such HF form (LayerNorm, GELU MLP, QK norm, partial RoPE)."""
    ma = ckpt.model_args
    missing = [f for f in HF_EXPORT_FIELDS if f not in ma]
    if missing:
        raise ValueError(f"{ckpt.dir} does not record {', '.join(missing)} (model_args has only "
                         f"{', '.join(sorted(ma))}): the HF config cannot be written")
    for field, want in (("swiglu", True), ("normalization", "RMSNorm"), ("qk_layernorm", False),
                        ("rotary_percent", 1.0)):
        if ma.get(field, want) != want:
            raise ValueError(f"{ckpt.dir}: model_args {field}={ma[field]!r} has no Qwen2/Llama form (needs "
                             f"{field}={want!r}); {_SUPPORTED_MSG}")


def iter_hf_tensors_from_megatron(ckpt: ShardedWeights) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of a megatron-fp4 checkpoint (or any :class:`ShardedWeights`, e.g. an RL
    checkpoint) in HF order (embedding, layers, norm, lm_head).

    Reads one full megatron tensor at a time; vocabulary padding is dropped.
    """
    ma = ckpt.model_args
    vocab = int(ckpt.args.get("hf_vocab_size") or ma["vocab_size"])
    ng, d = ma["num_query_groups"] or ma["num_attention_heads"], ma["kv_channels"] or (
        ma["hidden_size"] // ma["num_attention_heads"])
    qpg = ma["num_attention_heads"] // ng
    yield "model.embed_tokens.weight", ckpt.full_tensor("embedding.word_embeddings.weight")[:vocab]
    for i in range(ma["num_layers"]):
        g, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        yield p + "input_layernorm.weight", ckpt.full_tensor(g + "input_layernorm.weight")
        kinds = ("weight", "bias") if ma.get("add_qkv_bias") else ("weight",)
        for kind in kinds:
            qkv = ckpt.full_tensor(g + "self_attention.linear_qkv." + kind)
            tail = qkv.shape[1:]
            q, k, v = qkv.reshape(ng, (qpg + 2) * d, *tail).split([qpg * d, d, d], dim=1)
            yield p + "self_attn.q_proj." + kind, q.reshape(-1, *tail).contiguous()
            yield p + "self_attn.k_proj." + kind, k.reshape(-1, *tail).contiguous()
            yield p + "self_attn.v_proj." + kind, v.reshape(-1, *tail).contiguous()
        yield p + "self_attn.o_proj.weight", ckpt.full_tensor(g + "self_attention.linear_proj.weight")
        yield p + "post_attention_layernorm.weight", ckpt.full_tensor(g + "pre_mlp_layernorm.weight")
        gate, up = ckpt.full_tensor(g + "mlp.linear_fc1.weight").chunk(2, dim=0)
        yield p + "mlp.gate_proj.weight", gate.contiguous()
        yield p + "mlp.up_proj.weight", up.contiguous()
        yield p + "mlp.down_proj.weight", ckpt.full_tensor(g + "mlp.linear_fc2.weight")
    yield "model.norm.weight", ckpt.full_tensor("decoder.final_layernorm.weight")
    if not ma.get("tie_embeddings"):
        yield "lm_head.weight", ckpt.full_tensor("output_layer.weight")[:vocab]


def num_hf_tensors(model_args: dict) -> int:
    """How many tensors :func:`iter_hf_tensors_from_megatron` yields (for progress bars)."""
    per_layer = 9 + (3 if model_args.get("add_qkv_bias") else 0)
    return 2 + per_layer * model_args["num_layers"] + (0 if model_args.get("tie_embeddings") else 1)


def hf_config_from_checkpoint(ckpt: ShardedWeights) -> dict:
    """config.json for a checkpoint: the stored source config (dims checked) or one synthesized from model_args."""
    ma = ckpt.model_args
    vocab = int(ckpt.args.get("hf_vocab_size") or ma["vocab_size"])
    cfg = dict(ckpt.args.get("hf_config") or {})
    if not cfg:
        arch = ckpt.args.get("hf_architecture") or ("Qwen2ForCausalLM" if ma.get("add_qkv_bias")
                                                    else "LlamaForCausalLM")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; {_SUPPORTED_MSG}")
        cfg = {"architectures": [arch], "model_type": SUPPORTED_ARCHITECTURES[arch], "hidden_act": "silu",
               "initializer_range": 0.02, "use_cache": True}
        if arch == "LlamaForCausalLM":
            cfg.update(attention_bias=False, mlp_bias=False)
    stored = bool(ckpt.args.get("hf_config"))
    head_dim = ma["kv_channels"] or ma["hidden_size"] // ma["num_attention_heads"]
    cfg.update(
        hidden_size=ma["hidden_size"], intermediate_size=ma["ffn_hidden_size"],
        num_hidden_layers=ma["num_layers"], num_attention_heads=ma["num_attention_heads"],
        num_key_value_heads=ma["num_query_groups"] or ma["num_attention_heads"],
        vocab_size=vocab, rms_norm_eps=ma["norm_epsilon"], tie_word_embeddings=bool(ma.get("tie_embeddings")),
    )
    if not stored or "max_position_embeddings" not in cfg:  # (a trainer may build a longer-context model: RoPE
        cfg["max_position_embeddings"] = ma["max_seq_len"]  # takes any length, keep the source model's value)
    if "head_dim" in cfg or head_dim != ma["hidden_size"] // ma["num_attention_heads"]:
        cfg["head_dim"] = head_dim
    theta = ma["rotary_base"]
    if not stored or "rope_parameters" in cfg:
        cfg["rope_parameters"] = dict(cfg.get("rope_parameters") or {}, rope_type="default", rope_theta=theta)
    if not stored or "rope_theta" in cfg or "rope_parameters" not in cfg:
        cfg["rope_theta"] = theta
    if "dtype" not in cfg and "torch_dtype" not in cfg and "params_dtype" in ma:
        cfg["dtype"] = ma["params_dtype"]
    return cfg


class ShardedSafetensorsWriter:
    """Writes tensors into safetensors files of at most ``max_shard_bytes`` each, plus the HF index when > 1 file.

    Holds at most one file's worth of tensors in memory. Files are named like ``save_pretrained`` names them.
    """

    def __init__(self, out_dir: PathLike, max_shard_bytes: int = 5 * 2**30) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = int(max_shard_bytes)
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor (flushes the current file first if it would overflow)."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buf[name] = tensor.detach().contiguous()
        self._buf_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._buf:
            return
        tmp = f"model-tmp-{len(self._files):05d}.safetensors"
        save_file(self._buf, str(self.out_dir / tmp), metadata={"format": "pt"})
        self._files.append((tmp, list(self._buf)))
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last file, rename the files to their final names, write the index. Returns the file names."""
        self._flush()
        n = len(self._files)
        names = []
        weight_map = {}
        for i, (tmp, keys) in enumerate(self._files):
            final = SHARD_FILENAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / tmp, self.out_dir / final)
            names.append(final)
            weight_map.update({k: final for k in keys})
        index = self.out_dir / "model.safetensors.index.json"
        if n > 1:
            index.write_text(json.dumps({"metadata": {"total_size": self.total_bytes},
                                         "weight_map": weight_map}, indent=2) + "\n")
        elif index.exists():
            index.unlink()
        return names


def convert_megatron_to_hf(load_dir: Union[PathLike, ShardedWeights], save_dir: PathLike,
                           iteration: Optional[Union[int, str]] = None, max_shard_bytes: int = 5 * 2**30,
                           progress: bool = True, overwrite: bool = False, dtype: Optional[torch.dtype] = None
                           ) -> Path:
    """Convert a megatron-fp4 checkpoint (any TP/PP; or any :class:`ShardedWeights`, e.g. an RL checkpoint opened
    by ``megatron_fp4.rl.export.open_checkpoint``) to an HF folder transformers can load; returns ``save_dir``.

    ``dtype``: cast the floating-point tensors (default: keep the stored dtype); config.json's ``dtype`` names the
    dtype written.
    """
    ckpt = load_dir if isinstance(load_dir, ShardedWeights) else MegatronCheckpoint(load_dir, iteration)
    check_hf_exportable(ckpt)
    cfg = hf_config_from_checkpoint(ckpt)
    save_dir = prepare_output_dir(save_dir, overwrite)
    writer = ShardedSafetensorsWriter(save_dir, max_shard_bytes)
    written_dtype = None
    with progress_bar(num_hf_tensors(ckpt.model_args), "megatron->hf", progress) as bar:
        for name, t in iter_hf_tensors_from_megatron(ckpt):
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            written_dtype = written_dtype or t.dtype
            writer.add(name, t)
            bar.update(1)
    writer.close()
    ckpt.write_hf_assets(save_dir)
    if written_dtype is not None:
        for key in [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]:
            cfg[key] = str(written_dtype).replace("torch.", "")
    (save_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return save_dir
