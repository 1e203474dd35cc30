"""The single dispatch point for FP4 GEMMs used by the training linears (SPEC §3).

    out = fp4_gemm(a, b, "hif4", "hif4")      # fp32 [m, n] = Q(a) @ Q(b)^T

``a`` is ``[m, K]`` and ``b`` is ``[n, K]`` in high precision (fp32/bf16/fp16); each is quantized along its LAST
dimension K (the reduction dimension) in its own format and rounding, and the product is accumulated in fp32.
Callers transpose beforehand so that K is last (dgrad passes dY and W^T, wgrad passes dY^T and X^T).

Backends: the PyTorch reference (:func:`reference_fp4_gemm`: ``fake_quantize`` + fp32 matmul) serves every device.
A faster implementation (e.g. the Triton kernels in ``kernels/``) plugs in per device type with
:func:`register_fp4_gemm_backend` and must return the same numbers (up to fp32 summation order); callers never
change. ``MEGATRON_FP4_GEMM_BACKEND=reference`` (or :func:`use_reference_backend`) forces the reference.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Optional, Union

import torch

from megatron_fp4.formats import Format, InvalidTensorError, check_tensor, get_format

__all__ = [
    "fp4_gemm",
    "reference_fp4_gemm",
    "register_fp4_gemm_backend",
    "unregister_fp4_gemm_backend",
    "fp4_gemm_backend_for",
    "use_reference_backend",
]

FormatLike = Union[str, Format]

#: Signature of a backend: (a, b, a_format, b_format, a_rounding, b_rounding, generator) -> fp32 [m, n].
GemmBackend = Callable[
    [torch.Tensor, torch.Tensor, Format, Format, str, str, Optional[torch.Generator]], torch.Tensor
]

_BACKENDS: dict[str, GemmBackend] = {}
_FORCE_REFERENCE: list[bool] = []
_AUTO_TRIED: set[str] = set()


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


def register_fp4_gemm_backend(device_type: str, fn: GemmBackend) -> None:
    """Use ``fn`` for operands on ``device_type`` ("cuda", "cpu", ...); it replaces any earlier registration.

    ``fn`` receives contiguous 2-D operands and resolved Format objects and returns fp32 ``[m, n]``; it may
    return ``NotImplemented`` to fall back to the reference (e.g. for a format or shape it does not cover).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    _BACKENDS[device_type] = fn


def unregister_fp4_gemm_backend(device_type: str) -> None:
    """Remove the backend registered for ``device_type`` (the reference serves it again)."""
    _BACKENDS.pop(device_type, None)


def _auto_register(device_type: str) -> None:
    """On first CUDA use, register the Triton kernels (``kernels.dispatch``) when Triton and a GPU are present.

    They return the reference's numbers up to fp32 summation order and decline (NotImplemented) what they do not
    cover (stochastic rounding, NVFP4, mixed formats). ``MEGATRON_FP4_KERNELS=0`` turns this off.
    """
    if device_type != "cuda" or device_type in _AUTO_TRIED or device_type in _BACKENDS:
        return
    _AUTO_TRIED.add(device_type)
    if os.environ.get("MEGATRON_FP4_KERNELS", "1") == "0":
        return
    try:
        from kernels import dispatch
    except ImportError:  # Triton or the kernels package missing: the reference serves
        return
    dispatch.register(device_type)


def fp4_gemm_backend_for(device_type: str) -> Optional[GemmBackend]:
    """The backend that will serve ``device_type`` now (None means the PyTorch reference)."""
    if _FORCE_REFERENCE and _FORCE_REFERENCE[-1]:
        return None
    if os.environ.get("MEGATRON_FP4_GEMM_BACKEND", "") == "reference":
        return None
    _auto_register(device_type)
    return _BACKENDS.get(device_type)


@contextlib.contextmanager
def use_reference_backend(enabled: bool = True) -> Iterator[None]:
    """Force the PyTorch reference inside the block (for tests that compare a kernel against it)."""
    _FORCE_REFERENCE.append(enabled)
    try:
        yield
    finally:
        _FORCE_REFERENCE.pop()


def fp4_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_format: FormatLike,
    b_format: FormatLike,
    *,
    a_rounding: str = "nearest",
    b_rounding: str = "nearest",
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """fp32 ``Q(a) @ Q(b)^T`` for ``a [m, K]``, ``b [n, K]``, each quantized along K in its format and rounding."""
    check_tensor(a, "a", "fp4_gemm", ndim=2)
    check_tensor(b, "b", "fp4_gemm", ndim=2)
    if a.shape[1] != b.shape[1]:
        raise InvalidTensorError(f"fp4_gemm: reduction dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"fp4_gemm: operands on different devices ({a.device}, {b.device})")
    a_fmt, b_fmt = get_format(a_format), get_format(b_format)
    a, b = a.contiguous(), b.contiguous()
    backend = fp4_gemm_backend_for(a.device.type)
    if backend is not None:
        out = backend(a, b, a_fmt, b_fmt, a_rounding, b_rounding, generator)
        if out is not NotImplemented:
            return out
    return reference_fp4_gemm(a, b, a_fmt, b_fmt, a_rounding, b_rounding, generator)
