"""The CUDA C++ quantizers: the both-layouts quantizer (``megatron_fp4/kernels/csrc/quant_both.cu``: a training
operand's two exact BF16 expansions from one read of x) and Rollout-ResQ's bf16 sum (``csrc/resq_sum.cu``; fused
with the decode step's SwiGLU in ``csrc/swiglu_resq.cu``).

    rows, cols = both_layouts(x, "hif4")   # x [R, K] along K -> [R, KP]; x.t() along R -> [K, RP]
    rows, cols = both_layouts_fp8(x, "mxfp4", cols_e4m3=True)  # MXFP4's FP8 form: (values, S, ok, 2^S) each
    both_layouts(w, "hif4", out=(w_rows, w_cols))  # into existing buffers (a weight's, under CUDA graphs)
    a = resq_sum(x, "hif4")                # bf16(Q(x) + S(Q(x - Q(x)))) [R, KP]: ResQ 2:4's one GEMM operand
    a = swiglu_resq(fc1_out, "hif4")       # the same of the SwiGLU of fc1's output (fp32 splits or bf16)

Bit for bit ``megatron_fp4.kernels.quantize.quantize(x, fmt, expand="bf16", packed=False)`` and the same of
``x.t()`` (FP8: ``expand="native"`` (E5M2) or ``"e4m3"`` for each layout, as the reference computes them; the unit
math, ``csrc/quant_math.h``, is shared with a host build that the CPU tests check against the PyTorch reference).
Triton cannot express its layout: after the transpose each thread owns 16 consecutive tokens of two columns, so a
HiF4 unit is 4 lanes of one warp, reduced by shuffles (docs/PERFORMANCE.md, issue 21). :func:`resq_sum` is bit for
bit ``megatron_fp4.kernels.resq.resq_quantize(x, fmt, expand="sum", packed=False)`` (the Triton kernel, which it
replaces there: one part of 8 values per thread, for the decode step's small activations); :func:`swiglu_resq` is
bit for bit the Triton SwiGLU (``decode_ops.swiglu``) followed by it. Built with nvcc on first use
(:mod:`megatron_fp4.kernels._nvcc`); ``MEGATRON_FP4_CUDA_QUANT=0`` turns them all off (the Triton kernels serve).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from megatron_fp4.kernels import _nvcc
from megatron_fp4.kernels._common import switch_on

__all__ = ["available", "usable", "both_layouts", "both_layouts_fp8", "resq_sum", "swiglu_resq", "swiglu_resq_usable",
           "FORMAT_IDS", "FP8_FORMATS", "RESQ_SOURCE", "SWIGLU_RESQ_SOURCE"]

FORMAT_IDS = {"hif4": 0, "mxfp4": 1, "mxfp4_rceil": 2}
_BLOCK = {"hif4": 64, "mxfp4": 32, "mxfp4_rceil": 32}
_ARGTYPES = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4 + [ctypes.c_longlong] * 3 + [ctypes.c_void_p]
_FP8_ARGTYPES = _ARGTYPES[:-1] + [ctypes.c_void_p] * 8 + [ctypes.c_int] * 2 + [ctypes.c_void_p]
_RESQ_ARGTYPES = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3 + [ctypes.c_longlong] * 2 + [ctypes.c_void_p]
#: The formats with an FP8 form (MXFP4: E2M1 times a power of two fits FP8 relative to a row scale).
FP8_FORMATS = ("mxfp4", "mxfp4_rceil")
_SOURCE = "quant_both.cu"
#: The ResQ bf16-sum kernel's source (:func:`available` / :func:`usable` take it as ``source``).
RESQ_SOURCE = "resq_sum.cu"


def available(source: str = _SOURCE) -> bool:
    """Whether the kernel of ``source`` (the both-layouts quantizer's by default, or :data:`RESQ_SOURCE`) can run
    here: a CUDA GPU of compute capability 8.0 or newer, nvcc, not disabled by ``MEGATRON_FP4_CUDA_QUANT=0``, and no
    earlier build failure."""
    if not switch_on("MEGATRON_FP4_CUDA_QUANT") or _nvcc.build_failed(source):
        return False
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        return False
    return _nvcc.nvcc() is not None


def usable(x: torch.Tensor, fmt_name: str, source: str = _SOURCE) -> bool:
    """Whether :func:`both_layouts` (or, with ``source=RESQ_SOURCE``, :func:`resq_sum`) takes ``x``: a 2-D bf16 CUDA
    tensor with unit-stride rows, K a multiple of 8, 16-byte aligned rows, a format it implements, and the kernel
    :func:`available`."""
    return (fmt_name in FORMAT_IDS and x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.numel() > 0
            and x.stride(1) == 1 and x.shape[1] % 8 == 0 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and available(source))


@functools.lru_cache(maxsize=None)
def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return "90a" if (major, minor) == (9, 0) else f"{major}{minor}"


#: A launcher's source, symbol and argument types by kind.
_KINDS = {"both": (_SOURCE, "quant_both_launch", _ARGTYPES), "fp8": (_SOURCE, "quant_fp8_launch", _FP8_ARGTYPES),
          "resq": (RESQ_SOURCE, "resq_sum_launch", _RESQ_ARGTYPES)}


def _launcher(fmt_id: int, kind: str = "both"):
    source, symbol, argtypes = _KINDS[kind]
    return _nvcc.launcher(source, dict(FMT=fmt_id), symbol, argtypes, arch=_arch())


def _check(x: torch.Tensor, fmt_name: str, formats, source: str = _SOURCE, what: str = "both_layouts") -> None:
    if not usable(x, fmt_name, source) or fmt_name not in formats:
        raise ValueError(f"{what}: needs a 2-D bf16 CUDA tensor with contiguous, 16-byte aligned rows, K a "
                         f"multiple of 8 and format one of {sorted(formats)}; got {x.dtype} {tuple(x.shape)} "
                         f"strides {x.stride()} format {fmt_name!r}")


def both_layouts(x: torch.Tensor, fmt_name: str, out: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x quantized along K: bf16 [R, KP], x.t() quantized along R: bf16 [K, RP]) for x [R, K] that
    :func:`usable` accepts; ``out``: those two tensors to write into (e.g. the buffers a CUDA graph reads)."""
    _check(x, fmt_name, FORMAT_IDS)
    R, K = x.shape
    bs = _BLOCK[fmt_name]
    kp, rp = -(-K // bs) * bs, -(-R // bs) * bs
    if out is None:
        out = (torch.empty((R, kp), dtype=torch.bfloat16, device=x.device),
               torch.empty((K, rp), dtype=torch.bfloat16, device=x.device))
    rows, cols = out
    _check_out(rows, (R, kp), (torch.bfloat16,), "rows")
    _check_out(cols, (K, rp), (torch.bfloat16,), "cols")
    err = _launcher(FORMAT_IDS[fmt_name])(x.data_ptr(), rows.data_ptr(), cols.data_ptr(), R, K, kp, rp, x.stride(0),
                                          rows.stride(0), cols.stride(0),
                                          torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"quant_both launch failed (cudaError {err})")
    return out


def _check_out(t: torch.Tensor, shape: tuple, dtypes: tuple, what: str) -> None:
    if tuple(t.shape) != shape or t.dtype not in dtypes or not t.is_contiguous() or not t.is_cuda:
        raise ValueError(f"out {what}: needs a contiguous CUDA {dtypes[0]} tensor of shape {shape}; got {t.dtype} "
                         f"{tuple(t.shape)} strides {t.stride()} on {t.device}")


def _fp8_dtype(e4m3: bool) -> torch.dtype:
    return torch.float8_e4m3fn if e4m3 else torch.float8_e5m2


def both_layouts_fp8(x: torch.Tensor, fmt_name: str, rows_e4m3: bool = False, cols_e4m3: bool = False,
                     out: Optional[tuple] = None):
    """MXFP4's FP8 form of x [R, K] along K ([R, KP]) and of x.t() along R ([K, RP]), each E4M3 where
    ``rows_e4m3`` / ``cols_e4m3`` say, else E5M2, as (values, scale exponents S int32, no-flush flags bool, 2^S
    fp32 or None): the fields of ``megatron_fp4.kernels.quantize.Expanded``. ``out``: two such tuples to write into (a
    None 2^S is not written). Two launches (the rows' and columns' maxima, then the bytes); no host sync."""
    _check(x, fmt_name, FP8_FORMATS)
    R, K = x.shape
    kp, rp = -(-K // 32) * 32, -(-R // 32) * 32
    dev = x.device
    if out is None:
        out = tuple((torch.empty((n, p), dtype=_fp8_dtype(e4), device=dev), torch.empty((n,), dtype=torch.int32,
                     device=dev), torch.empty((n,), dtype=torch.bool, device=dev),
                     torch.empty((n,), dtype=torch.float32, device=dev))
                    for n, p, e4 in ((R, kp, rows_e4m3), (K, rp, cols_e4m3)))
    for (v, sexp, ok, scale), n, p, e4, what in zip(out, (R, K), (kp, rp), (rows_e4m3, cols_e4m3), ("rows", "cols")):
        _check_out(v, (n, p), (_fp8_dtype(e4),), what)
        if sexp.shape != (n,) or sexp.dtype != torch.int32 or ok.shape != (n,) or ok.dtype != torch.bool or (
                scale is not None and (scale.shape != (n,) or scale.dtype != torch.float32)):
            raise ValueError(f"out {what}: needs S int32 [{n}], flags bool [{n}] and 2^S float32 [{n}] or None")
    (rv, rexp, rok, rsc), (cv, cexp, cok, csc) = out
    maxima = torch.zeros((R + K,), dtype=torch.int32, device=dev)
    err = _launcher(FORMAT_IDS[fmt_name], "fp8")(
        x.data_ptr(), rv.data_ptr(), cv.data_ptr(), R, K, kp, rp, x.stride(0), rv.stride(0), cv.stride(0),
        maxima.data_ptr(), maxima[R:].data_ptr(), rexp.data_ptr(), cexp.data_ptr(),
        rsc.data_ptr() if rsc is not None else None, csc.data_ptr() if csc is not None else None,
        rok.data_ptr(), cok.data_ptr(), int(rows_e4m3), int(cols_e4m3), torch.cuda.current_stream(dev).cuda_stream)
    if err:
        raise RuntimeError(f"quant_fp8 launch failed (cudaError {err})")
    return out


def resq_sum(x: torch.Tensor, fmt_name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bf16(deq Q(x) + S(deq Q(x - deq Q(x)))) ``[R, KP]`` (K padded to the format's block) for x ``[R, K]`` that
    :func:`usable` accepts (``source=RESQ_SOURCE``): Rollout-ResQ 2:4's one GEMM operand (``resq_combine="bf16"``),
    bit for bit ``megatron_fp4.kernels.resq.resq_quantize(x, fmt, expand="sum", packed=False)``. One launch, no host
    sync; ``out``: the tensor to write into."""
    _check(x, fmt_name, FORMAT_IDS, RESQ_SOURCE, "resq_sum")
    R, K = x.shape
    kp = -(-K // _BLOCK[fmt_name]) * _BLOCK[fmt_name]
    if out is None:
        out = torch.empty((R, kp), dtype=torch.bfloat16, device=x.device)
    _check_out(out, (R, kp), (torch.bfloat16,), "resq_sum")
    err = _launcher(FORMAT_IDS[fmt_name], "resq")(x.data_ptr(), out.data_ptr(), R, K, kp, x.stride(0),
                                                   out.stride(0), torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"resq_sum launch failed (cudaError {err})")
    return out


#: The environment switches of the fused ResQ-operand kernels (:func:`swiglu_resq`, :func:`norm_resq`), read by the
#: native engine's decode step and the SGLang plug-in alike: "0" turns one off (``_common.switch_on``).
SWIGLU_RESQ_SWITCH = "MEGATRON_FP4_FUSED_SWIGLU_RESQ"
NORM_RESQ_SWITCH = "MEGATRON_FP4_FUSED_NORM_RESQ"


#: The fused SwiGLU + ResQ bf16-sum kernel's source (the decode step's operand of fc2, :func:`swiglu_resq`).
SWIGLU_RESQ_SOURCE = "swiglu_resq.cu"
_SWIGLU_ARGTYPES = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_longlong] * 3 \
    + [ctypes.c_void_p]


def swiglu_resq_usable(a: torch.Tensor, fmt_name: str) -> bool:
    """Whether :func:`swiglu_resq` takes fc1's output ``a``: fp32 split sums ``[S, B, 2F]`` or bf16 ``[B, 2F]``, CUDA,
    contiguous, F a multiple of 8, a format it implements, and the kernel available."""
    return (fmt_name in FORMAT_IDS and a.is_cuda and a.is_contiguous() and a.numel() > 0 and a.shape[-1] % 16 == 0
            and ((a.dim() == 3 and a.dtype == torch.float32) or (a.dim() == 2 and a.dtype == torch.bfloat16))
            and a.data_ptr() % 16 == 0 and available(SWIGLU_RESQ_SOURCE))


def swiglu_resq(a: torch.Tensor, fmt_name: str) -> torch.Tensor:
    """The ResQ 2:4 bf16 sum ``[B, FP]`` of ``decode_ops.swiglu(a, torch.bfloat16, splits=a.dim() == 3)`` in one
    kernel (the Triton SwiGLU's arithmetic, then :func:`resq_sum`'s), for ``a`` that :func:`swiglu_resq_usable`
    accepts: what fc2 multiplies in W4A4 + ResQ 2:4 (bf16 sum), so fc2 runs as W4A16 on it."""
    if not swiglu_resq_usable(a, fmt_name):
        raise ValueError(f"swiglu_resq: needs fp32 [S, B, 2F] or bf16 [B, 2F] contiguous CUDA, F a multiple of 8, "
                         f"format one of {sorted(FORMAT_IDS)}; got {a.dtype} {tuple(a.shape)} format {fmt_name!r}")
    parts = a if a.dim() == 3 else a.unsqueeze(0)
    S, B, F2 = parts.shape
    F = F2 // 2
    fp = -(-F // _BLOCK[fmt_name]) * _BLOCK[fmt_name]
    out = torch.empty((B, fp), dtype=torch.bfloat16, device=a.device)
    err = _nvcc.launcher(SWIGLU_RESQ_SOURCE, dict(FMT=FORMAT_IDS[fmt_name]), "swiglu_resq_launch", _SWIGLU_ARGTYPES,
                         arch=_arch())(a.data_ptr(), int(a.dtype == torch.float32), out.data_ptr(), B, F, fp, S,
                                       parts.stride(1), parts.stride(0), out.stride(0),
                                       torch.cuda.current_stream(a.device).cuda_stream)
    if err:
        raise RuntimeError(f"swiglu_resq launch failed (cudaError {err})")
    return out


#: The fused residual add + RMSNorm + ResQ bf16-sum kernel's source.
NORM_RESQ_SOURCE = "norm_resq.cu"
_NORM_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 \
    + [ctypes.c_float] + [ctypes.c_int] * 2 + [ctypes.c_longlong] * 6 + [ctypes.c_void_p]


def norm_resq_usable(x: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, fmt_name: str) -> bool:
    """Whether :func:`norm_resq` takes these: x bf16 ``[B, N]`` (N a multiple of 8, 512 < N <= 16384), ``delta``
    None, bf16 ``[B, N]`` or fp32 split sums ``[S, B, N]``, a bf16 norm weight ``[N]``, all CUDA with unit-stride,
    16-byte aligned rows; a format it implements, and the kernel available."""
    def rows_ok(t: torch.Tensor) -> bool:
        return t.is_cuda and t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(
            s % 8 == 0 for s in t.stride()[:-1])

    if fmt_name not in FORMAT_IDS or x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[0] == 0:
        return False
    N = x.shape[1]
    if N % 8 or not 512 < N <= 16384 or weight.shape != (N,) or weight.dtype != torch.bfloat16:
        return False
    if delta is not None and not ((delta.dim() == 2 and delta.dtype == torch.bfloat16)
                                  or (delta.dim() == 3 and delta.dtype == torch.float32)):
        return False
    if delta is not None and (tuple(delta.shape[-2:]) != tuple(x.shape) or not rows_ok(delta)):
        return False
    return rows_ok(x) and rows_ok(weight) and available(NORM_RESQ_SOURCE)


def norm_resq(x: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float, fmt_name: str,
              warps: int, normed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ResQ 2:4's bf16 sum ``[B, NP]`` of RMSNorm(s), s = x + delta ``[B, N]``) in one kernel for arguments that
    :func:`norm_resq_usable` accepts: ``megatron_fp4.kernels.decode_ops.add_rms_norm`` (whose Triton kernel runs
    ``warps`` warps: the same blocked layout and reduction order, so the same normed bits) followed by
    :func:`resq_sum`. ``s`` is x itself without a delta. ``normed``: a contiguous bf16 ``[B, N]`` tensor that also
    receives RMSNorm(s) (the tests' view of the kernel's normed bits)."""
    if not norm_resq_usable(x, delta, weight, fmt_name):
        raise ValueError("norm_resq: needs x bf16 [B, N] (N a multiple of 8 in (512, 16384]), delta None, bf16 [B, N] "
                         "or fp32 [S, B, N], a bf16 weight [N], CUDA, 16-byte aligned unit-stride rows, format one "
                         f"of {sorted(FORMAT_IDS)}; got x {x.dtype} {tuple(x.shape)}, delta "
                         f"{None if delta is None else (delta.dtype, tuple(delta.shape))}, weight {weight.dtype} "
                         f"{tuple(weight.shape)}, format {fmt_name!r}")
    B, N = x.shape
    block = 1 << (N - 1).bit_length()
    threads = 32 * warps
    reps = block // (8 * threads)
    if reps not in (1, 2, 4) or reps * 8 * threads != block:
        raise ValueError(f"norm_resq: {warps} warps do not tile a block of {block} columns as the Triton kernel does")
    np_ = -(-N // _BLOCK[fmt_name]) * _BLOCK[fmt_name]
    out = torch.empty((B, np_), dtype=torch.bfloat16, device=x.device)
    s = torch.empty_like(x) if delta is not None else x
    kind = 0 if delta is None else (1 if delta.dtype == torch.float32 else 2)
    d = delta if delta is not None else x
    splits, ld_split = (d.shape[0], d.stride(0)) if d.dim() == 3 else (1, 0)
    if normed is not None:
        _check_out(normed, (B, N), (torch.bfloat16,), "norm_resq's normed")
    err = _nvcc.launcher(NORM_RESQ_SOURCE, dict(FMT=FORMAT_IDS[fmt_name]), "norm_resq_launch", _NORM_ARGTYPES,
                         arch=_arch())(x.data_ptr(), d.data_ptr(), kind, weight.data_ptr(), s.data_ptr(),
                                       out.data_ptr(), None if normed is None else normed.data_ptr(), B, N, np_,
                                       splits, float(eps), threads, reps, x.stride(0), d.stride(-2), s.stride(0),
                                       ld_split, out.stride(0), 0 if normed is None else normed.stride(0),
                                       torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"norm_resq launch failed (cudaError {err})")
    return out, s
