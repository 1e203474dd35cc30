"""Bit-level helpers shared by the formats: nibble packing, E2M1 rounding, bf16 rounding (SPEC §2.4)."""

from __future__ import annotations

import torch

#: E2M1 magnitudes indexed by their 3-bit code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# Midpoints between neighbouring E2M1 magnitudes; a tie goes to the even code, i.e. down at 0.25, 1.25, 2.5, 5.0
# (codes 0, 2, 4, 6 are even) and up at 0.75, 1.75, 3.5.
_E2M1_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_E2M1_TIE_UP = (0.75, 1.75, 3.5)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (uint8, last dim even) two per byte: element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dim must be even to pack nibbles, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: uint8 [..., n] -> uint8 codes [..., 2n]."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def bf16_rne(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest bfloat16 (ties to even), returned as fp32."""
    return x.to(torch.bfloat16).to(torch.float32)


def e2m1_round_nearest(a: torch.Tensor) -> torch.Tensor:
    """3-bit E2M1 magnitude code of non-negative fp32 ``a``: round to nearest even, saturating at 6."""
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for t in _E2M1_TIE_DOWN:
        code += (a > t).to(torch.uint8)
    for t in _E2M1_TIE_UP:
        code += (a >= t).to(torch.uint8)
    return code


def e2m1_round_stochastic(a: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """3-bit E2M1 magnitude code of non-negative fp32 ``a`` rounded stochastically (unbiased below 6)."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=a.device)
    a = a.clamp(max=E2M1_MAX)
    lo = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 6)
    lo_v = grid[lo]
    hi_v = grid[lo + 1]
    p_up = (a - lo_v) / (hi_v - lo_v)
    u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
    return (lo + (u < p_up).to(lo.dtype)).to(torch.uint8)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 magnitude of 3-bit E2M1 codes."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    return table[code.long()]
