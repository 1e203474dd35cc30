"""Multi-GPU check of FP4 GRPO: the same run on one GPU, at TP=2 and at PP=2; compares losses, reports throughput.

    python examples/multi_gpu/check_parallel.py --out runs/parallel            # on a machine with >= 2 GPUs
    python examples/multi_gpu/check_parallel.py --out /tmp/pc --tiny --cpu     # CPU smoke test (gloo)

Every run starts from the same random model (``--use-cpu-initialization``: full weights drawn on the CPU, then
sharded), warms up on the same batches, then runs the same GRPO schedule in HiF4 training + HiF4 W4A4 rollout with
Rollout-ResQ 2:4. Compared against the single-GPU run: the supervised warm-up NLL at every iteration (fixed data:
differences are fp32 summation order, amplified by training) and the GRPO metrics step by step (rollouts are
sampled, so a last-bit difference can change a sampled token and the runs then drift apart). Throughput: rollout
and training tokens/s (medians over the GRPO steps after the first). Writes one JSON with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Qwen2.5-0.5B's transformer shape (24 x 896, SwiGLU 4864, 14 heads / 2 KV groups), random init; the vocabulary is
# the synthetic task's (no downloads on the GPU machine). About 0.36B parameters.
MODEL = {
    "gpu": ["--num-layers", "24", "--hidden-size", "896", "--ffn-hidden-size", "4864", "--num-attention-heads", "14",
            "--num-query-groups", "2"],
    # shards of 64 / 128 along K: whole HiF4 blocks at TP=2, so TP does not change what is quantized together
    "tiny": ["--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
             "--num-query-groups", "2"],
}
SCHEDULE = {
    "gpu": ["--sft-iters", "20", "--sft-lr", "3e-4", "--sft-batch-size", "64", "--train-iters", "20",
            "--rollout-batch-size", "32", "--group-size", "16", "--micro-batch-size", "64", "--lr", "1e-5",
            "--min-lr", "1e-5", "--eval-samples", "128", "--eval-interval", "20"],
    "tiny": ["--sft-iters", "4", "--sft-batch-size", "16", "--train-iters", "2", "--rollout-batch-size", "4",
             "--group-size", "4", "--micro-batch-size", "8", "--eval-samples", "16", "--eval-interval", "100",
             "--num-synthetic-examples", "400"],
}
COMMON = ["--fp4-block-format", "hif4", "--rollout-precision", "w4a4", "--resq", "2:4", "--use-cpu-initialization",
          "--seed", "1234", "--max-response-length", "8"]
LAYOUTS = {"1gpu": [], "tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"]}
TIMING = ("_per_s", "_s", "_seconds")


def run_layout(name: str, args, flags: list[str]) -> dict:
    out = os.path.join(args.out, name)
    os.makedirs(out, exist_ok=True)
    jsonl, res = os.path.join(out, "train.jsonl"), os.path.join(out, "results.json")
    if args.reuse and os.path.exists(res):
        return load_run(jsonl, res, wall_s=None)
    for path in (jsonl, res):
        if os.path.exists(path):
            os.remove(path)
    preset = "tiny" if args.tiny else "gpu"
    script = [os.path.join(ROOT, "pretrain_rl.py"), *MODEL[preset], *SCHEDULE[preset], *COMMON, *flags,
              "--log-jsonl", jsonl, "--results-json", res, *args.extra]
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if name == "1gpu":
        cmd = [sys.executable, *script]
        if not args.cpu:
            env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script]
    print(f"[parallel] {name}: {' '.join(cmd[1:4])} ...", flush=True)
    t0 = time.monotonic()
    with open(os.path.join(out, "stdout.log"), "w") as log:
        rc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"[parallel] {name} failed (exit {rc}); see {out}/stdout.log")
    result = load_run(jsonl, res, wall_s=time.monotonic() - t0)
    print(f"[parallel] {name}: done in {result['wall_s']:.0f}s", flush=True)
    return result


def load_run(jsonl: str, res: str, wall_s) -> dict:
    with open(res) as f:
        result = json.load(f)
    with open(jsonl) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    result["train"] = [r for r in rows if r["kind"] == "train"]
    result["wall_s"] = wall_s if wall_s is not None else result.get("seconds")
    return result


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(run: dict, ref: dict) -> dict:
    """Largest relative differences to the reference run: warm-up NLL, then GRPO metrics per step."""
    wl, wr = run["warmup_losses"], ref["warmup_losses"]
    out = {"warmup_iters": len(wr), "warmup_nll_max_rel": max((rel(a, b) for a, b in zip(wl, wr)), default=0.0),
           "warmup_nll_first_rel": rel(wl[0], wr[0]) if wr else 0.0, "grpo": []}
    for a, b in zip(run["train"], ref["train"]):
        keys = [k for k in ("loss", "reward_mean", "kl_mean", "entropy_mean", "logp_abs_diff_mean")
                if k in a and k in b]
        out["grpo"].append({"step": a["step"], **{k: rel(a[k], b[k]) for k in keys}})
    return out


def throughput(run: dict) -> dict:
    rows = run["train"][1:] or run["train"]
    return {k: statistics.median(r[k] for r in rows) for k in ("rollout_tokens_per_s", "train_tokens_per_s")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/parallel")
    p.add_argument("--json", default=None, help="summary JSON (default OUT/summary.json)")
    p.add_argument("--tiny", action="store_true", help="a 4 x 128 model and 2 GRPO steps (smoke test)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (gloo), e.g. with --tiny")
    p.add_argument("--layouts", default="1gpu,tp2,pp2", help=f"comma-separated of {','.join(LAYOUTS)}")
    p.add_argument("--reuse", action="store_true", help="keep layouts that already have results under --out")
    p.add_argument("extra", nargs="*", help="after --: extra pretrain_rl.py flags for every run")
    args = p.parse_args()
    names = args.layouts.split(",")
    bad = [n for n in names if n not in LAYOUTS]
    if bad or "1gpu" not in names:
        raise SystemExit(f"--layouts={args.layouts!r} is not valid: use names from {', '.join(LAYOUTS)}, "
                         f"including 1gpu (the reference)")
    names = ["1gpu"] + [n for n in names if n != "1gpu"]
    results = {}
    for n in names:  # the summary is rewritten after every layout: a run cut short keeps what finished
        results[n] = run_layout(n, args, LAYOUTS[n])
        write_summary(args, results)


def write_summary(args, results: dict) -> None:
    ref = results["1gpu"]
    summary = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "layouts": {}}
    lines = [f"{'layout':8s} {'NLL it.1 rel':>13s} {'NLL max rel':>12s} {'GRPO step-1 loss rel':>21s} {'steps':>6s} "
             f"{'rollout tok/s':>14s} {'train tok/s':>12s} {'wall s':>7s}"]
    for n, r in results.items():
        cmp = compare(r, ref)
        tp = throughput(r)
        step1 = cmp["grpo"][0].get("loss", float("nan")) if cmp["grpo"] else float("nan")
        summary["layouts"][n] = {"compare_to_1gpu": cmp, "throughput": tp, "wall_s": r["wall_s"],
                                 "steps": len(r["train"]), "final": r["final"], "warm_start": r["warm_start"],
                                 "setup": r["setup"]}
        lines.append(f"{n:8s} {cmp['warmup_nll_first_rel']:13.2e} {cmp['warmup_nll_max_rel']:12.2e} {step1:21.2e} "
                     f"{len(r['train']):6d} {tp['rollout_tokens_per_s']:14.0f} {tp['train_tokens_per_s']:12.0f} "
                     f"{r['wall_s'] or 0:7.0f}")
    print("\n" + "\n".join(lines), flush=True)
    path = args.json or os.path.join(args.out, "summary.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"[parallel] wrote {path}", flush=True)


if __name__ == "__main__":
    main()
