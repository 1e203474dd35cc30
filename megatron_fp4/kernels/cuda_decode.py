"""The CUDA C++ decode GEMMs: packed HiF4/MXFP4 weights x BF16 activations, M <= 64.

    dw = to_decode_layout(qt, wide)        # once per weight update (PreparedWeight.decode)
    y = w4_decode(x_bf16, dw)              # fp32 [M, N] = x . deq(W)^T, exact products, fp32 accumulation
    y = w4_decode(x_bf16, dw, out_dtype=torch.bfloat16)  # the same sums rounded to bf16 (by the kernel's store)

The weight is re-laid out once so that each lane of a warp reads, with one 16-byte load per 64 values of K, the
codes of its BF16 MMA A fragments (``megatron_fp4/kernels/csrc/w4_decode.cu`` says how); the kernels dequantize them in
registers with a few bit operations per pair of values (the same bit-exact tricks as the Triton decode kernel,
``megatron_fp4/kernels/csrc/w4_device.h``) and multiply on the BF16 tensor cores with fp32 accumulation. Two kernels
read that layout: ``w4_wgmma.cu`` (Hopper's warpgroup MMA: a warpgroup's 64 weight rows x up to 64 tokens per
instruction, the activations staged once per block in shared memory) and ``w4_decode.cu`` (mma.sync m16n8k16);
:func:`default_kernel` picks one by weight size (``MEGATRON_FP4_DECODE_KERNEL=wgmma|mma`` forces one). W4A4 and
ResQ's bf16 sum call them on the activations' exact BF16 expansion. By default (:func:`natural_layout`) the weights
are laid out in natural K order instead, which only ``w4_wgmma.cu``'s NATURAL form reads (the activations then come
by TMA, unpermuted: :data:`NATURAL_TILE`); ``MEGATRON_FP4_DECODE_LAYOUT=permuted`` keeps the permuted layout and the
per-size tiles above. Built with nvcc per configuration on first use
(sm_90a), cached in ``megatron_fp4/kernels/_build`` (or ``MEGATRON_FP4_BUILD_DIR``), loaded with ctypes;
``MEGATRON_FP4_CUDA_DECODE=0`` turns them off (the Triton kernel serves). Without CUDA or nvcc nothing here runs but
:func:`to_decode_layout` and :func:`decode_layout_dequantize` (its PyTorch emulation, what the CPU tests check bit
for bit against the reference quantizer).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_fp4.kernels import _nvcc
from megatron_fp4.kernels._common import pdl_enabled, sm_count, switch_on
from megatron_fp4.formats import QuantizedTensor

__all__ = ["DecodeWeight", "to_decode_layout", "decode_layout_dequantize", "available", "w4_decode",
           "DECODE_TILES", "WGMMA_TILES", "WGMMA_MAX_WEIGHT", "LARGE_M16_TILES", "NATURAL_TILE", "NATURAL_TILE_AT_64",
           "natural_tile", "natural_layout", "hif4_subnormal_fits", "default_kernel", "build", "prebuild"]

_SLAB_PAD = 4  # slabs padded to a multiple of this (the largest slabs-per-warp tile)


@dataclass
class DecodeWeight:
    """A packed weight ``[N, K]`` in the decode kernel's layout: ``codes`` int32 ``[S, C, 32, 4]`` (S 16-row slabs,
    C 64-value chunks), ``meta`` uint8 ``[S, C, 80 | 32]`` (HiF4 | MXFP4); ``wide``: MXFP4 block scales above 2^1
    present."""

    codes: torch.Tensor
    meta: torch.Tensor
    n: int
    k: int
    fmt_id: int  # 0 HiF4, 1 MXFP4
    wide: bool
    #: the MMA's K order inside each k16 step is K's own (:func:`to_decode_layout` ``natural``; the wgmma kernel's
    #: NATURAL=1 tiles, which bring the activations by TMA unpermuted); else the permuted order both kernels read
    natural: bool = False
    #: the rows (int64, on the weight's device) with a NaN scale code, or None. The kernels do not test scale codes
    #: for NaN (it costs ~10% of the MXFP4 loop's instructions): they multiply such a block by a finite stand-in, and
    #: :func:`w4_decode` writes NaN into these rows' output columns, which is what the reference product gives (a NaN
    #: weight times any activation, zero included, is NaN, and so is the sum).
    nan_rows: Optional[torch.Tensor] = None
    #: HiF4 in natural order: codes stored as bf16 subnormals, sign and magnitude (:func:`_hif4_subnormal_position`;
    #: one multiply per pair in the kernel, w4_device.h), not offset binary; for weights whose every unit has
    #: E6M2 x 2^e < 2 (:func:`hif4_subnormal_fits`). A refit that changes it changes the structure, as ``wide`` does.
    subnormal: bool = False

    @property
    def slabs(self) -> int:
        return self.codes.shape[0]

    @property
    def chunks(self) -> int:
        return self.codes.shape[1]


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.int32)
    return torch.stack((c & 15, c >> 4), dim=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)


#: HiF4 in natural K order: each 4-bit code (sign, 3-bit magnitude m) stored as offset binary, 8 + (-1)^sign m (1..15;
#: -0 becomes +0), so that one mask, the bf16 128 and one FMA make its value with no sign operation: bf16(128 + o) x F
#: - 136 F = (o - 8) F, exact (136 F has at most 5 + 3 significant bits; w4_device.h dequant).
_HIF4_OFFSET = (8, 9, 10, 11, 12, 13, 14, 15, 8, 7, 6, 5, 4, 3, 2, 1)
#: MXFP4 in natural K order: the rotations (right, of the lane's 32-bit word) that put pair j's bits in place for
#: j = 0, 1, 2; pair 3 takes its sign, e1 and e0 bits from the rotation by 6 and its mantissa bits from the rotation by
#: 14 (w4_device.h mx_bits). "In place": a bf16x2 whose halves hold the code's sign at bit 15 and its exponent and
#: mantissa bits at 8, 7, 6 (e2m1 placed in bf16; the 2^126 this leaves is folded into the block scale), one mask away
#: (0x81C081C0). Four pairs cost 4 funnel shifts and 5 LOP3s, where the permuted layout's nibbles cost a shift pair
#: and two LOP3s each. No fourth rotation fits the bits the first three leave (a search over all), hence pair 3's two.
_MX_ROT = (0, 4, 10)
_MX_ROT3_MANTISSA = 14
_MX_ROT3_REST = 6
#: ``MEGATRON_FP4_DECODE_HIF4_SUBNORMAL=0``: natural-order HiF4 weights keep offset binary even where the subnormal
#: codes fit (A/B runs; :func:`to_decode_layout`'s ``subnormal=None``).
HIF4_SUBNORMAL_SWITCH = "MEGATRON_FP4_DECODE_HIF4_SUBNORMAL"


def _mx_natural_position(j: int, half: int, bit: int) -> int:
    """Where bit ``bit`` (0 mantissa, 1 e0, 2 e1, 3 sign) of pair ``j``'s value in ``half`` (0 low, 1 high) sits in a
    natural-order MXFP4 word."""
    target = (6, 7, 8, 15)[bit] + 16 * half
    r = _MX_ROT[j] if j < 3 else _MX_ROT3_MANTISSA if bit == 0 else _MX_ROT3_REST
    return (target + r) % 32


def _hif4_subnormal_position(j: int, half: int, bit: int) -> int:
    """Where bit ``bit`` (0..2 the magnitude's, 3 the sign) of pair ``j``'s code in ``half`` (0 low, 1 high) sits in a
    natural-order HiF4 word of the subnormal layout: the word rotated right by 4j puts it at bf16 bit 4..6 or 15 of
    that half (the magnitude k as the subnormal k x 2^-129; one mask, 0x80708070). The four rotations by 0, 4, 8 and
    12 take each of the 32 bits once."""
    return ((4, 5, 6, 15)[bit] + 16 * half + 4 * j) % 32


def _hif4_exponent_sums(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HiF4 scales ``[rows, C, 4]`` (uint8: E6M2, E1_8, two E1_16 bytes) -> the E6M2 codes ``[rows, C]`` and each
    4-value group's exponent sum e = E1_8 + E1_16 ``[rows, C, 16]`` (int64; 0 in a NaN unit)."""
    sc = scales.to(torch.int64)
    code, e8, e16 = sc[..., 0], sc[..., 1], sc[..., 2] | (sc[..., 3] << 8)
    q = torch.arange(16, device=scales.device)
    e = ((e8.unsqueeze(-1) >> (q // 2)) & 1) + ((e16.unsqueeze(-1) >> q) & 1)
    return code, torch.where((code == 255).unsqueeze(-1), torch.zeros_like(e), e)


def hif4_subnormal_fits(qt: QuantizedTensor) -> bool:
    """Whether a HiF4 weight can take the subnormal decode layout: every unit (NaN ones aside) has E6M2 x 2^e < 2
    for each of its groups' exponent sums e, i.e. the kernel's factor E6M2 x 2^(e + 127) is a finite bf16 (its
    exponent field c + e + 206 <= 254, c the E6M2 code's exponent bits; a unit's largest value below ~3.5 suffices)."""
    scales = qt.scales.reshape(-1, 4)
    c = scales[:, 0].to(torch.int32)
    near = (c >> 2 >= 47) & (c != 255)  # (below: fits whatever e <= 2 is; at 49 and above: never)
    if not bool(near.any()):
        return True
    code, e = _hif4_exponent_sums(scales[near.nonzero().flatten()])  # the few units at the edge
    return not bool(((code >> 2) + e.amax(-1) > 48).any())


def _rotr(w: torch.Tensor, r: int) -> torch.Tensor:
    """32-bit patterns (int64) rotated right by ``r`` (the CUDA funnel shift of a word with itself)."""
    return ((w >> r) | (w << (32 - r))) & 0xFFFFFFFF if r else w


def _rotl(w: torch.Tensor, r: int) -> torch.Tensor:
    """32-bit patterns (int64) rotated left by ``r``."""
    return _rotr(w, 32 - r)


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)


#: Weight rows :func:`to_decode_layout` lays out at a time (a multiple of 16 x _SLAB_PAD): its temporaries are int64
#: tensors of up to 32 bytes per weight value (a 7B fc1 at once: 4 GiB, which ran an SGLang Engine on an H100 out of
#: memory at its first weight sync, session 38); in blocks of this many rows, ~250 MB at K = 3584.
LAYOUT_ROWS = 2048


def to_decode_layout(qt: QuantizedTensor, wide: bool = False, natural: bool = False,
                     subnormal: Optional[bool] = None) -> DecodeWeight:
    """Re-lay a packed 2-D weight ``[N, K]`` (quantized along K, HiF4 or MXFP4) out for :func:`w4_decode`.

    Each lane's 32-bit word of a k16 step holds the 8 codes of its MMA A fragment: rows g and g + 8, MMA k 2t, 2t + 1,
    2t + 8, 2t + 9. By default those are K 4t .. 4t + 3 (one HiF4 micro-exponent group per lane, row and step; the
    activations are then staged in the same permuted order); ``natural`` keeps MMA k = K, so that the activations can
    be copied as they are (the NATURAL=1 tiles). A HiF4 lane then holds two micro-exponent groups per row and step
    (K 2t and 2t + 8 are 8 apart): 32 bits of exponent sums per lane instead of 16, the same for lanes t and t ^ 1,
    so that the metadata stores them once per lane pair (16 words, read at lane >> 1; 80 bytes as in the permuted
    order's 32 x 16 bits), and its codes are offset binary (:data:`_HIF4_OFFSET`), or with ``subnormal`` sign and
    magnitude placed as bf16 subnormals (:func:`_hif4_subnormal_position`: fewer instructions per value; None, the
    default: where :func:`hif4_subnormal_fits` and ``MEGATRON_FP4_DECODE_HIF4_SUBNORMAL`` is not 0). An MXFP4 word in
    natural order holds its codes' bits where :data:`_MX_ROT`'s rotations read them, not as nibbles."""
    name = qt.fmt.name
    if name not in ("hif4", "mxfp4", "mxfp4_rceil") or qt.codes.dim() != 2:
        raise ValueError(f"to_decode_layout takes a 2-D HiF4/MXFP4 weight, got {name} {tuple(qt.codes.shape)}")
    fmt_id = 0 if name == "hif4" else 1
    if subnormal is None:
        subnormal = natural and fmt_id == 0 and switch_on(HIF4_SUBNORMAL_SWITCH) and hif4_subnormal_fits(qt)
    elif subnormal and not (natural and fmt_id == 0 and hif4_subnormal_fits(qt)):
        raise ValueError("to_decode_layout: subnormal=True takes a HiF4 weight in natural order (natural=True) whose "
                         "every unit has E6M2 x 2^e < 2 (hif4_subnormal_fits)")
    N = qt.codes.shape[0]
    # row blocks of whole padded slab groups: their slabs concatenate to the whole weight's
    parts = [_layout_rows(qt.codes[r:r + LAYOUT_ROWS], qt.scales[r:r + LAYOUT_ROWS], fmt_id, natural, subnormal)
             for r in range(0, N, LAYOUT_ROWS)]
    codes = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])
    meta = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])
    nan = (qt.scales.reshape(N, -1) == 255) if fmt_id == 1 else (qt.scales[..., 0] == 255)
    nan_rows = nan.any(dim=1).nonzero().flatten()
    return DecodeWeight(codes, meta, N, qt.shape[-1], fmt_id, bool(wide) and fmt_id == 1, natural,
                        nan_rows if len(nan_rows) else None, bool(subnormal))


def _layout_rows(qcodes: torch.Tensor, qscales: torch.Tensor, fmt_id: int, natural: bool, subnormal: bool) -> tuple:
    """:func:`to_decode_layout`'s codes and meta of the rows ``qcodes`` / ``qscales`` (packed codes and scales)."""
    N, kh = qcodes.shape
    C = -(-2 * kh // 64)
    S = -(-(-(-N // 16)) // _SLAB_PAD) * _SLAB_PAD
    dev = qcodes.device
    nib = torch.zeros((S * 16, C * 64), dtype=torch.int64, device=dev)
    nib[:N, : 2 * kh] = _nibbles(qcodes)
    if natural and fmt_id == 0 and not subnormal:
        nib = torch.tensor(_HIF4_OFFSET, device=dev)[nib]  # (the padding's +0 as well)
    if natural:  # [S, h, g, C, s, i1, t, i0]: K = 64 c + 16 s + 8 i1 + 2 t + i0, i = 2 i1 + i0
        nib = nib.view(S, 2, 8, C, 4, 2, 4, 2).permute(0, 3, 2, 6, 4, 1, 5, 7).reshape(S, C, 8, 4, 4, 2, 4)
    else:  # [S, h, g, C, s, t, i]: row = 16 slab + 8 h + g, K = 64 c + 16 s + 4 t + i
        nib = nib.view(S, 2, 8, C, 4, 4, 4).permute(0, 3, 2, 5, 4, 1, 6)  # [S, C, g, t, s, h, i]
    h = torch.arange(2, device=dev).view(2, 1)
    i = torch.arange(4, device=dev).view(1, 4)
    if natural and fmt_id == 1:  # each code bit where _MX_ROT's rotations read it
        pos = torch.tensor([[[_mx_natural_position(hh + 2 * (ii >> 1), ii & 1, b) for b in range(4)]
                             for ii in range(4)] for hh in range(2)], device=dev)  # [h, i, bit]
        bit = torch.arange(4, device=dev)
        words = (((nib.unsqueeze(-1) >> bit) & 1) << pos).sum(dim=(-1, -2, -3))
    else:
        shift = 4 * (h + 2 * (i >> 1) + 4 * (i & 1))  # nibble position of (h, i) in the 32-bit word
        words = (nib << shift).sum(dim=(-1, -2))  # [S, C, g, t, s]
        if subnormal:  # pair j's nibble sits at 4 j (+ 16 in the high half): its magnitude 4 bits up, its sign 12
            words = _rotl(words & 0x77777777, 4) | _rotl(words & 0x88888888, 12)  # (_hif4_subnormal_position)
    codes = _to_int32(words).reshape(S, C, 32, 4).contiguous()
    if fmt_id == 1:
        sc = torch.full((S * 16, 2 * C), 127, dtype=torch.uint8, device=dev)
        sc[:N, : qscales.shape[1]] = qscales.reshape(N, -1)
        meta = sc.view(S, 2, 8, C, 2).permute(0, 3, 2, 1, 4).reshape(S, C, 32).contiguous()
    else:
        sc = torch.zeros((S * 16, C, 4), dtype=torch.uint8, device=dev)
        sc[:N, : qscales.shape[1]] = qscales
        code, e = _hif4_exponent_sums(sc)  # [rows, C], [rows, C, 16]
        if subnormal:  # a NaN unit's stand-in (w4_decode writes its rows' NaN): a code whose factor stays finite
            code = torch.where(code == 255, torch.zeros_like(code), code)
        steps = 2 * torch.arange(4, device=dev)
        if natural:  # lane t's groups at step s: A = 4 s + t // 2 (K 2t, 2t + 1), B = 4 s + 2 + t // 2 (K 2t + 8, 9):
            # one word per lane pair (tt = t // 2), word 2 g + tt = lane >> 1
            e = e.view(S, 2, 8, C, 4, 2, 2)  # [S, h, g, C, s, ab, tt]: group 4 s + 2 ab + tt
            e = e.permute(0, 3, 2, 6, 1, 5, 4)  # [S, C, g, tt, h, ab, s]
            ebytes = (e << steps).sum(-1)  # [S, C, g, tt, h, ab]: bytes (g, A), (g, B), (g + 8, A), (g + 8, B)
        else:
            e = e.view(S, 2, 8, C, 4, 4).permute(0, 3, 2, 5, 1, 4)  # [S, C, g, t, h, s]
            ebytes = (e << steps).sum(-1)  # [S, C, g, t, h]: bytes (g), (g + 8)
        cb = code.view(S, 2, 8, C).permute(0, 3, 2, 1).reshape(S, C, 8, 2)  # bytes c(g), c(g + 8)
        meta = torch.cat((ebytes.reshape(S, C, -1), cb.reshape(S, C, 16)), -1)
        meta = meta.to(torch.uint8).contiguous()
    return codes, meta


# --------------------------------------------------------------------------------------------------------------------
# PyTorch emulation of the kernel's dequantization (bit for bit), for CPU tests
# --------------------------------------------------------------------------------------------------------------------
def _bf(bits: torch.Tensor) -> torch.Tensor:
    """16-bit patterns (int64) -> float64 values of those bf16 numbers."""
    b = torch.where(bits >= 2 ** 15, bits - 2 ** 16, bits).to(torch.int16)
    return b.view(torch.bfloat16).double()


def _bits(v: torch.Tensor) -> torch.Tensor:
    """float64 values (exact in bf16 after one rounding) -> bf16 bits (int64)."""
    return v.to(torch.float32).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def _halves(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return v & 0xFFFF, (v >> 16) & 0xFFFF


def _hif4_base_bits(code: torch.Tensor) -> torch.Tensor:
    """bf16 bits of E6M2 / 4 for HiF4's 8-bit scale codes (int64), as the decode kernels' make_scales builds them."""
    return ((((code >> 2) & 63) + 77) << 7) | ((code & 3) << 5)


def decode_layout_dequantize(dw: DecodeWeight) -> torch.Tensor:
    """The fp32 weight ``[N, K]`` the kernel multiplies, computed with its bit operations in PyTorch (CPU tests); the
    rows of :attr:`DecodeWeight.nan_rows` all NaN (what :func:`w4_decode` makes of their outputs)."""
    S, C = dw.slabs, dw.chunks
    w = dw.codes.to(torch.int64) & 0xFFFFFFFF  # [S, C, 32, 4]
    lane = torch.arange(32, device=w.device)
    s = torch.arange(4, device=w.device).view(1, 1, 1, 4)
    vals = []
    if dw.fmt_id == 1:
        m = dw.meta.to(torch.int64).view(S, C, 8, 4)
        m = m[:, :, (lane >> 2)]  # [S, C, 32, 4]: per lane its g's bytes
        blk = (s >> 1)
        for j in range(4):
            if dw.natural:  # w4_device.h mx_bits, natural layout
                a = (_rotr(w, _MX_ROT[j]) & 0x81C081C0 if j < 3 else
                     (_rotr(w, _MX_ROT3_REST) & 0x81808180) | (_rotr(w, _MX_ROT3_MANTISSA) & 0x00400040))
            else:
                src = (w << (12 - 4 * j)) & 0xFFFFFFFF
                a = ((src >> 6) & 0x01C001C0) | (src & 0x80008000)
            row = j & 1
            sbyte = torch.gather(m, 3, (2 * row + blk).expand_as(w))
            sx = sbyte + 126
            if dw.wide:
                f = torch.clamp(sx, max=254) << 7
                f2 = (torch.clamp(sx - 254, min=0) + 127) << 7
            else:
                f = (sx << 7) & 0xFFFF
            out = []
            for half in _halves(a):
                v = _bits(_bf(half) * _bf(f))
                if dw.wide:
                    v = _bits(_bf(v) * _bf(f2))
                out.append(v)
            vals.append(out)
    else:
        m = dw.meta.to(torch.int64)
        nb = 4 if dw.natural else 2  # bytes of exponent sums per lane (natural: one word per lane pair)
        ee = sum(m[:, :, b:64:nb] << (8 * b) for b in range(nb))  # [S, C, 64 // nb]
        if dw.natural:
            ee = ee[:, :, lane >> 1]  # [S, C, 32]
        cc = m[:, :, 64:80:2] | (m[:, :, 65:80:2] << 8)  # [S, C, 8]
        cc = cc[:, :, (lane >> 2)]
        for j in range(4):
            row = j & 1
            c = (cc >> (8 * row)) & 255
            # the byte of (row, pair j >> 1): natural (g, A), (g, B), (g + 8, A), (g + 8, B); else (g), (g + 8)
            byte = 2 * row + (j >> 1) if dw.natural else row
            e = (ee.unsqueeze(-1) >> (8 * byte + 2 * s)) & 3
            base = _hif4_base_bits(c).unsqueeze(-1)
            if dw.subnormal:  # w4_device.h's W4_SUBN dequant: the subnormal k x 2^-129 times E6M2 x 2^(e + 127)
                a = _rotr(w, 4 * j) & 0x80708070
                F = base + ((129 + e) << 7)  # (base: E6M2 / 4; its exponent field + 2 + 127 + e)
                vals.append([_bits(_bf(ha) * _bf(F)) for ha in _halves(a)])
                continue
            F = base + (e << 7)
            if dw.natural:  # offset binary nibble j: bf16(128 + o) F - 136 F, no sign operation
                a = ((w >> (4 * j)) & 0x000F000F) | 0x43004300
                sign = torch.zeros_like(w)
                mv = 136.0
            else:
                t = w >> (8 if j >= 2 else 0)
                mask, magic, mv = ((0x00070007, 0x43004300, 128.0) if j % 2 == 0 else (0x00700070, 0x41004100, 8.0))
                a = (t & mask) | magic
                sign = (w << (12 - 4 * j)) & 0x80008000
            # -mv F: the natural kernel adds e to the exponent field of -136 x base (exact: w4_device.h's dequant)
            neg = _bits(_bf(base) * -mv) + (e << 7) if dw.natural else _bits(_bf(F) * -mv)
            out = []
            for ha, hs in zip(_halves(a), _halves(sign)):
                v = _bits(_bf(ha) * _bf(F) + _bf(neg))
                out.append(v ^ hs)
            vals.append(out)
    # place pair j (lo, hi) of lane (g, t), step s at row 8 (j & 1) + g, K 16 s + 4 t + 2 (j >> 1) + {0, 1}
    # (natural: K 16 s + 8 (j >> 1) + 2 t + {0, 1})
    full = torch.zeros((S, C, 2, 8, 4, 4, 2, 2), dtype=torch.float64)  # [S, C, h, g, s, t, pair, i]
    for j in range(4):
        for i_, half in enumerate(vals[j]):
            v = _bf(half).view(S, C, 8, 4, 4)  # [S, C, g, t, s]
            full[:, :, j & 1, :, :, :, j >> 1, i_] = v.permute(0, 1, 2, 4, 3)
    if dw.natural:
        full = full.permute(0, 1, 2, 3, 4, 6, 5, 7)  # [S, C, h, g, s, pair, t, i]
    full = full.reshape(S, C, 2, 8, 4, 16).permute(0, 2, 3, 1, 4, 5).reshape(S * 16, C * 64)[: dw.n, : dw.k].float()
    if dw.nan_rows is not None:  # as w4_decode: these rows' blocks of NaN scale hold finite stand-ins
        full[dw.nan_rows.cpu()] = float("nan")
    return full


# --------------------------------------------------------------------------------------------------------------------
# Build, load, launch
# --------------------------------------------------------------------------------------------------------------------
#: Default tiles of the mma.sync kernel by (format id, token bucket): SPW slabs of 16 weight rows per warp, DEPTH
#: chunks of 64 values in flight per warp (registers), WARPS per block (sharing each staged activation chunk),
#: PER_SM target blocks per SM (split-K fills the GPU up to it).
DECODE_TILES = {  # from --decode-sweep on the 7B MLP shapes (docs/PERFORMANCE.md)
    **{(f, m): dict(SPW=2, DEPTH=2, WARPS=8, PER_SM=4) for f in (0, 1) for m in (8, 16)},
    **{(f, m): dict(SPW=1, DEPTH=4, WARPS=4, PER_SM=4) for f in (0, 1) for m in (32, 64)},
}
#: Default tiles of the wgmma kernel by (format id, token bucket): WGS warpgroups (64 weight rows each) per block,
#: DEPTH chunks in flight per warp, XST shared-memory stages of activations, MINB blocks per SM the registers allow
#: (also the split-K target), PRODUCER 1: one extra warp stages the activations (w4_wgmma.cu says why); a tile may
#: add LEAN 1 (fewer instructions per chunk), XPAIR, WRING (w4_wgmma.cu; docs/PERFORMANCE.md, session 25).
WGMMA_TILES = {  # no register spills (ptxas, tests/test_cuda_decode.py); M = 16 and 64 measured on the H200
    # (docs/PERFORMANCE.md, session 19); HiF4 at M <= 32 takes DEPTH 2: DEPTH 4 spilled 20 bytes there
    **{(f, m): dict(WGS=2, DEPTH=4, XST=4, MINB=2, PRODUCER=0) for f, m in ((0, 8), (0, 16), (1, 8), (1, 16), (1, 32))},
    **{(f, m): dict(WGS=2, DEPTH=2, XST=4, MINB=2, PRODUCER=0) for f, m in ((0, 32), (0, 64), (1, 64))},
}
#: Weights of up to this many values (N x K) take the wgmma kernel, larger ones the mma.sync kernel: on the H200 at
#: M = 16 wgmma beat mma.sync on every Qwen2.5-1.5B weight (1536 x 1536 .. 1536 x 8960: 1.10-1.27x) and lost on the
#: 7B MLP weights (3584 x 18944 both ways: 0.81-0.91x), benchmarks/results/decode_h200_s19.json.
WGMMA_MAX_WEIGHT = 32 * 2 ** 20
#: Larger weights at 9-16 tokens take the wgmma kernel with a producer warp instead, per format id: on the H200 it beat
#: mma.sync's default on the 7B MLP weights (HiF4 25.2-25.7 us vs 30.4-30.6, MXFP4 22.9-23.6 vs 25.9-26.1; the
#: mma.sync tile stays for 8, 32 and 64 tokens; benchmarks/results/decode_h200_s23.json); HiF4 with LEAN=1 (session
#: 25, three runs: 23.2-24.4 us vs 25.1-25.5 without; MXFP4 gained nothing from it, benchmarks/results/decode_h200_s25.json).
_LARGE_M16 = dict(KERNEL="wgmma", WGS=2, DEPTH=2, XST=4, MINB=3, PRODUCER=1)
LARGE_M16_TILES = {0: dict(_LARGE_M16, LEAN=1), 1: _LARGE_M16}
#: The tile of weights in the natural K order (:func:`to_decode_layout` ``natural``, the default layout): only the
#: wgmma kernel's NATURAL form reads them (activations by TMA, weights through the shared-memory ring). On the H200
#: (session 26, both formats, bit-exact; benchmarks/results/decode_natural_h200.json) against the permuted layout's
#: defaults: 1.20-1.46x faster at 32 and 64 tokens on the 7B MLP weights (MXFP4 at 64: 0.95x / 1.37x cuBLAS BF16,
#: HiF4 0.84x / 1.22x) and 1.10-1.32x at every token count on the 1.5B ones; 0.86-1.03x at 8 and 16 tokens on the 7B
#: weights (the price of one layout for every batch: a rollout's decode batch is mostly 32-64 sequences).
#: WTMA=1 (the producer brings weight codes and metadata by 3-D TMA): session 28, 0.83-0.99x the time of WTMA=0 on
#: the 7B and 1.5B MLP weights at 16 and 64 tokens, both formats, except 3584x18944 MXFP4 at 64 (1.01x)
#: (benchmarks/results/decode_natural_sweep_h200.json).
NATURAL_TILE = dict(KERNEL="wgmma", PRODUCER=1, WGS=2, DEPTH=2, XST=6, MINB=2, LEAN=1, WRING=1, NATURAL=1, WTMA=1)
_LAYOUTS = ("permuted", "natural")
#: Tile keys ``MEGATRON_FP4_DECODE_NATURAL_TILE`` may set (a JSON object merged into :data:`NATURAL_TILE` at import, for
#: A/B runs of a whole engine: e.g. '{"CLUSTER": 1}', deterministic split-K, see w4_wgmma.cu).
NATURAL_TILE_KEYS = ("WGS", "DEPTH", "XST", "MINB", "LEAN", "CLUSTER", "WTMA", "WJIT", "SPLIT")


def natural_tile_override(text: str) -> dict:
    """The tile keys of ``MEGATRON_FP4_DECODE_NATURAL_TILE``'s JSON object ``text`` (ValueError naming the variable
    and the allowed keys on anything else)."""
    try:
        tile = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"MEGATRON_FP4_DECODE_NATURAL_TILE must be a JSON object, e.g. "
                         f"'{{\"CLUSTER\": 1}}' ({e})") from None
    bad = [k for k in tile if k not in NATURAL_TILE_KEYS] if isinstance(tile, dict) else None
    if bad is None or bad or not all(isinstance(v, int) and v >= 0 for v in tile.values()):
        raise ValueError(f"MEGATRON_FP4_DECODE_NATURAL_TILE={text!r}: a JSON object of non-negative integers with keys "
                         f"among {', '.join(NATURAL_TILE_KEYS)}")
    return tile


#: :data:`NATURAL_TILE`'s keys that differ at 64 tokens (the rollout's decode batch), both formats. At 64 tokens a block
#: reads 8 KB of activations per 64-value chunk against 2.1-2.6 KB of weights per 64 rows, so the ring's stages are
#: mostly activations and shared memory caps how many are in flight. Session 39 (Nsight Compute on the H200:
#: latency-bound, 0.46-0.55 warps issued per scheduler and cycle) moved both formats to one warpgroup per block, three
#: blocks per SM (benchmarks/results/decode_m64_tile_h100.json: 7B fc1 3584x37888 HiF4 57.5 -> 52.8 us, MXFP4 48.9 ->
#: 48.1). Session 51, an H100 (benchmarks/results/decode_h100_s51_ring.json, ..._xst7.json): with the weights' stages
#: kept apart from the activations' (w4_wgmma.cu, WSTAGE_BYTES) a seventh stage fits three MXFP4 blocks: fc1 46.9 ->
#: 43.8 us, the engine's 7B MXFP4 rows +2.6% (W4A16) / +3.5% (ResQ). HiF4's larger metadata (144 bytes per slab then)
#: did not fit three (57.8 us), and took two warpgroups per block with eight stages instead (a tile per format for one
#: session; fc1 52.0 -> 50.1, fc2 25.5 -> 24.3; engine +1.1-1.2%). Session 52, an H100: with its metadata at 80 bytes
#: (one exponent word per lane pair) three HiF4 blocks of seven stages fit too, and win on the 1.5B MLP and attention
#: weights (1536x17920 15.1 -> 12.7 us, 8960x1536 12.5 -> 11.1) and on 7B fc1 (48.3 -> 47.7; fc2 24.3 -> 25.3): the
#: engine's HiF4 rows +3.3% / +5.1% (1.5B W4A16 / ResQ) and +1.4% / +1.7% (7B)
#: (benchmarks/results/decode_h100_s52_sweep_1.5b.json, rollout_h100_s52_hif4_ab*.json). At 4 stages either format was
#: 1.5-1.65x slower than at 6: the ring's depth is what the loop waits on.
NATURAL_TILE_AT_64 = dict(WGS=1, MINB=3, XST=7)
#: ``MEGATRON_FP4_DECODE_NATURAL_TILE``'s keys: over every token bucket's tile
_NATURAL_ENV = natural_tile_override(os.environ.get("MEGATRON_FP4_DECODE_NATURAL_TILE") or "{}")
NATURAL_TILE.update(_NATURAL_ENV)


def natural_tile(config: Optional[dict], ntok: int) -> dict:
    """The tile a natural-order weight runs at ``ntok`` tokens (a token bucket: 8, 16, 32, 64): ``config``'s keys
    over the environment's (``MEGATRON_FP4_DECODE_NATURAL_TILE``), over :data:`NATURAL_TILE_AT_64`'s at 64 tokens,
    over :data:`NATURAL_TILE`'s."""
    return {**NATURAL_TILE, **(NATURAL_TILE_AT_64 if ntok == 64 else {}), **_NATURAL_ENV, **(config or {}),
            "NATURAL": 1}


def natural_layout() -> bool:
    """Whether decode weights (every format) are laid out in natural K order: ``MEGATRON_FP4_DECODE_LAYOUT`` "natural"
    (the default) or "permuted" (the layout of the per-size tiles, :data:`DECODE_TILES` / :data:`WGMMA_TILES`: faster
    at 8-16 tokens on the 7B MLP weights, slower from 32 on)."""
    layout = os.environ.get("MEGATRON_FP4_DECODE_LAYOUT", "natural")
    if layout not in _LAYOUTS:
        raise ValueError(f"MEGATRON_FP4_DECODE_LAYOUT={layout!r} is not valid; allowed values: "
                         f"{', '.join(map(repr, _LAYOUTS))}")
    return layout == "natural"


#: Token counts up to which :func:`megatron_fp4.kernels.dispatch.decode_matmul` prefers these kernels to the Triton one.
MAX_M = int(os.environ.get("MEGATRON_FP4_CUDA_DECODE_MAX_M", "64"))
_SOURCES = {"mma": "w4_decode.cu", "wgmma": "w4_wgmma.cu"}
_SYMBOLS = {"mma": "w4_decode_launch", "wgmma": "w4_wgmma_launch"}
_ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 11 + [ctypes.c_void_p]  # both launchers


def available() -> bool:
    """Whether the CUDA decode kernels can serve: a Hopper GPU (sm_90), nvcc to build them, not disabled by
    ``MEGATRON_FP4_CUDA_DECODE=0``, and no earlier build failure."""
    if not switch_on("MEGATRON_FP4_CUDA_DECODE") or any(map(_nvcc.build_failed, _SOURCES.values())):
        return False
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    return _nvcc.nvcc() is not None


def default_kernel(n: int, k: int) -> str:
    """The decode kernel for a weight ``[n, k]``: "wgmma" up to :data:`WGMMA_MAX_WEIGHT` values, else "mma" (at 9-16
    tokens :data:`LARGE_M16_TILES` overrides the latter)."""
    return "wgmma" if n * k <= WGMMA_MAX_WEIGHT else "mma"


def _choose(n: int, k: int, ntok: int, config: Optional[dict], fmt_id: int) -> tuple:
    """The kernel and tile override of one launch on a weight ``[n, k]``: ``config``'s KERNEL, else
    ``MEGATRON_FP4_DECODE_KERNEL``, else :data:`LARGE_M16_TILES` (no config given, a weight over
    :data:`WGMMA_MAX_WEIGHT`, 9-16 tokens), else :func:`default_kernel`."""
    kernel = (config or {}).get("KERNEL") or os.environ.get("MEGATRON_FP4_DECODE_KERNEL")
    if not kernel and config is None and ntok == 16 and n * k > WGMMA_MAX_WEIGHT:
        kernel, config = "wgmma", LARGE_M16_TILES[fmt_id]
    kernel = kernel or default_kernel(n, k)
    if kernel not in _SOURCES:
        raise ValueError(f"decode kernel {kernel!r} is not valid; allowed values: {', '.join(map(repr, _SOURCES))}")
    return kernel, config


def _tile(kernel: str, fmt_id: int, ntok: int, config: Optional[dict]) -> dict:
    cfg = dict((WGMMA_TILES if kernel == "wgmma" else DECODE_TILES)[(fmt_id, ntok)])
    cfg.update({k: v for k, v in (config or {}).items() if k != "KERNEL"})
    return cfg


def _defines(kernel: str, fmt_id: int, wide: bool, ntok: int, cfg: dict) -> dict:
    if kernel == "wgmma":
        return dict(FMT=fmt_id, WIDE=int(wide), NTOK=ntok, WGS=cfg["WGS"], DEPTH=cfg["DEPTH"], XST=cfg["XST"],
                    MINB=cfg["MINB"], PRODUCER=int(cfg["PRODUCER"]), LEAN=int(cfg.get("LEAN", 0)),
                    XPAIR=int(cfg.get("XPAIR", 0)), WRING=int(cfg.get("WRING", 0)), NATURAL=int(cfg.get("NATURAL", 0)),
                    CLUSTER=int(cfg.get("CLUSTER", 0)), WTMA=int(cfg.get("WTMA", 0)), WJIT=int(cfg.get("WJIT", 0)),
                    SUBN=int(bool(cfg.get("SUBN")) and fmt_id == 0 and bool(cfg.get("NATURAL"))))
    return dict(FMT=fmt_id, WIDE=int(wide), NT=ntok // 8, SPW=cfg["SPW"], DEPTH=cfg["DEPTH"], WARPS=cfg["WARPS"])


def build(kernel: str, fmt_id: int, wide: bool, ntok: int, cfg: dict):
    """The compiled launcher of one configuration (built on first use; returns the ctypes function)."""
    return _nvcc.launcher(_SOURCES[kernel], _defines(kernel, fmt_id, wide, ntok, cfg), _SYMBOLS[kernel], _ARGTYPES)


@functools.lru_cache(maxsize=None)
def _blocks_per_sm(defines: tuple, device: int) -> int:
    fn = _nvcc.launcher(_SOURCES["wgmma"], dict(defines), "w4_wgmma_blocks_per_sm", [ctypes.POINTER(ctypes.c_int)])
    blocks = ctypes.c_int(0)
    with torch.cuda.device(device):
        err = fn(ctypes.byref(blocks))
    if err or blocks.value < 1:
        raise RuntimeError(f"w4_wgmma_blocks_per_sm failed (cudaError {err}, {blocks.value} blocks) for {dict(defines)}")
    return blocks.value


def blocks_per_sm(fmt_id: int, wide: bool, ntok: int, cfg: dict, device: int = 0) -> int:
    """How many blocks of the wgmma kernel built for ``cfg`` (a whole tile, as :func:`_tile` returns it) an SM of CUDA
    ``device`` runs at once: the occupancy API on the built kernel (registers, shared memory, threads). It may exceed
    the tile's MINB, ``__launch_bounds__``' floor: the default tile at 8-16 tokens, budgeted for two, runs three
    (66 registers). Cached per configuration and device."""
    return _blocks_per_sm(tuple(sorted(_defines("wgmma", fmt_id, wide, ntok, cfg).items())), device)


def prebuild(tiles: Optional[list] = None, ntoks=(16, 64), workers: int = 0) -> int:
    """Compile configurations in parallel ahead of use: both kernels' default tiles and :data:`NATURAL_TILE` (the
    default layout's) for both formats, the wide MXFP4 variant and every token bucket, plus ``tiles`` (dicts with
    KERNEL and its tile keys; with NATURAL=1, keys over NATURAL_TILE's) for token buckets ``ntoks``; natural HiF4 tiles
    for both of its layouts (:attr:`DecodeWeight.subnormal`). Returns how many."""
    def job(kernel, f, w, m, tile):  # keyed by what reaches nvcc (a SPLIT override compiles nothing new)
        return kernel, tuple(sorted(_defines(kernel, f, bool(w), m, _tile(kernel, f, m, tile)).items()))

    jobs = {job(kernel, f, w, m, None) for kernel in _SOURCES for f, w in ((0, 0), (1, 0), (1, 1))
            for m in (8, 16, 32, 64)}
    jobs |= {job("wgmma", f, w, 16, LARGE_M16_TILES[f]) for f, w in ((0, 0), (1, 0), (1, 1))}
    jobs |= {job("wgmma", f, w, m, dict(natural_tile(None, m), SUBN=sub)) for f, w in ((0, 0), (1, 0), (1, 1))
             for m in (8, 16, 32, 64) for sub in (0, 1)}
    for t in tiles or []:
        for m in ntoks:  # a natural tile's KERNEL comes from NATURAL_TILE
            tile = natural_tile(t, m) if t.get("NATURAL") else t
            jobs |= {job(tile["KERNEL"], f, 0, m, dict(tile, SUBN=sub)) for f in (0, 1) for sub in (0, 1)}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 4) as ex:
        list(ex.map(lambda j: _nvcc.compile_library(_SOURCES[j[0]], dict(j[1])), sorted(jobs)))
    return len(jobs)


#: Blocks an SM overlaps at no cost to each other (:func:`_balanced_split`): a wave of resident blocks takes at least
#: this many blocks' time, however few of them the SM holds.
SPLIT_OVERLAP = 2.5


@functools.lru_cache(maxsize=None)
def _balanced_split(row_blocks: int, chunks: int, sms: int, resident: int, most: int = 0, tail: int = 16) -> int:
    """Split-K for ``row_blocks`` x split blocks on ``sms`` SMs that each run ``resident`` blocks at once: the fewest
    splits (at most ``most`` when given) that minimize max(blocks on the busiest SM, :data:`SPLIT_OVERLAP` x waves)
    x (chunks per block + ``tail``, its pipeline fill and epilogue, in chunks). An SM's blocks share its memory
    throughput, but up to about 2.5 of them overlap (one alone keeps too few bytes in flight), so a wave of fewer
    blocks than that per SM is not proportionally faster, and a second, nearly empty wave costs as much as the first.
    The epilogue adds the block's outputs atomically (or stores its split's partial sums), so its cost grows with the
    tokens: :func:`w4_decode` passes :func:`_split_tail`. Fitted to session 54's sweep of forced splits on an H100
    (benchmarks/results/decode_h100_s54_split_*.json: the 7B and 1.5B MLP and attention weights at 16, 32 and 64
    tokens, both formats): on those 36 cases its picks are the measured best splits or within 3% of them."""
    def cost(split):
        cps = -(-chunks // split)
        blocks = row_blocks * -(-chunks // cps)
        return max(-(-blocks // sms), SPLIT_OVERLAP * -(-blocks // (resident * sms))) * (cps + tail)

    return min(range(1, min(chunks, most or chunks) + 1), key=lambda sp: (cost(sp), sp))


def _split_tail(ntok: int) -> int:
    """:func:`_balanced_split`'s ``tail`` at ``ntok`` tokens: ``ntok`` chunks (16 at 16 tokens: any tail from 16 to 32
    fits session 54's sweep; 32 at 32 tokens; 64 at 64, where 24-64 fit it)."""
    return ntok


def _ntok(M: int) -> int:
    return 8 if M <= 8 else 16 if M <= 16 else 32 if M <= 32 else 64


def w4_decode(x: torch.Tensor, dw: DecodeWeight, config: Optional[dict] = None,
              out_dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    """``x [M, K] . deq(W)^T`` for BF16 ``x`` (M <= 64) and a :class:`DecodeWeight` (CUDA, sm_90), accumulated in
    fp32, returned as ``out_dtype`` (bfloat16: the fp32 sums rounded to nearest even, stored so by the kernel itself
    where each output is stored once; otherwise cast from fp32). ``out_dtype`` None: the fp32 sums as the kernel
    stores them, ``[splits, M, N]``, each split's partial sums after a split-K (no atomics, no zero-filled output, no
    cast kernel; the reader adds them in order, so the result is deterministic: the fused decode-step kernels of
    :mod:`megatron_fp4.kernels.decode_ops`). A split-K rounded to a 16-bit ``out_dtype`` stores its partial sums and
    one :func:`~megatron_fp4.kernels.decode_ops.split_sum` kernel adds them in order and rounds: two launches,
    deterministic, where the atomics took three (zero-fill, GEMM, cast). ``config``: a tile override (``KERNEL``
    "wgmma" | "mma" and that kernel's tile keys, SPLIT to force split-K)."""
    M = x.shape[0]
    if not 0 < M <= 64:
        raise ValueError(f"w4_decode is the decode kernel (0 < M <= 64), got M={M}")
    kc = dw.chunks * 64
    if x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    if x.shape[1] != kc:
        if x.shape[1] > kc:
            raise ValueError(f"w4_decode: activation K {x.shape[1]} > weight K {kc}")
        x = torch.nn.functional.pad(x, (0, kc - x.shape[1]))
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.contiguous()
    ntok = _ntok(M)
    if dw.natural:  # only NATURAL tiles read this layout (and they read no other)
        if (config or {}).get("KERNEL", "wgmma") != "wgmma":
            raise ValueError(f"w4_decode: a natural-order weight needs the wgmma kernel, got {config}")
        # (SUBN: the weight's, not a tile's choice)
        config = dict(natural_tile(config, ntok), SUBN=int(dw.subnormal))
    elif (config or {}).get("NATURAL"):
        raise ValueError("w4_decode: NATURAL=1 tiles read weights made by to_decode_layout(natural=True)")
    kernel, config = _choose(dw.n, dw.k, ntok, config, dw.fmt_id)
    cfg = _tile(kernel, dw.fmt_id, ntok, config)
    fn = build(kernel, dw.fmt_id, dw.wide, ntok, cfg)
    S, C = dw.slabs, dw.chunks
    sms = sm_count(x.device)
    cluster = kernel == "wgmma" and bool(cfg.get("CLUSTER"))  # split-K through a cluster: at most 8 splits
    if kernel == "wgmma":
        row_blocks = -(-S // (4 * cfg["WGS"]))
        most = 8 if cluster else C
        tail = 2 if cluster else _split_tail(ntok)  # a cluster adds its partial sums in shared memory
        split = min(cfg.get("SPLIT") or _balanced_split(
            row_blocks, C, sms, blocks_per_sm(dw.fmt_id, dw.wide, ntok, cfg, x.device.index), most, tail), most)
    else:
        row_blocks = -(-S // (cfg["WARPS"] * cfg["SPW"]))
        split = cfg.get("SPLIT") or max(1, min(C, round(cfg["PER_SM"] * sms / row_blocks)))
    cps = -(-C // split)
    split = -(-C // cps)
    atomic = split > 1 and not cluster  # partial sums added atomically into a zeroed fp32 output...
    as_stored = out_dtype is None
    reduce = atomic and not as_stored and out_dtype != torch.float32  # (rounded by split_sum)
    partial = atomic and (as_stored or reduce)  # ... or stored per split, [split, M, N], for the reader to sum
    obf16 = out_dtype == torch.bfloat16 and not atomic
    out = (torch.zeros if atomic and not partial else torch.empty)(
        (split, M, dw.n) if partial else (M, dw.n), dtype=torch.bfloat16 if obf16 else torch.float32, device=x.device)
    err = fn(dw.codes.data_ptr(), dw.meta.data_ptr(), x.data_ptr(), out.data_ptr(), M, dw.n, S, C, x.stride(0),
             out.stride(-2), split, cps, int(obf16), int(partial), int(pdl_enabled()),
             torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        what = (f"a TMA map (CUresult {err - 1000})" if err >= 1000 else
                "no cuTensorMapEncodeTiled in the driver" if err == 999 else f"cudaError {err}")
        raise RuntimeError(f"w4_decode launch failed ({what})")
    if dw.nan_rows is not None:
        out.index_fill_(-1, dw.nan_rows, float("nan"))
    if reduce:
        from megatron_fp4.kernels.decode_ops import split_sum

        return split_sum(out, out_dtype)
    if as_stored:
        return out if partial else out.unsqueeze(0)
    return out.to(out_dtype)
