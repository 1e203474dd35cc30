"""The Triton decode GEMM (M <= 64 tokens): ``w4_matmul`` reads each packed HiF4/MXFP4 weight tile once and
dequantizes it to BF16 in registers with a few bit operations per value (inline PTX on the GPU, a pure twin in the
interpreter), then multiplies BF16 activations (W4A16) or the activations' exact BF16 expansions (W4A4), optionally
with a second activation (the ResQ residual) that rides on the same weight read. Split-K with fp32 atomics fills
the GPU. The CUDA C++ decode kernel (:mod:`megatron_fp4.kernels.cuda_decode`) serves the smallest batches where it can
run.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_fp4.kernels._common import HAS_TRITON, cdiv, interpreting, sm_count, tl, triton
from megatron_fp4.kernels.packed_gemm import _fmt_id, _scale_arg
from megatron_fp4.formats import QuantizedTensor

__all__ = ["w4_matmul", "needs_wide_decode", "permute_decode_activations", "DECODE_CONFIGS"]

if HAS_TRITON:
    from megatron_fp4.kernels.packed_gemm import _dot

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
    often keep the answer with the weight (``megatron_fp4.kernels.dispatch.PreparedWeight.wide``)."""
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
