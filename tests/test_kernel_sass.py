"""benchmarks/kernel_sass.py: the decode kernel compiles for sm_90 on a CPU-only machine, and its unpack stays a
few instructions per weight value (the kernel it replaced ran 17-18; fp64 constants or per-element scale
selects creeping back in would show here first)."""

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton build ships no ptxas")
@pytest.mark.parametrize("fmt,bound", [("mxfp4", 6.0), ("hif4", 8.0)])
def test_decode_loop_instructions_per_value(fmt, bound):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real, not interpret
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); from benchmarks.kernel_sass import main; "
            f"print('PER_VALUE', main(['decode', '--fmt', {fmt!r}, '--prefetch']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    per_value = float(out.stdout.split("PER_VALUE")[-1])
    assert 1.0 < per_value < bound, out.stdout
