"""GRPO step benchmark: the wall time of whole ``pretrain_rl.py`` steps (rollout, update, weight sync) per rollout
backend and precision, on a Qwen2.5-shaped random model; one table, JSON under benchmarks/results/.

    PYTHONPATH=. python3 benchmarks/bench_rl_step.py --shape qwen2.5-1.5b \\
        --runs native-megatron:bf16,native:bf16,sglang:bf16,sglang:w4a4+resq \\
        --prompts 64 --group-size 8 --prompt-len 128 --new-tokens 256 --steps 3 \\
        --out benchmarks/results/rl_step_h200.json

Each run is one ``pretrain_rl.py`` process with the same command except ``--rollout-backend`` and the rollout
precision (``--extra`` adds flags to every run): a random model of the shape (``--init random``, bf16 on CUDA),
a WordLevel tokenizer of the shape's vocabulary written to --work-dir, and prompts of exactly --prompt-len random
tokens (no stop token is likely, so responses run to --new-tokens). The rows are the medians over the steps after
the first (warm-up: kernel autotuning, graph capture) of the driver's own ``step_s``, ``rollout_s``, ``train_s``
and ``rollout/weight_sync_total_s``, plus the speed-up of every run's step against the first run's; on a GPU the
largest ``mem/*`` of the steps (device-wide use, an SGLang Engine included, and the trainer's own); and every step's
train-rollout mismatch ``logp_abs_diff_mean`` (printed side by side when there are several runs). For the
mismatch of the two backends on the same run, compare one precision over many steps:

    python3 benchmarks/bench_rl_step.py --shape qwen2.5-1.5b --runs native:w4a4+resq,sglang:w4a4+resq --steps 20 \\
        --out benchmarks/results/rl_mismatch_h200.json

Run names: ``BACKEND:PRECISION`` with BACKEND one of native (the native engine's default decode path: CUDA graphs
on a GPU), native-megatron (its megatron-core path) or sglang, and PRECISION one of bf16, w4a16, w4a4, w4a4+resq
(HiF4 by default; ``--format mxfp4``; ResQ 2:4 in its bf16-sum form). FP4 training stays as --fp4-train says (off by default here:
the comparison is about rollout).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rollout import SHAPES  # noqa: E402

PRECISION_FLAGS = {
    "bf16": ["--rollout-precision", "bf16", "--resq", "none"],
    "w4a16": ["--rollout-precision", "w4a16", "--resq", "none"],
    "w4a4": ["--rollout-precision", "w4a4", "--resq", "none"],
    "w4a4+resq": ["--rollout-precision", "w4a4", "--resq", "2:4", "--resq-combine", "bf16"],
}
#: run backends -> driver flags: the native engine on its default decode path (CUDA graphs on a GPU), the same engine
#: on megatron-core's forward (the rollout every GRPO step used before the graph path: the "today's native" of
#: issue 19's 5x target), and SGLang
BACKENDS = {"native": ["--rollout-backend", "native"],
            "native-megatron": ["--rollout-backend", "native", "--rollout-decode", "megatron"],
            "sglang": ["--rollout-backend", "sglang"]}


def parse_runs(text: str) -> list[tuple[str, str]]:
    runs = []
    for item in text.split(","):
        backend, _, precision = item.partition(":")
        if backend not in BACKENDS or precision not in PRECISION_FLAGS:
            raise SystemExit(f"bench_rl_step.py: error: --runs item {item!r}: want BACKEND:PRECISION with BACKEND in "
                             f"{', '.join(BACKENDS)} and PRECISION in {', '.join(PRECISION_FLAGS)}")
        runs.append((backend, precision))
    return runs


def write_inputs(work_dir: str, vocab_size: int, prompts: int, prompt_len: int, seed: int) -> tuple[str, str]:
    """A WordLevel tokenizer of ``vocab_size`` tokens (t0 ... t{V-1}, plus pad/unk/eos) and a JSONL of prompts of
    exactly ``prompt_len`` tokens; returns (tokenizer folder, data file)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok_dir, data = os.path.join(work_dir, "tokenizer"), os.path.join(work_dir, "prompts.jsonl")
    specials = ["<pad>", "<unk>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"t{i}": i + len(specials) for i in range(vocab_size - len(specials))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(tok_dir)
    rng = random.Random(seed)
    with open(data, "w") as f:
        for _ in range(max(prompts * 4, 64)):
            words = " ".join(f"t{rng.randrange(vocab_size - len(specials))}" for _ in range(prompt_len))
            f.write(json.dumps({"input": words, "label": "0"}) + "\n")
    return tok_dir, data


def run_one(args, backend: str, precision: str, tok_dir: str, data: str, shape: dict) -> dict:
    log = os.path.join(args.work_dir, f"{backend}_{precision}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_rl.py"), "--init", "random", "--tokenizer-model", tok_dir,
           "--prompt-data", data, "--rm-type", "math_rule",
           "--num-layers", str(shape["num_layers"]), "--hidden-size", str(shape["hidden_size"]),
           "--ffn-hidden-size", str(shape["ffn_hidden_size"]),
           "--num-attention-heads", str(shape["num_attention_heads"]),
           "--num-query-groups", str(shape["num_query_groups"]),
           "--rollout-batch-size", str(args.prompts), "--group-size", str(args.group_size),
           "--max-prompt-length", str(args.prompt_len), "--max-response-length", str(args.new_tokens),
           "--micro-batch-size", str(args.micro_batch_size), "--train-iters", str(args.steps),
           "--sft-iters", "0", "--no-overlong-filter", "--fp4-block-format", args.format, "--log-jsonl", log,
           *BACKENDS[backend], *PRECISION_FLAGS[precision],
           *(["--bf16"] if args.bf16 else []), *([] if args.fp4_train else ["--no-fp4-train"]), *args.extra]
    t0 = time.monotonic()
    path = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")  # keeps SGLang's and megatron's folders
    error, out_log = None, log[:-len(".jsonl")] + ".log"  # the driver's stdout and stderr, kept in --work-dir
    with open(out_log, "w") as out:
        try:
            code = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=args.run_timeout or None).returncode
            if code:
                with open(out_log) as f:
                    error = f"exit {code}: {f.read()[-3000:]}"
        except subprocess.TimeoutExpired:  # the steps it finished still count
            error = f"stopped after --run-timeout {args.run_timeout} s (its output: {out_log})"
    rows = [json.loads(line) for line in open(log) if '"kind": "train"' in line] if os.path.exists(log) else []
    if not rows:
        return {"backend": backend, "precision": precision, "format": args.format, "steps": 0,
                "wall_s": time.monotonic() - t0, "error": error or "no step logged"}
    timed = rows[1:] or rows  # the first step pays autotuning and graph capture
    med = {k: statistics.median(float(row.get(k, 0.0)) for row in timed)
           for k in ("step_s", "rollout_s", "train_s", "rollout/weight_sync_total_s", "rollout_tokens_per_s",
                     "logp_abs_diff_mean")}
    mem = {k: max(row[k] for row in rows) for k in ("mem/device_used_gib", "mem/reserved_gib",
                                                     "mem/peak_allocated_gib") if all(k in row for row in rows)}
    return {"backend": backend, "precision": precision, "format": args.format, "steps": len(rows),
            "timed_steps": len(timed), "wall_s": time.monotonic() - t0, **med, **mem,
            "logp_abs_diff_mean_per_step": [row.get("logp_abs_diff_mean") for row in rows],
            **({"error": error} if error else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--runs", default="native:bf16,sglang:bf16,sglang:w4a4+resq", type=parse_runs,
                    help="comma-separated BACKEND:PRECISION runs; the first is the speed-up baseline")
    ap.add_argument("--format", default="hif4", choices=("hif4", "mxfp4"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per run (the first is not timed)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="bf16 parameters (default: on with CUDA)")
    ap.add_argument("--fp4-train", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--run-timeout", type=float, default=0,
                    help="seconds after which a run is stopped, keeping the steps it logged (default 0: none)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags added to every pretrain_rl.py run")
    ap.add_argument("--work-dir", default="/tmp/bench_rl_step",
                    help="the tokenizer, prompts and each run's step log (.jsonl) and output (.log)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "rl_step.json"))
    args = ap.parse_args()
    for name in ("prompts", "group_size", "prompt_len", "new_tokens", "micro_batch_size", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    import torch

    if args.bf16 is None:
        args.bf16 = torch.cuda.is_available()
    os.makedirs(args.work_dir, exist_ok=True)
    shape = SHAPES[args.shape]
    tok_dir, data = write_inputs(args.work_dir, shape["vocab_size"], args.prompts, args.prompt_len, args.seed)
    info = {"shape": args.shape, **shape, "prompts": args.prompts, "group_size": args.group_size,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "steps": args.steps, "bf16": args.bf16,
            "fp4_train": args.fp4_train, "extra": args.extra, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "date": time.strftime("%Y-%m-%d")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows = []
    print(f"{'run':<28} {'step s':>8} {'rollout s':>10} {'train s':>8} {'sync s':>7} {'rollout tok/s':>14} "
          f"{'|dlogp|':>8} {'speed-up':>9} {'GPU used GiB':>13} {'own GiB':>8}", flush=True)
    for backend, precision in args.runs:
        row = run_one(args, backend, precision, tok_dir, data, shape)
        name = backend + ":" + precision
        if "step_s" in row:
            base = next((r for r in rows if "step_s" in r), row)  # the first run that logged a step
            row["speedup"] = base["step_s"] / row["step_s"]
            print(f"{name:<28} {row['step_s']:>8.2f} {row['rollout_s']:>10.2f} "
                  f"{row['train_s']:>8.2f} {row['rollout/weight_sync_total_s']:>7.2f} "
                  f"{row['rollout_tokens_per_s']:>14.0f} {row['logp_abs_diff_mean']:>8.4f} {row['speedup']:>8.2f}x "
                  f"{row.get('mem/device_used_gib', float('nan')):>13.1f} "
                  f"{row.get('mem/reserved_gib', float('nan')):>8.1f}", flush=True)
        if "error" in row:
            print(f"{name:<28} {'failed' if 'step_s' not in row else 'incomplete'}: {row['error']}", flush=True)
        rows.append(row)
        with open(args.out, "w") as f:  # after every run: a later run's crash or a call's time limit loses nothing
            json.dump({"info": info, "rows": rows}, f, indent=1)
    done = [r for r in rows if "step_s" in r]
    if len(done) > 1:  # the train-rollout mismatch of every run, step by step
        print("\n|dlogp| per step: " + " | ".join(f"{r['backend']}:{r['precision']}" for r in done))
        for i, vals in enumerate(zip(*(r["logp_abs_diff_mean_per_step"] for r in done)), 1):
            print(f"step {i:>3}: " + " | ".join("-" if v is None else f"{v:.4f}" for v in vals))
    print(f"wrote {args.out}")
    if any("step_s" not in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
