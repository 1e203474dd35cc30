"""Exports of what GRPO trains: a ``pretrain_rl.py --save`` run directory (any TP/PP/DP, the latest or a given
iteration), a megatron-fp4 checkpoint, or the live policy of a running job, written as a Hugging Face folder (or,
through :func:`open_checkpoint`, as an FP4 rollout checkpoint).

    from megatron_fp4.rl.export import export_hf, open_checkpoint
    export_hf("runs/grpo", "hf/grpo")                         # the latest RL checkpoint of a run
    export_hf("runs/grpo", "hf/grpo-it100", iteration=100)
    export_hf(trainer.policy, "hf/grpo")                      # on every rank of a running job (collective)
    export_fp4_checkpoint(open_checkpoint("runs/grpo"), "fp4/grpo", format="hif4", resq="2:4")

An RL checkpoint records what the export needs in its rank files' layout record
(:mod:`megatron_fp4.rl.checkpoint_weights`): the model's arguments, and for a model converted from HF its
config.json, architecture, vocabulary and tokenizer files. ``models/`` cannot read RL checkpoints (it never imports
``rl/``): this module is the one place that tells the two checkpoint kinds apart.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch

from megatron_fp4.models.checkpoint_io import (MegatronCheckpoint, ShardedWeights, dtype_from_name,
                                              is_megatron_checkpoint)
from megatron_fp4.models.hf_conversion import HF_EXPORT_FIELDS, convert_megatron_to_hf, copy_hf_assets
from megatron_fp4.models.hf_export import export_model_hf
from megatron_fp4.rl.checkpoint import CheckpointError, TRACKER_FILE, iter_dir_name, list_checkpoints, load_checkpoint
from megatron_fp4.rl.checkpoint_weights import TrainerCheckpointWeights

__all__ = ["RunWeights", "open_checkpoint", "export_hf"]

PathLike = Union[str, os.PathLike]
_ITER_RE = re.compile(r"iter_(\d{7})")


def _split_iteration_dir(path: Path, iteration: Optional[Union[int, str]]) -> tuple[Path, Optional[Union[int, str]]]:
    """(run directory, iteration) for a path that may name one RL iteration directory (``RUN/iter_0000100``)."""
    m = _ITER_RE.fullmatch(path.name)
    if m and iteration is None and (path / "metadata.json").is_file():
        return path.parent, int(m.group(1))
    return path, iteration


class RunWeights(ShardedWeights):
    """The policy of one RL checkpoint as the export reads it: the stored weights, or where ``main`` (the
    optimizer's fp32 master copies, ``optimizer_named.main``, kept under mixed precision only) has a tensor that
    one, all cast to one ``dtype`` (a run may keep some parameters, e.g. norms on the CPU, in fp32)."""

    def __init__(self, model: TrainerCheckpointWeights, main: Optional[TrainerCheckpointWeights],
                 dtype: torch.dtype) -> None:
        self._model, self._main, self.dtype = model, main, dtype
        self.dir, self.args, self.model_args = model.dir, model.args, model.model_args
        self.tp, self.pp = model.tp, model.pp

    def shard_keys(self, tp_rank: int, pp_rank: int) -> list[str]:
        return self._model.shard_keys(tp_rank, pp_rank)

    def shard_tensor(self, tp_rank: int, pp_rank: int, local_name: str) -> torch.Tensor:
        src = self._model
        if self._main is not None and local_name in self._main.shard_keys(tp_rank, pp_rank):
            src = self._main
        t = src.shard_tensor(tp_rank, pp_rank, local_name)
        return t.to(self.dtype) if t.is_floating_point() else t

    def write_hf_assets(self, dst: PathLike) -> list[str]:
        return self._model.write_hf_assets(dst)


def _open_run(run: Path, iteration: Optional[Union[int, str]], dtype: Optional[torch.dtype]) -> RunWeights:
    if iteration is not None and (isinstance(iteration, bool) or not str(iteration).isdigit()):
        raise ValueError(f"--iteration {iteration!r} is not valid for the pretrain_rl.py run {run}; allowed values: "
                         f"its checkpoint iterations {list_checkpoints(run)}")
    it = None if iteration is None else int(iteration)
    if it is not None and it not in list_checkpoints(run):
        raise ValueError(f"--iteration {it}: {run} has no complete checkpoint {iter_dir_name(it)}; allowed values: "
                         f"{list_checkpoints(run)}")
    try:
        weights = TrainerCheckpointWeights(run, it)
    except CheckpointError as e:
        raise ValueError(f"cannot export {run}: {e}") from None
    missing = [f for f in HF_EXPORT_FIELDS if f not in weights.model_args]
    if missing:
        raise ValueError(
            f"{weights.dir} was written before RL checkpoints recorded the model for export: it records only "
            f"{', '.join(sorted(weights.model_args))}, not {', '.join(missing)} (nor the HF config, architecture "
            f"and tokenizer files). Resume the run with this version to write a new checkpoint, or build the model "
            f"from the checkpoint it started from, load_checkpoint_into_model(model, TrainerCheckpointWeights("
            f"'{run}')) and export_hf(model, ...)")
    if not weights.records_hf_model:
        warnings.warn(f"{weights.dir} records no Hugging Face model (the run did not start from a converted HF "
                      f"checkpoint): config.json is synthesized from the model's arguments and no tokenizer files "
                      f"are written")
    trained = dtype_from_name(weights.model_args.get("params_dtype", "float32"))
    dtype = dtype or trained
    main = None
    if dtype.itemsize > trained.itemsize:  # wider than the stored weights: the master copies, where kept
        it = int(weights.dir.name[len("iter_"):])
        _, state0 = load_checkpoint(run, it, rank=0, mmap=True)
        if "main" in (state0.get("optimizer_named") or {}):
            main = TrainerCheckpointWeights(run, it, ("optimizer_named", "main"))
    return RunWeights(weights, main, dtype)


def open_checkpoint(path: PathLike, iteration: Optional[Union[int, str]] = None, dtype: Optional[torch.dtype] = None
                    ) -> ShardedWeights:
    """The weights of ``path`` for export: a ``pretrain_rl.py --save`` directory (or one ``iter_*`` directory of
    it; a :class:`RunWeights`) or a megatron-fp4 checkpoint; ``iteration``: the latest when None. ``dtype`` (RL
    runs): the dtype read (default: the run's parameter dtype); a wider one than the run's parameters (float32 from
    a --bf16 run) reads the optimizer's fp32 master weights."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--load {path} does not exist")
    run, iteration = _split_iteration_dir(path, iteration)
    if list_checkpoints(run):
        return _open_run(run, iteration, dtype)
    if is_megatron_checkpoint(path) or (path / "args.json").is_file():
        return MegatronCheckpoint(path, iteration)
    raise FileNotFoundError(f"--load {path} is neither a pretrain_rl.py --save directory (no complete iter_* "
                            f"checkpoint with metadata.json) nor a megatron-fp4 checkpoint ({TRACKER_FILE} + "
                            f"<iteration>/args.json)")


def export_hf(source: Any, save_dir: PathLike, *, iteration: Optional[Union[int, str]] = None,
              dtype: Optional[torch.dtype] = None, vocab_size: Optional[int] = None,
              hf_assets: Optional[PathLike] = None, max_shard_bytes: int = 5 * 2**30, overwrite: bool = False,
              progress: bool = False) -> Path:
    """Write a Hugging Face folder (config.json, tokenizer files, safetensors) of ``source``; returns ``save_dir``.

    ``source``: a run directory or checkpoint path (see :func:`open_checkpoint`; ``iteration`` picks one), an
    opened :class:`ShardedWeights`, or a live GPTModel (DDP-wrapped or not), in which case every rank must call
    this (collective; see ``megatron_fp4.models.hf_export.export_model_hf``; ``vocab_size`` applies there
    only). ``dtype``: cast the weights (default: the run's parameter dtype); ``torch.float32`` from a path exports
    the fp32 master weights of a bf16 run. ``hf_assets``: a folder of tokenizer files to write too (default: the
    ones recorded with the weights).
    """
    if isinstance(source, torch.nn.Module):
        return export_model_hf(source, save_dir, dtype=dtype, vocab_size=vocab_size, hf_assets=hf_assets,
                               max_shard_bytes=max_shard_bytes, overwrite=overwrite, progress=progress)
    weights = source if isinstance(source, ShardedWeights) else open_checkpoint(source, iteration, dtype)
    out = convert_megatron_to_hf(weights, save_dir, max_shard_bytes=max_shard_bytes, progress=progress,
                                 overwrite=overwrite, dtype=dtype)
    if hf_assets is not None:
        if not Path(hf_assets).is_dir():
            raise FileNotFoundError(f"hf_assets folder {hf_assets} does not exist")
        copy_hf_assets(hf_assets, out)
    return out
