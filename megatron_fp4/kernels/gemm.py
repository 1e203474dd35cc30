"""Pre-expanded FP4 GEMMs for Hopper (no FP4 tensor cores): exact products of HiF4/MXFP4 operands (SPEC §3).

The operands are dequantized once to a GEMM-ready :class:`megatron_fp4.kernels.quantize.Expanded` form (weights offline
per weight update, activations inside the fused quantize kernel), then ONE plain tensor-core GEMM runs with the
power-of-two row/column scales applied only in the epilogue: cuBLAS where it applies (faster than our Triton GEMM on
the H200), else a Triton GEMM with a single ``acc = tl.dot(a, b, acc)`` loop. BF16 for HiF4 (element x
micro-exponents x E6M2 needs <= 6 significant bits), FP8 for MXFP4 (E2M1 x block scale fits E5M2 relative to a
per-row power of two for blocks within 27 binades of the row's largest, E4M3 within 14; values further down are
flushed to zero by the quantizer, each under 2^-29 (E5M2) or 2^-16 (E4M3) of the row's largest value:
:class:`megatron_fp4.kernels.quantize.Expanded`). Measured on the H200: Hopper's FP8 MMA does NOT accumulate in full
fp32 (partial sums keep about 13-14 bits relative to the largest product), so the FP8 path is "exact products of the
held values, approximate accumulation" (relative error ~1e-4; ``promote`` narrows it at a speed cost). The exact
path for both formats is the BF16 expansion (MXFP4 values are exact in BF16 too), whose tensor cores accumulate in
fp32.

The other GEMM families read packed operands: :mod:`megatron_fp4.kernels.packed_gemm` (both operands packed, dequantized
in the prologue) and :mod:`megatron_fp4.kernels.decode_gemm` (the decode GEMM, M <= 64: packed weights x BF16
activations).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

from megatron_fp4.kernels._common import HAS_TRITON, cdiv, interpreting, tl, triton, tune_bucket
from megatron_fp4.kernels.quantize import Expanded

__all__ = ["IMPLS", "mm_expanded"]

if HAS_TRITON:

    @triton.jit
    def _p2(e):
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    def _gemm_configs(bk):
        cfgs = []
        for bm, bn, w, st in ((128, 256, 8, 3), (128, 256, 8, 4), (256, 128, 8, 3), (128, 128, 4, 4),
                              (256, 128, 8, 4)):
            cfgs.append(triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=st))
        return cfgs

    @triton.jit
    def _grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) of a program in GROUP_M-row super-tiles (L2 reuse of the B tiles)."""
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        group = GROUP_M * num_n
        first_m = (pid // group) * GROUP_M
        gsize = tl.minimum(num_m - first_m, GROUP_M)
        return first_m + ((pid % group) % gsize), (pid % group) // gsize

    @triton.jit
    def _mma(a, b, acc, PRECISE_ACC: tl.constexpr, IEEE: tl.constexpr):
        """acc + a . b: FP8 with promotion every PRECISE_ACC values (0: Hopper's default), fp32 in IEEE mode."""
        if PRECISE_ACC > 0:
            return tl.dot(a, b, acc, max_num_imprecise_acc=PRECISE_ACC)
        elif IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _gemm_body(a_ptr, r_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K, stride_am, stride_rm, stride_bn,
                   stride_cm, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISE_ACC: tl.constexpr,
                   IEEE: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, GROUP_M: tl.constexpr):
        pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
        offs_am = (pid_m * BM + tl.arange(0, BM)) % M
        offs_bn = (pid_n * BN + tl.arange(0, BN)) % N
        offs_k = tl.arange(0, BK)
        a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :]
        r_ptrs = r_ptr + offs_am[:, None] * stride_rm + offs_k[None, :]
        b_ptrs = b_ptr + offs_bn[None, :] * stride_bn + offs_k[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(0, tl.cdiv(K, BK)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=offs_k[None, :] < K - kk * BK, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < K - kk * BK, other=0.0)
            acc = _mma(a, b, acc, PRECISE_ACC, IEEE)
            if HAS_RES:
                if EVEN_K:
                    r = tl.load(r_ptrs)
                else:
                    r = tl.load(r_ptrs, mask=offs_k[None, :] < K - kk * BK, other=0.0)
                acc = _mma(r, b, acc, PRECISE_ACC, IEEE)
                r_ptrs += BK
            a_ptrs += BK
            b_ptrs += BK
        offs_cm = pid_m * BM + tl.arange(0, BM)
        offs_cn = pid_n * BN + tl.arange(0, BN)
        cmask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
        if HAS_SCALE:
            sa = tl.load(sa_ptr + offs_cm, mask=offs_cm < M, other=0)
            sb = tl.load(sb_ptr + offs_cn, mask=offs_cn < N, other=0)
            acc = (acc * _p2(sa)[:, None]) * _p2(sb)[None, :]
        tl.store(c_ptr + offs_cm[:, None] * stride_cm + offs_cn[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=cmask)

    @triton.jit
    def _gemm_kernel_fixed(a_ptr, r_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K, stride_am, stride_rm, stride_bn,
                           stride_cm, M_BUCKET, K_BUCKET, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISE_ACC: tl.constexpr,
                           IEEE: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, GROUP_M: tl.constexpr):
        _gemm_body(a_ptr, r_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K, stride_am, stride_rm, stride_bn, stride_cm,
                   HAS_RES, HAS_SCALE, PRECISE_ACC, IEEE, EVEN_K, BM, BN, BK, GROUP_M)

    # Tune per power-of-two bucket of M and K, not per exact size: training and rollout see a new token count
    # almost every step, and re-tuning each one costs far more than the GEMM (M_BUCKET/K_BUCKET are key-only).
    _GEMM_KEY = ["M_BUCKET", "N", "K_BUCKET", "HAS_RES", "PRECISE_ACC"]
    _gemm_kernel_bf16 = triton.autotune(configs=_gemm_configs(64), key=_GEMM_KEY)(_gemm_kernel_fixed)
    _gemm_kernel_fp8 = triton.autotune(configs=_gemm_configs(128), key=_GEMM_KEY)(_gemm_kernel_fixed)


# ----------------------------------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------------------------------
#: GEMM implementations of :func:`mm_expanded` (None: cuBLAS where it applies, else Triton).
IMPLS = (None, "cublas", "triton")
_FP8 = (torch.float8_e5m2, torch.float8_e4m3fn)


def _cublas_applies(a: Expanded, b: Expanded) -> bool:
    """cuBLAS takes BF16 x BF16 (no row scales) and E5M2 x E4M3 with row scales (``torch._scaled_mm``: not
    E5M2 x E5M2; K and N multiples of 16), on CUDA outside the interpreter."""
    av, bv = a.values, b.values
    if not (av.is_cuda and bv.is_cuda) or interpreting():
        return False
    if av.dtype == bv.dtype == torch.bfloat16:
        return a.row_exp is None and b.row_exp is None
    return ({av.dtype, bv.dtype} == set(_FP8) and a.row_exp is not None and b.row_exp is not None
            and av.shape[1] % 16 == 0 and bv.shape[0] % 16 == 0)


@contextmanager
def _fp32_reductions():
    """cuBLAS may reduce split-K partial sums of a BF16-output GEMM in BF16 (PyTorch's default allows it): not
    here, so that the exact path rounds once, from fp32."""
    m = torch.backends.cuda.matmul
    old = m.allow_bf16_reduced_precision_reduction
    m.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction = old


def _cublas_mm(a: Expanded, b: Expanded, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    av, bv = a.values, b.values
    if av.dtype == torch.bfloat16:  # fp32 accumulation, one rounding to out_dtype
        if out_dtype == torch.bfloat16:
            with _fp32_reductions():
                return torch.mm(av, bv.t())
        return torch.mm(av, bv.t(), out_dtype=torch.float32).to(out_dtype)
    sa = (a.row_scale if a.row_scale is not None else torch.exp2(a.row_exp.float())).unsqueeze(1)
    sb = (b.row_scale if b.row_scale is not None else torch.exp2(b.row_exp.float())).unsqueeze(0)
    return torch._scaled_mm(av, bv.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)


def mm_expanded(a: Expanded, b: Expanded, a_res: Optional[Expanded] = None,
                out_dtype: torch.dtype = torch.float32, promote: int = 0,
                config: Optional[dict] = None, impl: Optional[str] = None) -> torch.Tensor:
    """``(a [+ a_res along K]) @ b^T`` of expanded operands on the tensor cores (no row fallback).

    ``impl`` (see :data:`IMPLS`): "cublas" runs the expansions through cuBLAS (BF16 x BF16 with fp32
    accumulation; MXFP4 E5M2 activations x E4M3 weights through ``torch._scaled_mm`` with the power-of-two row
    scales); "triton" runs our plain one-loop Triton GEMM; None picks cuBLAS where it applies, except for a
    BF16 ``a_res``, where one Triton GEMM in concatenated-K form [a | a_res] . [b | b]^T reads each b tile once
    (cuBLAS computes the two products into fp32 and adds them). FP8 operands carry row exponents; ``a_res``
    must then share ``a``'s row exponents (the fused ResQ quantizer writes them so). ``config`` (BM, BN,
    num_warps, num_stages) skips the Triton autotuning. ``promote`` (FP8 only): 0 is Hopper's default FP8
    accumulation (about 2^-13 relative to the largest partial product; cuBLAS "fast accumulation"); > 0 adds
    the tensor cores' partial sums into fp32 every ``promote`` K-elements (Triton; 32 is exact to ~2e-7) or
    uses cuBLAS's promoted accumulation (not exact: measured 1e-6 to 5e-5 relative, docs/PERFORMANCE.md).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not valid; allowed values: {', '.join(map(repr, IMPLS))}")
    av, bv = a.values, b.values
    M, K = av.shape
    N = bv.shape[0]
    if bv.shape[1] != K:
        raise ValueError(f"mm_expanded: K differs: {tuple(av.shape)} vs {tuple(bv.shape)}")
    cublas = _cublas_applies(a, b)
    if impl == "cublas" and not cublas:
        raise ValueError(f"impl='cublas' needs CUDA BF16 x BF16 or E5M2 x E4M3 operands (K, N multiples of 16), "
                         f"got {av.dtype} x {bv.dtype} of {tuple(av.shape)} x {tuple(bv.shape)}")
    bf16_resq = a_res is not None and av.dtype == torch.bfloat16  # one Triton GEMM in concatenated-K form
    if impl == "cublas" or (impl is None and cublas and not bf16_resq):
        if a_res is None:
            return _cublas_mm(a, b, out_dtype, promote == 0)
        c = _cublas_mm(a, b, torch.float32, promote == 0)
        return c.add_(_cublas_mm(a_res, b, torch.float32, promote == 0)).to(out_dtype)
    if av.dtype != bv.dtype and not interpreting():
        raise ValueError(f"the Triton GEMM needs operands of one dtype, got {av.dtype} x {bv.dtype}")
    fp8 = av.dtype in _FP8
    c = torch.empty((M, N), dtype=out_dtype, device=av.device)
    has_scale = a.row_exp is not None or b.row_exp is not None
    sa = a.row_exp if a.row_exp is not None else torch.zeros(M, dtype=torch.int32, device=av.device)
    sb = b.row_exp if b.row_exp is not None else torch.zeros(N, dtype=torch.int32, device=av.device)
    rv = a_res.values if a_res is not None else av
    ieee = interpreting()
    if ieee and av.dtype != torch.float32:  # the interpreter cannot dot bf16/fp8: same values in fp32
        av, bv, rv = av.float(), bv.float(), rv.float()
    BK = 128 if fp8 else 64
    precise_acc = promote if (fp8 and not ieee) else 0
    even_k = K % BK == 0
    args = (av, rv, bv, c, sa, sb, M, N, K, av.stride(0), rv.stride(0), bv.stride(0), c.stride(0),
            tune_bucket(M), tune_bucket(K))
    kw = dict(HAS_RES=a_res is not None, HAS_SCALE=has_scale, PRECISE_ACC=precise_acc, IEEE=ieee, EVEN_K=even_k)
    if config is None and not ieee and M * N * K < 2 ** 31:  # small problems: no autotuning
        config = {"BM": 128, "BN": 128, "num_warps": 4, "num_stages": 3}
    if config is not None or ieee:
        cfg = config or {"BM": 32, "BN": 32, "num_warps": 4, "num_stages": 1}
        bk = 32 if ieee else BK
        kw["EVEN_K"] = K % bk == 0
        grid = (cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"]),)
        _gemm_kernel_fixed[grid](*args, **kw, BM=cfg["BM"], BN=cfg["BN"], BK=bk, GROUP_M=8,
                                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    else:
        grid = lambda meta: (cdiv(M, meta["BM"]) * cdiv(N, meta["BN"]),)  # noqa: E731
        (_gemm_kernel_fp8 if fp8 else _gemm_kernel_bf16)[grid](*args, **kw)
    return c
