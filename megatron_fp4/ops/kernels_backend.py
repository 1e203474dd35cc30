"""The Triton kernels (``megatron_fp4/kernels/``) as an FP4 GEMM backend of :mod:`megatron_fp4.ops` (what the first CUDA
GEMM registers, or ``ops.register_kernel_backend``): :class:`KernelBackend` for the training linears' two-step GEMMs and
:func:`ops_backend`, the plain-function form. They return the reference's numbers up to fp32 summation order (the
MXFP4 FP8 modes: approximately, see ``megatron_fp4.kernels.quantize.Expanded``) and decline what they do not cover.

Layering: this module imports :mod:`megatron_fp4.kernels` and :mod:`megatron_fp4.gemm_backend` (the interface and the
reference, below both); the kernels never import ``megatron_fp4.ops``, and ``megatron_fp4.ops`` imports this module
only when it registers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_fp4.kernels._common import KERNEL_FORMATS, kernels_usable
from megatron_fp4.kernels.dispatch import PROMOTE, available, fp4_gemm, fp8_weight_expand
from megatron_fp4.kernels.gemm import mm_expanded
from megatron_fp4.kernels.quantize import quantize, quantize_both_layouts
from megatron_fp4.formats import Format
from megatron_fp4.gemm_backend import FP4GemmBackend

__all__ = ["KernelBackend", "kernel_backend", "ops_backend"]


def ops_backend(a, b, a_fmt: Format, b_fmt: Format, a_rounding: str, b_rounding: str, generator=None):
    """A plain-function backend for ``megatron_fp4.ops.register_fp4_gemm_backend`` (:func:`fp4_gemm`, decode
    kernels for M <= 64 included); NotImplemented where the kernels don't apply."""
    if a_rounding != "nearest" or b_rounding != "nearest":
        return NotImplemented  # stochastic rounding stays on the reference (its RNG stream defines the numbers)
    if a_fmt.name != b_fmt.name or a_fmt.name not in KERNEL_FORMATS or not kernels_usable(a, b):
        return NotImplemented
    return fp4_gemm(a, b, a_fmt, b_fmt)


@dataclass
class Operand:
    """A training GEMM operand quantized along K: its GEMM-ready expansion."""

    fmt: Format
    expanded: object  # megatron_fp4.kernels.quantize.Expanded


class KernelBackend(FP4GemmBackend):
    """The training GEMMs on the kernels (what ``ops.register_kernel_backend`` installs): each operand quantized by
    one Triton kernel that writes only its GEMM-ready expansion, read strided (transposed views cost no copy), then
    one tensor-core GEMM rounding once to the caller's dtype. "exact" mode: BF16 expansions and cuBLAS's BF16 GEMM
    with fp32 accumulation (the reference's numbers up to summation order). MXFP4 "fp8" / "fp8_fast": E5M2
    activations and gradients x E4M3 weights (fprop, dgrad) or E4M3 X^T (wgrad) on cuBLAS's FP8 GEMM (two E5M2
    operands: the Triton FP8 GEMM), values below the FP8 window flushed
    (:class:`megatron_fp4.kernels.quantize.Expanded`; no host sync). Declines stochastic rounding, mixed formats and
    formats without kernels.

    An operand's two layouts (X along K and along the tokens; a weight's W and W^T) come from
    ``megatron_fp4.kernels.quantize.quantize_both_layouts``: on a GPU with nvcc, one CUDA kernel that reads each 64 x 64
    tile of x once and writes both expansions (``megatron_fp4.kernels.cuda_quantize``; MXFP4's FP8 form: a read for the
    row and column scales, then that kernel); else two Triton passes (MXFP4's row kernel and column kernel, or in FP8
    form its row kernel on x and on x^T; HiF4's row kernel writing x's transposed copy too, then the row kernel on
    that copy)."""

    def quantize(self, x, fmt, rounding, generator, mode, weight, out=None):
        if rounding != "nearest" or fmt.name not in KERNEL_FORMATS or not kernels_usable(x):
            return NotImplemented
        expand = _weight_expand(x, fmt, mode) if weight else _operand_expand(fmt, mode)
        return Operand(fmt, quantize(x, fmt, expand=expand, packed=False, out=out)[1])

    def quantize_both(self, x, fmt, mode, b_cols=False):
        if fmt.name not in KERNEL_FORMATS or not kernels_usable(x):
            return super().quantize_both(x, fmt, mode, b_cols)
        # X^T (wgrad's b) in a weight's form: E4M3 where cuBLAS's FP8 GEMM then takes it
        cols = _weight_expand(x.t(), fmt, mode) if b_cols else _operand_expand(fmt, mode)
        return _both_layouts(x, fmt, (_operand_expand(fmt, mode), cols))

    def quantize_weight_both(self, x, fmt, mode):
        if fmt.name not in KERNEL_FORMATS or not kernels_usable(x):
            return super().quantize_weight_both(x, fmt, mode)
        return _both_layouts(x, fmt, (_weight_expand(x, fmt, mode), _weight_expand(x.t(), fmt, mode)))

    def requantize_both(self, x, fmt, mode, q_rows, q_cols):
        expand = tuple(_expand_of(q.expanded) for q in (q_rows, q_cols))
        mixed = "bf16" in expand and expand != ("bf16", "bf16")  # one BF16 and one FP8 form: not one call's pair
        if fmt.name not in KERNEL_FORMATS or not kernels_usable(x) or mixed:
            return super().requantize_both(x, fmt, mode, q_rows, q_cols)
        quantize_both_layouts(x, fmt, expand=expand, out=(q_rows.expanded, q_cols.expanded))
        return q_rows, q_cols

    def requantize(self, x, fmt, mode, q):
        self.quantize(x, fmt, "nearest", None, mode, True, out=q.expanded)  # the kernels write into q's buffers
        return q

    def matmul(self, qa, qb, out_dtype, mode):
        if qa.fmt.name != qb.fmt.name:
            return NotImplemented
        return mm_expanded(qa.expanded, qb.expanded, out_dtype=out_dtype, promote=PROMOTE[mode])


def _operand_expand(fmt: Format, mode: str) -> str:
    """The expansion an activation or gradient operand is quantized into: BF16 in "exact" mode and for HiF4, else
    MXFP4's E5M2 form."""
    return "bf16" if mode == "exact" or fmt.name == "hif4" else "native"


def _weight_expand(w, fmt: Format, mode: str) -> str:
    """The expansion a weight (or W^T) is quantized into: BF16 where operands are, else MXFP4's FP8 weight form
    (E4M3 where cuBLAS's FP8 GEMM then takes it)."""
    return "bf16" if _operand_expand(fmt, mode) == "bf16" else fp8_weight_expand(w)


def _both_layouts(x, fmt: Format, expand: tuple) -> tuple:
    """``x`` and ``x.t()`` quantized along their last dimension in one call, as two operands."""
    rows, cols = quantize_both_layouts(x, fmt, expand=expand)
    return Operand(fmt, rows), Operand(fmt, cols)


def _expand_of(e) -> str:
    """The ``megatron_fp4.kernels.quantize.quantize`` expansion mode that made the expansion ``e``."""
    return {torch.bfloat16: "bf16", torch.float8_e5m2: "native", torch.float8_e4m3fn: "e4m3"}[e.values.dtype]


def kernel_backend(device_type: str = "cuda") -> Optional[KernelBackend]:
    """A :class:`KernelBackend` if the kernels can run on ``device_type``, else None."""
    if device_type == "cuda" and not (torch.cuda.is_available() and available()):
        return None
    return KernelBackend()
