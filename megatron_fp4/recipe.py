"""Transformer-Engine-style FP4 recipes and the ``fp4_autocast`` context.

A recipe is a frozen dataclass that says how the three GEMMs of every FP4 linear are quantized (SPEC §3):
which format each tensor role uses, how gradients are rounded, whether a random Hadamard transform is applied
to the wgrad operands, which GEMMs are quantized at all and which transformer layers stay in high precision.
A recipe built with no arguments is the paper's setting: all three GEMMs quantized in the recipe's format,
round-to-nearest everywhere, no Hadamard transform, every layer in FP4.

    with fp4_autocast(recipe=HiF4BlockScaling()):
        y = model(x)          # FP4 linears read the active recipe

Names: these are emulated block-FP4 recipes of this package, not Transformer Engine's. ``HiF4BlockScaling`` and
``MXFP4BlockScaling`` have no TE namesake. The NVFP4 comparison recipe is ``NVFP4BlockScaling1D``: TE's
``NVFP4BlockScaling`` defaults to 16x16 (2D) weight blocks, a random Hadamard transform on the wgrad operands and
stochastic rounding of gradients, and this one quantizes 1D 16-value blocks everywhere with round-to-nearest (the
comparison setting of the other recipes). ``NVFP4BlockScaling`` is kept as a deprecated alias that warns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

from megatron_fp4.formats import Format, get_format, registered_formats
from megatron_fp4.formats.base import choice_error
from megatron_fp4.ops import GEMM_MODES

ROLES = ("weight", "activation", "gradient")
ROUNDINGS = ("nearest", "stochastic")
HADAMARD_BLOCK_SIZES = (16, 32, 64)


@dataclass(frozen=True)
class FP4Recipe:
    """Base FP4 recipe; use one of the per-format subclasses, or this one with explicit formats."""

    #: Format name (see ``megatron_fp4.formats.registered_formats()``) for weights, in every GEMM.
    weight_format: str = "hif4"
    #: Format name for activations (fprop input X, and X^T in wgrad).
    activation_format: str = "hif4"
    #: Format name for output gradients dY (dgrad and wgrad).
    gradient_format: str = "hif4"
    #: Rounding of gradient elements: "nearest" or "stochastic" (unbiased). Weights and activations always round
    #: to nearest (stochastic rounding is allowed for gradients only, SPEC §3).
    gradient_rounding: str = "nearest"
    #: Apply a random Hadamard transform along the token dimension to both wgrad operands before quantizing.
    hadamard_wgrad: bool = False
    #: Block size of that transform (16, 32 or 64).
    hadamard_block_size: int = 16
    #: Seed of the Hadamard random signs (the same signs must multiply both operands).
    hadamard_seed: int = 0
    #: Quantize the forward GEMM Y = X W^T.
    quantize_fprop: bool = True
    #: Quantize the data-gradient GEMM dX = dY W. False with quantize_wgrad=False is "FP4 forward, BF16 backward".
    quantize_dgrad: bool = True
    #: Quantize the weight-gradient GEMM dW = dY^T X.
    quantize_wgrad: bool = True
    #: Number of leading transformer layers kept in high precision.
    high_precision_first_layers: int = 0
    #: Number of trailing transformer layers kept in high precision.
    high_precision_last_layers: int = 0
    #: How the GEMM kernels multiply (``megatron_fp4.ops.GEMM_MODES``): "exact" (fp32 accumulation of the exact
    #: products), or for MXFP4 "fp8" / "fp8_fast": the three GEMMs on the FP8 tensor cores (promoted / Hopper's
    #: default accumulation, and values under 2^-29 (E5M2: activations, gradients) or 2^-16 (E4M3: weights, and
    #: X^T in wgrad) of their row's largest flushed to zero; approximate, see docs/PERFORMANCE.md). The PyTorch
    #: reference computes every mode exactly.
    gemm_mode: str = "exact"

    def __post_init__(self) -> None:
        valid = registered_formats()
        for role in ROLES:
            name = getattr(self, f"{role}_format")
            if not isinstance(name, str) or name not in valid:
                raise choice_error(f"{role}_format", name, valid)
        if self.gradient_rounding not in ROUNDINGS:
            raise choice_error("gradient_rounding", self.gradient_rounding, ROUNDINGS)
        if self.hadamard_block_size not in HADAMARD_BLOCK_SIZES:
            raise choice_error("hadamard_block_size", self.hadamard_block_size, HADAMARD_BLOCK_SIZES)
        for field in ("high_precision_first_layers", "high_precision_last_layers"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{field}={value!r} is not valid; it must be an integer >= 0")
        if self.gemm_mode not in GEMM_MODES:
            raise choice_error("gemm_mode", self.gemm_mode, GEMM_MODES)
        if self.gemm_mode != "exact" and not self.weight_format.startswith("mxfp4"):
            raise ValueError(f"gemm_mode={self.gemm_mode!r} needs MXFP4 weights (weight_format "
                             f"{self.weight_format!r}: its GEMMs run exact on BF16 tensor cores); use 'exact'")
        for field in ("hadamard_wgrad", "quantize_fprop", "quantize_dgrad", "quantize_wgrad"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field}={getattr(self, field)!r} is not valid; allowed values: True, False")

    def format(self, role: str) -> Format:
        """The Format object for a tensor role: "weight", "activation" or "gradient"."""
        if role not in ROLES:
            raise choice_error("role", role, ROLES)
        return get_format(getattr(self, f"{role}_format"))

    def rounding(self, role: str) -> str:
        """Rounding mode for a tensor role (only gradients may be stochastic)."""
        if role not in ROLES:
            raise choice_error("role", role, ROLES)
        return self.gradient_rounding if role == "gradient" else "nearest"

    def keeps_layer_in_high_precision(self, layer_number: int, num_layers: int) -> bool:
        """Whether transformer layer ``layer_number`` (1-based, of ``num_layers``) stays out of FP4."""
        if not 1 <= layer_number <= num_layers:
            raise ValueError(f"layer_number={layer_number} must be in [1, {num_layers}]")
        return (layer_number <= self.high_precision_first_layers
                or layer_number > num_layers - self.high_precision_last_layers)

    def replace(self, **changes) -> "FP4Recipe":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class HiF4BlockScaling(FP4Recipe):
    """HiFloat4 everywhere: 64-value units, E6M2 + two 1-bit micro-exponent levels (4.5 bits/value)."""

    weight_format: str = "hif4"
    activation_format: str = "hif4"
    gradient_format: str = "hif4"


@dataclass(frozen=True)
class MXFP4BlockScaling(FP4Recipe):
    """OCP MXFP4 everywhere: 32-value blocks, E8M0 scale (4.25 bits/value).

    ``scale_mode="rceil"`` switches every role left at "mxfp4" to NVIDIA's rceil scale (never clips).
    """

    weight_format: str = "mxfp4"
    activation_format: str = "mxfp4"
    gradient_format: str = "mxfp4"
    #: "floor" (OCP v1.0, the default) or "rceil".
    scale_mode: str = "floor"

    def __post_init__(self) -> None:
        if self.scale_mode not in ("floor", "rceil"):
            raise choice_error("scale_mode", self.scale_mode, ("floor", "rceil"))
        if self.scale_mode == "rceil":
            for role in ROLES:
                if getattr(self, f"{role}_format") == "mxfp4":
                    object.__setattr__(self, f"{role}_format", "mxfp4_rceil")
        super().__post_init__()


@dataclass(frozen=True)
class NVFP4BlockScaling1D(FP4Recipe):
    """NVFP4 everywhere (comparison format): 1D 16-value blocks for every tensor, E4M3 block scale, fp32 tensor
    scale, round-to-nearest, no Hadamard transform. Not Transformer Engine's ``NVFP4BlockScaling``, whose defaults
    add 2D (16x16) weight blocks, a random Hadamard transform on the wgrad operands and stochastic gradient
    rounding (``gradient_rounding="stochastic"`` and ``hadamard_wgrad=True`` give the last two here)."""

    weight_format: str = "nvfp4"
    activation_format: str = "nvfp4"
    gradient_format: str = "nvfp4"


RECIPES = {"hif4": HiF4BlockScaling, "mxfp4": MXFP4BlockScaling, "nvfp4": NVFP4BlockScaling1D}


def __getattr__(name: str):
    """``NVFP4BlockScaling``: the old name of :class:`NVFP4BlockScaling1D`, which it shadowed TE's recipe with."""
    if name == "NVFP4BlockScaling":
        warnings.warn("megatron_fp4.recipe.NVFP4BlockScaling is renamed NVFP4BlockScaling1D: it is not Transformer "
                      "Engine's NVFP4BlockScaling (TE's defaults add 2D weight blocks, a random Hadamard transform "
                      "and stochastic gradient rounding)", DeprecationWarning, stacklevel=2)
        return NVFP4BlockScaling1D
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def recipe_for_format(name: str, **fields) -> FP4Recipe:
    """The recipe class for a format name ("hif4", "mxfp4", "nvfp4"), built with ``fields``."""
    if name not in RECIPES:
        raise choice_error("format", name, tuple(RECIPES))
    return RECIPES[name](**fields)


_ACTIVE: list[Optional[FP4Recipe]] = []


@contextlib.contextmanager
def fp4_autocast(enabled: bool = True, recipe: Optional[FP4Recipe] = None) -> Iterator[None]:
    """Run FP4 linears inside the block with ``recipe`` (default: ``HiF4BlockScaling()``).

    ``enabled=False`` turns FP4 off inside the block (nested contexts restore the outer state on exit).
    """
    if recipe is not None and not isinstance(recipe, FP4Recipe):
        raise TypeError(f"recipe must be an FP4Recipe, got {type(recipe).__name__}")
    _ACTIVE.append((recipe or HiF4BlockScaling()) if enabled else None)
    try:
        yield
    finally:
        _ACTIVE.pop()


def get_fp4_recipe() -> Optional[FP4Recipe]:
    """The recipe of the innermost active ``fp4_autocast``, or None when FP4 is off."""
    return _ACTIVE[-1] if _ACTIVE else None


def fp4_autocast_active() -> bool:
    """Whether any ``fp4_autocast`` block is open (also one with ``enabled=False``, which turns FP4 off)."""
    return bool(_ACTIVE)


def is_fp4_enabled() -> bool:
    """Whether an enabled ``fp4_autocast`` is active."""
    return get_fp4_recipe() is not None
