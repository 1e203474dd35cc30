"""OCP MXFP4 (Microscaling v1.0): 32 E2M1 values sharing one E8M0 power-of-two scale (SPEC §2.2).

Scale: X = floor(log2(amax)) - 2 ("floor", the OCP default, bit-exact with torchao's MX reference) or the
NVIDIA "rceil" variant X = ceil(log2(amax / 6)) (never clips), clamped to [-127, 127]; stored biased by 127.
Elements: round-to-nearest-even E2M1 of x / 2^X, saturating at +-6, sign kept (also for values rounding to 0).
Stochastic rounding (gradients) always uses the rceil scale: with the floor scale the top of a block would
saturate at 6 and round down every time, which biases it.
NaN/Inf: a block whose amax is NaN or Inf gets the NaN scale code 255 and dequantizes to all-NaN.
(torchao maps an Inf block to a finite scale and, for blocks with X = -127, scales elements by 2^-126 instead of
2^-127; this reference follows the OCP definition in both cases.)
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_fp4.formats.base import Format
from megatron_fp4.formats.packing import e2m1_decode, e2m1_round_nearest, e2m1_round_stochastic

E8M0_BIAS = 127
E8M0_NAN_CODE = 255
SCALE_MODES = ("floor", "rceil")


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """Exact floor(log2(a)) of positive finite fp32 values as int32 (subnormals included)."""
    _, ex = torch.frexp(a)
    return ex.to(torch.int32) - 1


class MXFP4Format(Format):
    """MXFP4: 4.25 bits/value, one E8M0 scale per 32 values."""

    block_size = 32
    bits_per_value = 4.25
    scale_bytes = 1

    def __init__(self, scale_mode: str = "floor"):
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode={scale_mode!r} is not valid; allowed values: 'floor', 'rceil'")
        self.scale_mode = scale_mode
        self.name = "mxfp4" if scale_mode == "floor" else "mxfp4_rceil"

    def _encode(self, xb: torch.Tensor, rounding: str, generator: Optional[torch.Generator]):
        a = xb.abs()
        amax = a.amax(-1)  # NaN if any NaN
        bad = ~torch.isfinite(amax)
        safe_amax = torch.where(bad | (amax == 0), torch.ones_like(amax), amax)
        x_exp = floor_log2(safe_amax) - 2
        if self.scale_mode == "rceil" or rounding == "stochastic":
            x_exp = x_exp + (safe_amax * torch.exp2(-x_exp.to(torch.float32)) > 6.0).to(torch.int32)
        x_exp = torch.where(amax == 0, torch.full_like(x_exp, -E8M0_BIAS), x_exp).clamp(-E8M0_BIAS, E8M0_BIAS)
        scaled = a * torch.exp2(-x_exp.to(torch.float32)).unsqueeze(-1)
        scaled = torch.where(torch.isfinite(scaled), scaled, torch.zeros((), device=a.device))
        if rounding == "stochastic":
            mag = e2m1_round_stochastic(scaled, generator)
        else:
            mag = e2m1_round_nearest(scaled)
        codes = mag | (torch.signbit(xb).to(torch.uint8) << 3)
        scale_code = (x_exp + E8M0_BIAS).to(torch.uint8)
        if bad.any():
            codes = codes.masked_fill(bad.unsqueeze(-1), 0)
            scale_code = scale_code.masked_fill(bad, E8M0_NAN_CODE)
        return codes, scale_code.unsqueeze(-1), None

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor, global_scale: Optional[torch.Tensor]):
        s = scales[..., 0].to(torch.int32)
        scale = torch.exp2((s - E8M0_BIAS).to(torch.float32))
        scale = torch.where(s == E8M0_NAN_CODE, torch.full_like(scale, float("nan")), scale)
        val = e2m1_decode(codes & 7) * scale.unsqueeze(-1)
        return torch.where((codes & 8).bool(), -val, val)
