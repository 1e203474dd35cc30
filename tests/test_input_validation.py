"""The library's public tensor functions on empty and malformed tensors: one InvalidTensorError (a ValueError and a
TypeError) naming the function and the argument, never a reshape error from deep inside; and the shapes README
promises (any non-empty shape, any dim) give the reference's result."""

from __future__ import annotations

import pytest
import torch

from megatron_fp4 import ops
from megatron_fp4.formats import InvalidTensorError, get_format
from megatron_fp4.linear import fp4_linear
from megatron_fp4.recipe import HiF4BlockScaling
from megatron_fp4.resq import resq_activation

FORMATS = ("hif4", "mxfp4", "nvfp4")
BAD_X = {
    "empty rows": torch.empty(0, 64),
    "empty K": torch.empty(3, 0),
    "empty 1-d": torch.empty(0),
    "0-d": torch.tensor(1.5),
    "int": torch.ones(4, 64, dtype=torch.int32),
    "float64": torch.ones(4, 64, dtype=torch.float64),
    "bool": torch.ones(4, 64, dtype=torch.bool),
    "list": [1.0, 2.0],
}


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("case", sorted(BAD_X))
def test_quantize_and_fake_quantize_refuse_bad_tensors(name, case):
    fmt = get_format(name)
    for fn in (fmt.quantize, fmt.fake_quantize):
        with pytest.raises(InvalidTensorError, match=rf"^{name}: (x |cannot quantize a 0-d)") as e:
            fn(BAD_X[case])
        assert isinstance(e.value, ValueError) and isinstance(e.value, TypeError)


@pytest.mark.parametrize("name", FORMATS)
def test_dim_and_generator_are_checked(name):
    fmt = get_format(name)
    x = torch.randn(4, 64)
    for dim in (2, -3, "1", 1.0, None):
        with pytest.raises(InvalidTensorError, match=rf"{name}: dim="):
            fmt.quantize(x, dim=dim)
    with pytest.raises(ValueError, match="generator must be a torch.Generator"):
        fmt.quantize(x, rounding="stochastic", generator=3)


@pytest.mark.parametrize("name", FORMATS)
def test_from_bytes_refuses_malformed_input(name):
    fmt = get_format(name)
    raw = fmt.quantize(torch.randn(2, 64)).to_bytes()
    cases = [(raw[:-1], (2, 64), {}, "expected"), ("text", (2, 64), {}, "must be bytes"),
             (raw, (0, 64), {}, "shape"), (raw, (), {}, "shape"), (raw, (2.0, 64), {}, "shape"),
             (raw, (-2, 64), {}, "shape"), (raw, 5, {}, "shape"), (raw, (2, 64), {"dtype": torch.int32}, "dtype"),
             (raw, (2, 64), {"dim": 2}, "dim=2")]
    for data, shape, kw, what in cases:
        with pytest.raises(InvalidTensorError, match=rf"{name}.from_bytes: .*{what}"):
            fmt.from_bytes(data, shape, **kw)
    back = fmt.from_bytes(memoryview(raw), (2, 64)).dequantize()  # bytes-like is fine
    assert back.shape == (2, 64)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape,dim", [((1,), 0), ((5,), -1), ((3, 70), 1), ((70, 3), 0), ((2, 3, 33), 1),
                                       ((1, 1, 1), 2)])
def test_any_nonempty_shape_and_dim_round_trips(name, shape, dim):
    fmt = get_format(name)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    qt = fmt.quantize(x, dim=dim)
    y = qt.dequantize()
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y, fmt.fake_quantize(x, dim=dim))
    again = fmt.from_bytes(qt.to_bytes(), x.shape, dim=dim, dtype=x.dtype).dequantize()
    assert torch.equal(again, y)


def test_fp4_linear_refuses_malformed_operands():
    r = HiF4BlockScaling()
    w = torch.randn(8, 64)
    cases = [((torch.empty(0, 64), w, None), "x is empty"), ((torch.tensor(1.0), w, None), "x must have at least 1"),
             ((torch.ones(3, 64, dtype=torch.int64), w, None), "x must be a float32"),
             ((torch.randn(3, 64), torch.randn(64), None), "weight must have 2 dimensions"),
             ((torch.randn(3, 64), torch.randn(2, 8, 64), None), "weight must have 2 dimensions"),
             ((torch.randn(3, 32), w, None), "x has 32 features"),
             ((torch.randn(3, 64), w, torch.randn(5)), "bias has 5 values"),
             ((torch.randn(3, 64), w, torch.randn(8, 1)), "bias must have 1 dimensions")]
    for args, what in cases:
        with pytest.raises(InvalidTensorError, match=f"fp4_linear: {what}"):
            fp4_linear(*args, recipe=r)
    with pytest.raises(TypeError, match="recipe must be an FP4Recipe"):
        fp4_linear(torch.randn(3, 64), w, recipe="hif4")
    y = fp4_linear(torch.randn(2, 3, 64), w, torch.randn(8), recipe=r)  # leading dims are tokens
    assert y.shape == (2, 3, 8)


def test_resq_and_fp4_gemm_refuse_malformed_operands():
    for x, what in ((torch.empty(0, 64), "x is empty"), (torch.ones(4, 64, dtype=torch.int32), "x must be a float32"),
                    ([1.0], "x must be a torch.Tensor"), (torch.tensor(2.0), "x must have at least 1")):
        with pytest.raises(InvalidTensorError, match=f"resq_activation: {what}"):
            resq_activation(x, "hif4", "2:4")
    b = torch.randn(8, 64)
    for a, bb, what in ((torch.empty(0, 64), b, "a is empty"), (torch.randn(64), b, "a must have 2 dimensions"),
                        (torch.randn(3, 64), torch.randn(8, 32), "reduction dims differ"),
                        (torch.randn(3, 64), b.to(torch.int8), "b must be a float32")):
        with pytest.raises(InvalidTensorError, match=f"fp4_gemm: {what}"):
            ops.fp4_gemm(a, bb, "hif4", "hif4")


def test_kernel_dispatch_entry_points_refuse_malformed_operands():
    from megatron_fp4.kernels import dispatch

    w = dispatch.prepare_weight(torch.randn(8, 64), "hif4")
    with pytest.raises(InvalidTensorError, match="prepare_weight: w is empty"):
        dispatch.prepare_weight(torch.empty(0, 64), "hif4")
    with pytest.raises(InvalidTensorError, match="dispatch.fp4_gemm: a is empty"):
        dispatch.fp4_gemm(torch.empty(0, 64), torch.randn(8, 64), "hif4")
    with pytest.raises(InvalidTensorError, match="dispatch.fp4_gemm: reduction dims differ"):
        dispatch.fp4_gemm(torch.randn(3, 64), torch.randn(8, 32), "hif4")
    with pytest.raises(InvalidTensorError, match="dispatch.linear: x is empty"):
        dispatch.linear(torch.empty(0, 64), w)
    with pytest.raises(InvalidTensorError, match="dispatch.linear: x has 32 features"):
        dispatch.linear(torch.randn(3, 32), w)
    with pytest.raises(InvalidTensorError, match="dispatch.linear: w must be a PreparedWeight"):
        dispatch.linear(torch.randn(3, 64), torch.randn(8, 64))
    with pytest.raises(InvalidTensorError, match="decode_matmul: a has 32 columns"):
        dispatch.decode_matmul(torch.randn(3, 32, dtype=torch.bfloat16), w)
    ref = get_format("hif4").fake_quantize(torch.ones(3, 64)) @ w.packed.dequantize().float().t()
    assert torch.equal(dispatch.linear(torch.ones(3, 64), w), ref)
