"""NVFP4 (comparison format): 16 E2M1 values per E4M3 block scale, plus an fp32 per-tensor scale (SPEC §2.3).

g = 448 * 6 / amax_tensor (g = 1 for an all-zero tensor); d = e4m3_rne(block_amax * g / 6) (clamped to 448);
elements = E2M1 round-to-nearest-even of x * g / d, clamped to +-6; dequant = q * d / g.
The stored global scale is g. NaN/Inf anywhere makes the tensor scale NaN, so everything dequantizes to NaN.
Stochastic rounding (gradients) rounds d UP to E4M3 instead, so no element clips and the rounding is unbiased.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_fp4.formats.base import Format
from megatron_fp4.formats.packing import e2m1_decode, e2m1_round_nearest, e2m1_round_stochastic

E4M3_MAX = 448.0
E2M1_MAX = 6.0


class NVFP4Format(Format):
    """NVFP4: 4.5 bits/value (one E4M3 scale per 16 values) + one fp32 scale per tensor."""

    name = "nvfp4"
    block_size = 16
    bits_per_value = 4.5
    scale_bytes = 1
    has_global_scale = True

    def _encode(self, xb: torch.Tensor, rounding: str, generator: Optional[torch.Generator]):
        a = xb.abs()
        block_amax = a.amax(-1)
        amax = block_amax.max() if block_amax.numel() else torch.zeros((), device=xb.device)
        if not torch.isfinite(amax):
            g = torch.tensor(float("nan"), device=xb.device)
        elif amax == 0:
            g = torch.ones((), device=xb.device)
        else:
            g = (E4M3_MAX * E2M1_MAX) / amax
        d_exact = (block_amax * g / E2M1_MAX).clamp(max=E4M3_MAX)
        d8 = d_exact.to(torch.float8_e4m3fn)
        d = d8.to(torch.float32)
        if rounding == "stochastic":  # round the block scale up so that no element exceeds 6
            below = d < d_exact
            if bool(below.any()):
                bits = d8.view(torch.uint8)
                d8 = torch.where(below, bits + 1, bits).view(torch.float8_e4m3fn)
                d = d8.to(torch.float32)
        safe_d = torch.where(d > 0, d, torch.ones_like(d))
        scaled = (a * g) / safe_d.unsqueeze(-1)
        scaled = torch.where((d > 0).unsqueeze(-1) & torch.isfinite(scaled), scaled,
                             torch.zeros((), device=xb.device)).clamp(max=E2M1_MAX)
        if rounding == "stochastic":
            mag = e2m1_round_stochastic(scaled, generator)
        else:
            mag = e2m1_round_nearest(scaled)
        codes = mag | (torch.signbit(xb).to(torch.uint8) << 3)
        return codes, d8.view(torch.uint8).unsqueeze(-1), g.to(torch.float32).reshape(())

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor, global_scale: Optional[torch.Tensor]):
        d = scales[..., 0].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
        val = (e2m1_decode(codes & 7) * d.unsqueeze(-1)) / global_scale
        return torch.where((codes & 8).bool(), -val, val)
