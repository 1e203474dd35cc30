"""The packed FP4 GEMM: ``packed_matmul`` reads both operands' 4-bit codes and scales and dequantizes them to
BF16 in its main loop (exact for HiF4 and MXFP4), then multiplies on the BF16 tensor cores with fp32 accumulation.
Also the helpers the decode GEMM (:mod:`megatron_fp4.kernels.decode_gemm`) shares with it (the scale arguments, the
BF16/fp32 dot) and :func:`dequantize_rows`, the PyTorch decode of selected rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_fp4.kernels._common import HAS_TRITON, cdiv, interpreting, tl, triton
from megatron_fp4.formats import QuantizedTensor
from megatron_fp4.formats.packing import unpack_nibbles

__all__ = ["packed_matmul", "dequantize_rows"]

if HAS_TRITON:
    from megatron_fp4.kernels.gemm import _grouped_tile

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


# ----------------------------------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------------------------------
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
