"""Triton kernels (kernels/) against the PyTorch reference: bit-exact packing, exact GEMMs, fused ResQ.

On a machine without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, small sizes, fp32
dots); without Triton those tests skip. GPU tests are marked ``gpu``.
"""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from megatron_fp4.kernels import dispatch  # noqa: E402
from megatron_fp4.kernels.decode_gemm import w4_matmul  # noqa: E402
from megatron_fp4.kernels.gemm import mm_expanded  # noqa: E402
from megatron_fp4.kernels.packed_gemm import packed_matmul  # noqa: E402
from megatron_fp4.kernels.quantize import expand_packed, quantize  # noqa: E402
from megatron_fp4.kernels.resq import resq_quantize_reference, resq_matmul, resq_quantize  # noqa: E402
from megatron_fp4.formats import get_format  # noqa: E402
from megatron_fp4.ops import kernels_backend  # noqa: E402
from megatron_fp4.resq import resq_activation, resq_components  # noqa: E402

FORMATS = ["hif4", "mxfp4", "mxfp4_rceil"]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ON_CPU = DEV == "cpu"
if ON_CPU:
    from megatron_fp4.kernels._common import interpreting

    if not interpreting():  # kernels were imported before the interpreter was switched on
        pytest.skip("Triton interpreter not active for kernels/", allow_module_level=True)


def _inputs(kind, shape, dtype=torch.float32, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "outliers":
        x = x * torch.exp(torch.randn(shape, generator=g) * 3)
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        flat[idx] *= 1e4
        flat[idx[: len(idx) // 3]] = 0.0
    elif kind == "special":
        flat = x.view(-1)
        flat[3] = float("nan")
        flat[min(200, flat.numel() - 1)] = float("inf")
        flat[min(77, flat.numel() - 1)] = -0.0
        flat[min(140, flat.numel() - 1):] *= 1e-30
    return x.to(dtype).to(device)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _ref_mm(a, b, f):
    return f.fake_quantize(a.float().cpu()).double() @ f.fake_quantize(b.float().cpu()).double().t()


def _exact(got, want, what=""):
    """Bit-for-bit equal (NaN where NaN), naming the first differing index when not."""
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _check_pack(x, name, dim, config=None):
    f = get_format(name)
    q, ex = quantize(x, name, dim=dim, expand="native", config=config)
    r = f.quantize(x, dim=dim)
    assert q.codes.shape == r.codes.shape and q.scales.shape == r.scales.shape
    _exact(q.codes, r.codes, "codes")
    _exact(q.scales, r.scales, "scales")
    _exact(q.dequantize(), r.dequantize(), "dequantized values")
    rows = r.dequantize().float().movedim(dim, -1).reshape(ex.values.shape[0], -1)
    k = rows.shape[1]
    if ex.row_exp is None:
        _exact(ex.values.float()[:, :k], rows, "BF16 expansion")
    else:
        _check_fp8(ex, rows, k)
        # the kernel's E5M2 bytes, flushes included, and row scales equal the twin's (rows with NaN blocks too)
        twin = expand_packed(r, "native")
        _exact(ex.row_ok, twin.row_ok, "E5M2 row_ok")
        _exact(ex.row_exp, twin.row_exp, "E5M2 row_exp")
        _exact(_fp8_bytes(ex.values), _fp8_bytes(twin.values), "E5M2 bytes")
        if dim % x.dim() != x.dim() - 1:
            return  # weights (the E4M3 form's use) are quantized along their last dimension only
        # the E4M3 weight form (cuBLAS's FP8 GEMM): its window ends at 2^(row_exp - 8), subnormals included
        _, e4 = quantize(x, name, dim=dim, expand="e4m3", config=config, packed=False)
        assert e4.values.dtype == torch.float8_e4m3fn
        _check_fp8(e4, rows, k, window=-8)
        twin = expand_packed(r, "e4m3")
        _exact(e4.row_ok, twin.row_ok, "E4M3 row_ok")
        _exact(e4.row_exp, twin.row_exp, "E4M3 row_exp")
        _exact(_fp8_bytes(e4.values), _fp8_bytes(twin.values), "E4M3 bytes")


def _fp8_bytes(v):
    """FP8 bytes with every NaN as 0x7F (the kernel writes 0x7F, PyTorch's conversion may keep NaN's sign)."""
    return torch.where(v.float().isnan(), 0x7F, v.view(torch.uint8).int())


def _check_fp8(ex, rows, k, window=-14):
    """An FP8 expansion of the exact values ``rows`` [R, k]: every value held exactly or, where it is below the
    FP8 window (2^(row_exp + window)), flushed to zero; NaN where the reference is NaN; ``row_ok`` = nothing
    flushed. E4M3 has no Inf: a value that is Inf in the reference (rceil's 4 * 2^126) is NaN there, and not ok."""
    got = (ex.values.float() * torch.exp2(ex.row_exp.float())[:, None])[:, :k]
    lost = rows.isinf() if ex.values.dtype == torch.float8_e4m3fn else torch.zeros_like(rows, dtype=torch.bool)
    nan = rows.isnan() | lost
    assert torch.equal(got.isnan(), nan)
    flushed = (got != rows) & ~nan
    assert torch.equal(got[flushed], torch.zeros_like(got[flushed]))
    below = rows.abs() < torch.exp2(ex.row_exp.float() + window)[:, None]
    assert bool((below | ~flushed).all()), "a value inside the FP8 window was flushed"
    assert torch.equal(ex.row_ok.cpu(), ~(flushed | lost).any(1).cpu())


# ---------------------------------------------------------------------------------------------- CPU interpreter
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("kind", ["random", "outliers", "special"])
def test_quantize_bit_exact_small(name, kind):
    _check_pack(_inputs(kind, (6, 200), device="cpu" if ON_CPU else DEV), name, -1)
    _check_resq(_inputs(kind, (6, 200), device="cpu" if ON_CPU else DEV), name)
    _check_pack(_inputs(kind, (130, 5), device="cpu" if ON_CPU else DEV), name, 0)  # column variant


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4_rceil"])
def test_fp8_forms_at_the_edges(name):
    """MXFP4's FP8 forms (E5M2 rows, E4M3 weights) bit for bit the reference's where row scales and values reach
    their edges: a row whose largest finite value sits in a NaN block and one whose largest sits in an Inf block
    (the row scale comes from the finite blocks only), a row of NaN blocks, and values near the largest bf16
    (rceil's X = 126, where the reference's 4 * 2^126 and 6 * 2^126 are fp32's Inf)."""
    x = _inputs("random", (5, 128), device="cpu" if ON_CPU else DEV)
    x[0, 3], x[0, 4] = float("nan"), 1e6
    x[1, 40], x[1, 41] = float("inf"), -1e6
    x[2, ::32] = float("nan")
    x[3, 70], x[3, 71], x[3, 100] = 3.0e38, -2.5e38, 1.0e38
    x[4, 0], x[4, 33] = 3.3e38, -1.2e38
    _check_pack(x, name, -1)


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4_rceil"])
def test_mxfp4_rounding_every_bf16_value(name):
    """Every bf16 value in [0, 6] (and fp32 values next to each rounding tie) in blocks whose maximum is 6.0, so the
    kernel's E2M1 rounding sees each of them unscaled; rows of 7.99 blocks exercise the cap at 6.0."""
    v = torch.arange(0, 0x40C1, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    vals = torch.cat([v, ties, torch.nextafter(ties, torch.zeros(7)), torch.nextafter(ties, torch.full((7,), 8.0)),
                      -v, torch.linspace(5.5, 7.99, 200)])
    vals = torch.cat([vals, torch.zeros(-vals.numel() % 31)]).reshape(-1, 31)
    top = torch.full((vals.shape[0], 1), 6.0)
    top[-8:] = 7.99
    x = torch.cat([top, vals], dim=1).to("cpu" if ON_CPU else DEV)
    _check_pack(x, name, -1)


@pytest.mark.parametrize("name", FORMATS)
def test_quantize_few_rows_split_along_k(name):
    """Decode-sized activations (few rows): programs share out each row's K tiles (with and without prefetch, as
    many programs per row as k_split gives or a tile's fifth item asks); codes, scales and the BF16 expansions stay
    bit-identical, for the plain and the fused ResQ kernel (its bf16 sum alone too)."""
    from megatron_fp4.kernels._common import cdiv, k_split

    f = get_format(name)
    x = _inputs("outliers", (2, 3000), device="cpu" if ON_CPU else DEV)
    assert k_split(2, cdiv(3000, 256), x.device) > 1
    ref = f.quantize(x)
    qq, ss = resq_components(x.cpu(), name, "2:4")
    # (the fifth item: programs per row block, here one per K tile and more than there are: capped at the tiles)
    for cfg in (None, (1, 256, 4, 0), (1, 256, 4, 1), (1, 256, 4, 0, 64), (1, 512, 2, 1, 3)):
        for expand in (None, "bf16"):
            out = quantize(x, name, expand=expand, config=cfg)
            q = out[0] if expand else out
            assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales)
            if expand:
                assert torch.equal(out[1].values.float()[:, :3000].cpu(), ref.dequantize().float().cpu())
        q, r, eq, er = resq_quantize(x, name, expand="bf16", config=cfg)
        assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales)
        assert torch.equal(eq.values.float()[:, :3000].cpu(), qq) and torch.equal(er.values.float()[:, :3000].cpu(), ss)
        es = resq_quantize(x, name, expand="sum", config=cfg, packed=False)[2]
        assert torch.equal(es.values[:, :3000].cpu(), (qq + ss).to(torch.bfloat16))
    _check_pack(x, name, -1)  # MXFP4 "native": one program per row (the row scale scans the whole row)


def test_decode_quantize_tiles():
    """The decode step's activation tiles (session 38's sweep): a 7B fc2 input (64 x 18944) two rows per program and
    a program per 512-value K tile; smaller ones (64 x 3584, 16 x 18944) one row per program in 1024-value steps,
    shared out by k_split; a given tile's fifth item sets the programs per row block (at most one per K tile)."""
    from megatron_fp4.kernels._common import k_split
    from megatron_fp4.kernels.quantize import _fixed_launch

    big = torch.empty((64, 18944), dtype=torch.bfloat16)
    assert _fixed_launch(big, 18944, None, row_pass=False) == (True, (2, 512, 4, 0), (32, 37))
    for shape in ((64, 3584), (16, 18944)):
        x = torch.empty(shape, dtype=torch.bfloat16)
        tiles = -(-shape[1] // 1024)
        assert _fixed_launch(x, shape[1], None, False) == (True, (1, 1024, 4, 0),
                                                             (shape[0], k_split(shape[0], tiles, x.device)))
    assert _fixed_launch(big, 18944, None, row_pass=True)[2] == (32, 1)  # a row pass: one program per row block
    assert _fixed_launch(big, 18944, (4, 256, 2, 1, 5), False) == (True, (4, 256, 2, 1), (16, 5))
    assert _fixed_launch(big, 18944, (4, 256, 2, 1, 500), False)[2] == (16, 74)


@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_quantize_prefetch_tiles_small(name):
    """The prefetching loop (next K tile loaded before the current one is worked on) over several K steps."""
    x = _inputs("outliers", (5, 700), device="cpu" if ON_CPU else DEV)
    _check_pack(x, name, -1, config=(2, 128, 4, 1))
    _check_pack(x.t().contiguous(), name, 0, config=(64, 64, 4, 1))
    _check_resq(x, name, config=(2, 128, 4, 1))


def _check_resq(x, name, config=None):
    """Packed Q(X), S(Q(R)) and the one-operand BF16 sum (resq_combine="bf16") equal the reference bit for bit."""
    q, r, eq, er = resq_quantize(x, name, expand="bf16", config=config)
    q2, r2, _, _ = resq_quantize_reference(x, get_format(name), None)
    for a, b in ((q, q2), (r, r2)):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    q3, r3, es, none = resq_quantize(x, name, expand="sum", config=config)
    assert none is None and torch.equal(q3.codes, q2.codes) and torch.equal(r3.codes, r2.codes)
    want = resq_activation(x, name, "2:4", out_dtype=torch.bfloat16)
    got = es.values[:, :x.shape[1]]
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    # the sum alone (the decode GEMMs' operand): the kernel without its packed outputs writes the same bits
    nq, nr, only, nn = resq_quantize(x, name, expand="sum", config=config, packed=False)
    assert nq is None and nr is None and nn is None
    assert torch.equal(only.values.view(torch.int16), es.values.view(torch.int16))
    if name != "hif4":  # MXFP4 "native": both E5M2 operands on one row scale, flushes as the twin's
        _, _, en, enr = resq_quantize(x, name, expand="native", config=config)
        _, _, tn, tnr = resq_quantize_reference(x, get_format(name), "native")
        fin = ~q2.dequantize().isnan().any(1)  # rows with a NaN block: see _check_pack
        assert torch.equal(en.row_exp[fin], tn.row_exp[fin]) and torch.equal(enr.row_exp, en.row_exp)
        assert torch.equal(en.row_ok[fin], (tn.row_ok & tnr.row_ok)[fin])
        for a, b in ((en, tn), (enr, tnr)):
            assert torch.equal(_fp8_bytes(a.values)[fin], _fp8_bytes(b.values)[fin])


def test_quantize_autotuning_candidates():
    """The row quantizer tunes over row tiles for row-major inputs and column tiles for transposed ones, the
    prefetching tiles included (both formats' loops prefetch, HiF4's expansion-only loop too)."""
    from megatron_fp4.kernels import quantize as qm
    from megatron_fp4.kernels._common import TILE_RECIP

    # under megatron_fp4.kernels._launch.fast on a GPU
    tuner = getattr(qm._hif4_quant_tuned, "kernel", qm._hif4_quant_tuned)

    def tiles(stride_xk, **kw):
        return {(c.kwargs["BR"], c.kwargs["BK"], c.num_warps, c.kwargs["PREFETCH"])
                for c in qm._prune(tuner.configs, {"stride_xk": stride_xk}, **kw)}

    assert tiles(1, PACKED=1, **TILE_RECIP) == set(qm._ROW_CFGS)
    assert tiles(4096, PACKED=1, **TILE_RECIP) == set(qm._COL_CFGS)
    assert tiles(1, PACKED=0, **TILE_RECIP) == set(qm._ROW_CFGS) == tiles(1, PACKED=0, RCEIL=False)


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4_rceil"])
def test_fp8_expansion_flushes_as_the_twin(name):
    """Finite rows whose blocks span more binades than E5M2 (E4M3) holds: the quantize and ResQ kernels flush the
    same values to zero as the PyTorch twin (expand_packed / the reference ResQ), byte for byte, and flag the
    rows."""
    x = _inputs("random", (6, 200), device="cpu" if ON_CPU else DEV, seed=4)
    x[1] *= 1e-12
    x[1, 7] = 1e6
    x[4, 100:] *= 1e-10
    for j, e in enumerate((7, 8, 9, 10, 16)):  # row 5's blocks in E4M3's subnormal range and below it
        x[5, 32 * (j + 1):32 * (j + 2)] *= 2.0 ** -e
    _check_pack(x, name, -1)
    _check_resq(x, name)
    _, ex = quantize(x, name, expand="native")
    assert ex.row_ok.tolist() == [True, False, True, True, False, True]
    _, e4 = quantize(x, name, expand="e4m3", packed=False)
    bits = e4.values.view(torch.uint8)
    assert bool((((bits & 0x78) == 0) & ((bits & 7) != 0)).any()), "no E4M3 subnormal was written"
    assert e4.row_ok.tolist() == [True, False, True, True, False, False]


@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_gemms_exact_small(name):
    f = get_format(name)
    a = _inputs("random", (40, 192), seed=1)
    b = _inputs("random", (24, 192), seed=2)
    a[3] *= 1e-12
    a[3, 5] = 1e6  # MXFP4: row 3's blocks span too many binades for E5M2: its small values are flushed
    ref = _ref_mm(a, b, f)
    qa, ea = quantize(a, name, expand="native")
    qb, eb = quantize(b, name, expand="native")
    if name == "mxfp4":
        assert not bool(ea.row_ok[3]) and bool(ea.row_ok.sum() == 39)
        _check_fp8(ea, qa.dequantize().float(), 192)
        ref_flushed = (ea.values.float() * torch.exp2(ea.row_exp.float())[:, None]).double().cpu()
        ref_flushed = ref_flushed @ qb.dequantize().double().cpu().t()
        assert _rel(mm_expanded(ea, eb).cpu()[3], ref_flushed[3]) < 1e-12  # the product of the held values
    assert _rel(mm_expanded(ea, eb).cpu(), ref) < 1e-6  # and what was flushed is negligible
    assert _rel(packed_matmul(qa, qb).cpu(), ref) < 1e-6
    _, eab = quantize(a, name, expand="bf16")  # decode W4A4: the activations' exact BF16 expansion
    assert _rel(w4_matmul(eab.values, qb).cpu(), ref) < 1e-6
    split = {"BN": 16, "num_warps": 4, "num_stages": 1, "SPLIT_K": 3}  # split-K: fp32 atomic adds
    assert _rel(w4_matmul(eab.values, qb, config=split).cpu(), ref) < 1e-6
    assert _rel(dispatch.fp4_gemm(a, b, name).cpu(), ref) < 1e-6


@pytest.mark.parametrize("name", FORMATS)
def test_w4_decode_edge_cases(name):
    """The decode kernel's bit-level unpack on the values that stress it: weights needing MXFP4 block scales
    above 2^1 (the two-factor path), scales at the bottom of E8M0 (subnormal products), NaN blocks/units, zero
    rows, a K that ends half-way through a 64-value step, N not a multiple of the tile, and the ResQ residual."""
    from megatron_fp4.kernels.decode_gemm import needs_wide_decode

    f = get_format(name)
    w = _inputs("outliers", (40, 200), seed=8)
    x = _inputs("random", (5, 200), seed=9).to(torch.bfloat16)
    xr = _inputs("random", (5, 200), seed=10).to(torch.bfloat16)
    qn = f.quantize(w)
    assert not needs_wide_decode(qn) or name != "hif4"
    w[0, :40] *= 1e3  # magnitudes >= 16: MXFP4 block scales above 2^1
    w[1] = w[1] * (1e-38 if name != "hif4" else 1e-14)  # E8M0 scale bytes 0-1; HiF4's smallest E6M2 codes
    w[2, 70] = float("nan")
    w[3] = 0.0
    qw = f.quantize(w)
    assert needs_wide_decode(qw) == (name != "hif4")
    kp = qw.codes.shape[-1] * 2
    wq = qw.dequantize().double().cpu()
    xp = torch.nn.functional.pad(x, (0, kp - 200))
    rp = torch.nn.functional.pad(xr, (0, kp - 200))
    ref = xp.double().cpu()[:, :200] @ wq.t() + rp.double().cpu()[:, :200] @ wq.t()
    for cfg in (None, {"BN": 16, "num_warps": 4, "num_stages": 1, "SPLIT_K": 3, "XPERM": True}):
        got = w4_matmul(xp, qw, rp, config=cfg).double().cpu()
        assert torch.equal(got.isnan(), ref.isnan()) and bool(got[:, 2].isnan().all())
        keep = ~ref.isnan()
        assert _rel(got[keep], ref[keep]) < 1e-6
        assert bool((got[:, 3] == 0).all())
        tiny = got[:, 1] / ref[:, 1]  # the smallest weights, relative to their own size
        assert bool(((tiny - 1).abs() < 1e-6).all())
    nc = w4_matmul(xp.t().contiguous().t(), qw, rp.t().contiguous().t()).double().cpu()  # column-major inputs
    assert _rel(nc[~ref.isnan()], ref[~ref.isnan()]) < 1e-6
    if name != "hif4":  # without the two-factor path the large blocks come out wrong: the flag is needed
        bad = w4_matmul(xp, qw, rp, wide=False)[:, 0].double().cpu()
        assert not torch.allclose(bad, ref[:, 0], rtol=1e-3)


@pytest.mark.parametrize("name", FORMATS)
def test_resq_fused_matches_reference(name):
    f = get_format(name)
    x = _inputs("outliers", (72, 136), seed=3)
    w = _inputs("random", (24, 136), seed=4)
    _check_resq(x, name)
    q, r, eq, er = resq_quantize(x, name, expand="bf16")
    qq, ss = resq_components(x.cpu(), name, "2:4")
    assert torch.equal(eq.values.float()[:, :136].cpu(), qq)
    assert torch.equal(er.values.float()[:, :136].cpu(), ss)
    wq = f.fake_quantize(w.float().cpu()).double()
    ref = qq.double() @ wq.t() + ss.double() @ wq.t()
    qw, ew = quantize(w, name, expand="native")
    ref_sum = (qq + ss).to(torch.bfloat16).double() @ wq.t()
    for m in (16, 72):  # decode kernel, then the pre-expanded concatenated-K GEMM (FP8 promoted: exact mode)
        assert _rel(resq_matmul(x[:m], qw, ew, promote=32).cpu(), ref[:m]) < 1e-6
        # one GEMM on the BF16 sum (for the E5M2 weight expansion, against the weight's BF16 expansion)
        assert _rel(resq_matmul(x[:m], qw, ew, combine="bf16").cpu(), ref_sum[:m]) < 1e-6
    with pytest.raises(ValueError, match="combine='fp16'.*'exact', 'bf16'"):
        resq_matmul(x, qw, combine="fp16")
    # through dispatch with an FP8-mode MXFP4 weight: its BF16 expansion is made once, on the first prefill call
    pw = dispatch.prepare_weight(w, name, mode="fp8" if name != "hif4" else "exact")
    for _ in range(2):
        assert _rel(dispatch.linear(x, pw, resq="2:4", resq_combine="bf16").cpu(), ref_sum) < 1e-6
    assert pw.bf16_expanded() is (pw._bf16 if name != "hif4" else pw.expanded)
    with pytest.raises(ValueError, match="expand='fp8'.*'sum'"):
        resq_quantize(x, name, expand="fp8")


def test_e4m3_weight_expansion_and_row_fallback():
    """MXFP4 weights as E4M3 (cuBLAS's FP8 weight operand): exact relative to the row's power of two, rows whose
    blocks span more than E4M3's window flagged, and the GEMM recomputes those output columns exactly."""
    f = get_format("mxfp4")
    w = _inputs("random", (32, 136), seed=5)  # 32 rows: cuBLAS takes it on a GPU
    w[3] *= 1e-6
    w[3, 2] = 10.0  # row 3's blocks span ~27 binades: E5M2 may hold it, E4M3 (14) cannot
    qw = f.quantize(w)
    e4 = expand_packed(qw, "e4m3")
    assert e4.values.dtype == torch.float8_e4m3fn
    keep = torch.arange(32, device=w.device) != 3
    assert not bool(e4.row_ok[3]) and bool(e4.row_ok[keep].all())
    _check_fp8(e4, qw.dequantize().float(), 136, window=-8)  # E4M3 (subnormal steps of 2^-9) holds E2M1 from 2^-8
    x = _inputs("outliers", (20, 136), seed=6)
    qx, ex = quantize(x, "mxfp4", expand="native")
    # the flushed 1e-6-scale weights cost < 1e-6; exact in the interpreter (fp32 dots), on a GPU cuBLAS's FP8
    # accumulation is approximate (see PERFORMANCE.md)
    assert _rel(mm_expanded(ex, e4, promote=32).cpu(), _ref_mm(x, w, f)) < (1e-6 if ON_CPU else 1e-4)
    with pytest.raises(ValueError, match="mode='e5m3'"):
        expand_packed(qw, "e5m3")
    with pytest.raises(ValueError, match="impl='cuda'"):
        mm_expanded(ex, e4, impl="cuda")


@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_training_backend_expansion_only_and_strided(name, host_reads):
    """The training GEMMs' quantizer writes only the expansion (packed=False), equal to the packed call's, and
    reads transposed views as they are; kernels_backend.KernelBackend's GEMMs (exact; MXFP4 fp8 mode in the
    interpreter's exact dots) equal the reference's, and the FP4 linear's forward and gradients through it equal
    the reference's, with no host sync."""
    from megatron_fp4 import ops
    from megatron_fp4.linear import fp4_linear
    from megatron_fp4.recipe import recipe_for_format

    dev = "cpu" if ON_CPU else DEV
    x = _inputs("outliers", (96, 136), device=dev)
    for xin in (x, _inputs("special", (70, 130), device=dev)):  # NaN/Inf units, zeros, subnormals
        for expand in ("bf16", "native"):
            q, e = quantize(xin, name, expand=expand)
            none, e2 = quantize(xin, name, expand=expand, packed=False)
            assert none is None and torch.equal(e2.values.view(torch.uint8), e.values.view(torch.uint8))
    xt = x.t()  # [136, 96], strides (1, 136)
    ref = quantize(xt.contiguous(), name, expand="bf16")[1].values
    assert torch.equal(quantize(xt, name, expand="bf16", packed=False)[1].values, ref)
    with pytest.raises(ValueError, match="packed=False needs expand"):
        quantize(x, name, packed=False)
    with pytest.raises(ValueError, match="packed=False is resq_quantize's sum-only form"):
        resq_quantize(x, name, expand="bf16", packed=False)
    from megatron_fp4.kernels.quantize import _row_major

    assert torch.equal(_row_major(xt), xt.contiguous())  # what large transposed operands go through on a GPU
    if not ON_CPU:
        big = _inputs("outliers", (4096, 1000), dtype=torch.bfloat16).t()
        assert torch.equal(quantize(big, name, expand="bf16", packed=False)[1].values,
                           quantize(big.contiguous(), name, expand="bf16")[1].values)
    be = kernels_backend.KernelBackend()
    f = get_format(name)
    w = _inputs("random", (40, 136), device=dev, seed=3)
    for mode in (("exact", "fp8") if name == "mxfp4" else ("exact",)):
        qa = be.quantize(x, f, "nearest", None, mode, False)
        qb = be.quantize(w, f, "nearest", None, mode, True)
        assert _rel(be.matmul(qa, qb, torch.float32, mode).cpu(), _ref_mm(x, w, f)) < (1e-6 if ON_CPU else 1e-4)
    # both layouts: x along K, then x.t() (the column kernel); FP8 modes: X^T as wgrad's second operand (b_cols)
    # takes a weight's form (E4M3 where cuBLAS then takes it), dY^T E5M2, both with their scales
    for mode in (("exact", "fp8") if name == "mxfp4" else ("exact",)):
        for b_cols in (False, True):
            got = be.quantize_both(x, f, mode, b_cols)
            want = (be.quantize(x, f, "nearest", None, mode, False), be.quantize(x.t(), f, "nearest", None, mode,
                                                                                   b_cols))
            for g, w_ in zip(got, want):
                assert g.expanded.values.dtype == w_.expanded.values.dtype, (mode, b_cols)
                assert torch.equal(g.expanded.values.view(torch.uint8), w_.expanded.values.view(torch.uint8))
                for field in ("row_exp", "row_ok"):
                    a, b = getattr(g.expanded, field), getattr(w_.expanded, field)
                    assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (mode, b_cols, field)
    assert be.quantize(x, f, "stochastic", None, "exact", False) is NotImplemented
    assert be.quantize(x, get_format("nvfp4"), "nearest", None, "exact", False) is NotImplemented
    recipe = recipe_for_format(name)
    xs, ws = x[:64].reshape(4, 16, 136).clone(), w.clone()

    def fwd_bwd():
        xr, wr = xs.clone().requires_grad_(True), ws.clone().requires_grad_(True)
        y = fp4_linear(xr, wr, recipe=recipe)
        (y * y).sum().backward()
        return y.detach(), xr.grad, wr.grad

    with ops.use_reference_backend():
        want = fwd_bwd()
    dtype = torch.device(dev).type
    prev = ops.fp4_gemm_backend_for(dtype)
    ops.register_fp4_gemm_backend(dtype, be)
    try:
        with ops.quantized_weight_cache(), host_reads() as reads:
            got = fwd_bwd()
        assert reads.count == 0  # no host sync in an FP4 linear's forward and backward (a GPU would wait there)
        if name == "mxfp4":  # the FP8 mode too: its rows are no longer checked on the host
            with ops.quantized_weight_cache(), host_reads() as reads:
                recipe = dataclasses.replace(recipe, gemm_mode="fp8")
                got8 = fwd_bwd()
            assert reads.count == 0
            for a, b in zip(got8, want):  # exact dots in the interpreter; cuBLAS's FP8 accumulation on a GPU
                assert _rel(a.cpu(), b.cpu()) < (1e-6 if ON_CPU else 1e-2)
            recipe = recipe_for_format(name)
    finally:
        ops.unregister_fp4_gemm_backend(dtype)
        if prev is not None:
            ops.register_fp4_gemm_backend(dtype, prev)
    for a, b in zip(got, want):
        assert _rel(a.cpu(), b.cpu()) < (1e-6 if ON_CPU else 1e-3)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("kind", ["outliers", "special"])
def test_column_kernel_bit_exact(name, kind):
    """A transposed view's exact expansion (the wgrad/dgrad operands X^T, dY^T, W^T), by ``quantize`` (the column
    kernel for MXFP4, a transposed copy and the row kernel for HiF4) and by the column kernel itself for either
    format, is bit for bit the reference's quantization of the transposed copy: ragged
    sizes (rows not a multiple of 64: zero padding; columns not a multiple of the tile), NaN/Inf units, a row
    stride wider than the rows."""
    from megatron_fp4.kernels import quantize as qm
    from megatron_fp4.kernels.quantize import quantize_reference

    dev = "cpu" if ON_CPU else DEV
    f = get_format(name)
    for rows, cols in ((150, 72), (64, 200)):
        x = _inputs(kind, (rows, cols + 8), device=dev)[:, :cols]  # row stride cols + 8
        want = quantize_reference(x.t().contiguous().cpu(), f, 1, "bf16")[1].values
        got = quantize(x.t(), f, expand="bf16", packed=False)[1].values
        by_kernel = qm._quantize_columns(x.t(), f, None).values  # the column kernel, whichever route quantize() takes
        nan = want.isnan()
        for g in (got.cpu(), by_kernel.cpu()):
            assert g.shape == want.shape and torch.equal(g.isnan(), nan)
            _exact(g[~nan].view(torch.int16), want[~nan].view(torch.int16), f"{rows} x {cols}")  # zeros' signs


@pytest.mark.parametrize("name", FORMATS)
def test_both_layouts_bit_exact(name):
    """A training operand's two expansions from ``quantize_both_layouts`` (HiF4: the row pass also writes x^T,
    which a second row pass quantizes) are the reference's quantizations of x along K and of x^T along R, bit for
    bit, at every tile the fused HiF4 pass may pick: ragged sizes, NaN/Inf units, a row stride wider than the rows.
    The kernel backend's ``quantize_both`` serves them."""
    from megatron_fp4.kernels import quantize as qm
    from megatron_fp4.kernels.quantize import quantize_reference

    dev = "cpu" if ON_CPU else DEV
    f = get_format(name)
    for rows, cols in ((150, 72), (40, 1100)):
        x = _inputs("special", (rows, cols + 8), device=dev, dtype=torch.bfloat16)[:, :cols]
        want_r = quantize_reference(x.cpu(), f, 1, "bf16")[1].values
        want_c = quantize_reference(x.t().contiguous().cpu(), f, 1, "bf16")[1].values
        cfgs = qm._ROW_T_CFGS + [(4, 512, 4, 0), (1, 1024, 4, 0)] if name == "hif4" else [None]
        for cfg in cfgs:
            got_r, got_c = (e.values.cpu() for e in qm.quantize_both_layouts(x, f, config=cfg))
            for got, want in ((got_r, want_r), (got_c, want_c)):
                nan = want.isnan()
                assert got.shape == want.shape and torch.equal(got.isnan(), nan)
                _exact(got[~nan].view(torch.int16), want[~nan].view(torch.int16), f"{rows} x {cols} {cfg}")
    if not ON_CPU:
        from megatron_fp4.ops.kernels_backend import KernelBackend

        x = _inputs("outliers", (2048, 1536), dtype=torch.bfloat16)  # large enough to autotune
        q_r, q_c = KernelBackend().quantize_both(x, f, "exact")
        _exact(q_r.expanded.values.view(torch.int16), quantize(x, f, expand="bf16")[1].values.view(torch.int16))
        _exact(q_c.expanded.values.view(torch.int16),
               quantize(x.t().contiguous(), f, expand="bf16")[1].values.view(torch.int16))


@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_requantize_writes_into_the_same_buffers(name):
    """``quantize(out=)`` and ``KernelBackend.requantize`` (what CUDA graphs' persistent weights are refreshed by)
    write a new weight's quantization into an earlier result's buffers, bit for bit what a fresh call returns, in
    every expansion the training GEMMs use (MXFP4's FP8 weight form with its row exponents included), W and W^T
    also at once (``requantize_both``); a buffer of another shape or dtype is refused."""
    dev = "cpu" if ON_CPU else DEV
    f = get_format(name)
    w_old, w_new = _inputs("outliers", (48, 136), device=dev), _inputs("special", (48, 136), device=dev, seed=4)
    expands = ["bf16"] + (["native", "e4m3"] if name == "mxfp4" else [])
    for expand in expands:
        for view in (lambda t: t, lambda t: t.t()):  # W and W^T (a strided view)
            out = quantize(view(w_old), f, expand=expand, packed=False)[1]
            ptrs = [t.data_ptr() for t in out if t is not None]
            got = quantize(view(w_new), f, expand=expand, packed=False, out=out)[1]
            want = quantize(view(w_new), f, expand=expand, packed=False)[1]
            assert [t.data_ptr() for t in got if t is not None] == ptrs
            for a, b in zip(got, want):
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), expand  # bits: NaN units
    with pytest.raises(ValueError, match="out= holds"):
        quantize(w_new[:, :64], f, expand="bf16", packed=False, out=quantize(w_old, f, expand="bf16",
                                                                             packed=False)[1])
    with pytest.raises(ValueError, match="packed=False"):
        quantize(w_new, f, expand="bf16", out=quantize(w_old, f, expand="bf16", packed=False)[1])
    be = kernels_backend.KernelBackend()
    for mode in (("exact", "fp8") if name == "mxfp4" else ("exact",)):
        q = be.quantize(w_old, f, "nearest", None, mode, True)
        before = q.expanded.values.data_ptr()
        assert be.requantize(w_new, f, mode, q) is q and q.expanded.values.data_ptr() == before
        fresh = be.quantize(w_new, f, "nearest", None, mode, True)
        assert torch.equal(q.expanded.values.view(torch.uint8), fresh.expanded.values.view(torch.uint8))
        # W and W^T at once (the persistent weights' refresh; on a GPU one CUDA kernel reading W once): into the
        # same buffers, the forms (MXFP4 FP8: E4M3 W, E5M2 W^T here: 136 rows) and bits of two fresh calls
        q_t = be.quantize(w_old.t(), f, "nearest", None, mode, True)
        ptrs = [t.data_ptr() for e in (q.expanded, q_t.expanded) for t in e if t is not None]
        w2 = _inputs("outliers", (48, 136), device=dev, seed=5)
        assert be.requantize_both(w2, f, mode, q, q_t) == (q, q_t)
        assert [t.data_ptr() for e in (q.expanded, q_t.expanded) for t in e if t is not None] == ptrs
        # quantize_weight_both (an eager schedule's W and W^T, ops.quantized_weight_cache(both_layouts=True)):
        # the forms and bits of the two calls too
        for got, view in ((q, w2), (q_t, w2.t()), *zip(be.quantize_weight_both(w2, f, mode), (w2, w2.t()))):
            fresh = be.quantize(view, f, "nearest", None, mode, True).expanded
            for a, b in zip(got.expanded, fresh):
                assert (a is None) == (b is None) and (a is None or torch.equal(a.view(torch.uint8),
                                                                                b.view(torch.uint8))), mode


def test_dispatch_registers_and_falls_back():
    from megatron_fp4 import ops

    a = torch.randn(8, 64)
    b = torch.randn(4, 64)
    for name in ("hif4", "mxfp4", "nvfp4"):
        f = get_format(name)
        ref = ops.reference_fp4_gemm(a, b, f, f)
        assert torch.allclose(dispatch.fp4_gemm(a, b, name), ref, rtol=1e-6, atol=1e-6)
    # the ops backend declines what it does not implement
    assert kernels_backend.ops_backend(a, b, get_format("hif4"), get_format("hif4"), "stochastic", "nearest") \
        is NotImplemented
    assert kernels_backend.ops_backend(a, b, get_format("nvfp4"), get_format("nvfp4"), "nearest", "nearest") \
        is NotImplemented
    w = dispatch.prepare_weight(b, "hif4")
    for act in ("fp4", "bf16"):
        for rq in ("none", "2:4"):
            if act == "bf16" and rq != "none":
                continue
            y = dispatch.linear(a, w, resq=rq, activations=act)
            assert y.shape == (8, 4) and torch.isfinite(y).all()
    with pytest.raises(ValueError, match="resq_combine='sum'.*'exact', 'bf16'"):
        dispatch.linear(a, w, resq="2:4", resq_combine="sum")


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("kind", ["random", "outliers", "special"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_quantize_bit_exact(name, kind, dtype):
    for shape, dim in (((257, 1000), -1), ((1000, 257), 0), ((64, 2048), -1), ((3, 5, 96), -1), ((96, 33), 0)):
        _check_pack(_inputs(kind, shape, dtype=dtype), name, dim)
    _check_resq(_inputs(kind, (257, 1000), dtype=dtype), name)


@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_training_quantizer_every_tuned_config(name):
    """The training backend's quantizer (expansion only, packed=False: BF16, and MXFP4's E5M2 / E4M3 for the FP8
    modes) at every row and column tile autotuning may pick, and the column kernel at each of its tiles, write the
    packed call's expansion bit for bit, K not a multiple of any tile; on the CPU in Triton's interpreter (the GPU
    test below compiles them)."""
    from megatron_fp4.kernels import quantize as qm

    x = _inputs("outliers", (40, 1100), dtype=torch.bfloat16)
    for expand in ("bf16",) + (("native", "e4m3") if name == "mxfp4" else ()):
        for dim, cfgs in ((-1, qm._ROW_CFGS), (0, qm._COL_CFGS)):
            want = quantize(x, name, dim=dim, expand=expand)[1]
            for cfg in cfgs:
                got = quantize(x, name, dim=dim, expand=expand, packed=False, config=cfg)[1]
                _exact(got.values.view(torch.uint8), want.values.view(torch.uint8), f"{expand} {dim} {cfg}")
                if got.row_exp is not None:
                    _exact(got.row_exp, want.row_exp, f"row_exp {expand} {dim} {cfg}")
    want = quantize(x, name, dim=0, expand="bf16")[1].values  # the column kernel: x along its rows, from x itself
    for cfg in qm.COL_KERNEL_CFGS:
        got = qm._quantize_columns(x.t(), get_format(name), None, config=cfg).values
        _exact(got.view(torch.uint8), want.view(torch.uint8), f"column kernel {cfg}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_gpu_quantize_every_tuned_config(name):
    """Autotuning may pick any of these tiles: each one is bit-exact (row and column variants)."""
    from megatron_fp4.kernels import quantize as qm

    x = _inputs("outliers", (300, 1100), dtype=torch.bfloat16)
    for cfg in qm._ROW_CFGS:
        _check_pack(x, name, -1, config=cfg)
    for cfg in qm._COL_CFGS:
        _check_pack(x, name, 0, config=cfg)
    for cfg in qm._ROW_CFGS:  # the fused ResQ kernel autotunes over the same tiles
        _check_resq(x, name, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMATS)
def test_gpu_training_operands_every_config(name):
    """The training operands' quantizers at every tile autotuning may pick, compiled: the expansion-only row
    kernel (row and column tiles) and the column kernel (a transposed view, read from the row-major tensor) write
    the packed call's expansion bit for bit (signed zeros included), on NaN/Inf units and autotuned sizes too."""
    from megatron_fp4.kernels import quantize as qm

    f = get_format(name)
    x = _inputs("special", (300, 1100), dtype=torch.bfloat16)
    for dim, cfgs in ((-1, qm._ROW_CFGS), (0, qm._COL_CFGS)):
        want = quantize(x, name, dim=dim, expand="bf16")[1].values
        for cfg in cfgs:
            got = quantize(x, name, dim=dim, expand="bf16", packed=False, config=cfg)[1].values
            _exact(got.view(torch.uint8), want.view(torch.uint8), str(cfg))
    big = _inputs("outliers", (2048, 1536), dtype=torch.bfloat16)  # large enough to autotune
    for xin in (x, big, big[:, :1000]):
        want = quantize(xin.t().contiguous(), name, expand="bf16")[1].values
        for cfg in qm.COL_KERNEL_CFGS + [None]:
            got = qm._quantize_columns(xin.t(), f, None, config=cfg).values
            _exact(got.view(torch.uint8), want.view(torch.uint8), f"column kernel {cfg}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
@pytest.mark.parametrize("m", [16, 64, 300, 1024])
def test_gpu_gemm_exact(name, m):
    f = get_format(name)
    K, N = 2048, 384
    a = _inputs("outliers", (m, K), seed=m)
    b = _inputs("random", (N, K), seed=7) * 0.02
    if m == 300:
        a[5] *= 1e-12
        a[5, 9] = 1e8
    ref = _ref_mm(a, b, f).cuda()
    qa, ea = quantize(a, name, expand="bf16")
    qb, eb = quantize(b, name, expand="bf16")
    assert _rel(mm_expanded(ea, eb), ref) < 1e-5  # the exact path: BF16 tensor cores, fp32 accumulation
    if name == "mxfp4":  # FP8 E5M2 path: exact products, Hopper's reduced-precision FP8 accumulation
        qa8, ea8 = quantize(a, name, expand="native")
        qb8, eb8 = quantize(b, name, expand="native")
        errs = {p: _rel(mm_expanded(ea8, eb8, promote=p), ref) for p in (0, 128, 32)}
        print(f"mxfp4 fp8 m={m}: rel error by promote interval {errs}")
        assert errs[0] < 1e-3 and errs[32] < 1e-5
        assert _rel(dispatch.fp4_gemm(a, b, name, mode="fp8"), ref) < 1e-3
    assert _rel(packed_matmul(qa, qb), ref) < 1e-5
    _, eab = quantize(a, name, expand="bf16")
    if m <= 64:
        assert _rel(w4_matmul(eab.values, qb), ref) < 1e-5
    assert _rel(dispatch.fp4_gemm(a, b, name), ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_gpu_resq_and_w4a16(name):
    f = get_format(name)
    x = _inputs("outliers", (512, 1024), seed=11)
    w = _inputs("random", (256, 1024), seed=12)
    q, r, eq, er = resq_quantize(x, name, expand="native")
    q2, r2, _, _ = resq_quantize_reference(x, f, None)
    assert torch.equal(q.codes, q2.codes) and torch.equal(r.codes, r2.codes) and torch.equal(r.scales, r2.scales)
    qq, ss = resq_components(x, name, "2:4")
    wq = f.fake_quantize(w.float()).double()
    ref = qq.double() @ wq.t() + ss.double() @ wq.t()
    qw, ew = quantize(w, name, expand="bf16")
    ref_sum = (qq + ss).to(torch.bfloat16).double() @ wq.t()
    for m in (16, 64, 512):
        assert _rel(resq_matmul(x[:m], qw, ew), ref[:m]) < 1e-5
        assert _rel(resq_matmul(x[:m], qw, ew, combine="bf16"), ref_sum[:m]) < 1e-5
    if name == "mxfp4":  # FP8 E5M2 operands, partial sums promoted to fp32 every 32 K-elements
        _, ew8 = quantize(w, name, expand="native")
        assert _rel(resq_matmul(x, qw, ew8, promote=32), ref) < 1e-5
    xb = x[:64].to(torch.bfloat16)
    ref16 = xb.double() @ wq.t()
    assert _rel(w4_matmul(xb, qw), ref16) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_gpu_cublas_paths(name):
    """The expansions through cuBLAS: BF16 exact like our Triton GEMM (plain and ResQ); MXFP4 FP8 (E5M2
    activations x E4M3 weights) approximate (cuBLAS's promoted accumulation measured 4.6e-5 here, fast ~1e-4);
    flagged activation rows and weight rows beyond E4M3's window recomputed exactly."""
    f = get_format(name)
    x = _inputs("outliers", (300, 2048), seed=21)
    x[5] *= 1e-12
    x[5, 9] = 1e8  # an activation row beyond E5M2's window
    w = _inputs("random", (384, 2048), seed=22) * 0.02
    w[7] *= 1e-6
    w[7, 3] = 10.0  # a weight row beyond E4M3's window
    ref = _ref_mm(x, w, f).cuda()
    qq, ss = resq_components(x, name, "2:4")
    wq = f.fake_quantize(w.float()).double()
    ref_resq = qq.double() @ wq.t() + ss.double() @ wq.t()
    _, ex = quantize(x, name, expand="bf16")
    _, ew = quantize(w, name, expand="bf16")
    _, _, eq, er = resq_quantize(x, name, expand="bf16")
    for impl in ("cublas", "triton"):
        assert _rel(mm_expanded(ex, ew, impl=impl), ref) < 1e-5
        assert _rel(mm_expanded(ex, ew, out_dtype=torch.bfloat16, impl=impl), ref) < 4e-3
        assert _rel(mm_expanded(eq, ew, er, impl=impl), ref_resq) < 1e-5
    pw = dispatch.prepare_weight(w, name)  # exact mode: BF16 expansions, cuBLAS
    assert _rel(dispatch.linear(x, pw), ref) < 1e-5
    ref_sum = (qq + ss).to(torch.bfloat16).double() @ wq.t()
    assert _rel(dispatch.linear(x, pw, resq="2:4", resq_combine="bf16"), ref_sum) < 1e-5
    if name == "mxfp4":
        pw8 = dispatch.prepare_weight(w, name, mode="fp8")
        assert pw8.expanded.values.dtype == torch.float8_e4m3fn
        assert not bool(pw8.expanded.row_ok[7]) and int(pw8.expanded.row_ok.sum()) == 383
        errs = {m: _rel(dispatch.linear(x, dispatch.prepare_weight(w, name, mode=m)), ref) for m in ("fp8", "fp8_fast")}
        errs["resq fp8"] = _rel(dispatch.linear(x, pw8, resq="2:4"), ref_resq)
        print(f"cuBLAS FP8 relative errors: {errs}")
        assert errs["fp8"] < 1e-4 and errs["resq fp8"] < 1e-4 and errs["fp8_fast"] < 1e-3


@pytest.mark.gpu
def test_gpu_ops_backend_matches_reference():
    from megatron_fp4 import ops

    assert ops.register_kernel_backend()
    try:
        a = torch.randn(256, 512, device="cuda")
        b = torch.randn(128, 512, device="cuda")
        for name in ("hif4", "mxfp4"):
            with ops.use_reference_backend():
                ref = ops.fp4_gemm(a, b, name, name)
            out = ops.fp4_gemm(a, b, name, name)
            assert _rel(out, ref) < 1e-5
    finally:
        ops.unregister_fp4_gemm_backend("cuda")


@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_fallback_without_triton_is_the_reference(monkeypatch, name):
    """Without Triton (or a GPU / the interpreter) every entry point returns exactly the reference's numbers."""
    import megatron_fp4.kernels._common as common
    from megatron_fp4 import ops

    monkeypatch.setattr(common, "HAS_TRITON", False)
    f = get_format(name)
    a = torch.randn(20, 96)
    b = torch.randn(12, 96)
    q = quantize(a, name)
    r = f.quantize(a)
    assert torch.equal(q.codes, r.codes) and torch.equal(q.scales, r.scales)
    ref = ops.reference_fp4_gemm(a, b, f, f)
    assert torch.equal(dispatch.fp4_gemm(a, b, name), ref)
    assert kernels_backend.ops_backend(a, b, f, f, "nearest", "nearest") is NotImplemented
    w = dispatch.prepare_weight(b, name)
    assert torch.equal(dispatch.linear(a, w), f.fake_quantize(a) @ f.fake_quantize(b).t())
    qq, ss = resq_components(a, name, "2:4")
    wq = f.fake_quantize(b)
    assert torch.equal(dispatch.linear(a, w, resq="2:4"), qq @ wq.t() + ss @ wq.t())
    assert torch.equal(resq_matmul(a, w.packed), qq @ wq.t() + ss @ wq.t())
    ref_sum = (qq + ss).to(torch.bfloat16).float() @ wq.t()
    assert torch.equal(dispatch.linear(a, w, resq="2:4", resq_combine="bf16"), ref_sum)
    q1, r1, _, _ = resq_quantize(a, name)
    q2, r2, _, _ = resq_quantize_reference(a, f, None)
    assert torch.equal(r1.codes, r2.codes)
    monkeypatch.setattr(common, "HAS_TRITON", True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter: reference as well
    assert torch.equal(dispatch.fp4_gemm(a, b, name), ref)
    assert ops.fp4_gemm_backend_for("cpu") is None


def test_falling_back_to_the_reference_on_cuda_is_said_once(monkeypatch):
    """Where the kernels cannot serve CUDA (switched off, or no usable GPU as on this CPU machine), the training
    GEMMs run on the reference: the user is told so, with the reason, once per process."""
    from megatron_fp4 import ops

    for env, why in (("0", "MEGATRON_FP4_KERNELS=0"), ("1", "Triton cannot run the kernels")):
        if env == "1" and torch.cuda.is_available():
            continue  # a GPU machine registers the kernels: nothing to say
        monkeypatch.setenv("MEGATRON_FP4_KERNELS", env)
        monkeypatch.setattr(ops, "_AUTO_TRIED", set())
        monkeypatch.setattr(ops, "_WARNED", set())
        monkeypatch.setattr(ops, "_BACKENDS", {k: v for k, v in ops._BACKENDS.items() if k != "cuda"})
        with pytest.warns(UserWarning, match=f"training FP4 GEMMs on cuda run on the PyTorch reference.*{why}"):
            assert ops.fp4_gemm_backend_for("cuda") is None
        monkeypatch.setattr(ops, "_AUTO_TRIED", set())
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once: not again
            ops.fp4_gemm_backend_for("cuda")


@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
@pytest.mark.parametrize("M", [3, 80])  # a decode kernel (split sums as stored), a prefill GEMM
def test_linear_bias_is_added_before_the_one_rounding(name, M):
    """dispatch.linear(bias=): the GEMM's fp32 sums plus the bias in fp32, rounded once to out_dtype (one split_sum
    kernel, no bias cast / add / cast kernels), the same numbers as adding it after an fp32 GEMM; and the kernel
    backend takes the bias from rollout_linear (adds_bias) with the reference's numbers."""
    from megatron_fp4.resq import (ROLLOUT_LINEAR_PATHS, RolloutPrecision, register_rollout_backend,
                                   rollout_backend_for, rollout_linear)
    from megatron_fp4.rollout_kernels import register_kernel_backend

    g = torch.Generator().manual_seed(5)
    x, wt = torch.randn(M, 96, generator=g).to(DEV), (torch.randn(40, 96, generator=g) * 0.1).to(DEV)
    bias = torch.randn(40, generator=g).to(torch.float16).to(DEV)
    w = dispatch.prepare_weight(wt, name)
    for kw in (dict(), dict(resq="2:4"), dict(resq="2:4", resq_combine="bf16")):
        fp32 = dispatch.linear(x, w, **kw)
        for dt in (torch.float32, torch.float16):
            got = dispatch.linear(x, w, out_dtype=dt, bias=bias, **kw)
            assert got.dtype == dt and torch.equal(got, (fp32 + bias.float()).to(dt)), (kw, dt)
    with pytest.raises(Exception, match="bias must be"):
        dispatch.linear(x, w, out_dtype=None, bias=bias)
    with pytest.raises(Exception, match="bias must be"):
        dispatch.linear(x, w, bias=bias[:-1])
    precision = RolloutPrecision("w4a4", name, "2:4")
    x16 = x.to(torch.float16)
    before = rollout_backend_for(DEV)
    register_rollout_backend(DEV, None)
    ref = rollout_linear(x16, wt, bias, precision)
    assert register_kernel_backend(DEV)
    try:
        served = ROLLOUT_LINEAR_PATHS["backend"]
        got = rollout_linear(x16, wt, bias, precision)
        stored = rollout_linear(x16, wt, bias, precision, as_stored=True)
        assert ROLLOUT_LINEAR_PATHS["backend"] == served + 2
    finally:
        register_rollout_backend(DEV, before)
    assert got.dtype == torch.float16 and torch.equal(stored, got.unsqueeze(0))
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
@pytest.mark.parametrize("M", [4, 40, 100])  # decode GEMM split 3+ ways at 4 and 40 tokens; a prefill GEMM at 100
def test_gpu_rollout_linear_bias_through_the_kernels_at_size(name, M):
    """rollout_linear with a bias through the kernel backend (the decode GEMM's split sums, the bias and one rounding
    in split_sum) against the reference with no backend, on a weight large enough for several K splits (the test
    above: at most two): bf16 out within a rounding, the bias added once (a missing or doubled bias is off by ~1),
    as-stored sums the same numbers."""
    from megatron_fp4.resq import RolloutPrecision, register_rollout_backend, rollout_backend_for, rollout_linear
    from megatron_fp4.rollout_kernels import register_kernel_backend

    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 4096, generator=g).to(torch.bfloat16).to(DEV)
    wt = (torch.randn(1024, 4096, generator=g) * 0.02).to(DEV)
    bias = torch.randn(1024, generator=g).to(torch.bfloat16).to(DEV)
    before = rollout_backend_for(DEV)
    try:
        for precision in (RolloutPrecision("w4a16", name), RolloutPrecision("w4a4", name, "2:4"),
                          RolloutPrecision("w4a4", name, "2:4", resq_combine="bf16")):
            register_rollout_backend(DEV, None)
            ref = rollout_linear(x, wt, bias, precision)
            assert register_kernel_backend(DEV)
            got = rollout_linear(x, wt, bias, precision)
            stored = rollout_linear(x, wt, bias, precision, as_stored=True)
            assert got.dtype == torch.bfloat16 and got.shape == (M, 1024)
            torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=1e-2, msg=precision.label)
            torch.testing.assert_close(stored.float().sum(0), got.float(), atol=2e-2, rtol=1e-2, msg=precision.label)
    finally:
        register_rollout_backend(DEV, before)
