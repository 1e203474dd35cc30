"""The GRPO trainer: the loop over the roles, as slime's train.py has it (generate -> train -> update weights ->
evaluate -> save), and the start of a run (resume, or starting weights and warm-up, then the step-0 evaluation).

The roles, each in its own module: the rollout manager (engine, sampling, rewards, filters, weight sync), the
actor (advantages, GRPO loss through megatron's schedule, optimizer and LR schedule, frozen reference), the
evaluator (greedy held-out accuracy), the checkpointer (save, resume, reshard) and the supervised warm-up.
``megatron_fp4.rl.setup.build_trainer`` wires them from the configuration.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Optional

from megatron_fp4.rl.actor import Actor
from megatron_fp4.rl.checkpointer import Checkpointer, StartPlan
from megatron_fp4.rl.config import RLConfig
from megatron_fp4.rl.distributed import any_rank
from megatron_fp4.rl.evaluator import Evaluator
from megatron_fp4.rl.monitor import MetricsLogger, device_memory_metrics
from megatron_fp4.rl.rollout_manager import RolloutManager
from megatron_fp4.rl.warmup import SupervisedWarmup

__all__ = ["GRPOTrainer"]


class GRPOTrainer:
    """One GRPO run over its roles. ``step`` counts GRPO steps done; ``extra`` is the run's record (warm-up losses,
    warm-start accuracy) kept in every checkpoint."""

    def __init__(self, cfg: RLConfig, rollout: RolloutManager, actor: Actor, evaluator: Evaluator,
                 checkpointer: Checkpointer, warmup: SupervisedWarmup, logger: MetricsLogger,
                 bf16_precision: Any = None) -> None:
        self.cfg, self.rollout, self.actor, self.evaluator = cfg, rollout, actor, evaluator
        self.checkpointer, self.warmup, self.logger = checkpointer, warmup, logger
        self.bf16_precision = bf16_precision  # what --sft-target-accuracy is measured in
        self.step = 0
        self.extra: dict[str, Any] = {}

    # -- the loop ---------------------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """GRPO steps until --train-iters; returns the warm-start and final held-out accuracy. With
        --exit-signal-handler a SIGTERM / SIGINT stops the run after the step in progress (saved first): the result
        then has ``stopped`` (the signal's name) and no final evaluation."""
        run = self.cfg.run
        last_eval = None
        stop = StopSignal() if self.cfg.checkpoint.exit_signal_handler else None
        try:
            while self.step < run.train_iters:
                metrics = self.train_step()
                step = self.step
                self.logger.record(step, "train", metrics, console=step % run.log_interval == 0)
                if step % run.eval_interval == 0 or step == run.train_iters:
                    last_eval = self.evaluator.evaluate(rollout_id=f"eval_{step}")
                    self.logger.record(step, "eval", last_eval)
                self.log_underflow(step)
                saved = False
                if self.cfg.checkpoint.save and (step % self.cfg.checkpoint.save_interval == 0
                                                 or step == run.train_iters):
                    self.save()
                    saved = True
                if stop is not None and step < run.train_iters and stop.agreed():
                    if not saved:
                        self.save()
                    if self.logger.rank == 0:
                        print(f"[stop] {stop.received or 'a signal on another rank'}: stopped after GRPO step {step} "
                              f"of {run.train_iters}, checkpoint saved in {self.cfg.checkpoint.save}; the same "
                              f"command resumes the run", flush=True)
                    return {"warm_start": self.extra.get("warm_start", {}), "final": {}, "steps": self.step,
                            "warmup_losses": self.extra.get("warmup_losses", []),
                            "stopped": stop.received or "signal"}
        finally:
            if stop is not None:
                stop.restore()
        if self.cfg.checkpoint.save_hf:
            self.checkpointer.save_hf(self.actor)
        warm = self.extra.get("warm_start", {})
        if last_eval is None:
            last_eval = (dict(warm) if run.train_iters == 0 and warm
                         else self.evaluator.evaluate(rollout_id=f"eval_{self.step}"))
        return {"warm_start": warm, "final": last_eval, "steps": self.step,
                "warmup_losses": self.extra.get("warmup_losses", [])}

    def train_step(self) -> dict[str, float]:
        """One GRPO step: rollout() -> Sequences, update(sequences), then the new weights to the rollout engine.
        Wall times: ``rollout_s`` (generation), ``train_s`` (the update), ``step_s`` (all of it, scoring and the
        weight sync included); on a GPU the memory at the step's end (:func:`device_memory_metrics`)."""
        t0 = time.perf_counter()
        sequences, metrics = self.rollout.rollout(self.step)
        self.step += 1
        if sequences.num_tokens == 0:  # every group filtered out: nothing to learn, the weights stay as they are
            metrics.update(skipped=1.0, loss=0.0)
        else:
            self.rollout.release_memory()  # --offload-rollout: the engine's memory is the trainer's until the sync
            t1 = time.perf_counter()
            metrics.update(self.actor.update(sequences, self.step, self.checkpointer.last_checkpoint))
            metrics["train_s"] = time.perf_counter() - t1
            metrics.update(self.sync_weights())
        self.actor.set_lr(self.actor.lr_at(self.step))
        metrics["step_s"] = time.perf_counter() - t0
        metrics.update(device_memory_metrics())
        return metrics

    def sync_weights(self) -> dict[str, float]:
        """The policy's weights into the rollout engine (stops the run on non-finite weights)."""
        return self.rollout.sync_weights(self.actor.module, self.step, self.checkpointer.last_checkpoint)

    # -- the start of a run -------------------------------------------------------------------------------------------
    def start(self, plan: StartPlan) -> bool:
        """Resume ``plan.resume``, or start from ``plan.init_from``'s weights or the supervised warm-up (the policy
        already holds --ref-load's weights when given); then sync and, for a new run, evaluate the warm start
        (step 0), save it and log the underflow. Returns whether the run resumed."""
        if plan.resume is not None:
            resumed = self.checkpointer.resume(plan.resume, self.actor, self.rollout.sampler)
            self.step, self.extra = resumed.step, resumed.extra
            self.actor.set_lr(self.actor.lr_at(self.step))
            self.sync_weights()
            return True
        if plan.init_from:  # a shared warm start: its weights replace the warm-up
            self.checkpointer.load_weights(plan.init_from, self.actor)
        else:
            self.extra["warmup_losses"] = self.warm_up()
        self.actor.copy_policy_to_reference()
        self.sync_weights()
        warm = self.evaluator.evaluate(rollout_id="eval_0")
        self.extra["warm_start"] = warm
        self.logger.log(0, warm, prefix="eval")
        if self.cfg.checkpoint.save:
            self.save()
        self.log_underflow(0)
        return False

    def warm_up(self) -> list[float]:
        """--sft-iters supervised iterations, or fewer with --sft-target-accuracy (the first check, every
        --sft-eval-interval iterations, whose greedy held-out BF16 accuracy reaches the target stops it)."""
        c = self.cfg.warmup
        if c.sft_target_accuracy is None:
            return self.warmup.run(c.sft_iters)
        done, losses = 0, []
        while done < c.sft_iters:
            chunk = min(c.sft_eval_interval, c.sft_iters - done)
            losses += self.warmup.run(chunk, progress=False)
            done += chunk
            self.sync_weights()
            acc = self.evaluator.evaluate({"accuracy": self.bf16_precision}, held_out_only=True)["accuracy"]
            if self.logger.rank == 0:
                print(f"[warmup] iter {done}/{c.sft_iters} | held-out accuracy {acc:.3f} "
                      f"(target {c.sft_target_accuracy:.3f})", flush=True)
            if acc >= c.sft_target_accuracy:
                break
        return losses

    # -- checkpoints and diagnostics ----------------------------------------------------------------------------------
    def save(self) -> str:
        return self.checkpointer.save(self.step, self.actor, self.rollout.sampler, self.extra)

    def log_underflow(self, step: int) -> None:
        """Every --log-underflow-interval steps (and at step 0 and the last step): the per-layer rollout FP4
        underflow rate without and with ResQ on up to 64 held-out prompts, to the JSONL log and tensorboard."""
        run, precision = self.cfg.run, self.cfg.precision
        if not run.log_underflow_interval or (step % run.log_underflow_interval and step != run.train_iters):
            return
        sparsity = precision.resq if precision.resq != "none" else "2:4"
        rates = self.rollout.measure_underflow((self.evaluator.examples or self.rollout.train_examples)[:64],
                                               sparsity)
        fmt = self.rollout.engine.precision.format
        self.logger.record(step, "underflow", rates, console=False, tensorboard=True,
                           fields={"format": fmt, "sparsity": sparsity})


class StopSignal:
    """--exit-signal-handler (Megatron-LM's flag): SIGTERM and SIGINT only set ``received`` (the signal's name), so
    the GRPO step in progress runs to its end; :meth:`agreed`, between steps, tells whether any rank got one (every
    rank then stops after the same step). A second signal acts as it would without the flag (Ctrl-C twice: stop
    now). :meth:`restore` puts the previous handlers back."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: Optional[str] = None
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # the second one: the usual way out
            self.restore()
            signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum).name
        if os.environ.get("RANK", "0") == "0":
            print(f"[stop] {self.received}: the run stops after this GRPO step, once it is saved (the same signal "
                  f"again stops it now)", flush=True)

    def agreed(self) -> bool:
        """Whether any rank has received a stop signal (a collective: every rank calls it after each step)."""
        return any_rank(self.received is not None)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
