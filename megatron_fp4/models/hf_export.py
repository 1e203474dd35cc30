"""Hugging Face export of a live megatron-core GPT model: the weights a running job holds (any TP/PP), written as a
folder transformers loads.

    export_model_hf(policy, "hf/run1")          # on EVERY rank of the job (collective), e.g. at the end of training

DP rank 0 of every (TP, PP) rank writes its shard into a temporary megatron-fp4 checkpoint beside ``save_dir``
(``save_model_checkpoint``; a filesystem all ranks share, as for any checkpoint), global rank 0 converts it with
``convert_megatron_to_hf`` and removes it. The architecture comes from the model itself
(``GPTModelArgs.from_model``); config.json, the unpadded vocabulary and the tokenizer files from ``model.hf_info``
(set when the model was built from a converted HF checkpoint), else config.json is synthesized and no tokenizer is
written unless ``hf_assets`` names a folder holding one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_fp4.models.checkpoint_io import model_args_to_json, save_model_checkpoint
from megatron_fp4.models.gpt import GPTModelArgs
from megatron_fp4.models.hf_conversion import (convert_megatron_to_hf, copy_hf_assets, hf_config_from_checkpoint,
                                               prepare_output_dir)

__all__ = ["export_model_hf", "hf_config_of_model"]

PathLike = Union[str, os.PathLike]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _on_rank0(fn) -> Any:
    """Run ``fn`` on global rank 0 only; an exception there is raised on every rank (no rank is left waiting)."""
    result, error = None, None
    if not _distributed() or torch.distributed.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # re-raised below, on every rank
            error = e
    if _distributed():
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        torch.distributed.broadcast_object_list(box, src=0)
        if box[0] is not None and error is None:
            raise RuntimeError(f"HF export failed on rank 0: {box[0]}")
    if error is not None:
        raise error
    return result


def hf_config_of_model(model: Any) -> dict:
    """The config.json :func:`export_model_hf` writes for ``model`` with its default vocabulary, without writing
    anything: local, not collective."""
    margs = GPTModelArgs.from_model(model)
    info = margs.hf_info or {}

    class _View:  # the slice of a checkpoint that hf_config_from_checkpoint reads
        model_args = model_args_to_json(margs)
        args = {"hf_config": info.get("config"), "hf_vocab_size": info.get("vocab_size"),
                "hf_architecture": info.get("architecture")}

    return hf_config_from_checkpoint(_View())


def export_model_hf(model: Any, save_dir: PathLike, *, dtype: Optional[torch.dtype] = None,
                    vocab_size: Optional[int] = None, hf_assets: Optional[PathLike] = None,
                    max_shard_bytes: int = 5 * 2**30, overwrite: bool = False, progress: bool = False) -> Path:
    """Write the HF folder of a live GPTModel (DDP / Float16 wrappers unwrapped); collective over all ranks.

    ``dtype``: cast the weights (default: the model's parameter dtype, for every tensor, also where a model built
    elsewhere keeps its norms in fp32 beside bf16 weights). ``vocab_size``: rows of the exported
    vocabulary (default: the HF model's the weights came from, else the model's, padding included).
    ``hf_assets``: a folder of tokenizer files to copy instead of ``model.hf_info['assets_dir']``. An existing
    model in ``save_dir`` is replaced only with ``overwrite``. Returns ``save_dir``.
    """
    save_dir = Path(save_dir)
    margs = GPTModelArgs.from_model(model)
    info = margs.hf_info or {}
    _on_rank0(lambda: prepare_output_dir(save_dir, overwrite))  # fail before anyone writes
    tmp = save_dir.parent / f".{save_dir.name}.megatron-tmp"
    _on_rank0(lambda: shutil.rmtree(tmp) if tmp.exists() else None)
    save_model_checkpoint(model, tmp, "release", margs, hf_config=info.get("config"),
                          hf_vocab_size=vocab_size or info.get("vocab_size"),
                          hf_architecture=info.get("architecture"))
    assets = hf_assets or info.get("assets_dir")

    def convert() -> None:
        try:
            convert_megatron_to_hf(tmp, save_dir, max_shard_bytes=max_shard_bytes, progress=progress,
                                   overwrite=True, dtype=dtype or margs.params_dtype)
            if assets is not None:
                if not Path(assets).is_dir():
                    raise FileNotFoundError(f"hf_assets folder {assets} does not exist")
                copy_hf_assets(assets, save_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    _on_rank0(convert)
    return save_dir
