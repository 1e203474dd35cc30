"""Launching Triton kernels with less host time: ``fast(kernel)[grid](*args, **kw)`` does what
``kernel[grid](*args, **kw)`` does, but after a specialization's first launch it calls the compiled kernel's
launcher directly.

Why: a training FP4 linear launches about six quantize kernels per forward + backward, and Triton's Python launch
path (``JITFunction.run``: device and stream lookup, binding, the cache key with ``str(options)``, the global-value
check; an autotuner's key on top) cost ~90-120 us per launch on the H200 machine's host (bench_train.py
--host-overhead: ~1,050 us per HiF4 linear forward + backward against ~200-250 us for BF16), and the FP4 training
step is host-bound there (docs/PERFORMANCE.md).

Correctness: the compiled kernel is reused only for a call that Triton would send to the same compiled kernel.
The key holds what Triton specializes on (each tensor's dtype and 16-byte alignment; each integer's range class,
whether it is 1 and whether it divides by 16; booleans and None by value; floats by type) plus every constexpr
and launch option by value, the device and the kernel. Anything else (another argument type, launch hooks
installed, e.g. by a profiler, the interpreter, a Triton without the expected ``CompiledKernel`` fields) takes
Triton's own path. Autotuned kernels (:func:`fast` of a ``triton.autotune`` object) reuse the configuration the
autotuner chose for the same tuning key.

Off by default: ``MEGATRON_FP4_FAST_LAUNCH=1`` turns it on. It has not run on a GPU yet (its first H200 run found
Triton 3.6's empty hook chains counted as installed hooks, so every launch took Triton's path); the H200's kernel
tests and ``bench_train.py --host-overhead`` with it on decide the default (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from megatron_fp4.kernels._common import HAS_TRITON, interpreting, triton

__all__ = ["fast", "FastKernel", "enabled"]

_INT32 = 1 << 31
_INT64 = 1 << 63


def _hooks_installed() -> bool:
    """Whether a launch hook is installed (a profiler's, e.g. proton): Triton's own path then runs it. Triton 3.6
    keeps the hooks in chains that are empty by default; older versions use None or a callable."""
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    if rt is None:
        return True
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        calls = getattr(hook, "calls", None)
        if hook is not None and (calls is None or len(calls) > 0):
            return True
    return False


def enabled() -> bool:
    """``MEGATRON_FP4_FAST_LAUNCH=1`` turns the direct launch on (off by default until measured on the H200)."""
    return os.environ.get("MEGATRON_FP4_FAST_LAUNCH", "0") == "1"


def _device() -> int:
    return torch.cuda.current_device()


def _stream(device: int) -> int:
    """The current CUDA stream's handle (what Triton's own launch path passes)."""
    return torch._C._cuda_getCurrentRawStream(device)


def _arg_key(a: Any):
    """What Triton specializes an argument on, or raises TypeError for a kind it is not sure of."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return (-_INT32 <= a < _INT32, a < _INT64, a == 1, a % 16 == 0)
    if isinstance(a, float):
        return float
    raise TypeError(type(a).__name__)


class FastKernel:
    """A ``@triton.jit`` function (or a ``triton.autotune`` of one) launched as described in the module's doc."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.tuner = kernel if hasattr(kernel, "configs") and hasattr(kernel, "keys") else None
        self.jit = kernel.fn if self.tuner is not None else kernel
        params = list(self.jit.signature.parameters.values())
        self.names = [p.name for p in params]
        self.defaults = [p.default for p in params]
        self.compiled: dict = {}
        self.configs: dict = {}
        self.tune_at = [self.names.index(k) for k in self.tuner.keys] if self.tuner is not None else []
        self.ok = True  # False once this Triton's compiled kernels turned out not to have the expected fields

    def __getitem__(self, grid) -> Callable:
        return lambda *args, **kw: self.run(grid, args, kw)

    def _full_args(self, args: tuple, kw: dict) -> list:
        """Every parameter's value in signature order (Triton's bound arguments, defaults filled in)."""
        out = list(args)
        for name, default in zip(self.names[len(args):], self.defaults[len(args):]):
            out.append(kw[name] if name in kw else default)
        return out

    def run(self, grid, args: tuple, kw: dict) -> None:
        if (not self.ok or not enabled() or interpreting() or _hooks_installed()
                or any(isinstance(v, torch.Tensor) for v in kw.values())):
            self.kernel[grid](*args, **kw)
            return
        if self.tuner is not None:
            full = self._full_args(args, kw)
            tkey = (tuple(full[i] for i in self.tune_at),
                    tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))  # the autotuner's key
            cfg = self.configs.get(tkey)
            if cfg is None:  # the autotuner's own launch for a new tuning key (it benchmarks the configurations)
                self.kernel[grid](*args, **kw)
                if self.tuner.best_config.pre_hook is None:
                    self.configs[tkey] = self.tuner.best_config
                return
            kw = {**kw, **cfg.all_kwargs()}
        full = self._full_args(args, kw)
        if callable(grid):
            grid = grid(dict(zip(self.names, full)))
        device = _device()
        try:
            key = (tuple(_arg_key(a) for a in args), tuple(kw.items()), device)
            ck = self.compiled.get(key)
        except TypeError:  # an argument kind not covered, or an unhashable constexpr
            self.jit[grid](*args, **kw)
            return
        if ck is None:  # Triton's own launch (it compiles or finds the kernel), remembered for the next ones
            ck = self.jit[grid](*args, **kw)
            if all(hasattr(ck, f) for f in ("run", "function", "packed_metadata")):
                self.compiled[key] = ck
            else:
                self.ok = False
            return
        g = tuple(grid) + (1, 1)
        ck.run(g[0], g[1], g[2], _stream(device), ck.function, ck.packed_metadata, None, None, None, *full)


def fast(kernel) -> FastKernel | Any:
    """:class:`FastKernel` of ``kernel`` where Triton compiles kernels (``kernel`` itself without Triton and in
    its interpreter, whose kernels are not compiled)."""
    if not HAS_TRITON or kernel is None or interpreting():
        return kernel
    return FastKernel(kernel)
