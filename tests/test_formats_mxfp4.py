"""MXFP4 is bit-exact with torchao's MX reference (floor scale); rceil never clips; NaN/Inf blocks are NaN."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_fp4.formats import get_format

torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")

MX = get_format("mxfp4")
MX_RCEIL = get_format("mxfp4_rceil")


def _torchao(x):
    scale, data = torchao_mx.to_mx(x.contiguous(), torch.float4_e2m1fn_x2, 32)
    return scale.view(torch.uint8), data.view(torch.uint8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 9), blocks=st.integers(1, 6), log_scale=st.floats(-8, 6),
       n_outliers=st.integers(0, 4), outlier_mag=st.floats(1, 1e4), seed=st.integers(0, 2 ** 31 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_bit_exact_with_torchao(rows, blocks, log_scale, n_outliers, outlier_mag, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks * 32, generator=gen) * 10.0 ** log_scale
    if n_outliers:
        idx = torch.randint(0, x.numel(), (n_outliers,), generator=gen)
        x.view(-1)[idx] *= outlier_mag
    x = x.to(dtype)
    ref_scale, ref_codes = _torchao(x)
    qt = MX.quantize(x)
    assert torch.equal(qt.scales, ref_scale)
    assert torch.equal(qt.codes, ref_codes)


def test_bit_exact_on_exact_grid_ties():
    # every E2M1 midpoint relative to a power-of-two scale: ties must go to the even code as torchao does
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.5, 0.0])
    x = torch.cat([grid, -grid, torch.full((12,), 0.3)]).reshape(1, 32) * 2.0 ** -3
    x[0, 0] = 7.9 * 2.0 ** -3  # amax sets X so the grid lands on element midpoints
    ref_scale, ref_codes = _torchao(x)
    qt = MX.quantize(x)
    assert torch.equal(qt.scales, ref_scale) and torch.equal(qt.codes, ref_codes)


def test_scale_definition_and_saturation():
    x = torch.zeros(1, 32)
    x[0, 0] = 7.0  # floor(log2 7) - 2 = 0 -> 7 saturates to 6
    x[0, 1] = 0.2  # below half of 0.5 -> 0
    qt = MX.quantize(x)
    assert int(qt.scales[0, 0]) == 127
    d = qt.dequantize()
    assert d[0, :2].tolist() == [6.0, 0.0]


def test_rceil_never_clips():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * torch.logspace(-6, 6, 64).unsqueeze(1)
    qt = MX_RCEIL.quantize(x)
    exps = qt.scales.to(torch.float32) - 127
    blocks = x.reshape(64, 8, 32).abs().amax(-1)
    assert bool((blocks <= 6 * torch.exp2(exps)).all())
    assert bool((blocks > 3 * torch.exp2(exps)).all())  # smallest such scale
    # rceil error is never worse than floor's on blocks that floor saturates
    err_floor = (MX.fake_quantize(x) - x).abs().amax()
    assert float((MX_RCEIL.fake_quantize(x) - x).abs().amax()) <= float(err_floor) * 2


def test_nan_and_inf_blocks_are_nan():
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    qt = MX.quantize(x)
    assert qt.scales.tolist() == [[255, qt.scales[0, 1].item()], [qt.scales[1, 0].item(), 255]]
    d = qt.dequantize()
    assert bool(torch.isnan(d[0, :32]).all()) and bool(torch.isfinite(d[0, 32:]).all())
    assert bool(torch.isnan(d[1, 32:]).all()) and bool(torch.isfinite(d[1, :32]).all())


def test_zero_block_uses_smallest_scale():
    qt = MX.quantize(torch.zeros(1, 32))
    assert int(qt.scales[0, 0]) == 0
    assert bool((qt.dequantize() == 0).all())


def test_worked_example_mse():
    u = ([0.1, -3.0, 7.5, 0.001, 0.6, -0.25, 1.2, 0.05, 0.3, -0.2, 0.15, 0.02, 0.9, 0.4, -0.7, 0]
         + [0.05, -0.1, 0.15, -0.2, 0.25, -0.05, 0.1, -0.15] * 6)
    x = torch.tensor(u)
    d = MX.fake_quantize(x)
    assert abs(float(((d - x) ** 2).mean()) - 4.516e-2) < 5e-6
    assert int(((d == 0) & (x != 0)).sum()) == 23
