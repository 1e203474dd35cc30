"""The model weights of a GRPO trainer checkpoint, readable at any tensor/pipeline-parallel layout.

Each rank file of a trainer checkpoint (:mod:`megatron_fp4.rl.checkpoint`) records the rank's place in the
parallel layout (``layout``, see :func:`layout_record`). The data-parallel rank 0 file of every (TP, PP) position
holds that shard of the policy under stage-local names, so :class:`TrainerCheckpointWeights` serves full tensors
by global name, and ``megatron_fp4.models.checkpoint_io.load_checkpoint_into_model`` reshards them for a model
built with another TP/PP (a warm start made on one GPU, used by a TP=2 run).

The layout record also describes the model, so that a run directory alone can be exported to Hugging Face
(``megatron_fp4.rl.export``): every ``GPTModelArgs`` field, and, for a model converted from HF, its config.json,
architecture and vocabulary (``hf``) and, in global rank 0's file, its tokenizer files (``hf_assets``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from megatron_fp4.models.checkpoint_io import ShardedWeights, hf_asset_files, model_args_to_json
from megatron_fp4.rl.checkpoint import CheckpointError, iter_dir_name, load_checkpoint, verify_checksums

__all__ = ["layout_record", "same_layout", "describe_layout", "saved_layout", "TrainerCheckpointWeights"]

#: Largest tokenizer / config file embedded in a checkpoint's layout record (larger files are not copied).
MAX_ASSET_BYTES = 64 * 2**20


def _asset_tensors(folder: str | None) -> dict[str, torch.Tensor]:
    """{file name: uint8 tensor of its bytes} of the HF asset files in ``folder`` (weights_only-safe)."""
    if not folder or not Path(folder).is_dir():
        return {}
    out = {}
    for p in hf_asset_files(folder):
        if p.stat().st_size > MAX_ASSET_BYTES:
            warnings.warn(f"{p} ({p.stat().st_size} bytes) is larger than {MAX_ASSET_BYTES} bytes: not recorded "
                          f"with the checkpoint (an HF export of it will lack this file)")
            continue
        data = bytearray(p.read_bytes())
        out[p.name] = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return out


def layout_record(module: torch.nn.Module, real_vocab_size: int) -> dict:
    """This rank's parallel layout and the model, as stored with its checkpoint file: ``model_args`` (every
    GPTModelArgs field of the whole model), ``real_vocab_size`` (the tokenizer's), and when the model came from a
    Hugging Face checkpoint (``module.hf_info``) ``hf`` (config, architecture, vocabulary) and, on global rank 0
    only, ``hf_assets`` ({file name: uint8 bytes} of its tokenizer files)."""
    from megatron.core import parallel_state as ps

    from megatron_fp4.models.gpt import GPTModelArgs

    record = {
        "tp": ps.get_tensor_model_parallel_world_size(), "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_world_size(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_world_size(), "dp_rank": ps.get_data_parallel_rank(),
        "model_args": model_args_to_json(GPTModelArgs.from_model(module)),
        "real_vocab_size": int(real_vocab_size),
    }
    info = getattr(module, "hf_info", None)
    if info:
        record["hf"] = {"config": info.get("config"), "architecture": info.get("architecture"),
                        "vocab_size": info.get("vocab_size")}
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not dist or torch.distributed.get_rank() == 0:
            record["hf_assets"] = _asset_tensors(info.get("assets_dir"))
    return record


def same_layout(a: dict, b: dict) -> bool:
    """Same TP, PP and DP sizes (then every rank finds its own state in its own file)."""
    return all(a[k] == b[k] for k in ("tp", "pp", "dp"))


def describe_layout(layout: dict) -> str:
    return f"TP={layout['tp']}, PP={layout['pp']}, DP={layout['dp']}"


def saved_layout(load_dir: str | Path, iteration: int | None = None) -> tuple[int, dict | None]:
    """(iteration, layout of the checkpoint's rank 0) of the latest (or given) checkpoint; None for checkpoints
    written before layouts were recorded."""
    it, state = load_checkpoint(load_dir, iteration, rank=0, mmap=True)
    return it, state.get("layout")


class TrainerCheckpointWeights(ShardedWeights):
    """The policy weights of one trainer checkpoint iteration, by (TP rank, PP rank) shard; with ``part`` another
    dict of tensors named like them: ``"reference"``, or ``("optimizer_named", "exp_avg")`` (optimizer state by
    parameter name, :mod:`megatron_fp4.rl.optimizer_state`).

    Rank files are opened (memory-mapped) when a shard is first needed, so a loading rank reads the few files that
    hold its layers, not all of them: under Megatron's rank order (TP fastest, then DP, then PP) the DP-rank-0 file
    of shard (t, p) is rank t + TP * DP * p; the file's own layout record confirms it, and only a checkpoint saved
    with another rank order costs one scan of every file's layout."""

    def __init__(self, load_dir: str | Path, iteration: int | None = None, part: str | tuple[str, ...] = "model"
                 ) -> None:
        it, state0 = load_checkpoint(load_dir, iteration, rank=0, mmap=True)
        first = state0.get("layout")
        if first is None:
            raise CheckpointError(f"{load_dir} ({iter_dir_name(it)}) records no parallel layout (written by an older "
                                  f"version): it can only be loaded with the layout it was saved with")
        self.dir = Path(load_dir) / iter_dir_name(it)
        self.tp, self.pp, self.dp = int(first["tp"]), int(first["pp"]), int(first["dp"])
        self.model_args = dict(first["model_args"])
        hf = first.get("hf") or {}
        #: as a megatron-fp4 checkpoint's args.json has them (hf_vocab_size: the rows an export keeps)
        self.args = {"hf_vocab_size": int(hf.get("vocab_size") or first["real_vocab_size"]),
                     "hf_config": hf.get("config"), "hf_architecture": hf.get("architecture")}
        self.records_hf_model = bool(hf.get("config"))
        self.hf_assets: dict[str, torch.Tensor] = dict(first.get("hf_assets") or {})
        self._load_dir, self._iteration = load_dir, it
        self._part = (part,) if isinstance(part, str) else tuple(part)
        self._shards: dict[tuple[int, int], dict] = {}
        self._rank_of: dict[tuple[int, int], int] | None = None  # filled by a scan if the rank order is not Megatron's
        self._keep_if_dp0(state0, 0)

    def _keep_if_dp0(self, state: dict, rank: int) -> tuple[int, int] | None:
        lay = state.get("layout") or {}
        if lay.get("dp_rank") != 0:
            return None
        pos = (int(lay["tp_rank"]), int(lay["pp_rank"]))
        if pos not in self._shards:  # the tensors this reader serves, verified once against their checksums
            verify_checksums(state, self.dir / f"rank_{rank:05d}.pt", ("/".join(self._part) + "/",))
        tensors = state
        for key in self._part:
            tensors = tensors[key]
        self._shards.setdefault(pos, tensors)
        return pos

    def _open(self, rank: int) -> dict:
        return load_checkpoint(self._load_dir, self._iteration, rank=rank, mmap=True)[1]

    def _shard(self, tp_rank: int, pp_rank: int) -> dict:
        pos = (tp_rank, pp_rank)
        if pos in self._shards:
            return self._shards[pos]
        if not (0 <= tp_rank < self.tp and 0 <= pp_rank < self.pp):
            raise KeyError(f"{self.dir} has TP={self.tp}, PP={self.pp}: no shard (TP rank {tp_rank}, PP rank {pp_rank})")
        guess = tp_rank + self.tp * self.dp * pp_rank
        if self._rank_of is None and self._keep_if_dp0(self._open(guess), guess) == pos:
            return self._shards[pos]
        if self._rank_of is None:  # another rank order: read every file's layout once
            self._rank_of = {}
            for rank in range(self.tp * self.pp * self.dp):
                lay = self._open(rank).get("layout") or {}
                if lay.get("dp_rank") == 0:
                    self._rank_of[(int(lay["tp_rank"]), int(lay["pp_rank"]))] = rank
        if pos not in self._rank_of:
            raise CheckpointError(f"{self.dir}: no rank file holds the (TP rank, PP rank) shard {pos}")
        self._keep_if_dp0(self._open(self._rank_of[pos]), self._rank_of[pos])
        return self._shards[pos]

    def shard_tensor(self, tp_rank: int, pp_rank: int, local_name: str) -> torch.Tensor:
        try:
            return self._shard(tp_rank, pp_rank)[local_name]
        except KeyError:
            raise KeyError(f"{local_name} not found in {self.dir} (TP rank {tp_rank}, PP rank {pp_rank})") from None

    def shard_keys(self, tp_rank: int, pp_rank: int) -> list[str]:
        return [k for k in self._shard(tp_rank, pp_rank) if not k.endswith("_extra_state")]

    def write_hf_assets(self, dst: str | Path) -> list[str]:
        """Write the tokenizer files recorded with the checkpoint (rank 0's ``hf_assets``) into ``dst``."""
        dst = Path(dst)
        for name, data in self.hf_assets.items():
            dst.mkdir(parents=True, exist_ok=True)
            (dst / name).write_bytes(data.numpy().tobytes())
        return sorted(self.hf_assets)
