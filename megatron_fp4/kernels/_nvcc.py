"""Building the CUDA C++ kernels of ``megatron_fp4/kernels/csrc`` with nvcc on first use: one shared library per source
and configuration (``-D`` defines), cached in ``megatron_fp4/kernels/_build`` (or ``MEGATRON_FP4_BUILD_DIR``, else a
temporary folder) under a hash of the sources, and loaded with ctypes. Nothing here needs a GPU; building needs nvcc."""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Optional

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_LOCK = threading.Lock()
_LIBS: dict = {}
_FAILED: dict = {}  # source -> nvcc's message of its first failed build


@functools.lru_cache(maxsize=None)
def nvcc() -> Optional[str]:
    """Path of nvcc (PATH, then $CUDA_HOME/bin), or None."""
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.exists(cand):
            return cand
    return None


def build_dir() -> str:
    d = os.environ.get("MEGATRON_FP4_BUILD_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                 "_build")
    try:
        os.makedirs(d, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    d = os.path.join(tempfile.gettempdir(), "megatron_fp4_build")
    os.makedirs(d, exist_ok=True)
    return d


def build_failed(source: str) -> bool:
    """Whether a build of ``csrc/<source>`` failed in this process (its users then stop trying it)."""
    return source in _FAILED


def command(source: str, defines: dict, out: str, arch: str = "90a", *extra: str) -> list:
    """The nvcc command line that builds ``csrc/<source>`` with ``defines`` into the shared library ``out``
    (``extra``: more nvcc options, e.g. ``-cubin -Xptxas -v`` for a register report instead)."""
    return [nvcc() or "nvcc", "-O3", "-std=c++17", "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-shared",
            "-Xcompiler", "-fPIC", f"-I{CSRC}", *(f"-D{k}={int(v)}" for k, v in sorted(defines.items())), *extra,
            os.path.join(CSRC, source), "-o", out]


def compile_library(source: str, defines: dict, arch: str = "90a") -> str:
    """Path of the shared library of ``csrc/<source>`` built with ``defines`` for ``sm_<arch>``, compiled if
    missing (the key hashes the source, the headers of csrc/, the defines and the arch). Raises RuntimeError with
    nvcc's message if the build fails."""
    src = os.path.join(CSRC, source)
    h = hashlib.sha1(open(src, "rb").read())
    for header in sorted(glob.glob(os.path.join(CSRC, "*.h"))):
        h.update(open(header, "rb").read())
    h.update(repr((sorted(defines.items()), arch)).encode())
    path = os.path.join(build_dir(), f"{os.path.splitext(source)[0]}_{h.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        r = subprocess.run(command(source, defines, tmp, arch), capture_output=True, text=True)
        if r.returncode != 0:
            _FAILED.setdefault(source, r.stderr[-2000:])
            raise RuntimeError(f"building {source} with {defines} failed:\n{r.stderr[-2000:]}")
        os.replace(tmp, path)
    return path


def launcher(source: str, defines: dict, symbol: str, argtypes: list, arch: str = "90a"):
    """The ctypes function ``symbol`` (returning int) of ``source`` built with ``defines`` (:func:`compile_library`
    on first use; later calls are one dictionary lookup)."""
    key = (source, tuple(sorted(defines.items())), symbol, arch)
    fn = _LIBS.get(key)
    if fn is None:
        path = compile_library(source, defines, arch)
        with _LOCK:
            fn = _LIBS.get(key)
            if fn is None:
                fn = getattr(ctypes.CDLL(path), symbol)
                fn.restype = ctypes.c_int
                fn.argtypes = argtypes
                _LIBS[key] = fn
    return fn
