"""benchmarks/kernel_sass.py: the decode kernel compiles for sm_90 on a CPU-only machine, and its unpack stays a
few instructions per weight value (the kernel it replaced ran 17-18; fp64 constants or per-element scale
selects creeping back in would show here first). The training operands' column kernel compiles too and keeps
its units-shaped tile math: one layout conversion (the transpose; a 2-D form of HiF4's tile math needed 13 and
twice the instructions per value). The CUDA decode GEMM's LEAN build (built by nvcc where it exists) keeps its
lead in instructions per weight value over the default build of the same tile, and the CUDA ResQ sum keeps its
session-48 count."""

import os
import subprocess
import sys

import pytest

from megatron_fp4.kernels import _nvcc
from sm90 import compile_env

triton = pytest.importorskip("triton")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _kernel_sass(args):
    """(instructions per value, layout conversions) of ``kernel_sass.main(args)``, compiled in a fresh process."""
    env = compile_env()  # compile for real, not interpret; the H200's Triton where .sm90-triton/ holds it
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); from benchmarks.kernel_sass import main; "
            f"print('PER_VALUE', main({args!r}), main.convert_layouts)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    per_value, convert = out.stdout.split("PER_VALUE")[-1].split()
    return float(per_value), int(convert)


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton build ships no ptxas")
@pytest.mark.parametrize("fmt,bound", [("mxfp4", 6.0), ("hif4", 8.0)])
def test_decode_loop_instructions_per_value(fmt, bound):
    per_value, _ = _kernel_sass(["decode", "--fmt", fmt, "--prefetch"])
    assert 1.0 < per_value < bound


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton build ships no ptxas")
@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
def test_column_kernel_keeps_its_units_shaped_math(fmt):
    per_value, convert = _kernel_sass(["columns", "--fmt", fmt, "--BK", "64", "--num-warps", "4"])
    assert convert == 1
    assert 10.0 < per_value < 70.0  # Triton 3.6 (the H200's): HiF4 52.8, MXFP4 39.0; 3.9: 47.0, 38.8


@pytest.mark.skipif(_nvcc.nvcc() is None or not os.path.exists(PTXAS), reason="needs nvcc and Triton's nvdisasm")
@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
def test_cuda_decode_lean_build_takes_fewer_instructions(fmt):
    tile = '{"KERNEL": "wgmma", "PRODUCER": 1, "WGS": 2, "DEPTH": 2, "XST": 4, "MINB": 3%s}'
    default, _ = _kernel_sass(["cuda", "--fmt", fmt, "--BM", "16", "--tile", tile % ""])
    lean, _ = _kernel_sass(["cuda", "--fmt", fmt, "--BM", "16", "--tile", tile % ', "LEAN": 1'])
    # nvcc 13.0, sm_90a (session 24): HiF4 6.16 -> 4.91, MXFP4 5.47 -> 4.55 per value and thread
    assert 2.0 < lean < 0.9 * default < 8.0


@pytest.mark.skipif(_nvcc.nvcc() is None or not os.path.exists(PTXAS), reason="needs nvcc and Triton's nvdisasm")
@pytest.mark.parametrize("fmt,bound", [("hif4", 4.2), ("mxfp4", 3.4)])
@pytest.mark.parametrize("tokens", ["16", "64"])
def test_cuda_decode_default_tile_instructions(fmt, bound, tokens):
    """The default (natural-layout) tile's loop per value and thread. Session 39, nvcc 13.0, sm_90a: the bf16
    factors broadcast by the FMAs' operand selectors instead of PRMTs, HiF4's -136 F as an exponent add to one
    product per chunk, and the ring's indices carried from chunk to chunk instead of divided out: HiF4 5.13 -> 3.95
    at 16 tokens (5.06 -> 3.98 at 64), MXFP4 3.53 -> 3.17 (3.50 -> 3.17)."""
    per_value, _ = _kernel_sass(["cuda", "--fmt", fmt, "--BM", tokens])
    assert 2.0 < per_value < bound


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton build ships no ptxas")
@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
def test_resq_sum_alone_skips_the_packing(fmt):
    """The ResQ quantize kernel's bf16 sum without its packed outputs (what the decode GEMMs read) drops the
    packing's instructions: Triton 3.6, 1 x 1024 tile, 4 warps (session 38): HiF4 97.0 -> 75.5, MXFP4 83.4 -> 69.1
    per value and thread."""
    args = ["resq", "--fmt", fmt, "--BR", "1", "--BK", "1024", "--num-warps", "4"]
    packed, _ = _kernel_sass(args + ["--packed"])
    alone, _ = _kernel_sass(args)
    assert 20.0 < alone < 0.9 * packed < 150.0


@pytest.mark.skipif(_nvcc.nvcc() is None or not os.path.exists(PTXAS), reason="needs nvcc and Triton's nvdisasm")
@pytest.mark.parametrize("fmt,bound", [("hif4", 50.0), ("mxfp4", 48.0)])
def test_cuda_resq_sum_instructions(fmt, bound):
    """The CUDA ResQ bf16 sum (resq_sum.cu; quant_math.h's resq_residual and resq_sum, which the fused SwiGLU and
    norm kernels run too) per value and thread. Session 48, nvcc 13.0, sm_90a: 2:4's choice by a min/max network on
    unique keys, HiF4's half-up rounding by one FFMA.RM and a floor, E2M1's rounding by one magic add and the sums
    rounded two at a time by cvt.rn.bf16x2: HiF4 61.0 -> 45.0, MXFP4 59.0 -> 43.0."""
    per_value, _ = _kernel_sass(["resq-cuda", "--fmt", fmt])
    assert 20.0 < per_value < bound
