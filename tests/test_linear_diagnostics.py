"""UnderflowMonitor: per-linear underflow rate of the quantized input activations, only while enabled."""

import torch

from megatron_fp4.diagnostics import UnderflowMonitor, fp4_linear_modules
from megatron_fp4.formats import get_format
from megatron_fp4.linear import FP4Linear
from megatron_fp4.recipe import HiF4BlockScaling, MXFP4BlockScaling, fp4_autocast


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(FP4Linear(64, 32), torch.nn.ReLU(), FP4Linear(32, 16), torch.nn.Linear(16, 4))


def _expected(x, fmt):
    fq = get_format(fmt).fake_quantize(x)
    nz = x != 0
    return int((nz & (fq == 0)).sum()) / int(nz.sum())


def test_rates_match_direct_computation():
    model = _model()
    x = torch.randn(10, 64)
    x[:, 0] = 1000.0  # an outlier channel: small entries of each block underflow
    assert set(fp4_linear_modules(model)) == {"0", "2"}
    with fp4_autocast(recipe=MXFP4BlockScaling()):
        with UnderflowMonitor(model) as mon:
            model(x)
            model[0](x)  # a second call accumulates into the same counters
        rates = mon.collect()
    assert set(rates) == {"0", "2"}
    x0 = torch.cat([x, x])
    assert abs(rates["0"] - _expected(x0, "mxfp4")) < 1e-12 and rates["0"] > 0.3
    with fp4_autocast(recipe=MXFP4BlockScaling()):
        assert abs(rates["2"] - _expected(torch.relu(model[0](x)), "mxfp4")) < 1e-12
    assert mon.collect() == {}  # collect() resets


def test_nothing_recorded_when_disabled_or_high_precision():
    model = _model()
    x = torch.randn(4, 64)
    mon = UnderflowMonitor(model)
    with fp4_autocast(recipe=HiF4BlockScaling()):
        model(x)  # not enabled: no hooks at all
    assert mon.collect() == {} and not mon.enabled
    assert all(not m._forward_pre_hooks for m in model)
    with mon:
        model(x)  # no recipe: the linears run in high precision, nothing is quantized
        with fp4_autocast(recipe=HiF4BlockScaling(quantize_fprop=False)):
            model(x)
    assert mon.collect() == {}
    assert all(not m._forward_pre_hooks for m in model)  # hooks removed on exit
