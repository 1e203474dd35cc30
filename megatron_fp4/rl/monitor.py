"""Training-loop safety and reporting: skip non-finite updates (stop after several in a row), and log per-step
metrics to tensorboard, a JSONL file, Weights & Biases (optional: --use-wandb) and a one-line console summary."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import IO, Any, Mapping

import torch

__all__ = ["TrainingDivergedError", "NonFiniteGuard", "MetricsLogger", "format_metrics", "init_wandb",
           "device_memory_metrics"]

log = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """Raised after too many consecutive non-finite steps; the message names the step and the last checkpoint."""


def _as_float(x: Any) -> float:
    if isinstance(x, torch.Tensor):
        return float(x.detach().float().reshape(-1)[0]) if x.numel() == 1 else float("nan")
    return float(x)


class NonFiniteGuard:
    """Decides whether to apply an optimizer update: a non-finite loss or grad norm skips it (and is logged);
    `max_consecutive` such steps in a row raise TrainingDivergedError."""

    def __init__(self, max_consecutive: int = 3) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total_skipped = 0

    def should_skip(self, step: int, loss: Any, grad_norm: Any = 0.0, last_checkpoint: str | None = None) -> bool:
        """True when this step's update must be skipped; raises after max_consecutive skips in a row."""
        lv, gv = _as_float(loss), _as_float(grad_norm)
        if math.isfinite(lv) and math.isfinite(gv):
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.total_skipped += 1
        log.warning("step %d: non-finite loss=%s grad_norm=%s, skipping the update (%d in a row)", step, lv, gv,
                    self.consecutive)
        if self.consecutive >= self.max_consecutive:
            raise TrainingDivergedError(
                f"stopping at step {step}: {self.consecutive} consecutive steps with a non-finite loss or gradient "
                f"(last: loss={lv}, grad_norm={gv}); last good checkpoint: {last_checkpoint or 'none saved'}")
        return True

    def state_dict(self) -> dict[str, int]:
        return {"consecutive": self.consecutive, "total_skipped": self.total_skipped}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.consecutive, self.total_skipped = int(state["consecutive"]), int(state["total_skipped"])


def device_memory_metrics() -> dict[str, float]:
    """This rank's GPU memory at the end of a step, in GiB (nothing without CUDA): ``mem/device_used_gib`` (the
    whole device, every process on it: an SGLang Engine on the same GPU included), ``mem/reserved_gib`` (this
    process's caching allocator) and ``mem/peak_allocated_gib`` (this process's peak since the last call, which
    resets it). device_used - reserved is what the other processes (and the CUDA contexts) take."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    gib = float(2 ** 30)
    out = {"mem/device_used_gib": (total - free) / gib, "mem/reserved_gib": torch.cuda.memory_reserved() / gib,
           "mem/peak_allocated_gib": torch.cuda.max_memory_allocated() / gib}
    torch.cuda.reset_peak_memory_stats()
    return out


def _fmt(v: float) -> str:
    if v == 0 or not math.isfinite(v):
        return str(v)
    a = abs(v)
    return f"{v:.3e}" if a < 1e-3 or a >= 1e5 else f"{v:.4g}"


def format_metrics(step: int, metrics: Mapping[str, Any], total_steps: int | None = None,
                   keys: tuple[str, ...] | None = None) -> str:
    """'step 3/10 | reward_mean 0.5 | ...' for the given keys (all, sorted, when None)."""
    head = f"step {step}" + (f"/{total_steps}" if total_steps else "")
    names = keys if keys is not None else tuple(sorted(metrics))
    return " | ".join([head] + [f"{k} {_fmt(_as_float(metrics[k]))}" for k in names if k in metrics])


def init_wandb(run_cfg: Any, config: Mapping[str, Any]) -> Any:
    """A Weights & Biases run for --use-wandb (--wandb-project, --wandb-group, --wandb-mode, --wandb-dir), with
    every knob in ``config``; RuntimeError naming ``pip install wandb`` when the package is missing."""
    try:
        import wandb
    except ImportError:
        raise RuntimeError("--use-wandb needs the wandb package, which is not installed: pip install wandb "
                           "(or pip install -e .[wandb])") from None
    kwargs = {"project": run_cfg.wandb_project or "megatron-fp4", "group": run_cfg.wandb_group,
              "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()}}
    if run_cfg.wandb_mode is not None:
        kwargs["mode"] = run_cfg.wandb_mode
    if run_cfg.wandb_dir is not None:
        kwargs["dir"] = run_cfg.wandb_dir
    return wandb.init(**kwargs)


class MetricsLogger:
    """Per-step scalar metrics to tensorboard (when log_dir is given; only on rank 0), one console line, with
    ``jsonl_path`` one JSON line per record, and with ``wandb_run`` (a W&B run) every record under ``kind/``
    (rank 0)."""

    CONSOLE_KEYS = ("reward_mean", "accuracy", "loss", "kl_mean", "ppo_clip_frac", "tis_clip_frac",
                    "logp_abs_diff_mean", "entropy_mean", "grad_norm", "response_length_mean", "rollout_tokens_per_s",
                    "train_tokens_per_s")

    def __init__(self, log_dir: str | None = None, total_steps: int | None = None, rank: int = 0,
                 stream: IO[str] | None = None, console_keys: tuple[str, ...] | None = None,
                 jsonl_path: str | None = None, wandb_run: Any = None) -> None:
        self.rank, self.total_steps, self.jsonl_path = rank, total_steps, jsonl_path
        self.wandb_run = wandb_run if rank == 0 else None
        self.stream = stream if stream is not None else sys.stdout
        self.console_keys = console_keys if console_keys is not None else self.CONSOLE_KEYS
        self.writer = None
        if log_dir is not None and rank == 0:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=log_dir)
        self._t0 = time.monotonic()
        self._anchors: dict[str, tuple[int, float]] = {}  # prefix -> (step, time) of its first console line

    def record(self, step: int, kind: str, metrics: Mapping[str, Any], console: bool = True,
               tensorboard: bool | None = None, fields: Mapping[str, Any] | None = None) -> None:
        """One JSON line ``{"step", "kind", **fields, **metrics}`` (with ``jsonl_path``), then tensorboard under
        ``kind/`` and the console line where asked (tensorboard follows ``console`` unless given); rank 0 only."""
        if self.rank != 0:
            return
        if self.jsonl_path:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps({"step": step, "kind": kind, **(fields or {}), **metrics}) + "\n")
        self.log(step, metrics, prefix=kind, console=console,
                 tensorboard=console if tensorboard is None else tensorboard)

    def log(self, step: int, metrics: Mapping[str, Any], prefix: str = "train", console: bool = True,
            tensorboard: bool = True) -> None:
        """Write every scalar under prefix/name (tensorboard, W&B) and print the console line (rank 0 only)."""
        if self.rank != 0:
            return
        if self.wandb_run is not None:
            self.wandb_run.log({f"{prefix}/{k}": _as_float(v) for k, v in metrics.items()}, step=step)
        if self.writer is not None and tensorboard:
            for k, v in metrics.items():
                self.writer.add_scalar(f"{prefix}/{k}", _as_float(v), step)
            self.writer.flush()
        if not console:
            return
        line = format_metrics(step, metrics, self.total_steps, self.console_keys)
        now = time.monotonic()
        elapsed = now - self._t0
        # the pace since this kind's first line: setup, a warm-up or the steps before a resume do not count
        step0, t0 = self._anchors.setdefault(prefix, (step, now))
        eta = ""
        if self.total_steps and step > step0:
            eta = f" | eta {(now - t0) / (step - step0) * max(self.total_steps - step, 0):.0f}s"
        print(f"[{prefix}] {line} | {elapsed:.0f}s{eta}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
