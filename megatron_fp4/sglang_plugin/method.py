"""SGLang QuantizationConfig + LinearMethodBase for megatron-fp4 FP4 rollout (HiF4 / MXFP4 + Rollout-ResQ).

Each quantized linear keeps three parameters: ``weight`` (the high-precision loading target: SGLang's own
weight_loader, wrapped to mark the layer stale), ``weight_packed`` (uint8 ``[N, K/2]``, two FP4 codes per byte) and
``weight_scale`` (uint8 block metadata), the layout of :mod:`megatron_fp4.models.fp4_checkpoint`. The packed pair
is re-quantized from ``weight`` after loading and after every refit, in place: the Parameter objects and every
GEMM operand's storage (the dequantized reference operand, the kernels' prepared weight) survive, so CUDA graphs
captured over them stay valid. ``apply`` computes :func:`megatron_fp4.resq.rollout_linear` on the dequantized
packed weight: the reference quantizer's operands bit for bit. On devices with a registered rollout backend (the
Triton kernels on CUDA, ``megatron_fp4.rollout_kernels``) the backend computes the same numbers from its
prepared weight.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

import torch
from torch.nn import Parameter

from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.quantization.base_config import LinearMethodBase, QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.utils import set_weight_attrs

from megatron_fp4.formats import QuantizedTensor, get_format
from megatron_fp4.resq import (ROLLOUT_LINEAR_PATHS, QuantizedWeightCache, RolloutPrecision, copy_into,
                               rollout_backend_for, rollout_linear)
from megatron_fp4.sglang_plugin import fused
from megatron_fp4.sglang_plugin.options import QUANT_METHOD, PluginOptions

__all__ = ["MegatronFP4Config", "MegatronFP4LinearMethod", "requantize_stale_layers", "QUANT_METHOD"]

#: Prepared weights of a device backend (kernels), shared by every layer of this process.
_BACKEND_CACHE = QuantizedWeightCache()
#: Totals of this process's re-quantizations (count, seconds), for weight-sync timing; ``reallocated``: layers
#: whose GEMM operands a refit could not rewrite in place (new buffers: CUDA graphs captured before must be
#: recaptured).
REQUANT_STATS = {"layers": 0, "seconds": 0.0, "reallocated": 0}
#: ``MEGATRON_FP4_PLUGIN_TRACE=FILE``: each FP4 linear appends one JSON line at its first forward in this process
#: outside CUDA-graph capture and torch.compile tracing (for the kernels: the first whose input is not all zeros;
#: SGLang's warm-up forwards of dummy tokens can be), ``{"layer", "path": "kernels" | "reference", "device", "pid",
#: "fused_operand", "rel_diff_vs_reference", "reference_abs_max"}``: which path served it (``fused_operand``: its
#: operand came from the fused norm / SwiGLU before it, :mod:`fused`) and, for the kernels, how far their output is
#: from the PyTorch reference's on the same input, visible from outside SGLang's scheduler processes (the GPU tests
#: check that no layer silently fell back to the reference and that the kernels computed its numbers).
#: A debugging aid: the check costs a reference GEMM and a host sync per layer, once.
TRACE_ENV = "MEGATRON_FP4_PLUGIN_TRACE"
_BACKENDS_TRIED: set = set()


def _ensure_backend(device_type: str) -> None:
    """On first use of a CUDA device in this process, let the Triton kernels serve rollout GEMMs (when usable:
    ``megatron_fp4.rollout_kernels``; ``MEGATRON_FP4_KERNELS=0`` keeps the PyTorch reference)."""
    if device_type in _BACKENDS_TRIED:
        return
    _BACKENDS_TRIED.add(device_type)
    if device_type != "cuda" or os.environ.get("MEGATRON_FP4_KERNELS", "1") == "0":
        return
    if rollout_backend_for(device_type) is None:
        try:
            from megatron_fp4.rollout_kernels import register_kernel_backend

            register_kernel_backend(device_type)
        except Exception:  # pragma: no cover - the kernels are optional; the reference serves
            pass


class MegatronFP4Config(QuantizationConfig):
    """``--quantization megatron_fp4``: FP4 rollout linears; options from the HF ``quantization_config``."""

    def __init__(self, options: Optional[PluginOptions] = None, modules_not_quantized: Optional[List[str]] = None,
                 packed_checkpoint: bool = False) -> None:
        super().__init__()
        self.options = options or PluginOptions()
        #: HF module prefixes kept in high precision (e.g. from the exporter's high_precision_first_layers).
        self.modules_not_quantized = list(modules_not_quantized or [])
        #: The checkpoint stores weight_packed/weight_scale (an FP4 export) instead of high-precision weights.
        self.packed_checkpoint = packed_checkpoint
        if self.options.precision.bf16_sum_operand:
            fused.install()  # the norms and SwiGLUs before our linears make their operand (sglang_plugin/fused.py)

    def __repr__(self) -> str:
        return f"MegatronFP4Config({self.options})"

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> List[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # no tensor-core requirement: Triton kernels or the PyTorch reference

    @staticmethod
    def get_config_filenames() -> List[str]:
        return []

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "MegatronFP4Config":
        opts = PluginOptions.from_quant_config({k: v for k, v in config.items()
                                                if k not in ("packed_modules_mapping", "hf_config")})
        # An export of models/fp4_checkpoint lists its packed modules; modules it kept are HF names (no ".weight").
        return cls(opts, config.get("modules_not_quantized"), packed_checkpoint=bool(config.get("quantized_modules")))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None  # embeddings, lm_head: high precision (SPEC §3)
        if self._kept_high_precision(prefix):
            return UnquantizedLinearMethod()
        return MegatronFP4LinearMethod(self, prefix)

    def _kept_high_precision(self, prefix: str) -> bool:
        """Whether ``prefix`` (an SGLang module; fused ones such as qkv_proj expand to their HF parts) is listed
        in ``modules_not_quantized``; a fused module must be kept whole or quantized whole."""
        head, _, last = prefix.rpartition(".")
        parts = [f"{head}.{p}" if head else p for p in self.packed_modules_mapping.get(last, [])] or [prefix]
        kept = [any(p == m or p.startswith(m + ".") for m in self.modules_not_quantized) for p in parts]
        if any(kept) and not all(kept):
            raise ValueError(f"{QUANT_METHOD} quantization_config: modules_not_quantized lists only some of "
                             f"{parts}, which SGLang fuses into {prefix}; list all or none of them")
        return all(kept)

    def get_scaled_act_names(self) -> List[str]:
        return []


class MegatronFP4LinearMethod(LinearMethodBase):
    """FP4 weights stored packed, activations quantized per call with the Rollout-ResQ residual."""

    def __init__(self, config: MegatronFP4Config, prefix: str = "") -> None:
        self.config = config
        self.options = config.options
        self.precision = config.options.precision
        self.prefix = prefix
        #: The format, when a fused norm / SwiGLU may make this linear's operand (:mod:`fused`), else None.
        self.fused_operand_format = self.options.format if self.precision.bf16_sum_operand else None

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: List[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        self.options.check_linear(self.prefix, input_size_per_partition)
        fmt = get_format(self.options.format)
        n, k = sum(output_partition_sizes), input_size_per_partition
        nblocks = k // fmt.block_size
        loader = extra_weight_attrs.pop("weight_loader", None)
        scale_shape = (n, nblocks) if fmt.scale_bytes == 1 else (n, nblocks, fmt.scale_bytes)
        weight = Parameter(torch.zeros(n, k, dtype=params_dtype), requires_grad=False)
        packed = Parameter(torch.zeros(n, k // 2, dtype=torch.uint8), requires_grad=False)
        scale = Parameter(torch.zeros(scale_shape, dtype=torch.uint8), requires_grad=False)
        # Rows are output features (QKV / gate-up shards land by row); dim 1 is K (codes: 2 per byte, scales: one
        # entry per block), so a row-parallel split of whole blocks narrows all three the same way.
        for name, param, flag in (("weight", weight, "megatron_fp4_stale"),
                                  ("weight_packed", packed, "megatron_fp4_packed_loaded"),
                                  ("weight_scale", scale, "megatron_fp4_packed_loaded")):
            set_weight_attrs(param, {"input_dim": 1, "output_dim": 0})
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)
            if loader is not None:
                set_weight_attrs(param, {"weight_loader": _marking_loader(loader, layer, flag)})
        layer.megatron_fp4_stale = not self.config.packed_checkpoint
        layer.megatron_fp4_packed_loaded = False
        layer.megatron_fp4_from_packed = False
        layer.megatron_fp4_wq = None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if layer.megatron_fp4_packed_loaded and not layer.megatron_fp4_stale:
            self.adopt_packed(layer)
        else:
            self.requantize(layer)

    def adopt_packed(self, layer: torch.nn.Module) -> None:
        """Serve the loaded packed weight as is (an FP4 export: re-quantizing HiF4 values could change them);
        ``weight`` becomes its dequantized values so later partial refits start from them."""
        if not self.precision.quantize_weights:
            raise ValueError(f"{QUANT_METHOD}: mode={self.options.mode!r} keeps weights in high precision, but "
                             f"{self.prefix} was loaded from a packed FP4 checkpoint")
        fmt = get_format(self.options.format)
        w = layer.weight
        qt = QuantizedTensor(fmt, layer.weight_packed.data, layer.weight_scale.data, w.shape, 1, w.dtype)
        with torch.no_grad():
            wq = qt.dequantize()
            w.data.copy_(wq)
            _store_operand(layer, wq)
        layer.megatron_fp4_packed_loaded = False
        layer.megatron_fp4_stale = False
        layer.megatron_fp4_from_packed = True  # the reference path serves it (kernels re-quantize from weight)

    def requantize(self, layer: torch.nn.Module) -> float:
        """Quantize ``layer.weight`` into the packed parameters (in place) and refresh the GEMM operand."""
        t0 = time.perf_counter()
        with torch.no_grad():
            fmt = get_format(self.options.format)
            w = layer.weight.detach()
            _ensure_backend(w.device.type)
            if self.precision.quantize_weights:
                qt = fmt.quantize(w, dim=-1)
                layer.weight_packed.data.copy_(qt.codes)
                layer.weight_scale.data.copy_(qt.scales)
                _store_operand(layer, qt.dequantize())  # == fmt.fake_quantize(w): the reference operand
            else:
                layer.megatron_fp4_wq = None
            if rollout_backend_for(w.device.type) is not None:
                # the kernels' prepared weight (packed, expanded, decode layout) rewritten in place
                _BACKEND_CACHE.refresh([layer.weight], self.options.format, self.precision, in_place=True)
                if not _BACKEND_CACHE.last_refresh_in_place:
                    REQUANT_STATS["reallocated"] += 1
        layer.megatron_fp4_stale = False
        layer.megatron_fp4_packed_loaded = False
        layer.megatron_fp4_from_packed = False
        dt = time.perf_counter() - t0
        REQUANT_STATS["layers"] += 1
        REQUANT_STATS["seconds"] += dt
        return dt

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if layer.megatron_fp4_stale:
            self.requantize(layer)  # a refit that bypassed the re-quantizing loader
        elif layer.megatron_fp4_packed_loaded:
            self.adopt_packed(layer)
        precision, fused_operand = self.precision, fused.take(layer, x)
        if fused_operand:  # ResQ 2:4's bf16 sum already (K padded to the format's block): W4A16 on it
            x, precision = x[..., :layer.weight.shape[1]], RolloutPrecision("w4a16", precision.format)
        trace = os.environ.get(TRACE_ENV) if not getattr(layer, "megatron_fp4_traced", False) else None
        served_by_backend = ROLLOUT_LINEAR_PATHS["backend"]
        if rollout_backend_for(x.device.type) is not None and not layer.megatron_fp4_from_packed:
            y = rollout_linear(x, layer.weight, bias, precision, cache=_BACKEND_CACHE)
        else:
            y = rollout_linear(x, layer.weight, bias, precision, weight_q=layer.megatron_fp4_wq)
        if trace and not _capturing(x):
            self._trace(layer, x, bias, y, precision, trace, ROLLOUT_LINEAR_PATHS["backend"] > served_by_backend,
                        fused_operand)
        return y

    def _trace(self, layer, x, bias, y, precision: RolloutPrecision, trace: str, by_backend: bool,
               fused_operand: bool) -> None:
        """One trace line for ``layer`` (its first forward outside graph capture and compilation; for the kernels,
        the first whose input is not all zeros): the path that served it and, for the kernels, their
        largest difference from the PyTorch reference on the same input, relative to the reference's largest output
        (up to one rounding of the output dtype)."""
        row = {"layer": self.prefix, "path": "kernels" if by_backend else "reference", "device": x.device.type,
               "pid": os.getpid(), "fused_operand": fused_operand}
        if by_backend:
            if not bool(x.any()):  # nothing to compare (SGLang's warm-up forwards of dummy tokens): a later forward
                return
            ref = rollout_linear(x, layer.weight, bias, precision, weight_q=layer.megatron_fp4_wq).float()
            top = row["reference_abs_max"] = float(ref.abs().max())  # > 0: the comparison saw a real output
            row["rel_diff_vs_reference"] = float((y.float() - ref).abs().max()) / max(top, 1e-30)
        layer.megatron_fp4_traced = True
        with open(trace, "a") as f:
            f.write(json.dumps(row) + "\n")


def _capturing(x: torch.Tensor) -> bool:
    """Whether this forward is being captured into a CUDA graph or traced by torch.compile (no host syncs there)."""
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _store_operand(layer: torch.nn.Module, wq: torch.Tensor) -> None:
    """``layer.megatron_fp4_wq = wq``, written into the existing tensor where there is one of the same shape,
    dtype and device (CUDA graphs captured its address); a first build or a change allocates."""
    old = getattr(layer, "megatron_fp4_wq", None)
    if old is not None and copy_into(old, wq):
        return
    if old is not None:
        REQUANT_STATS["reallocated"] += 1
    layer.megatron_fp4_wq = wq


def _marking_loader(loader, layer: torch.nn.Module, flag: str):
    """SGLang's weight loader for ``layer``, then ``layer.<flag> = True`` (what was loaded, for re-quantization)."""
    def weight_loader(param, loaded_weight, *args, **kwargs):
        out = loader(param, loaded_weight, *args, **kwargs)
        setattr(layer, flag, True)
        return out

    return weight_loader


def requantize_stale_layers(model: torch.nn.Module) -> dict:
    """Bring every megatron-fp4 linear loaded since its last quantization up to date: re-quantize a new
    high-precision weight, or adopt newly loaded packed FP4 tensors."""
    t0 = time.perf_counter()
    n = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, MegatronFP4LinearMethod):
            continue
        if module.megatron_fp4_stale:
            method.requantize(module)
            n += 1
        elif module.megatron_fp4_packed_loaded:
            method.adopt_packed(module)
            n += 1
    return {"layers": n, "seconds": time.perf_counter() - t0}
