"""The CUDA both-layouts quantizer (megatron_fp4/kernels/cuda_quantize.py, megatron_fp4/kernels/csrc/quant_both.cu,
quant_math.h).

CPU: the unit math of ``quant_math.h`` (what the kernel runs per thread), built for the host with the system C++
compiler, against the PyTorch reference bit for bit (skipped without a compiler). GPU (``gpu`` marker): the kernel
against the reference and the Triton passes, and ``quantize_both_layouts`` serving through it.
"""

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from megatron_fp4.kernels.quantize import quantize_reference
from megatron_fp4.formats import get_format

FORMATS = ["hif4", "mxfp4", "mxfp4_rceil"]
_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_fp4", "kernels", "csrc")


def _unit_harness(unit_fn: str) -> str:
    """A host program over bf16 units. Reads: format id, value count n (a multiple of the unit), n bf16 bit patterns;
    writes the n bf16 results of ``unit<F>(x, y, parts)`` (C++ in ``unit_fn``) on each unit, its parts of 8 values
    (4 words) as the kernel's lanes hold them."""
    return r"""
#include <cstdio>
#include <vector>
#include "quant_math.h"
""" + unit_fn + r"""
int main(int argc, char** argv) {
  FILE* in = std::fopen(argv[1], "rb");
  int fmt = 0; long n = 0;
  if (std::fread(&fmt, 4, 1, in) != 1 || std::fread(&n, 8, 1, in) != 1) return 2;
  std::vector<uint32_t> x(n / 2), y(n / 2);
  if ((long)std::fread(x.data(), 4, n / 2, in) != n / 2) return 3;
  std::fclose(in);
  const int parts = fmt == 0 ? 8 : 4;
  for (long u = 0; u < n / 2; u += 4 * parts) {
    if (fmt == 0) unit<0>(&x[u], &y[u], parts);
    else if (fmt == 1) unit<1>(&x[u], &y[u], parts);
    else unit<2>(&x[u], &y[u], parts);
  }
  FILE* out = std::fopen(argv[2], "wb");
  std::fwrite(y.data(), 4, n / 2, out);
  std::fclose(out);
  return 0;
}
"""


# The expansion: the unit maximum taken over the parts, two parts per call (as each thread of the kernel holds them).
_HARNESS = _unit_harness(r"""
template <int F>
void unit(const uint32_t* x, uint32_t* y, int parts) {
  uint32_t bmax = 0;
  for (int p = 0; p < parts; ++p) bmax = qm::umax(bmax, qm::part_max(x + 4 * p));
  for (int p = 0; p < parts; p += 2) qm::quant_parts<F, 2>(x + 4 * p, bmax, y + 4 * p);
}
""")


# MXFP4's FP8 form. Reads: rceil, e4m3, row length L (a multiple of 32), value count n (a multiple of L), n bf16
# bit patterns; writes n FP8 bytes and n / L row flags (1: nothing flushed): each row's scale from its finite
# blocks' largest |x| (fp8_row_s), each block quantized 16 values at a time (mx_fp8_parts<2>), as the kernel does.
_FP8_HARNESS = r"""
#include <cstdio>
#include <vector>
#include "quant_math.h"
int main(int argc, char** argv) {
  FILE* in = std::fopen(argv[1], "rb");
  int rceil = 0, e4m3 = 0, L = 0; long n = 0;
  if (std::fread(&rceil, 4, 1, in) != 1 || std::fread(&e4m3, 4, 1, in) != 1 || std::fread(&L, 4, 1, in) != 1 ||
      std::fread(&n, 8, 1, in) != 1) return 2;
  std::vector<uint32_t> x(n / 2), y(n / 4);
  std::vector<unsigned char> ok(n / L);
  if ((long)std::fread(x.data(), 4, n / 2, in) != n / 2) return 3;
  std::fclose(in);
  for (long r = 0; r < n / L; ++r) {
    const uint32_t* row = &x[r * L / 2];
    uint32_t rmax = 0;
    for (int b = 0; b < L / 32; ++b) {
      uint32_t bmax = 0;
      for (int p = 0; p < 4; ++p) bmax = qm::umax(bmax, qm::part_max(&row[16 * b + 4 * p]));
      if (bmax < 0x7F80u) rmax = qm::umax(rmax, bmax);
    }
    const int S = qm::fp8_row_s(rmax, rceil, e4m3);
    bool flag = true;
    for (int b = 0; b < L / 32; ++b) {
      uint32_t bmax = 0;
      for (int p = 0; p < 4; ++p) bmax = qm::umax(bmax, qm::part_max(&row[16 * b + 4 * p]));
      for (int p = 0; p < 4; p += 2)
        qm::mx_fp8_parts<2>(&row[16 * b + 4 * p], bmax, rceil, S, e4m3, &y[(r * L + 32 * b + 8 * p) / 4], flag);
    }
    ok[r] = flag;
  }
  FILE* out = std::fopen(argv[2], "wb");
  std::fwrite(y.data(), 4, n / 4, out);
  std::fwrite(ok.data(), 1, n / L, out);
  std::fclose(out);
  return 0;
}
"""


# Rollout-ResQ's bf16 sum: one part of 8 values per call, both maxima (|x|, then the residual's |r|) taken over the
# unit's parts between the two steps, as the kernel's lanes meet by shuffles.
_RESQ_HARNESS = _unit_harness(r"""
template <int F>
void unit(const uint32_t* x, uint32_t* y, int parts) {
  uint32_t bmax = 0, rmax = 0, q[8][4];
  float r[8][8];
  for (int p = 0; p < parts; ++p) bmax = qm::umax(bmax, qm::part_max(x + 4 * p));
  for (int p = 0; p < parts; ++p) rmax = qm::umax(rmax, qm::resq_residual<F>(x + 4 * p, bmax, q[p], r[p]));
  for (int p = 0; p < parts; ++p) qm::resq_sum<F>(q[p], r[p], rmax, y + 4 * p);
}
""")


def _build(tmp_path_factory, name: str, source: str):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build quant_math.h for the host")
    d = tmp_path_factory.mktemp(name)
    src, exe = d / "harness.cpp", d / "harness"
    src.write_text(source)
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", f"-I{_CSRC}", str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    return d, exe


def _bits_runner(d, exe):
    def run(x: torch.Tensor, fmt_id: int) -> torch.Tensor:
        """bf16 bits (int16) of the host math on bf16 values x (a multiple of the unit, in units' order)."""
        bits = x.contiguous().view(torch.int16).numpy()
        fin, fout = d / "in.bin", d / "out.bin"
        with open(fin, "wb") as fh:
            fh.write(np.int32(fmt_id).tobytes() + np.int64(bits.size).tobytes() + bits.tobytes())
        subprocess.run([str(exe), str(fin), str(fout)], check=True)
        return torch.from_numpy(np.fromfile(fout, dtype=np.int16).copy())

    return run


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return _bits_runner(*_build(tmp_path_factory, "quant_math", _HARNESS))


@pytest.fixture(scope="module")
def resq_harness(tmp_path_factory):
    return _bits_runner(*_build(tmp_path_factory, "quant_math_resq", _RESQ_HARNESS))


def _units(seed: int, n_units: int, unit: int) -> torch.Tensor:
    """bf16 values, ``n_units`` x ``unit``: every bf16 bit pattern at random (NaN, Inf, subnormals, the largest
    values), finite patterns only, Gaussians with outliers over 60 binades, units built from the formats' own
    values times a scale (rounding ties and exact hits), and all-zero / single-value units; the units shuffled, so
    that any prefix of the values holds every kind."""
    g = torch.Generator().manual_seed(seed)
    q = n_units // 6
    raw = torch.randint(-32768, 32768, (q, unit), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = raw.clone()
    finite[~torch.isfinite(finite.float())] = 1.0
    gauss = torch.randn(q, unit, generator=g) * torch.exp2(torch.randint(-30, 30, (q, 1), generator=g).float())
    gauss = gauss * torch.exp(torch.randn(q, unit, generator=g) * 2)
    grid = torch.randint(0, 8, (q, unit), generator=g).float() / 4 * torch.exp2(
        torch.randint(0, 3, (q, unit), generator=g).float())
    grid = grid * torch.randint(-1, 2, (q, unit), generator=g).float() * torch.exp2(
        torch.randint(-20, 20, (q, 1), generator=g).float()) * (1 + torch.randint(0, 4, (q, 1), generator=g) / 8)
    halves = grid + torch.exp2(torch.randint(-24, 0, (q, 1), generator=g).float()) / 8  # near rounding midpoints
    sparse = torch.zeros(n_units - 5 * q, unit)
    sparse[1::2, 5] = torch.randn(sparse[1::2].shape[0], generator=g) * 1e3
    parts = [raw, finite] + [t.to(torch.bfloat16) for t in (gauss, grid, halves, sparse)]
    units = torch.cat(parts)
    return units[torch.randperm(n_units, generator=g)].view(-1)


@pytest.fixture(scope="module")
def fp8_harness(tmp_path_factory):
    d, exe = _build(tmp_path_factory, "quant_math_fp8", _FP8_HARNESS)

    def run(x: torch.Tensor, rceil: bool, e4m3: bool, row: int):
        """(FP8 bytes [n], row flags [n / row]) of the host math on bf16 values x, rows of ``row`` values."""
        bits = x.contiguous().view(torch.int16).numpy()
        fin, fout = d / "in.bin", d / "out.bin"
        with open(fin, "wb") as fh:
            fh.write(np.int32(rceil).tobytes() + np.int32(e4m3).tobytes() + np.int32(row).tobytes()
                     + np.int64(bits.size).tobytes() + bits.tobytes())
        subprocess.run([str(exe), str(fin), str(fout)], check=True)
        out = torch.from_numpy(np.fromfile(fout, dtype=np.uint8).copy())
        return out[: bits.size], out[bits.size:].bool()

    return run


@pytest.mark.parametrize("name", FORMATS)
def test_host_unit_math_matches_reference(harness, name):
    """quant_math.h's per-part arithmetic, run as the kernel's lanes split a unit (8 values each, the unit maximum
    over the parts), equals the PyTorch reference's BF16 expansion bit for bit (NaN where NaN) on every bf16 bit
    pattern class: NaN/Inf units, subnormals, the format's overflow edge, rounding ties, zeros."""
    f = get_format(name)
    for seed in range(3):
        x = _units(seed, 1200, f.block_size)
        got = harness(x, {"hif4": 0, "mxfp4": 1, "mxfp4_rceil": 2}[name])
        _assert_same_bits(got, quantize_reference(x.view(-1, f.block_size), f, 1, "bf16")[1].values, seed)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, seed: int) -> None:
    """The host math's bf16 bits ``got`` (int16) equal ``want``'s (bf16, any shape), NaN where NaN."""
    want = want.reshape(-1)
    nan = want.isnan()
    got_v = got.view(torch.bfloat16)
    assert torch.equal(got_v.isnan(), nan), f"seed {seed}: NaN units differ"
    diff = (got[~nan] != want[~nan].view(torch.int16)).nonzero()
    assert diff.numel() == 0, (f"seed {seed}: {diff.numel()} values differ, first at {diff[0].item()}: "
                               f"{got_v[~nan][diff[0]].item()} vs {want[~nan][diff[0]].item()}")


def _resq_units(seed: int, n_units: int, unit: int) -> torch.Tensor:
    """:func:`_units`' classes plus units whose residual is what 2:4 has to choose between: values a little off the
    format's grid (residuals of a few significant bits, many equal magnitudes: ties), and units of one outlier over
    many small values (the underflow ResQ is for)."""
    g = torch.Generator().manual_seed(seed + 100)
    q = n_units // 4
    base = _units(seed, n_units - 2 * q, unit).view(-1, unit).float()
    grid = torch.randint(-7, 8, (q, unit), generator=g).float() / 4 * torch.exp2(
        torch.randint(-10, 10, (q, 1), generator=g).float())
    near = grid * (1 + torch.randint(-3, 4, (q, unit), generator=g).float() / 64)
    outl = torch.randn(q, unit, generator=g) * 1e-2
    outl[torch.arange(q), torch.randint(0, unit, (q,), generator=g)] = 50.0
    units = torch.cat([base, near, outl]).to(torch.bfloat16)
    return units[torch.randperm(n_units, generator=g)].reshape(-1)


@pytest.mark.parametrize("name", FORMATS)
def test_host_resq_sum_matches_reference(resq_harness, name):
    """quant_math.h's ResQ 2:4 bf16 sum (resq_residual, then resq_sum, the residual's unit maximum between them, as
    the kernel's lanes run it) equals ``resq_quantize_reference(x, f, "sum")`` bit for bit, the Triton kernel's own
    reference (NaN where NaN): every bf16 bit-pattern class, residuals on and near the grid (2:4's ties), outliers."""
    from megatron_fp4.kernels.resq import resq_quantize_reference

    f = get_format(name)
    for seed in range(3):
        x = _resq_units(seed, 1200, f.block_size)
        got = resq_harness(x, {"hif4": 0, "mxfp4": 1, "mxfp4_rceil": 2}[name])
        want = resq_quantize_reference(x.view(-1, f.block_size), f, "sum")[2].values
        _assert_same_bits(got, want, seed)
        # the sums differ from Q(x) alone in many units: the residual is there, not dropped
        main = quantize_reference(x.view(-1, f.block_size), f, 1, "bf16")[1].values.reshape(-1)
        fin = ~want.reshape(-1).isnan()
        assert (got[fin] != main[fin].view(torch.int16)).float().mean() > 0.2


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4_rceil"])
@pytest.mark.parametrize("form", ["native", "e4m3"])
def test_host_fp8_math_matches_reference(fp8_harness, name, form):
    """quant_math.h's FP8 form of MXFP4 (rows of 128 values: the row scale from the finite blocks, each block 16
    values at a time) equals the reference's ``expand="native"`` (E5M2) / ``"e4m3"`` bytes and its row flags, on
    every bf16 bit-pattern class (rows where values fall below the FP8 window, NaN/Inf blocks, all-zero rows)."""
    f = get_format(name)
    for seed in range(3):
        x = _units(seed, 1200, 32)
        got, ok = fp8_harness(x, name == "mxfp4_rceil", form == "e4m3", 128)
        want = quantize_reference(x.view(-1, 128), f, 1, form)[1]
        nan = want.values.float().isnan().reshape(-1)
        got_nan = got.view(torch.float8_e4m3fn if form == "e4m3" else torch.float8_e5m2).float().isnan()
        assert torch.equal(got_nan, nan), f"seed {seed}: NaN values differ"
        diff = (got[~nan] != want.values.view(torch.uint8).reshape(-1)[~nan]).nonzero()
        assert diff.numel() == 0, f"seed {seed}: {diff.numel()} bytes differ, first at {diff[0].item()}"
        assert torch.equal(ok, want.row_ok), f"seed {seed}: row flags differ"
        assert (~ok).any() and ok.any()  # the inputs reach both sides of the window


# ------------------------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------------------------
def _cuda_quantize():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megatron_fp4.kernels import cuda_quantize

    if not cuda_quantize.available():
        pytest.skip("the CUDA quantizer cannot build here (nvcc) or is turned off")
    return cuda_quantize


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMATS)
def test_both_layouts_kernel_bit_exact(name):
    """The kernel's two expansions are the reference's quantizations of x along K and of x^T along R, bit for bit,
    on ragged shapes (tiles cut by R, K, the format's padding), special values and a row stride wider than K."""
    cq = _cuda_quantize()
    f = get_format(name)
    for (rows, cols), pad in (((150, 72), 8), ((64, 64), 0), ((40, 1096), 16), ((1000, 520), 0), ((8, 8), 0)):
        x = _units(rows, -(-rows * (cols + pad) // 64) + 6, 64)[: rows * (cols + pad)]
        x = x.view(rows, cols + pad)[:, :cols].cuda()
        r, c = cq.both_layouts(x, name)
        out = cq.both_layouts(x * 2, name)
        assert cq.both_layouts(x, name, out=out) is out and all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                                                                for a, b in zip(out, (r, c)))  # into given buffers
        want_r = quantize_reference(x.cpu(), f, 1, "bf16")[1].values
        want_c = quantize_reference(x.t().contiguous().cpu(), f, 1, "bf16")[1].values
        for got, want, what in ((r.cpu(), want_r, "rows"), (c.cpu(), want_c, "columns")):
            nan = want.isnan()
            assert got.shape == want.shape and torch.equal(got.isnan(), nan), f"{rows} x {cols} {what}"
            assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), f"{rows} x {cols} {what}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMATS)
def test_quantize_both_layouts_serves_through_the_kernel(name, monkeypatch):
    """``megatron_fp4.kernels.quantize.quantize_both_layouts`` (the training linears' X and dY) returns the CUDA
    kernel's expansions, equal to the Triton passes' (``MEGATRON_FP4_CUDA_QUANT=0``) on a training-sized operand."""
    cq = _cuda_quantize()
    from megatron_fp4.kernels import quantize as qm

    x = (torch.randn(4096, 1536, device="cuda") * torch.exp(torch.randn(4096, 1536, device="cuda") * 2)).bfloat16()
    calls = []
    real = cq.both_layouts
    monkeypatch.setattr(cq, "both_layouts", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = qm.quantize_both_layouts(x, name)
    assert calls, "the CUDA kernel did not serve"
    monkeypatch.setenv("MEGATRON_FP4_CUDA_QUANT", "0")
    want = qm.quantize_both_layouts(x, name)
    for g, w in zip(got, want):
        assert torch.equal(g.values.view(torch.int16), w.values.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mxfp4", "mxfp4_rceil"])
@pytest.mark.parametrize("forms", [("native", "native"), ("native", "e4m3"), ("e4m3", "e4m3"), ("e4m3", "native")])
def test_fp8_both_layouts_kernel_bit_exact(name, forms):
    """MXFP4's FP8 form (the "fp8" GEMM modes' X, dY and weights): the kernel's rows and columns (E5M2 "native" or
    E4M3 each), their scale exponents, 2^S and no-flush flags are the reference's ``expand=forms[0]`` of x and
    ``forms[1]`` of x^T, bit for bit, on ragged shapes, special values (NaN/Inf blocks, values below the window)
    and a wide row stride; ``out=`` writes the same into given buffers."""
    cq = _cuda_quantize()
    f = get_format(name)
    e4 = [form == "e4m3" for form in forms]
    for (rows, ncols), pad in (((150, 72), 8), ((64, 64), 0), ((40, 1096), 16), ((1000, 520), 0), ((8, 8), 0)):
        x = _units(rows + 1, -(-rows * (ncols + pad) // 64) + 6, 64)[: rows * (ncols + pad)]
        x = x.view(rows, ncols + pad)[:, :ncols].cuda()
        got_r, got_c = cq.both_layouts_fp8(x, name, rows_e4m3=e4[0], cols_e4m3=e4[1])
        again = cq.both_layouts_fp8(x * 2, name, rows_e4m3=e4[0], cols_e4m3=e4[1])
        ptrs = [t.data_ptr() for part in again for t in part]
        assert cq.both_layouts_fp8(x, name, rows_e4m3=e4[0], cols_e4m3=e4[1], out=again) is again
        assert [t.data_ptr() for part in again for t in part] == ptrs
        for a, b in zip(again, (got_r, got_c)):
            assert all(torch.equal(u.view(torch.uint8), v.view(torch.uint8)) for u, v in zip(a, b))
        want_r = quantize_reference(x.cpu(), f, 1, forms[0])[1]
        want_c = quantize_reference(x.t().contiguous().cpu(), f, 1, forms[1])[1]
        for (values, sexp, ok, scale), want, what in ((got_r, want_r, "rows"), (got_c, want_c, "columns")):
            tag = f"{rows} x {ncols} {what}"
            assert values.shape == want.values.shape and values.dtype == want.values.dtype, tag
            nan = want.values.float().isnan()
            assert torch.equal(values.cpu().float().isnan(), nan), tag
            assert torch.equal(values.cpu().view(torch.uint8)[~nan], want.values.view(torch.uint8)[~nan]), tag
            assert torch.equal(sexp.cpu(), want.row_exp) and torch.equal(ok.cpu(), want.row_ok), tag
            assert torch.equal(scale.cpu(), torch.exp2(want.row_exp.float())), tag


@pytest.mark.gpu
@pytest.mark.parametrize("cols", ["native", "e4m3"])
def test_fp8_quantize_both_layouts_serves_through_the_kernel(cols, monkeypatch):
    """``quantize_both_layouts(expand=("native", cols))`` (the FP8 modes' X and dY) returns the CUDA kernel's
    forms, equal to the Triton passes' on a training-sized operand, and the FP8 GEMM of two such operands (wgrad's
    dY^T x X^T) equals the exact product of the reference's values to FP8 accumulation's error."""
    cq = _cuda_quantize()
    from megatron_fp4.kernels import quantize as qm
    from megatron_fp4.kernels.gemm import mm_expanded

    x = (torch.randn(4096, 1536, device="cuda") * torch.exp(torch.randn(4096, 1536, device="cuda") * 2)).bfloat16()
    calls = []
    real = cq.both_layouts_fp8
    monkeypatch.setattr(cq, "both_layouts_fp8", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = qm.quantize_both_layouts(x, "mxfp4", expand=("native", cols))
    assert calls, "the CUDA kernel did not serve"
    monkeypatch.setenv("MEGATRON_FP4_CUDA_QUANT", "0")
    want = qm.quantize_both_layouts(x, "mxfp4", expand=("native", cols))
    for g, w in zip(got, want):
        assert g.values.dtype == w.values.dtype
        assert torch.equal(g.values.view(torch.uint8), w.values.view(torch.uint8))
        assert torch.equal(g.row_exp, w.row_exp) and torch.equal(g.row_ok, w.row_ok)
    monkeypatch.delenv("MEGATRON_FP4_CUDA_QUANT")
    dy = torch.randn(4096, 256, device="cuda").bfloat16()
    dy_cols = qm.quantize_both_layouts(dy, "mxfp4", expand=("native", "native"))[1]
    dw = mm_expanded(dy_cols, got[1], promote=32)
    a, b = (e.values.float() * torch.exp2(e.row_exp.float())[:, None] for e in (dy_cols, got[1]))
    ref = a @ b.t()
    assert (dw - ref).abs().max() / ref.abs().max() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMATS)
def test_resq_sum_kernel_bit_exact(name):
    """The ResQ bf16-sum kernel equals the reference (``resq_quantize_reference(x, f, "sum")``) and the Triton kernel
    (a fixed tile) bit for bit: the decode step's shapes (7B and 1.5B activations at 16 and 64 tokens), a K the format
    pads, a row stride wider than K, every bf16 bit-pattern class; into a given buffer too."""
    cq = _cuda_quantize()
    if not cq.available(cq.RESQ_SOURCE):
        pytest.skip("the CUDA ResQ kernel cannot build here or is turned off")
    from megatron_fp4.kernels.resq import resq_quantize, resq_quantize_reference

    f = get_format(name)
    cases = [((64, 3584), 0), ((16, 18944), 0), ((64, 18944), 0), ((64, 1536), 0), ((3, 1000), 0), ((5, 72), 24),
             ((1, 8), 0)]
    for (rows, cols), pad in cases:
        n = rows * (cols + pad)
        x = _resq_units(rows + cols, -(-n // 64) + 8, 64)[:n].view(rows, cols + pad)[:, :cols].cuda()
        got = cq.resq_sum(x, name)
        kp = -(-cols // f.block_size) * f.block_size
        assert got.shape == (rows, kp) and got.dtype == torch.bfloat16
        want = resq_quantize_reference(x.cpu(), f, "sum")[2].values  # [rows, cols]: the padding dropped
        nan = want.isnan()
        g = got[:, :cols].cpu()
        assert torch.equal(g.isnan(), nan), f"{rows} x {cols}: NaN values differ"
        assert torch.equal(g[~nan].view(torch.int16), want[~nan].view(torch.int16)), f"{rows} x {cols}"
        triton = resq_quantize(x, name, expand="sum", packed=False, config=(1, 1024, 4, 0))[2].values
        assert torch.equal(got.isnan(), triton.isnan())
        assert torch.equal(got[~got.isnan()].view(torch.int16), triton[~triton.isnan()].view(torch.int16))
        out = torch.full_like(got, 7.0)
        assert cq.resq_sum(x, name, out=out) is out and torch.equal(out.view(torch.int16), got.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_resq_quantize_sum_serves_through_the_kernel(name, monkeypatch):
    """``resq_quantize(x, fmt, expand="sum", packed=False)`` (what ``dispatch.linear`` runs before a ResQ decode GEMM,
    for the engine and the SGLang plug-in) returns the CUDA kernel's sum, inside a CUDA graph too; with
    ``MEGATRON_FP4_CUDA_QUANT=0`` the Triton kernel's, the same bits."""
    cq = _cuda_quantize()
    if not cq.available(cq.RESQ_SOURCE):
        pytest.skip("the CUDA ResQ kernel cannot build here or is turned off")
    from megatron_fp4.kernels.resq import resq_quantize

    x = (torch.randn(64, 3584, device="cuda") * torch.exp(torch.randn(64, 3584, device="cuda") * 2)).bfloat16()
    calls = []
    real = cq.resq_sum
    monkeypatch.setattr(cq, "resq_sum", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = resq_quantize(x, name, expand="sum", packed=False)[2].values
    assert calls, "the CUDA kernel did not serve"
    static = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graphed = resq_quantize(static, name, expand="sum", packed=False)[2].values
    static.copy_(x * 3)
    g.replay()
    assert torch.equal(graphed.view(torch.int16), real(x * 3, name).view(torch.int16))
    monkeypatch.setenv("MEGATRON_FP4_CUDA_QUANT", "0")
    want = resq_quantize(x, name, expand="sum", packed=False)[2].values
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_swiglu_resq_kernel_is_the_two_kernels_bits(name):
    """The fused SwiGLU + ResQ sum equals the Triton SwiGLU followed by the ResQ quantize, bit for bit: fc1's fp32
    split sums (1 and 3 splits) or its bf16 output, the 7B and 1.5B widths and a one-unit row."""
    cq = _cuda_quantize()
    if not cq.available(cq.SWIGLU_RESQ_SOURCE):
        pytest.skip("the fused SwiGLU + ResQ kernel cannot build here or is turned off")
    from megatron_fp4.kernels.decode_ops import swiglu
    from megatron_fp4.kernels.resq import resq_quantize

    for B, F in ((64, 18944), (16, 18944), (64, 8960), (3, 64)):
        for splits in (0, 1, 3):
            shape = (splits, B, 2 * F) if splits else (B, 2 * F)
            a = torch.randn(shape, device="cuda") * torch.exp(torch.randn(shape, device="cuda"))
            a = a if splits else a.bfloat16()
            want = resq_quantize(swiglu(a, torch.bfloat16, splits=bool(splits)), name, expand="sum",
                                 packed=False)[2].values
            got = cq.swiglu_resq(a, name)
            assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                (B, F, splits, (got != want).sum().item())


def test_norm_resq_rounds_mean_plus_eps_once_as_the_triton_norm(tmp_path):
    """The Triton norm's PTX divides (div.full) then adds eps with a contractible add.f32, and ptxas fuses the
    division's last multiply with the add: one FFMA, rcp(N) * sum + eps rounded once (Triton 3.6, every block of
    the tests; session 47). In the fused kernel's SASS, for every variant (delta kinds x strips per thread, both
    formats), the square root's operand comes from an FFMA with the eps parameter, not an FADD after an FMUL (two
    roundings: r one unit in the last place apart in some rows, session 47's GPU mismatch). No GPU: nvcc for
    sm_90a and nvdisasm."""
    import re
    import subprocess

    import triton

    from megatron_fp4.kernels import _nvcc

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if _nvcc.nvcc() is None or not os.path.exists(nvdisasm):
        pytest.skip("needs nvcc and nvdisasm (a compile for sm_90a)")
    for fmt in (0, 1):
        path = str(tmp_path / f"norm{fmt}.cubin")
        cmd = [a for a in _nvcc.command("norm_resq.cu", {"FMT": fmt}, path, "90a", "-cubin")
               if a not in ("-shared", "-Xcompiler", "-fPIC")]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
        ins = [line.split("*/", 1)[1].split(";")[0].split() for line in sass.splitlines()
               if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
        ins = [w[1:] if w[0].startswith("@") else w for w in ins]  # (past a predicate)
        roots = [i for i, w in enumerate(ins) if w[0] == "MUFU.SQRT"]
        assert len(roots) == 9, len(roots)  # 3 delta kinds x 3 strip counts
        for i in roots:
            src = ins[i][2].rstrip(",")
            feed = next(w for w in reversed(ins[:i]) if len(w) > 1 and w[1].rstrip(",") == src)
            assert feed[0] == "FFMA" and re.match(r"(UR\d+|c\[)", feed[-1]), (fmt, feed)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hif4", "mxfp4"])
def test_norm_resq_kernel_is_the_two_kernels_bits(name):
    """The fused residual add + RMSNorm + ResQ sum equals the Triton add_rms_norm followed by the ResQ quantize, bit
    for bit (the same normed bits: the Triton kernel's layout and reduction order), and stores the same residual
    sum: fp32 split sums (1 and 3 splits), a bf16 delta and none; the 7B and 1.5B widths, one strip per thread (1024)
    and four (8960). (Sessions 46-47 on an H100: 10 of 80 cases
    had a few normed values one bf16 unit apart, mean + eps rounded twice where the Triton norm's FFMA rounds once;
    with mean_eps it passed on an H100 in session 48, and 18 x 64 random rows per width gave the same normed bits.)"""
    cq = _cuda_quantize()
    if not cq.available(cq.NORM_RESQ_SOURCE):
        pytest.skip("the fused norm + ResQ kernel cannot build here or is turned off")
    from megatron_fp4.kernels.decode_ops import _norm_warps, add_rms_norm, add_rms_norm_resq
    from megatron_fp4.kernels.resq import resq_quantize

    for B, N in ((64, 3584), (16, 3584), (64, 1536), (3, 1024), (64, 8960)):
        norm = torch.nn.RMSNorm(N, eps=1e-6, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(N, device="cuda"))
        x = (torch.randn(B, N, device="cuda") * 3).bfloat16()
        for kind in ("none", "bf16", 1, 3):
            delta = (None if kind == "none" else torch.randn(B, N, device="cuda").bfloat16() if kind == "bf16"
                     else torch.randn(kind, B, N, device="cuda") * torch.exp(torch.randn(kind, B, N, device="cuda")))
            h, s = add_rms_norm(x, delta, norm)
            want = resq_quantize(h, name, expand="sum", packed=False)[2].values
            got, got_s = add_rms_norm_resq(x, delta, norm, name)
            assert torch.equal(got_s.view(torch.int16), s.view(torch.int16)), (B, N, kind)
            normed = torch.empty_like(h)
            cq.norm_resq(x, delta, norm.weight, norm.eps, name, _norm_warps(1 << (N - 1).bit_length()), normed)
            bad = (normed.view(torch.int16) != h.view(torch.int16)).sum().item()
            assert bad == 0, f"{bad} normed values differ from the Triton kernel's ({B} x {N}, delta {kind})"
            assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16)), \
                (B, N, kind, (got != want).sum().item())
