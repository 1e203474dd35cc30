"""FP4 GEMMs for Hopper (no FP4 tensor cores): exact products of packed HiF4/MXFP4 operands (SPEC §3).

Two ways to feed the tensor cores, both exact with respect to ``Q(a) @ Q(b)^T`` computed by the reference:

- pre-expanded (fast path for M > 64): operands dequantized once to a GEMM-ready :class:`Expanded` form (weights
  offline per weight update, activations inside the fused quantize kernel), then ONE plain tensor-core GEMM with
  the power-of-two row/column scales applied only in the epilogue: cuBLAS where it applies (faster than our
  Triton GEMM on the H200), else a Triton GEMM with a single ``acc = tl.dot(a, b, acc)`` loop. BF16 for HiF4
  (element x micro-exponents x E6M2 needs <= 6 significant bits), FP8 for MXFP4 (E2M1 x block scale fits E5M2
  relative to a per-row power of two for blocks within 27 binades of the row's largest, E4M3 within 14; values
  further down are flushed to zero by the quantizer, each under 2^-29 (E5M2) or 2^-16 (E4M3) of the row's
  largest value: :class:`kernels.quantize.Expanded`). Measured on the H200: Hopper's FP8 MMA does NOT accumulate
  in full fp32 (partial sums keep about 13-14 bits relative to the largest product), so the FP8 path is "exact
  products of the held values, approximate accumulation" (relative error ~1e-4; ``promote`` narrows it at a
  speed cost). The exact path for both formats is the BF16 expansion (MXFP4 values are exact in BF16 too),
  whose tensor cores accumulate in fp32.
- packed (``packed_matmul``/``w4_matmul``): the kernel reads the 4-bit codes and scales and dequantizes to BF16
  in its prologue. ``w4_matmul`` is the decode kernel (M <= 64): packed weights x BF16 activations (W4A16, or
  the exact BF16 expansions of FP4 activations for W4A4), optionally with a second activation (the ResQ
  residual) that rides on the same weight read.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

from kernels._common import HAS_TRITON, cdiv, interpreting, sm_count, tl, triton, tune_bucket
from kernels.quantize import Expanded
from megatron_fp4.formats import QuantizedTensor
from megatron_fp4.formats.packing import unpack_nibbles

__all__ = ["IMPLS", "mm_expanded", "packed_matmul", "w4_matmul", "needs_wide_decode", "dequantize_rows"]

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

    # --- packed operands: dequantize in the prologue ---------------------------------------------------------
    @triton.jit
    def _e8m0_half(s):
        """2^(X-1) for E8M0 bytes s (X = s - 127; NaN for 255), fp32."""
        v = tl.where(s >= 2, ((s - 1) << 23).to(tl.float32, bitcast=True),
                     tl.where(s == 1, 5.877471754111438e-39, 2.938735877055719e-39))
        return tl.where(s == 255, float("nan"), v)

    @triton.jit
    def _deq_bytes(q, s_ptr, rows, rmask, j0, j, stride_s, FMT: tl.constexpr):
        """Packed bytes q [R, 32] (byte columns j = j0 + 0..31, j0 a multiple of 32, i.e. 64 values) ->
        (even, odd) element values fp32 [R, 32] (exact). Scales are loaded once per row and broadcast."""
        q = q.to(tl.int32)
        jj = (j % 32)[None, :]
        if FMT == 0:  # HiF4: one 64-value unit = one 32-bit scale word per row
            w = tl.load(s_ptr + rows * stride_s + j0 // 32, mask=rmask, other=0)[:, None]
            c = w & 0xFF
            b8 = (w >> (8 + jj // 4)) & 1
            b16 = (w >> (16 + jj // 2)) & 1
            sc = ((((c >> 2) + 77 + b8 + b16) << 23) | ((c & 3) << 21)).to(tl.float32, bitcast=True)
            sc = tl.where(c == 255, float("nan"), sc)
            lo = ((q & 7) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            hi = (((q >> 4) & 7) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        else:  # MXFP4: two E8M0 bytes per row; value = (2*e2m1) * 2^(X-1), the scale computed once per row
            s0 = tl.load(s_ptr + rows * stride_s + j0 // 16, mask=rmask, other=127).to(tl.int32)
            s1 = tl.load(s_ptr + rows * stride_s + j0 // 16 + 1, mask=rmask, other=127).to(tl.int32)
            sc = tl.where(jj < 16, _e8m0_half(s0)[:, None], _e8m0_half(s1)[:, None])
            lut = tl.full(q.shape, -932957680, tl.int32)
            lo = ((lut >> ((q & 7) * 4)) & 0xF).to(tl.float32)
            hi = ((lut >> (((q >> 4) & 7) * 4)) & 0xF).to(tl.float32)
        lo = lo * sc
        hi = hi * sc
        lo = tl.where((q & 0x8) != 0, -lo, lo)
        hi = tl.where((q & 0x80) != 0, -hi, hi)
        return lo, hi

    @triton.jit
    def _dot(a, b, acc, F32: tl.constexpr):
        if F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)

    @triton.jit
    def _packed_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, KH, stride_am, stride_asm, stride_bn,
                            stride_bsn, stride_cm, FMT: tl.constexpr, F32: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, BKH: tl.constexpr, GROUP_M: tl.constexpr):
        """C = deq(A) . deq(B)^T with both operands read packed and dequantized to BF16 in the main loop. The
        even and odd elements of each 64-value slice form two dots, so no nibble interleaving is needed."""
        pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        mmask = offs_m < M
        nmask = offs_n < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for j0 in range(0, KH, BKH):
            j = j0 + tl.arange(0, BKH)  # BKH == 32: one HiF4 unit / two MXFP4 blocks per row
            jm = j < KH
            qb = tl.load(b_ptr + offs_n[:, None] * stride_bn + j[None, :], mask=nmask[:, None] & jm[None, :],
                         other=0)
            blo, bhi = _deq_bytes(qb, bs_ptr, offs_n, nmask, j0, j, stride_bsn, FMT)
            qa = tl.load(a_ptr + offs_m[:, None] * stride_am + j[None, :], mask=mmask[:, None] & jm[None, :],
                         other=0)
            alo, ahi = _deq_bytes(qa, as_ptr, offs_m, mmask, j0, j, stride_asm, FMT)
            acc = _dot(alo, tl.trans(blo), acc, F32)
            acc = _dot(ahi, tl.trans(bhi), acc, F32)
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


    @triton.jit
    def _decode_tile(M, N, BN: tl.constexpr, BM: tl.constexpr):
        """A decode program's split-K index, its BN weight rows (N side) and the BM token columns, with masks."""
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        offs_m = tl.arange(0, BM)
        return tl.program_id(1), offs_n, offs_m, offs_n < N, offs_m < M

    @triton.jit
    def _store_decode(c_ptr, acc, offs_n, offs_m, nmask, mmask, stride_cm, SPLIT_K: tl.constexpr):
        """out[m, n] = acc[n, m] (the swapped accumulator); split-K programs add theirs atomically."""
        cptr = c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None]
        cmask = nmask[:, None] & mmask[None, :]
        if SPLIT_K > 1:
            tl.atomic_add(cptr, acc, mask=cmask)
        else:
            tl.store(cptr, acc.to(c_ptr.dtype.element_ty), mask=cmask)

    # --- W4A16 decode: unpack 32-bit pairs of 16-bit code lanes with a few bit operations per value ----------
    # One asm instance takes two 16-bit code lanes (4 codes each) and returns, per nibble position j, a bf16x2
    # register with both lanes' values (Marlin-style: both lanes go through the same bit operations).
    # MXFP4: sign | (e2m1 magnitude << 6) is the bf16 of e2m1 * 2^-126 (subnormal for e = 0 codes, as bf16
    # arithmetic supports), times f = 2^(X + 126) (and, WIDE: a second factor for X > 1) is e2m1 * 2^X exactly.
    # HiF4: k | magic is the bf16 128 + k (j even) or 8 + k (j odd, k four bits up); fma(v, F, -128F / -8F) = k F
    # exactly (k F has <= 6 significant bits), then the sign is xor-ed in. F = E6M2 x 2^micro per 16-bit lane.
    @triton.jit
    def _nibble_pure(hw, f, g, J: tl.constexpr, FMT: tl.constexpr, WIDE: tl.constexpr):
        """The same numbers as the asm below, in fp32 (CPU interpreter)."""
        n = (hw.to(tl.int32) >> (4 * J)) & 0xF
        ff = (f << 16).to(tl.float32, bitcast=True)
        if FMT == 1:
            v = (((n & 7) << 22) | ((n & 8) << 28)).to(tl.float32, bitcast=True) * ff
            if WIDE:
                v = v * (g << 16).to(tl.float32, bitcast=True)
        else:
            v = (n & 7).to(tl.float32) * ff
            v = tl.where((n & 8) != 0, -v, v)
        return v.to(tl.bfloat16)

    def _asm_unpack(fmt: int, wide: bool) -> str:
        lines = [".reg .b32 t, a, s, f;", "prmt.b32 f, $5, $6, 0x5410;"]
        if fmt == 1:
            if wide:
                lines += [".reg .b32 g;", "prmt.b32 g, $7, $8, 0x5410;"]
            for j in (3, 2, 1, 0):
                src = "$4" if j == 3 else "t"
                if j != 3:
                    lines.append(f"shl.b32 t, $4, {4 * (3 - j)};")
                lines.append(f"and.b32 a, {src}, 0x70007000; shr.b32 a, a, 6; and.b32 s, {src}, 0x80008000; "
                             f"or.b32 a, a, s; mul.rn.bf16x2 ${j}, a, f;")
                if wide:
                    lines.append(f"mul.rn.bf16x2 ${j}, ${j}, g;")
        else:
            lines += [".reg .b32 n128, n8;", "mov.b32 n128, 0xC300C300; mul.rn.bf16x2 n128, f, n128;",
                      "mov.b32 n8, 0xC100C100; mul.rn.bf16x2 n8, f, n8;", "shr.b32 t, $4, 8;"]
            for j in range(4):
                src = "$4" if j < 2 else "t"
                mask, magic, neg = ("0x00070007", "0x43004300", "n128") if j % 2 == 0 else \
                    ("0x00700070", "0x41004100", "n8")
                lines.append(f"and.b32 a, {src}, {mask}; or.b32 a, a, {magic}; fma.rn.bf16x2 a, a, f, {neg};")
                lines.append(f"shl.b32 s, $4, {12 - 4 * j}; and.b32 s, s, 0x80008000; xor.b32 ${j}, a, s;")
        return "{\n" + "\n".join(lines) + "\n}"

    _ASM_MX = tl.constexpr(_asm_unpack(1, False))
    _ASM_MX_WIDE = tl.constexpr(_asm_unpack(1, True))
    _ASM_HIF4 = tl.constexpr(_asm_unpack(0, False))

    @triton.jit
    def _unpack_planes(hw, f, g, FMT: tl.constexpr, WIDE: tl.constexpr, ASM: tl.constexpr):
        """int16 code lanes hw [R, H] (4 codes each) and int32 factors (low 16 bits: bf16 f, g) -> bf16 values of
        nibble j = 0..3 of each lane (K index 4h + j), four [R, H] tensors."""
        if ASM:
            if FMT == 1:
                if WIDE:
                    return tl.inline_asm_elementwise(_ASM_MX_WIDE, "=r,=r,=r,=r,r,r,r,r,r", [hw, f, g],
                                                     dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
                return tl.inline_asm_elementwise(_ASM_MX, "=r,=r,=r,=r,r,r,r", [hw, f],
                                                 dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
            return tl.inline_asm_elementwise(_ASM_HIF4, "=r,=r,=r,=r,r,r,r", [hw, f], dtype=(tl.bfloat16,) * 4,
                                             is_pure=True, pack=2)
        return (_nibble_pure(hw, f, g, 0, FMT, WIDE), _nibble_pure(hw, f, g, 1, FMT, WIDE),
                _nibble_pure(hw, f, g, 2, FMT, WIDE), _nibble_pure(hw, f, g, 3, FMT, WIDE))

    @triton.jit
    def _step_loads(x_ptr, r_ptr, b_ptr, bs_ptr, offs_n, nmask, offs_m, mmask, st, KH2, stride_xm, stride_rm,
                    stride_bn, stride_bsn, FMT: tl.constexpr, HAS_RES: tl.constexpr, BM: tl.constexpr):
        """Everything decode step ``st`` reads (zeros beyond K): codes [BN, 16] (int16 lanes), the raw scales
        (MXFP4: the two blocks' E8M0 bytes; HiF4: the unit's word, twice) and activations [BM, 64] (+ residual)."""
        i = tl.arange(0, 16)[None, :]
        live = nmask & ((offs_n * 0 + st * 16) < KH2)
        hw = tl.load(b_ptr + offs_n[:, None] * stride_bn + st * 16 + i, mask=live[:, None] & (st * 16 + i < KH2),
                     other=0)
        if FMT == 1:
            sa = tl.load(bs_ptr + offs_n * stride_bsn + 2 * st, mask=live, other=127).to(tl.int32)
            sb = tl.load(bs_ptr + offs_n * stride_bsn + 2 * st + 1, mask=live & ((offs_n * 0 + st * 16 + 8) < KH2),
                         other=127).to(tl.int32)
        else:
            sa = tl.load(bs_ptr + offs_n * stride_bsn + st, mask=live, other=0)
            sb = sa
        kk = 64 * st + tl.arange(0, 64)
        xm = mmask[:, None] & (kk < 4 * KH2)[None, :]
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=xm, other=0.0)
        rt = xt
        if HAS_RES:
            rt = tl.load(r_ptr + offs_m[:, None] * stride_rm + kk[None, :], mask=xm, other=0.0)
        return hw, sa, sb, xt, rt

    @triton.jit
    def _step_factors(sa, sb, FMT: tl.constexpr, WIDE: tl.constexpr):
        """Per 16-bit code lane [BN, 16]: the bf16 bits of f (and g) that _unpack_planes multiplies by."""
        i = tl.arange(0, 16)[None, :]
        if FMT == 1:  # two E8M0 blocks: f = 2^(X + 126) (WIDE: min(., 127), g = the rest)
            sx = tl.where(i < 8, sa[:, None], sb[:, None]) + 126
            if WIDE:
                f = tl.where(sx == 381, 0x7FC0, tl.minimum(sx, 254) << 7)
                g = (tl.maximum(sx - 254, 0) + 127) << 7
            else:
                f = tl.where(sx == 381, 0x7FC0, sx << 7)
                g = f
        else:  # HiF4 unit: F = E6M2 x 2^(E1_8 + E1_16) per 16-bit lane; NaN units (0xFF) -> NaN
            c = sa & 0xFF
            base = tl.where(c == 255, 0x7FC0, (((c >> 2) + 77) << 7) | ((c & 3) << 5))[:, None]
            w = tl.where(c == 255, 0, sa)[:, None]
            f = base + ((((w >> (8 + i // 2)) & 1) + ((w >> (16 + i)) & 1)) << 7)
            g = f
        return f, g

    @triton.jit
    def _permute_k(xt, BM: tl.constexpr, XPERM: tl.constexpr):
        """Activations [BM, 64] -> [64, BM] in the weight tile's K order (8w + 2j + e holds K = 8w + j + 4e);
        XPERM: stored in that order already (:func:`permute_decode_activations`)."""
        if XPERM:
            return tl.trans(xt)
        return tl.trans(tl.reshape(tl.permute(tl.reshape(xt, (BM, 8, 2, 4)), (0, 1, 3, 2)), (BM, 64)))

    @triton.jit
    def _w4_decode_kernel(x_ptr, r_ptr, b_ptr, bs_ptr, c_ptr, M, N, KH2, stride_xm, stride_rm, stride_bn,
                          stride_bsn, stride_cm, FMT: tl.constexpr, HAS_RES: tl.constexpr, SPLIT_K: tl.constexpr,
                          WIDE: tl.constexpr, ASM: tl.constexpr, F32: tl.constexpr, XPERM: tl.constexpr,
                          PREFETCH: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):
        """out[M, N] (+)= x[M, K] . deq(W[N, K])^T for M <= BM, computed swapped (acc = W . x^T, [BN, BM]): the
        weight tile, dequantized to BF16 in registers (exact), is the MMA's M side, the few tokens its N side.
        A step is 64 values (one HiF4 unit, two MXFP4 blocks): 16 code lanes of 16 bits per row (b_ptr: int16
        view, KH2 lanes per row); split-K programs take every SPLIT_K-th step. PREFETCH: the next step's loads are
        issued before this step's math (registers, no shared-memory stages). The ResQ residual reuses the tile."""
        pid_k, offs_n, offs_m, nmask, mmask = _decode_tile(M, N, BN, BM)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        if PREFETCH:
            hw, sa, sb, xt, rt = _step_loads(x_ptr, r_ptr, b_ptr, bs_ptr, offs_n, nmask, offs_m, mmask, pid_k, KH2,
                                             stride_xm, stride_rm, stride_bn, stride_bsn, FMT, HAS_RES, BM)
        for st in range(pid_k, tl.cdiv(KH2, 16), SPLIT_K):
            if PREFETCH:
                hw2, sa2, sb2, xt2, rt2 = _step_loads(x_ptr, r_ptr, b_ptr, bs_ptr, offs_n, nmask, offs_m, mmask,
                                                      st + SPLIT_K, KH2, stride_xm, stride_rm, stride_bn, stride_bsn,
                                                      FMT, HAS_RES, BM)
            else:
                hw, sa, sb, xt, rt = _step_loads(x_ptr, r_ptr, b_ptr, bs_ptr, offs_n, nmask, offs_m, mmask, st, KH2,
                                                 stride_xm, stride_rm, stride_bn, stride_bsn, FMT, HAS_RES, BM)
            f, g = _step_factors(sa, sb, FMT, WIDE)
            v0, v1, v2, v3 = _unpack_planes(hw, f, g, FMT, WIDE, ASM)
            # keep each asm output pair (K 8w + j, 8w + 4 + j) adjacent; x takes the same K order
            t = tl.join(tl.join(tl.reshape(v0, (BN, 8, 2)), tl.reshape(v1, (BN, 8, 2))),
                        tl.join(tl.reshape(v2, (BN, 8, 2)), tl.reshape(v3, (BN, 8, 2))))
            wt = tl.reshape(tl.permute(t, (0, 1, 4, 3, 2)), (BN, 64))
            acc = _dot(wt, _permute_k(xt, BM, XPERM), acc, F32)
            if HAS_RES:
                acc = _dot(wt, _permute_k(rt, BM, XPERM), acc, F32)
            if PREFETCH:
                hw, sa, sb, xt, rt = hw2, sa2, sb2, xt2, rt2
        _store_decode(c_ptr, acc, offs_n, offs_m, nmask, mmask, stride_cm, SPLIT_K)


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


def dequantize_rows(qt: QuantizedTensor, rows: torch.Tensor) -> torch.Tensor:
    """fp32 [len(rows), K_pad] values of the selected rows of a 2-D row-quantized QuantizedTensor (PyTorch)."""
    f = qt.fmt
    codes2 = qt.codes.reshape(-1, qt.codes.shape[-1])[rows]
    nblk = codes2.shape[1] * 2 // f.block_size
    codes = unpack_nibbles(codes2).reshape(codes2.shape[0], nblk, f.block_size)
    scales = qt.scales.reshape(-1, nblk, f.scale_bytes)[rows]
    return f._decode(codes, scales, qt.global_scale).reshape(codes2.shape[0], -1)


def _scale_arg(qt: QuantizedTensor) -> torch.Tensor:
    s = qt.scales.reshape(-1, qt.scales.shape[-2] * 4 if qt.fmt.name == "hif4" else qt.scales.shape[-1])
    return s.view(torch.int32) if qt.fmt.name == "hif4" else s


def _fmt_id(qt: QuantizedTensor) -> int:
    return 0 if qt.fmt.name == "hif4" else 1


def packed_matmul(qa: QuantizedTensor, qb: QuantizedTensor, out_dtype: torch.dtype = torch.float32,
                  config: Optional[dict] = None) -> torch.Tensor:
    """``Q(a) @ Q(b)^T`` reading both packed operands and dequantizing them to BF16 inside the GEMM (exact)."""
    if qa.fmt.name != qb.fmt.name:
        raise ValueError(f"packed_matmul: formats differ ({qa.fmt.name}, {qb.fmt.name})")
    a = qa.codes.reshape(-1, qa.codes.shape[-1])
    b = qb.codes.reshape(-1, qb.codes.shape[-1])
    M, KH = a.shape
    N = b.shape[0]
    sa, sb = _scale_arg(qa), _scale_arg(qb)
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    f32 = interpreting()
    cfg = config or ({"BM": 16, "BN": 16, "BKH": 32, "num_warps": 4, "num_stages": 1} if f32 else
                     {"BM": 128, "BN": 128, "BKH": 32, "num_warps": 8, "num_stages": 3})
    grid = (cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"]),)
    _packed_gemm_kernel[grid](a, sa, b, sb, c, M, N, KH, a.stride(0), sa.stride(0), b.stride(0), sb.stride(0),
                              c.stride(0), FMT=_fmt_id(qa), F32=f32, BM=cfg["BM"], BN=cfg["BN"], BKH=cfg["BKH"],
                              GROUP_M=8, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return c


_PREFETCH = {"BN": 64, "num_warps": 4, "num_stages": 1, "PREFETCH": True, "XPERM": False}
#: Decode-kernel tiles by (format family, token bucket), measured on the H200 over the five benchmark shapes
#: (docs/PERFORMANCE.md, runs 9 and 10): 64-row weight tiles. M <= 16, both formats: no shared-memory stages, the next
#: step's loads prefetched into registers, split-K to 8 programs per SM. M <= 64: MXFP4 the same with 4 programs
#: per SM (run 10: 13-47 us against 17-56 us for the HiF4 tile); HiF4 four pipeline stages with the activations
#: permuted once (run 9: 17-55 us against 19-68 us for the MXFP4 tile in run 10).
#: SPLIT: target programs per SM for split-K; PREFETCH: register double-buffering of the next step's loads;
#: XPERM: activations permuted to the kernel's K order first (one small copy), no register permute per tile.
#: benchmarks/bench_kernels.py --sweep measures alternatives.
DECODE_CONFIGS = {
    ("hif4", 16): {**_PREFETCH, "SPLIT": 8},
    ("mxfp4", 16): {**_PREFETCH, "SPLIT": 8},
    ("hif4", 64): {"BN": 64, "num_warps": 4, "num_stages": 4, "SPLIT": 4, "PREFETCH": False, "XPERM": True},
    ("mxfp4", 64): {**_PREFETCH, "SPLIT": 4},
}


def _decode_config(M: int, fmt_name: str, config: Optional[dict]) -> dict:
    if config is not None:
        return {"SPLIT": 3, "PREFETCH": False, "XPERM": False, **config}
    if interpreting():
        return {"BN": 16, "num_warps": 4, "num_stages": 1, "SPLIT": 3, "PREFETCH": True, "XPERM": False}
    return dict(DECODE_CONFIGS["hif4" if fmt_name == "hif4" else "mxfp4", 16 if M <= 16 else 64])


def needs_wide_decode(qb: QuantizedTensor) -> bool:
    """Whether the W4A16 decode kernel needs its two-factor MXFP4 path for ``qb`` (a block scale above 2^1,
    i.e. weights of magnitude >= 16; never for HiF4). A device reduction and host sync: callers that decode
    often keep the answer with the weight (``kernels.dispatch.PreparedWeight.wide``)."""
    return qb.fmt.name != "hif4" and bool((qb.scales.reshape(-1) > 128).any())


def permute_decode_activations(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K_pad]`` in the decode kernel's K order: within each 8 values, K = j + 4e goes to 2j + e (the
    order in which its bit-level unpack leaves the weights)."""
    M, K = x.shape
    return x.reshape(M, K // 8, 2, 4).transpose(-1, -2).reshape(M, K)


def w4_matmul(a: torch.Tensor, qb: QuantizedTensor, a_res: Optional[torch.Tensor] = None,
              config: Optional[dict] = None, wide: Optional[bool] = None) -> torch.Tensor:
    """fp32 ``(a [+ a_res along K]) @ Q(b)^T`` for BF16 ``a [M, K_pad]`` (M <= 64) and packed weights: W4A16,
    and the decode W4A4/ResQ GEMMs with the activations' exact BF16 expansions.

    Each weight tile is read once and dequantized in registers (exact in BF16); the optional residual
    activation (ResQ) multiplies the same dequantized tile. Split-K with fp32 atomics fills the GPU. ``wide``:
    see :func:`needs_wide_decode` (computed here when None).
    """
    b = qb.codes.reshape(-1, qb.codes.shape[-1])
    N, KH = b.shape
    M = a.shape[0]
    if a.shape[1] != 2 * KH:
        raise ValueError(f"w4_matmul: activation K {a.shape[1]} != weight K_pad {2 * KH}")
    if M > 64:
        raise ValueError(f"w4_matmul is the decode kernel (M <= 64), got M={M}; use mm_expanded")
    if wide is None:
        wide = needs_wide_decode(qb)
    sb = _scale_arg(qb)
    f32 = interpreting()
    a = (a.float() if f32 else a).contiguous()  # the kernel reads rows with unit stride along K
    if a_res is not None:
        a_res = (a_res.float() if f32 else a_res).contiguous()
    config = _decode_config(M, qb.fmt.name, config)
    if config["XPERM"]:
        a = permute_decode_activations(a)
        a_res = permute_decode_activations(a_res) if a_res is not None else None
    r = a_res if a_res is not None else a
    tiles = cdiv(N, config["BN"])
    ksteps = cdiv(KH, 32)
    split = config.get("SPLIT_K") or max(1, min(ksteps // 2 or 1,
                                                (config["SPLIT"] * sm_count(a.device)) // max(tiles, 1)))
    c = (torch.zeros if split > 1 else torch.empty)((M, N), dtype=torch.float32, device=a.device)
    b16 = b.contiguous().view(torch.int16)  # 16-bit lanes of four codes each
    _w4_decode_kernel[(tiles, split)](a, r, b16, sb, c, M, N, KH // 2, a.stride(0), r.stride(0), b16.stride(0),
                                      sb.stride(0), c.stride(0), FMT=_fmt_id(qb), HAS_RES=a_res is not None,
                                      SPLIT_K=split, WIDE=bool(wide), ASM=not f32, F32=f32,
                                      XPERM=config["XPERM"], PREFETCH=config["PREFETCH"], BN=config["BN"],
                                      BM=config.get("BM", 16 if M <= 16 else (32 if M <= 32 else 64)),
                                      num_warps=config["num_warps"], num_stages=config["num_stages"])
    return c
