"""Rollout-ResQ (SPEC §4): sparse FP4 residual correction of rollout activations, and the rollout linear forms.

For a rollout linear with input X (tokens x K) and weight W:

    y = Q(X) Q(W)^T + S(Q(X - Q(X))) Q(W)^T            (W4A4 + ResQ; S = sparsity selector)

    xe = resq_activation(x, "hif4", "2:4")              # deq(Q(x)) + S(deq(Q(x - deq(Q(x)))))
    y = rollout_linear(x, w, b, RolloutPrecision("w4a4", "hif4", "2:4"))

Sparsity selectors S keep 50% of the quantized residual: "2:4" (2 largest of every 4 along K, ties: lower
index), "channel" (the ceil(K/2) K-channels of largest L2 norm over the tokens of the call), "tile32x64" (the
ceil(n/2) of the n 32-token x 64-channel tiles with largest L2 norm), "dense" (identity: the two-tensor split
Q(X) + Q(X - Q(X))), "none" (no residual: plain FP4). Ties in "channel"/"tile32x64" go to the lower index.
"2:4" and "dense" are token-local (a token's result does not depend on the other tokens of the call);
"channel" and "tile32x64" are not, by definition. ``RolloutPrecision(..., resq_combine="bf16")`` rounds
Q(X) + S(Q(R)) once to BF16, so that one BF16 GEMM computes both products (the Hopper fast path of
``megatron_fp4.kernels.dispatch``); the default "exact" keeps the sum in fp32.

Baselines of the paper: W4A16 (weights only), W16A4 (activations only), BF16, OCC-style clipping with sparse
high-precision compensation (:func:`occ_activation`) and the two-tensor split (:func:`split_activation`).
Only the rollout model uses this module; training is unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F

from megatron_fp4.formats import Format, check_tensor, get_format, registered_formats
from megatron_fp4.formats.base import choice_error

__all__ = [
    "SPARSITIES",
    "ROLLOUT_MODES",
    "ACTIVATION_METHODS",
    "RESQ_COMBINES",
    "ROLLOUT_LINEAR_PATHS",
    "RolloutPrecision",
    "QuantizedWeightCache",
    "sparsify",
    "resq_components",
    "resq_activation",
    "split_activation",
    "occ_components",
    "occ_activation",
    "rollout_activation",
    "rollout_linear",
    "register_rollout_backend",
    "rollout_backend_for",
    "paper_rollout_precisions",
    "gemm_cost_vs_bf16",
]

#: Residual sparsity selectors S of SPEC §4.
SPARSITIES = ("none", "2:4", "channel", "tile32x64", "dense")
#: Rollout linear forms: which operands are FP4.
ROLLOUT_MODES = ("bf16", "w4a16", "w16a4", "w4a4")
#: How quantized activations are corrected: ResQ residual (with ``sparsity``) or OCC clipping + compensation.
ACTIVATION_METHODS = ("resq", "occ")
#: How the ResQ residual joins the main operand: "exact" (Q(X) + S(Q(R)) kept in fp32: the residual product is added
#: exactly, two GEMMs on hardware without an fp32 operand) or "bf16" (the sum rounded once to one BF16 operand: one
#: GEMM, so the residual costs no tensor-core time on Hopper; values round only where Q(X) and S(Q(R)) are both
#: nonzero and need more than bf16's 8 significant bits together, see docs/PERFORMANCE.md).
RESQ_COMBINES = ("exact", "bf16")

FormatLike = Union[str, Format]


def _check_sparsity(sparsity: str) -> None:
    if sparsity not in SPARSITIES:
        raise choice_error("sparsity", sparsity, SPARSITIES)


def _as_tokens(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, tuple]:
    """Move ``dim`` last and flatten the rest to tokens: ``[T, K]`` plus what :func:`_from_tokens` needs."""
    if x.dim() == 0:
        raise ValueError("cannot apply a K-dimension selector to a 0-d tensor")
    dim = dim % x.dim()
    xm = x.movedim(dim, -1)
    return xm.reshape(-1, xm.shape[-1]), (xm.shape, dim)


def _from_tokens(x2: torch.Tensor, meta: tuple) -> torch.Tensor:
    shape, dim = meta
    return x2.reshape(shape).movedim(-1, dim)


def _top_half_mask(scores: torch.Tensor) -> torch.Tensor:
    """bool mask (same shape as the 1-D ``scores``) of the ceil(n/2) largest entries; ties: lower index wins."""
    n = scores.numel()
    keep = (n + 1) // 2
    order = torch.argsort(scores, descending=True, stable=True)
    mask = torch.zeros(n, dtype=torch.bool, device=scores.device)
    mask[order[:keep]] = True
    return mask


def _two_of_four_mask(g: torch.Tensor) -> torch.Tensor:
    """bool mask over groups ``[..., 4]``: the 2 largest magnitudes of each group (ties: lower index wins)."""
    a = g.abs()
    ai, aj = a.unsqueeze(-1), a.unsqueeze(-2)  # [..., i, j]
    lower = torch.ones(4, 4, dtype=torch.bool, device=g.device).tril(-1)  # j < i
    beaten_by = (aj > ai) | ((aj == ai) & lower)  # j beats i
    return beaten_by.sum(-1) < 2


def sparsify(r: torch.Tensor, sparsity: str, dim: int = -1) -> torch.Tensor:
    """S(r): keep 50% of ``r`` per the selector (SPEC §4); K is ``dim``, every other dimension is tokens."""
    _check_sparsity(sparsity)
    if sparsity == "dense":
        return r
    if sparsity == "none":
        return torch.zeros_like(r)
    r2, meta = _as_tokens(r, dim)
    T, K = r2.shape
    if r2.numel() == 0:
        return r
    if sparsity == "2:4":
        pad = (-K) % 4
        g = F.pad(r2, (0, pad)) if pad else r2
        g = g.reshape(T, -1, 4)
        out = (g * _two_of_four_mask(g)).reshape(T, -1)[:, :K]
    elif sparsity == "channel":
        norms = r2.float().square().sum(0)  # [K]; squared L2 norm ranks the same as the norm
        out = r2 * _top_half_mask(norms).to(r2.dtype)
    else:  # tile32x64
        pt, pk = (-T) % 32, (-K) % 64
        g = F.pad(r2, (0, pk, 0, pt)) if (pt or pk) else r2
        nt, nk = g.shape[0] // 32, g.shape[1] // 64
        tiles = g.reshape(nt, 32, nk, 64)
        norms = tiles.float().square().sum(dim=(1, 3)).reshape(-1)  # row-major tile order
        mask = _top_half_mask(norms).reshape(nt, 1, nk, 1).to(g.dtype)
        out = (tiles * mask).reshape(nt * 32, nk * 64)[:T, :K]
    return _from_tokens(out, meta)


def resq_components(x: torch.Tensor, fmt: FormatLike, sparsity: str, dim: int = -1
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(deq(Q(x)), S(deq(Q(x - deq(Q(x)))))) in fp32; the residual part is all zeros for sparsity "none"."""
    _check_sparsity(sparsity)
    check_tensor(x, "x", "resq_activation")
    f = get_format(fmt)
    xf = x.float()
    q = f.fake_quantize(xf, dim=dim)
    if sparsity == "none":
        return q, torch.zeros_like(q)
    rq = f.fake_quantize(xf - q, dim=dim)
    return q, sparsify(rq, sparsity, dim=dim)


def resq_activation(x: torch.Tensor, fmt: FormatLike, sparsity: str, dim: int = -1,
                    out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Effective activation deq(Q(x)) + S(deq(Q(x - deq(Q(x))))) along ``dim`` (SPEC §4).

    Computed in fp32 and returned in ``out_dtype`` (default ``x.dtype``; the sum can need more bits than bf16
    holds, so pass ``torch.float32`` to keep it exact).
    """
    q, s = resq_components(x, fmt, sparsity, dim)
    return (q + s).to(out_dtype or x.dtype)


def split_activation(x: torch.Tensor, fmt: FormatLike, dim: int = -1,
                     out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Two-tensor split baseline Q(X) + Q(X - Q(X)) (dense residual, two full FP4 GEMMs)."""
    return resq_activation(x, fmt, "dense", dim, out_dtype)


def occ_components(x: torch.Tensor, fmt: FormatLike, outlier_fraction: float = 1 / 64, dim: int = -1
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """OCC-style clipping: (deq(Q(clip(x, t))), x - clip(x, t)) in fp32, per token along ``dim``.

    The per-token threshold t is the (n+1)-th largest |x| of the token with n = ceil(outlier_fraction * K), so at
    most n values per token are clipped; their excess is the sparse high-precision compensation term.
    """
    if not (isinstance(outlier_fraction, (int, float)) and 0.0 <= outlier_fraction <= 1.0):
        raise ValueError(f"outlier_fraction={outlier_fraction!r} is not valid; it must be in [0, 1]")
    f = get_format(fmt)
    x2, meta = _as_tokens(x.float(), dim)
    K = x2.shape[1]
    n = min(math.ceil(outlier_fraction * K), K)
    if n == 0 or x2.numel() == 0:
        clipped = x2
    elif n >= K:
        clipped = torch.zeros_like(x2)
    else:
        t = x2.abs().topk(n + 1, dim=-1).values[:, -1:]  # [T, 1]
        clipped = torch.maximum(torch.minimum(x2, t), -t)
    excess = x2 - clipped
    q = f.fake_quantize(clipped, dim=-1)
    return _from_tokens(q, meta), _from_tokens(excess, meta)


def occ_activation(x: torch.Tensor, fmt: FormatLike, outlier_fraction: float = 1 / 64, dim: int = -1,
                   out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """OCC baseline: deq(Q(clip(x, t))) + (x - clip(x, t)) (clipped outliers added back in high precision)."""
    q, e = occ_components(x, fmt, outlier_fraction, dim)
    return (q + e).to(out_dtype or x.dtype)


# --------------------------------------------------------------------------------------------------------------------
# Rollout precision and linear forms
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RolloutPrecision:
    """How a rollout linear computes, independent of the training recipe (one row of the paper's table)."""

    #: "bf16" (model dtype), "w4a16" (FP4 weights only), "w16a4" (FP4 activations only), "w4a4" (both).
    mode: str = "bf16"
    #: FP4 format of the quantized operands ("hif4", "mxfp4", or any registered format).
    format: str = "hif4"
    #: ResQ residual selector for quantized activations: "none", "2:4", "channel", "tile32x64", "dense".
    sparsity: str = "none"
    #: "resq" (residual quantization, uses ``sparsity``) or "occ" (clipping + sparse high-precision excess).
    activation_method: str = "resq"
    #: OCC: fraction of each token's K values treated as outliers (clipped, compensated in high precision).
    occ_outlier_fraction: float = 1 / 64
    #: ResQ: "exact" or "bf16" (:data:`RESQ_COMBINES`): whether Q(X) + S(Q(R)) is rounded to one BF16 operand.
    resq_combine: str = "exact"

    def __post_init__(self) -> None:
        if self.mode not in ROLLOUT_MODES:
            raise choice_error("mode", self.mode, ROLLOUT_MODES)
        if self.format not in registered_formats():
            raise choice_error("format", self.format, registered_formats())
        _check_sparsity(self.sparsity)
        if self.activation_method not in ACTIVATION_METHODS:
            raise choice_error("activation_method", self.activation_method, ACTIVATION_METHODS)
        if not self.quantize_activations and (self.sparsity != "none" or self.activation_method != "resq"):
            raise ValueError(f"mode={self.mode!r} keeps activations in high precision; sparsity must be 'none' and "
                             f"activation_method 'resq' (got {self.sparsity!r}, {self.activation_method!r})")
        if self.activation_method == "occ" and self.sparsity != "none":
            raise ValueError("activation_method='occ' does not use a ResQ residual; set sparsity='none'")
        if not 0.0 <= self.occ_outlier_fraction <= 1.0:
            raise ValueError(f"occ_outlier_fraction={self.occ_outlier_fraction!r} must be in [0, 1]")
        if self.resq_combine not in RESQ_COMBINES:
            raise choice_error("resq_combine", self.resq_combine, RESQ_COMBINES)
        if self.resq_combine != "exact" and (self.sparsity == "none" or self.activation_method != "resq"):
            raise ValueError(f"resq_combine={self.resq_combine!r} combines a ResQ residual with Q(X); it needs "
                             f"activation_method 'resq' and a sparsity other than 'none' (got "
                             f"{self.activation_method!r}, {self.sparsity!r})")

    @property
    def quantize_weights(self) -> bool:
        """Whether weights are FP4 in this mode."""
        return self.mode in ("w4a16", "w4a4")

    @property
    def quantize_activations(self) -> bool:
        """Whether activations are FP4 in this mode."""
        return self.mode in ("w16a4", "w4a4")

    @property
    def bf16_sum_operand(self) -> bool:
        """Whether activations become one BF16 operand, ResQ 2:4's bf16 sum (W4A4 + ResQ 2:4, ``resq_combine``
        "bf16"), that the linear multiplies as W4A16: the operand a fused kernel before the linear (the norm, the
        SwiGLU) can make in its stead."""
        return (self.mode, self.sparsity, self.resq_combine, self.activation_method) == ("w4a4", "2:4", "bf16", "resq")

    @property
    def label(self) -> str:
        """Short name, e.g. "w4a4+resq2:4/hif4"."""
        extra = ""
        if self.activation_method == "occ":
            extra = "+occ"
        elif self.sparsity != "none":
            extra = f"+resq{self.sparsity}" + ("+bf16sum" if self.resq_combine == "bf16" else "")
        return f"{self.mode}{extra}" + ("" if self.mode == "bf16" else f"/{self.format}")


def paper_rollout_precisions(fmt: str = "hif4") -> dict[str, RolloutPrecision]:
    """The rollout column of the paper's table (SPEC §1) for one format."""
    return {
        "BF16": RolloutPrecision("bf16", fmt),
        "W4A16": RolloutPrecision("w4a16", fmt),
        "W16A4": RolloutPrecision("w16a4", fmt),
        "FP4": RolloutPrecision("w4a4", fmt),
        "FP4 + ResQ 2:4": RolloutPrecision("w4a4", fmt, "2:4"),
    }


def gemm_cost_vs_bf16(precision: RolloutPrecision) -> float:
    """Speed-up over BF16 of one rollout GEMM under SPEC §4's cost model (native FP4 = 4x BF16 throughput).

    FP4 x FP4 costs 0.5 mdn units (BF16 = 2 mdn); a 2:4 residual GEMM 0.25; a dense residual 0.5. Mixed-precision
    modes (w4a16 / w16a4) run at BF16 speed (1.0); OCC is counted as one FP4 GEMM (its sparse high-precision
    excess is not modelled).
    """
    if precision.mode != "w4a4":
        return 1.0
    cost = 0.5 + {"none": 0.0, "2:4": 0.25, "channel": 0.25, "tile32x64": 0.25, "dense": 0.5}[precision.sparsity]
    return 2.0 / cost


def _same_structure(dst: Any, src: Any) -> bool:
    """Whether :func:`copy_into` can write ``src`` into ``dst``: the same structure of tensors (same shapes, dtypes,
    devices) and equal plain values."""
    if isinstance(dst, torch.Tensor) or isinstance(src, torch.Tensor):
        return (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and dst.shape == src.shape
                and dst.dtype == src.dtype and dst.device == src.device)
    if type(dst) is not type(src):
        return False
    if isinstance(dst, (tuple, list)):
        return len(dst) == len(src) and all(_same_structure(a, b) for a, b in zip(dst, src))
    if isinstance(dst, dict):
        return dst.keys() == src.keys() and all(_same_structure(dst[k], src[k]) for k in dst)
    if dataclasses.is_dataclass(dst):
        return all(_same_structure(getattr(dst, f.name), getattr(src, f.name)) for f in dataclasses.fields(dst))
    try:
        return bool(dst == src)
    except Exception:
        return dst is src


def _copy_tensors(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for a, b in zip(dst, src):
            _copy_tensors(a, b)
    elif isinstance(dst, dict):
        for k in dst:
            _copy_tensors(dst[k], src[k])
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            _copy_tensors(getattr(dst, f.name), getattr(src, f.name))


def copy_into(dst: Any, src: Any) -> bool:
    """Copy ``src`` into ``dst`` in place where both are the same structure of tensors (same shapes and dtypes)
    and equal plain values (dataclasses, named tuples, lists, dicts); where they differ, return False and leave
    ``dst`` untouched (the structure is checked before anything is written)."""
    if not _same_structure(dst, src):
        return False
    with torch.no_grad():
        _copy_tensors(dst, src)
    return True


class QuantizedWeightCache:
    """Dequantized FP4 weights, quantized once per weight version instead of once per call.

    An entry is reused while the weight is the same tensor object with the same storage pointer and
    ``_version``; writes that bypass the version counter (``param.data.copy_``) need :meth:`clear` or
    :meth:`refresh` (the rollout engine calls it on every weight update).

    A stale entry is rebuilt **in place**: the new form is written into the tensors of the old one (same shapes,
    dtypes and flags), so their ``data_ptr()`` stay what CUDA graphs captured; only a first build or a change of
    structure (shape, dtype, a flag such as ``PreparedWeight.wide``) allocates, counted in :attr:`reallocations`
    and :attr:`generation`.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], tuple] = {}
        #: Number of weight quantizations performed, and their total wall time in seconds.
        self.quantize_calls = 0
        self.quantize_seconds = 0.0
        #: Whether the last :meth:`refresh` kept every entry's tensors (wrote the new forms in place).
        self.last_refresh_in_place = True
        #: Incremented whenever an entry is replaced by a new object or dropped (not by in-place refreshes):
        #: users that captured entries by address (CUDA graphs) compare it to know they must recapture.
        self.generation = 0
        #: Number of stale entries whose new form could not be written in place (replaced by a new object).
        self.reallocations = 0

    def get(self, weight: torch.Tensor, fmt: FormatLike) -> torch.Tensor:
        """deq(Q(weight)) along its last dim (K), in ``weight.dtype`` (FP4 values are exact in bf16)."""
        f = get_format(fmt)
        return self.get_prepared(weight, f.name, lambda w: f.fake_quantize(w, dim=-1))

    def get_prepared(self, weight: torch.Tensor, kind: str, build: Callable[[torch.Tensor], Any]) -> Any:
        """Any per-weight object (e.g. a kernel's packed weight) built by ``build(weight)`` once per weight version,
        under the same invalidation rules as :meth:`get` (a rebuild writes into the old object's tensors where
        the structure allows); dropped by :meth:`clear`."""
        key = (id(weight), kind)
        stamp = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, weight.device)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == stamp:
            return entry[2]
        t0 = time.perf_counter()
        with torch.no_grad():
            obj = build(weight.detach())
        if entry is not None:
            if entry[0]() is weight and copy_into(entry[2], obj):
                obj = entry[2]  # the same tensors, new values
            else:
                self.generation += 1
                self.reallocations += 1
        self.quantize_seconds += time.perf_counter() - t0
        self.quantize_calls += 1
        self._entries[key] = (weakref.ref(weight), stamp, obj)
        return obj

    def refresh(self, weights, fmt: FormatLike, precision: Optional["RolloutPrecision"] = None,
                in_place: bool = True) -> float:
        """Re-quantize ``weights`` (an iterable of tensors) now; returns the seconds it took. With ``precision``,
        a registered rollout backend for the weights' device prepares its own weight form instead.

        ``in_place`` (default): write each new form into the tensors of the entry it replaces (same shapes,
        dtypes and flags), one weight at a time, so that captured CUDA graphs that read them stay valid; entries
        that cannot be (first build, changed structure, a form no longer used) are replaced or dropped, and
        :attr:`last_refresh_in_place` says whether any was. ``in_place=False`` drops the old forms first (new
        tensors for every weight)."""
        t0 = time.perf_counter()
        get_format(fmt)  # validates
        weights = list(weights)
        self.last_refresh_in_place = True
        for w in weights:
            keys = [k for k in self._entries if k[0] == id(w)]
            if not in_place:
                for key in keys:
                    del self._entries[key]  # every cached form of this weight (reference and backend-prepared)
                if keys:
                    self.generation += 1
                    self.last_refresh_in_place = False
            else:
                for key in keys:
                    ref, _, obj = self._entries[key]
                    self._entries[key] = (ref, None, obj)  # stale: the next build writes into obj
            reallocations = self.reallocations
            backend = _ROLLOUT_BACKENDS.get(w.device.type)
            prepare = getattr(backend, "prepare_weight", None)
            if not (precision is not None and prepare is not None
                    and prepare(w, precision, self) is not NotImplemented):
                self.get(w, fmt)
            if self.reallocations != reallocations:
                self.last_refresh_in_place = False
            for key in [k for k in keys if k in self._entries and self._entries[k][1] is None]:
                del self._entries[key]  # a form this refresh did not rebuild (e.g. another precision's)
                self.generation += 1
                self.last_refresh_in_place = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def clear(self) -> None:
        """Drop every cached weight (frees their memory)."""
        if self._entries:
            self.generation += 1
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Memory held by the cached dequantized weights (tensor entries only)."""
        return sum(e[2].numel() * e[2].element_size() for e in self._entries.values()
                   if isinstance(e[2], torch.Tensor))


#: device type -> rollout GEMM backend (see :func:`register_rollout_backend`).
_ROLLOUT_BACKENDS: dict[str, Any] = {}
#: FP4 :func:`rollout_linear` calls of this process served by a registered backend (the kernels) and by the PyTorch
#: reference (none registered, or it declined the call); host-side counts (a CUDA-graph replay runs no Python).
ROLLOUT_LINEAR_PATHS = {"backend": 0, "reference": 0}


def register_rollout_backend(device_type: str, fn: Optional[Callable]) -> None:
    """Serve quantized :func:`rollout_linear` calls on ``device_type`` with ``fn`` (None removes it).

    ``fn(x2d, weight, precision, cache, out_dtype) -> [M, n]`` in ``out_dtype`` or ``NotImplemented`` (then the
    PyTorch reference runs); it must return the reference's numbers up to fp32 summation order. ``out_dtype`` is
    x's dtype where the linear has no bias (the GEMM's fp32 sums round once to it, as the reference's cast does,
    and no fp32 output is written and cast back) and fp32 where a bias is added after it. An optional attribute
    ``fn.prepare_weight(weight, precision, cache)`` quantizes a weight ahead of time (weight sync); ``fn.adds_bias``
    True: ``fn`` takes ``bias=`` (a linear's bias) and adds it to its fp32 sums before the one rounding to
    ``out_dtype`` (x's dtype then), with no separate bias cast, add and cast kernels.
    """
    if fn is None:
        _ROLLOUT_BACKENDS.pop(device_type, None)
        return
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    _ROLLOUT_BACKENDS[device_type] = fn


def rollout_backend_for(device_type: str) -> Optional[Callable]:
    """The backend serving ``device_type`` (None: the PyTorch reference)."""
    return _ROLLOUT_BACKENDS.get(device_type)


def rollout_activation(x: torch.Tensor, precision: RolloutPrecision) -> torch.Tensor:
    """The activation a rollout linear multiplies (fp32, or bf16 for ``resq_combine="bf16"``, when quantized;
    ``x`` itself otherwise)."""
    if not precision.quantize_activations:
        return x
    if precision.activation_method == "occ":
        return occ_activation(x, precision.format, precision.occ_outlier_fraction, dim=-1, out_dtype=torch.float32)
    out_dtype = torch.bfloat16 if precision.resq_combine == "bf16" else torch.float32
    return resq_activation(x, precision.format, precision.sparsity, dim=-1, out_dtype=out_dtype)


def rollout_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    precision: Union[str, RolloutPrecision] = "bf16",
    fmt: Optional[str] = None,
    sparsity: Optional[str] = None,
    *,
    cache: Optional[QuantizedWeightCache] = None,
    weight_q: Optional[torch.Tensor] = None,
    as_stored: bool = False,
) -> torch.Tensor:
    """Rollout ``x @ W^T + b`` in one of the rollout forms (BF16, W4A16, W16A4, W4A4 [+ ResQ | OCC]).

    ``precision`` is a :class:`RolloutPrecision` or a mode string (then ``fmt``/``sparsity`` complete it).
    Quantized forms multiply in fp32 (SPEC: fp32 accumulation) and return ``x.dtype``. The FP4 weight comes from
    ``weight_q`` if given, else from ``cache`` (quantized once per weight version), else is quantized now.
    ``as_stored``: ``[splits, *x.shape[:-1], n]``, the split-K partial sums of a kernel backend's decode GEMM as it
    stored them (fp32; no atomics, no zero-fill, no cast kernel), for a reader that adds them in order and rounds to
    ``x.dtype`` (the engine's fused decode-step kernels); one split (any other path) is the result itself. With a
    bias the splits are added here (in order, fp32), then the bias: one split.
    """
    if isinstance(precision, str):
        precision = RolloutPrecision(precision, fmt or "hif4", sparsity or "none")
    elif fmt is not None or sparsity is not None:
        raise ValueError("pass fmt/sparsity only with a mode string; a RolloutPrecision already carries them")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"rollout_linear: x has {x.shape[-1]} features but weight is {tuple(weight.shape)}")
    if precision.mode == "bf16":
        y = F.linear(x, weight, bias)
        return y.unsqueeze(0) if as_stored else y
    backend = _ROLLOUT_BACKENDS.get(x.device.type) if weight_q is None else None
    if backend is not None:
        x2 = x.reshape(-1, x.shape[-1])
        adds_bias = bias is not None and getattr(backend, "adds_bias", False)  # bias + rounding in its kernel
        y = (backend(x2, weight, precision, cache, out_dtype=x.dtype, bias=bias) if adds_bias else
             backend(x2, weight, precision, cache, out_dtype=None if as_stored else
                     torch.float32 if bias is not None else x.dtype))
        if y is not NotImplemented:
            ROLLOUT_LINEAR_PATHS["backend"] += 1
            if as_stored and not adds_bias:
                y = y if y.dim() == 3 else y.unsqueeze(0)  # (the other paths: x.dtype [M, n])
                if bias is None:
                    return y.reshape(y.shape[0], *x.shape[:-1], weight.shape[0])
                y = y[0].float() if y.shape[0] == 1 else y.float().sum(0)  # the splits in order: deterministic
            if bias is not None and not adds_bias:
                y = y + bias.float()
            y = y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
            return y.unsqueeze(0) if as_stored else y
    ROLLOUT_LINEAR_PATHS["reference"] += 1
    if precision.quantize_weights:
        if weight_q is None:
            weight_q = (cache.get(weight, precision.format) if cache is not None
                        else get_format(precision.format).fake_quantize(weight.detach(), dim=-1))
        w = weight_q
    else:
        w = weight
    a = rollout_activation(x, precision)
    y = torch.matmul(a.float(), w.float().t())
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return y.unsqueeze(0) if as_stored else y
