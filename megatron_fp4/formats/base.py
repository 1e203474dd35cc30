"""The Format interface and the QuantizedTensor container shared by every FP4 format.

A format quantizes along one dimension in blocks of ``block_size`` values. The base class moves that dimension
last, zero-pads it to a multiple of the block, and hands fp32 blocks ``[rows, nblocks, block]`` to the format's
``_encode``/``_decode``; it packs element codes two per byte (SPEC §2.4) and restores the input's shape, so a
format only implements the per-block arithmetic.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_fp4.formats.packing import pack_nibbles, unpack_nibbles

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROUNDINGS = ("nearest", "stochastic")


class InvalidTensorError(ValueError, TypeError):
    """A tensor argument a function cannot take: not a tensor, a dtype it does not accept, empty (a zero-size
    dimension), or the wrong number of dimensions. A ValueError, and a TypeError for callers that catch that (the
    way numpy's AxisError is both a ValueError and an IndexError). The message names the function and the
    argument."""


def check_tensor(x, name: str, fn: str, *, dtypes: Optional[tuple] = FLOAT_DTYPES, min_dim: int = 1,
                 ndim: Optional[int] = None, nonempty: bool = True) -> None:
    """Raise :class:`InvalidTensorError` (naming ``fn`` and ``name``) unless ``x`` is a tensor of one of
    ``dtypes`` (None: any), with ``ndim`` dimensions (or at least ``min_dim``), and no zero-size dimension when
    ``nonempty``."""
    if not isinstance(x, torch.Tensor):
        raise InvalidTensorError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        allowed = "/".join(str(d).replace("torch.", "") for d in dtypes)
        raise InvalidTensorError(f"{fn}: {name} must be a {allowed} tensor, got {str(x.dtype).replace('torch.', '')}")
    if ndim is not None and x.dim() != ndim:
        raise InvalidTensorError(f"{fn}: {name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if x.dim() < min_dim:
        raise InvalidTensorError(f"{fn}: {name} must have at least {min_dim} dimension(s), got a "
                                 f"{x.dim()}-d tensor")
    if nonempty and x.numel() == 0:
        raise InvalidTensorError(f"{fn}: {name} is empty (shape {tuple(x.shape)}); quantization needs at least one "
                                 f"value along every dimension")


def check_dim(dim, ndim: int, fn: str) -> int:
    """``dim`` normalized to [0, ndim); InvalidTensorError naming ``fn`` when it is not an int in range."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise InvalidTensorError(f"{fn}: dim={dim!r} must be an int")
    if not -ndim <= dim < ndim:
        raise InvalidTensorError(f"{fn}: dim={dim} is out of range for a tensor with {ndim} dimensions")
    return dim % ndim


def choice_error(field: str, value, allowed) -> ValueError:
    """The project's error for a bad choice: names the field, the value and the allowed values."""
    return ValueError(f"{field}={value!r} is not valid; allowed values: {', '.join(map(repr, allowed))}")


@dataclass
class QuantizedTensor:
    """Packed FP4 data of a tensor quantized along ``dim``.

    ``codes``: uint8 ``[*outer, K_pad // 2]``, two 4-bit element codes per byte (element 2i in the low nibble),
    where ``outer`` is the input shape without ``dim`` and K_pad is ``shape[dim]`` rounded up to the block.
    ``scales``: uint8 block metadata ``[*outer, nblocks, scale_bytes]`` in the format's byte layout.
    ``global_scale``: fp32 scalar tensor for formats with a per-tensor scale (NVFP4), else None.
    """

    fmt: "Format"
    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dim: int
    dtype: torch.dtype
    global_scale: Optional[torch.Tensor] = None

    def dequantize(self) -> torch.Tensor:
        """The represented values, in the original shape and dtype."""
        return self.fmt.dequantize(self)

    def to_bytes(self) -> bytes:
        """Serialize codes, scales and the global scale (in that order) to raw bytes."""
        parts = [self.codes.contiguous().cpu(), self.scales.contiguous().cpu()]
        if self.global_scale is not None:
            parts.append(self.global_scale.reshape(1).to(torch.float32).cpu().view(torch.uint8))
        return b"".join(p.reshape(-1).numpy().tobytes() for p in parts)

    @property
    def nbytes(self) -> int:
        """Storage size in bytes (codes + scales + global scale)."""
        extra = 4 if self.global_scale is not None else 0
        return self.codes.numel() + self.scales.numel() + extra


class Format(ABC):
    """A block-scaled 4-bit number format. Subclasses set the class attributes and the two block kernels."""

    #: Registry name.
    name: str = ""
    #: Values per block (the scale granularity along the quantized dimension).
    block_size: int = 0
    #: Storage cost per value, metadata included.
    bits_per_value: float = 0.0
    #: Metadata bytes per block.
    scale_bytes: int = 0
    #: Whether the format carries an fp32 per-tensor scale.
    has_global_scale: bool = False

    # -- per-block arithmetic, implemented by each format -------------------------------------------------------
    @abstractmethod
    def _encode(self, xb: torch.Tensor, rounding: str, generator: Optional[torch.Generator]
                ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """fp32 blocks [R, B, block] -> (4-bit codes uint8 [R, B, block], scales uint8 [R, B, scale_bytes],
        global scale fp32 scalar or None)."""

    @abstractmethod
    def _decode(self, codes: torch.Tensor, scales: torch.Tensor, global_scale: Optional[torch.Tensor]
                ) -> torch.Tensor:
        """Inverse of ``_encode``: fp32 values [R, B, block]."""

    # -- public API -----------------------------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, dim: int = -1, rounding: str = "nearest",
                 generator: Optional[torch.Generator] = None) -> QuantizedTensor:
        """Quantize ``x`` in blocks along ``dim`` and pack it (SPEC §2)."""
        xb, dim, outer = self._to_blocks(x, dim, rounding, generator)
        codes, scales, global_scale = self._encode(xb, rounding, generator)
        packed = pack_nibbles(codes.reshape(codes.shape[0], -1))
        return QuantizedTensor(
            fmt=self, codes=packed.reshape(*outer, packed.shape[-1]),
            scales=self._squeeze_scales(scales.reshape(*outer, *scales.shape[1:])), shape=x.shape, dim=dim, dtype=x.dtype,
            global_scale=global_scale)

    def dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
        """Values represented by a QuantizedTensor of this format, in its original shape and dtype."""
        nblocks = qt.scales.shape[len(qt.shape) - 1]
        codes = unpack_nibbles(qt.codes).reshape(-1, nblocks, self.block_size)
        scales = qt.scales.reshape(codes.shape[0], nblocks, self.scale_bytes)
        values = self._decode(codes, scales, qt.global_scale)
        return self._from_blocks(values, qt.shape, qt.dim, qt.dtype)

    def fake_quantize(self, x: torch.Tensor, dim: int = -1, rounding: str = "nearest",
                      generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """dequantize(quantize(x)) without the packing round trip."""
        xb, dim, _ = self._to_blocks(x, dim, rounding, generator)
        return self._from_blocks(self._fake_quantize_blocks(xb, rounding, generator), x.shape, dim, x.dtype)

    def _fake_quantize_blocks(self, xb: torch.Tensor, rounding: str, generator: Optional[torch.Generator]
                              ) -> torch.Tensor:
        """fp32 values of encode-then-decode of blocks; formats may override it with a direct computation."""
        return self._decode(*self._encode(xb, rounding, generator))

    def from_bytes(self, data: bytes, shape, dim: int = -1, dtype: torch.dtype = torch.float32
                   ) -> QuantizedTensor:
        """Rebuild a QuantizedTensor from ``QuantizedTensor.to_bytes()`` output and the original shape."""
        fn = f"{self.name}.from_bytes"
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidTensorError(f"{fn}: data must be bytes (QuantizedTensor.to_bytes()), got "
                                     f"{type(data).__name__}")
        try:
            dims = tuple(shape)
        except TypeError:
            raise InvalidTensorError(f"{fn}: shape must be a sequence of ints, got {shape!r}") from None
        if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims):
            raise InvalidTensorError(f"{fn}: shape {shape!r} is not valid; expected one or more ints >= 1 (the "
                                     f"quantized tensor's shape)")
        if dtype not in FLOAT_DTYPES:
            raise InvalidTensorError(f"{fn}: dtype {dtype!r} is not valid; allowed values: "
                                     f"{', '.join(str(d) for d in FLOAT_DTYPES)}")
        shape = torch.Size(dims)
        dim = check_dim(dim, len(shape), fn)
        outer = [s for i, s in enumerate(shape) if i != dim]
        nblocks = math.ceil(shape[dim] / self.block_size)
        rows = math.prod(outer)
        n_codes = rows * nblocks * self.block_size // 2
        n_scales = rows * nblocks * self.scale_bytes
        expected = n_codes + n_scales + (4 if self.has_global_scale else 0)
        if len(data) != expected:
            raise InvalidTensorError(f"{fn}: expected {expected} bytes for shape {tuple(shape)}, got {len(data)}")
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        codes = buf[:n_codes].reshape(*outer, nblocks * self.block_size // 2)
        scales = buf[n_codes:n_codes + n_scales].reshape(*outer, nblocks, self.scale_bytes)
        scales = self._squeeze_scales(scales)
        gs = buf[n_codes + n_scales:].clone().view(torch.float32).reshape(()) if self.has_global_scale else None
        return QuantizedTensor(self, codes, scales, shape, dim, dtype, gs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, block_size={self.block_size})"

    # -- shape plumbing ----------------------------------------------------------------------------------------------
    def _squeeze_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """Scales as stored in a QuantizedTensor (one-byte formats drop the trailing byte axis)."""
        return scales.squeeze(-1) if self.scale_bytes == 1 else scales

    def _to_blocks(self, x: torch.Tensor, dim: int, rounding: str, generator: Optional[torch.Generator] = None):
        if isinstance(x, torch.Tensor) and x.dim() == 0:
            raise InvalidTensorError(f"{self.name}: cannot quantize a 0-d tensor along a dimension")
        check_tensor(x, "x", self.name)
        if rounding not in ROUNDINGS:
            raise choice_error("rounding", rounding, ROUNDINGS)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"{self.name}: generator must be a torch.Generator or None, got "
                             f"{type(generator).__name__}")
        dim = check_dim(dim, x.dim(), self.name)
        xm = x.movedim(dim, -1)
        outer = xm.shape[:-1]
        k = xm.shape[-1]
        xm = xm.reshape(-1, k).to(torch.float32)
        pad = (-k) % self.block_size
        if pad:
            xm = torch.nn.functional.pad(xm, (0, pad))
        return xm.reshape(xm.shape[0], -1, self.block_size), dim, outer

    @staticmethod
    def _from_blocks(values: torch.Tensor, shape: torch.Size, dim: int, dtype: torch.dtype) -> torch.Tensor:
        k = shape[dim]
        outer = [s for i, s in enumerate(shape) if i != dim]
        v = values.reshape(values.shape[0], -1)[:, :k].reshape(*outer, k)
        return v.movedim(-1, dim).to(dtype)

