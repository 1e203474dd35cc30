"""The checkpointer: where a run starts from (``plan_start``), and saving, resuming and resharding its state.

Checkpoint flags mean what they mean in Megatron-LM and slime:
- ``--load DIR``: the RL checkpoint a run resumes from (default: ``--save``, so re-running a command continues it).
  A ``--load`` that does not exist or holds no checkpoint starts from the starting weights and says so first; an
  incomplete or damaged one is an error naming the file. ``--load`` equal to ``--save`` is that default spelled
  out: while it holds nothing the run starts as it would without ``--load``.
- ``--ref-load DIR`` (a converted checkpoint) or ``--init-from DIR`` (another run's weights): the starting
  weights, also the KL reference. With no ``--load`` at all a run may start from a random model; with a
  ``--load`` that holds nothing, only when ``--init random`` says so.
- ``--hf-checkpoint DIR`` (a Hugging Face folder): the tokenizer, and, when no ``--ref-load`` names a converted
  checkpoint, the architecture and starting weights (read through ``megatron_fp4.models.hf_weights``, nothing
  converted on disk); ``--init-from`` still replaces its weights.
- ``--load CONVERTED`` (the old spelling of ``--ref-load``) still works, with a note saying so.

A checkpoint (one file per rank, :mod:`megatron_fp4.rl.checkpoint`) holds the policy, the reference, the optimizer
state by parameter name, the data position, the non-finite guard, the RNG states, the step and the run's extra
record, and this rank's layout; at another TP/PP/DP layout it is resharded (weights and optimizer state exactly).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_fp4.rl.actor import Actor
from megatron_fp4.rl.checkpoint import (CheckpointError, capture_rng_state, check_save_dir, claim_save_dir,
                                        inspect_checkpoint_dir, iter_dir_name, load_checkpoint, restore_rng_state,
                                        save_checkpoint, verify_checksums)
from megatron_fp4.rl.config import CheckpointConfig
from megatron_fp4.rl.data import PromptSampler
from megatron_fp4.rl.optimizer_state import (load_named_optimizer_state, named_optimizer_state, parameter_names,
                                             uses_distributed_optimizer)

__all__ = ["StartPlan", "plan_start", "Checkpointer", "Resumed"]


@dataclass(frozen=True)
class StartPlan:
    """Where a run's state comes from, decided from the checkpoint flags before any model is built."""

    resume: Optional[str]      # an RL checkpoint directory to resume from
    ref_load: Optional[str]    # a converted checkpoint: architecture, starting weights and tokenizer
    init_from: Optional[str]   # an RL checkpoint directory whose latest model weights start the run
    notes: tuple[str, ...]     # what was decided and why, printed first
    hf_checkpoint: Optional[str] = None  # an HF folder: architecture and starting weights (no --ref-load)


def plan_start(cfg: CheckpointConfig) -> StartPlan:
    """Resolve --load / --save / --ref-load / --init-from / --init (see the module docstring); ValueError naming
    the flag when the run has nothing to start from."""
    from megatron_fp4.models.checkpoint_io import is_megatron_checkpoint

    notes = []
    load, ref_load = cfg.load, cfg.ref_load
    if ref_load is not None and not is_megatron_checkpoint(ref_load):
        hint = (f"; it holds an RL checkpoint: resume it with --load {ref_load}, or start from its weights with "
                f"--init-from {ref_load}" if inspect_checkpoint_dir(ref_load) is not None else "")
        raise ValueError(f"--ref-load={ref_load!r} is not a converted checkpoint (tools/convert_hf_to_megatron.py)"
                         f"{hint}")
    if load is not None and is_megatron_checkpoint(load):
        if ref_load is not None and Path(ref_load).resolve() != Path(load).resolve():
            raise ValueError(f"--load={load!r} is a converted checkpoint (starting weights) and --ref-load="
                             f"{ref_load!r} names others: pass the starting weights with --ref-load only")
        notes.append(f"--load {load} is a converted model checkpoint: taken as --ref-load {load} (the starting "
                     f"weights). --load now names the RL checkpoint a run resumes from, as in Megatron-LM and "
                     f"slime: pass --ref-load {load}")
        ref_load, load = load, None
    # --load defaults to --save, and naming the same directory is that default spelled out (Megatron-LM's and
    # slime's idiom for "resume if I have a checkpoint"): an empty one starts the run like no --load at all
    given = load is not None
    own = not given or (cfg.save is not None and Path(load).resolve() == Path(cfg.save).resolve())
    load = load if given else cfg.save
    hf = cfg.hf_checkpoint if ref_load is None else None  # a converted checkpoint's weights win
    resume = load if load is not None and inspect_checkpoint_dir(load) is not None else None
    if cfg.save is not None:
        check_save_dir(cfg.save)  # another tool's folder or a converted model is refused before any work
    if resume is not None:
        return StartPlan(resume, ref_load, cfg.init_from, tuple(notes), hf)
    if own and given:
        notes.insert(0, f"--load {load} (= --save) holds no checkpoint yet: a new run")
    if not own:
        why = "does not exist" if not os.path.exists(load) else "holds no checkpoint"
        start = (f"--ref-load {ref_load}" if ref_load else f"--init-from {cfg.init_from}" if cfg.init_from
                 else f"--hf-checkpoint {hf}" if hf else "a random model (--init random)" if cfg.init == "random"
                 else None)
        if start is None:
            raise ValueError(f"--load {load} {why} and no starting weights are named: pass --ref-load "
                             f"CONVERTED_CHECKPOINT, --hf-checkpoint HF_DIR or --init-from RUN_DIR, or --init random "
                             f"for a randomly initialized model")
        notes.insert(0, f"--load {load} {why}: starting from {start}")
    return StartPlan(None, ref_load, cfg.init_from, tuple(notes), hf)


@dataclass
class Resumed:
    """What a resume restored besides the roles' own state."""

    step: int
    extra: dict
    path: str


class Checkpointer:
    """Saves and restores the actor (policy, reference, optimizer, guard), the data position and the run record."""

    def __init__(self, cfg: CheckpointConfig, real_vocab_size: int, tokenizer_dir: Optional[str] = None) -> None:
        self.cfg, self.real_vocab_size, self.tokenizer_dir = cfg, real_vocab_size, tokenizer_dir
        self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.last_checkpoint: Optional[str] = None
        if cfg.save and self.rank == 0:  # before anything (tensorboard, logs) writes into it
            claim_save_dir(cfg.save)

    def layout(self, actor: Actor) -> dict:
        """This rank's parallel layout and the model shape, stored with each checkpoint file."""
        from megatron_fp4.rl.checkpoint_weights import layout_record

        return layout_record(actor.module, self.real_vocab_size)

    def save(self, step: int, actor: Actor, sampler: PromptSampler, extra: dict[str, Any]) -> str:
        """Write checkpoint ``step`` into --save atomically (every rank its own file); returns its directory."""
        state = {
            "step": step,
            "model": actor.module.state_dict(),
            "reference": actor.reference.state_dict() if actor.reference is not None else None,
            "optimizer_named": named_optimizer_state(actor.optimizer, actor.module),
            "sampler": sampler.state_dict(),
            "guard": actor.guard.state_dict(),
            "rng": capture_rng_state(),
            "extra": extra,
            "layout": self.layout(actor),
        }
        path = save_checkpoint(self.cfg.save, step, state, keep_last=self.cfg.keep_last, rank=self.rank,
                               world_size=self.world_size)
        self.last_checkpoint = str(path)
        if self.rank == 0:
            print(f"[checkpoint] saved step {step} to {path}", flush=True)
        return str(path)

    def save_hf(self, actor: Actor) -> str:
        """The policy as a Hugging Face folder in --save-hf (collective: every rank calls it); returns the folder.
        Config and tokenizer come from the model the run started from (or the HF tokenizer folder it used)."""
        from megatron_fp4.rl.export import export_hf

        from_hf = bool(getattr(actor.module, "hf_info", None))  # then its own vocabulary; else the tokenizer's
        path = export_hf(actor.policy, self.cfg.save_hf, vocab_size=None if from_hf else self.real_vocab_size,
                         hf_assets=self.tokenizer_dir)
        if self.rank == 0:
            print(f"[checkpoint] Hugging Face export of the policy written to {path}", flush=True)
        return str(path)

    def load_weights(self, load_dir: str, actor: Actor) -> int:
        """Only the model weights of the latest RL checkpoint in ``load_dir`` (a warm start shared by several runs);
        optimizer, step, data position and RNG stay fresh. The checkpoint may come from another TP/PP/DP layout
        (resharded on load). Returns the checkpoint's iteration."""
        from megatron_fp4.rl.checkpoint_weights import describe_layout, same_layout, saved_layout

        it, saved = saved_layout(load_dir)
        mine = self.layout(actor)
        how = "warm start"
        same = saved is None or same_layout(saved, mine)
        self._load_policy(load_dir, it, same, actor)
        if not same:
            how += f", resharded from {describe_layout(saved)} to {describe_layout(mine)}"
        if self.rank == 0:
            print(f"[checkpoint] model weights from {os.path.join(load_dir, iter_dir_name(it))} ({how})", flush=True)
        return it

    def resume(self, load_dir: str, actor: Actor, sampler: PromptSampler) -> Resumed:
        """Restore the latest RL checkpoint of ``load_dir`` into the actor and the sampler (and the RNG states). A
        checkpoint saved at another TP/PP/DP layout is resharded: weights and optimizer state exactly, the data
        position, step and guard from its rank 0 (they are global), and every rank takes rank 0's RNG state
        (sampling seeds derive from the step and the data-parallel rank, not from it)."""
        from megatron_fp4.rl.checkpoint_weights import describe_layout, same_layout, saved_layout

        it, saved = saved_layout(load_dir)
        mine = self.layout(actor)
        how = ""
        if saved is None or same_layout(saved, mine):
            state = self._load_policy(load_dir, it, True, actor)  # then the saved main copies where stored
            if actor.reference is not None and state.get("reference") is not None:
                actor.reference.load_state_dict(state["reference"])
            if "optimizer_named" in state:
                load_named_optimizer_state(actor.optimizer, actor.module, state["optimizer_named"])
            elif uses_distributed_optimizer(actor.optimizer):  # its state dict is by position and replicated
                raise CheckpointError(
                    f"cannot resume from {os.path.join(load_dir, iter_dir_name(it))} with --use-distributed-optimizer: "
                    f"it was saved by a version that did not store the optimizer state by parameter name. Resume it "
                    f"without --use-distributed-optimizer (its next checkpoint stores the state by name)")
            else:  # written before optimizer state was stored by name
                actor.optimizer.load_state_dict(state["optimizer"])
        else:
            state = self._load_resharded(load_dir, it, saved, mine, actor)
            how = f", resharded from {describe_layout(saved)} to {describe_layout(mine)}"
        sampler.load_state_dict(state["sampler"])
        actor.guard.load_state_dict(state["guard"])
        restore_rng_state(state["rng"])
        step = int(state["step"])
        self.last_checkpoint = os.path.join(load_dir, iter_dir_name(it))
        if self.rank == 0:
            print(f"[checkpoint] resumed from {self.last_checkpoint} (step {step}{how})", flush=True)
        return Resumed(step, dict(state.get("extra") or {}), self.last_checkpoint)

    def _load_policy(self, load_dir: str, it: int, same_layout: bool, actor: Actor) -> Optional[dict]:
        """Load the policy weights of checkpoint ``it``: from this rank's file under the layout it was saved with
        (whose whole state is returned), else resharded (None returned). Either way the optimizer's main copies
        are refreshed from them: with --bf16 it steps fp32 copies made when it was built (a no-op for fp32
        parameters), or the first update would start from the old weights."""
        from megatron_fp4.models.checkpoint_io import load_checkpoint_into_model
        from megatron_fp4.rl.checkpoint_weights import TrainerCheckpointWeights

        state = None
        if same_layout:
            _, state = load_checkpoint(load_dir, it, rank=self.rank)
            actor.module.load_state_dict(state["model"])
        else:
            load_checkpoint_into_model(actor.policy, TrainerCheckpointWeights(load_dir, it))
        actor.reload_main_params()
        return state

    def _load_resharded(self, load_dir: str, it: int, saved: dict, mine: dict, actor: Actor) -> dict:
        """Weights, reference and optimizer state of checkpoint ``it`` resharded to this rank; returns rank 0's
        state (the global parts)."""
        from megatron_fp4.models.checkpoint_io import load_checkpoint_into_model, rank_state
        from megatron_fp4.rl.checkpoint_weights import TrainerCheckpointWeights, describe_layout

        _, state0 = load_checkpoint(load_dir, it, rank=0, mmap=True)
        # the global parts taken from rank 0's file (the sharded ones are verified as they are read)
        verify_checksums(state0, Path(load_dir) / iter_dir_name(it) / "rank_00000.pt", ("rng/", "sampler/", "guard/"))
        if "optimizer_named" not in state0:
            raise CheckpointError(
                f"cannot resume from {os.path.join(load_dir, iter_dir_name(it))} at another layout: it was saved "
                f"with {describe_layout(saved)} (this run has {describe_layout(mine)}) by a version that did not "
                f"store the optimizer state by parameter name. To start from its weights at this layout, pass "
                f"--init-from {load_dir} with a new --save directory (fresh optimizer and schedule)")
        module = actor.module
        self._load_policy(load_dir, it, False, actor)  # then the saved main copies where stored
        if actor.reference is not None and state0.get("reference") is not None:
            load_checkpoint_into_model(actor.reference, TrainerCheckpointWeights(load_dir, it, "reference"))
        saved_opt = state0["optimizer_named"]
        steps = {float(v) for v in saved_opt.get("step", {}).values()}
        if len(steps) > 1:
            raise CheckpointError(f"{load_dir}: parameters at different optimizer steps {sorted(steps)}: cannot "
                                  f"reshard the optimizer state")
        names = parameter_names(actor.optimizer, module)
        named = {kind: rank_state(module, TrainerCheckpointWeights(load_dir, it, ("optimizer_named", kind)),
                                  names=names) for kind in saved_opt if kind != "step"}
        if steps:  # (no step: saved before the first update, the per-parameter state stays fresh)
            step = next(iter(saved_opt["step"].values()))
            named["step"] = {n: step for n in names}
        load_named_optimizer_state(actor.optimizer, module, named)
        return state0
