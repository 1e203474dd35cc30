"""HiF4 is bit-exact with the SPEC §2.1 recipe: checked against a scalar, loop-based transcription of it."""

import math
import struct

import numpy as np
import pytest
import torch

from megatron_fp4.formats import get_format
from megatron_fp4.formats.hif4 import E6M2_NAN_CODE, e6m2_decode, e6m2_round

F32 = np.float32
HIF4 = get_format("hif4")

# --- an independent scalar transcription of SPEC §2.1 (numpy float32 scalars, Python loops) ------------------


def _bf16_rne(v: np.float32) -> np.float32:
    bits = struct.unpack("<I", struct.pack("<f", float(v)))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return F32(struct.unpack("<f", struct.pack("<I", bits))[0])


def spec_quantize_unit(unit):
    """Returns (e6m2 value, e1_8 list, e1_16 list, k list, dequant list) for one 64-value unit."""
    x = [F32(v) for v in unit]
    a = [abs(v) for v in x]
    v16 = [max(a[4 * j:4 * j + 4]) for j in range(16)]
    v8 = [max(v16[2 * j], v16[2 * j + 1]) for j in range(8)]
    vmax = max(v8)
    sf = _bf16_rne(F32(vmax * F32(0.142578125)))
    sf = min(max(float(sf), 2.0 ** -48), 49152.0)
    e = math.floor(math.log2(sf))
    q = round(sf * 2.0 ** (2 - e))  # Python round: half to even
    e6m2 = q * 2.0 ** (e - 2)
    r = _bf16_rne(F32(1.0) / F32(e6m2))
    e1_8 = [1 if F32(v8[j] * r) >= 4 else 0 for j in range(8)]
    e1_16 = [1 if F32(F32(v16[j] * r) * F32(2.0 ** -e1_8[j // 2])) >= 2 else 0 for j in range(16)]
    ks, deq = [], []
    for i, v in enumerate(x):
        s = e1_8[i // 8] + e1_16[i // 4]
        m = F32(F32(a[i] * r) * F32(2.0 ** -s))
        m4 = 4 * float(m)  # exact
        k = math.floor(m4) + (1 if m4 - math.floor(m4) >= 0.5 else 0)
        k = min(k, 7)
        ks.append(k)
        deq.append(math.copysign(k / 4 * 2.0 ** s * e6m2, float(v)))
    return e6m2, e1_8, e1_16, ks, deq


U = ([0.1, -3.0, 7.5, 0.001, 0.6, -0.25, 1.2, 0.05, 0.3, -0.2, 0.15, 0.02, 0.9, 0.4, -0.7, 0]
     + [0.05, -0.1, 0.15, -0.2, 0.25, -0.05, 0.1, -0.15] * 6)


def _meta_bits(scales):
    e1_8 = [(int(scales[1]) >> j) & 1 for j in range(8)]
    e1_16 = [(int(scales[2 + j // 8]) >> (j % 8)) & 1 for j in range(16)]
    return e1_8, e1_16


def test_worked_example_u():
    x = torch.tensor(U, dtype=torch.float32)
    qt = HIF4.quantize(x)
    assert qt.scales.shape == (1, 4)
    assert int(qt.scales[0, 0]) == 0xC0  # E6M2 = 1.0
    e1_8, e1_16 = _meta_bits(qt.scales[0])
    assert e1_8 == [1, 0, 0, 0, 0, 0, 0, 0]
    assert e1_16 == [1] + [0] * 15
    d = qt.dequantize()
    assert d[:16].tolist() == [0, -3, 7, 0, 0.5, -0.5, 1, 0, 0.25, -0.25, 0.25, 0, 1, 0.5, -0.75, 0]
    assert d[16:24].tolist() == [0, -0.0, 0.25, -0.25, 0.25, -0.0, 0, -0.25]
    assert torch.signbit(d[17]) and torch.signbit(d[21])  # sign kept on values that round to zero
    mse = float(((d - x) ** 2).mean())
    assert abs(mse - 1.090e-2) < 5e-6
    assert int(((d == 0) & (x != 0)).sum()) == 28


def _random_units(n, gen):
    """Units mixing magnitudes, exact ties, zeros, outliers and signed zeros."""
    units = []
    for i in range(n):
        scale = 2.0 ** float(torch.randint(-40, 30, (1,), generator=gen))
        u = torch.randn(64, generator=gen) * scale
        kind = i % 5
        if kind == 1:  # exact ties in the element grid relative to a power-of-two scale
            u = (torch.randint(0, 32, (64,), generator=gen).float() / 8 - 2) * scale
        elif kind == 2:  # outlier-heavy
            u[torch.randint(0, 64, (3,), generator=gen)] *= 300
        elif kind == 3:  # sparse with zeros and negative zeros
            u = u * (torch.rand(64, generator=gen) < 0.3)
            u[5] = -0.0
        units.append(u)
    return torch.stack(units)


def test_matches_scalar_spec_transcription():
    gen = torch.Generator().manual_seed(1)
    units = _random_units(150, gen)
    qt = HIF4.quantize(units)
    deq = qt.dequantize()
    codes = qt.codes
    meta = qt.scales.reshape(-1, 4)
    for i in range(units.shape[0]):
        e6m2, e1_8, e1_16, ks, ref = spec_quantize_unit(units[i].tolist())
        assert float(e6m2_decode(meta[i, 0])) == e6m2, i
        assert _meta_bits(meta[i]) == (e1_8, e1_16), i
        lo = (codes[i] & 0xF).tolist()
        hi = (codes[i] >> 4).tolist()
        got_k = [c & 7 for pair in zip(lo, hi) for c in pair]
        assert got_k == ks, i
        assert deq[i].tolist() == ref, i


def test_every_e6m2_code_round_trips():
    codes = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8)
    values = e6m2_decode(codes)
    assert torch.isnan(values[E6M2_NAN_CODE])
    finite = values[:E6M2_NAN_CODE]
    assert float(finite[0]) == 2.0 ** -48
    assert float(finite[-1]) == 49152.0
    assert bool((finite[1:] > finite[:-1]).all())  # strictly increasing
    v, c = e6m2_round(finite)
    assert torch.equal(v, finite)
    assert torch.equal(c, codes[:E6M2_NAN_CODE])


def test_e6m2_rounding_ties_to_even_and_carries():
    # 1.125 is halfway between 1.0 (m=0, even) and 1.25 (m=1): goes to 1.0; 1.375 -> 1.5 (m=2, even).
    # 1.875 lies between 1.75 and 2.0 and ties to the even 2.0, carrying into the exponent.
    sf = torch.tensor([1.125, 1.375, 1.875, 1.9375, 3.75])
    v, c = e6m2_round(sf)
    assert v.tolist() == [1.0, 1.5, 2.0, 2.0, 4.0]
    assert c.tolist() == [0xC0, 0xC2, 0xC4, 0xC4, 0xC8]


def test_every_element_code():
    # vmax = 1.75 -> sf = bf16(0.2495) -> E6M2 = 0.25, r = 4 -> E1_8 = E1_16 = 1: group scale 0.25 * 4 = 1,
    # so x = k/4 encodes as magnitude code k, and -x sets the sign bit (bit 3), -0.0 included.
    x = torch.zeros(64)
    order = [0, 1, 2, 7, 3, 4, 5, 6]  # every group of 4 holds a value >= 1, so each has E1_16 = 1
    x[:8] = torch.tensor(order) / 4
    x[8:16] = -x[:8]
    qt = HIF4.quantize(x)
    assert float(e6m2_decode(qt.scales[0, 0])) == 0.25
    codes = torch.stack((qt.codes & 0xF, qt.codes >> 4), -1).flatten()
    assert codes[:16].tolist() == order + [8 + k for k in order]
    assert torch.equal(qt.dequantize()[:16], x[:16])
    # decoding: every (sign, k) code is sign * k/4 * group scale
    for c in range(16):
        packed = torch.full((32,), c | (c << 4), dtype=torch.uint8)
        fake = HIF4.quantize(x)
        fake.codes = packed
        d = fake.dequantize()
        assert float(d[0]) == (-1 if c & 8 else 1) * (c & 7) / 4


def test_ties_round_half_away_from_zero():
    # E6M2 = 1 (vmax 7), no micro-exponents on group 2: m = |x| exactly.
    x = torch.zeros(64)
    x[0] = 7.0
    x[8:12] = torch.tensor([0.125, -0.375, 0.625, -1.125])  # 4m = 0.5, 1.5, 2.5, 4.5
    d = HIF4.fake_quantize(x)
    assert d[8:12].tolist() == [0.25, -0.5, 0.75, -1.25]


def test_saturation_k8_to_7():
    x = torch.zeros(64)
    x[0] = 7.9  # m = 7.9/4 after E1_8 = E1_16 = 1 -> 4m = 7.9 -> k = 8 -> 7
    qt = HIF4.quantize(x)
    assert int(qt.codes[0] & 7) == 7
    e1_8, e1_16 = _meta_bits(qt.scales[0])
    assert (e1_8[0], e1_16[0]) == (1, 1)
    assert float(qt.dequantize()[0]) == 7.0 / 4 * 4 * float(e6m2_decode(qt.scales[0, 0]))


def test_all_zero_unit():
    x = torch.zeros(2, 64)
    x[1, 3] = -0.0
    qt = HIF4.quantize(x)
    assert qt.scales.shape == (2, 1, 4)
    assert qt.scales[:, 0, 0].tolist() == [0, 0]  # E6M2 = 2^-48
    assert float(e6m2_decode(qt.scales[0, 0, 0])) == 2.0 ** -48
    assert torch.equal(qt.dequantize(), x)


@pytest.mark.parametrize("mag", [2.0 ** -60, 1e-30, 1e6, 3e38])
def test_tiny_and_huge_magnitudes(mag):
    x = torch.full((64,), mag) * torch.linspace(-1, 1, 64)
    e6m2, _, _, _, ref = spec_quantize_unit(x.tolist())
    d = HIF4.fake_quantize(x)
    assert d.tolist() == ref
    if mag <= 2.0 ** -60:
        assert e6m2 == 2.0 ** -48 and bool((d == 0).all())  # clamped scale, full underflow
    if mag >= 1e6:
        assert e6m2 == 49152.0 and float(d.abs().max()) == 7 * 2 * 2 * 49152.0 / 4  # saturated


def test_nan_and_inf_make_the_unit_nan_only():
    x = torch.randn(3, 128)
    x[0, 5] = float("nan")
    x[1, 70] = float("inf")
    x[2, 1] = -float("inf")
    qt = HIF4.quantize(x)
    d = qt.dequantize()
    assert bool(torch.isnan(d[0, :64]).all()) and bool(torch.isfinite(d[0, 64:]).all())
    assert bool(torch.isfinite(d[1, :64]).all()) and bool(torch.isnan(d[1, 64:]).all())
    assert bool(torch.isnan(d[2, :64]).all())
    assert int(qt.scales[0, 0, 0]) == E6M2_NAN_CODE and int(qt.scales[0, 1, 0]) != E6M2_NAN_CODE
    clean = x.clone()
    clean[0, :64] = 0
    assert torch.equal(d[0, 64:], HIF4.fake_quantize(clean)[0, 64:])


def test_stochastic_rounding_is_seeded_and_nearest_mode_is_spec():
    x = torch.randn(4, 64)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(HIF4.fake_quantize(x, rounding="stochastic", generator=g1),
                       HIF4.fake_quantize(x, rounding="stochastic", generator=g2))
    # the stochastic encoder never saturates: every scaled magnitude lies on or below k = 7
    qt = HIF4.quantize(x * 1000, rounding="stochastic", generator=g1)
    assert torch.isfinite(qt.dequantize()).all()
