"""The environment of a process that compiles Triton kernels for the H200 (sm_90) on a machine without a GPU.

The H200 machine runs Triton 3.6 (with its torch 2.11); the CPU machines' torch brings a newer Triton whose ptxas
allocates registers differently (3.6 spilled registers in two decode kernels where 3.9 did not, session 32). Where
the GPU machine's Triton is installed into ``.sm90-triton/`` at the repository root (README's test command:
``pip install --no-deps --target .sm90-triton "triton==3.6.0"``), the compile checks import it first, so their
register, spill and instruction counts are the H200's; without it they use this machine's Triton."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Where README's test command installs the GPU machine's Triton.
SM90_TRITON = os.path.join(ROOT, ".sm90-triton")


def compile_env() -> dict:
    """os.environ for a compiling subprocess: no interpreter, the GPU machine's Triton (if installed) and the
    repository first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    first = [SM90_TRITON] if os.path.isdir(os.path.join(SM90_TRITON, "triton")) else []
    env["PYTHONPATH"] = os.pathsep.join(first + [ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env
