"""Per-layer underflow of rollout activations, with and without ResQ (the paper's lesson (a), SPEC §5 metric).

    with RolloutUnderflowMonitor(model, "hif4", "2:4") as mon:
        engine.generate(prompts, params)
    mon.collect()   # {"decoder.layers.0.mlp.linear_fc2": {"fp4": 0.62, "resq": 0.21}, ...}

"fp4" is the fraction of nonzero inputs of a rollout linear that deq(Q(x)) turns into zero; "resq" the fraction
that stays zero after adding the selected residual, deq(Q(x)) + S(deq(Q(x - deq(Q(x))))). Both are measured on
the same inputs (each forward call of the linear, along K), whatever precision the model runs in.
"""

from __future__ import annotations

import torch

from megatron_fp4.formats import get_format
from megatron_fp4.formats.base import choice_error
from megatron_fp4.resq import SPARSITIES, resq_components
from megatron_fp4.rollout.precision import rollout_linear_modules

__all__ = ["RolloutUnderflowMonitor", "underflow_counts"]


def underflow_counts(x: torch.Tensor, fmt: str, sparsity: str, dim: int = -1) -> tuple[int, int, int]:
    """(nonzero inputs, of them zero after FP4, of them zero after FP4 + ResQ ``sparsity``)."""
    q, s = resq_components(x, fmt, sparsity, dim)
    nz = x != 0
    return int(nz.sum()), int((nz & (q == 0)).sum()), int((nz & ((q + s) == 0)).sum())


class RolloutUnderflowMonitor:
    """Forward pre-hooks on the rollout linears that count underflow without and with ResQ. Enable, run, collect."""

    def __init__(self, model: torch.nn.Module, fmt: str = "hif4", sparsity: str = "2:4") -> None:
        get_format(fmt)  # validates
        if sparsity not in SPARSITIES:
            raise choice_error("sparsity", sparsity, SPARSITIES)
        self.fmt, self.sparsity = fmt, sparsity
        self.modules = rollout_linear_modules(model)
        self._handles: list = []
        self._counts: dict[str, list[int]] = {}

    def enable(self) -> "RolloutUnderflowMonitor":
        """Install the hooks (idempotent)."""
        if not self._handles:
            for name, m in self.modules.items():
                self._handles.append(m.register_forward_pre_hook(self._hook(name)))
        return self

    def disable(self) -> None:
        """Remove the hooks (counts are kept)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module, args):
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                return
            with torch.no_grad():
                nz, u_fp4, u_resq = underflow_counts(x.detach(), self.fmt, self.sparsity)
            c = self._counts.setdefault(name, [0, 0, 0])
            c[0] += nz
            c[1] += u_fp4
            c[2] += u_resq
        return hook

    def counts(self) -> dict[str, tuple[int, int, int]]:
        """Name -> (nonzero, underflowed in FP4, underflowed with ResQ) accumulated so far."""
        return {n: tuple(c) for n, c in self._counts.items()}

    def collect(self, reset: bool = True) -> dict[str, dict[str, float]]:
        """Name -> {"fp4": rate, "resq": rate} since the last reset."""
        out = {n: {"fp4": c[1] / c[0] if c[0] else 0.0, "resq": c[2] / c[0] if c[0] else 0.0}
               for n, c in self._counts.items()}
        if reset:
            self._counts.clear()
        return out

    def as_metrics(self, prefix: str = "rollout/underflow/") -> dict[str, float]:
        """Flat metrics (without resetting): ``{prefix}{layer}/fp4`` and ``/resq``."""
        return {f"{prefix}{n}/{k}": v for n, d in self.collect(reset=False).items() for k, v in d.items()}

    def __enter__(self) -> "RolloutUnderflowMonitor":
        return self.enable()

    def __exit__(self, *exc) -> None:
        self.disable()
