"""The plug-in's options (format, Rollout-ResQ sparsity and combine, mode) parsed from a ``quantization_config``;
no SGLang.

    opts = PluginOptions.from_quant_config({"quant_method": "megatron_fp4", "format": "hif4", "resq": "2:4"})
    opts.precision            # RolloutPrecision("w4a4", "hif4", "2:4"): what every quantized linear computes
    opts.check_linear("model.layers.0.mlp.down_proj", in_features=256)   # raises if K cannot be packed

Keys (those of :mod:`megatron_fp4.models.fp4_checkpoint`'s ``quantization_config``, plus ``mode``):
``format`` (hif4 | mxfp4 | mxfp4_rceil), ``resq`` or ``sparsity`` (none | 2:4 | channel | tile32x64 | dense),
``activation_format`` (the format, or "none" for weight-only W4A16), ``mode`` (w4a4 | w4a16 | w16a4),
``resq_combine`` (exact | bf16: ResQ as one GEMM on bf16(Q(X) + S(Q(R))), see ``RolloutPrecision.resq_combine``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from megatron_fp4.formats import get_format
from megatron_fp4.resq import RESQ_COMBINES, SPARSITIES, RolloutPrecision

__all__ = ["QUANT_METHOD", "PLUGIN_FORMATS", "PLUGIN_MODES", "PluginOptions", "quant_config_dict"]

#: The SGLang quantization-method name (also the ``quant_method`` of the FP4 checkpoint exporter).
QUANT_METHOD = "megatron_fp4"
#: Formats the plug-in serves (HiF4 and OCP MXFP4, floor or rceil scale).
PLUGIN_FORMATS = ("hif4", "mxfp4", "mxfp4_rceil")
#: Rollout forms with at least one FP4 operand ("bf16" means: do not pass a quantization method at all).
PLUGIN_MODES = ("w4a4", "w4a16", "w16a4")


def _bad(key: str, value: Any, allowed) -> ValueError:
    return ValueError(f"{QUANT_METHOD} quantization_config: {key}={value!r} is not valid; allowed values: "
                      f"{', '.join(map(repr, allowed))}")


@dataclass(frozen=True)
class PluginOptions:
    """Validated plug-in options; :attr:`precision` is the rollout form every quantized linear computes."""

    format: str = "hif4"
    sparsity: str = "none"
    mode: str = "w4a4"
    resq_combine: str = "exact"

    def __post_init__(self) -> None:
        if self.format not in PLUGIN_FORMATS:
            raise _bad("format", self.format, PLUGIN_FORMATS)
        if self.sparsity not in SPARSITIES:
            raise _bad("resq", self.sparsity, SPARSITIES)
        if self.mode not in PLUGIN_MODES:
            raise _bad("mode", self.mode, PLUGIN_MODES)
        if self.mode == "w4a16" and self.sparsity != "none":
            raise ValueError(f"{QUANT_METHOD} quantization_config: resq={self.sparsity!r} needs quantized "
                             f"activations; mode='w4a16' keeps them in high precision (use resq='none')")
        if self.resq_combine not in RESQ_COMBINES:
            raise _bad("resq_combine", self.resq_combine, RESQ_COMBINES)
        if self.resq_combine != "exact" and self.sparsity == "none":
            raise ValueError(f"{QUANT_METHOD} quantization_config: resq_combine={self.resq_combine!r} needs a ResQ "
                             f"residual (resq other than 'none')")

    @property
    def precision(self) -> RolloutPrecision:
        """The reference rollout form (megatron_fp4.resq.rollout_linear) these options select."""
        return RolloutPrecision(self.mode, self.format, self.sparsity, resq_combine=self.resq_combine)

    @property
    def block_size(self) -> int:
        """Values per scale block of the format (the packing granularity along K)."""
        return get_format(self.format).block_size

    @classmethod
    def from_precision(cls, precision: RolloutPrecision) -> "PluginOptions":
        """Options serving ``precision`` (its mode must quantize something; activation_method must be "resq")."""
        if precision.mode == "bf16":
            raise ValueError("RolloutPrecision mode 'bf16' needs no quantization method")
        if precision.activation_method != "resq":
            raise ValueError(f"activation_method={precision.activation_method!r} is not served by the SGLang "
                             f"plug-in; allowed values: 'resq'")
        return cls(precision.format, precision.sparsity, precision.mode, precision.resq_combine)

    @classmethod
    def from_quant_config(cls, config: Optional[Mapping[str, Any]]) -> "PluginOptions":
        """Parse a ``quantization_config`` dict (missing keys take the defaults: hif4, resq none, w4a4)."""
        config = dict(config or {})
        method = config.get("quant_method", QUANT_METHOD)
        if method != QUANT_METHOD:
            raise _bad("quant_method", method, (QUANT_METHOD,))
        fmt = config.get("format", "hif4")
        if "resq" in config and "sparsity" in config and config["resq"] != config["sparsity"]:
            raise ValueError(f"{QUANT_METHOD} quantization_config: resq={config['resq']!r} and "
                             f"sparsity={config['sparsity']!r} disagree; give one of them")
        sparsity = config.get("resq", config.get("sparsity", "none"))
        mode = config.get("mode")
        act = config.get("activation_format", None)
        if act == "none":
            mode = mode or "w4a16"
        elif act is not None and act != fmt:
            raise ValueError(f"{QUANT_METHOD} quantization_config: activation_format={act!r} is not valid; "
                             f"allowed values: {fmt!r} (the weight format) or 'none'")
        return cls(fmt, sparsity, mode or "w4a4", config.get("resq_combine", "exact"))

    def check_linear(self, prefix: str, in_features: int) -> None:
        """Raise unless a linear with ``in_features`` per rank (K) can be stored packed: whole blocks per row."""
        b = self.block_size
        if in_features <= 0 or in_features % b:
            raise ValueError(
                f"{QUANT_METHOD}: format={self.format!r} packs weights in blocks of {b} along in_features, but "
                f"linear {prefix or '<unnamed>'} has in_features={in_features} per tensor-parallel rank, not a "
                f"multiple of {b}; choose another format or keep this model in bf16")

    def to_quant_config(self) -> dict:
        """The ``quantization_config`` dict that selects these options."""
        return quant_config_dict(self.format, self.sparsity, self.mode, self.resq_combine)


def quant_config_dict(format: str = "hif4", sparsity: str = "none", mode: str = "w4a4",
                      resq_combine: str = "exact") -> dict:
    """A minimal ``quantization_config`` for an HF config.json (or SGLang's ``json_model_override_args``)."""
    return {"quant_method": QUANT_METHOD, "format": format, "resq": sparsity, "mode": mode,
            "resq_combine": resq_combine}
