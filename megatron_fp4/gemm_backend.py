"""The FP4 GEMM backend interface and the PyTorch reference that defines its numbers (SPEC §3).

A backend is an :class:`FP4GemmBackend` (``quantize`` an operand into its GEMM-ready form, ``matmul`` two forms) or
a plain function of both operands (:data:`GemmBackend`); :func:`reference_fp4_gemm` and :class:`FP4GemmBackend`
itself are the reference every backend matches. Torch and ``megatron_fp4.formats`` only: the kernels
(``megatron_fp4/kernels/``) build on this, and ``megatron_fp4.ops`` registers and dispatches.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_fp4.formats import Format

__all__ = ["GEMM_MODES", "GemmBackend", "FP4GemmBackend", "reference_fp4_gemm"]

#: How a backend multiplies FP4 operands (:attr:`megatron_fp4.recipe.FP4Recipe.gemm_mode`): "exact" (fp32
#: accumulation of the exact products; the reference's numbers up to summation order), "fp8" / "fp8_fast" (MXFP4 on
#: the FP8 tensor cores with promoted / Hopper's default accumulation: approximate, megatron_fp4/kernels/dispatch.py
#: says how much). The reference computes every mode exactly.
GEMM_MODES = ("exact", "fp8", "fp8_fast")

#: Signature of a backend: (a, b, a_format, b_format, a_rounding, b_rounding, generator) -> fp32 [m, n].
GemmBackend = Callable[
    [torch.Tensor, torch.Tensor, Format, Format, str, str, Optional[torch.Generator]], torch.Tensor
]


def reference_fp4_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_format: Format,
    b_format: Format,
    a_rounding: str = "nearest",
    b_rounding: str = "nearest",
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """PyTorch reference: fake-quantize both operands along K (in fp32) and multiply with fp32 accumulation."""
    aq = a_format.fake_quantize(a.float(), dim=-1, rounding=a_rounding, generator=generator)
    bq = b_format.fake_quantize(b.float(), dim=-1, rounding=b_rounding, generator=generator)
    return torch.matmul(aq, bq.t())


class FP4GemmBackend:
    """A backend in two steps; either step may return ``NotImplemented`` (the reference then serves the call).
    This base class is the PyTorch reference; calling an instance runs both steps (a plain backend's contract)."""

    def quantize(self, x: torch.Tensor, fmt: Format, rounding: str, generator: Optional[torch.Generator],
                 mode: str, weight: bool) -> object:
        """The GEMM-ready form of ``x [rows, K]`` (any strides) quantized along K; ``weight``: ``x`` is a weight
        (kept across micro-batches, so a slower, GEMM-friendlier form pays off)."""
        return fmt.fake_quantize(x.float(), dim=-1, rounding=rounding, generator=generator)

    def requantize(self, x: torch.Tensor, fmt: Format, mode: str, q: object) -> object:
        """Write the (nearest-rounded, weight) quantization of ``x`` into the buffers of ``q``, an earlier
        ``quantize`` result of the same arguments and shape, and return ``q``: what a CUDA graph that reads ``q``
        sees after its weights changed. No allocation the caller keeps; capturable in a CUDA graph."""
        if not torch.is_tensor(q):
            raise NotImplementedError(f"{type(self).__name__} must implement requantize for its quantized form "
                                      f"{type(q).__name__}")
        return q.copy_(self.quantize(x, fmt, "nearest", None, mode, True))

    def requantize_both(self, x: torch.Tensor, fmt: Format, mode: str, q_rows: object, q_cols: object) -> tuple:
        """:meth:`requantize` of a weight ``x`` and of ``x.t()`` into ``q_rows`` and ``q_cols`` (earlier weight
        ``quantize`` results of ``x`` and ``x.t()``): a backend may do both from one read of ``x``."""
        return self.requantize(x, fmt, mode, q_rows), self.requantize(x.t(), fmt, mode, q_cols)

    def quantize_weight_both(self, x: torch.Tensor, fmt: Format, mode: str) -> tuple:
        """(:meth:`quantize` of a weight ``x``, of ``x.t()``): a weight's fprop (W) and dgrad (W^T) forms, which a
        backend may make from one read of ``x``."""
        return (self.quantize(x, fmt, "nearest", None, mode, True),
                self.quantize(x.t(), fmt, "nearest", None, mode, True))

    def matmul(self, qa: object, qb: object, out_dtype: torch.dtype, mode: str) -> torch.Tensor:
        """``qa @ qb^T`` accumulated in fp32, rounded once to ``out_dtype``."""
        return torch.matmul(qa, qb.t()).to(out_dtype)

    def quantize_both(self, x: torch.Tensor, fmt: Format, mode: str, b_cols: bool = False) -> object:
        """(``x [R, K]`` quantized along K, ``x.t()`` quantized along R), GEMM mode ``mode``, round to nearest: a
        training linear's input (fprop, wgrad) or output gradient (dgrad, wgrad). ``b_cols``: ``x.t()`` is its
        GEMM's second operand (the input X^T in wgrad), which a backend may store in a weight's form (MXFP4 FP8
        modes: E4M3). A backend may do both from one read of ``x``."""
        return (self.quantize(x, fmt, "nearest", None, mode, False),
                self.quantize(x.t(), fmt, "nearest", None, mode, False))

    def __call__(self, a, b, a_fmt, b_fmt, a_rounding, b_rounding, generator=None):
        qa = self.quantize(a, a_fmt, a_rounding, generator, "exact", False)
        qb = self.quantize(b, b_fmt, b_rounding, generator, "exact", False)
        if qa is NotImplemented or qb is NotImplemented:
            return NotImplemented
        return self.matmul(qa, qb, torch.float32, "exact")
