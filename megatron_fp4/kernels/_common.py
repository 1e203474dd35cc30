"""Triton availability and small shared helpers for the kernels package (no Megatron, no formats logic)."""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: without it every public entry point falls back to the PyTorch reference.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None
    HAS_TRITON = False

#: Formats the kernels implement (others fall back to the reference).
KERNEL_FORMATS = ("hif4", "mxfp4", "mxfp4_rceil")

#: HiF4 r = bf16_rne(1 / E6M2) for the mantissa codes m = 1, 2, 3 (m = 0 gives exactly 1): times 2^-e.
HIF4_RECIP = (1.0, 0.80078125, 0.66796875, 0.5703125)
#: The Triton quantize tiles' constexprs: FMT per kernel format (its place in KERNEL_FORMATS), HiF4's reciprocals.
TILE_FMT = {name: i for i, name in enumerate(KERNEL_FORMATS)}
TILE_RECIP = dict(R1=HIF4_RECIP[1], R2=HIF4_RECIP[2], R3=HIF4_RECIP[3])


#: Token counts (activation rows) at or below this are decode-sized: the decode GEMM
#: (megatron_fp4.kernels.decode_gemm.w4_matmul) serves them, and the quantize kernels split such rows along K instead of
#: autotuning over rows.
DECODE_MAX_M = 64


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernels_usable(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on these tensors (CUDA + Triton, or the CPU interpreter)."""
    if not HAS_TRITON:
        return False
    if all(t.is_cuda for t in tensors):
        return True
    return interpreting() and all(t.device.type == "cpu" for t in tensors)


def tune_bucket(n: int) -> int:
    """The autotuning key of a size that changes from call to call (tokens per step): its next power of two."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 stands in for the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def k_split(row_programs: int, k_tiles: int, device: torch.device, per_sm: int = 4) -> int:
    """How many programs share one row block's K tiles when there are few row blocks (decode-sized
    activations): enough for ``per_sm`` programs per SM, at most one per tile."""
    return max(1, min(k_tiles, (per_sm * sm_count(device)) // max(row_programs, 1)))

