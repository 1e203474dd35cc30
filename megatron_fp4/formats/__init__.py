"""FP4 number formats as pure PyTorch: the reference every kernel, exporter and plug-in must match bit for bit.

    fmt = get_format("hif4")              # or "mxfp4", "nvfp4", "mxfp4_rceil", or a registered name
    qt = fmt.quantize(x, dim=-1)          # packed codes + scales (QuantizedTensor)
    y = qt.dequantize()                   # == fmt.fake_quantize(x)

Users add formats with ``register_format(name, format_or_factory)``; recipes accept any registered name.
"""

from __future__ import annotations

from typing import Callable, Union

import torch

from megatron_fp4.formats.base import Format, InvalidTensorError, QuantizedTensor, check_tensor
from megatron_fp4.formats.hif4 import HiF4Format
from megatron_fp4.formats.mxfp4 import MXFP4Format
from megatron_fp4.formats.nvfp4 import NVFP4Format

__all__ = ["Format", "QuantizedTensor", "InvalidTensorError", "check_tensor", "HiF4Format", "MXFP4Format", "NVFP4Format", "get_format",
           "register_format", "registered_formats", "underflow_rate"]

_REGISTRY: dict[str, Format] = {}


def register_format(name: str, fmt: Union[Format, Callable[[], Format]], override: bool = False) -> Format:
    """Register a Format instance (or a zero-argument factory returning one) under ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"format name must be a non-empty string, got {name!r}")
    if name in _REGISTRY and not override:
        raise ValueError(f"format {name!r} is already registered; pass override=True to replace it")
    instance = fmt() if (callable(fmt) and not isinstance(fmt, Format)) else fmt
    if not isinstance(instance, Format):
        raise TypeError(f"register_format({name!r}, ...) needs a Format or a factory returning one, "
                        f"got {type(instance).__name__}")
    if instance.block_size <= 0 or instance.block_size % 2:
        raise ValueError(f"format {name!r}: block_size must be a positive even number, got {instance.block_size}")
    _REGISTRY[name] = instance
    return instance


def registered_formats() -> tuple[str, ...]:
    """Names accepted by ``get_format`` and by recipes."""
    return tuple(_REGISTRY)


def get_format(name: Union[str, Format]) -> Format:
    """The Format registered under ``name`` (a Format passes through unchanged)."""
    if isinstance(name, Format):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown format {name!r}; valid names: {', '.join(sorted(_REGISTRY))}") from None


def underflow_rate(x: torch.Tensor, fmt: Union[str, Format], dim: int = -1) -> float:
    """Fraction of the nonzero entries of ``x`` that quantize to zero (0.0 when x has no nonzero entry)."""
    fq = get_format(fmt).fake_quantize(x, dim=dim)
    nonzero = x != 0
    count = int(nonzero.sum())
    if count == 0:
        return 0.0
    return int((nonzero & (fq == 0)).sum()) / count


register_format("hif4", HiF4Format())
register_format("mxfp4", MXFP4Format("floor"))
register_format("mxfp4_rceil", MXFP4Format("rceil"))
register_format("nvfp4", NVFP4Format())
