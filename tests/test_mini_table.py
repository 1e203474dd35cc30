"""The mini precision table end to end on CPU (issue 9): run_mini_table.py --tiny (a warm start, two table rows,
one seed, 2 GRPO steps from it), resumability, and tools/plot_runs.py's report; plus the driver's --init-from,
--train-iters 0 and --log-underflow-interval additions it relies on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_fp4.rl.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "mini_table", "run_mini_table.py")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(*argv, check=True):
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def test_new_driver_arguments_validate(tmp_path):
    assert parse_args(["--train-iters", "0"]).train_iters == 0
    assert parse_args(["--log-underflow-interval", "5"]).log_underflow_interval == 5
    with pytest.raises(ValueError, match="--init-from"):
        parse_args(["--init-from", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="--log-underflow-interval=-1"):
        parse_args(["--log-underflow-interval", "-1"])


def test_mini_table_tiny_runs_resumes_and_reports(tmp_path):
    out, md = tmp_path / "runs", tmp_path / "report" / "mini_table.md"
    argv = [SCRIPT, "--tiny", "--out", str(out), "--only", "fp4_fp4,bf16_fp4", "--formats", "hif4",
            "--seeds", "3", "--grpo-steps", "2"]
    p = _run(*argv)
    assert "2/2 runs done" in p.stdout, p.stdout

    # the warm start is a BF16 warm-up only (--train-iters 0); every row starts from its weights
    warm = json.loads((out / "seed3" / "warm" / "results.json").read_text())
    assert "--train-iters 0" in warm["command"] and "--fp4-block-format none" in warm["command"]
    for row, flag in (("fp4_fp4", "--fp4-block-format hif4"), ("bf16_fp4", "--no-fp4-train")):
        d = out / "seed3" / "hif4" / row
        rec = json.loads((d / "results.json").read_text())
        assert rec["steps"] == 2 and rec["row"] == row and flag in rec["command"] and "--init-from" in rec["command"]
        assert "model weights from" in (d / "stdout.log").read_text()
        assert "[warmup]" not in (d / "stdout.log").read_text()
        rows = [json.loads(line) for line in (d / "train.jsonl").read_text().splitlines()]
        kinds = [r["kind"] for r in rows]
        assert kinds.count("train") == 2 and "eval" in kinds
        under = [r for r in rows if r["kind"] == "underflow"]
        assert [r["step"] for r in under] == [0, 1, 2]  # --log-underflow-interval 1 (tiny preset)
        rates = {k: v for k, v in under[-1].items() if k.endswith(("/fp4", "/resq"))}
        assert any(k.endswith("linear_fc2/fp4") for k in rates) and all(0 <= v <= 1 for v in rates.values())
        # the same warm start: both rows measure the same warm-start accuracy in the same (W4A4) precision
        assert rec["warm_start"]["accuracy_bf16"] == warm["warm_start"]["accuracy"]

    # resumable: a second call finds every result and runs nothing
    p = _run(*argv)
    assert "0s this call" in p.stdout or "2/2 runs done" in p.stdout
    assert "warm-up" not in p.stdout and " ..." not in p.stdout

    notes = tmp_path / "notes.md"
    notes.write_text("## How these runs were made\n\nwith care\n")
    p = _run(os.path.join(ROOT, "tools", "plot_runs.py"), "--runs", str(out), "--out", str(md), "--notes", str(notes))
    text = md.read_text()
    header = text.split("| training")[0]
    assert "python tools/plot_runs.py --runs" in header  # the command above the table
    assert "## How these runs were made\n\nwith care" in header and "\npython pretrain_rl.py --num-layers" in header
    assert "| FP4 | FP4 | " in text and "| BF16 | FP4 | " in text and "Agreement with the paper" in text
    assert "(b) BF16 training + FP4 rollout is worse than full FP4" in text
    for png in ("mini_table_rewards.png", "mini_table_underflow.png"):
        assert (md.parent / png).stat().st_size > 1000
        assert f"]({png})" in text


def test_multi_gpu_seed_script_runs_every_shard(tmp_path):
    """run_seeds_multi_gpu.sh (the H200 recipe) on CPU: two seeds over two "GPUs", each seed's warm start made once
    by its shard 0 before the other shard starts; every run of both seeds finishes."""
    out = tmp_path / "mt"
    env = {**_env(), "PYTHON": sys.executable, "JOBS": "1",
           "MINI_TABLE_FLAGS": "--tiny --only bf16_bf16,fp4_fp4 --formats hif4 --grpo-steps 1"}
    p = subprocess.run(["bash", os.path.join(ROOT, "examples", "mini_table", "run_seeds_multi_gpu.sh"), "1 2", "2",
                        str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for seed in (1, 2):
        assert (out / f"seed{seed}" / "warm" / "results.json").is_file()
        assert "warm-up seed" in (out / "logs" / f"seed{seed}.shard0.log").read_text()
        assert "warm-up seed" not in (out / "logs" / f"seed{seed}.shard1.log").read_text()  # reused, not remade
        for run in ("bf16/bf16_bf16", "hif4/fp4_fp4"):
            assert json.loads((out / f"seed{seed}" / run / "results.json").read_text())["grpo_steps"] == 1
