"""examples/multi_gpu/check_parallel.py on CPU (gloo): one process vs TP=2 vs PP=2 from the same random model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tp2_and_pp2_start_from_the_single_process_loss(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "multi_gpu", "check_parallel.py"),
                        "--out", str(tmp_path), "--tiny", "--cpu"], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["layouts"]) == {"1gpu", "tp2", "pp2"}
    for name in ("tp2", "pp2"):
        lay = summary["layouts"][name]
        cmp = lay["compare_to_1gpu"]
        assert cmp["warmup_iters"] == 4 and lay["steps"] == 2
        # same random model, same first batch: the first loss differs only by fp32 summation order
        assert cmp["warmup_nll_first_rel"] < 1e-6, (name, cmp)
        assert lay["throughput"]["rollout_tokens_per_s"] > 0 and lay["throughput"]["train_tokens_per_s"] > 0
    assert "layout" in r.stdout and "tp2" in r.stdout
