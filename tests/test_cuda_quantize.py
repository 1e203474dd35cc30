"""The CUDA both-layouts quantizer (kernels/cuda_quantize.py, kernels/csrc/quant_both.cu, quant_math.h).

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

from kernels.quantize import quantize_reference
from megatron_fp4.formats import get_format

FORMATS = ["hif4", "mxfp4", "mxfp4_rceil"]
_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "csrc")

# Reads: format id, value count n (a multiple of the unit), n fp32 bit patterns; writes n bf16 bit patterns: each
# unit split into parts of 8 as the kernel's lanes hold them, the unit maximum taken over the parts.
# Reads: format id, value count n (a multiple of the unit), n bf16 bit patterns; writes the n bf16 results: each
# unit split into parts of 8 values (4 words) as the kernel's lanes hold them, the unit maximum taken over the parts.
_HARNESS = r"""
#include <cstdio>
#include <vector>
#include "quant_math.h"
int main(int argc, char** argv) {
  FILE* in = std::fopen(argv[1], "rb");
  int fmt = 0; long n = 0;
  if (std::fread(&fmt, 4, 1, in) != 1 || std::fread(&n, 8, 1, in) != 1) return 2;
  std::vector<uint32_t> x(n / 2), y(n / 2);
  if ((long)std::fread(x.data(), 4, n / 2, in) != n / 2) return 3;
  std::fclose(in);
  const int parts = fmt == 0 ? 8 : 4;
  for (long u = 0; u < n / 2; u += 4 * parts) {
    uint32_t bmax = 0;
    for (int p = 0; p < parts; ++p) bmax = qm::umax(bmax, qm::part_max(&x[u + 4 * p]));
    for (int p = 0; p < parts; p += 2) {  // two parts per call, as each thread of the kernel holds them
      if (fmt == 0) qm::quant_parts<0, 2>(&x[u + 4 * p], bmax, &y[u + 4 * p]);
      else if (fmt == 1) qm::quant_parts<1, 2>(&x[u + 4 * p], bmax, &y[u + 4 * p]);
      else qm::quant_parts<2, 2>(&x[u + 4 * p], bmax, &y[u + 4 * p]);
    }
  }
  FILE* out = std::fopen(argv[2], "wb");
  std::fwrite(y.data(), 4, n / 2, out);
  std::fclose(out);
  return 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build quant_math.h for the host")
    d = tmp_path_factory.mktemp("quant_math")
    src, exe = d / "harness.cpp", d / "harness"
    src.write_text(_HARNESS)
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", f"-I{_CSRC}", str(src), "-o", str(exe)],
                   check=True, capture_output=True)

    def run(x: torch.Tensor, fmt_id: int) -> torch.Tensor:
        """bf16 bits (int16) of the host math on bf16 values x (a multiple of the unit, in units' order)."""
        bits = x.contiguous().view(torch.int16).numpy()
        fin, fout = d / "in.bin", d / "out.bin"
        with open(fin, "wb") as fh:
            fh.write(np.int32(fmt_id).tobytes() + np.int64(bits.size).tobytes() + bits.tobytes())
        subprocess.run([str(exe), str(fin), str(fout)], check=True)
        return torch.from_numpy(np.fromfile(fout, dtype=np.int16).copy())

    return run


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


@pytest.mark.parametrize("name", FORMATS)
def test_host_unit_math_matches_reference(harness, name):
    """quant_math.h's per-part arithmetic, run as the kernel's lanes split a unit (8 values each, the unit maximum
    over the parts), equals the PyTorch reference's BF16 expansion bit for bit (NaN where NaN) on every bf16 bit
    pattern class: NaN/Inf units, subnormals, the format's overflow edge, rounding ties, zeros."""
    f = get_format(name)
    for seed in range(3):
        x = _units(seed, 1200, f.block_size)
        got = harness(x, {"hif4": 0, "mxfp4": 1, "mxfp4_rceil": 2}[name])
        want = quantize_reference(x.view(-1, f.block_size), f, 1, "bf16")[1].values.reshape(-1)
        nan = want.isnan()
        got_v = got.view(torch.bfloat16)
        assert torch.equal(got_v.isnan(), nan), f"seed {seed}: NaN units differ"
        diff = (got[~nan] != want[~nan].view(torch.int16)).nonzero()
        assert diff.numel() == 0, (f"seed {seed}: {diff.numel()} values differ, first at {diff[0].item()}: "
                                   f"{got_v[~nan][diff[0]].item()} vs {want[~nan][diff[0]].item()}")


# ------------------------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------------------------
def _cuda_quantize():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kernels import cuda_quantize

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
        want_r = quantize_reference(x.cpu(), f, 1, "bf16")[1].values
        want_c = quantize_reference(x.t().contiguous().cpu(), f, 1, "bf16")[1].values
        for got, want, what in ((r.cpu(), want_r, "rows"), (c.cpu(), want_c, "columns")):
            nan = want.isnan()
            assert got.shape == want.shape and torch.equal(got.isnan(), nan), f"{rows} x {cols} {what}"
            assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), f"{rows} x {cols} {what}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMATS)
def test_quantize_both_layouts_serves_through_the_kernel(name, monkeypatch):
    """``kernels.quantize.quantize_both_layouts`` (the training linears' X and dY) returns the CUDA kernel's
    expansions, equal to the Triton passes' (``MEGATRON_FP4_CUDA_QUANT=0``) on a training-sized operand."""
    cq = _cuda_quantize()
    from kernels import quantize as qm

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
