"""FP4 rollout checkpoints: an HF-style folder whose transformer-block linears are stored packed (SPEC §2.4).

For every quantized linear ``M`` (``model.layers.i.self_attn.{q,k,v,o}_proj``, ``model.layers.i.mlp.{gate,up,down}
_proj``) the folder stores, instead of ``M.weight``:

    M.weight_packed        uint8 [out_features, K_pad // 2]    QuantizedTensor.codes (element 2i in the low nibble)
    M.weight_scale         uint8 [out_features, K_pad // block(, scale_bytes)]   QuantizedTensor.scales
    M.weight_global_scale  float32 []                         only for formats with a per-tensor scale (nvfp4)

quantized along in_features (the GEMM reduction dim K, zero-padded to K_pad, a multiple of the block), exactly
``get_format(fmt).quantize(weight, dim=-1)`` of the reference quantizer. Biases, embeddings, norms and lm_head stay
in the source dtype under their HF names. ``config.json`` carries::

    "quantization_config": {"quant_method": "megatron_fp4", "version": 1, "format": "hif4", "block_size": 64,
      "bits_per_value": 4.5, "scale_bytes_per_block": 4, "group_dim": "in_features", "activation_format": "hif4",
      "resq": "2:4", "resq_combine": "exact", "weight_tensors": {...},
      "quantized_modules": {name: {"shape": [N, K], "dtype": "bfloat16"}}, "modules_not_quantized": [...],
      "high_precision_first_layers": 0, "high_precision_last_layers": 0}

``resq``, ``resq_combine`` and ``activation_format`` do not change the stored weights: they tell the rollout engine
how to quantize activations (SPEC §4; ``megatron_fp4.resq.RolloutPrecision``). :func:`load_fp4_checkpoint` returns
the dequantized HF state dict (== fake-quantized weights) and the packed tensors; ``load_gpt(folder)`` builds the
megatron-core model from it.

HiF4 fake quantization is not idempotent (re-quantizing dequantized HiF4 weights can change them; MXFP4's is the
identity), so an engine serving this folder must take the stored weights as its FP4 weights, not quantize again.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch

from megatron_fp4.formats import QuantizedTensor, get_format, registered_formats
from megatron_fp4.models.checkpoint_io import (_write_text_atomic, dtype_from_name, dtype_name, is_megatron_checkpoint,
                                              MegatronCheckpoint, ShardedWeights)
from megatron_fp4.models.hf_conversion import (
    HFFolderSource,
    _run_root,
    _source_paths,
    check_hf_exportable,
    ShardedSafetensorsWriter,
    progress_bar,
    copy_hf_assets,
    hf_config_from_checkpoint,
    iter_hf_tensors_from_megatron,
    model_args_from_hf_config,
    num_hf_tensors,
    prepare_output_dir,
    check_hf_shapes,
)
from megatron_fp4.models.safetensors_io import writer_record
from megatron_fp4.ownership import check_output_dir
from megatron_fp4.resq import RESQ_COMBINES, SPARSITIES

__all__ = [
    "QUANT_METHOD",
    "RESQ_SPARSITIES",
    "EXPORT_FORMATS",
    "QUANTIZED_LINEARS",
    "FP4Checkpoint",
    "FP4FolderSource",
    "export_fp4_checkpoint",
    "load_fp4_checkpoint",
]

QUANT_METHOD = "megatron_fp4"
QUANT_CONFIG_VERSION = 1
#: Rollout-ResQ sparsity patterns (SPEC §4).
RESQ_SPARSITIES = SPARSITIES
#: Formats the exporter offers on the command line (any registered format works from Python).
EXPORT_FORMATS = ("hif4", "mxfp4")
#: Linear modules of a transformer block that are stored in FP4 (HF names, relative to model.layers.i).
QUANTIZED_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_LINEAR_RE = re.compile(r"(model\.layers\.(\d+)\.(?:" + "|".join(re.escape(m) for m in QUANTIZED_LINEARS)
                        + r"))\.weight")
PACKED, SCALE, GLOBAL_SCALE = "weight_packed", "weight_scale", "weight_global_scale"
#: safetensors metadata key recording, in every file of an export, the format and the (shape, dtype) of the
#: modules whose packed weights it holds: verified against config.json's quantization_config on load.
QUANT_META_KEY = "megatron_fp4.quantization"


def _quantized_module(name: str, num_layers: int, first_hp: int, last_hp: int) -> Optional[str]:
    """Module name if HF tensor ``name`` is the weight of a linear that is stored in FP4, else None."""
    m = _LINEAR_RE.fullmatch(name)
    if not m:
        return None
    layer = int(m.group(2)) + 1  # 1-based, as FP4Recipe.keeps_layer_in_high_precision counts
    if layer <= first_hp or layer > num_layers - last_hp:
        return None
    return m.group(1)


def _source_for(path: Union[str, os.PathLike, ShardedWeights]):
    """(config dict, iterator of (HF name, tensor), tensor count, writer of the tokenizer files into a folder) for an
    HF folder, a megatron checkpoint or any :class:`ShardedWeights` (e.g. an RL checkpoint)."""
    if isinstance(path, ShardedWeights) or is_megatron_checkpoint(path):
        ckpt = path if isinstance(path, ShardedWeights) else MegatronCheckpoint(path)
        check_hf_exportable(ckpt)
        if isinstance(ckpt, MegatronCheckpoint):
            ckpt.check_shards()  # every shard's header, names and shapes before anything is written
            ckpt.hf_assets_dir  # and the tokenizer files it recorded
        return (hf_config_from_checkpoint(ckpt), iter_hf_tensors_from_megatron(ckpt),
                num_hf_tensors(ckpt.model_args), ckpt.write_hf_assets)
    path = Path(path)
    src = HFFolderSource(path)
    qc = src.config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD:
        raise ValueError(f"{path} is already an FP4 export; export from the high-precision checkpoint")
    if qc is not None:
        raise ValueError(f"{src.config_where}: has a quantization_config ({str(qc)[:80]}); export from a "
                         f"high-precision checkpoint")
    margs = model_args_from_hf_config(src.config, src.config_where)
    check_hf_shapes(src, margs)
    keys = src.keys()
    order = {k: i for i, k in enumerate(_hf_order(margs))}
    keys = sorted(keys, key=lambda k: (order.get(k, len(order)), k))
    return src.config, ((k, src.get(k)) for k in keys), len(keys), lambda dst: copy_hf_assets(path, dst)


def _hf_order(margs: dict) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for i in range(margs["num_layers"]):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight"]
        for x in "qkv":
            names += [f"{p}self_attn.{x}_proj.weight", f"{p}self_attn.{x}_proj.bias"]
        names += [p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight", p + "mlp.gate_proj.weight",
                  p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
    return names + ["model.norm.weight", "lm_head.weight"]


def export_fp4_checkpoint(source: Union[str, os.PathLike, ShardedWeights], save_dir: Union[str, os.PathLike],
                          format: str = "hif4", resq: str = "none", activation_format: Optional[str] = None,
                          resq_combine: str = "exact",
                          high_precision_first_layers: int = 0, high_precision_last_layers: int = 0,
                          max_shard_bytes: int = 5 * 2**30, progress: bool = True, overwrite: bool = False
                          ) -> Path:
    """Write the FP4 rollout checkpoint of ``source`` (an HF folder, a megatron-fp4 checkpoint, or any
    :class:`ShardedWeights`: an RL run through ``megatron_fp4.rl.export.open_checkpoint``) to ``save_dir``."""
    if format not in registered_formats():
        raise ValueError(f"--format {format!r} is not valid; allowed values: {', '.join(EXPORT_FORMATS)} "
                         f"(or a registered format: {', '.join(registered_formats())})")
    if resq not in RESQ_SPARSITIES:
        raise ValueError(f"--resq {resq!r} is not valid; allowed values: {', '.join(RESQ_SPARSITIES)}")
    if resq_combine not in RESQ_COMBINES:
        raise ValueError(f"--resq-combine {resq_combine!r} is not valid; allowed values: {', '.join(RESQ_COMBINES)}")
    if resq_combine != "exact" and resq == "none":
        raise ValueError(f"--resq-combine {resq_combine!r} needs a ResQ residual (--resq other than 'none')")
    activation_format = activation_format or format
    if activation_format not in registered_formats() + ("none",):
        raise ValueError(f"--activation-format {activation_format!r} is not valid; allowed values: none, "
                         f"{', '.join(registered_formats())}")
    for name, v in (("high_precision_first_layers", high_precision_first_layers),
                    ("high_precision_last_layers", high_precision_last_layers)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"--{name.replace('_', '-')} {v!r} is not valid; expected an integer >= 0")
    fmt = get_format(format)
    sources = (_source_paths(source) + _run_root(source) if isinstance(source, ShardedWeights)
               else [Path(source)])
    check_output_dir(save_dir, "hf", sources=sources)  # before reading anything
    config, tensors, count, write_assets = _source_for(source)
    margs = model_args_from_hf_config(config)
    num_layers = margs["num_layers"]
    created = not Path(save_dir).exists()
    save_dir = prepare_output_dir(save_dir, overwrite, sources=sources)
    quantized: dict[str, dict] = {}

    def file_metadata(names: list[str]) -> dict[str, str]:  # how to read this file's packed tensors (verified)
        return {QUANT_META_KEY: json.dumps({"format": format, "block_size": fmt.block_size, "modules": {
            m: quantized[m] for m in quantized if f"{m}.{PACKED}" in names}}, sort_keys=True)}

    kept: list[str] = []
    with ShardedSafetensorsWriter(save_dir, max_shard_bytes, metadata_fn=file_metadata, remove_dir_on_abort=created,
                                  writer=writer_record("megatron_fp4.models.fp4_checkpoint.export_fp4_checkpoint",
                                                       format=format)
                                  ) as writer, progress_bar(count, f"export {format}", progress) as bar:
        for name, w in tensors:
            module = _quantized_module(name, num_layers, high_precision_first_layers, high_precision_last_layers)
            if module is None:
                writer.add(name, w)
                if name.endswith(".weight"):
                    kept.append(name[: -len(".weight")])
            else:
                qt = fmt.quantize(w, dim=-1)
                quantized[module] = {"shape": list(w.shape), "dtype": dtype_name(w.dtype)}
                writer.add(f"{module}.{PACKED}", qt.codes)
                writer.add(f"{module}.{SCALE}", qt.scales)
                if qt.global_scale is not None:
                    writer.add(f"{module}.{GLOBAL_SCALE}", qt.global_scale.reshape(()).to(torch.float32))
            bar.update(1)
    write_assets(save_dir)
    qc = {
        "quant_method": QUANT_METHOD,
        "version": QUANT_CONFIG_VERSION,
        "format": format,
        "block_size": fmt.block_size,
        "bits_per_value": fmt.bits_per_value,
        "scale_bytes_per_block": fmt.scale_bytes,
        "has_global_scale": bool(fmt.has_global_scale),
        "group_dim": "in_features",
        "activation_format": activation_format,
        "resq": resq,
        "resq_combine": resq_combine,
        "weight_tensors": {
            "packed": f"{PACKED}: uint8 [out_features, ceil(in_features / block_size) * block_size / 2], two "
                      f"4-bit codes per byte, element 2i in the low nibble",
            "scale": f"{SCALE}: uint8 [out_features, n_blocks" + (", scale_bytes]" if fmt.scale_bytes > 1 else "]")
                     + " block metadata in the format's byte layout (SPEC 2.4)",
            **({"global_scale": f"{GLOBAL_SCALE}: float32 scalar"} if fmt.has_global_scale else {}),
        },
        "high_precision_first_layers": high_precision_first_layers,
        "high_precision_last_layers": high_precision_last_layers,
        "quantized_modules": quantized,
        "modules_not_quantized": kept,
    }
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    config["quantization_config"] = qc
    _write_text_atomic(save_dir / "config.json", json.dumps(config, indent=2) + "\n")
    return save_dir


class FP4FolderSource(HFFolderSource):
    """An FP4 export read as HF-named high-precision tensors: ``M.weight`` is dequantized on access."""

    def __init__(self, path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(path)
        where = self.config_where
        qc = self.config.get("quantization_config") or {}
        if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
            raise ValueError(f"{self.path}/config.json has no quantization_config with quant_method "
                             f"{QUANT_METHOD!r}: not an FP4 export of tools/export_fp4_checkpoint.py")
        version = qc.get("version", 0)
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"{where}: quantization_config version={version!r} is not an integer")
        if version > QUANT_CONFIG_VERSION:
            raise ValueError(f"{where}: quantization_config version {version} is newer than this reader")
        self.quantization_config = qc
        if qc.get("format") not in registered_formats():
            raise ValueError(f"{where}: quantization_config format={qc.get('format')!r} is not valid; allowed "
                             f"values: {', '.join(registered_formats())}")
        self.format = get_format(qc["format"])
        if self.format.block_size != qc.get("block_size"):
            raise ValueError(f"{where}: quantization_config block_size {qc.get('block_size')!r} does not match "
                             f"format {qc['format']} ({self.format.block_size})")
        modules = qc.get("quantized_modules")
        if not isinstance(modules, dict):
            raise ValueError(f"{where}: quantization_config quantized_modules is missing or not an object")
        for module, info in modules.items():
            shape = info.get("shape") if isinstance(info, dict) else None
            ok = (isinstance(shape, list) and len(shape) == 2
                  and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape))
            try:
                dtype_ok = ok and dtype_from_name(info.get("dtype")) is not None
            except ValueError:
                dtype_ok = False
            if not dtype_ok:
                raise ValueError(f"{where}: quantization_config quantized_modules[{module!r}] = {info!r} is not "
                                 f"valid; expected {{\"shape\": [out, in] (integers >= 1), \"dtype\": \"bfloat16\" / "
                                 f"\"float16\" / \"float32\"}}")
        self.modules: dict[str, dict] = modules
        self.out_dtype = dtype
        for module in self.modules:
            for t in (PACKED, SCALE) + ((GLOBAL_SCALE,) if self.format.has_global_scale else ()):
                if f"{module}.{t}" not in self.weight_map:
                    raise KeyError(f"{module}.{t} is missing from {self.path}")
            for t in (PACKED, SCALE):
                dt = super().dtype(f"{module}.{t}")
                if dt != torch.uint8:
                    raise ValueError(f"{self.where(f'{module}.{t}')}: {module}.{t} has dtype "
                                     f"{str(dt).replace('torch.', '')}, expected uint8")
            self._check_packed_shapes(module)
        self._check_recorded_quantization()

    def _check_recorded_quantization(self) -> None:
        """config.json's format and quantized modules agree with what each file recorded when it was written."""
        qc = self.quantization_config
        for f in sorted(set(self.weight_map.values())):
            meta = self._file(f).metadata.get(QUANT_META_KEY)
            if meta is None:
                continue  # written before files recorded it
            try:
                rec = json.loads(meta)
                rec_modules = dict(rec["modules"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{self.path / f}: its {QUANT_META_KEY} record is damaged") from None
            bad = None
            if rec.get("format") != qc["format"] or rec.get("block_size") != qc["block_size"]:
                bad = f"format {rec.get('format')!r} / block_size {rec.get('block_size')!r}"
            else:
                for m, info in rec_modules.items():
                    if self.modules.get(m) != info:
                        bad = f"{m} = {info}"
                        break
            if bad is not None:
                raise ValueError(f"{self.config_where}: quantization_config does not match what {self.path / f} "
                                 f"recorded when it was written ({bad}): config.json was edited or damaged")

    def _check_packed_shapes(self, module: str) -> None:
        shape = self.modules[module]["shape"]
        n_blocks = -(-shape[1] // self.format.block_size)
        want_codes = (shape[0], n_blocks * self.format.block_size // 2)
        want_scales = (shape[0], n_blocks) + ((self.format.scale_bytes,) if self.format.scale_bytes > 1 else ())
        codes, scales = super().shape(f"{module}.{PACKED}"), super().shape(f"{module}.{SCALE}")
        if codes != want_codes or scales != want_scales:
            raise ValueError(f"{self.where(f'{module}.{PACKED}')}: {module}: packed shapes {codes} / {scales} do not "
                             f"match weight shape {tuple(shape)} in format {self.format.name} (expected {want_codes} "
                             f"/ {want_scales})")
        if self.format.has_global_scale:
            gs = f"{module}.{GLOBAL_SCALE}"
            if super().shape(gs) not in ((), (1,)) or super().dtype(gs) != torch.float32:
                raise ValueError(f"{self.where(gs)}: {gs} must be a float32 scalar")

    def _module_of(self, name: str) -> Optional[str]:
        if name.endswith(".weight") and name[: -len(".weight")] in self.modules:
            return name[: -len(".weight")]
        return None

    def keys(self) -> list[str]:
        out = []
        for k in self.weight_map:
            for suffix in (PACKED, SCALE, GLOBAL_SCALE):
                if k.endswith("." + suffix):
                    if suffix == PACKED:
                        out.append(k[: -len(suffix)] + "weight")
                    break
            else:
                out.append(k)
        return out

    def has(self, name: str) -> bool:
        return self._module_of(name) is not None or name in self.weight_map

    def quantized(self, module: str) -> QuantizedTensor:
        """The packed QuantizedTensor of one quantized linear module."""
        info = self.modules[module]
        codes = super().get(f"{module}.{PACKED}")
        scales = super().get(f"{module}.{SCALE}")
        gs = super().get(f"{module}.{GLOBAL_SCALE}") if self.format.has_global_scale else None
        shape = torch.Size(info["shape"])
        return QuantizedTensor(fmt=self.format, codes=codes, scales=scales, shape=shape, dim=1,
                               dtype=dtype_from_name(info["dtype"]), global_scale=gs)

    def get(self, name: str) -> torch.Tensor:
        module = self._module_of(name)
        if module is None:
            t = super().get(name)
            return t.to(self.out_dtype) if self.out_dtype is not None and t.is_floating_point() else t
        w = self.quantized(module).dequantize()
        return w.to(self.out_dtype) if self.out_dtype is not None else w

    def shape(self, name: str) -> tuple[int, ...]:
        module = self._module_of(name)
        return tuple(self.modules[module]["shape"]) if module is not None else super().shape(name)

    def dtype(self, name: str) -> torch.dtype:
        module = self._module_of(name)
        if module is not None:
            return self.out_dtype or dtype_from_name(self.modules[module]["dtype"])
        return self.out_dtype or super().dtype(name)


@dataclass
class FP4Checkpoint:
    """A loaded FP4 export: config, quantization_config, the dequantized HF state dict and the packed linears."""

    config: dict
    quantization_config: dict
    #: HF-named tensors; quantized linears as ``M.weight`` = dequantized (== fake-quantized original) weights.
    state_dict: dict[str, torch.Tensor]
    #: module name -> packed QuantizedTensor (only when ``load_fp4_checkpoint(..., packed=True)``).
    quantized: dict[str, QuantizedTensor] = field(default_factory=dict)


def load_fp4_checkpoint(path: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None, packed: bool = False
                        ) -> FP4Checkpoint:
    """Load an FP4 export: dequantized HF state dict (in the source dtype, or ``dtype``) and optionally the packed
    QuantizedTensors. ``load_gpt(path)`` builds the megatron-core model directly."""
    src = FP4FolderSource(path, dtype)
    src.model_args()  # config.json's model and every tensor it implies, present with its shape
    state = {k: src.get(k) for k in src.keys()}
    quantized = {m: src.quantized(m) for m in src.modules} if packed else {}
    return FP4Checkpoint(config=src.config, quantization_config=src.quantization_config, state_dict=state,
                         quantized=quantized)
