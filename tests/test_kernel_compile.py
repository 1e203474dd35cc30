"""The training quantize kernels compile for the H200 (sm_90) on a machine without a GPU, through Triton's own
compiler (``benchmarks/sass_quantize.py``, run as a user runs it): what the CPU interpreter cannot check (layouts,
register allocation, PTX), checked before any GPU time is spent. Also guards the one-pass kernel's structure: its
quantization works on the units' own shapes, so Triton needs at most one layout conversion (the tile's second,
transposed load)."""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "cuobjdump")),
                    reason="this Triton ships no NVIDIA toolchain (ptxas, cuobjdump)")
def test_training_quantize_kernels_compile_for_sm90(tmp_path):
    out = tmp_path / "sass.json"
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=ROOT)  # the real compiler, not the interpreter
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sass_quantize.py"), "--out", str(out)],
                   check=True, env=env, cwd=ROOT, timeout=600, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert {r["kernel"] for r in rows} >= {"one-pass hif4", "one-pass mxfp4", "row hif4 8x256", "row mxfp4 8x256"}
    for r in rows:
        assert r["sass"] > 100 and r["per_value"] > 5, r  # real kernel bodies, not stubs
        if r["kernel"].startswith("one-pass"):
            assert r["convert_layouts"] <= 1, r
            assert r["spill_bytes"] in (None, 0) or r["warps"] < 4, r  # None: this ptxas did not report
