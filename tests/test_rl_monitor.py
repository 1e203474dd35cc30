"""Tests for megatron_fp4.rl.monitor: the non-finite guard and the metrics logger."""

import io
import math

import pytest
import torch

from megatron_fp4.rl.monitor import MetricsLogger, NonFiniteGuard, TrainingDivergedError, format_metrics


def test_guard_skips_non_finite_and_stops_after_k_in_a_row():
    g = NonFiniteGuard(max_consecutive=3)
    assert not g.should_skip(1, torch.tensor(0.5), 1.0)
    assert g.should_skip(2, float("nan"), 1.0)
    assert g.should_skip(3, 0.1, torch.tensor(float("inf")))
    assert not g.should_skip(4, 0.2, 2.0)  # a good step resets the run
    assert g.state_dict() == {"consecutive": 0, "total_skipped": 2}
    assert g.should_skip(5, math.inf, 0.0)
    assert g.should_skip(6, math.nan, 0.0)
    with pytest.raises(TrainingDivergedError, match=r"step 7.*3 consecutive.*ckpt/iter_0000004"):
        g.should_skip(7, math.nan, 0.0, last_checkpoint="ckpt/iter_0000004")
    h = NonFiniteGuard(2)
    h.load_state_dict({"consecutive": 1, "total_skipped": 5})
    with pytest.raises(TrainingDivergedError, match="none saved"):
        h.should_skip(9, math.nan)
    with pytest.raises(ValueError):
        NonFiniteGuard(0)


def test_format_and_logger(tmp_path):
    line = format_metrics(3, {"b": 0.00001234, "a": torch.tensor(0.5), "c": 123456.0}, total_steps=10)
    assert line == "step 3/10 | a 0.5 | b 1.234e-05 | c 1.235e+05"
    out = io.StringIO()
    lg = MetricsLogger(log_dir=str(tmp_path / "tb"), total_steps=4, stream=out)
    lg.log(1, {"reward_mean": 0.25, "loss": torch.tensor(-0.1), "other": 3})
    lg.close()
    text = out.getvalue()
    assert text.startswith("[train] step 1/4 | reward_mean 0.25 | loss -0.1 |") and "other" not in text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/reward_mean", "train/loss", "train/other"}
    assert acc.Scalars("train/loss")[0].step == 1 and acc.Scalars("train/loss")[0].value == pytest.approx(-0.1)
    silent = io.StringIO()
    MetricsLogger(total_steps=4, rank=1, stream=silent).log(1, {"loss": 1.0})
    assert silent.getvalue() == ""


def test_eta_counts_the_pace_since_the_first_line_of_its_kind(monkeypatch):
    """The console's eta is the pace since this kind's first line times the steps left: a 200 s warm-up before GRPO,
    or 80 steps before a resume, do not make it 50x too long (or short)."""
    clock = [1000.0]
    monkeypatch.setattr("megatron_fp4.rl.monitor.time.monotonic", lambda: clock[0])
    out = io.StringIO()
    lg = MetricsLogger(total_steps=100, stream=out)
    clock[0] += 200.0  # setup and a supervised warm-up
    lg.log(81, {"loss": 0.1})  # a run resumed at step 80: no pace yet, no eta
    for step in (82, 83):
        clock[0] += 2.0
        lg.log(step, {"loss": 0.1})
    lg.log(90, {"accuracy": 0.5}, prefix="eval")  # another kind: its own first line
    lines = out.getvalue().splitlines()
    assert "eta" not in lines[0] and lines[0].endswith("| 200s")
    assert lines[1].endswith("| 202s | eta 36s") and lines[2].endswith("| 204s | eta 34s")  # 2 s a step
    assert "eta" not in lines[3]


def test_wandb_run_receives_every_record(tmp_path, monkeypatch):
    """--use-wandb: the logger sends each record under kind/ to a W&B run (offline here: nothing leaves the
    machine), and the run's config holds every knob."""
    pytest.importorskip("wandb")
    from types import SimpleNamespace

    from megatron_fp4.rl.monitor import MetricsLogger, init_wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = SimpleNamespace(wandb_project="megatron-fp4-test", wandb_group="g", wandb_mode="offline",
                          wandb_dir=str(tmp_path))
    run = init_wandb(cfg, {"lr": 1e-3, "eval_prompt_data": ("toy", "toy.jsonl")})
    logger = MetricsLogger(rank=0, wandb_run=run, stream=io.StringIO())
    logger.log(0, {"accuracy": 0.25}, prefix="eval")
    logger.record(1, "train", {"loss": 0.5, "reward_mean": torch.tensor(0.75)})
    logger.record(2, "train", {"loss": 0.25})  # W&B commits a step's values when the next step starts
    summary = dict(run.summary)
    assert (summary["eval/accuracy"], summary["train/loss"], summary["train/reward_mean"]) == (0.25, 0.5, 0.75)
    assert run.config["eval_prompt_data"] == ["toy", "toy.jsonl"] and run.group == "g"
    logger.close()
    assert logger.wandb_run is None and list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_device_memory_metrics(monkeypatch):
    """Nothing without CUDA; on a GPU the device-wide use (other processes such as an SGLang Engine included), this
    process's reserved memory and its peak since the last call, which the call resets."""
    from megatron_fp4.rl.monitor import device_memory_metrics

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_memory_metrics() == {}
    gib = 2 ** 30
    resets = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (100 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 30 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 25 * gib)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    assert device_memory_metrics() == {"mem/device_used_gib": 40.0, "mem/reserved_gib": 30.0,
                                       "mem/peak_allocated_gib": 25.0}
    assert resets == [1]
