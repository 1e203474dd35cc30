"""Fused quantize+pack kernels for HiF4 and MXFP4 (SPEC §2), bit-exact with ``megatron_fp4.formats``.

    qt = quantize(x, "hif4", dim=-1)                       # QuantizedTensor, same bytes as the reference
    qt, ex = quantize(x, "mxfp4", dim=0, expand="native")   # + GEMM-ready operand (see :class:`Expanded`)

Rows are the dimensions other than ``dim``; the kernel reads them through strides, so ``dim=0`` of a ``[K, n]``
tensor (the wgrad/dgrad operands) needs no transpose copy. ``expand`` also writes the dequantized operand:
"bf16" (exact for both formats) or "native" (HiF4: bf16; MXFP4: FP8 E5M2 relative to a power-of-two row scale
2^row_exp, values below E5M2's normal range flushed to zero: see :class:`Expanded`). The PyTorch twin is
``Format.quantize``/``dequantize`` (and :func:`expand_packed` for the expansions).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from megatron_fp4.kernels._common import (DECODE_MAX_M, HAS_TRITON, KERNEL_FORMATS, TILE_FMT, TILE_RECIP, cdiv,
                                          interpreting, k_split, kernels_usable, tl, triton, tune_bucket)
from megatron_fp4.kernels._launch import fast
from megatron_fp4.formats import QuantizedTensor, get_format

__all__ = ["Expanded", "quantize", "quantize_both_layouts", "quantize_reference", "expand_packed", "fp8_rows",
           "EXPAND_MODES"]

#: Whether a large transposed view's exact expansion comes from the column kernel (:func:`_quantize_columns`, one
#: read of the row-major tensor) rather than a transposed copy and the row kernel, for the formats in
#: ``COLUMN_KERNEL_FORMATS``. Measured on the H200 (2026-12-02, 8192 tokens x 1536 / 8960 / 17920): MXFP4's column
#: kernel 1.2x faster than copy + rows (2.1 vs 1.8 TB/s); HiF4's 1.2-1.3x slower since its row kernel loads and
#: stores coalesced (3.7 TB/s; the column kernel's units span threads after the transpose, ~2.5x the row kernel's
#: SASS instructions per value, 1.5 TB/s). ``MEGATRON_FP4_COLUMN_KERNEL=0`` turns it off.
COLUMN_KERNEL = os.environ.get("MEGATRON_FP4_COLUMN_KERNEL", "1") == "1"
COLUMN_KERNEL_FORMATS = ("mxfp4", "mxfp4_rceil")
#: Whether :func:`quantize_both_layouts` has HiF4's row pass write x's transposed copy too (one read of x for both
#: passes instead of a separate transpose). ``MEGATRON_FP4_FUSED_TRANSPOSE=0`` turns it off.
FUSED_TRANSPOSE = os.environ.get("MEGATRON_FP4_FUSED_TRANSPOSE", "1") == "1"
#: (columns per program, warps) the column kernel autotunes over (128 columns with 4 warps spill registers).
#: Loading each direction's units in their own shape (no transpose through shared memory, half the SASS
#: instructions) never won autotuning on the H200 and was removed in session 17.
COL_KERNEL_CFGS = [(32, 4), (64, 4), (64, 8), (128, 8)]

#: "e4m3": MXFP4 only, E4M3 relative to a row scale (weights for the cuBLAS FP8 GEMM, which multiplies E5M2
#: activations by E4M3 weights only).
EXPAND_MODES = (None, "native", "bf16", "e4m3")
WEIGHT_EXPAND_MODES = ("native", "bf16", "e4m3")


class Expanded(NamedTuple):
    """A dequantized GEMM operand ``[R, K_pad]``: value = values * 2^row_exp[r] (row_exp None means 0).

    ``values`` is bfloat16 (exact for HiF4 and MXFP4), float8_e5m2 (MXFP4 "native") or float8_e4m3fn (MXFP4
    weights for cuBLAS, :func:`expand_packed` mode "e4m3"). The FP8 forms hold every value relative to a
    power-of-two row scale 2^row_exp chosen from the row's largest block; values below the FP8 window are flushed
    to a signed zero (E5M2: values under 2^(row_exp - 14), which is under 2^-29 of the row's largest value; E4M3:
    under 2^(row_exp - 8), under 2^-16 of the row's largest), NaN/Inf blocks are NaN. ``row_ok`` (bool [R], fp8
    only) says which rows were held exactly (nothing flushed):
    diagnostics; the GEMMs read the flushed values as they are (no host check, no fallback: "fp8" is an
    approximate mode, SPEC §3).
    """

    values: torch.Tensor
    row_exp: Optional[torch.Tensor] = None
    row_ok: Optional[torch.Tensor] = None
    row_scale: Optional[torch.Tensor] = None  # fp32 2^row_exp, kept with weights (cuBLAS takes scales as fp32)


# ----------------------------------------------------------------------------------------------------------------
# Triton device code
# ----------------------------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _bf16_rne(v):
        """Round fp32 to bf16 (ties to even; either sign; Inf and NaN kept), result in fp32. Explicit because
        Triton's CPU interpreter converts fp32 to bf16 by truncation; NaN is passed through (the GPU's canonical
        NaN 0x7FFFFFFF would carry into the sign bit)."""
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return tl.where(v == v, b.to(tl.float32, bitcast=True), v)

    @triton.jit
    def _pow2(e):
        """2^e as fp32 for integer tensors e in [-126, 127] (exact)."""
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _bcast(v, BR: tl.constexpr, N: tl.constexpr, REP: tl.constexpr):
        """[BR, N] -> [BR, N*REP], each value repeated REP times along the last dim."""
        return tl.reshape(tl.broadcast_to(v[:, :, None], (BR, N, REP)), (BR, N * REP))

    @triton.jit
    def _abs_bits(xb, BR: tl.constexpr, BK: tl.constexpr):
        """|x| (fp32) of fp32 bit patterns xb [BR, BK], and the maxima of groups of 4 as bits [BR, BK/4]: on the
        bits of |x| integer order is value order with Inf and NaN above every finite value, so one integer max
        per group finds both the group maximum and (>= 0x7F800000) a non-finite value, with no per-value
        finiteness test (the quantize kernels are ALU-bound)."""
        ab = xb & 0x7FFFFFFF
        return ab.to(tl.float32, bitcast=True), tl.max(tl.reshape(ab, (BR, BK // 4, 4)), axis=2)

    @triton.jit
    def _hif4_scale(bmax, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr):
        """HiF4's level 1 (SPEC §2.1 steps 2-4) from each unit's largest |x| as fp32 bits: (bad: a NaN or Inf in
        the unit, whose other values do not matter then; E6M2; its exponent e and mantissa m2; r =
        bf16_rne(1 / E6M2), as HIF4_RECIP[m2] * 2^-e)."""
        bad = bmax >= 0x7F800000
        vmax = tl.where(bad, 0.0, bmax.to(tl.float32, bitcast=True))
        sf = _bf16_rne(vmax * 0.142578125)
        sf = tl.minimum(tl.maximum(sf, 3.552713678800501e-15), 49152.0)
        sb = sf.to(tl.int32, bitcast=True)
        rb = (sb + 0xFFFFF + ((sb >> 21) & 1)) & -2097152  # RNE to 2 mantissa bits, carry into the exponent
        e = ((rb >> 23) & 0xFF) - 127
        m2 = (rb >> 21) & 3
        r = tl.where(m2 == 0, 1.0, tl.where(m2 == 1, R1, tl.where(m2 == 2, R2, R3))) * _pow2(-e)
        return bad, rb.to(tl.float32, bitcast=True), e, m2, r

    @triton.jit
    def _hif4_tile(x, BR: tl.constexpr, BK: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr,
                   R3: tl.constexpr):
        """HiF4 of an fp32 tile [BR, BK] (BK a multiple of 64): codes [BR,BK] int32, scale word [BR,BK/64] int32
        (bytes: E6M2 code, E1_8, E1_16 lo, E1_16 hi), dequantized fp32 [BR,BK], bad-unit flag [BR,BK/64]."""
        NU: tl.constexpr = BK // 64
        G8: tl.constexpr = BK // 8
        G16: tl.constexpr = BK // 4
        xb = x.to(tl.int32, bitcast=True)
        a, b16 = _abs_bits(xb, BR, BK)
        b8 = tl.max(tl.reshape(b16, (BR, G8, 2)), axis=2)
        bmax = tl.max(tl.reshape(b8, (BR, NU, 8)), axis=2)
        bad, e6m2, e, m2, r = _hif4_scale(bmax, R1, R2, R3)
        v16 = b16.to(tl.float32, bitcast=True)
        v8 = b8.to(tl.float32, bitcast=True)
        code = (e + 48) * 4 + m2
        e18 = (v8 * _bcast(r, BR, NU, 8)) >= 4.0  # [BR, G8]
        e18x = _bcast(e18.to(tl.int32), BR, G8, 2)  # [BR, G16]
        p16 = v16 * _bcast(r, BR, NU, 16)
        e116 = tl.where(e18x != 0, p16 * 0.5, p16) >= 2.0
        shift = e18x + e116.to(tl.int32)  # [BR, G16]
        pw = tl.where(shift == 0, 4.0, tl.where(shift == 1, 2.0, 1.0))
        m4 = (a * _bcast(r, BR, NU, 64)) * _bcast(pw, BR, G16, 4)
        kf = tl.floor(m4)
        kf = tl.where(m4 - kf >= 0.5, kf + 1.0, kf)
        kf = tl.minimum(kf, 7.0)
        k = kf.to(tl.int32)
        badx = _bcast(bad.to(tl.int32), BR, NU, 64) != 0
        codes = tl.where(badx, 0, k | ((xb >> 28) & 8))
        p2 = tl.where(shift == 0, 1.0, tl.where(shift == 1, 2.0, 4.0))
        gs = e6m2[:, :, None] * tl.reshape(p2, (BR, NU, 16))  # E6M2 * 2^shift
        gsx = _bcast(tl.reshape(gs * 0.25, (BR, G16)), BR, G16, 4)
        val = kf * gsx
        val = (val.to(tl.int32, bitcast=True) | (xb & -2147483648)).to(tl.float32, bitcast=True)  # x's sign (-0)
        val = tl.where(badx, float("nan"), val)
        j8 = tl.arange(0, 8)[None, None, :]
        j16 = tl.arange(0, 16)[None, None, :]
        b8 = tl.sum(tl.reshape(e18.to(tl.int32), (BR, NU, 8)) << j8, axis=2)
        b16 = tl.sum(tl.reshape(e116.to(tl.int32), (BR, NU, 16)) << j16, axis=2)
        word = tl.where(bad, 0xFF, code | (b8 << 8) | (b16 << 16))
        return codes, word, val, bad

    @triton.jit
    def _mx_x(amax, RCEIL: tl.constexpr):
        """MXFP4 scale exponent X (int32, [-127, 127]) of non-negative finite block amax."""
        ab = amax.to(tl.int32, bitcast=True)
        eb = ab >> 23
        X = eb - 129
        if RCEIL:
            X = X + ((ab & 0x7FFFFF) > 0x400000).to(tl.int32)
        X = tl.where(eb == 0, -127, X)
        return tl.minimum(tl.maximum(X, -127), 127)

    @triton.jit
    def _e2m1_code(s):
        """E2M1 magnitude code (0..7) of non-negative fp32 s < 8, round to nearest, ties to even. s >= 1: the fp32
        mantissa rounded to one bit by an integer add (a carry moves the exponent), code = 2 (e + 1) + m, capped at 7
        (6.0); s < 1: rint(2 s) in {0, 1, 2} from the low bits of 2 s + 2^23. A few integer ops instead of seven
        compares: the quantize kernels are ALU-bound (docs/PERFORMANCE.md)."""
        b = s.to(tl.int32, bitcast=True)
        hi = tl.minimum(((b + 0x1FFFFF + ((b >> 22) & 1)) >> 22) - 252, 7)
        lo = (s * 2.0 + 8388608.0).to(tl.int32, bitcast=True) & 3
        return tl.where(s < 1.0, lo, hi)

    @triton.jit
    def _mx_tile(x, BR: tl.constexpr, BK: tl.constexpr, RCEIL: tl.constexpr):
        """MXFP4 of an fp32 tile [BR, BK] (BK a multiple of 32): codes [BR,BK] int32, X [BR,BK/32] int32,
        bad-block flag [BR,BK/32], dequantized fp32 [BR,BK]."""
        NB: tl.constexpr = BK // 32
        xb = x.to(tl.int32, bitcast=True)
        a, bq = _abs_bits(xb, BR, BK)
        bmax = tl.max(tl.reshape(bq, (BR, NB, 8)), axis=2)
        bad = bmax >= 0x7F800000  # a NaN or Inf in the block (its other values do not matter then)
        X = _mx_x(tl.where(bad, 0.0, bmax.to(tl.float32, bitcast=True)), RCEIL)
        inv = ((127 - X) << 23).to(tl.float32, bitcast=True)  # 2^-X, X <= 126 for finite blocks
        c = _e2m1_code(a * _bcast(inv, BR, NB, 32))
        badx = _bcast(bad.to(tl.int32), BR, NB, 32) != 0
        codes = tl.where(badx, 0, c | ((xb >> 28) & 8))
        # value = (2 * e2m1) * 0.5 * 2^X; 2*e2m1 of code c is nibble c of 0xC8643210
        v2 = ((tl.full(c.shape, -932957680, tl.int32) >> (c * 4)) & 0xF).to(tl.float32)
        px = tl.where(X == -127, 5.877471754111438e-39, ((X + 127) << 23).to(tl.float32, bitcast=True))
        val = (v2 * 0.5) * _bcast(px, BR, NB, 32)
        val = (val.to(tl.int32, bitcast=True) | (xb & -2147483648)).to(tl.float32, bitcast=True)  # x's sign (-0)
        val = tl.where(badx, float("nan"), val)
        return codes, X, bad, val

    @triton.jit
    def _hif4_units(x, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr):
        """HiF4 dequantized fp32 values of units x [BR, NU, 8, 2, 4] (one 64-value unit per [r, u], as 8 pairs of
        fours): :func:`_hif4_tile`'s values, computed on the unit's own shape. The group maxima are reductions
        over trailing axes and the scales reach their values by broadcasting, so no 2-D reshape moves values
        between threads (on 64 x 64 tiles HiF4's 2-D form needed ~2x the instructions per value and spilled
        registers: Triton 3.6's sm_90 SASS)."""
        xb = x.to(tl.int32, bitcast=True)
        ab = xb & 0x7FFFFFFF  # |x| bits: integer order is value order, Inf/NaN above all finite values
        b16 = tl.max(ab, axis=4)
        b8 = tl.max(b16, axis=3)
        bad, e6m2, e, m2, r = _hif4_scale(tl.max(b8, axis=2), R1, R2, R3)  # [BR, NU] each
        r3 = r[:, :, None]
        e18 = (b8.to(tl.float32, bitcast=True) * r3) >= 4.0  # [BR, NU, 8]
        p16 = b16.to(tl.float32, bitcast=True) * r3[:, :, :, None]  # [BR, NU, 8, 2]
        e18x = e18[:, :, :, None]
        shift = e18x.to(tl.int32) + (tl.where(e18x, p16 * 0.5, p16) >= 2.0).to(tl.int32)
        # 4 m = |x| * (r * 2^(2 - shift)): a power of two times r is exact, so this is (|x| r) 2^(2 - shift)
        # wherever k can be nonzero (the two differ only for subnormal |x| r, which rounds to k = 0 either way)
        m4 = ab.to(tl.float32, bitcast=True) * (r3[:, :, :, None] * tl.where(
            shift == 0, 4.0, tl.where(shift == 1, 2.0, 1.0)))[:, :, :, :, None]
        kf = tl.floor(m4)
        kf = tl.minimum(tl.where(m4 - kf >= 0.5, kf + 1.0, kf), 7.0)
        gs = e6m2[:, :, None, None] * tl.where(shift == 0, 0.25, tl.where(shift == 1, 0.5, 1.0))  # E6M2 2^shift / 4
        val = kf * gs[:, :, :, :, None]
        val = (val.to(tl.int32, bitcast=True) | (xb & -2147483648)).to(tl.float32, bitcast=True)  # x's sign
        return tl.where(bad[:, :, None, None, None], float("nan"), val)

    @triton.jit
    def _mx_unit_codes(x, RCEIL: tl.constexpr):
        """(E2M1 magnitude codes [BR, NB, 8, 4], scale exponents X [BR, NB], bad-block flags [BR, NB], x's bits) of
        fp32 blocks x [BR, NB, 8, 4] (one 32-value block per [r, b], as 8 fours): :func:`_mx_tile`'s numbers on
        the block's own shape (see :func:`_hif4_units`)."""
        xb = x.to(tl.int32, bitcast=True)
        ab = xb & 0x7FFFFFFF
        bmax = tl.max(tl.max(ab, axis=3), axis=2)
        bad = bmax >= 0x7F800000
        X = _mx_x(tl.where(bad, 0.0, bmax.to(tl.float32, bitcast=True)), RCEIL)
        inv = ((127 - X) << 23).to(tl.float32, bitcast=True)  # 2^-X, X <= 126 for finite blocks
        return _e2m1_code(ab.to(tl.float32, bitcast=True) * inv[:, :, None, None]), X, bad, xb

    @triton.jit
    def _mx_units(x, RCEIL: tl.constexpr):
        """MXFP4 dequantized fp32 values of blocks x [BR, NB, 8, 4]."""
        c, X, bad, xb = _mx_unit_codes(x, RCEIL)
        v2 = ((tl.full(c.shape, -932957680, tl.int32) >> (c * 4)) & 0xF).to(tl.float32)  # 2 * E2M1 value
        px = tl.where(X == -127, 5.877471754111438e-39, ((X + 127) << 23).to(tl.float32, bitcast=True))
        val = (v2 * 0.5) * px[:, :, None, None]
        val = (val.to(tl.int32, bitcast=True) | (xb & -2147483648)).to(tl.float32, bitcast=True)
        return tl.where(bad[:, :, None, None], float("nan"), val)

    @triton.jit
    def _mx_e5m2(codes, X, S, bad, BR: tl.constexpr, BK: tl.constexpr):
        """E5M2 bit patterns (int32) of MXFP4 codes relative to the row scale 2^S, and a flag [BR]: no value of the
        row was flushed. Values below E5M2's normal range (more than 2^-27 below the row's largest block) are
        flushed to a signed zero; bad (NaN/Inf) blocks become E5M2 NaN, as the reference's values are."""
        NB: tl.constexpr = BK // 32
        mag = codes & 7
        ee = mag >> 1
        m = mag & 1
        EX = tl.where(ee == 0, -1, ee - 1) + _bcast(X, BR, NB, 32)  # q * 2^X = 1.m * 2^EX
        field = EX - S[:, None] + 15
        ok = (mag == 0) | ((field >= 1) & (field <= 30))
        sign = (codes & 8) << 4
        bits = sign | tl.where(ok & (mag != 0), (field << 2) | tl.where(ee == 0, 0, m << 1), 0)
        bits = tl.where(EX >= 128, sign | 0x7C, bits)  # fp32's Inf in the reference (rceil's X = 126): E5M2's Inf
        bits = tl.where(_bcast(bad.to(tl.int32), BR, NB, 32) != 0, 0x7F, bits)
        return bits, tl.min(ok.to(tl.int32), axis=1)

    @triton.jit
    def _mx_e4m3(codes, X, S, bad, BR: tl.constexpr, BK: tl.constexpr):
        """E4M3 (fn) bit patterns (int32) of MXFP4 codes relative to the row scale 2^S (S = the row's largest
        block exponent - 6: its 6 * 2^X is 384), subnormals included, and the flag [BR] of :func:`_mx_e5m2`.
        A value 1.m * 2^E is normal for E >= -6; E4M3's subnormals k/8 * 2^-6 hold it for E = -7, -8 and, for
        m = 0, E = -9 (k = 2m' * 2^(E + 8) with 2m' = 2 or 3); smaller ones are flushed to a signed zero; bad
        blocks become NaN (0x7F), as :func:`fp8_rows` of the reference's values."""
        NB: tl.constexpr = BK // 32
        mag = codes & 7
        ee = mag >> 1
        m2 = tl.where(ee == 0, 2, 2 + (mag & 1))  # twice the significand: 2 (1.0) or 3 (1.5)
        EX = tl.where(ee == 0, -1, ee - 1) + _bcast(X, BR, NB, 32)
        E = EX - S[:, None]
        normal = E >= -6
        sub = (E >= -8) | ((E == -9) & (m2 == 2))
        k = tl.where(E >= -8, m2 << tl.maximum(E + 8, 0), 1)
        ovf = EX >= 128  # fp32's Inf in the reference (rceil's X = 126), which E4M3 cannot hold: NaN, not ok
        ok = (mag == 0) | ((normal | sub) & ~ovf)
        sign = (codes & 8) << 4
        bits = tl.where(normal, ((E + 7) << 3) | ((m2 - 2) << 2), k)
        bits = sign | tl.where(ok & (mag != 0), bits, 0)
        bits = tl.where(ovf, sign | 0x7F, bits)
        bits = tl.where(_bcast(bad.to(tl.int32), BR, NB, 32) != 0, 0x7F, bits)
        return bits, tl.min(ok.to(tl.int32), axis=1)

    @triton.jit
    def _store_packed(codes_ptr, codes, rows, rmask, k0, KP, stride_cr, BR: tl.constexpr, BK: tl.constexpr):
        lo, hi = tl.split(tl.reshape(codes, (BR, BK // 2, 2)))
        byte = (lo | (hi << 4)).to(tl.uint8)
        jc = k0 // 2 + tl.arange(0, BK // 2)
        tl.store(codes_ptr + rows[:, None] * stride_cr + jc[None, :], byte,
                 mask=rmask[:, None] & (jc[None, :] < KP // 2))

    @triton.jit
    def _load_x(x_ptr, rows, rmask, cols, K, stride_xr, stride_xk):
        x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xk,
                    mask=rmask[:, None] & (cols[None, :] < K), other=0.0)
        return x.to(tl.float32)

    @triton.jit
    def _first_tile(x_ptr, rows, rmask, K, stride_xr, stride_xk, BR: tl.constexpr, BK: tl.constexpr,
                    PREFETCH: tl.constexpr):
        """PREFETCH: this program's first K tile, loaded before the loop, whose steps then load tile i+1 before
        working on tile i (keeps loads in flight while the ALU-heavy tile math runs); else a placeholder.
        A program takes every num_programs(1)-th K tile from tile program_id(1) (K split for few rows)."""
        if PREFETCH:
            return _load_x(x_ptr, rows, rmask, tl.program_id(1) * BK + tl.arange(0, BK), K, stride_xr, stride_xk)
        else:
            return tl.zeros((BR, BK), dtype=tl.float32)

    @triton.jit
    def _k_tile(x_ptr, rows, rmask, cols, xn, K, stride_xr, stride_xk, BK: tl.constexpr, PREFETCH: tl.constexpr):
        """(the tile at ``cols``, the tile to carry into the next step). PREFETCH: the tile at ``cols`` is ``xn``,
        loaded a step earlier, and the next one is loaded now, before the caller works on this one."""
        if PREFETCH:
            return xn, _load_x(x_ptr, rows, rmask, cols + tl.num_programs(1) * BK, K, stride_xr, stride_xk)
        else:
            return _load_x(x_ptr, rows, rmask, cols, K, stride_xr, stride_xk), xn

    @triton.jit
    def _row_amax(x_ptr, rows, rmask, K, stride_xr, stride_xk, BR: tl.constexpr, BK: tl.constexpr):
        """Each row's largest |x| over its finite 32-value MXFP4 blocks (a NaN/Inf block's finite values do not
        count: the reference takes the row scale from the finite blocks' exponents)."""
        NB: tl.constexpr = BK // 32
        am = tl.zeros((BR,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            x = tl.reshape(_load_x(x_ptr, rows, rmask, cols, K, stride_xr, stride_xk), (BR, NB, 32))
            finite = (x.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000
            bad = tl.min(finite.to(tl.int32), axis=2) == 0
            bmax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=2)
            am = tl.maximum(am, tl.max(tl.where(bad, 0.0, bmax), axis=1))
        return am

    @triton.jit
    def _fp8_row_exp(x_ptr, rows, rmask, K, stride_xr, stride_xk, RCEIL: tl.constexpr, TOP: tl.constexpr,
                     BR: tl.constexpr, BK: tl.constexpr):
        """The FP8 row scale exponent S of each row: 2^S maps the row's largest MXFP4 block (6 * 2^X) to the FP8
        form's top binade (TOP = 13: E5M2's 1.5 * 2^15; TOP = 6: E4M3's 384 <= 448)."""
        am = _row_amax(x_ptr, rows, rmask, K, stride_xr, stride_xk, BR, BK)
        return tl.minimum(tl.maximum(_mx_x(am, RCEIL) - TOP, -126), 127)

    @triton.jit
    def _hif4_quant_kernel(x_ptr, codes_ptr, scales_ptr, ex_ptr, xt_ptr, R, K, KP, stride_xr, stride_xk, stride_cr,
                           stride_sr, stride_er, stride_tr, K_BUCKET, EXPAND: tl.constexpr, BR: tl.constexpr,
                           BK: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr,
                           PREFETCH: tl.constexpr = 0, PACKED: tl.constexpr = 1, WRITE_T: tl.constexpr = 0):
        """PACKED: store the codes and scales (0: only the expansion, what the training GEMMs read: computed on the
        units' own shape, :func:`_hif4_units`). WRITE_T (with PACKED=0): also store x's transposed copy x^T [K, R]
        (row stride stride_tr), what the column pass then quantizes along its rows: one read of x serves both."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < R
        if PACKED:
            xn = _first_tile(x_ptr, rows, rmask, K, stride_xr, stride_xk, BR, BK, PREFETCH)
            for k0 in range(tl.program_id(1) * BK, KP, tl.num_programs(1) * BK):
                cols = k0 + tl.arange(0, BK)
                x, xn = _k_tile(x_ptr, rows, rmask, cols, xn, K, stride_xr, stride_xk, BK, PREFETCH)
                codes, word, val, bad = _hif4_tile(x, BR, BK, R1, R2, R3)
                _store_packed(codes_ptr, codes, rows, rmask, k0, KP, stride_cr, BR, BK)
                ju = k0 // 64 + tl.arange(0, BK // 64)
                tl.store(scales_ptr + rows[:, None] * stride_sr + ju[None, :], word,
                         mask=rmask[:, None] & (ju[None, :] < KP // 64))
                if EXPAND:
                    tl.store(ex_ptr + rows[:, None] * stride_er + cols[None, :], val.to(tl.bfloat16),
                             mask=rmask[:, None] & (cols[None, :] < KP))
        else:  # the tile loads and stores as [BR, BK] (coalesced) and is computed on its units' shape
            xn = _first_tile(x_ptr, rows, rmask, K, stride_xr, stride_xk, BR, BK, PREFETCH)
            for k0 in range(tl.program_id(1) * BK, KP, tl.num_programs(1) * BK):
                cols = k0 + tl.arange(0, BK)
                x, xn = _k_tile(x_ptr, rows, rmask, cols, xn, K, stride_xr, stride_xk, BK, PREFETCH)
                val = _hif4_units(tl.reshape(x, (BR, BK // 64, 8, 2, 4)), R1, R2, R3)
                tl.store(ex_ptr + rows[:, None] * stride_er + cols[None, :],
                         tl.reshape(val, (BR, BK)).to(tl.bfloat16), mask=rmask[:, None] & (cols[None, :] < KP))
                if WRITE_T:  # Triton moves the tile between threads through shared memory: coalesced stores
                    tl.store(xt_ptr + cols[:, None] * stride_tr + rows[None, :],
                             tl.trans(x.to(xt_ptr.dtype.element_ty)), mask=rmask[None, :] & (cols[:, None] < K))

    @triton.jit
    def _mx_quant_kernel(x_ptr, codes_ptr, scales_ptr, ex_ptr, rexp_ptr, rok_ptr, R, K, KP, stride_xr,
                         stride_xk, stride_cr, stride_sr, stride_er, K_BUCKET, RCEIL: tl.constexpr, EXPAND: tl.constexpr,
                         BR: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr = 0, PACKED: tl.constexpr = 1):
        """EXPAND: 0 none, 1 E5M2 + row scale (two passes over x), 2 bf16, 3 E4M3 + row scale (two passes; weights
        for cuBLAS's FP8 GEMM). PACKED: store the codes and scales."""
        NB: tl.constexpr = BK // 32
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < R
        S = tl.zeros((BR,), dtype=tl.int32)
        ok = tl.full((BR,), 1, dtype=tl.int32)
        if EXPAND == 1:  # the row's largest block maps to E5M2's 2^2 binade (6 * 2^X -> 1.5 * 2^15)
            S = _fp8_row_exp(x_ptr, rows, rmask, K, stride_xr, stride_xk, RCEIL, 13, BR, BK)
        if EXPAND == 3:  # ... and to E4M3's 384 (6 * 2^X -> 1.5 * 2^8 <= 448)
            S = _fp8_row_exp(x_ptr, rows, rmask, K, stride_xr, stride_xk, RCEIL, 6, BR, BK)
        xn = _first_tile(x_ptr, rows, rmask, K, stride_xr, stride_xk, BR, BK, PREFETCH)
        for k0 in range(tl.program_id(1) * BK, KP, tl.num_programs(1) * BK):
            cols = k0 + tl.arange(0, BK)
            x, xn = _k_tile(x_ptr, rows, rmask, cols, xn, K, stride_xr, stride_xk, BK, PREFETCH)
            codes, X, bad, val = _mx_tile(x, BR, BK, RCEIL)
            if PACKED:
                _store_packed(codes_ptr, codes, rows, rmask, k0, KP, stride_cr, BR, BK)
                jb = k0 // 32 + tl.arange(0, NB)
                tl.store(scales_ptr + rows[:, None] * stride_sr + jb[None, :],
                         tl.where(bad, 255, X + 127).to(tl.uint8), mask=rmask[:, None] & (jb[None, :] < KP // 32))
            emask = rmask[:, None] & (cols[None, :] < KP)
            if EXPAND == 1:
                bits, okt = _mx_e5m2(codes, X, S, bad, BR, BK)
                ok = ok & okt
                tl.store(ex_ptr + rows[:, None] * stride_er + cols[None, :], bits.to(tl.uint8), mask=emask)
            if EXPAND == 2:
                tl.store(ex_ptr + rows[:, None] * stride_er + cols[None, :], val.to(tl.bfloat16), mask=emask)
            if EXPAND == 3:
                bits, okt = _mx_e4m3(codes, X, S, bad, BR, BK)
                ok = ok & okt
                tl.store(ex_ptr + rows[:, None] * stride_er + cols[None, :], bits.to(tl.uint8), mask=emask)
        if EXPAND % 2 == 1:  # the FP8 forms (1, 3): their row scales and flags
            tl.store(rexp_ptr + rows, S, mask=rmask)
            tl.store(rok_ptr + rows, ok.to(tl.int8), mask=rmask)


    @triton.jit
    def _col_quant_kernel(x_ptr, ec_ptr, R, K, RP, stride_xr, stride_ec, R_BUCKET, FMT: tl.constexpr,
                          BC: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr):
        """Row-major x [R, K] quantized along R into the BF16 expansion ec [K, RP] (row-major: the quantization of
        x.t(), what the wgrad and dgrad GEMMs read of X, dY and W) without a transposed copy of x: a program
        loads 64 rows (one HiF4 unit / two MXFP4 blocks along R) by BC columns, coalesced, and quantizes the
        transposed tile on its units' shape (Triton moves it between threads through shared memory). Rows past R
        are zeros (the padding RP - R). FMT: 0 HiF4, 1 MXFP4, 2 MXFP4 rceil."""
        r = tl.program_id(0) * 64 + tl.arange(0, 64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        x = tl.load(x_ptr + r[:, None] * stride_xr + c[None, :], mask=(r[:, None] < R) & (c[None, :] < K),
                    other=0.0).to(tl.float32)
        xt = tl.trans(x)  # [BC, 64]: a column's 64 rows
        if FMT == 0:
            val = tl.reshape(_hif4_units(tl.reshape(xt, (BC, 1, 8, 2, 4)), R1, R2, R3), (BC, 64))
        else:
            val = tl.reshape(_mx_units(tl.reshape(xt, (BC, 2, 8, 4)), FMT == 2), (BC, 64))
        tl.store(ec_ptr + c[:, None] * stride_ec + r[None, :], val.to(tl.bfloat16),
                 mask=(c[:, None] < K) & (r[None, :] < RP))

    @triton.jit
    def _transpose_kernel(x_ptr, y_ptr, R, C, stride_xr, stride_yr, BR: tl.constexpr, BC: tl.constexpr):
        """y[c, r] = x[r, c] for row-major x [R, C] (Triton stages the tile through shared memory, so both the
        load and the store are coalesced)."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        m = (r[:, None] < R) & (c[None, :] < C)
        t = tl.load(x_ptr + r[:, None] * stride_xr + c[None, :], mask=m)
        tl.store(y_ptr + c[None, :] * stride_yr + r[:, None], t, mask=m)

    # (rows per program, K per step, warps, prefetch the next K tile). Measured on the H200 (docs/PERFORMANCE.md,
    # run 6): prefetching wins for HiF4 (-18%) and is even for MXFP4; 32x256 and 16x512 tiles (with or without
    # prefetch) and prefetching column tiles never won, so they are not tried.
    _ROW_CFGS = [(8, 256, 4, 0), (16, 128, 4, 0), (4, 512, 4, 0), (16, 256, 8, 0), (32, 64, 4, 0), (2, 1024, 4, 0),
                 (1, 1024, 4, 0), (8, 256, 4, 1), (16, 256, 8, 1), (4, 512, 4, 1)]
    _COL_CFGS = [(64, 64, 4, 0), (128, 64, 4, 0), (256, 64, 8, 0), (128, 128, 8, 0), (32, 64, 2, 0)]
    # HiF4's row pass writing the transposed copy too (WRITE_T): 16 rows or more per program.
    _ROW_T_CFGS = [(16, 128, 4, 0), (16, 256, 8, 0), (32, 64, 4, 0), (32, 128, 8, 0), (64, 64, 4, 0)]

    def _qconfig(br, bk, w, pf):
        return triton.Config({"BR": br, "BK": bk, "PREFETCH": pf}, num_warps=w)

    def _prune(configs, named_args, **kwargs):
        row_major = named_args["stride_xk"] == 1
        want = _ROW_CFGS if row_major else _COL_CFGS
        if kwargs.get("WRITE_T"):  # tall tiles: each column of the transposed copy is written in runs of >= 32 B
            want = _ROW_T_CFGS
        keep = [c for c in configs
                if (c.kwargs["BR"], c.kwargs["BK"], c.num_warps, c.kwargs["PREFETCH"]) in want]
        return keep or configs

    # K_BUCKET (K's next power of two) rather than K: the column variants see a new token count every step.
    _TUNE = dict(configs=[_qconfig(*c) for c in _ROW_CFGS + _COL_CFGS], key=["K_BUCKET", "stride_xk", "EXPAND"],
                 prune_configs_by={"early_config_prune": _prune})
    _QTUNE = {**_TUNE, "key": _TUNE["key"] + ["PACKED"]}
    _HIF4_TUNE = {**_QTUNE, "configs": _QTUNE["configs"] + [_qconfig(*c) for c in _ROW_T_CFGS if c not in _ROW_CFGS],
                  "key": _QTUNE["key"] + ["WRITE_T"]}
    _col_quant_tuned = triton.autotune(
        configs=[triton.Config({"BC": bc}, num_warps=w) for bc, w in COL_KERNEL_CFGS],
        key=["R_BUCKET", "K", "FMT"])(_col_quant_kernel)
    _hif4_quant_tuned = triton.autotune(**_HIF4_TUNE)(_hif4_quant_kernel)
    _mx_quant_tuned = triton.autotune(**_QTUNE)(_mx_quant_kernel)

    # The host wrappers launch through megatron_fp4.kernels._launch (Triton's Python launch path was most of an FP4
    # training linear's host time).
    _hif4_quant_fast, _mx_quant_fast, _transpose_fast, _col_quant_fast = map(
        fast, (_hif4_quant_kernel, _mx_quant_kernel, _transpose_kernel, _col_quant_kernel))
    _hif4_quant_tuned, _mx_quant_tuned, _col_quant_tuned = map(fast, (_hif4_quant_tuned, _mx_quant_tuned,
                                                                      _col_quant_tuned))


# ----------------------------------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------------------------------
def _rows_view(x: torch.Tensor, dim: int):
    """2-D strided view [rows, K] of x with ``dim`` last (no copy for 2-D inputs), plus outer shape."""
    xm = x.movedim(dim, -1)
    outer = xm.shape[:-1]
    k = xm.shape[-1]
    if xm.dim() != 2:
        xm = xm.reshape(-1, k)
    return xm, outer, k


_UNUSED: dict = {}


def _unused(shape: tuple, device: torch.device) -> torch.Tensor:
    """A small uint8 tensor standing in for an output the kernel does not write (``packed=False``: codes and
    scales), made once per device and shape rather than allocated per call (each allocation costs host time)."""
    key = (device, shape)
    t = _UNUSED.get(key)
    if t is None:
        t = _UNUSED[key] = torch.empty(shape, dtype=torch.uint8, device=device)
    return t


def _row_major(x2: torch.Tensor) -> torch.Tensor:
    """A row-major copy of the transposed view ``x2`` ([R, K] with strides (1, R)), made by a tiled Triton
    transpose (a few times faster than torch's copy of a transposed view on the H200, and than quantizing along
    the strided dimension: HiF4's per-row tile math then reduces across threads)."""
    y = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
    src = x2.t()  # row-major [K, R]
    grid = (cdiv(src.shape[0], 64), cdiv(src.shape[1], 64))
    _transpose_fast[grid](src, y, src.shape[0], src.shape[1], src.stride(0), y.stride(0), BR=64, BC=64,
                            num_warps=4)
    return y


def _quantize_columns(x2: torch.Tensor, f, out: Optional[Expanded], config: Optional[tuple] = None) -> Expanded:
    """The BF16 expansion of the transposed view ``x2`` ([R, K] with strides (1, s)) quantized along K, by the
    column kernel on the row-major tensor under it (no transposed copy). ``config`` = (columns per program, warps)
    skips autotuning (small inputs and the interpreter use (64, 4))."""
    src = x2.t()  # row-major [K, R]: quantized along its rows' dimension
    n, c = src.shape
    rp = cdiv(n, f.block_size) * f.block_size
    ex = Expanded(torch.empty((c, rp), dtype=torch.bfloat16, device=x2.device)) if out is None else _check_out(
        out, (c, rp), torch.bfloat16)
    args = (src, ex.values, n, c, rp, src.stride(0), ex.values.stride(0), tune_bucket(n))
    kw = dict(FMT=TILE_FMT[f.name], **TILE_RECIP)
    if config is not None or interpreting() or n * c < (1 << 16):
        bc, warps = config or (64, 4)
        _col_quant_fast[(cdiv(n, 64), cdiv(c, bc))](*args, **kw, BC=bc, num_warps=warps)
    else:
        _col_quant_tuned[lambda meta: (cdiv(n, 64), cdiv(c, meta["BC"]))](*args, **kw)
    return ex


def _transposed(x2: torch.Tensor) -> bool:
    """Whether the 2-D view ``x2`` is column-major (a transposed row-major tensor, e.g. a training operand's X^T)."""
    return x2.stride(1) != 1 and x2.stride(0) == 1


def _block_config(x2: torch.Tensor):
    """Fixed tile (rows, K step, warps[, prefetch, programs per row block]) for small inputs and the interpreter
    (larger inputs autotune)."""
    if _transposed(x2):
        return (64, 64, 4)
    if x2.shape[0] <= DECODE_MAX_M:  # decode-sized activations: one row per program, long K steps
        # the largest (a 7B fc2's 64 x 18944): two rows per program and a program per K tile (on an H100, session
        # 38, benchmarks/results/decode_quantize_h100.json: ResQ's sum 10-15% faster, W4A4's 5-8%; at 64 x 3584
        # and at 16 tokens within 3% of the one-row tile, which stays there)
        return (2, 512, 4, 0, 64) if x2.numel() >= 1 << 20 else (1, 1024, 4)
    return (8, 256, 4)


def _fixed_launch(x2: torch.Tensor, kp: int, config: Optional[tuple], row_pass: bool):
    """(whether a quantize kernel runs a fixed tile rather than autotuning, that tile as (rows, K step, warps,
    prefetch), its grid). Small inputs, the interpreter, a given ``config`` and few rows (decode activations) take
    a fixed tile (``config``, else :func:`_block_config`'s); with few row blocks the K tiles are shared out over
    programs too (:func:`k_split`, or the programs per row block a tile's fifth item gives, at most one per K
    tile), unless a first pass scans whole rows (``row_pass``: MXFP4's "native" expansion computes its row
    scale)."""
    R, k = x2.shape
    tile = tuple(config or _block_config(x2))
    BR, BK, warps = tile[:3]
    fixed = config is not None or interpreting() or R * k < (1 << 16) or R <= DECODE_MAX_M
    tiles = cdiv(kp, BK)
    split = min(tile[4], tiles) if len(tile) > 4 and tile[4] else k_split(cdiv(R, BR), tiles, x2.device)
    return fixed, (BR, BK, warps, tile[3] if len(tile) > 3 else 0), (cdiv(R, BR), 1 if row_pass else split)


def quantize(x: torch.Tensor, fmt, dim: int = -1, expand: Optional[str] = None,
             config: Optional[tuple] = None, packed: bool = True, out: Optional[Expanded] = None,
             _xt: Optional[torch.Tensor] = None):
    """Quantize+pack ``x`` along ``dim`` with the Triton kernel (bit-exact with ``fmt.quantize``).

    Returns a QuantizedTensor, or ``(QuantizedTensor, Expanded)`` when ``expand`` is "native" or "bf16";
    ``packed=False`` (with ``expand``) writes only the expansion and returns ``(None, Expanded)`` (the training
    GEMMs read nothing else).
    Falls back to the PyTorch reference where the kernels cannot run (no Triton, no GPU, other formats).
    ``config`` = (rows per program, K per step, warps[, prefetch 0/1[, programs per row block]]) skips autotuning
    (small inputs use a fixed one). ``out`` (with ``packed=False``): an :class:`Expanded` of the same expansion and
    shape, e.g. an earlier result, whose buffers receive the new one (what a CUDA graph that reads them needs); it
    is returned.
    ``_xt`` (:func:`quantize_both_layouts`): a [K, R] buffer the HiF4 expansion-only row pass fills with x^T.
    """
    f = get_format(fmt)
    if expand not in EXPAND_MODES:
        raise ValueError(f"expand={expand!r} is not valid; allowed values: None, 'native', 'bf16', 'e4m3'")
    if expand == "e4m3" and f.name == "hif4":
        raise ValueError("expand='e4m3' is MXFP4's FP8 weight form; HiF4 expands to 'native' or 'bf16' (BF16)")
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-d tensor along a dimension")
    if not packed and not expand:
        raise ValueError("packed=False needs expand ('native' or 'bf16'): there would be nothing to return")
    if out is not None and packed:
        raise ValueError("out= takes the expansion only: pass packed=False with it")
    dim = dim % x.dim()
    if f.name not in KERNEL_FORMATS or not kernels_usable(x) or x.numel() == 0:
        ref = quantize_reference(x, f, dim, expand)
        return ref if packed else (None, ref[1] if out is None else _write_into(out, ref[1]))
    x2, outer, k = _rows_view(x, dim)
    R = x2.shape[0]
    if (COLUMN_KERNEL and f.name in COLUMN_KERNEL_FORMATS and not packed and expand == "bf16" and config is None
            and _transposed(x2) and R > DECODE_MAX_M):  # a transposed view's exact expansion (X^T, dY^T, W^T)
        return None, _quantize_columns(x2, f, out)
    if _transposed(x2) and R * k >= (1 << 20) and R > DECODE_MAX_M and config is None and not interpreting():
        x2 = _row_major(x2)  # large column-major operands (the training GEMMs' transposed views)
    bs = f.block_size
    kp = cdiv(k, bs) * bs
    nblk = kp // bs
    dev = x.device
    codes = torch.empty((R, kp // 2), dtype=torch.uint8, device=dev) if packed else _unused((1, 1), dev)
    fixed, (BR, BK, warps, pf), grid = _fixed_launch(x2, kp, config,
                                                     row_pass=f.name != "hif4" and expand in ("native", "e4m3"))
    tgrid = lambda meta: (cdiv(R, meta["BR"]), 1)  # noqa: E731
    ex = None
    if f.name == "hif4":
        scales = torch.empty((R, nblk, 4), dtype=torch.uint8, device=dev) if packed else _unused((1, 1, 4), dev)
        if expand:
            ex = (Expanded(torch.empty((R, kp), dtype=torch.bfloat16, device=dev)) if out is None
                  else _check_out(out, (R, kp), torch.bfloat16))
        exv = ex.values if ex is not None else codes
        xt = _xt if _xt is not None else exv
        args = (x2, codes, scales.view(torch.int32), exv, xt, R, k, kp, x2.stride(0), x2.stride(1), codes.stride(0),
                nblk, exv.stride(0), xt.stride(0), tune_bucket(k))
        kw = dict(EXPAND=bool(expand), **TILE_RECIP, PACKED=int(packed), WRITE_T=int(_xt is not None))
        if fixed:
            _hif4_quant_fast[grid](*args, **kw, BR=BR, BK=BK, PREFETCH=pf, num_warps=warps)
        else:
            _hif4_quant_tuned[tgrid](*args, **kw)
        scales_out = scales.reshape(*outer, nblk, 4) if packed else None
    else:
        scales = torch.empty((R, nblk), dtype=torch.uint8, device=dev) if packed else _unused((1, 1), dev)
        mode = {None: 0, "native": 1, "bf16": 2, "e4m3": 3}[expand]
        rexp = rok = None
        if mode % 2 == 1:
            ex = (Expanded(torch.empty((R, kp), dtype=torch.uint8, device=dev),
                           torch.empty((R,), dtype=torch.int32, device=dev),
                           torch.empty((R,), dtype=torch.int8, device=dev)) if out is None else
                  _check_out(out, (R, kp), torch.float8_e5m2 if mode == 1 else torch.float8_e4m3fn)._replace(
                      values=out.values.view(torch.uint8), row_ok=out.row_ok.view(torch.int8)))
            rexp, rok = ex.row_exp, ex.row_ok
        elif mode == 2:
            ex = (Expanded(torch.empty((R, kp), dtype=torch.bfloat16, device=dev)) if out is None
                  else _check_out(out, (R, kp), torch.bfloat16))
        exv = ex.values if ex is not None else codes
        rexp = rexp if rexp is not None else scales
        rok = rok if rok is not None else scales
        args = (x2, codes, scales, exv, rexp, rok, R, k, kp, x2.stride(0), x2.stride(1), codes.stride(0),
                scales.stride(0), exv.stride(0), tune_bucket(k))
        kw = dict(RCEIL=f.name == "mxfp4_rceil", EXPAND=mode, PACKED=int(packed))
        if fixed:
            _mx_quant_fast[grid](*args, **kw, BR=BR, BK=BK, PREFETCH=pf, num_warps=warps)
        else:
            _mx_quant_tuned[tgrid](*args, **kw)
        if mode % 2 == 1:
            ex = Expanded(ex.values.view(torch.float8_e5m2 if mode == 1 else torch.float8_e4m3fn), ex.row_exp,
                          ex.row_ok.view(torch.bool))  # the kernel writes 0/1 bytes: a view, no conversion
        scales_out = scales.reshape(*outer, nblk) if packed else None
    if not packed:
        return None, ex
    qt = QuantizedTensor(fmt=f, codes=codes.reshape(*outer, kp // 2), scales=scales_out, shape=x.shape, dim=dim,
                         dtype=x.dtype)
    return (qt, ex) if expand else qt


def quantize_both_layouts(x: torch.Tensor, fmt, config: Optional[tuple] = None, backend: str = "auto",
                          expand: tuple = ("bf16", "bf16"),
                          out: Optional[tuple] = None) -> tuple[Expanded, Expanded]:
    """A training operand's (or a weight's) expansions in both GEMM layouts: x [R, K] quantized along K and x.t()
    quantized along R, bit for bit ``quantize(x, fmt, expand=expand[0], packed=False)`` and ``quantize(x.t(), fmt,
    expand=expand[1], packed=False)``. ``expand``: both "bf16" (exact), or MXFP4's FP8 forms, each "native"
    (E5M2) or "e4m3" (X: E5M2 rows, E4M3 columns; dY: E5M2 both; a weight: E4M3 both). ``out``: two earlier
    results of the same call whose buffers receive these (what a CUDA graph that reads them needs).

    ``backend`` "auto": the CUDA kernel (:mod:`megatron_fp4.kernels.cuda_quantize`: one read of x, both layouts written
    from a 64 x 64 tile; FP8: a read for the row and column scales first) where it takes x (bf16, rows of a multiple of
    8 values, nvcc) and no Triton ``config`` is given, else the Triton passes ("triton"): HiF4, row-major x: the row
    pass also writes x's transposed copy, which a second row pass quantizes (HiF4's column kernel is slower, see
    ``COLUMN_KERNEL``); other formats: the two calls. ``config``: the fused Triton passes' row tile (tests)."""
    if backend not in ("auto", "triton"):
        raise ValueError(f"backend={backend!r} is not valid; allowed values: 'auto', 'triton'")
    fp8 = tuple(expand) != ("bf16", "bf16")
    f = get_format(fmt)
    if fp8 and (f.name == "hif4" or not set(expand) <= {"native", "e4m3"} or len(expand) != 2):
        raise ValueError(f"expand={expand!r} is not valid; allowed values: ('bf16', 'bf16'), or for MXFP4 a pair of "
                         f"'native' (E5M2) and 'e4m3'")
    rows_out, cols_out = out if out is not None else (None, None)
    if backend == "auto" and config is None and x.is_cuda:
        from megatron_fp4.kernels import cuda_quantize

        if cuda_quantize.usable(x, f.name) and not fp8:
            rows, cols = cuda_quantize.both_layouts(x, f.name, out=None if out is None else (rows_out.values,
                                                                                             cols_out.values))
            return (Expanded(rows), Expanded(cols)) if out is None else out
        if cuda_quantize.usable(x, f.name) and f.name in cuda_quantize.FP8_FORMATS:
            rows, cols = cuda_quantize.both_layouts_fp8(x, f.name, rows_e4m3=expand[0] == "e4m3",
                                                        cols_e4m3=expand[1] == "e4m3",
                                                        out=None if out is None else tuple(out))
            return (Expanded(*rows), Expanded(*cols)) if out is None else out
    if (fp8 or out is not None or not FUSED_TRANSPOSE or f.name != "hif4" or x.dim() != 2 or x.stride(-1) != 1
            or x.numel() == 0 or not kernels_usable(x)):
        return (quantize(x, f, expand=expand[0], packed=False, out=rows_out)[1],
                quantize(x.t(), f, expand=expand[1], packed=False, out=cols_out)[1])
    xt = torch.empty((x.shape[1], x.shape[0]), dtype=x.dtype, device=x.device)
    rows = quantize(x, f, expand="bf16", packed=False, config=config, _xt=xt)[1]
    return rows, quantize(xt, f, expand="bf16", packed=False, config=config)[1]


def _check_out(out: Expanded, shape: tuple, dtype: torch.dtype) -> Expanded:
    """``out`` if its values are the ``shape`` and ``dtype`` this quantization writes."""
    if tuple(out.values.shape) != tuple(shape) or out.values.dtype != dtype:
        raise ValueError(f"out= holds {out.values.dtype} {tuple(out.values.shape)}; this quantization writes "
                         f"{dtype} {tuple(shape)}")
    return out


def _write_into(out: Expanded, new: Expanded) -> Expanded:
    """The reference's result ``new`` copied into ``out``'s buffers (``quantize(out=)`` where no kernel runs)."""
    for dst, src in zip(out, new):
        if (dst is None) != (src is None) or (dst is not None and (dst.shape != src.shape or dst.dtype != src.dtype)):
            raise ValueError("out= does not match this quantization's expansion (shapes, dtypes or fields)")
        if dst is not None:
            dst.copy_(src)
    return out


def quantize_reference(x: torch.Tensor, f, dim: int, expand: Optional[str]):
    """PyTorch twin of :func:`quantize` (the formats reference plus a torch expansion)."""
    qt = f.quantize(x, dim=dim)
    if not expand:
        return qt
    return qt, expand_packed(qt, expand)


def expand_packed(qt: QuantizedTensor, mode: str = "native") -> Expanded:
    """GEMM-ready operand [rows, K_pad] of a packed QuantizedTensor (PyTorch; used once per weight update)."""
    f = qt.fmt
    rows = qt.codes.reshape(-1, qt.codes.shape[-1])
    from megatron_fp4.formats.packing import unpack_nibbles

    nblk = rows.shape[1] * 2 // f.block_size
    codes = unpack_nibbles(rows).reshape(rows.shape[0], nblk, f.block_size)
    scales = qt.scales.reshape(rows.shape[0], nblk, f.scale_bytes)
    vals = f._decode(codes, scales, qt.global_scale).reshape(rows.shape[0], -1)  # fp32, exact
    if mode not in WEIGHT_EXPAND_MODES:
        raise ValueError(f"mode={mode!r} is not valid; allowed values: {', '.join(map(repr, WEIGHT_EXPAND_MODES))}")
    if mode == "bf16" or f.name == "hif4":
        return Expanded(vals.to(torch.bfloat16))
    # MXFP4 native: E5M2 relative to 2^S with S = clamp(max X - 13, -126, 127) (what the quantize kernel writes);
    # e4m3 (weights for cuBLAS, which multiplies E5M2 only by E4M3): the largest block maps to 6 * 2^6 = 384 <= 448,
    # so blocks down to 2^-14 of it are exact (subnormals included; the round trip below checks every value).
    # Values below the window are flushed to a signed zero (row_ok False), NaN blocks stay NaN (see Expanded).
    X = scales[..., 0].to(torch.int32) - 127
    bad = scales[..., 0] == 255
    xmax = torch.where(bad, torch.full_like(X, -127), X).amax(-1)
    e4m3 = mode == "e4m3"
    S = (xmax - (6 if e4m3 else 13)).clamp(-126, 127).to(torch.int32)
    return fp8_rows(vals, S, e4m3)


def fp8_rows(vals: torch.Tensor, S: torch.Tensor, e4m3: bool = False) -> Expanded:
    """fp32 MXFP4 values ``[R, K]`` as FP8 relative to 2^S[r] (int32 [R]): E5M2 in its normal range (the quantize
    kernel's rule), or E4M3 subnormals included; values the FP8 form cannot hold are flushed to a signed zero."""
    scaled = vals * torch.exp2(-S.to(torch.float32))[:, None]
    f8dtype = torch.float8_e4m3fn if e4m3 else torch.float8_e5m2
    exact = (scaled.to(f8dtype).to(torch.float32) == scaled) | (scaled == 0) | scaled.isnan()
    if not e4m3:  # also require normal range (matches the kernel's check): |v| >= 2^-14 for nonzero values
        exact &= (scaled.abs() >= 2.0 ** -14) | (scaled == 0) | scaled.isnan()
    f8 = torch.where(exact, scaled, scaled * 0).to(f8dtype)  # scaled * 0: the flushed value's signed zero
    return Expanded(f8, S, exact.all(-1), torch.exp2(S.to(torch.float32)))
