"""Fused Rollout-ResQ kernels (SPEC §4): one pass quantizes X, forms R = X - deq(Q(X)), quantizes R, keeps the
2 largest of every 4 along K (ties: lower index) and packs both; the GEMM adds S(Q(R)) Q(W)^T to the main product
reading each Q(W) tile once (concatenated-K form). PyTorch twin: ``megatron_fp4.resq.resq_components``.

    q, s, eq, es = resq_quantize(x, "hif4", expand="native")      # packed Q(X), packed S(Q(R)), GEMM operands
    q, s, ea, _ = resq_quantize(x, "hif4", expand="sum")          # one BF16 operand bf16(Q(X) + S(Q(R)))
    y = resq_matmul(x, packed_weight, expanded_weight)              # decode (M <= 64) or pre-expanded GEMM
    y = resq_matmul(x, packed_weight, expanded_weight, combine="bf16")   # one GEMM on the BF16 sum
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_fp4.kernels._common import (DECODE_MAX_M, HAS_TRITON, KERNEL_FORMATS, TILE_FMT, TILE_RECIP, cdiv,
                                          kernels_usable, pdl_launch, tl, triton, tune_bucket)
from megatron_fp4.kernels.quantize import Expanded, _fixed_launch, _rows_view, expand_packed, fp8_rows
from megatron_fp4.formats import QuantizedTensor, get_format
from megatron_fp4.resq import RESQ_COMBINES

__all__ = ["resq_quantize", "resq_quantize_reference", "resq_matmul", "DECODE_MAX_M", "RESQ_EXPAND_MODES"]

RESQ_EXPAND_MODES = (None, "native", "bf16", "sum")

if HAS_TRITON:
    from megatron_fp4.kernels._common import pdl_enter
    from megatron_fp4.kernels.quantize import (_bcast, _bf16_rne, _first_tile, _hif4_tile, _k_tile,  # noqa: F401
                                               _load_x, _mx_e5m2, _mx_tile, _mx_x, _store_packed)

    @triton.jit
    def _keep24(m, BR: tl.constexpr, BK: tl.constexpr):
        """Keep mask (int32 [BR, BK]) of the 2 largest of every 4 consecutive magnitudes (ties: lower index)."""
        a, b = tl.split(tl.reshape(m, (BR, BK // 4, 2, 2)))
        m0, m2 = tl.split(a)
        m1, m3 = tl.split(b)
        k0 = (m1 > m0).to(tl.int32) + (m2 > m0).to(tl.int32) + (m3 > m0).to(tl.int32)
        k1 = (m0 >= m1).to(tl.int32) + (m2 > m1).to(tl.int32) + (m3 > m1).to(tl.int32)
        k2 = (m0 >= m2).to(tl.int32) + (m1 >= m2).to(tl.int32) + (m3 > m2).to(tl.int32)
        k3 = (m0 >= m3).to(tl.int32) + (m1 >= m3).to(tl.int32) + (m2 >= m3).to(tl.int32)
        ka = tl.join((k0 < 2).to(tl.int32), (k2 < 2).to(tl.int32))
        kb = tl.join((k1 < 2).to(tl.int32), (k3 < 2).to(tl.int32))
        return tl.reshape(tl.join(ka, kb), (BR, BK))

    @triton.jit
    def _resq_tiles(x, FMT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, R1: tl.constexpr,
                    R2: tl.constexpr, R3: tl.constexpr):
        if FMT == 0:
            codes, word, val, bad = _hif4_tile(x, BR, BK, R1, R2, R3)
            rcodes, rword, rval, rbad = _hif4_tile(x - val, BR, BK, R1, R2, R3)
            badx = _bcast(rbad.to(tl.int32), BR, BK // 64, 64)
            X = word
            RX = rword
        else:
            codes, X, bad, val = _mx_tile(x, BR, BK, FMT == 2)
            rcodes, RX, rbad, rval = _mx_tile(x - val, BR, BK, FMT == 2)
            badx = _bcast(rbad.to(tl.int32), BR, BK // 32, 32)
        keep = (_keep24(rcodes & 7, BR, BK) | badx) != 0
        rcodes = tl.where(keep, rcodes, 0)
        rval = tl.where(keep, rval, 0.0)
        return codes, X, bad, val, rcodes, RX, rbad, rval

    @triton.jit
    def _resq_kernel(x_ptr, qc_ptr, qs_ptr, rc_ptr, rs_ptr, ex_ptr, exr_ptr, rexp_ptr, rok_ptr, R, K, KP,
                     stride_xr, stride_xk, stride_cr, stride_sr, stride_er, K_BUCKET, FMT: tl.constexpr,
                     EXPAND: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, R1: tl.constexpr,
                     R2: tl.constexpr, R3: tl.constexpr, PREFETCH: tl.constexpr = 0, PDL: tl.constexpr = False,
                     PACKED: tl.constexpr = 1):
        """FMT 0 hif4, 1 mxfp4, 2 mxfp4_rceil. EXPAND 0 none, 1 native (HiF4 bf16, MXFP4 E5M2 + shared row
        scale), 2 bf16, 3 sum: bf16(deq Q(X) + deq S(Q(R))) (the fp32 sum rounded once, as the reference). PDL: a
        decode step's launch (:func:`megatron_fp4.kernels._common.pdl_enter`). PACKED 0 (with EXPAND 3): only the
        sum is stored, not the packed Q(X) and S(Q(R)) (what a GEMM on the sum reads: their packing is skipped)."""
        pdl_enter(PDL)
        BLK: tl.constexpr = 64 if FMT == 0 else 32
        NB: tl.constexpr = BK // BLK
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < R
        S = tl.zeros((BR,), dtype=tl.int32)
        ok = tl.full((BR,), 1, dtype=tl.int32)
        if FMT != 0 and EXPAND == 1:  # pass 1: the row scale covers both Q(X) and the residual
            am = tl.zeros((BR,), dtype=tl.float32)
            for k0 in range(0, KP, BK):
                cols = k0 + tl.arange(0, BK)
                x = _load_x(x_ptr, rows, rmask, cols, K, stride_xr, stride_xk)
                codes, X, bad, val = _mx_tile(x, BR, BK, FMT == 2)
                rr = x - val
                rb = rr.to(tl.int32, bitcast=True)
                ra = tl.where((rb & 0x7F800000) != 0x7F800000, tl.abs(rr), 0.0)
                xb = x.to(tl.int32, bitcast=True)
                xa = tl.where((xb & 0x7F800000) != 0x7F800000, tl.abs(x), 0.0)
                am = tl.maximum(am, tl.max(tl.maximum(xa, ra), axis=1))
            S = tl.minimum(tl.maximum(_mx_x(am, FMT == 2) - 13, -126), 127)
        xn = _first_tile(x_ptr, rows, rmask, K, stride_xr, stride_xk, BR, BK, PREFETCH)
        for k0 in range(tl.program_id(1) * BK, KP, tl.num_programs(1) * BK):
            cols = k0 + tl.arange(0, BK)
            x, xn = _k_tile(x_ptr, rows, rmask, cols, xn, K, stride_xr, stride_xk, BK, PREFETCH)
            codes, X, bad, val, rcodes, RX, rbad, rval = _resq_tiles(x, FMT, BR, BK, R1, R2, R3)
            if PACKED:
                _store_packed(qc_ptr, codes, rows, rmask, k0, KP, stride_cr, BR, BK)
                _store_packed(rc_ptr, rcodes, rows, rmask, k0, KP, stride_cr, BR, BK)
                jb = k0 // BLK + tl.arange(0, NB)
                smask = rmask[:, None] & (jb[None, :] < KP // BLK)
                sptr = rows[:, None] * stride_sr + jb[None, :]
                if FMT == 0:
                    tl.store(qs_ptr + sptr, X, mask=smask)
                    tl.store(rs_ptr + sptr, RX, mask=smask)
                else:
                    tl.store(qs_ptr + sptr, tl.where(bad, 255, X + 127).to(tl.uint8), mask=smask)
                    tl.store(rs_ptr + sptr, tl.where(rbad, 255, RX + 127).to(tl.uint8), mask=smask)
            emask = rmask[:, None] & (cols[None, :] < KP)
            eptr = rows[:, None] * stride_er + cols[None, :]
            if EXPAND == 2 or (EXPAND == 1 and FMT == 0):
                tl.store(ex_ptr + eptr, val.to(tl.bfloat16), mask=emask)
                tl.store(exr_ptr + eptr, rval.to(tl.bfloat16), mask=emask)
            if EXPAND == 3:
                tl.store(ex_ptr + eptr, _bf16_rne(val + rval).to(tl.bfloat16), mask=emask)
            if EXPAND == 1 and FMT != 0:
                bits, okt = _mx_e5m2(codes, X, S, bad, BR, BK)
                rbits, rokt = _mx_e5m2(rcodes, RX, S, rbad, BR, BK)
                ok = ok & okt & rokt
                tl.store(ex_ptr + eptr, bits.to(tl.uint8), mask=emask)
                tl.store(exr_ptr + eptr, rbits.to(tl.uint8), mask=emask)
        if FMT != 0 and EXPAND == 1:
            tl.store(rexp_ptr + rows, S, mask=rmask)
            tl.store(rok_ptr + rows, ok.to(tl.int8), mask=rmask)


if HAS_TRITON:
    from megatron_fp4.kernels.quantize import _TUNE

    _resq_tuned = triton.autotune(**{**_TUNE, "key": _TUNE["key"] + ["FMT", "PACKED"]})(_resq_kernel)


def resq_quantize_reference(x: torch.Tensor, f, expand: Optional[str]):
    """PyTorch twin: Q(X) and S(Q(R)) as packed tensors (2:4 zeroes dropped codes), plus expansions (for "sum":
    the BF16 sum and None)."""
    from megatron_fp4.resq import _two_of_four_mask

    q = f.quantize(x, dim=-1)
    xq = q.dequantize().float()
    rq = f.quantize(x.float() - xq, dim=-1)
    from megatron_fp4.formats.packing import pack_nibbles, unpack_nibbles

    codes = unpack_nibbles(rq.codes.reshape(-1, rq.codes.shape[-1]))
    mag = (codes & 7).reshape(codes.shape[0], -1, 4).float()
    keep = _two_of_four_mask(mag).reshape(codes.shape)
    codes = torch.where(keep, codes, torch.zeros_like(codes))
    rq = QuantizedTensor(f, pack_nibbles(codes).reshape(rq.codes.shape), rq.scales, rq.shape, rq.dim, rq.dtype)
    if not expand:
        return q, rq, None, None
    if expand == "sum":
        return q, rq, Expanded((xq + rq.dequantize().float()).to(torch.bfloat16)), None
    eq, er = expand_packed(q, expand), expand_packed(rq, expand)
    if eq.row_exp is not None:  # share one row scale (as the kernel does): recompute both relative to it
        S = torch.maximum(eq.row_exp, er.row_exp)
        eq = _rescale(q, S)
        er = _rescale(rq, S)
    return q, rq, eq, er


def _rescale(qt: QuantizedTensor, S: torch.Tensor) -> Expanded:
    from megatron_fp4.kernels.packed_gemm import dequantize_rows

    return fp8_rows(dequantize_rows(qt, torch.arange(S.numel(), device=S.device)), S)


def resq_quantize(x: torch.Tensor, fmt, expand: Optional[str] = None, config: Optional[tuple] = None,
                  packed: bool = True):
    """Fused Rollout-ResQ quantization of ``x [..., K]`` along K with 2:4 sparsity of the quantized residual.

    Returns ``(Q(X), S(Q(R)), expanded Q(X), expanded S(Q(R)))`` (the last two None without ``expand``); the
    residual's dropped elements have code 0. With ``expand="native"`` and MXFP4, both expansions share one row
    scale so that the GEMM can add them in one accumulator. ``expand="sum"``: the third item is the one BF16
    operand bf16(Q(X) + S(Q(R))) (``resq_combine="bf16"`` of ``megatron_fp4.resq``), the fourth None;
    ``packed=False`` (with "sum" only) writes nothing else and returns ``(None, None, sum, None)``: a GEMM on the
    sum reads nothing else. On a GPU with nvcc the CUDA kernel (:func:`megatron_fp4.kernels.cuda_quantize.resq_sum`)
    writes it, else the Triton kernel without its packing (a fifth fewer instructions). ``config``: a fixed tile of
    the Triton kernel (then it runs), as for :func:`megatron_fp4.kernels.quantize.quantize`.
    """
    f = get_format(fmt)
    if expand not in RESQ_EXPAND_MODES:
        raise ValueError(f"expand={expand!r} is not valid; allowed values: "
                         f"{', '.join(map(repr, RESQ_EXPAND_MODES))}")
    if not packed and expand != "sum":
        raise ValueError(f"packed=False is resq_quantize's sum-only form: it needs expand='sum', got {expand!r}")
    if f.name not in KERNEL_FORMATS or not kernels_usable(x) or x.numel() == 0:
        out = resq_quantize_reference(x, f, expand)
        return out if packed else (None, None, out[2], None)
    x2, outer, k = _rows_view(x, x.dim() - 1)
    if not packed and config is None:  # the sum alone: the CUDA kernel where it runs (the same bits, fewer cycles)
        from megatron_fp4.kernels import cuda_quantize

        if cuda_quantize.usable(x2, f.name, cuda_quantize.RESQ_SOURCE):
            return None, None, Expanded(cuda_quantize.resq_sum(x2, f.name)), None
    R = x2.shape[0]
    bs = f.block_size
    kp = cdiv(k, bs) * bs
    nblk = kp // bs
    dev = x.device
    rows = R if packed else 1  # (unused 1-row stand-ins without packed outputs)
    qc = torch.empty((rows, kp // 2), dtype=torch.uint8, device=dev)
    rc = torch.empty_like(qc)
    if f.name == "hif4":
        qs = torch.empty((rows, nblk, 4), dtype=torch.uint8, device=dev)
        rs = torch.empty_like(qs)
        qs_arg, rs_arg = qs.view(torch.int32), rs.view(torch.int32)
    else:
        qs = torch.empty((rows, nblk), dtype=torch.uint8, device=dev)
        rs = torch.empty_like(qs)
        qs_arg, rs_arg = qs, rs
    fmt_id = TILE_FMT[f.name]
    mode = {None: 0, "native": 1, "bf16": 2, "sum": 3}[expand]
    rexp = rok = None
    if mode == 0:
        ex = exr = qc
    elif mode == 3:
        ex = torch.empty((R, kp), dtype=torch.bfloat16, device=dev)
        exr = ex
    elif mode == 1 and fmt_id != 0:
        ex = torch.empty((R, kp), dtype=torch.uint8, device=dev)
        exr = torch.empty_like(ex)
        rexp = torch.empty((R,), dtype=torch.int32, device=dev)
        rok = torch.empty((R,), dtype=torch.int8, device=dev)
    else:
        ex = torch.empty((R, kp), dtype=torch.bfloat16, device=dev)
        exr = torch.empty_like(ex)
    args = (x2, qc, qs_arg, rc, rs_arg, ex, exr, rexp if rexp is not None else qc, rok if rok is not None else qc, R,
            k, kp, x2.stride(0), x2.stride(1), qc.stride(0), nblk, ex.stride(0), tune_bucket(k))
    kw = dict(FMT=fmt_id, EXPAND=mode, **TILE_RECIP, PACKED=int(packed))
    fixed, (BR, BK, warps, pf), grid = _fixed_launch(x2, kp, config, row_pass=mode == 1 and fmt_id != 0)
    if fixed:
        _resq_kernel[grid](*args, **kw, BR=BR, BK=BK, PREFETCH=pf, num_warps=warps, **pdl_launch())
    else:
        _resq_tuned[lambda meta: (cdiv(R, meta["BR"]), 1)](*args, **kw)
    if not packed:
        return None, None, Expanded(ex), None
    sshape = (*outer, nblk, 4) if fmt_id == 0 else (*outer, nblk)
    q = QuantizedTensor(f, qc.reshape(*outer, kp // 2), qs.reshape(sshape), x.shape, x.dim() - 1, x.dtype)
    r = QuantizedTensor(f, rc.reshape(*outer, kp // 2), rs.reshape(sshape), x.shape, x.dim() - 1, x.dtype)
    if mode == 0:
        return q, r, None, None
    if mode == 3:
        return q, r, Expanded(ex), None
    if mode == 1 and fmt_id != 0:
        return (q, r, Expanded(ex.view(torch.float8_e5m2), rexp, rok.bool()),
                Expanded(exr.view(torch.float8_e5m2), rexp, rok.bool()))
    return q, r, Expanded(ex), Expanded(exr)


def resq_matmul(x: torch.Tensor, qw: QuantizedTensor, ew: Optional[Expanded] = None,
                out_dtype: torch.dtype = torch.float32, promote: int = 0,
                wide: Optional[bool] = None, combine: str = "exact") -> torch.Tensor:
    """``Q(X) Q(W)^T + S(Q(X - Q(X))) Q(W)^T`` (2:4 ResQ) for ``x [M, K]`` and a packed weight ``qw [N, K]``.

    ``combine="exact"``: M <= DECODE_MAX_M: the decode kernel on the packed weight and the BF16 expansions of both
    activation operands, the residual riding on the same weight read (``wide``: see
    :func:`megatron_fp4.kernels.decode_gemm.w4_matmul`). Larger M: the pre-expanded GEMM in concatenated-K form;
    ``ew`` (from ``expand_packed``/``quantize(..., expand=...)``, once per weight update) picks the mode: BF16
    (exact, the default when None) or FP8 (MXFP4: E5M2, or E4M3 for cuBLAS; ``promote`` as in
    :func:`megatron_fp4.kernels.gemm.mm_expanded`). ``combine="bf16"``: ``bf16(Q(X) + S(Q(R))) Q(W)^T``, one GEMM of the
    plain W4A4 size (decode kernel, or BF16 GEMM against ``ew`` if it is BF16, else the weight's BF16 expansion).
    """
    from megatron_fp4.kernels.decode_gemm import w4_matmul
    from megatron_fp4.kernels.gemm import mm_expanded

    if combine not in RESQ_COMBINES:
        raise ValueError(f"combine={combine!r} is not valid; allowed values: {', '.join(map(repr, RESQ_COMBINES))}")
    if not kernels_usable(x) or qw.fmt.name not in KERNEL_FORMATS:  # PyTorch twin (fp32)
        from megatron_fp4.resq import resq_activation, resq_components

        wq = qw.dequantize().float()
        if combine == "bf16":
            return (resq_activation(x, qw.fmt, "2:4", out_dtype=torch.bfloat16).float() @ wq.t()).to(out_dtype)
        q, s = resq_components(x, qw.fmt, "2:4")
        return (q @ wq.t() + s @ wq.t()).to(out_dtype)
    M = x.shape[0]
    if combine == "bf16":
        a = resq_quantize(x, qw.fmt, expand="sum", packed=False)[2]
        if M <= DECODE_MAX_M:
            return w4_matmul(a.values, qw, wide=wide).to(out_dtype)
        if ew is None or ew.values.dtype != torch.bfloat16:
            ew = expand_packed(qw, "bf16")
        return mm_expanded(a, ew, out_dtype=out_dtype)
    if M <= DECODE_MAX_M:
        _, _, eq, er = resq_quantize(x, qw.fmt, expand="bf16")
        return w4_matmul(eq.values, qw, er.values, wide=wide).to(out_dtype)
    if ew is None:
        ew = expand_packed(qw, "bf16")
    mode = "bf16" if ew.values.dtype == torch.bfloat16 else "native"
    _, _, eq, er = resq_quantize(x, qw.fmt, expand=mode)
    return mm_expanded(eq, ew, er, out_dtype=out_dtype, promote=promote)
