"""One rollout engine per tensor-parallel group: the group's first rank runs it, every rank of the group sees its
samples and takes part in the weight sync; with pipeline parallelism only the first stage's groups run one.

    engine = TPGroupEngine(SGLangRolloutEngine(..., tp_size=T) if tp_rank == 0 else None, precision, hf_config,
                           group=tp_group)

An SGLang Engine with ``tp_size = T`` shards the model over the group's T GPUs itself (its own processes and NCCL
group), so it is started once per trainer TP group, by the group's first rank, on the group's GPUs. Every rank of the
group calls the same methods in the same order (they are collectives over ``group``):

- :meth:`generate`: the first rank generates, the others receive its samples (a broadcast);
- :meth:`update_weights`: the trainer's TP shards are gathered tensor by tensor in HF order
  (:func:`megatron_fp4.models.checkpoint_io.merge_tp`, then the megatron -> HF mapping) and pushed by the first
  rank in buckets, so at most one bucket of full tensors is held at a time;
- :meth:`release_memory` / :meth:`resume_memory`: on the first rank only.

With pipeline parallelism, :class:`FirstStageEngine` wraps that engine on the first stage (None on the others): the
later stages receive the first stage's samples and leave the push to it (the stages' parameters are gathered over
the pipeline first, so the first stage holds the whole depth).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch

from megatron_fp4.models.checkpoint_io import merge_tp
from megatron_fp4.models.hf_conversion import iter_hf_tensors_from_megatron
from megatron_fp4.resq import RolloutPrecision
from megatron_fp4.rollout.base import RolloutEngine, RolloutSample, SamplingParams, WeightSyncStats
from megatron_fp4.rollout.sglang_engine import InMemoryCheckpoint

__all__ = ["TPGroupEngine", "FirstStageEngine"]


class _GatheredShards(InMemoryCheckpoint):
    """:class:`InMemoryCheckpoint` over this rank's TP shards: each full tensor is gathered over the group when it
    is asked for (a collective: every rank asks in the same order)."""

    def __init__(self, shards: dict[str, torch.Tensor], hf_config: dict, group: Any) -> None:
        super().__init__(shards, hf_config)
        self.group, self.size = group, torch.distributed.get_world_size(group)

    def full_tensor(self, name: str) -> torch.Tensor:
        local = super().full_tensor(name).detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        torch.distributed.all_gather(parts, local, group=self.group)
        return merge_tp(name, parts)


class _LeaderEngine(RolloutEngine):
    """``engine`` on the first rank of ``group`` (None on the others): its samples broadcast to the group, its
    memory released and resumed there only."""

    def __init__(self, engine: Optional[RolloutEngine], precision: RolloutPrecision, group: Any) -> None:
        self.group = group
        self.src = torch.distributed.get_global_rank(group, 0)
        self.leader = torch.distributed.get_rank() == self.src
        if self.leader != (engine is not None):
            raise ValueError(f"{type(self).__name__}: the group's first rank, and only it, passes the engine")
        self.engine, self._precision = engine, precision
        self.last_weight_sync: Optional[WeightSyncStats] = None

    @property
    def precision(self) -> RolloutPrecision:
        return self._precision

    def generate(self, prompts: Sequence[Sequence[int]], sampling_params: SamplingParams) -> list[RolloutSample]:
        """The first rank's samples, on every rank of the group (an error there is raised everywhere)."""
        out: Any = None
        if self.leader:
            try:
                out = self.engine.generate(prompts, sampling_params)
            except Exception as e:  # the others would wait for the broadcast forever
                out = RuntimeError(f"{type(e).__name__}: {e}")
        box = [out]
        torch.distributed.broadcast_object_list(box, src=self.src, group=self.group)
        if isinstance(box[0], Exception):
            raise RuntimeError(f"rollout engine on rank {self.src} failed: {box[0]}")
        return box[0]

    def release_memory(self) -> None:
        if self.leader:
            self.engine.release_memory()

    def resume_memory(self) -> None:
        if self.leader:
            self.engine.resume_memory()

    def shutdown(self) -> None:
        if self.leader:
            self.engine.shutdown()


class FirstStageEngine(_LeaderEngine):
    """The first pipeline stage's engine (None on later stages) serving the pipeline ``group``: every stage gets
    its samples; only it pushes weights (every stage passes the gathered whole-depth weights; the later stages'
    calls return empty stats)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        stats = self.engine.update_weights(named_tensors) if self.leader else WeightSyncStats()
        self.last_weight_sync = stats
        return stats


class TPGroupEngine(_LeaderEngine):
    """``engine`` (on the group's first rank; None elsewhere) serving a whole tensor-parallel group."""

    def __init__(self, engine: Optional[RolloutEngine], precision: RolloutPrecision, hf_config: dict,
                 group: Any) -> None:
        super().__init__(engine, precision, group)
        self.hf_config = hf_config

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        """Gather this rank's TP shards (megatron-core names) tensor by tensor and push them from the first rank."""
        hf = iter_hf_tensors_from_megatron(_GatheredShards(dict(named_tensors), self.hf_config, self.group))
        stats = WeightSyncStats()
        try:
            if self.leader:
                stats = self.engine.update_weights(hf)
        finally:
            for _ in hf:  # take part in every gather (the first rank too, if its push stopped early)
                pass
        self.last_weight_sync = stats
        return stats
