"""Serve rollout GEMMs with the Triton FP4 kernels (``megatron_fp4.kernels.dispatch``) on CUDA; PyTorch reference
elsewhere. The kernels as a backend of :mod:`megatron_fp4.resq`'s rollout linear, used by the native engine
(``megatron_fp4.rollout``) and the SGLang plug-in alike (both build on it; it knows neither).

    from megatron_fp4.rollout_kernels import register_kernel_backend
    register_kernel_backend()     # True when CUDA + Triton kernels are usable; rollout_linear then uses them

Covered: W4A4 with ResQ "none" / "2:4" (either ``resq_combine``) and W4A16 with bf16 activations, formats
hif4 / mxfp4 / mxfp4_rceil.
Everything else (W16A4, "channel"/"tile32x64"/"dense" residuals, OCC, fp32 W4A16) falls back to the reference
in :func:`megatron_fp4.resq.rollout_linear`. Weights are prepared (packed + expanded) once per weight version in
the model's :class:`~megatron_fp4.resq.QuantizedWeightCache`. The kernels' numbers equal the reference's up to
fp32 summation order (tested in tests/test_kernels*.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_fp4.resq import QuantizedWeightCache, RolloutPrecision, register_rollout_backend

__all__ = ["register_kernel_backend", "unregister_kernel_backend"]


def _plan(precision: RolloutPrecision, x_dtype: Optional[torch.dtype], formats) -> Optional[dict]:
    """Keyword arguments (activations, resq, resq_combine) of ``dispatch.linear`` for ``precision``, or None
    when not covered."""
    if precision.format not in formats or precision.activation_method != "resq":
        return None
    if precision.mode == "w4a4" and precision.sparsity in ("none", "2:4"):
        return dict(activations="fp4", resq=precision.sparsity, resq_combine=precision.resq_combine)
    if precision.mode == "w4a16" and (x_dtype is None or x_dtype == torch.bfloat16):
        return dict(activations="bf16")  # the kernel reads bf16 activations: exact only when they already are bf16
    return None


def register_kernel_backend(device_type: str = "cuda") -> bool:
    """Register the kernel backend for ``device_type`` if the kernels can run there; returns whether."""
    try:
        from megatron_fp4.kernels import dispatch
        from megatron_fp4.kernels._common import KERNEL_FORMATS, kernels_usable
    except ImportError:
        return False
    if device_type == "cuda" and not (torch.cuda.is_available() and dispatch.available()):
        return False

    def prepared(weight: torch.Tensor, fmt: str, cache: Optional[QuantizedWeightCache]):
        if cache is None:
            return dispatch.prepare_weight(weight.detach(), fmt)
        return cache.get_prepared(weight, f"kernels:{fmt}", lambda w: dispatch.prepare_weight(w, fmt))

    def backend(x2: torch.Tensor, weight: torch.Tensor, precision: RolloutPrecision,
                cache: Optional[QuantizedWeightCache], out_dtype: Optional[torch.dtype] = torch.float32,
                bias: Optional[torch.Tensor] = None):
        plan = _plan(precision, x2.dtype, KERNEL_FORMATS)
        if plan is None or not kernels_usable(x2, weight):
            return NotImplemented
        return dispatch.linear(x2.contiguous(), prepared(weight, precision.format, cache), **plan,
                               out_dtype=out_dtype, bias=bias)

    def prepare_weight(weight: torch.Tensor, precision: RolloutPrecision, cache: QuantizedWeightCache):
        if _plan(precision, None, KERNEL_FORMATS) is None or not kernels_usable(weight):
            return NotImplemented
        return prepared(weight, precision.format, cache)

    backend.prepare_weight = prepare_weight  # type: ignore[attr-defined]
    backend.adds_bias = True  # type: ignore[attr-defined]
    register_rollout_backend(device_type, backend)
    return True


def unregister_kernel_backend(device_type: str = "cuda") -> None:
    """Go back to the PyTorch reference for ``device_type``."""
    register_rollout_backend(device_type, None)
