"""The CUDA C++ both-layouts quantizer (``kernels/csrc/quant_both.cu``): a training operand's two exact BF16
expansions from one read of x.

    rows, cols = both_layouts(x, "hif4")   # x [R, K] along K -> [R, KP]; x.t() along R -> [K, RP]

Bit for bit ``kernels.quantize.quantize(x, fmt, expand="bf16", packed=False)`` and the same of ``x.t()`` (the unit
math, ``csrc/quant_math.h``, is shared with a host build that the CPU tests check against the PyTorch reference).
Triton cannot express its layout: after the transpose each thread owns 16 consecutive tokens of two columns, so a
HiF4 unit is 4 lanes of one warp, reduced by shuffles (docs/PERFORMANCE.md, issue 21). Built with nvcc on first
use (:mod:`kernels._nvcc`); ``MEGATRON_FP4_CUDA_QUANT=0`` turns it off (the Triton passes serve).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from kernels import _nvcc

__all__ = ["available", "usable", "both_layouts", "FORMAT_IDS"]

FORMAT_IDS = {"hif4": 0, "mxfp4": 1, "mxfp4_rceil": 2}
_BLOCK = {"hif4": 64, "mxfp4": 32, "mxfp4_rceil": 32}
_ARGTYPES = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4 + [ctypes.c_longlong] * 3 + [ctypes.c_void_p]
_SOURCE = "quant_both.cu"


def available() -> bool:
    """Whether the kernel can run here: a CUDA GPU of compute capability 8.0 or newer, nvcc, not disabled by
    ``MEGATRON_FP4_CUDA_QUANT=0``, and no earlier build failure."""
    if os.environ.get("MEGATRON_FP4_CUDA_QUANT", "1") == "0" or _nvcc.build_failed(_SOURCE):
        return False
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        return False
    return _nvcc.nvcc() is not None


def usable(x: torch.Tensor, fmt_name: str) -> bool:
    """Whether :func:`both_layouts` takes ``x``: a 2-D bf16 CUDA tensor with unit-stride rows, K a multiple of 8,
    16-byte aligned rows, a format it implements, and the kernel :func:`available`."""
    return (fmt_name in FORMAT_IDS and x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.numel() > 0
            and x.stride(1) == 1 and x.shape[1] % 8 == 0 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and available())


@functools.lru_cache(maxsize=None)
def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return "90a" if (major, minor) == (9, 0) else f"{major}{minor}"


def _launcher(fmt_id: int):
    return _nvcc.launcher(_SOURCE, dict(FMT=fmt_id), "quant_both_launch", _ARGTYPES, arch=_arch())


def both_layouts(x: torch.Tensor, fmt_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x quantized along K: bf16 [R, KP], x.t() quantized along R: bf16 [K, RP]) for x [R, K] that
    :func:`usable` accepts."""
    if not usable(x, fmt_name):
        raise ValueError(f"both_layouts: needs a 2-D bf16 CUDA tensor with contiguous, 16-byte aligned rows, K a "
                         f"multiple of 8 and format one of {sorted(FORMAT_IDS)}; got {x.dtype} {tuple(x.shape)} "
                         f"strides {x.stride()} format {fmt_name!r}")
    R, K = x.shape
    bs = _BLOCK[fmt_name]
    kp, rp = -(-K // bs) * bs, -(-R // bs) * bs
    rows = torch.empty((R, kp), dtype=torch.bfloat16, device=x.device)
    cols = torch.empty((K, rp), dtype=torch.bfloat16, device=x.device)
    err = _launcher(FORMAT_IDS[fmt_name])(x.data_ptr(), rows.data_ptr(), cols.data_ptr(), R, K, kp, rp, x.stride(0),
                                          rows.stride(0), cols.stride(0),
                                          torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"quant_both launch failed (cudaError {err})")
    return rows, cols
