"""Safetensors files with checksums: written atomically, verified when read, every failure named.

Every file the converters and exporters write carries, in its safetensors ``__metadata__`` (the header, so written
atomically with the data)::

    "format": "pt"
    "megatron_fp4.writer":    JSON {"writer": what wrote it, "version": package version, ...}
    "megatron_fp4.checksums": JSON {"algorithm": "xxh3_128",
                                    "tensors": {name: xxh3-128 of name, dtype, shape and the tensor's bytes},
                                    "metadata": xxh3-128 of the other metadata entries}

:class:`SafetensorsFile` verifies a tensor's checksum each time it is read and the metadata's when the file is
opened (a file without checksums, written before they existed or by another program, is read unverified). Every
problem (unreadable or truncated file, damaged header or checksum table, a tensor that does not match) is a
:class:`SafetensorsFileError` naming the file and, where one is at fault, the tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

__all__ = ["CHECKSUM_ALGORITHM", "CHECKSUMS_KEY", "WRITER_KEY", "SafetensorsFileError", "tensor_digest",
           "checksum_metadata", "save_safetensors", "SafetensorsFile", "fsync_dir",
           "write_text_atomic"]

CHECKSUM_ALGORITHM = "xxh3_128"
CHECKSUMS_KEY = "megatron_fp4.checksums"
WRITER_KEY = "megatron_fp4.writer"
PathLike = Union[str, os.PathLike]

#: safetensors dtype names -> torch dtypes (what the header may say).
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsFileError(ValueError):
    """A safetensors file that cannot be read safely: unreadable, truncated, damaged, or not matching its
    checksums. The message names the file (and the tensor)."""


def _hasher():
    import xxhash

    return xxhash.xxh3_128()


def tensor_digest(name: str, t: torch.Tensor) -> str:
    """xxh3-128 hex digest of a tensor's name, dtype, shape and bytes (as stored: contiguous, CPU)."""
    h = _hasher()
    h.update(f"{name}\0{str(t.dtype).replace('torch.', '')}\0{tuple(t.shape)}\0".encode())
    b = t.detach().to("cpu").contiguous().reshape(-1)
    if b.numel():
        h.update(memoryview(b.view(torch.uint8).numpy()))
    return h.hexdigest()


def _metadata_digest(metadata: dict[str, str]) -> str:
    h = _hasher()
    h.update(json.dumps({k: v for k, v in metadata.items() if k != CHECKSUMS_KEY}, sort_keys=True).encode())
    return h.hexdigest()


def writer_record(writer: str, **extra: Any) -> dict:
    """``{"writer": writer, "version": <megatron_fp4 version>, **extra}``: what a file or checkpoint records as
    having written it."""
    from megatron_fp4 import __version__

    return {"writer": writer, "version": __version__, **extra}


def checksum_metadata(tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]] = None,
                      writer: Optional[dict] = None) -> dict[str, str]:
    """The ``__metadata__`` of a file holding ``tensors``: ``metadata`` (``format: pt`` by default), the writer
    record and the checksum table."""
    meta = {"format": "pt", **(metadata or {})}
    if writer is not None:
        meta[WRITER_KEY] = json.dumps(writer, sort_keys=True)
    table = {"algorithm": CHECKSUM_ALGORITHM, "tensors": {k: tensor_digest(k, t) for k, t in tensors.items()},
             "metadata": _metadata_digest(meta)}
    meta[CHECKSUMS_KEY] = json.dumps(table, sort_keys=True)
    return meta


def fsync_dir(path: PathLike) -> None:
    """fsync a directory so that a rename inside it is durable (ignored where the platform refuses)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: PathLike, text: str) -> None:
    """Replace ``path`` by ``text`` atomically (temp file in the same directory, fsync, rename, fsync the
    directory)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save_safetensors(tensors: dict[str, torch.Tensor], path: PathLike, metadata: Optional[dict[str, str]] = None,
                     writer: Optional[dict] = None, checksums: bool = True) -> Path:
    """Write ``tensors`` (contiguous CPU tensors) to ``path`` with checksums: into ``path.tmp`` first, fsynced,
    then renamed over ``path``, so a crash never leaves a partial file under the final name."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    meta = (checksum_metadata(tensors, metadata, writer) if checksums
            else {"format": "pt", **(metadata or {}), **({WRITER_KEY: json.dumps(writer)} if writer else {})})
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    with open(tmp, "rb+") as f:
        _sort_metadata_keys(f)
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def _sort_metadata_keys(f) -> None:
    """Rewrite the header's ``__metadata__`` object with its keys sorted, in place (same length): safetensors keeps
    metadata in a hash map whose order changes from process to process, and the same tensors and metadata should
    give the same bytes. Left as written if the re-serialized header would not have the same length."""
    f.seek(0)
    n = int.from_bytes(f.read(8), "little")
    raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return
    if not isinstance(header.get("__metadata__"), dict):
        return
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(text) != len(raw.rstrip(b" ")):
        return
    f.seek(8)
    f.write(text + b" " * (n - len(text)))
    f.flush()


class SafetensorsFile:
    """A safetensors file opened for reading (memory-mapped); tensors are verified against the file's checksums as
    they are read. ``verify=False`` skips the verification (the benchmark's baseline)."""

    def __init__(self, path: PathLike, verify: bool = True) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path} does not exist")
        try:
            self._h = safe_open(str(self.path), framework="pt", device="cpu")
            self._keys = list(self._h.keys())
            meta = self._h.metadata() or {}
        except Exception as e:  # safetensors' own error type for a truncated or damaged header, OSError, ...
            raise SafetensorsFileError(f"{self.path}: not a readable safetensors file "
                                       f"({_first_line(e)}); the file is damaged or truncated") from None
        self.metadata: dict[str, str] = dict(meta)
        self.verify = verify
        self.checksums: Optional[dict[str, str]] = None
        if CHECKSUMS_KEY in self.metadata:
            self.checksums = self._checksum_table()
        self._verified: set[str] = set()

    def _checksum_table(self) -> dict[str, str]:
        try:
            table = json.loads(self.metadata[CHECKSUMS_KEY])
            algorithm, tensors, meta_digest = table["algorithm"], table["tensors"], table["metadata"]
            ok = isinstance(tensors, dict) and all(isinstance(v, str) for v in tensors.values())
        except (ValueError, KeyError, TypeError):
            ok, algorithm = False, None
        if not ok:
            raise SafetensorsFileError(f"{self.path}: its checksum table ({CHECKSUMS_KEY} in the header) is "
                                       f"damaged")
        if algorithm != CHECKSUM_ALGORITHM:
            raise SafetensorsFileError(f"{self.path}: checksum algorithm {algorithm!r} is not supported (this "
                                       f"reader verifies {CHECKSUM_ALGORITHM})")
        if self.verify and meta_digest != _metadata_digest(self.metadata):
            raise SafetensorsFileError(f"{self.path}: its header metadata does not match its checksum: the file "
                                       f"is damaged")
        if self.verify and set(tensors) != set(self._keys):
            extra = sorted(set(self._keys) - set(tensors))
            lost = sorted(set(tensors) - set(self._keys))
            what = f"tensor {extra[0]} has no checksum" if extra else f"tensor {lost[0]} is missing"
            raise SafetensorsFileError(f"{self.path}: {what} (the header does not match the checksum table): the "
                                       f"file is damaged")
        return tensors

    @property
    def writer(self) -> Optional[dict]:
        """The writer record of the file (None when it has none or it does not parse)."""
        try:
            doc = json.loads(self.metadata[WRITER_KEY])
        except (KeyError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def keys(self) -> list[str]:
        """Tensor names, in the file's order."""
        return list(self._keys)

    def __contains__(self, name: str) -> bool:
        return name in self._keys

    def _slice(self, name: str):
        if name not in self._keys:
            raise KeyError(f"tensor {name} is missing from {self.path}")
        try:
            return self._h.get_slice(name)
        except Exception as e:
            raise SafetensorsFileError(f"{self.path}: tensor {name} cannot be read ({_first_line(e)})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor as the header records it."""
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """dtype of a tensor as the header records it."""
        st = self._slice(name).get_dtype()
        if st not in _ST_DTYPES:
            raise SafetensorsFileError(f"{self.path}: tensor {name} has dtype {st}, which this reader does not "
                                       f"support")
        return _ST_DTYPES[st]

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``, verified against its checksum when the file has checksums."""
        if name not in self._keys:
            raise KeyError(f"tensor {name} is missing from {self.path}")
        try:
            t = self._h.get_tensor(name)
        except Exception as e:
            raise SafetensorsFileError(f"{self.path}: tensor {name} cannot be read ({_first_line(e)}); the file is "
                                       f"damaged or truncated") from None
        if self.verify and self.checksums is not None and tensor_digest(name, t) != self.checksums.get(name):
            raise SafetensorsFileError(f"{self.path}: tensor {name} does not match its checksum: the file is "
                                       f"damaged")
        return t

    def load_all(self) -> dict[str, torch.Tensor]:
        """Every tensor of the file, verified."""
        return {k: self.get(k) for k in self._keys}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
