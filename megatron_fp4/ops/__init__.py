"""The single dispatch point for FP4 GEMMs used by the training linears (SPEC §3).

    out = fp4_gemm(a, b, "hif4", "hif4")      # fp32 [m, n] = Q(a) @ Q(b)^T

``a`` is ``[m, K]`` and ``b`` is ``[n, K]`` in high precision (fp32/bf16/fp16), any strides; each is quantized along
its LAST dimension K (the reduction dimension) in its own format and rounding, and the product is accumulated in
fp32 (``out_dtype`` rounds it once at the end). Callers pass transposed views so that K is last (dgrad passes dY
and W^T, wgrad passes dY^T and X^T); a backend that reads strided operands quantizes them without a copy.

Backends: the PyTorch reference (:func:`reference_fp4_gemm`: ``fake_quantize`` + fp32 matmul) serves every device.
A faster implementation (e.g. the Triton kernels in ``megatron_fp4/kernels/``) plugs in per device type with
:func:`register_fp4_gemm_backend` and must return the same numbers (up to fp32 summation order); callers never
change. ``MEGATRON_FP4_GEMM_BACKEND=reference`` (or :func:`use_reference_backend`) forces the reference.

A backend is an :class:`FP4GemmBackend` (two steps: ``quantize`` an operand into its GEMM-ready form, ``matmul``
two forms) or a plain function of both operands. The two steps let a caller reuse a quantized operand: inside
:func:`quantized_weight_cache` (the actor opens one per optimizer step's forward/backward schedule) the operands
passed with ``cache_b=True`` (the FP4 linears' weights, W for fprop and W^T for dgrad) are quantized once per
weight version, not once per micro-batch.

Under CUDA graphs (megatron-core's ``cuda_graph_impl="local"``) no Python runs on a replay, so the weights' quantized
forms live in persistent buffers instead (:func:`persistent_weights`): the graphs read them, and
:func:`refresh_persistent_weights` (the actor calls it at the start of each schedule, after the optimizer step)
rewrites them in place, in one CUDA graph of its own: once per optimizer step, not once per micro-batch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Iterator, NamedTuple, Optional, Union

import torch

from megatron_fp4.formats import Format, InvalidTensorError, check_tensor, get_format
from megatron_fp4.gemm_backend import GEMM_MODES, FP4GemmBackend, GemmBackend, reference_fp4_gemm

__all__ = [
    "GEMM_MODES",
    "FP4GemmBackend",
    "quantized_weight_cache",
    "persistent_weights",
    "refresh_persistent_weights",
    "clear_persistent_weights",
    "Quantized",
    "quantize_both",
    "fp4_gemm",
    "reference_fp4_gemm",
    "register_fp4_gemm_backend",
    "register_kernel_backend",
    "unregister_fp4_gemm_backend",
    "fp4_gemm_backend_for",
    "use_reference_backend",
    "warn_reference_fallback",
]

FormatLike = Union[str, Format]

_BACKENDS: dict[str, GemmBackend] = {}
_FORCE_REFERENCE: list[bool] = []
_AUTO_TRIED: set[str] = set()
_WARNED: set[tuple[str, str]] = set()
_REFERENCE = FP4GemmBackend()


def register_fp4_gemm_backend(device_type: str, fn: Union[GemmBackend, FP4GemmBackend]) -> None:
    """Use ``fn`` for operands on ``device_type`` ("cuda", "cpu", ...); it replaces any earlier registration.

    ``fn`` is an :class:`FP4GemmBackend`, or a function that receives contiguous 2-D operands and resolved Format
    objects and returns fp32 ``[m, n]``; either may return ``NotImplemented`` to fall back to the reference (e.g.
    for a format or shape it does not cover).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    _BACKENDS[device_type] = fn


def unregister_fp4_gemm_backend(device_type: str) -> None:
    """Remove the backend registered for ``device_type`` (the reference serves it again)."""
    _BACKENDS.pop(device_type, None)


def _auto_register(device_type: str) -> None:
    """On first CUDA use, register the Triton kernels (:mod:`megatron_fp4.ops.kernels_backend`) when Triton and a GPU
    are present.

    They return the reference's numbers up to fp32 summation order and decline (NotImplemented) what they do not
    cover (stochastic rounding, NVFP4, mixed formats). ``MEGATRON_FP4_KERNELS=0`` turns this off.
    """
    if device_type != "cuda" or device_type in _AUTO_TRIED or device_type in _BACKENDS:
        return
    _AUTO_TRIED.add(device_type)
    if os.environ.get("MEGATRON_FP4_KERNELS", "1") == "0":
        warn_reference_fallback("training FP4 GEMMs", device_type, "MEGATRON_FP4_KERNELS=0")
        return
    try:
        ok = register_kernel_backend(device_type)
    except ImportError as e:  # Triton or the kernels package missing: the reference serves
        warn_reference_fallback("training FP4 GEMMs", device_type, f"the kernels cannot be imported: {e}")
        return
    if not ok:
        warn_reference_fallback("training FP4 GEMMs", device_type, "Triton cannot run the kernels on this device")


def register_kernel_backend(device_type: str = "cuda") -> bool:
    """Serve ``device_type``'s FP4 GEMMs with the Triton kernels (``kernels_backend.KernelBackend``) if they can run
    there; returns whether. The first CUDA GEMM does this by itself."""
    from megatron_fp4.ops.kernels_backend import kernel_backend

    be = kernel_backend(device_type)
    if be is not None:
        register_fp4_gemm_backend(device_type, be)
    return be is not None


def warn_reference_fallback(what: str, device_type: str, why: str) -> None:
    """Say once per process (on rank 0) that ``what`` runs on the slow PyTorch reference on ``device_type``, and
    why: the numbers are the same, the speed is not."""
    key = (what, device_type)
    if key in _WARNED:
        return
    _WARNED.add(key)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    warnings.warn(f"megatron_fp4: {what} on {device_type} run on the PyTorch reference (same numbers, much slower): "
                  f"{why}", stacklevel=3)


def fp4_gemm_backend_for(device_type: str) -> Optional[GemmBackend]:
    """The backend that will serve ``device_type`` now (None means the PyTorch reference)."""
    if _FORCE_REFERENCE and _FORCE_REFERENCE[-1]:
        return None
    if os.environ.get("MEGATRON_FP4_GEMM_BACKEND", "") == "reference":
        return None
    _auto_register(device_type)
    return _BACKENDS.get(device_type)


@contextlib.contextmanager
def use_reference_backend(enabled: bool = True) -> Iterator[None]:
    """Force the PyTorch reference inside the block (for tests that compare a kernel against it)."""
    _FORCE_REFERENCE.append(enabled)
    try:
        yield
    finally:
        _FORCE_REFERENCE.pop()


class Quantized(NamedTuple):
    """An operand already quantized along its last dimension (:func:`quantize_both`), accepted by :func:`fp4_gemm`
    in place of a tensor: the backend that made it multiplies it."""

    backend: FP4GemmBackend
    value: object
    fmt: Format


def quantize_both(x: torch.Tensor, fmt: FormatLike, mode: str = "exact",
                  b_cols: bool = False) -> Optional[tuple[Quantized, Quantized]]:
    """``x [R, K]`` quantized along K and ``x.t()`` along R (GEMM mode ``mode``), nearest rounding, by the backend
    serving ``x``'s device (one pass over ``x`` where it can); ``b_cols``: ``x.t()`` is the second operand of its
    GEMM (a linear's input X^T in wgrad). None where that backend is a plain function (it only multiplies
    tensors: callers then pass tensors to :func:`fp4_gemm`)."""
    check_tensor(x, "x", "quantize_both", ndim=2)
    f = get_format(fmt)
    backend = fp4_gemm_backend_for(x.device.type)
    if backend is not None and not isinstance(backend, FP4GemmBackend):
        return None
    for be in ((backend, _REFERENCE) if backend is not None else (_REFERENCE,)):
        out = be.quantize_both(x, f, mode, b_cols)
        if out is not NotImplemented and all(o is not NotImplemented for o in out):
            return Quantized(be, out[0], f), Quantized(be, out[1], f)
    raise AssertionError("the reference backend declined a quantization")  # unreachable


class _WeightCache(dict):
    """One :func:`quantized_weight_cache` block's entries: key -> (root tensor, quantized form)."""

    def __init__(self, both_layouts: bool):
        super().__init__()
        self.both_layouts = both_layouts


_CACHES: list[_WeightCache] = []


@contextlib.contextmanager
def quantized_weight_cache(both_layouts: bool = False) -> Iterator[dict]:
    """Inside the block, operands passed to :func:`fp4_gemm` with ``cache_b=True`` are quantized once per weight
    version and reused (the numbers are those of quantizing them every time). ``both_layouts``: a 2-D weight's first
    quantization (W, fprop) also makes W^T's (dgrad), from one read of W where the backend can
    (``quantize_weight_both``): for blocks whose passes all have a backward.

    An entry is keyed by the tensor's storage, view (offset, shape, strides), dtype and version counter (in-place
    updates through autograd-visible ops bump it), the format, rounding mode and GEMM mode. Weights changed through
    ``.data`` are not seen: open the block around work that does not update the weights (one forward/backward
    schedule), as the actor does. The cache (and the memory it holds) is dropped at the end of the block.
    """
    cache = _WeightCache(both_layouts)
    _CACHES.append(cache)
    try:
        yield cache
    finally:
        _CACHES.pop()
        cache.clear()


def _capturing(x: torch.Tensor) -> bool:
    """Whether ``x``'s CUDA stream is being captured into a CUDA graph, or megatron-core is creating its CUDA graphs
    (whose warm-up runs must take the capture's path: they autotune the kernels it launches, which cannot be
    tuned during the capture)."""
    if not x.is_cuda:
        return False
    if torch.cuda.is_current_stream_capturing():
        return True
    graphs = sys.modules.get("megatron.core.transformer.cuda_graphs")  # megatron-core only if already loaded
    return graphs is not None and graphs.is_graph_capturing()


class _PersistentWeights:
    """Weights' quantized forms in buffers that outlive the optimizer steps (what CUDA graphs read).

    ``entries`` maps a weight view and its quantization (backend, view, dtype, format, GEMM mode: no version: the
    buffers are rewritten in place) to ``[base, view, backend, format, mode, quantized]``. ``refresh`` re-quantizes
    every entry into its buffers; on CUDA after the first refresh it captures that loop as one CUDA graph (hundreds
    of quantize launches would otherwise cost more host time than their GPU time) and replays it, capturing again
    when entries were added."""

    def __init__(self):
        self.entries: dict = {}
        self.forced: list[bool] = []
        self.graph = None
        self.graph_entries = -1  # how many entries the graph re-quantizes

    def get(self, backend: FP4GemmBackend, x: torch.Tensor, fmt: Format, mode: str):
        base, key = _cache_key(backend, x, fmt, mode, version=False)
        hit = self.entries.get(key)
        if hit is not None and hit[0] is base:
            return hit[5]
        q = backend.quantize(x, fmt, "nearest", None, mode, True)
        # unseen before a stream capture: quantized inside the graph (its buffer would belong to the graph's pool)
        if q is not NotImplemented and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.entries[key] = [base, x, backend, fmt, mode, q]
        return q

    @torch.no_grad()
    def _requantize_all(self) -> None:
        """Every entry re-quantized; a weight W held in both layouts (W for fprop, W^T for dgrad: the same storage,
        transposed views) in one ``requantize_both`` call, which a backend may serve from one read of W."""
        partners = {}  # key of a contiguous 2-D W -> key of W.t()'s entry
        for key, (_, x, *_) in self.entries.items():
            t = _transposed_key(key) if x.dim() == 2 and x.is_contiguous() else None
            if t in self.entries and t != key:
                partners[key] = t
        paired = set(partners.values())
        for key, (_, x, backend, fmt, mode, q) in self.entries.items():
            if key in partners:
                backend.requantize_both(x, fmt, mode, q, self.entries[partners[key]][5])
            elif key not in paired:
                backend.requantize(x, fmt, mode, q)

    def refresh(self) -> None:
        if not self.entries:
            return
        cuda = all(e[1].is_cuda for e in self.entries.values())
        if not cuda or os.environ.get("MEGATRON_FP4_REFRESH_GRAPH", "1") == "0":
            self._requantize_all()
            return
        if self.graph is None or self.graph_entries != len(self.entries):
            self._requantize_all()  # eagerly first: what the capture launches is tuned and compiled
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._requantize_all()
            self.graph_entries = len(self.entries)
        self.graph.replay()

    def clear(self) -> None:
        self.entries.clear()
        self.graph, self.graph_entries = None, -1


_PERSISTENT = _PersistentWeights()


@contextlib.contextmanager
def persistent_weights(enabled: bool = True) -> Iterator[None]:
    """Inside the block, weights (``cache_b=True`` operands) take the path they take while CUDA graphs are made
    (on any device): their quantized forms are held in persistent buffers, made on first use and rewritten in
    place only by :func:`refresh_persistent_weights`. For tests and for callers that run the same weights through
    their own graphs."""
    _PERSISTENT.forced.append(enabled)
    try:
        yield
    finally:
        _PERSISTENT.forced.pop()


def refresh_persistent_weights() -> None:
    """Re-quantize every weight held for CUDA graphs into its buffers (after an optimizer step changed the
    weights; one CUDA-graph replay on the GPU, ``MEGATRON_FP4_REFRESH_GRAPH=0``: eager launches). Nothing to do, and
    nothing done, when no graph uses FP4 weights."""
    _PERSISTENT.refresh()


def clear_persistent_weights() -> None:
    """Drop the persistent quantized weights (and their memory): after the CUDA graphs that read them are gone."""
    _PERSISTENT.clear()


def _cache_key(backend: FP4GemmBackend, x: torch.Tensor, fmt: Format, mode: str, version: bool = True):
    """(root tensor of ``x``, key of ``x``'s view and, with ``version``, its version, in a weight cache)."""
    base = x if x._base is None else x._base
    return base, (id(backend), id(base), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype,
                  x._version if version else None, fmt.name, mode)


def _transposed_key(key: tuple) -> tuple:
    """The :func:`_cache_key` key of the transposed view (``x.t()``) of the 2-D view whose key is ``key``."""
    return key[:3] + (key[3][::-1], key[4][::-1]) + key[5:]


def _quantize(backend: FP4GemmBackend, x: torch.Tensor, fmt: Format, rounding: str,
              generator: Optional[torch.Generator], mode: str, cache: bool):
    """``backend.quantize`` of ``x``, through the open weight cache when ``cache``.

    While CUDA graphs are made (megatron's ``cuda_graph_impl="local"``: warm-up runs and capture) a weight comes
    from the persistent buffers (:class:`_PersistentWeights`) instead: the graph reads them on every replay, and
    :func:`refresh_persistent_weights` rewrites them after the optimizer changed the weights in place (the graph's
    Python, the cache's version check, never runs again)."""
    if cache and rounding == "nearest" and ((_PERSISTENT.forced and _PERSISTENT.forced[-1]) or _capturing(x)):
        return _PERSISTENT.get(backend, x, fmt, mode)
    if not (cache and _CACHES and rounding == "nearest"):
        return backend.quantize(x, fmt, rounding, generator, mode, cache)
    cache = _CACHES[-1]
    base, key = _cache_key(backend, x, fmt, mode)
    hit = cache.get(key)
    if hit is not None and hit[0] is base:
        return hit[1]
    if cache.both_layouts and x.dim() == 2 and x.is_contiguous() and _transposed_key(key) not in cache:
        # W now, and W^T for the backward's dgrad
        q, q_t = backend.quantize_weight_both(x, fmt, mode)
        if q_t is not NotImplemented:
            cache[_transposed_key(key)] = (base, q_t)
    else:
        q = backend.quantize(x, fmt, rounding, generator, mode, True)
    if q is not NotImplemented:
        cache[key] = (base, q)  # holds ``base``: its id cannot be reused while the entry lives
    return q


def fp4_gemm(
    a: Union[torch.Tensor, Quantized],
    b: Union[torch.Tensor, Quantized],
    a_format: FormatLike,
    b_format: FormatLike,
    *,
    a_rounding: str = "nearest",
    b_rounding: str = "nearest",
    generator: Optional[torch.Generator] = None,
    out_dtype: torch.dtype = torch.float32,
    mode: str = "exact",
    cache_b: bool = False,
) -> torch.Tensor:
    """``Q(a) @ Q(b)^T`` for ``a [m, K]``, ``b [n, K]``, each quantized along K in its format and rounding,
    accumulated in fp32 and rounded once to ``out_dtype``. ``mode``: one of :data:`GEMM_MODES`; ``cache_b``:
    reuse ``b``'s quantization inside :func:`quantized_weight_cache` (for weights). Either operand may be
    :class:`Quantized` (its format and rounding then come with it; the other operand's backend is its backend)."""
    if mode not in GEMM_MODES:
        raise ValueError(f"fp4_gemm: mode={mode!r} is not valid; allowed values: {', '.join(map(repr, GEMM_MODES))}")
    if isinstance(a, Quantized) or isinstance(b, Quantized):
        be = a.backend if isinstance(a, Quantized) else b.backend
        qa = a.value if isinstance(a, Quantized) else be.quantize(a, get_format(a_format), a_rounding, generator,
                                                                  mode, False)
        qb = b.value if isinstance(b, Quantized) else _quantize(be, b, get_format(b_format), b_rounding, generator,
                                                                mode, cache_b)
        out = NotImplemented if qa is NotImplemented or qb is NotImplemented else be.matmul(qa, qb, out_dtype, mode)
        if out is NotImplemented:
            raise ValueError(f"fp4_gemm: the {type(be).__name__} that quantized an operand cannot multiply it by "
                             f"the other ({a_format!r} x {b_format!r}); pass both as tensors")
        return out
    check_tensor(a, "a", "fp4_gemm", ndim=2)
    check_tensor(b, "b", "fp4_gemm", ndim=2)
    if a.shape[1] != b.shape[1]:
        raise InvalidTensorError(f"fp4_gemm: reduction dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"fp4_gemm: operands on different devices ({a.device}, {b.device})")
    a_fmt, b_fmt = get_format(a_format), get_format(b_format)
    backend = fp4_gemm_backend_for(a.device.type)
    if backend is not None and not isinstance(backend, FP4GemmBackend):  # a plain function: fp32, contiguous
        out = backend(a.contiguous(), b.contiguous(), a_fmt, b_fmt, a_rounding, b_rounding, generator)
        if out is not NotImplemented:
            return out.to(out_dtype)
        backend = None
    for be in ((backend, _REFERENCE) if backend is not None else (_REFERENCE,)):
        qa = be.quantize(a, a_fmt, a_rounding, generator, mode, False)  # a first: the stochastic-rounding stream
        qb = (_quantize(be, b, b_fmt, b_rounding, generator, mode, cache_b) if qa is not NotImplemented
              else qa)
        if qb is not NotImplemented:
            out = be.matmul(qa, qb, out_dtype, mode)
            if out is not NotImplemented:
                return out
    raise AssertionError("the reference backend declined a GEMM")  # unreachable: the reference serves all
