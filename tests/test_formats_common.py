"""Properties every format shares: shapes, dims, dtypes, padding, packing round trip, registry, underflow."""

import pytest
import torch

from megatron_fp4.formats import (Format, HiF4Format, get_format, register_format, registered_formats,
                                  underflow_rate)
from megatron_fp4.formats.nvfp4 import NVFP4Format

NAMES = ["hif4", "mxfp4", "nvfp4", "mxfp4_rceil"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,dim", [((3, 100), -1), ((70, 5), 0), ((2, 3, 45), 1), ((130,), 0),
                                       ((4, 2, 64), -1)])
def test_shape_dtype_and_packing_round_trip(name, dtype, shape, dim):
    fmt = get_format(name)
    x = (torch.randn(shape) * 3).to(dtype)
    qt = fmt.quantize(x, dim=dim)
    fq = fmt.fake_quantize(x, dim=dim)
    assert fq.shape == x.shape and fq.dtype == dtype
    assert torch.equal(qt.dequantize(), fq)
    # raw bytes -> QuantizedTensor -> values
    back = fmt.from_bytes(qt.to_bytes(), x.shape, dim=dim, dtype=dtype)
    assert torch.equal(back.codes, qt.codes) and torch.equal(back.scales, qt.scales)
    assert torch.equal(back.dequantize(), fq)
    # quantizing along dim == moving dim last and quantizing along -1
    moved = fmt.fake_quantize(x.movedim(dim, -1).contiguous(), dim=-1).movedim(-1, dim)
    assert torch.equal(moved, fq)


@pytest.mark.parametrize("name", NAMES)
def test_padding_matches_explicit_zero_padding(name):
    fmt = get_format(name)
    x = torch.randn(5, 77)
    padded = torch.nn.functional.pad(x, (0, (-77) % fmt.block_size))
    assert torch.equal(fmt.fake_quantize(x), fmt.fake_quantize(padded)[:, :77])


@pytest.mark.parametrize("name,bits", [("hif4", 4.5), ("mxfp4", 4.25), ("nvfp4", 4.5)])
def test_bits_per_value_matches_storage(name, bits):
    fmt = get_format(name)
    assert fmt.bits_per_value == bits
    qt = fmt.quantize(torch.randn(64, 1024))
    extra = 32 if fmt.has_global_scale else 0
    assert (qt.nbytes * 8 - extra) / (64 * 1024) == bits


@pytest.mark.parametrize("name", NAMES)
def test_stochastic_rounding_is_unbiased_everywhere(name):
    # outlier-heavy rows, block maxima included: the mean of many draws converges to x (no saturation bias)
    fmt = get_format(name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 128, generator=gen)
    x[:, ::37] *= 20
    draws = 3000
    samples = fmt.fake_quantize(x.repeat(draws, 1), rounding="stochastic", generator=gen).view(draws, 2, 128)
    err = (samples.mean(0) - x).abs()
    # within 5 standard errors of the mean of each element (exactly representable elements have zero spread)
    bound = 5 * samples.std(0) / draws ** 0.5 + 1e-6 * x.abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    nearest_err = (fmt.fake_quantize(x) - x).abs()
    assert float(err.mean()) < float(nearest_err.mean()) / 10  # far below round-to-nearest's error


def test_get_format_errors_list_valid_names():
    with pytest.raises(ValueError, match="valid names: .*hif4.*mxfp4.*nvfp4"):
        get_format("fp4")


def test_bad_inputs_fail_with_clear_errors():
    fmt = get_format("hif4")
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        fmt.quantize(torch.arange(64))
    with pytest.raises(ValueError, match="rounding='up'"):
        fmt.quantize(torch.randn(64), rounding="up")
    with pytest.raises(ValueError, match="dim=3"):
        fmt.quantize(torch.randn(4, 64), dim=3)
    with pytest.raises(ValueError, match="expected"):
        fmt.from_bytes(b"\x00" * 3, (1, 64))


def test_underflow_rate():
    x = torch.zeros(1, 64)
    x[0, 0] = 7.0
    x[0, 1:5] = 0.01  # underflows next to the outlier
    x[0, 5] = 1.0
    assert underflow_rate(x, "hif4") == pytest.approx(4 / 6)
    assert underflow_rate(torch.zeros(3, 64), "mxfp4") == 0.0


def test_nvfp4_global_scale_and_error_bound():
    fmt = get_format("nvfp4")
    x = torch.randn(32, 256) * 5
    qt = fmt.quantize(x)
    g = float(qt.global_scale)
    assert g == pytest.approx(448 * 6 / float(x.abs().max()))
    d = qt.dequantize()
    # each block's error is at most half the coarsest E2M1 step (2 of 6) of its (rounded) scale
    blocks = x.reshape(32, 16, 16)
    err = (d - x).reshape(32, 16, 16).abs().amax(-1)
    assert bool((err <= blocks.abs().amax(-1) / 6 * 1.07 + 1e-6).all())
    assert torch.isnan(fmt.fake_quantize(torch.tensor([1.0, float("nan")] + [0.0] * 14))).all()


class _MyFormat(HiF4Format):
    """A user format: HiF4 with a different name (stands in for any Format subclass)."""

    name = "my_hif4"


def test_register_format_and_recipes_accept_it():
    from megatron_fp4.recipe import FP4Recipe

    register_format("my_hif4", _MyFormat, override=True)
    assert "my_hif4" in registered_formats()
    r = FP4Recipe(weight_format="my_hif4", activation_format="my_hif4", gradient_format="hif4")
    assert isinstance(r.format("weight"), _MyFormat)
    with pytest.raises(ValueError, match="already registered"):
        register_format("my_hif4", _MyFormat())
    with pytest.raises(TypeError):
        register_format("bad", lambda: 3)
    assert isinstance(get_format("nvfp4"), NVFP4Format) and isinstance(get_format("nvfp4"), Format)
