"""HiFloat4 (HiF4): 64-value units with an E6M2 scale and two 1-bit micro-exponent levels (SPEC §2.1).

Metadata per unit, 4 bytes: [E6M2 code, E1_8 bits (group j of 8 values = bit j), E1_16 bits of groups 0-7,
E1_16 bits of groups 8-15] (LSB first). Elements are S1P2 sign-magnitude nibbles: bit 3 sign, bits 0-2 k (k/4).

NaN/Inf: a unit that holds a NaN or an infinity is stored with the E6M2 NaN code 0xFF (element codes and
micro-exponents zero) and dequantizes to all-NaN; infinities are treated as NaN because HiF4 has no infinity.
Rounding of |x|/scale to k/4 is exact round-half-away-from-zero (``floor(4m + 0.5)`` evaluated without the
fp32 rounding of the ``+ 0.5``).

Stochastic rounding (gradients, SPEC §3) must be unbiased, which the SPEC §2.1 encoder is not: its thresholds
(4, 2) let scaled magnitudes reach just under 2 while the largest element is 1.75, so the top of a group would
always round down. The stochastic encoder therefore picks a never-saturating (still valid) HiF4 encoding: E6M2 is
vmax/7 rounded UP to the E6M2 grid, r = 1/E6M2 in fp32, micro-exponent thresholds 3.5 and 1.75, so 4m <= 7
everywhere; then k = floor(4m) + [u < frac(4m)]. Round-to-nearest is exactly SPEC §2.1.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_fp4.formats.base import Format
from megatron_fp4.formats.packing import bf16_rne

#: bf16(1/7): the scale factor that maps a unit's max magnitude to the top of the element range.
INV7_BF16 = 0.142578125
E6M2_BIAS = 48
E6M2_MIN = 2.0 ** -48
E6M2_MAX = 49152.0  # 2^15 * 1.5
E6M2_NAN_CODE = 0xFF
UNIT = 64


def _bit_weights(device) -> torch.Tensor:
    return torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)


def _to_bits_byte(bits: torch.Tensor) -> torch.Tensor:
    """bool [..., 8] -> uint8 [...] with element j in bit j."""
    return (bits.to(torch.uint8) * _bit_weights(bits.device)).sum(-1, dtype=torch.uint8)


def _from_bits_byte(byte: torch.Tensor) -> torch.Tensor:
    """uint8 [...] -> uint8 0/1 [..., 8] with bit j at position j."""
    return (byte.unsqueeze(-1) & _bit_weights(byte.device)).ne(0).to(torch.uint8)


def e6m2_round(sf: torch.Tensor, up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Round positive fp32 scales (already in [2^-48, 49152]) to E6M2, to nearest-even (or up, ``up=True``):
    returns (value fp32, code uint8)."""
    _, ex = torch.frexp(sf)
    e = ex.to(torch.int32) - 1  # floor(log2 sf)
    scaled = sf * torch.exp2((2 - e).to(torch.float32))  # in [4, 8)
    q = torch.ceil(scaled) if up else torch.round(scaled)  # in [4, 8], round: ties to even
    carry = q == 8
    e = e + carry.to(torch.int32)
    q = torch.where(carry, torch.full_like(q, 4.0), q)
    value = q * torch.exp2((e - 2).to(torch.float32))
    code = ((e + E6M2_BIAS) * 4 + (q.to(torch.int32) - 4)).to(torch.uint8)
    return value, code


def e6m2_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of E6M2 codes (0xFF -> NaN)."""
    c = code.to(torch.int32)
    value = (1.0 + (c & 3).to(torch.float32) * 0.25) * torch.exp2(((c >> 2) - E6M2_BIAS).to(torch.float32))
    return torch.where(c == E6M2_NAN_CODE, torch.full_like(value, float("nan")), value)


class HiF4Format(Format):
    """HiFloat4: 4.5 bits/value, three-level hierarchical scaling."""

    name = "hif4"
    block_size = UNIT
    bits_per_value = 4.5
    scale_bytes = 4

    def _unit_codes(self, xb: torch.Tensor, rounding: str, generator: Optional[torch.Generator]):
        """The arithmetic shared by quantize and fake_quantize: per unit (E6M2 value and code, E1_8, E1_16 bools,
        bad = NaN/Inf unit) and per element the magnitude code k (fp32, 0..7) and group shift."""
        R, B, _ = xb.shape
        a = xb.abs()
        v16 = a.view(R, B, 16, 4).amax(-1)  # amax propagates NaN and Inf into the unit maxima
        v8 = v16.view(R, B, 8, 2).amax(-1)
        vmax = v8.amax(-1)
        bad = ~torch.isfinite(vmax)  # [R, B] units holding NaN/Inf
        if bool(bad.any()):  # keep the arithmetic of the other units clean; bad units are overwritten later
            a = a.masked_fill(bad.unsqueeze(-1), 0.0)
            v16 = v16.masked_fill(bad.unsqueeze(-1), 0.0)
            v8 = v8.masked_fill(bad.unsqueeze(-1), 0.0)
            vmax = vmax.masked_fill(bad, 0.0)
        stochastic = rounding == "stochastic"
        if stochastic:  # headroom encoding (see the module docstring): never saturates, so SR is unbiased
            e6m2, e6m2_code = e6m2_round((vmax / 7.0).clamp(E6M2_MIN, E6M2_MAX), up=True)
            r = 1.0 / e6m2
            t8, t16 = 3.5, 1.75
        else:
            sf = bf16_rne(vmax * INV7_BF16).clamp(E6M2_MIN, E6M2_MAX)
            e6m2, e6m2_code = e6m2_round(sf)
            r = bf16_rne(1.0 / e6m2)
            t8, t16 = 4.0, 2.0
        e1_8 = (v8 * r.unsqueeze(-1)) >= t8  # [R, B, 8]
        e1_8_per16 = e1_8.repeat_interleave(2, dim=-1).to(torch.float32)  # [R, B, 16]
        e1_16 = (v16 * r.unsqueeze(-1)) * torch.exp2(-e1_8_per16) >= t16
        shift = e1_8_per16 + e1_16.to(torch.float32)  # [R, B, 16]
        m4 = (a.view(R, B, 16, 4) * r.view(R, B, 1, 1)) * torch.exp2(2.0 - shift).unsqueeze(-1)  # 4m
        k = torch.floor(m4)
        frac = m4 - k
        if stochastic:
            u = torch.rand(m4.shape, generator=generator, device=m4.device, dtype=torch.float32)
            k += (u < frac).to(k.dtype)
        else:
            k += (frac >= 0.5).to(k.dtype)
        k.clamp_(max=7.0)
        return e6m2, e6m2_code, e1_8, e1_16, shift, k, bad

    def _encode(self, xb: torch.Tensor, rounding: str, generator: Optional[torch.Generator]):
        e6m2, e6m2_code, e1_8, e1_16, _, k, bad = self._unit_codes(xb, rounding, generator)
        codes = k.view(xb.shape).to(torch.uint8) | (torch.signbit(xb).to(torch.uint8) << 3)
        if bool(bad.any()):
            badx = bad.unsqueeze(-1)
            codes = codes.masked_fill(badx, 0)
            e6m2_code = e6m2_code.masked_fill(bad, E6M2_NAN_CODE)
            e1_8 = e1_8.masked_fill(badx, False)
            e1_16 = e1_16.masked_fill(badx, False)
        meta = torch.stack(
            (e6m2_code, _to_bits_byte(e1_8), _to_bits_byte(e1_16[..., :8]), _to_bits_byte(e1_16[..., 8:])), dim=-1)
        return codes, meta, None

    def _fake_quantize_blocks(self, xb: torch.Tensor, rounding: str, generator: Optional[torch.Generator]
                              ) -> torch.Tensor:
        """dequantize(encode(xb)) computed directly from the magnitudes (no byte packing): same values."""
        e6m2, _, _, _, shift, k, bad = self._unit_codes(xb, rounding, generator)
        group_scale = torch.exp2(shift - 2.0) * e6m2.unsqueeze(-1)  # (k / 4) * 2^shift * E6M2
        val = (k * group_scale.unsqueeze(-1)).view(xb.shape).copysign(xb)
        if bool(bad.any()):
            val = val.masked_fill(bad.unsqueeze(-1), float("nan"))
        return val

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor, global_scale: Optional[torch.Tensor]):
        R, B, _ = codes.shape
        e6m2 = e6m2_decode(scales[..., 0])  # [R, B]
        e1_8 = _from_bits_byte(scales[..., 1]).repeat_interleave(2, dim=-1)  # [R, B, 16]
        e1_16 = torch.cat((_from_bits_byte(scales[..., 2]), _from_bits_byte(scales[..., 3])), dim=-1)
        group_scale = torch.exp2((e1_8 + e1_16).to(torch.float32)) * e6m2.unsqueeze(-1)  # [R, B, 16]
        mag = (codes & 7).to(torch.float32) * 0.25
        val = mag.view(R, B, 16, 4) * group_scale.unsqueeze(-1)
        val = val.view(R, B, UNIT)
        return torch.where((codes & 8).bool(), -val, val)
