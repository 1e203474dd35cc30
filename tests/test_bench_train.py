"""benchmarks/bench_train.py's CPU-side parts: the command line each row's own process gets under --cuda-graph,
and the clear refusals (a bad --recipes item, no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_train  # noqa: E402


@pytest.mark.parametrize("argv", [
    ["--recipes", "bf16,hif4", "--cuda-graph", "--batches", "4x2048,8x4096/2", "--warmup", "2", "--out", "a.json"],
    ["--recipes=bf16,hif4", "--cuda-graph", "--batches=4x2048,8x4096/2", "--warmup", "2", "--out=a.json"],
])
def test_row_argv_replaces_only_the_rows_flags(argv):
    got = bench_train.row_argv(argv, "hif4", (8, 4096, 2), "/tmp/row.json")
    assert got == ["--cuda-graph", "--warmup", "2", "--recipes", "hif4", "--batches", "8x4096/2", "--out",
                   "/tmp/row.json"]
    assert bench_train.row_argv(["--profile"], "bf16", (4, 2048, None), "o.json")[-3:] == ["4x2048", "--out",
                                                                                             "o.json"]
    # the row's own command line parses back to the one row it names
    assert bench_train.parse_batches(got[got.index("--batches") + 1]) == [(8, 4096, 2)]


def _run(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_train.py"), *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=300)


def test_refusals_name_the_problem():
    r = _run("--recipes", "bf16,fp3")
    assert r.returncode != 0 and "--recipes: 'fp3' is not valid; allowed values: bf16, hif4" in r.stderr
    r = _run("--batches", "4by2048")
    assert r.returncode != 0 and "--batches: '4by2048' is not BxT[/micro-batch]" in r.stderr
    r = _run("--rec", "bf16")  # no abbreviations: a row's command line replaces the full flag names only
    assert r.returncode == 2 and "unrecognized arguments: --rec" in r.stderr
    if not __import__("torch").cuda.is_available():
        r = _run("--recipes", "bf16")
        assert r.returncode != 0 and "needs a CUDA GPU" in r.stderr
