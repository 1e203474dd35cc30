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
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from megatron_fp4.models.checkpoint_io import (
    ARGS_FILENAME,
    HF_ASSETS_DIRNAME,
    SHARD_FILENAME,
    MegatronCheckpoint,
    ShardedWeights,
    _write_text_atomic,
    asset_digests,
    checkpoint_args_doc,
    copy_hf_assets,
    iteration_dirname,
    layer_offset,
    shard_dirname,
    shard_metadata,
    split_tp,
    stage_param_names,
    to_local_name,
)
from megatron_fp4.models.safetensors_io import SafetensorsFile, save_safetensors, writer_record
from megatron_fp4.ownership import check_output_dir

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "TensorSource",
    "HFFolderSource",
    "DictSource",
    "open_hf_source",
    "is_fp4_export",
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
def _cfg_value(cfg: dict, key: str, where: str, default: Any, nullable: bool) -> Any:
    """``cfg[key]``; ``default`` when absent (or null, where transformers takes null as the default); an explicit
    null elsewhere is a ValueError naming the key (transformers refuses it too, or reads it differently)."""
    if key not in cfg or (cfg[key] is None and nullable):
        return default
    if cfg[key] is None:
        raise ValueError(f"{where}: {key}=null is not valid; give a value or leave the key out")
    return cfg[key]


def _cfg_int(cfg: dict, key: str, where: str, default: Any = None, minimum: int = 1, nullable: bool = False) -> int:
    """config.json integer field ``key`` (``default`` when absent): ValueError naming the file and the key when it
    is not an integer >= ``minimum`` (or missing without a default)."""
    v = _cfg_value(cfg, key, where, default, nullable)
    if v is None:
        raise ValueError(f"{where} has no {key!r}")
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{where}: {key}={v!r} is not valid; expected an integer >= {minimum}")
    return v


def _cfg_float(cfg: dict, key: str, where: str, default: float, positive: bool) -> float:
    """config.json number field ``key``: finite and > 0 (``positive``) or >= 0; ValueError naming the key."""
    v = _cfg_value(cfg, key, where, default, nullable=False)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (
            positive and v == 0):
        raise ValueError(f"{where}: {key}={v!r} is not valid; expected a finite number {'> 0' if positive else '>= 0'}")
    return float(v)


def _cfg_bool(cfg: dict, key: str, where: str, default: bool = False) -> bool:
    v = _cfg_value(cfg, key, where, default, nullable=False)
    if not isinstance(v, bool):
        raise ValueError(f"{where}: {key}={v!r} is not valid; expected true or false")
    return v


_CFG_DTYPES = ("float32", "bfloat16", "float16", "float64", "auto")


def _check_unread_fields(cfg: dict, where: str, num_layers: int) -> None:
    """Fields the converter does not map but which change what the model computes or how it is read: the layer
    types (only full attention is supported) and the dtype names."""
    types = cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != num_layers
                              or any(t != "full_attention" for t in types)):
        raise ValueError(f"{where}: layer_types={types!r} is not supported; expected null or {num_layers} x "
                         f"\"full_attention\" (sliding-window layers have no megatron counterpart here)")
    for key in ("torch_dtype", "dtype"):
        if key in cfg and cfg[key] is not None and cfg[key] not in _CFG_DTYPES:
            raise ValueError(f"{where}: {key}={cfg[key]!r} is not valid; allowed values: {', '.join(_CFG_DTYPES)}")


def _rope_theta(cfg: dict, where: str = "config.json") -> float:
    rp = cfg.get("rope_parameters")
    rs = cfg.get("rope_scaling")
    for key, value in (("rope_parameters", rp), ("rope_scaling", rs)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{where}: {key}={value!r} is not valid; expected an object or null")
    rp, rs = rp or {}, rs or {}
    for key, value in (("rope_parameters", rp), ("rope_scaling", rs)):  # either one may carry the scaling
        for k in ("rope_type", "type"):
            if k in value and not isinstance(value[k], str):
                raise ValueError(f"{where}: {key}.{k}={value[k]!r} is not valid; expected a name such as "
                                 f"\"default\"")
        rope_type = value.get("rope_type", value.get("type")) or "default"
        if rope_type != "default":
            raise ValueError(f"unsupported RoPE scaling {rope_type!r} ({key} in {where}); only the default RoPE is "
                             f"supported by the converter")
    if "rope_theta" in rp:
        return _cfg_float(rp, "rope_theta", f"{where} rope_parameters", 10000.0, positive=True)
    return _cfg_float(cfg, "rope_theta", where, 10000.0, positive=True)


def model_args_from_hf_config(cfg: dict, where: str = "config.json") -> dict:
    """GPTModelArgs keyword arguments (without params_dtype; vocab unpadded) for a Qwen2/Llama config.json dict.

    Every field it reads is type- and range-checked; errors name ``where`` (the file) and the field."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(cfg).__name__}")
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{where}: architectures={archs!r} is not valid; expected a list of names")
    model_type = cfg.get("model_type")
    arch = archs[0] if archs else None
    if (not isinstance(model_type, str) or model_type not in SUPPORTED_ARCHITECTURES.values()
            or (arch is not None and arch not in SUPPORTED_ARCHITECTURES)
            or (arch is not None and SUPPORTED_ARCHITECTURES[arch] != model_type)):
        raise ValueError(f"{where}: unsupported architecture {arch!r} (model_type {model_type!r}); {_SUPPORTED_MSG}")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in cfg:
            raise ValueError(f"{where} has no {key!r}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: unsupported hidden_act {act!r}: only SwiGLU (silu) MLPs are supported")
    if model_type == "qwen2":
        if _cfg_bool(cfg, "use_sliding_window", where):
            raise ValueError(f"{where}: unsupported: Qwen2 with use_sliding_window=true (megatron-core local "
                             f"attention has no sliding window)")
        qkv_bias = True
    else:
        if _cfg_bool(cfg, "attention_bias", where):
            raise ValueError(f"{where}: unsupported: Llama with attention_bias=true (o_proj bias has no megatron "
                             f"counterpart in this model); " + _SUPPORTED_MSG)
        if _cfg_bool(cfg, "mlp_bias", where):
            raise ValueError(f"{where}: unsupported: Llama with mlp_bias=true")
        qkv_bias = False
    heads = _cfg_int(cfg, "num_attention_heads", where)
    kv_heads = _cfg_int(cfg, "num_key_value_heads", where, default=heads, nullable=True)
    if heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    hidden = _cfg_int(cfg, "hidden_size", where)
    if cfg.get("head_dim") is None and hidden % heads:  # (an explicit null is refused below for Qwen2)
        raise ValueError(f"{where}: num_attention_heads={heads} does not divide hidden_size={hidden} (and there is "
                         f"no head_dim)")
    head_dim = _cfg_int(cfg, "head_dim", where, default=hidden // heads, nullable=model_type == "llama")
    num_layers = _cfg_int(cfg, "num_hidden_layers", where)
    _check_unread_fields(cfg, where, num_layers)
    return dict(
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=_cfg_int(cfg, "intermediate_size", where),
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        vocab_size=_cfg_int(cfg, "vocab_size", where),
        max_seq_len=_cfg_int(cfg, "max_position_embeddings", where, default=4096),
        add_qkv_bias=qkv_bias,
        tie_embeddings=_cfg_bool(cfg, "tie_word_embeddings", where),
        swiglu=True,
        normalization="RMSNorm",
        norm_epsilon=_cfg_float(cfg, "rms_norm_eps", where, 1e-6, positive=False),
        rotary_base=_rope_theta(cfg, where),
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
    #: Where the config comes from, for error messages.
    config_where: str = "config.json"

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
        margs = model_args_from_hf_config(self.config, self.config_where)
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


def read_json_file(path: PathLike, what: str = "") -> Any:
    """The parsed JSON of ``path``; ValueError naming the file when it is not valid JSON (or not text)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON{what} ({e}); the file is damaged") from None


def _no_constant(name: str):
    """json ``parse_constant`` hook: NaN and Infinity are not JSON (Python's reader accepts them by default)."""
    raise ValueError(f"{name} is not a JSON value")


class HFFolderSource(TensorSource):
    """A local HF model folder: config.json + model.safetensors or a sharded model.safetensors.index.json.

    Files written by this package's exporters carry checksums (verified as tensors are read); others are read
    unverified. Every problem names the file."""

    def __init__(self, path: PathLike) -> None:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"Hugging Face model folder {path} does not exist")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found: {path} is not a Hugging Face model folder")
        self.path = path
        self.config = read_json_file(cfg_file)
        if not isinstance(self.config, dict):
            raise ValueError(f"{cfg_file}: expected a JSON object, found {type(self.config).__name__}")
        self.config_where = str(cfg_file)
        index = path / "model.safetensors.index.json"
        self.weight_map: dict[str, str] = {}
        if index.is_file():
            doc = read_json_file(index)
            wm = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                   for k, v in wm.items()):
                raise ValueError(f"{index}: expected an object with a \"weight_map\" of tensor name -> file name")
            outside = sorted({f for f in wm.values() if Path(f).is_absolute() or ".." in Path(f).parts})
            if outside:
                raise ValueError(f"{index}: names files outside {path} ({outside[0]})")
            self.weight_map = dict(wm)
            missing = sorted({f for f in self.weight_map.values() if not (path / f).is_file()})
            if missing:
                raise FileNotFoundError(f"{index} lists shard files that are missing: "
                                        f"{', '.join(str(path / f) for f in missing)}")
            self._files: dict[str, SafetensorsFile] = {}
            for f in sorted(set(self.weight_map.values())):
                listed = {k for k, v in self.weight_map.items() if v == f}
                held = set(self._file(f).keys())
                if listed - held:
                    raise ValueError(f"{index} lists tensor {sorted(listed - held)[0]} in {path / f}, which does "
                                     f"not hold it")
                if held - listed:
                    raise ValueError(f"{path / f} holds tensor {sorted(held - listed)[0]}, which {index} does not "
                                     f"list in it (the index is damaged or belongs to other files)")
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                bins = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
                hint = (f" (found {', '.join(bins)}: re-save with save_pretrained(..., safe_serialization=True))"
                        if bins else "")
                raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}{hint}")
            self._files = {}
            for f in files:
                for k in self._file(f.name).keys():
                    if k in self.weight_map:
                        raise ValueError(f"tensor {k} is in both {path / self.weight_map[k]} and {f}: which one "
                                         f"is the model's is ambiguous (add a model.safetensors.index.json)")
                    self.weight_map[k] = f.name

    def _file(self, f: str) -> SafetensorsFile:
        if f not in self._files:
            self._files[f] = SafetensorsFile(self.path / f)
        return self._files[f]

    def _handle(self, name: str) -> SafetensorsFile:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name} is missing from {self.path}")
        return self._file(self.weight_map[name])

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._handle(name).shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._handle(name).dtype(name)

    def where(self, name: str) -> str:
        return str(self.path / self.weight_map.get(name, "?"))


def _is_fp4_quantization(qc: Any) -> bool:
    return isinstance(qc, dict) and qc.get("quant_method") == "megatron_fp4"


def is_fp4_export(path: PathLike) -> bool:
    """Whether ``path`` is an FP4 export of ``tools/export_fp4_checkpoint.py`` (config.json's quantization_config
    names quant_method 'megatron_fp4')."""
    cfg_file = Path(path) / "config.json"
    cfg = read_json_file(cfg_file) if cfg_file.is_file() else None
    return _is_fp4_quantization(cfg.get("quantization_config") if isinstance(cfg, dict) else None)


def open_hf_source(path: PathLike) -> TensorSource:
    """The tensor source of a high-precision HF folder (:func:`megatron_fp4.models.loading.open_source` also opens
    this package's FP4 exports and GGUF files)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if cfg_file.is_file():
        cfg = read_json_file(cfg_file)
        qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if _is_fp4_quantization(qc):
            raise ValueError(f"{path} is an FP4 export (quant_method 'megatron_fp4'): open it with "
                             f"megatron_fp4.models.loading.open_source")
        if qc is not None:
            method = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise ValueError(f"{cfg_file}: quantization_config (quant_method {method!r}) is not supported: the "
                             f"converters read high-precision Hugging Face checkpoints and this package's own FP4 "
                             f"exports (quant_method 'megatron_fp4')")
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
        dt = source.dtype(name)
        if dt not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"tensor {name} in {source.where(name)} has dtype {str(dt).replace('torch.', '')}; "
                             f"model weights must be float32, bfloat16 or float16")
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


def prepare_output_dir(path: PathLike, overwrite: bool, megatron_iteration: Optional[Union[int, str]] = None,
                       sources: Iterable[PathLike] = (), arg: str = "--save") -> Path:
    """Check an output directory before any work (:func:`megatron_fp4.ownership.check_output_dir`: never a
    training run's folder, another tool's checkpoint or an input being read; writable), then create it; refuse
    (FileExistsError) to mix with an existing output unless ``overwrite``.

    For a megatron checkpoint (``megatron_iteration`` given) only the iteration being written counts (other
    iterations are kept; an existing one is replaced only once the new one is complete) and the iteration
    directory is not created here (nor the folder: the converter creates it once its input has been read); for an
    HF folder, existing weights / config.json (removed when ``overwrite``).
    Returns ``path`` (HF) or the iteration directory (megatron).
    """
    path = Path(path)
    kind = "hf" if megatron_iteration is None else "converted"
    check_output_dir(path, kind, arg=arg, sources=sources)
    if megatron_iteration is not None:
        target = path / iteration_dirname(megatron_iteration)
        if target.exists() and any(target.iterdir()) and not overwrite:
            raise FileExistsError(f"{arg} {path}: {target.name} already exists; pass --overwrite (overwrite=True) "
                                  f"to replace it or choose another --save")
        return target
    if path.exists():
        old = _hf_model_files(path)
        if old and not overwrite:
            raise FileExistsError(f"{arg} {path}: already holds a model ({old[0].name}); pass --overwrite "
                                  f"(overwrite=True) to replace it or choose another --save")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _hf_model_files(path: Path) -> list[Path]:
    """The files of an HF folder an export replaces: weights, their index, config.json."""
    return [p for p in sorted(path.iterdir()) if p.suffix == ".safetensors" or p.name in (
        "config.json", "model.safetensors.index.json")]


def _source_paths(source: Any) -> list[Path]:
    """The folders / files a source reads (for the output-overlap check)."""
    out = []
    for attr in ("path", "dir"):
        v = getattr(source, attr, None)
        if v is not None:
            out.append(Path(v))
    return out


def _write_converted(source: TensorSource, save_dir: Path, tmp: Path, margs: dict, tp: int, pp: int,
                     iteration: Union[int, str], hf_vocab: int, checkpoint_id: str, writer: dict,
                     progress: bool) -> None:
    """Write every shard, the tokenizer files (``tmp/hf_assets``, moved beside the iterations on commit) and
    args.json of a conversion into ``tmp``."""
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
                shard = tmp / shard_dirname(tp_rank, pp_rank)
                shard.mkdir(parents=True, exist_ok=True)
                save_safetensors(state, shard / SHARD_FILENAME, shard_metadata(checkpoint_id, tp_rank, pp_rank, tp, pp),
                                 writer=writer)
                del state
    if isinstance(source, HFFolderSource):
        copy_hf_assets(source.path, tmp / HF_ASSETS_DIRNAME)
    elif hasattr(source, "write_assets"):  # a GGUF file: its tokenizer
        source.write_assets(tmp / HF_ASSETS_DIRNAME)
    archs = source.config.get("architectures") or [
        {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[source.config["model_type"]]]
    hf_config = {k: v for k, v in source.config.items() if k != "quantization_config"}
    assets = asset_digests(tmp / HF_ASSETS_DIRNAME)
    doc = checkpoint_args_doc(iteration, margs, tp, pp, hf_config=hf_config, hf_vocab_size=hf_vocab,
                              hf_architecture=archs[0], checkpoint_id=checkpoint_id, writer=writer,
                              extra={HF_ASSETS_DIRNAME: assets} if assets else None)
    _write_text_atomic(tmp / ARGS_FILENAME, json.dumps(doc, indent=2) + "\n")


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

    Holds at most one file's worth of tensors in memory. Files are named like ``save_pretrained`` names them and
    carry the checksums of their tensors and the ``writer`` record (:mod:`megatron_fp4.models.safetensors_io`).
    """

    def __init__(self, out_dir: PathLike, max_shard_bytes: int = 5 * 2**30, writer: Optional[dict] = None,
                 metadata_fn: Optional[Any] = None, remove_dir_on_abort: bool = False) -> None:
        """``metadata_fn(names)``: extra safetensors metadata of a file holding tensors ``names``;
        ``remove_dir_on_abort``: the caller created ``out_dir`` for this output, so a failed write removes it when
        it is left empty."""
        self.metadata_fn = metadata_fn
        self.remove_dir_on_abort = remove_dir_on_abort
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if int(max_shard_bytes) < 1:
            raise ValueError(f"--max-shard-size {max_shard_bytes} is not valid; expected a size >= 1 byte")
        self.max_shard_bytes = int(max_shard_bytes)
        self.writer = writer
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
        if not self._buf:
            return
        tmp = f"model-tmp-{len(self._files):05d}.safetensors"
        extra = self.metadata_fn(list(self._buf)) if self.metadata_fn is not None else None
        save_safetensors(self._buf, self.out_dir / tmp, metadata=extra, writer=self.writer)
        self._files.append((tmp, list(self._buf)))
        self._buf, self._buf_bytes = {}, 0

    def abort(self) -> None:
        """Remove the files written so far (under their temporary names), and the folder when
        ``remove_dir_on_abort`` and it is left empty; the folder's earlier files stay (only :meth:`close` replaces
        them)."""
        for tmp, _ in self._files:
            (self.out_dir / tmp).unlink(missing_ok=True)
        self._files, self._buf, self._buf_bytes = [], {}, 0
        if self.remove_dir_on_abort and self.out_dir.is_dir() and not any(self.out_dir.iterdir()):
            self.out_dir.rmdir()

    def __enter__(self) -> "ShardedSafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """Leaving the block: :meth:`close` after the last file is written, or :meth:`abort` when the block raised
        (an interrupt too) or the last file could not be written."""
        if exc_type is not None:
            self.abort()
            return False
        try:
            self._flush()
        except BaseException:
            self.abort()
            raise
        self.close()
        return False

    def close(self) -> list[str]:
        """Write the last file, rename the files to their final names (replacing the folder's earlier weight files,
        which are removed only now), write the index. Returns the file names."""
        self._flush()
        stale = [p for p in self.out_dir.glob("*.safetensors") if p.name not in {t for t, _ in self._files}]
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
            _write_text_atomic(index, json.dumps({"metadata": {"total_size": self.total_bytes},
                                                  "weight_map": weight_map}, indent=2) + "\n")
        elif index.exists():
            index.unlink()
        for p in stale:
            if p.name not in names:
                p.unlink(missing_ok=True)
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
    if not isinstance(load_dir, ShardedWeights):
        check_output_dir(save_dir, "hf", sources=[load_dir])  # before reading anything
    ckpt = load_dir if isinstance(load_dir, ShardedWeights) else MegatronCheckpoint(load_dir, iteration)
    check_hf_exportable(ckpt)
    cfg = hf_config_from_checkpoint(ckpt)
    if isinstance(ckpt, MegatronCheckpoint):
        ckpt.check_shards()  # every shard's header, names and shapes before anything is written
        ckpt.hf_assets_dir  # and the tokenizer files it recorded
    created = not Path(save_dir).exists()
    save_dir = prepare_output_dir(save_dir, overwrite, sources=_source_paths(ckpt) + _run_root(ckpt))
    written_dtype = None
    with ShardedSafetensorsWriter(save_dir, max_shard_bytes, remove_dir_on_abort=created, writer=writer_record(
            "megatron_fp4.models.hf_conversion.convert_megatron_to_hf")  # (no paths: the same input, the same bytes)
            ) as writer, progress_bar(num_hf_tensors(ckpt.model_args), "megatron->hf", progress) as bar:
        for name, t in iter_hf_tensors_from_megatron(ckpt):
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            written_dtype = written_dtype or t.dtype
            writer.add(name, t)
            bar.update(1)
    ckpt.write_hf_assets(save_dir)
    if written_dtype is not None:
        for key in [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]:
            cfg[key] = str(written_dtype).replace("torch.", "")
    _write_text_atomic(save_dir / "config.json", json.dumps(cfg, indent=2) + "\n")
    return save_dir


def _run_root(ckpt: ShardedWeights) -> list[Path]:
    """The checkpoint folder holding an iteration directory (the tracker's folder), to keep outputs out of it."""
    d = Path(ckpt.dir)
    return [d.parent] if d.name == "release" or d.name.startswith("iter_") else []
