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


def switch_on(name: str) -> bool:
    """Whether the on-by-default switch ``name`` (an environment variable) is on: unless it is set to 0."""
    return os.environ.get(name, "1") != "0"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: Programmatic dependent launch (PDL, Hopper): with MEGATRON_FP4_PDL=1 the decode step's kernels (megatron_fp4.
#: kernels.decode_ops, the CUDA decode GEMM) launch with CUDA's programmatic-stream-serialization attribute. Each
#: starts by waiting for the kernel before it (griddepcontrol.wait: all of its work done and visible) and lets the
#: next one launch (griddepcontrol.launch_dependents), so a kernel's launch and block scheduling overlap the end of
#: the one before instead of following it; inside a CUDA graph the edges are programmatic. Every kernel launched so
#: waits before it touches memory, and lets the next one launch only after its wait (so a kernel runs early only
#: beside the one just before it, never beside older ones): the order of the step's reads and writes is the
#: stream's. Off by default until measured on the H200 (docs/PERFORMANCE.md).
PDL_ENV = "MEGATRON_FP4_PDL"
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except Exception:  # pragma: no cover - Triton without grid dependency control: no PDL
    gdc_launch_dependents = gdc_wait = None


def pdl_enabled() -> bool:
    """Whether the decode kernels launch with PDL (``MEGATRON_FP4_PDL=1``, Triton with grid dependency control, not
    the interpreter)."""
    return os.environ.get(PDL_ENV, "0") == "1" and gdc_wait is not None and not interpreting()


def pdl_launch() -> dict:
    """Keywords for a Triton launch of a kernel that starts with :func:`pdl_enter` (its ``PDL`` constexpr and
    Triton's ``launch_pdl`` option), empty when PDL is off."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled() else {}


if HAS_TRITON and gdc_wait is not None:
    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """A PDL kernel's first step: wait for the kernel before it, then let the next one launch."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
elif HAS_TRITON:  # pragma: no cover
    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        pass


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

