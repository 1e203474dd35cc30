"""FP4 linear: each GEMM equals a float64 reference on operands quantized along that GEMM's reduction dim."""

import contextlib
import zlib

import pytest
import torch
import torch.nn.functional as F

from megatron_fp4 import ops
from megatron_fp4.formats import get_format
from megatron_fp4.linear import (
    FP4Linear,
    fp4_linear,
    hadamard_matrix,
    random_hadamard_transform,
)
from megatron_fp4.recipe import (
    FP4Recipe,
    HiF4BlockScaling,
    MXFP4BlockScaling,
    NVFP4BlockScaling1D,
    fp4_autocast,
    recipe_for_format,
)

FORMATS = ("hif4", "mxfp4", "nvfp4")



def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref).norm() / ref.norm())


def q(fmt: str, t: torch.Tensor, dim: int) -> torch.Tensor:
    """The formats' reference fake-quantization along ``dim``, as float64."""
    return get_format(fmt).fake_quantize(t, dim=dim).double()


def run(x, w, b, recipe, dy):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    b = None if b is None else b.clone().requires_grad_(True)
    y = fp4_linear(x, w, b, recipe)
    y.backward(dy)
    return y, x.grad, w.grad, (None if b is None else b.grad)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lead,K,n", [((37,), 70, 45), ((3, 23), 100, 33), ((5, 9), 129, 66)])
def test_gemms_match_float64_reference(fmt, lead, K, n):
    g = torch.Generator().manual_seed(zlib.crc32(repr((fmt, lead, K, n)).encode()))
    x = torch.randn(*lead, K, generator=g)
    x[..., 3] *= 40.0  # an outlier channel, so blocks have very different scales
    w = torch.randn(n, K, generator=g) * 0.1
    b = torch.randn(n, generator=g)
    dy = torch.randn(*lead, n, generator=g)
    y, dx, dw, db = run(x, w, b, recipe_for_format(fmt), dy)

    x2, dy2 = x.reshape(-1, K), dy.reshape(-1, n)
    # fprop: groups along K for X rows and W rows
    y_ref = q(fmt, x2, -1) @ q(fmt, w, -1).T + b.double()
    # dgrad: groups along n (dY rows, W columns)
    dx_ref = q(fmt, dy2, -1) @ q(fmt, w, 0)
    # wgrad: groups along m (tokens) for dY^T and X^T
    dw_ref = q(fmt, dy2, 0).T @ q(fmt, x2, 0)
    assert y.shape == (*lead, n) and dx.shape == x.shape and dw.shape == w.shape
    assert rel_err(y.reshape(-1, n), y_ref) < 1e-5
    assert rel_err(dx.reshape(-1, K), dx_ref) < 1e-5
    assert rel_err(dw, dw_ref) < 1e-5
    torch.testing.assert_close(db, dy2.sum(0))
    # and quantization actually happened
    assert rel_err(y.reshape(-1, n), x2.double() @ w.double().T + b.double()) > 1e-3


@pytest.mark.parametrize("fmt", ("hif4", "mxfp4"))
def test_bf16_inputs(fmt):
    """bf16 operands: quantized exactly as their fp32 values, fp32 accumulation, bf16 outputs and grads."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 96, generator=g).bfloat16()
    w = (torch.randn(72, 96, generator=g) * 0.1).bfloat16()
    dy = torch.randn(40, 72, generator=g).bfloat16()
    y, dx, dw, _ = run(x, w, None, recipe_for_format(fmt), dy)
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
    y_ref = q(fmt, x.float(), -1) @ q(fmt, w.float(), -1).T
    dx_ref = q(fmt, dy.float(), -1) @ q(fmt, w.float(), 0)
    dw_ref = q(fmt, dy.float(), 0).T @ q(fmt, x.float(), 0)
    for got, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert rel_err(got, ref) < 4e-3  # bf16 output rounding only


def test_mixed_formats_per_role():
    recipe = FP4Recipe(weight_format="mxfp4", activation_format="hif4", gradient_format="nvfp4")
    g = torch.Generator().manual_seed(2)
    x, w, dy = torch.randn(50, 80, generator=g), torch.randn(30, 80, generator=g), torch.randn(50, 30, generator=g)
    y, dx, dw, _ = run(x, w, None, recipe, dy)
    assert rel_err(y, q("hif4", x, -1) @ q("mxfp4", w, -1).T) < 1e-5
    assert rel_err(dx, q("nvfp4", dy, -1) @ q("mxfp4", w, 0)) < 1e-5
    assert rel_err(dw, q("nvfp4", dy, 0).T @ q("hif4", x, 0)) < 1e-5


def test_no_recipe_is_plain_linear_bitwise():
    torch.manual_seed(0)
    ref = torch.nn.Linear(48, 24)
    mod = FP4Linear(48, 24)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(4, 7, 48)
    outs = []
    for m in (ref, mod):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, m.weight.grad, m.bias.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    # functional form, and an fp4_autocast(enabled=False) block over a module that has a recipe
    assert torch.equal(fp4_linear(x, ref.weight, ref.bias), F.linear(x, ref.weight, ref.bias))
    mod.recipe = HiF4BlockScaling()
    with fp4_autocast(enabled=False):
        assert torch.equal(mod(x), ref(x))
    assert not torch.equal(mod(x), ref(x))


def test_autocast_and_module_recipe():
    torch.manual_seed(0)
    x, w = torch.randn(16, 64), torch.randn(8, 64)
    with fp4_autocast(recipe=MXFP4BlockScaling()):
        y = fp4_linear(x, w)
    torch.testing.assert_close(y, (q("mxfp4", x, -1) @ q("mxfp4", w, -1).T).float())
    mod = FP4Linear(64, 8, bias=False, recipe=NVFP4BlockScaling1D())
    with torch.no_grad():
        mod.weight.copy_(w)
    torch.testing.assert_close(mod(x), (q("nvfp4", x, -1) @ q("nvfp4", w, -1).T).float())
    with fp4_autocast(recipe=HiF4BlockScaling()):  # the active autocast wins over the module's recipe
        torch.testing.assert_close(mod(x), (q("hif4", x, -1) @ q("hif4", w, -1).T).float())


def test_stochastic_rounding_gradients_unbiased():
    """Mean of the SR dgrad/wgrad over many draws converges to the product with the unrounded dY.

    The gradient format is mxfp4_rceil, whose scale never clips: with the floor-scale MXFP4 and with HiF4 the
    largest values of a block saturate (deterministically rounded down), so their SR is unbiased only below
    the top code (see the formats' docs).
    """
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 64, generator=g), torch.randn(32, 64, generator=g) * 0.2
    dy = torch.randn(64, 32, generator=g)
    recipe = MXFP4BlockScaling(scale_mode="rceil", gradient_rounding="stochastic")
    # expectation: only dY is stochastically rounded; W and X round to nearest
    dx_exp = dy.double() @ q("mxfp4_rceil", w, 0)
    dw_exp = dy.double().T @ q("mxfp4_rceil", x, 0)
    torch.manual_seed(0)
    draws = 256
    dx_sum, dw_sum = torch.zeros_like(dx_exp), torch.zeros_like(dw_exp)
    errs_dx, errs_dw = [], []
    for i in range(draws):
        _, dx, dw, _ = run(x, w, None, recipe, dy)
        dx_sum += dx.double()
        dw_sum += dw.double()
        if i + 1 in (1, 16, draws):
            errs_dx.append(rel_err(dx_sum / (i + 1), dx_exp))
            errs_dw.append(rel_err(dw_sum / (i + 1), dw_exp))
    # the error of the mean shrinks like 1/sqrt(draws): 16x fewer after 256 draws (allow 8x)
    assert errs_dx[-1] < errs_dx[0] / 8 and errs_dw[-1] < errs_dw[0] / 8
    assert errs_dx[-1] < errs_dx[1] / 2 and errs_dw[-1] < errs_dw[1] / 2
    # round-to-nearest of dY does not converge to the exact product
    _, dx_n, dw_n, _ = run(x, w, None, recipe.replace(gradient_rounding="nearest"), dy)
    assert rel_err(dx_n, dx_exp) > 3 * errs_dx[-1] and rel_err(dw_n, dw_exp) > 3 * errs_dw[-1]


@pytest.mark.parametrize("block", (16, 32, 64))
def test_hadamard_orthogonal_and_product_preserving(block):
    h = hadamard_matrix(block, seed=7).double()
    torch.testing.assert_close(h @ h.T, torch.eye(block, dtype=torch.float64), atol=1e-6, rtol=0)
    assert not torch.equal(h, hadamard_matrix(block, seed=8).double())  # the seed picks the signs
    g = torch.Generator().manual_seed(block)
    a, b = torch.randn(9, 100, generator=g), torch.randn(5, 100, generator=g)  # 100: not a block multiple
    ta, tb = random_hadamard_transform(a, block, 7), random_hadamard_transform(b, block, 7)
    assert ta.shape[1] % block == 0
    torch.testing.assert_close(ta @ tb.T, a @ b.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_hadamard_wgrad(fmt):
    """With the transform on, wgrad = Q_m(dY^T H) Q_m(X^T H)^T exactly, and is close to the unquantized dW."""
    g = torch.Generator().manual_seed(11)
    m, K, n = 200, 48, 24
    x = torch.randn(m, K, generator=g)
    x[::37] *= 50.0  # outlier tokens
    dy = torch.randn(m, n, generator=g)
    w = torch.randn(n, K, generator=g)
    recipe = recipe_for_format(fmt, hadamard_wgrad=True, hadamard_block_size=32, hadamard_seed=5)
    _, dx_h, dw_h, _ = run(x, w, None, recipe, dy)
    _, dx_p, dw_p, _ = run(x, w, None, recipe_for_format(fmt), dy)
    a = random_hadamard_transform(dy.T, 32, 5)
    b = random_hadamard_transform(x.T, 32, 5)
    assert rel_err(dw_h, q(fmt, a, -1) @ q(fmt, b, -1).T) < 1e-5
    exact = dy.double().T @ x.double()
    assert rel_err(dw_h, exact) < 0.2 and rel_err(dw_p, exact) < 0.2
    assert not torch.equal(dw_h, dw_p)
    assert torch.equal(dx_h, dx_p)  # dgrad is untouched


def test_quantize_backward_off():
    """FP4 forward, high-precision backward (and each GEMM switched off on its own)."""
    g = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(30, 70, generator=g), torch.randn(20, 70, generator=g), torch.randn(20, generator=g)
    dy = torch.randn(30, 20, generator=g)
    base = HiF4BlockScaling()
    y, dx, dw, _ = run(x, w, b, base.replace(quantize_dgrad=False, quantize_wgrad=False), dy)
    assert rel_err(y, q("hif4", x, -1) @ q("hif4", w, -1).T + b.double()) < 1e-5
    assert torch.equal(dx, dy @ w)
    assert torch.equal(dw, dy.T @ x)
    _, dx2, dw2, _ = run(x, w, b, base.replace(quantize_wgrad=False), dy)
    assert rel_err(dx2, q("hif4", dy, -1) @ q("hif4", w, 0)) < 1e-5 and torch.equal(dw2, dy.T @ x)
    y3, _, dw3, _ = run(x, w, b, base.replace(quantize_fprop=False), dy)
    assert torch.equal(y3, x @ w.T + b)
    assert rel_err(dw3, q("hif4", dy, 0).T @ q("hif4", x, 0)) < 1e-5


def test_frozen_weight_and_no_input_grad():
    x, w = torch.randn(10, 64), torch.randn(12, 64, requires_grad=False)
    xr = x.clone().requires_grad_(True)
    fp4_linear(xr, w, recipe=HiF4BlockScaling()).sum().backward()
    assert xr.grad is not None and w.grad is None
    wr = w.clone().requires_grad_(True)
    fp4_linear(x, wr, recipe=HiF4BlockScaling()).sum().backward()
    assert wr.grad is not None


def test_gemm_dispatch_backend():
    calls = []

    def backend(a, b, a_fmt, b_fmt, a_round, b_round, gen):
        calls.append((tuple(a.shape), tuple(b.shape), a_fmt.name, b_fmt.name, a_round))
        if a_fmt.name == "nvfp4":
            return NotImplemented
        return ops.reference_fp4_gemm(a, b, a_fmt, b_fmt, a_round, b_round, gen)

    x, w = torch.randn(5, 40), torch.randn(6, 40)
    ref = ops.fp4_gemm(x, w, "hif4", "hif4")
    ops.register_fp4_gemm_backend("cpu", backend)
    try:
        assert torch.equal(ops.fp4_gemm(x, w, "hif4", "hif4"), ref)
        assert calls == [((5, 40), (6, 40), "hif4", "hif4", "nearest")]
        ops.fp4_gemm(x, w, "nvfp4", "nvfp4")  # NotImplemented -> reference
        assert len(calls) == 2
        with ops.use_reference_backend():
            ops.fp4_gemm(x, w, "hif4", "hif4")
        assert len(calls) == 2
    finally:
        ops.unregister_fp4_gemm_backend("cpu")
    with pytest.raises(ValueError, match="reduction"):
        ops.fp4_gemm(x, torch.randn(6, 41), "hif4", "hif4")


class CountingBackend(ops.FP4GemmBackend):
    """The reference in two steps, counting the weight quantizations it is asked for."""

    def __init__(self):
        self.weights = 0

    def quantize(self, x, fmt, rounding, generator, mode, weight):
        self.weights += int(weight)
        return super().quantize(x, fmt, rounding, generator, mode, weight)


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
def test_weight_cache_quantizes_each_weight_once_per_schedule(fmt):
    """Inside ops.quantized_weight_cache the FP4 linear quantizes W (fprop) and W^T (dgrad) once for every
    micro-batch, with bit-identical outputs and gradients; an in-place weight update inside the block is seen."""
    recipe = recipe_for_format(fmt)
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    xs = [torch.randn(3, 5, 64) for _ in range(3)]

    def micro_batches(cache: bool):
        wr = w.clone().requires_grad_(True)
        outs, gx = [], []
        ctx = ops.quantized_weight_cache() if cache else torch.enable_grad()
        with ctx:
            for x in xs:
                xr = x.clone().requires_grad_(True)
                y = fp4_linear(xr, wr, recipe=recipe)
                (y * torch.linspace(-1, 1, 24)).sum().backward()
                outs.append(y.detach())
                gx.append(xr.grad)
        return outs, gx, wr.grad

    backend = CountingBackend()
    ops.register_fp4_gemm_backend("cpu", backend)
    try:
        plain = micro_batches(cache=False)
        assert backend.weights == 6  # no cache block: W and W^T in every micro-batch
        cached = micro_batches(cache=True)
        assert backend.weights == 6 + 2  # W and W^T, once for three micro-batches
        for a, b in zip(plain, cached):
            for ta, tb in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
                assert torch.equal(ta, tb)
        wr = w.clone().requires_grad_(True)
        with ops.quantized_weight_cache():
            y1 = fp4_linear(xs[0], wr, recipe=recipe)
            with torch.no_grad():
                wr.mul_(2.0)  # a new version of the weight: quantized again
            y2 = fp4_linear(xs[0], wr, recipe=recipe)
        assert backend.weights == 8 + 2 and torch.equal(y2, 2 * y1)
        with ops.quantized_weight_cache(), torch.no_grad():  # no dgrad follows: W alone
            fp4_linear(xs[0].clone().requires_grad_(True), w.clone().requires_grad_(True), recipe=recipe)
        assert backend.weights == 10 + 1
    finally:
        ops.unregister_fp4_gemm_backend("cpu")


class PairCounting(CountingBackend):
    def __init__(self):
        super().__init__()
        self.pairs = 0

    def quantize_weight_both(self, x, fmt, mode):
        self.pairs += 1
        return super().quantize_weight_both(x, fmt, mode)


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
def test_weight_cache_makes_w_and_w_t_together_for_schedules_with_a_backward(fmt):
    """``quantized_weight_cache(both_layouts=True)`` (the actor's training schedules): a weight's first quantization
    makes W and W^T in one backend call (one read of W on the GPU), which the dgrads of every micro-batch reuse;
    outputs and gradients are bit-identical to the plain cache's. A transposed or non-contiguous weight view takes
    the one-layout path."""
    recipe = recipe_for_format(fmt)
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    xs = [torch.randn(3, 5, 64) for _ in range(3)]

    def micro_batches(both: bool, param=w, weight=lambda p: p):
        wr = param.clone().requires_grad_(True)
        outs = []
        with ops.quantized_weight_cache(both_layouts=both):
            for x in xs:
                xr = x.clone().requires_grad_(True)
                y = fp4_linear(xr, weight(wr), recipe=recipe)
                (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
                outs += [y.detach(), xr.grad]
        return outs + [wr.grad]

    backend = PairCounting()
    ops.register_fp4_gemm_backend("cpu", backend)
    try:
        plain = micro_batches(both=False)
        assert (backend.weights, backend.pairs) == (2, 0)
        both = micro_batches(both=True)
        assert (backend.weights, backend.pairs) == (2 + 2, 1)  # the pair's two quantizations, asked for once
        assert all(torch.equal(a, b) for a, b in zip(plain, both))
        # the weight a transposed view of a [64, 24] parameter: W and W^T one by one, the same numbers
        assert all(torch.equal(a, b) for a, b in zip(plain, micro_batches(True, w.t().contiguous(), lambda p: p.t()))
                   if a.shape == b.shape)
        assert (backend.weights, backend.pairs) == (4 + 2, 1)
    finally:
        ops.unregister_fp4_gemm_backend("cpu")


class RequantizeCounting(CountingBackend):
    def __init__(self):
        super().__init__()
        self.requantized = self.pairs = 0

    def requantize(self, x, fmt, mode, q):
        self.requantized += 1
        return super().requantize(x, fmt, mode, q)

    def requantize_both(self, x, fmt, mode, q_rows, q_cols):
        self.pairs += 1
        return super().requantize_both(x, fmt, mode, q_rows, q_cols)


@pytest.mark.parametrize("via", ["forced", "capture"])
def test_weights_persist_for_cuda_graphs_and_refresh_in_place(monkeypatch, via):
    """While CUDA graphs are made (megatron's warm-up and capture; on CPU ``ops._capturing`` or
    ``ops.persistent_weights`` stand in) W and W^T are quantized once into persistent buffers, outside the open
    per-schedule cache, and every later pass reads those buffers (a graph reads their addresses): an in-place
    weight update is seen only after ``ops.refresh_persistent_weights``, which rewrites the same buffers with the
    numbers of quantizing the new weights (W and its transposed view W^T in one ``requantize_both`` call)."""
    recipe = recipe_for_format("hif4")
    torch.manual_seed(0)
    w, x = torch.randn(24, 64, requires_grad=True), torch.randn(4, 64, requires_grad=True)
    backend = RequantizeCounting()
    ops.register_fp4_gemm_backend("cpu", backend)
    ctx = ops.persistent_weights() if via == "forced" else contextlib.nullcontext()
    try:
        with ops.quantized_weight_cache() as cache:
            want = fp4_linear(x, w, recipe=recipe)
            want.sum().backward()
        if via == "capture":
            monkeypatch.setattr(ops, "_capturing", lambda t: True)
        with ctx, ops.quantized_weight_cache() as cache:
            for _ in range(2):
                y = fp4_linear(x, w, recipe=recipe)
                y.sum().backward()
                assert torch.equal(y, want)
            assert (backend.weights, len(cache)) == (2 + 2, 0)  # W and W^T once, outside the schedule's cache
            buffers = [e[5].data_ptr() for e in ops._PERSISTENT.entries.values()]
            assert len(buffers) == 2
            with torch.no_grad():
                w.mul_(2.0)  # the optimizer's in-place step
            assert torch.equal(fp4_linear(x, w, recipe=recipe), want)  # stale until refreshed, as a graph's
            ops.refresh_persistent_weights()
            assert (backend.requantized, backend.pairs) == (2, 1)  # W and W^T in one call, which a backend may serve
            assert [e[5].data_ptr() for e in ops._PERSISTENT.entries.values()] == buffers
            assert torch.equal(fp4_linear(x, w, recipe=recipe), 2 * want)
        monkeypatch.setattr(ops, "_capturing", lambda t: False)
        with ops.quantized_weight_cache():  # outside: the schedule's cache again, the buffers untouched
            assert torch.equal(fp4_linear(x, w, recipe=recipe), 2 * want)
        assert backend.weights == 4 + 2 + 1  # the refresh (the reference quantizes, then copies) and one W
    finally:
        ops.clear_persistent_weights()
        ops.unregister_fp4_gemm_backend("cpu")
    ops.refresh_persistent_weights()  # nothing held: nothing to do
    assert backend.requantized == 2


def test_gemm_strided_operands_and_out_dtype():
    """Transposed views are quantized as they are (no copy needed: same numbers as contiguous operands), and
    out_dtype rounds the fp32 product once."""
    a, b = torch.randn(64, 48), torch.randn(64, 20)
    ref = ops.fp4_gemm(a.t().contiguous(), b.t().contiguous(), "hif4", "hif4")
    assert torch.equal(ops.fp4_gemm(a.t(), b.t(), "hif4", "hif4"), ref)
    assert torch.equal(ops.fp4_gemm(a.t(), b.t(), "hif4", "hif4", out_dtype=torch.bfloat16),
                       ref.to(torch.bfloat16))
    assert torch.equal(ops.fp4_gemm(a.t(), b.t(), "mxfp4", "mxfp4", mode="fp8"),
                       ops.fp4_gemm(a.t(), b.t(), "mxfp4", "mxfp4"))  # the reference computes every mode exactly
    with pytest.raises(ValueError, match="mode='fp16'.*'exact', 'fp8', 'fp8_fast'"):
        ops.fp4_gemm(a, a, "hif4", "hif4", mode="fp16")


def test_recipe_gemm_mode():
    assert MXFP4BlockScaling(gemm_mode="fp8").gemm_mode == "fp8"
    with pytest.raises(ValueError, match="gemm_mode.*'exact', 'fp8', 'fp8_fast'"):
        MXFP4BlockScaling(gemm_mode="bf8")
    with pytest.raises(ValueError, match="gemm_mode='fp8' needs MXFP4 weights"):
        HiF4BlockScaling(gemm_mode="fp8")


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
def test_one_pass_operands_equal_separate_quantization(fmt, monkeypatch):
    """X and dY quantized once into both GEMM layouts (ops.quantize_both) give bit-identical outputs and gradients
    to quantizing each GEMM's operands separately; recipes the one pass cannot serve keep the separate path."""
    import megatron_fp4.linear as lin

    torch.manual_seed(1)
    x, w, b = torch.randn(3, 70, 96), torch.randn(40, 96), torch.randn(40)
    dy = torch.randn(3, 70, 40)

    def grads(recipe):
        xr, wr, br = (t.clone().requires_grad_(True) for t in (x, w, b))
        y = fp4_linear(xr, wr, br, recipe=recipe)
        y.backward(dy)
        return y.detach(), xr.grad, wr.grad, br.grad

    recipe = recipe_for_format(fmt)
    assert lin._one_pass_operands(recipe)
    for r in (recipe.replace(gradient_rounding="stochastic"), recipe.replace(hadamard_wgrad=True),
              recipe.replace(quantize_wgrad=False), recipe.replace(gradient_format="nvfp4")):
        assert not lin._one_pass_operands(r)
    one_pass = grads(recipe)
    wr = w.clone().requires_grad_(True)
    y = fp4_linear(x, wr, recipe=recipe)
    y.backward(dy, retain_graph=True)
    y.backward(dy)  # a retained graph backs up twice: Q_m(X^T) stays with it
    assert torch.equal(wr.grad, 2 * one_pass[2])
    monkeypatch.setattr(lin, "_one_pass_operands", lambda r: False)
    separate = grads(recipe)
    for a, c in zip(one_pass, separate):
        assert torch.equal(a, c)
