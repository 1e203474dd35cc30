"""Entry points that ``megatron_fp4.ops`` and the rollout code call: Triton kernels on CUDA, the PyTorch reference
elsewhere, with the same numbers (SPEC §3/§4; fp32 summation order aside).

    y = dispatch.fp4_gemm(a, b, "hif4")      # fp32 Q(a) @ Q(b)^T, a [m, K], b [n, K]
    w = dispatch.prepare_weight(W, "mxfp4")  # packed + pre-expanded weight, once per weight update
                                             # (mode="fp8": MXFP4 FP8 fast path, approximate accumulation)
    y = dispatch.linear(x, w)                # W4A4 rollout GEMM (decode or prefill), optional resq="2:4"
    y = dispatch.linear(x, w, resq="2:4", resq_combine="bf16")   # ResQ as one GEMM on bf16(Q(x) + S(Q(r)))
    y = dispatch.linear(x, w, activations="bf16")   # W4A16
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_fp4.kernels._common import DECODE_MAX_M, KERNEL_FORMATS, interpreting, kernels_usable
from megatron_fp4.formats import Format, InvalidTensorError, QuantizedTensor, check_tensor, get_format
from megatron_fp4.gemm_backend import GEMM_MODES, reference_fp4_gemm

__all__ = ["available", "fp4_gemm", "fp8_weight_expand", "PreparedWeight", "prepare_weight", "linear",
           "linear_reference", "decode_matmul", "MODES", "PROMOTE"]


def available(device: Optional[torch.device] = None) -> bool:
    """Whether the Triton kernels can run on ``device`` (default: the current CUDA device)."""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        return False
    return kernels_usable(torch.empty(0, device=dev if dev.type != "cuda" or torch.cuda.is_available() else "cpu"))


#: GEMM modes for M > 64 (MXFP4; HiF4 always uses the exact BF16 path): "exact" BF16 tensor cores (cuBLAS on
#: CUDA), fp32 accumulation, exact; "fp8" FP8 tensor cores with partial sums promoted to fp32: for prepared
#: weights cuBLAS's FP8 GEMM of E5M2 activations x E4M3 weights (approximate: measured 1e-6 to 5e-5 relative to
#: the exact product), for two on-the-fly operands the Triton E5M2 GEMM promoting every 32 K-elements (exact to
#: ~2e-7, and slower than "exact"); "fp8_fast" FP8 with Hopper's default FP8 accumulation (~1e-4 relative error).
#: All products are exact (E2M1 x block scale fits the FP8 operand); only the accumulation differs.
MODES = GEMM_MODES
PROMOTE = {"exact": 0, "fp8": 32, "fp8_fast": 0}


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not valid; allowed values: {', '.join(map(repr, MODES))}")


def fp4_gemm(a: torch.Tensor, b: torch.Tensor, a_format, b_format=None, mode: str = "exact") -> torch.Tensor:
    """fp32 ``Q(a) @ Q(b)^T`` for ``a [m, K]``, ``b [n, K]`` quantized along K (nearest rounding).

    M <= 64: the decode kernel (packed b, the exact BF16 expansion of Q(a)). Larger M: see :data:`MODES`
    ("exact": BF16 tensor cores, equal to the reference up to fp32 summation order).
    """
    _check_mode(mode)
    check_tensor(a, "a", "megatron_fp4.kernels.dispatch.fp4_gemm", ndim=2)
    check_tensor(b, "b", "megatron_fp4.kernels.dispatch.fp4_gemm", ndim=2)
    if a.shape[1] != b.shape[1]:
        raise InvalidTensorError(f"megatron_fp4.kernels.dispatch.fp4_gemm: reduction dims differ: a {tuple(a.shape)}, "
                                 f"b {tuple(b.shape)}")
    from megatron_fp4.kernels.decode_gemm import w4_matmul
    from megatron_fp4.kernels.gemm import mm_expanded
    from megatron_fp4.kernels.quantize import quantize

    fa = get_format(a_format)
    fb = get_format(b_format) if b_format is not None else fa
    if fa.name != fb.name or fa.name not in KERNEL_FORMATS or not kernels_usable(a, b):
        return reference_fp4_gemm(a, b, fa, fb)
    if a.shape[0] <= DECODE_MAX_M:
        # b is quantized here, so its scales are unknown to the host: the two-factor MXFP4 path is exact for every
        # scale and costs less than the device reduction and host sync that would decide it (needs_wide_decode)
        return w4_matmul(quantize(a, fa, expand="bf16", packed=False)[1].values, quantize(b, fb), wide=True)
    ex = "bf16" if mode == "exact" else "native"
    ea = quantize(a, fa, expand=ex, packed=False)[1]
    eb = quantize(b, fb, expand=ex, packed=False)[1]
    return mm_expanded(ea, eb, promote=PROMOTE[mode])


def fp8_weight_expand(w: torch.Tensor) -> str:
    """The ``megatron_fp4.kernels.quantize.quantize`` expansion of an MXFP4 weight ``[n, K]`` for the FP8 GEMM modes:
    "e4m3" where cuBLAS's FP8 GEMM can then take it (it multiplies E5M2 activations by E4M3 weights only: CUDA, n a
    multiple of 16), else "native" (E5M2, the Triton FP8 GEMM's)."""
    return "e4m3" if w.is_cuda and not interpreting() and w.shape[0] % 16 == 0 else "native"


@dataclass
class PreparedWeight:
    """A weight ``[n, K]`` quantized along K: packed (decode kernels) and expanded (prefill GEMM); ``wide``:
    the decode kernel needs its two-factor MXFP4 path (:func:`megatron_fp4.kernels.decode_gemm.needs_wide_decode`)."""

    packed: QuantizedTensor
    expanded: object  # megatron_fp4.kernels.quantize.Expanded or None
    fmt: Format
    mode: str = "exact"
    wide: bool = False
    _bf16: object = field(default=None, repr=False)
    #: The CUDA decode kernel's layout of ``packed`` (:mod:`megatron_fp4.kernels.cuda_decode`), or None where it cannot
    #: run.
    decode: object = None

    def bf16_expanded(self):
        """The BF16 expansion (W4A16 and bf16-sum ResQ prefill GEMMs): ``expanded`` in exact mode; for FP8-mode
        weights made on first use and kept, not redone per call."""
        if self.expanded.values.dtype == torch.bfloat16:
            return self.expanded
        if self._bf16 is None:
            from megatron_fp4.kernels.quantize import expand_packed

            self._bf16 = expand_packed(self.packed, "bf16")
        return self._bf16


def prepare_weight(w: torch.Tensor, fmt, mode: str = "exact") -> PreparedWeight:
    """Quantize a weight once per weight update: packed codes + the GEMM-ready expansion (BF16, or for MXFP4
    with ``mode`` "fp8"/"fp8_fast" FP8: E4M3 for cuBLAS on CUDA where the width allows, else E5M2)."""
    from megatron_fp4.kernels.decode_gemm import needs_wide_decode
    from megatron_fp4.kernels.quantize import quantize

    _check_mode(mode)
    check_tensor(w, "w", "megatron_fp4.kernels.dispatch.prepare_weight", ndim=2)
    f = get_format(fmt)
    q, e = quantize(w, f, dim=-1, expand="bf16" if mode == "exact" or f.name == "hif4" else fp8_weight_expand(w))
    wide = needs_wide_decode(q)
    return PreparedWeight(q, e, f, mode, wide, decode=_decode_layout(q, wide))


def _decode_layout(q: QuantizedTensor, wide: bool):
    from megatron_fp4.kernels import cuda_decode

    if q.codes.is_cuda and q.codes.dim() == 2 and cuda_decode.available():
        return cuda_decode.to_decode_layout(q, wide, natural=cuda_decode.natural_layout())
    return None


def decode_matmul(a: torch.Tensor, w: PreparedWeight, out_dtype: Optional[torch.dtype] = torch.float32
                  ) -> torch.Tensor:
    """``a [M, K_pad] . deq(W)^T`` for BF16 ``a`` (M <= 64), fp32 sums as ``out_dtype``: the CUDA decode kernel where
    the weight has its layout (which stores bf16 itself where it can), else the Triton one
    (:func:`megatron_fp4.kernels.decode_gemm.w4_matmul`). ``out_dtype`` None: the fp32 sums as the kernel stores
    them, ``[splits, M, N]`` (:func:`megatron_fp4.kernels.cuda_decode.w4_decode`; the Triton kernel's ``[1, M, N]``)."""
    from megatron_fp4.kernels import cuda_decode
    from megatron_fp4.kernels.decode_gemm import w4_matmul

    check_tensor(a, "a", "megatron_fp4.kernels.dispatch.decode_matmul", dtypes=None, ndim=2)
    if not isinstance(w, PreparedWeight):
        raise InvalidTensorError(f"megatron_fp4.kernels.dispatch.decode_matmul: w must be a PreparedWeight "
                                 f"(prepare_weight), got {type(w).__name__}")
    if a.shape[1] != w.packed.codes.shape[-1] * 2:
        raise InvalidTensorError(f"megatron_fp4.kernels.dispatch.decode_matmul: a has {a.shape[1]} columns, the "
                                 f"weight's padded K is {w.packed.codes.shape[-1] * 2}")
    if w.decode is not None and a.is_cuda and a.shape[0] <= cuda_decode.MAX_M and cuda_decode.available():
        return cuda_decode.w4_decode(a, w.decode, out_dtype=out_dtype)
    out = w4_matmul(a, w.packed, wide=w.wide)
    return out.unsqueeze(0) if out_dtype is None else out.to(out_dtype)


#: Token counts up to which :func:`linear` runs a decode kernel (packed weights read once, dequantized in registers):
#: 64 on weights in natural K order (the default layout, :func:`megatron_fp4.kernels.cuda_decode.natural_layout`), 32
#: on others; above, the activations' expansion times the weight's pre-expanded BF16 copy in one cuBLAS GEMM (the same
#: exact numbers). On the H200 (session 41) with the 64-token tile (``cuda_decode.NATURAL_TILE_AT_64``), the 7B engine
#: rows with qkv and proj on the decode kernel too at 64 tokens were 0.7-2.9% faster than with them on cuBLAS
#: (docs/PERFORMANCE.md). ``MEGATRON_FP4_DECODE_KERNEL_MAX_M`` sets one bound for every weight. ResQ's exact
#: (two-operand) form keeps the Triton decode kernel up to DECODE_MAX_M.
DECODE_KERNEL_MAX_M = int(os.environ.get("MEGATRON_FP4_DECODE_KERNEL_MAX_M", "0")) or None


def decode_kernel_max_m(w: PreparedWeight) -> int:
    """The largest token count :func:`linear` sends to a decode kernel for the weight ``w``."""
    if DECODE_KERNEL_MAX_M:
        return DECODE_KERNEL_MAX_M
    return 64 if getattr(w.decode, "natural", False) else 32


def linear(x: torch.Tensor, w: PreparedWeight, resq: str = "none", activations: str = "fp4",
           out_dtype: Optional[torch.dtype] = torch.float32, resq_combine: str = "exact",
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rollout GEMM ``x [M, K] -> [M, n]`` against a prepared FP4 weight.

    ``activations``: "fp4" (W4A4) or "bf16" (W4A16: x used as is, rounded to bf16); ``resq``: "none" or "2:4";
    ``resq_combine`` (2:4 only): "exact" (the residual product added exactly) or "bf16" (one GEMM on
    bf16(Q(x) + S(Q(r))), as ``megatron_fp4.resq.RolloutPrecision.resq_combine``). ``out_dtype`` None: the decode
    kernels' fp32 split sums as they store them, ``[splits, M, n]`` (:func:`decode_matmul`), x's dtype ``[M, n]``
    elsewhere. ``bias [n]``: added to the fp32 sums before the one rounding to ``out_dtype`` (not None then), in the
    kernel that adds the decode GEMM's split sums.
    """
    from megatron_fp4.resq import RESQ_COMBINES

    if resq not in ("none", "2:4"):
        raise ValueError(f"resq={resq!r} is not valid; allowed values: 'none', '2:4'")
    if resq_combine not in RESQ_COMBINES:
        raise ValueError(f"resq_combine={resq_combine!r} is not valid; allowed values: "
                         f"{', '.join(map(repr, RESQ_COMBINES))}")
    if activations not in ("fp4", "bf16"):
        raise ValueError(f"activations={activations!r} is not valid; allowed values: 'fp4', 'bf16'")
    check_tensor(x, "x", "megatron_fp4.kernels.dispatch.linear", ndim=2)
    if not isinstance(w, PreparedWeight):
        raise InvalidTensorError(f"megatron_fp4.kernels.dispatch.linear: w must be a PreparedWeight "
                                 f"(prepare_weight), got {type(w).__name__}")
    if x.shape[1] != w.packed.shape[1]:
        raise InvalidTensorError(f"megatron_fp4.kernels.dispatch.linear: x has {x.shape[1]} features but the weight is "
                                 f"{tuple(w.packed.shape)}")
    if bias is None:
        return _gemm(x, w, resq, activations, resq_combine, out_dtype, out_dtype or x.dtype)
    if out_dtype is None or bias.shape != (w.packed.shape[0],):
        raise InvalidTensorError(f"megatron_fp4.kernels.dispatch.linear: bias must be [{w.packed.shape[0]}] and comes "
                                 f"with an out_dtype (got {tuple(bias.shape)}, out_dtype {out_dtype})")
    from megatron_fp4.kernels.decode_ops import split_sum

    # the GEMM's fp32 sums (a decode kernel's split sums as stored), then the bias and the rounding in one kernel
    return split_sum(_gemm(x, w, resq, activations, resq_combine, None, torch.float32), out_dtype, bias)


def _gemm(x: torch.Tensor, w: PreparedWeight, resq: str, activations: str, resq_combine: str,
          dec_dtype: Optional[torch.dtype], out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`linear`'s GEMM: the decode kernels' output as ``dec_dtype`` (None: split sums as stored), every other
    path's as ``out_dtype``."""
    from megatron_fp4.kernels.gemm import mm_expanded
    from megatron_fp4.kernels.quantize import quantize
    from megatron_fp4.kernels.resq import resq_matmul

    K = x.shape[-1]
    kp = w.packed.codes.shape[-1] * 2
    if not kernels_usable(x) or w.fmt.name not in KERNEL_FORMATS:
        return linear_reference(x, w, resq, activations, resq_combine).to(out_dtype)
    max_m = decode_kernel_max_m(w)
    if activations == "bf16":
        xb = x.to(torch.bfloat16)
        if kp != K:
            xb = torch.nn.functional.pad(xb, (0, kp - K))
        if x.shape[0] <= max_m:
            return decode_matmul(xb, w, dec_dtype)
        from megatron_fp4.kernels.quantize import Expanded

        return mm_expanded(Expanded(xb), w.bf16_expanded(), out_dtype=out_dtype)
    if resq == "2:4":
        sum_prefill = resq_combine == "bf16" and x.shape[0] > DECODE_MAX_M  # one BF16 GEMM: BF16 weight operand
        if resq_combine == "bf16" and x.shape[0] <= DECODE_MAX_M:
            from megatron_fp4.kernels.resq import resq_quantize

            a = resq_quantize(x, w.fmt, expand="sum", packed=False)[2]
            if x.shape[0] <= max_m:
                return decode_matmul(a.values, w, dec_dtype)
            return mm_expanded(a, w.bf16_expanded(), out_dtype=out_dtype)
        return resq_matmul(x, w.packed, w.bf16_expanded() if sum_prefill else w.expanded, out_dtype=out_dtype,
                           promote=PROMOTE[w.mode], wide=w.wide, combine=resq_combine)
    if x.shape[0] <= max_m:
        return decode_matmul(quantize(x, w.fmt, expand="bf16", packed=False)[1].values, w, dec_dtype)
    ex = quantize(x, w.fmt, expand="bf16" if w.expanded.values.dtype == torch.bfloat16 else "native", packed=False)[1]
    return mm_expanded(ex, w.expanded, out_dtype=out_dtype, promote=PROMOTE[w.mode])


def linear_reference(x: torch.Tensor, w: PreparedWeight, resq: str, activations: str,
                      resq_combine: str = "exact") -> torch.Tensor:
    """PyTorch twin of :func:`linear` (fp32 results)."""
    if resq == "2:4" and activations == "fp4":
        from megatron_fp4.kernels.resq import resq_matmul

        return resq_matmul(x, w.packed, combine=resq_combine)  # its PyTorch twin where the kernels cannot run
    wq = w.packed.dequantize().float()
    if activations == "bf16":
        return x.to(torch.bfloat16).float() @ wq.t()
    return w.fmt.fake_quantize(x.float(), dim=-1) @ wq.t()
