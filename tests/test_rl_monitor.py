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
