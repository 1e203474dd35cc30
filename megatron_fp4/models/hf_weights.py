"""A Hugging Face model folder as starting weights of a distributed megatron model (``--hf-checkpoint``).

:class:`HFCheckpointWeights` presents the folder (Qwen2 / Llama safetensors, or an FP4 export, dequantized on access)
as a :class:`~megatron_fp4.models.checkpoint_io.ShardedWeights` with one shard (the TP=PP=1 view): every megatron
tensor is built on demand by :func:`~megatron_fp4.models.hf_conversion.megatron_tensor_from_hf`, exactly what
``tools/convert_hf_to_megatron.py`` writes, and :func:`~megatron_fp4.models.checkpoint_io.load_checkpoint_into_model`
splits it for this rank's TP/PP slice. Nothing is converted on disk.

    weights = HFCheckpointWeights("/models/Qwen2.5-3B")
    model = build_gpt_model(hf_gpt_model_args(weights, fp4_recipe=...), ...)
    load_checkpoint_into_model(model, weights)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

import torch

from megatron_fp4.models.checkpoint_io import ShardedWeights, stage_param_names
from megatron_fp4.models.hf_conversion import megatron_tensor_from_hf, model_args_from_hf_config
from megatron_fp4.models.loading import open_source

__all__ = ["HFCheckpointWeights", "hf_gpt_model_args"]

PathLike = Union[str, os.PathLike]


class HFCheckpointWeights(ShardedWeights):
    """The megatron tensors of an HF folder under the checkpoint reader's interface (TP = PP = 1, one shard)."""

    def __init__(self, path: PathLike) -> None:
        self.dir = Path(path)
        self.source = open_source(self.dir)  # checks config.json and the weight files (an FP4 export too)
        real_vocab = model_args_from_hf_config(self.source.config)["vocab_size"]
        self.model_args: dict = self.source.model_args(tp=1)  # shapes checked; params_dtype = the embedding's
        self.args: dict = {"hf_vocab_size": real_vocab}
        self.tp, self.pp = 1, 1
        self._names = stage_param_names(self.model_args, 0, 1)

    def shard_keys(self, tp_rank: int, pp_rank: int) -> list[str]:
        self._check_shard(tp_rank, pp_rank)
        return list(self._names)

    def shard_tensor(self, tp_rank: int, pp_rank: int, local_name: str) -> torch.Tensor:
        self._check_shard(tp_rank, pp_rank)
        if local_name not in self._names:
            raise KeyError(f"{local_name} is not a tensor of the model in {self.dir}")
        return megatron_tensor_from_hf(local_name, self.source, self.model_args)

    def _check_shard(self, tp_rank: int, pp_rank: int) -> None:
        if (tp_rank, pp_rank) != (0, 0):
            raise KeyError(f"{self.dir} is read as one shard (TP=PP=1); asked for TP rank {tp_rank}, PP rank "
                           f"{pp_rank}")


def hf_gpt_model_args(weights: Union[HFCheckpointWeights, PathLike], **changes: Any):
    """The ``GPTModelArgs`` of an HF folder's config.json (``changes`` override fields, e.g. ``fp4_recipe``,
    ``params_dtype``, ``max_seq_len``); build the model at any TP/PP, then ``load_checkpoint_into_model``."""
    from megatron_fp4.models.gpt import GPTModelArgs

    w = weights if isinstance(weights, HFCheckpointWeights) else HFCheckpointWeights(weights)
    return GPTModelArgs(**{**w.model_args, **changes})
