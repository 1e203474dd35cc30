"""Reading a model from whatever a user brings: the top of ``megatron_fp4.models``, where the formats meet.

    source = open_source(path)                  # an HF folder, an FP4 export, or (gguf_file=...) a GGUF file
    model = load_gpt(path)                      # a megatron-fp4 checkpoint or any of the above, as a GPTModel
    convert_hf_to_megatron(hf_path, save_dir, tensor_model_parallel_size=2)   # any source -> sharded checkpoint

The modules below it know one format each (``checkpoint_io``: megatron-fp4 checkpoints; ``hf_conversion``: HF
folders and the name/layout mapping; ``fp4_checkpoint``: FP4 exports; ``gguf``: GGUF files) and never import this
one, nor each other upwards.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_fp4.models.checkpoint_io import (HF_ASSETS_DIRNAME, MegatronCheckpoint, PathLike,
                                               _commit_iteration, _expected_state, _parallel_ranks,
                                               _tmp_iteration_dir, hf_info_of, is_megatron_checkpoint,
                                               iteration_dirname, load_checkpoint_into_model, model_args_from_json)
from megatron_fp4.models.fp4_checkpoint import FP4FolderSource
from megatron_fp4.models.gguf import GGUFSource
from megatron_fp4.models.hf_conversion import (SUPPORTED_ARCHITECTURES, TensorSource, _write_converted,
                                               check_parallel_sizes, is_fp4_export, megatron_tensor_from_hf,
                                               model_args_from_hf_config, open_hf_source, prepare_output_dir)
from megatron_fp4.models.safetensors_io import writer_record

__all__ = ["open_source", "load_gpt", "convert_hf_to_megatron"]


def open_source(path: PathLike, gguf_file: Optional[str] = None) -> TensorSource:
    """The tensor source of ``path``: with ``gguf_file`` that GGUF file inside it (transformers' GGUF loader), an
    FP4 export of ``tools/export_fp4_checkpoint.py`` (weights dequantized on access), or an HF folder."""
    if gguf_file is not None:
        return GGUFSource(path, gguf_file)
    if is_fp4_export(path):
        return FP4FolderSource(path)
    return open_hf_source(path)


def load_gpt(path: PathLike, iteration: Optional[Union[int, str]] = None, fp4_recipe: Any = None,
             params_dtype: Optional[torch.dtype] = None, eval_mode: bool = True, gguf_file: Optional[str] = None,
             **model_arg_changes: Any):
    """A megatron-core GPTModel (TP=PP=1, this process) with the weights of ``path``.

    ``path`` is a megatron-fp4 checkpoint (any TP/PP; merged on load), a Hugging Face Qwen2/Llama folder, an
    FP4 export of ``tools/export_fp4_checkpoint.py`` (weights dequantized), or with ``gguf_file`` the folder holding
    that GGUF file (read by transformers' GGUF loader). Initializes a single-process parallel_state if none exists.
    ``fp4_recipe`` sets the model's FP4 recipe (None: high precision).
    """
    from megatron_fp4.models.gpt import GPTModelArgs, build_gpt_model
    from megatron_fp4.parallel import initialize_parallel

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    tp_size, _, pp_size, _ = _parallel_ranks()
    if tp_size != 1 or pp_size != 1:
        raise RuntimeError(f"load_gpt builds a single-process model but parallel_state has TP={tp_size}, "
                           f"PP={pp_size}; build the model with build_gpt_model and use load_checkpoint_into_model")
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        initialize_parallel(1, 1)  # (re-initializing would also re-seed the RNGs)
    if is_megatron_checkpoint(path) and gguf_file is None:
        ckpt = MegatronCheckpoint(path, iteration)
        margs = model_args_from_json(ckpt.model_args)
        margs["hf_info"] = hf_info_of(ckpt)
        source = None
    else:
        source = open_source(path, gguf_file)
        margs = source.model_args(tp=1)
        config = {k: v for k, v in source.config.items() if k != "quantization_config"}
        arch = (config.get("architectures") or [None])[0] or {
            v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[config["model_type"]]
        margs["hf_info"] = {"config": config, "architecture": arch, "vocab_size": int(config["vocab_size"]),
                            "assets_dir": None if gguf_file else str(path)}
        ckpt = None
    margs.update(model_arg_changes)
    if params_dtype is not None:
        margs["params_dtype"] = params_dtype
    model = build_gpt_model(GPTModelArgs(**margs, fp4_recipe=fp4_recipe), parallel_output=False)
    if ckpt is not None:
        load_checkpoint_into_model(model, ckpt)
    else:
        expected = _expected_state(model)
        state = {k: megatron_tensor_from_hf(k, source, margs) for k in expected}
        for k, v in state.items():
            if tuple(v.shape) != tuple(expected[k].shape):
                raise ValueError(f"shape mismatch for {k}: converted {tuple(v.shape)} vs model "
                                 f"{tuple(expected[k].shape)}")
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise KeyError(f"load_state_dict: missing {missing[:8]}, unexpected {unexpected[:8]}")
    if eval_mode:
        model.eval()
    return model


def convert_hf_to_megatron(hf_path: PathLike, save_dir: PathLike, tensor_model_parallel_size: int = 1,
                           pipeline_model_parallel_size: int = 1, make_vocab_size_divisible_by: int = 1,
                           iteration: Union[int, str] = "release", progress: bool = True,
                           overwrite: bool = False, gguf_file: Optional[str] = None) -> Path:
    """Convert an HF Qwen2/Llama folder to a TP x PP sharded megatron-fp4 checkpoint; returns the iteration dir.

    ``gguf_file``: read the model from this GGUF file inside ``hf_path`` instead (through transformers' GGUF
    loader, dequantized to fp32; its tokenizer and chat template go to hf_assets/). Shards are written one at a
    time (each holds one TP rank of one PP stage) with their checksums into a temporary directory that is renamed
    into place once complete; the tracker last. The output folder is checked before anything is read.
    """
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    iteration_dirname(iteration)  # validates
    iteration = iteration if iteration == "release" else int(iteration)
    for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--make-vocab-size-divisible-by", make_vocab_size_divisible_by)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} {v!r} is not valid; expected an integer >= 1")
    save_dir = Path(save_dir)
    src_path = Path(hf_path) / gguf_file if gguf_file is not None else Path(hf_path)
    prepare_output_dir(save_dir, overwrite, megatron_iteration=iteration, sources=[src_path])
    source = open_source(hf_path, gguf_file)
    margs = model_args_from_hf_config(source.config, source.config_where)
    check_parallel_sizes(margs, tp, pp)
    hf_vocab = margs["vocab_size"]
    margs = source.model_args(tp, make_vocab_size_divisible_by)
    checkpoint_id = uuid.uuid4().hex
    writer = writer_record("tools/convert_hf_to_megatron.py (megatron_fp4.models.loading.convert_hf_to_megatron)",
                           source=str(src_path.resolve()))
    tmp = _tmp_iteration_dir(save_dir, iteration)
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted conversion
    created = not save_dir.exists()
    try:
        _write_converted(source, save_dir, tmp, margs, tp, pp, iteration, hf_vocab, checkpoint_id, writer, progress)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind (a kill leaves it to the next run)
        if created and save_dir.is_dir() and not any(save_dir.iterdir()):
            save_dir.rmdir()
        raise
    assets = tmp / HF_ASSETS_DIRNAME
    if assets.is_dir():
        final, aside = save_dir / HF_ASSETS_DIRNAME, save_dir / f".del_{HF_ASSETS_DIRNAME}"
        if aside.exists():
            shutil.rmtree(aside)
        if final.exists():
            os.replace(final, aside)
        os.replace(assets, final)
        shutil.rmtree(aside, ignore_errors=True)
    return _commit_iteration(save_dir, iteration, tmp)
