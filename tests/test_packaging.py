"""What the project installs: one top-level package, ``megatron_fp4``, with every file its kernels build from.

A top-level package of a common name shadows the PyPI package of that name for everything in the same environment:
ours was called ``kernels`` until transformers 5.25 started to require Hugging Face's ``kernels`` and every
``import transformers`` in the tests failed on our package (CI, 2026-12-03).
"""

import importlib.util
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_only_top_level_package_is_megatron_fp4():
    packages = {d for d in os.listdir(REPO) if os.path.isfile(os.path.join(REPO, d, "__init__.py"))}
    assert packages == {"megatron_fp4"}, packages


def test_hugging_face_kernels_is_not_shadowed():
    """transformers (>= 5.25) imports the PyPI package ``kernels``; nothing of this checkout may answer to that name."""
    sys.path.insert(0, REPO)
    try:
        spec = importlib.util.find_spec("kernels")
    finally:
        sys.path.remove(REPO)
    assert spec is None or not os.path.realpath(spec.origin or "").startswith(os.path.realpath(REPO) + os.sep), spec


def test_the_built_package_carries_the_cuda_sources(tmp_path):
    """setup.py's package_data: every .cu and .h the CUDA kernels build from on first use ends up installed."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(os.path.join(REPO, "setup.py"), src)
    shutil.copytree(os.path.join(REPO, "megatron_fp4"), src / "megatron_fp4",
                    ignore=shutil.ignore_patterns("__pycache__", "_build"))
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path / "out")], cwd=src,
                   check=True, capture_output=True)
    csrc = os.path.join("megatron_fp4", "kernels", "csrc")
    want = sorted(os.listdir(os.path.join(REPO, csrc)))
    assert want and sorted(os.listdir(tmp_path / "out" / csrc)) == want
