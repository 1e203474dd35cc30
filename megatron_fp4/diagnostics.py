"""Per-linear FP4 diagnostics: underflow rate of each linear's quantized input activations (SPEC §5 metric).

    with UnderflowMonitor(model) as mon:       # registers forward pre-hooks; removed on exit
        model(batch)
    mon.collect()   # {"decoder.layers.0.mlp.linear_fc2": 0.41, ...}  (fraction of nonzero inputs -> 0)

Nothing runs when no monitor is enabled (the hooks exist only while it is). A linear is monitored if it has
``fp4_recipe_for_forward()`` (``FP4Linear`` and the FP4 parallel linears); an input is counted only in a forward
that actually quantizes it (a recipe applies and ``quantize_fprop`` is on), in the recipe's activation format,
along the last dim (the GEMM's K). Under tensor parallelism each rank sees its local input (what it quantizes).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_fp4.formats import underflow_rate

__all__ = ["UnderflowMonitor", "fp4_linear_modules"]


def fp4_linear_modules(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.nn.Module]:
    """Name -> module for every FP4-capable linear in ``model`` (names as in ``named_modules``)."""
    return {
        (prefix + name): m
        for name, m in model.named_modules()
        if callable(getattr(m, "fp4_recipe_for_forward", None))
    }


class UnderflowMonitor:
    """Collects, per FP4 linear, how many nonzero input activations quantize to zero. Enable, run, collect."""

    def __init__(self, model: torch.nn.Module, prefix: str = "") -> None:
        self.modules = fp4_linear_modules(model, prefix)
        self._handles: list = []
        self._nonzero: dict[str, int] = {}
        self._underflow: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        """Whether the hooks are installed."""
        return bool(self._handles)

    def enable(self) -> "UnderflowMonitor":
        """Install the forward pre-hooks (idempotent)."""
        if not self._handles:
            for name, module in self.modules.items():
                self._handles.append(module.register_forward_pre_hook(self._make_hook(name)))
        return self

    def disable(self) -> None:
        """Remove the hooks (collected counts are kept)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def reset(self) -> None:
        """Forget the collected counts."""
        self._nonzero.clear()
        self._underflow.clear()

    def counts(self) -> dict[str, tuple[int, int]]:
        """Name -> (underflowed, nonzero) input counts accumulated so far."""
        return {n: (self._underflow[n], self._nonzero[n]) for n in self._nonzero}

    def collect(self, reset: bool = True, group=None) -> dict[str, float]:
        """Name -> underflow rate over all monitored forwards since the last reset (modules never run: absent).

        With ``group`` (a torch.distributed process group, e.g. the data-parallel group) the counts are summed
        over its ranks first; every rank of the group must call it and hold the same module names (ranks of
        one pipeline stage do).
        """
        names = sorted(self._nonzero)
        under = [self._underflow[n] for n in names]
        nonzero = [self._nonzero[n] for n in names]
        if group is not None and torch.distributed.get_world_size(group) > 1:
            device = "cpu"
            if torch.distributed.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            counts = torch.tensor([under, nonzero], dtype=torch.float64, device=device).reshape(2, len(names))
            torch.distributed.all_reduce(counts, group=group)
            under, nonzero = counts[0].tolist(), counts[1].tolist()
        rates = {n: (u / nz if nz else 0.0) for n, u, nz in zip(names, under, nonzero)}
        if reset:
            self.reset()
        return rates

    def __enter__(self) -> "UnderflowMonitor":
        return self.enable()

    def __exit__(self, *exc) -> None:
        self.disable()

    def _make_hook(self, name: str):
        def hook(module: torch.nn.Module, inputs) -> None:
            recipe = module.fp4_recipe_for_forward()
            if recipe is None or not recipe.quantize_fprop or not inputs:
                return
            x: Optional[torch.Tensor] = inputs[0]
            if not isinstance(x, torch.Tensor) or x.numel() == 0:
                return
            with torch.no_grad():
                x = x.detach()
                nonzero = int(torch.count_nonzero(x))
                rate = underflow_rate(x, recipe.format("activation"), dim=-1)
            self._nonzero[name] = self._nonzero.get(name, 0) + nonzero
            self._underflow[name] = self._underflow.get(name, 0) + round(rate * nonzero)

        return hook
