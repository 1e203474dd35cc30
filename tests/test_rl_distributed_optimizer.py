"""--use-distributed-optimizer (megatron-core's ZeRO-1 DistributedOptimizer) in the GRPO driver on CPU: gloo runs
its reduce-scatter and all-gather, so two data-parallel ranks train exactly as without it, and its checkpoints
(the optimizer state gathered whole by parameter name) resume with it on, with it off, and at another
data-parallel size."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from megatron_fp4.rl.arguments import parse_args
from megatron_fp4.rl.checkpoint import TRACKER_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a random high-precision model (no warm-up) and a group reward (each sample's rank in its group): non-zero
# advantages from the first step, so every step's update depends on the Adam state; no gradient clipping, so the
# gradient norm (summed in another order by the distributed optimizer) does not feed back into the weights
TINY = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--num-synthetic-examples", "600", "--eval-samples", "32",
        "--rollout-batch-size", "4", "--group-size", "4", "--micro-batch-size", "16", "--sft-iters", "0",
        "--init", "random", "--max-response-length", "4", "--eval-interval", "100", "--seed", "7",
        "--custom-rm-path", "custom_rewards.rank_in_group", "--group-rm", "--clip-grad", "0", "--fp4-format", "none",
        "--train-iters", "4", "--save-interval", "2"]
TIMING_KEYS = ("_per_s", "_s", "_seconds")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))


def _run(tmp_path, name, launcher, *extra):
    """pretrain_rl.py with TINY + ``extra``, checkpoints in tmp_path/name; returns (stdout, train rows by step)."""
    log = tmp_path / f"{name}.jsonl"
    r = subprocess.run([*launcher, os.path.join(ROOT, "pretrain_rl.py"), *TINY, *extra, "--save", str(tmp_path / name),
                        "--log-jsonl", str(log)], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    return r.stdout, {row["step"]: {k: v for k, v in row.items() if not k.endswith(TIMING_KEYS)
                                    and "weight_sync" not in k} for row in rows if row["kind"] == "train"}


def _step_two(tmp_path, run, name, step=2):
    """A directory holding only ``run``'s step-2 (or ``step``) checkpoint (what a resume then starts from)."""
    shutil.copytree(tmp_path / run / f"iter_{step:07d}", tmp_path / name / f"iter_{step:07d}")
    (tmp_path / name / TRACKER_FILE).write_text(f"{step}\n")
    return str(tmp_path / name)


def _same_metrics(a: dict, b: dict) -> None:
    """Equal train metrics; the gradient norm within fp32 rounding (the distributed optimizer sums the squares of
    its shards, then over the ranks: another order)."""
    assert a.keys() == b.keys()
    for step in a:
        x, y = dict(a[step]), dict(b[step])
        assert math.isclose(x.pop("grad_norm"), y.pop("grad_norm"), rel_tol=1e-6), step
        assert x == y, step


def _rank_states(ckpt_dir, step=4):
    import torch

    it = ckpt_dir / f"iter_{step:07d}"
    return [torch.load(p, map_location="cpu", weights_only=False) for p in sorted(it.glob("rank_*.pt"))]


def _same_state(a_dir, b_dir, main: int = 0) -> None:
    """Bit-identical weights and optimizer state by name (every kind, every parameter) in every rank file; ``main``:
    how many parameters have fp32 main copies (the bf16 ones under --bf16)."""
    import torch

    a_ranks, b_ranks = _rank_states(a_dir), _rank_states(b_dir)
    assert len(a_ranks) == len(b_ranks) > 0
    for a, b in zip(a_ranks, b_ranks):
        oa, ob = a["optimizer_named"], b["optimizer_named"]
        assert set(oa) == set(ob) == {"exp_avg", "exp_avg_sq", "step"} | ({"main"} if main else set())
        for kind in oa:
            assert list(oa[kind]) == list(ob[kind]) == [n for n, _ in a["model"].items() if n in oa[kind]], kind
            assert len(oa[kind]) == (main if kind == "main" else 15)  # 15: every parameter of the 2-layer model
            assert all(torch.equal(oa[kind][n], ob[kind][n]) for n in oa[kind]), kind
            if kind == "main":
                assert all(oa[kind][n].dtype == torch.float32 and a["model"][n].dtype == torch.bfloat16
                           for n in oa[kind])
        assert all(torch.equal(a["model"][n], b["model"][n]) for n in a["model"]
                   if isinstance(a["model"][n], torch.Tensor))


def test_flag_defaults_off():
    assert parse_args([]).use_distributed_optimizer is False
    assert parse_args(["--use-distributed-optimizer"]).use_distributed_optimizer is True


@pytest.mark.slow
def test_distributed_optimizer_trains_and_resumes_like_the_replicated_one(tmp_path):
    """DP=2 (two gloo processes), 4 GRPO steps, a checkpoint every 2:
    (a) with --use-distributed-optimizer the losses and metrics equal the replicated optimizer's, and the step-4
        checkpoints hold bit-identical weights and optimizer state by name (the shards gathered whole);
    (b) its step-2 checkpoint resumed with it continues exactly like the uninterrupted run (metrics, step-4
        weights and Adam state);
    (c) the same checkpoint resumed without it, and the replicated run's step-2 checkpoint resumed with it, too;
    (d) at another data-parallel size (one process, resharded), it resumes with and without it alike.
    Adam's moments decide the step-3 and step-4 updates: a resume that lost them would differ in step 4's loss."""
    out, plain = _run(tmp_path, "plain", TORCHRUN)
    assert "distributed optimizer" not in out
    out, dist = _run(tmp_path, "dist", TORCHRUN, "--use-distributed-optimizer")
    assert "world 2 (TP 1) | distributed optimizer" in out
    assert sorted(dist) == [1, 2, 3, 4] and any(row["loss"] != 0 for row in dist.values())
    _same_metrics(plain, dist)  # (a)
    _same_state(tmp_path / "plain", tmp_path / "dist")

    resumes = [("dist_on", "dist", ["--use-distributed-optimizer"]),  # (b)
               ("dist_off", "dist", []),  # (c)
               ("plain_on", "plain", ["--use-distributed-optimizer"])]
    for name, source, extra in resumes:
        out, rows = _run(tmp_path, name, TORCHRUN, "--load", _step_two(tmp_path, source, f"{name}_from"), *extra)
        assert "(step 2)" in out and "resharded" not in out, name
        assert sorted(rows) == [3, 4], name
        _same_metrics({s: dist[s] for s in (3, 4)}, rows)
        _same_state(tmp_path / "dist", tmp_path / name)

    # (d) one process: the rollouts differ from DP=2's, so the two resumes are compared with each other
    one = {}
    for name, extra in (("one_on", ["--use-distributed-optimizer"]), ("one_off", [])):
        out, one[name] = _run(tmp_path, name, [sys.executable], "--load", _step_two(tmp_path, "dist", f"{name}_from"),
                              *extra)
        assert "(step 2, resharded from TP=1, PP=1, DP=2 to TP=1, PP=1, DP=1)" in out, name
        assert sorted(one[name]) == [3, 4], name
    _same_metrics(one["one_on"], one["one_off"])
    _same_state(tmp_path / "one_on", tmp_path / "one_off")


@pytest.mark.slow
def test_distributed_optimizer_with_bf16_weights_shards_and_restores_the_fp32_main_copies(tmp_path):
    """--bf16 (every parameter bf16, norms included): the distributed optimizer then keeps each rank's range of the
    fp32 main copies itself. DP=2 trains exactly as the replicated mixed-precision optimizer and saves the same
    whole main copies and Adam state by name; its step-0 checkpoint (saved before the first step: main copies
    only, no Adam state yet) and its step-2 checkpoint both resume into the uninterrupted run's metrics and step-4
    state."""
    bf16 = ["--bf16", "--keep-last", "3"]
    _, plain = _run(tmp_path, "plain", TORCHRUN, *bf16)
    _, dist = _run(tmp_path, "dist", TORCHRUN, *bf16, "--use-distributed-optimizer")
    assert sorted(dist) == [1, 2, 3, 4]
    _same_metrics(plain, dist)
    _same_state(tmp_path / "plain", tmp_path / "dist", main=15)
    for step in (0, 2):
        name = f"from_{step}"
        out, rows = _run(tmp_path, name, TORCHRUN, *bf16, "--use-distributed-optimizer",
                         "--load", _step_two(tmp_path, "dist", f"{name}_src", step))
        assert f"(step {step})" in out
        assert sorted(rows) == list(range(step + 1, 5))
        _same_metrics({s: dist[s] for s in rows}, rows)
        _same_state(tmp_path / "dist", tmp_path / name, main=15)


def test_checkpoint_without_named_optimizer_state_is_refused_with_the_flag(tmp_path):
    """A checkpoint of a version that stored the optimizer's own (positional, replicated) state dict cannot feed the
    distributed optimizer: a one-line error saying to resume without the flag, not a traceback."""
    from rl_helpers import rewrite_as_older_version

    _run(tmp_path, "old", [sys.executable], "--train-iters", "0")
    # where older versions kept the optimizer
    rewrite_as_older_version(tmp_path / "old", lambda s: s.update(optimizer=s.pop("optimizer_named")))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *TINY, "--train-iters", "1",
                        "--save", str(tmp_path / "old"), "--use-distributed-optimizer"],
                       env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1
    assert "with --use-distributed-optimizer: it was saved by a version that did not store the optimizer" in r.stderr
    assert "Resume it without --use-distributed-optimizer" in r.stderr and "Traceback" not in r.stderr
