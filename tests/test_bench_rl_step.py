"""benchmarks/bench_rl_step.py on the CPU: a tiny run of the driver per backend:precision, the table's JSON rows
carry the driver's own step timings, a run that fails is recorded and the next still runs, and a bad --runs item is
refused naming the allowed values."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_rl_step.py")


def _bench(tmp_path, *args):
    return subprocess.run([sys.executable, BENCH, "--shape", "tiny", "--prompts", "2", "--group-size", "2",
                           "--prompt-len", "8", "--new-tokens", "4", "--work-dir", str(tmp_path / "work"),
                           "--out", str(tmp_path / "out.json"), *args],
                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_rows_hold_the_drivers_step_timings(tmp_path):
    # sglang cannot start on a CPU: its run fails at once, is recorded, and the next run goes on
    r = _bench(tmp_path, "--runs", "sglang:bf16,native-megatron:bf16", "--steps", "2", "--run-timeout", "500")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "native-megatron:bf16" in r.stdout and "speed-up" in r.stdout and "sglang:bf16 " in r.stdout
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["info"]["shape"] == "tiny" and out["info"]["new_tokens"] == 4
    failed, row = out["rows"]
    assert failed["steps"] == 0 and "cannot run here" in failed["error"] and "step_s" not in failed
    assert (row["backend"], row["precision"], row["steps"], row["timed_steps"]) == ("native-megatron", "bf16", 2, 1)
    assert row["step_s"] >= row["rollout_s"] > 0 and row["train_s"] > 0 and row["speedup"] == 1.0
    assert row["rollout_tokens_per_s"] > 0 and "error" not in row
    assert len(row["logp_abs_diff_mean_per_step"]) == 2 and all(v >= 0 for v in row["logp_abs_diff_mean_per_step"])
    assert not any(k.startswith("mem/") for k in row)  # GPU only


def test_bad_run_names_the_allowed_values(tmp_path):
    r = _bench(tmp_path, "--runs", "vllm:bf16")
    assert r.returncode != 0
    assert ("BACKEND in native, native-megatron, sglang and PRECISION in bf16, w4a16, w4a4, w4a4+resq"
            in r.stderr)
