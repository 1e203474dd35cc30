"""pretrain_rl.py end to end on CPU: argument validation, a tiny FP4 GRPO run, TP=2 under torchrun, PP=2 under
torchrun against the single-process run, and a kill -9 during training followed by a resume whose next steps equal
an uninterrupted run's."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megatron_fp4.rl.arguments import parse_args
from megatron_fp4.rl.checkpoint import TRACKER_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--num-synthetic-examples", "600", "--eval-samples", "32",
        "--rollout-batch-size", "4", "--group-size", "4", "--micro-batch-size", "16", "--sft-iters", "3",
        "--sft-batch-size", "16", "--max-response-length", "4", "--eval-interval", "100", "--seed", "7"]
TIMING_KEYS = ("_per_s", "_s", "_seconds")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _one_thread_per_process(tmp_path):
    """A launcher script for pretrain_rl.py that gives every process one torch thread (exact comparisons across
    process counts: CPU matmuls round differently with another thread count)."""
    wrapper = tmp_path / "one_thread_per_process.py"
    wrapper.write_text(
        "import os, runpy, sys\n"
        "os.cpu_count = lambda: int(os.environ.get('LOCAL_WORLD_SIZE', '1'))  # one torch thread per process\n"
        f"sys.argv = [{os.path.join(ROOT, 'pretrain_rl.py')!r}] + sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    return wrapper


def _saved_step(ckpt) -> int:
    """The step of the newest checkpoint the tracker names (what a resume loads), -1 before the first: a save
    renames its iteration directory into place first and updates the tracker after, so a kill in between resumes
    from the previous checkpoint."""
    try:
        return int((ckpt / TRACKER_FILE).read_text())
    except (OSError, ValueError):
        return -1


def _deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.endswith(TIMING_KEYS) and "weight_sync" not in k}


def test_flag_choices_are_the_library_constants():
    """Every choice flag offers exactly the library's own tuple (one definition per knob)."""
    from megatron_fp4.recipe import RECIPES
    from megatron_fp4.resq import RESQ_COMBINES, ROLLOUT_MODES, SPARSITIES
    from megatron_fp4.rl.arguments import build_parser

    choices = {a.dest: a.metavar for a in build_parser()._actions}
    assert choices["resq"] == "{" + ",".join(SPARSITIES) + "}"
    assert choices["resq_combine"] == "{" + ",".join(RESQ_COMBINES) + "}"
    assert choices["rollout_precision"] == "{" + ",".join(ROLLOUT_MODES) + "}"
    assert choices["fp4_block_format"] == "{" + ",".join([*RECIPES, "none"]) + "}"


@pytest.mark.parametrize("argv,match", [
    (["--fp4-format", "fp8"], "--fp4-block-format='fp8' is not valid"),  # the old spelling, an alias
    (["--resq", "3:4"], "resq"),
    (["--group-size", "1"], "--group-size=1"),
    (["--top-p", "1.5"], "--top-p=1.5"),
    (["--lr", "0"], "--lr=0"),
    (["--dataset", "gsm8k:/no/such/file.jsonl"], "no such file"),
    (["--dataset", "synthetic:sub"], "synthetic tasks: add, arith"),
    (["--rollout-precision", "w4a16", "--resq", "2:4"], "--resq='2:4' needs FP4 rollout activations"),
    (["--resq-combine", "fp16"], "resq-combine"),
    (["--resq", "none", "--resq-combine", "bf16"], "--resq-combine='bf16' needs a ResQ residual"),
    (["--num-attention-heads", "4", "--num-query-groups", "3"], "num-query-groups"),
    (["--seq-length", "4"], "--seq-length=4"),
])
def test_bad_arguments_name_the_argument(argv, match, capsys):
    with pytest.raises((ValueError, SystemExit)) as e:
        parse_args(argv)
    text = str(e.value) + capsys.readouterr().err
    assert match in text


def test_tensor_parallel_constraints():
    with pytest.raises(ValueError, match="--tensor-model-parallel-size=2 must divide"):
        parse_args(["--tensor-model-parallel-size", "2", "--num-query-groups", "1"], world_size=2)
    with pytest.raises(ValueError, match="world size 3 is not divisible"):
        parse_args(["--tensor-model-parallel-size", "2"], world_size=3)
    with pytest.raises(ValueError, match="--rollout-batch-size=3 must be a multiple"):
        parse_args(["--rollout-batch-size", "3"], world_size=2)
    with pytest.raises(ValueError, match="--global-batch-size=6 must be a multiple"):
        parse_args(["--rollout-batch-size", "8", "--group-size", "3", "--global-batch-size", "6"], world_size=4)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the message of a machine without CUDA")
def test_sglang_rollout_backend_fails_at_once_without_cuda(tmp_path):
    """``--rollout-backend sglang`` on a CPU: a one-line error naming the flag and why (SGLang's Engine needs CUDA
    and sgl-kernel), at argument parsing, before any model or data is built."""
    need = "--rollout-backend sglang cannot run here: SGLang's Engine needs a CUDA GPU"
    with pytest.raises(ValueError, match=re.escape(need)):
        parse_args(["--rollout-backend", "sglang"])
    r = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), "--rollout-backend", "sglang",
                        "--save", str(tmp_path / "ckpt")], env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout[-2000:])
    assert r.stderr.strip().splitlines()[-1].startswith(f"pretrain_rl.py: error: {need}"), r.stderr[-2000:]
    assert "use --rollout-backend native" in r.stderr and not (tmp_path / "ckpt").exists()


def test_sglang_start_problem_names_what_is_missing(monkeypatch):
    """Where CUDA is there, the check names the next missing piece: SGLang, sgl-kernel, the plug-in's entry point
    (needed only for FP4 rollout)."""
    import importlib.metadata
    import importlib.util

    import torch

    from megatron_fp4.rollout.sglang_engine import sglang_start_problem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    missing = set()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in missing else (real_find_spec(name, *a) or object()))
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])
    missing.add("sglang")
    assert "SGLang is not installed" in sglang_start_problem()
    missing.clear()
    missing.add("sgl_kernel")
    assert "sgl-kernel (SGLang's CUDA ops) is not installed" in sglang_start_problem()
    missing.clear()
    assert "'sglang.srt.plugins' entry point is not installed" in sglang_start_problem(needs_plugin=True)
    assert sglang_start_problem(needs_plugin=False) is None  # a BF16 rollout needs no plug-in
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "needs a CUDA GPU" in sglang_start_problem(needs_plugin=False)


def test_yaml_config_is_overridden_by_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("group-size: 4\nlr: 0.01\nresq: dense\n")
    args = parse_args(["--config", str(cfg), "--lr", "0.02"])
    assert (args.group_size, args.lr, args.resq) == (4, 0.02, "dense")
    cfg.write_text("no_such_flag: 1\n")
    with pytest.raises(ValueError, match="unknown argument"):
        parse_args(["--config", str(cfg)])


def test_print_config_round_trips_through_config(tmp_path):
    """--print-config writes every knob (value and help) as YAML that --config reads back to the same arguments."""
    from megatron_fp4.rl.arguments import config_yaml, load_args

    text = config_yaml(load_args(["--group-size", "4", "--resq", "dense", "--no-overlong-filter"]))
    assert "# responses sampled per prompt (G)\ngroup-size: 4\n" in text and "resq: dense" in text
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    want = vars(parse_args(["--group-size", "4", "--resq", "dense", "--no-overlong-filter"]))
    assert vars(parse_args(["--config", str(cfg)])) == {**want, "config": str(cfg)}
    r = _run(["--print-config", "--lr", "0.01"])
    assert r.returncode == 0 and "\nlr: 0.01\n" in r.stdout and r.stderr == ""


def _run(args, **kw):
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *args], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=600, **kw)


@pytest.mark.slow
def test_kill_and_resume_continues_exactly(tmp_path):
    common = TINY + ["--train-iters", "6", "--save-interval", "2"]
    # uninterrupted reference run
    ref_log = tmp_path / "ref.jsonl"
    r = _run(common + ["--save", str(tmp_path / "ref_ckpt"), "--log-jsonl", str(ref_log)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[result] held-out accuracy" in r.stdout
    ref = {row["step"]: _deterministic(row) for row in _read_jsonl(ref_log) if row["kind"] == "train"}
    assert sorted(ref) == [1, 2, 3, 4, 5, 6]

    # same command, killed with SIGKILL once the step-2 checkpoint exists
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *common, "--save", str(ckpt), "--load", str(ckpt),
           "--log-jsonl", str(log)]
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while _saved_step(ckpt) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(row["step"] for row in _read_jsonl(log) if row["kind"] == "train")
    assert killed_at < 6, "the run finished before it could be killed"

    r = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    resume_step = int(re.search(r"resumed from .* \(step (\d+)\)", r.stdout).group(1))
    assert 2 <= resume_step <= killed_at
    resumed = [row for row in _read_jsonl(log) if row["kind"] == "train"][-(6 - resume_step):]
    assert [row["step"] for row in resumed] == list(range(resume_step + 1, 7))
    for row in resumed:
        assert _deterministic(row) == ref[row["step"]], row["step"]


def test_nonfinite_loss_skips_updates_then_stops_naming_step_and_checkpoint(tmp_path):
    # a GRPO loss that turns NaN (patched in, in the child process) makes every gradient non-finite: each update
    # is skipped and logged, and the third in a row stops the run naming the step and the last good checkpoint
    argv = TINY + ["--train-iters", "8", "--save", str(tmp_path / "c"), "--save-interval", "100",
                   "--max-nonfinite-steps", "3"]
    code = ("import sys, megatron_fp4.rl.grpo as g; orig = g.grpo_token_loss; "
            "g.grpo_token_loss = lambda *a, **k: orig(*a, **k) * float('nan'); "
            f"sys.argv = ['pretrain_rl.py'] + {argv!r}; import runpy; runpy.run_path('pretrain_rl.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 1
    assert ("pretrain_rl.py: error: stopping at step 3: 3 consecutive steps with a non-finite loss or gradient"
            in r.stderr)
    assert "last good checkpoint: " + str(tmp_path / "c" / "iter_0000000") in r.stderr
    assert r.stderr.count("skipping the update") == 3
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_tensor_parallel_two_ranks_runs_three_steps(tmp_path):
    log = tmp_path / "tp2.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "pretrain_rl.py"), *TINY, "--tensor-model-parallel-size", "2", "--train-iters", "3",
           "--log-jsonl", str(log)]
    r = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(TP 2)" in r.stdout and "[result] held-out accuracy" in r.stdout
    # TINY's hidden size 64 splits into 32-wide shards: half a HiF4 unit, so TP changes what is quantized together
    assert "hidden size 64 / TP 2 is not a multiple of the hif4 block (64)" in r.stdout
    assert "ffn hidden size" not in r.stdout  # 128 / 2 = 64: whole units
    rows = [row for row in _read_jsonl(log) if row["kind"] == "train"]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(math.isfinite(row["loss"]) for row in rows)


def test_save_debug_rollout_data_gathers_data_parallel_ranks(tmp_path):
    """DP=2: rank 0 writes every rank's samples, the batch's groups and each held-out prompt once, in order."""
    import torch

    from megatron_fp4.rl.arguments import rl_config
    from megatron_fp4.rl.setup import load_examples

    argv = [*TINY, "--sft-iters", "0", "--train-iters", "1", "--fp4-block-format", "none",
            "--save-debug-rollout-data", str(tmp_path / "debug" / "{rollout_id}.pt")]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(ROOT, "pretrain_rl.py"), *argv], env=_env(), cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    train = torch.load(tmp_path / "debug" / "0.pt", weights_only=True)["samples"]
    assert [s["group_index"] for s in train] == [g for g in range(4) for _ in range(4)]  # 2 groups per rank
    assert len({s["prompt"] for s in train}) == 4
    _, held_out, _ = load_examples(rl_config(parse_args(argv)))
    for name in ("eval_0", "eval_1"):
        ev = torch.load(tmp_path / "debug" / f"{name}.pt", weights_only=True)
        assert ev["rollout_id"] == name and {s["eval_metric"] for s in ev["samples"]} == {"accuracy"}
        assert [(s["group_index"], s["prompt"], s["label"]) for s in ev["samples"]] == [
            (i, e.prompt, e.reference) for i, e in enumerate(held_out)]


@pytest.mark.slow
def test_pipeline_parallel_two_ranks_equals_single_process(tmp_path):
    """PP=2 under torchrun (policy split in two stages, a full-depth rollout copy on each rank fed by the weight
    gather) logs the same metrics as the single-process run with the same seed: same initial weights (the stages
    take their slices of a full model built like the PP=1 policy), same samples, same updates.

    The comparison is exact for every metric but grad_norm, under two settings that remove the only differences
    in fp32 rounding: (1) one intra-op thread per process in both runs (pretrain_rl.py gives each process
    cores / local world size threads, and the CPU matmuls round differently with a different thread count);
    (2) --clip-grad 0: the gradient norm is the square root of a sum of squares that PP=2 all-reduces stage by
    stage, in another order than PP=1 (it differs in the last bits, ~1e-7 relative); with clipping on, that
    difference reaches the clip coefficient and so the weights, and the 40 warm-up steps at --sft-lr 3e-3 amplify
    it to percent-level metric differences (a PP=1 run whose micro-batch size alone changes diverges as much;
    with the default 3 warm-up steps the PP=2 metrics stay within ~1e-5 relative of PP=1's).
    --micro-batch-size 6 makes ragged micro-batches (16 sequences: 6, 6, 4), which the stages must exchange
    the activation shapes for; --sft-iters 40 gives non-zero rewards (a policy-gradient term besides the KL)."""
    wrapper = _one_thread_per_process(tmp_path)
    common = TINY + ["--num-layers", "4", "--micro-batch-size", "6", "--sft-iters", "40", "--clip-grad", "0",
                     "--train-iters", "3", "--eval-interval", "2"]
    logs = {}
    for pp, launcher in ((1, [sys.executable]),
                         (2, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])):
        logs[pp] = tmp_path / f"pp{pp}.jsonl"
        r = subprocess.run([*launcher, str(wrapper), *common, "--pipeline-model-parallel-size", str(pp),
                            "--log-jsonl", str(logs[pp])], check=False, env=_env(), cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    assert "(TP 1, PP 2)" in r.stdout and "[result] held-out accuracy" in r.stdout
    ref, got = _read_jsonl(logs[1]), _read_jsonl(logs[2])
    assert [(row["step"], row["kind"]) for row in got] == [(row["step"], row["kind"]) for row in ref]
    assert [row["step"] for row in ref if row["kind"] == "train"] == [1, 2, 3]
    assert any(row.get("reward_mean", 0) > 0 for row in ref)
    assert all(row["rollout/weight_sync_gather_s"] >= 0 for row in got if row["kind"] == "train")
    for a, b in zip(ref, got):
        a, b = _deterministic(a), _deterministic(b)
        assert set(a) == set(b)
        assert math.isclose(a.pop("grad_norm", 0.0), b.pop("grad_norm", 0.0), rel_tol=1e-6, abs_tol=1e-12)
        assert a == b


@pytest.mark.slow
def test_grpo_from_converted_hf_checkpoint_on_gsm8k_jsonl(tmp_path):
    """The GSM8K path end to end: a tiny HF Qwen2 + tokenizer converted with tools/, loaded with --load
    (architecture, weights and tokenizer from the checkpoint), GSM8K-format jsonl data, 2 GRPO steps; then the
    same at PP=2 (tied embeddings: the last stage's output layer and the full-depth rollout copy load from it)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from test_tools_helpers import make_hf_model

    hf = tmp_path / "hf"
    make_hf_model("qwen2_tied", hf)  # vocab 96
    words = ["<pad>", "<s>", "<unk>", "</s>"] + [str(i) for i in range(10)] + [
        "Question", ":", "Answer", "Let", "'", "s", "think", "step", "by", ".", "Tom", "has", "apples", "gets",
        "more", "How", "many", "does", "have", "?", "####", "+", "="]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(hf)
    data = tmp_path / "gsm8k.jsonl"
    with open(data, "w") as f:
        for a in range(1, 9):
            f.write(json.dumps({"question": f"Tom has {a} apples . Tom gets 2 more . How many does Tom have ?",
                                "answer": f"{a} + 2 = {a + 2}\n#### {a + 2}"}) + "\n")
    ckpt = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf_to_megatron.py"), "--hf-path",
                        str(hf), "--save", str(ckpt), "--no-progress"], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    argv = ["--load", str(ckpt), "--dataset", f"gsm8k:{data}", "--eval-samples", "2", "--sft-iters", "0",
            "--rollout-batch-size", "2", "--group-size", "2", "--max-prompt-length", "32", "--max-response-length",
            "6", "--train-iters", "2", "--eval-interval", "100"]
    log = tmp_path / "log.jsonl"
    r = _run([*argv, "--log-jsonl", str(log)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"tokenizer {len(words)} tokens, model vocab 96" in r.stdout and "[result] held-out accuracy" in r.stdout
    rows = [row for row in _read_jsonl(log) if row["kind"] == "train"]
    assert [row["step"] for row in rows] == [1, 2]

    log = tmp_path / "pp2.jsonl"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(ROOT, "pretrain_rl.py"), *argv, "--pipeline-model-parallel-size", "2",
                        "--log-jsonl", str(log)], check=False, env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(TP 1, PP 2)" in r.stdout and "[result] held-out accuracy" in r.stdout
    rows = [row for row in _read_jsonl(log) if row["kind"] == "train"]
    assert [row["step"] for row in rows] == [1, 2] and all(math.isfinite(row["loss"]) for row in rows)


def test_warmup_to_target_accuracy_stops_early_and_chunks_change_nothing(tmp_path):
    """--sft-target-accuracy checks held-out accuracy every --sft-eval-interval iterations and stops at the first
    check that reaches it; warming up in chunks trains on the same batches as one uninterrupted warm-up."""
    base = [*TINY, "--train-iters", "1", "--sft-iters", "6"]
    early = _run([*base, "--sft-target-accuracy", "0", "--sft-eval-interval", "2"])
    assert early.returncode == 0, early.stderr[-2000:]
    assert "[warmup] iter 2/6 | held-out accuracy" in early.stdout
    assert "iter 4/6" not in early.stdout

    runs = {}
    for name, extra in (("chunked", ["--sft-target-accuracy", "1", "--sft-eval-interval", "2"]), ("plain", [])):
        log = tmp_path / f"{name}.jsonl"
        r = _run([*base, *extra, "--log-jsonl", str(log)])
        assert r.returncode == 0, r.stderr[-2000:]
        runs[name] = [_deterministic(row) for row in _read_jsonl(log) if row["kind"] == "train"]
    assert runs["chunked"] == runs["plain"] and runs["plain"]


def test_nonfinite_weights_stop_the_run_before_sampling(tmp_path):
    # an optimizer step that leaves an inf weight (patched in) stops at the next weight sync with the step and
    # the last good checkpoint, instead of crashing later inside torch.multinomial
    argv = TINY + ["--train-iters", "4", "--save", str(tmp_path / "c"), "--save-interval", "100"]
    code = ("import sys, torch, megatron_fp4.rl.actor as a; orig = a.Actor.update\n"
            "def update(self, seqs, step, last_checkpoint):\n"
            "    out = orig(self, seqs, step, last_checkpoint)\n"
            "    if step >= 2:\n"
            "        next(self.module.parameters()).data.view(-1)[0] = float('inf')\n"
            "    return out\n"
            "a.Actor.update = update\n"
            f"sys.argv = ['pretrain_rl.py'] + {argv!r}; import runpy; runpy.run_path('pretrain_rl.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "pretrain_rl.py: error: stopping at step 2: the policy's weights are not finite" in r.stderr
    assert "last good checkpoint: " + str(tmp_path / "c" / "iter_0000000") in r.stderr
    assert "Traceback" not in r.stderr


def _full_weights(ckpt_dir, part="model"):
    """{global name: full tensor} of the policy (or another ``part``, e.g. an optimizer state by parameter name)
    in a trainer checkpoint, merging its TP shards and PP stages."""
    from megatron_fp4.models.checkpoint_io import layer_offset, to_global_name
    from megatron_fp4.rl.checkpoint_weights import TrainerCheckpointWeights

    src = TrainerCheckpointWeights(ckpt_dir, part=part)
    names = {to_global_name(k, layer_offset(src.model_args["num_layers"], p, src.pp))
             for p in range(src.pp) for k in src.shard_keys(0, p)}
    return {g: src.full_tensor(g) for g in sorted(names)}


@pytest.mark.slow
def test_init_from_reshards_a_checkpoint_across_tp_and_pp(tmp_path):
    """A warm start saved at TP=2 starts a PP=2 run, whose checkpoint starts a single-process run: the same weights
    at every layout (bit for bit), and resuming at another layout stops with a message saying what to do."""
    import torch

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    common = [*TINY, "--fp4-format", "none", "--train-iters", "0"]
    runs = [("tp2", torchrun, ["--tensor-model-parallel-size", "2"], None),
            ("pp2", torchrun, ["--pipeline-model-parallel-size", "2"], "tp2"),
            ("one", [sys.executable], [], "pp2")]
    for name, launcher, layout, init in runs:
        extra = ["--init-from", str(tmp_path / init)] if init else []
        r = subprocess.run([*launcher, os.path.join(ROOT, "pretrain_rl.py"), *common, *layout, *extra,
                            "--save", str(tmp_path / name)], env=_env(), cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        if init == "tp2":
            assert "resharded from TP=2, PP=1, DP=1 to TP=1, PP=2, DP=1" in r.stdout
    assert "resharded from TP=1, PP=2, DP=1 to TP=1, PP=1, DP=1" in r.stdout
    ref = _full_weights(tmp_path / "tp2")
    assert len(ref) == 3 + 2 * 6  # embedding, final norm, output layer, 2 layers x (2 norms, qkv, proj, fc1, fc2)
    for name in ("pp2", "one"):
        got = _full_weights(tmp_path / name)
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[k], ref[k]) for k in ref), name
    # resuming at another layout reshards; a checkpoint without the optimizer state by name cannot be
    from rl_helpers import rewrite_as_older_version

    rewrite_as_older_version(tmp_path / "tp2", lambda s: s.update(optimizer=s.pop("optimizer_named")))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *common, "--save", str(tmp_path / "tp2")],
                       env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1
    assert "saved with TP=2, PP=1, DP=1 (this run has TP=1, PP=1, DP=1)" in r.stderr
    assert f"--init-from {tmp_path / 'tp2'}" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_resume_at_another_layout_continues_exactly(tmp_path):
    """A run's step-2 checkpoint (one process) resumes under PP=2 and under TP=2 (weights and Adam state
    resharded, data position, step and RNG from rank 0). PP=2 computes exactly what one process does (see
    test_pipeline_parallel_two_ranks_equals_single_process), so its step 3 equals the uninterrupted run's: the
    same metrics and bit-identical weights and Adam moments after the update; TP=2's within fp32 rounding. Wrong
    optimizer state would change the update."""
    import torch

    wrapper = _one_thread_per_process(tmp_path)
    common = TINY + ["--num-layers", "4", "--clip-grad", "0", "--fp4-format", "none"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # the uninterrupted run's step-2 checkpoint, alone in a directory, is what the other layouts resume from
    runs = [("ref", [sys.executable], ["--save-interval", "1"]),
            ("tp2", torchrun, ["--tensor-model-parallel-size", "2", "--load", str(tmp_path / "first")]),
            ("pp2", torchrun, ["--pipeline-model-parallel-size", "2", "--load", str(tmp_path / "first")])]
    layouts = {"tp2": "TP=2, PP=1, DP=1", "pp2": "TP=1, PP=2, DP=1"}
    for name, launcher, extra in runs:
        r = subprocess.run([*launcher, str(wrapper), *common, "--train-iters", "3", *extra,
                            "--save", str(tmp_path / name), "--log-jsonl", str(tmp_path / f"{name}.jsonl")],
                           env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        if name == "ref":
            shutil.copytree(tmp_path / "ref" / "iter_0000002", tmp_path / "first" / "iter_0000002")
            (tmp_path / "first" / TRACKER_FILE).write_text("2\n")
        assert name == "ref" or f"(step 2, resharded from TP=1, PP=1, DP=1 to {layouts[name]})" in r.stdout
    ref = {row["step"]: _deterministic(row) for row in _read_jsonl(tmp_path / "ref.jsonl") if row["kind"] == "train"}
    got = [_deterministic(row) for row in _read_jsonl(tmp_path / "pp2.jsonl") if row["kind"] == "train"]
    assert [row["step"] for row in got] == [3]
    a, b = ref[3], got[0]
    assert math.isclose(a.pop("grad_norm"), b.pop("grad_norm"), rel_tol=1e-6)
    assert a == b
    for part in ("model", ("optimizer_named", "exp_avg"), ("optimizer_named", "exp_avg_sq")):
        want, have = _full_weights(tmp_path / "ref", part), _full_weights(tmp_path / "pp2", part)
        assert len(want) == 3 + 4 * 6 and want.keys() == have.keys(), part
        assert all(torch.equal(want[k], have[k]) for k in want), part
    # TP=2 rounds differently, so its step 3 is compared within fp32 noise: 2e-8 of each tensor's largest value
    # measured; without the resharded Adam state the step-3 update differs by ~1e-2 (the update itself is ~4e-3)
    want, have = _full_weights(tmp_path / "ref"), _full_weights(tmp_path / "tp2")
    assert want.keys() == have.keys()
    assert max(((want[k] - have[k]).abs().max() / want[k].abs().max()).item() for k in want) < 1e-6


def test_load_cases_end_to_end(tmp_path):
    """--load naming nothing: an error before any model is built, or (with starting weights or --init random) a
    run whose first line says where it starts from; a damaged --load: an error naming the file."""
    quick = [*TINY, "--sft-iters", "0", "--train-iters", "0"]
    missing = tmp_path / "missing"
    r = _run([*quick, "--load", str(missing)])
    assert r.returncode == 2 and "Traceback" not in r.stderr and "[setup]" not in r.stdout
    assert r.stderr.strip() == (f"pretrain_rl.py: error: --load {missing} does not exist and no starting weights "
                                f"are named: pass --ref-load CONVERTED_CHECKPOINT, --hf-checkpoint HF_DIR or "
                                f"--init-from RUN_DIR, or --init random for a randomly initialized model")
    r = _run([*quick, "--load", str(missing), "--init", "random", "--save", str(tmp_path / "run")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[0] == (f"[checkpoint] --load {missing} does not exist: starting from a random model "
                                        f"(--init random)")
    r = _run([*quick, "--load", str(tmp_path / "run"), "--init", "random"])  # now it holds one: resumed
    assert r.returncode == 0 and f"resumed from {tmp_path / 'run' / 'iter_0000000'} (step 0)" in r.stdout
    (tmp_path / "run" / "iter_0000000" / "metadata.json").unlink()
    r = _run([*quick, "--load", str(tmp_path / "run")])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"{tmp_path / 'run' / 'iter_0000000'} is incomplete: metadata.json is missing" in r.stderr


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun's workers run in sessions of their own)."""
    rows = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
    children: dict[int, list[int]] = {}
    for row in rows:
        if row.strip():
            child, parent = map(int, row.split())
            children.setdefault(parent, []).append(child)
    doomed, todo = [], [pid]
    while todo:
        doomed.append(todo.pop())
        todo += children.get(doomed[-1], [])
    for p in doomed:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_node_launch_saves_and_resumes_after_both_are_killed(tmp_path):
    """Multi-node launch simulated on one host: two torchrun invocations (--nnodes 2, --node-rank 0 and 1, gloo,
    rendezvous on localhost) run TP=2 x DP=2 GRPO with --save; both are killed with SIGKILL after a checkpoint and
    the same two commands resume it. Only global rank 0 logs (not node 1's local rank 0), every global rank writes
    its own file with its place in the layout, and the resumed run continues from the saved step."""
    import torch

    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    argv = [*TINY, "--tensor-model-parallel-size", "2", "--train-iters", "6", "--save-interval", "1",
            "--save", str(ckpt), "--log-jsonl", str(log)]

    def launch(port):
        procs = []
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                   os.path.join(ROOT, "pretrain_rl.py"), *argv]
            out = open(tmp_path / f"node{node}_{port}.log", "w")
            procs.append((subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True), out))
        return procs

    procs = launch(_free_port())
    deadline = time.monotonic() + 600
    while _saved_step(ckpt) < 2 and all(p.poll() is None for p, _ in procs) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    for p, out in procs:
        _kill_tree(p.pid)
        p.wait()
        out.close()
    killed_at = max(row["step"] for row in _read_jsonl(log) if row["kind"] == "train")
    assert 2 <= killed_at < 6, killed_at

    port = _free_port()
    procs = launch(port)
    for p, out in procs:
        assert p.wait(timeout=600) == 0, (tmp_path / f"node{procs.index((p, out))}_{port}.log").read_text()[-3000:]
        out.close()
    node0, node1 = ((tmp_path / f"node{n}_{port}.log").read_text() for n in (0, 1))
    resume_step = int(re.search(r"resumed from .* \(step (\d+)\)", node0).group(1))
    assert 2 <= resume_step <= killed_at
    assert "(TP 2)" in node0 and "world 4" in node0 and "[result] held-out accuracy" in node0
    for line in ("[setup]", "[train]", "[checkpoint]", "[result]"):
        assert line not in node1, line  # node 1 holds global ranks 2 and 3: they never log
    rows = [row for row in _read_jsonl(log) if row["kind"] == "train"]
    assert [row["step"] for row in rows][-(6 - resume_step):] == list(range(resume_step + 1, 7))
    # each global rank wrote its own file, recording its place in Megatron's order (TP fastest, then DP)
    final = ckpt / "iter_0000006"
    for rank in range(4):
        layout = torch.load(final / f"rank_{rank:05d}.pt", weights_only=True, mmap=True)["layout"]
        assert (layout["tp"], layout["dp"], layout["tp_rank"], layout["dp_rank"]) == (2, 2, rank % 2, rank // 2)


@pytest.mark.slow
def test_sigterm_with_exit_signal_handler_saves_the_step_and_resumes(tmp_path):
    """--exit-signal-handler: a SIGTERM mid-run lets the step in progress end, saves it, exits 0 without results;
    the same command resumes from that very step and finishes."""
    ckpt, log, res = tmp_path / "ckpt", tmp_path / "run.jsonl", tmp_path / "res.json"
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *TINY, "--train-iters", "4", "--save-interval", "100",
           "--save", str(ckpt), "--exit-signal-handler", "--log-jsonl", str(log), "--results-json", str(res)]
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while (not log.exists() or '"kind": "train"' not in log.read_text()) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-3000:]
    done = max(row["step"] for row in _read_jsonl(log) if row["kind"] == "train")
    assert done < 4, "the run finished before the signal came"
    assert f"[stop] SIGTERM: stopped after GRPO step {done} of 4" in out
    assert _saved_step(ckpt) == done and not res.exists()  # saved (step 0 and this step only), not finished

    r = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"(step {done})" in re.search(r"resumed from .*", r.stdout).group(0)
    steps = [row["step"] for row in _read_jsonl(log) if row["kind"] == "train"]
    assert steps == list(range(1, 5)) and json.loads(res.read_text())["steps"] == 4


def test_exit_signal_handler_needs_save():
    r = _run(["--exit-signal-handler", "--train-iters", "1"])
    assert r.returncode == 2 and "--exit-signal-handler saves a checkpoint" in r.stderr


def test_stop_signal_waits_for_the_step_and_a_second_one_stops_at_once(capsys):
    from megatron_fp4.rl.trainer import StopSignal

    # Python's own SIGINT handler, as in a foreground run (a job started in the background with & has SIGINT
    # ignored, and so would the second signal be)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stop = StopSignal()
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the first: noted, nothing raised
            assert stop.received == "SIGINT" and "stops after this GRPO step" in capsys.readouterr().out
            with pytest.raises(KeyboardInterrupt):  # the second: as without the flag
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
        finally:
            stop.restore()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


@pytest.mark.slow
def test_a_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """--exit-signal-handler at DP=2: only one worker gets the SIGTERM (a node's share of a job); the ranks agree
    (an all-reduce after each step), both save that step together and exit 0, and the run resumes from it."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "pretrain_rl.py"), *TINY, "--train-iters", "5", "--save-interval", "100", "--save",
           str(ckpt), "--exit-signal-handler", "--log-jsonl", str(log)]
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while (not log.exists() or '"kind": "train"' not in log.read_text()) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        # torchrun's children, read from ps's pid/ppid columns only: ps cuts args to 80 columns where stdout is a
        # pipe, so a long interpreter path would hide the script's name (CI's venv did)
        rows = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
        workers = sorted(int(r.split()[0]) for r in rows if r.strip() and int(r.split()[1]) == proc.pid)
        assert len(workers) == 2, (proc.pid, rows)
        os.kill(workers[-1], signal.SIGTERM)  # one worker only
        out = proc.communicate(timeout=600)[0]
    finally:
        _kill_tree(proc.pid)
    assert proc.returncode == 0, out[-3000:]
    done = max(row["step"] for row in _read_jsonl(log) if row["kind"] == "train")
    assert done < 5 and f"stopped after GRPO step {done} of 5" in out and _saved_step(ckpt) == done
    r = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and f"(step {done})" in r.stdout, r.stderr[-3000:]
    assert [row["step"] for row in _read_jsonl(log) if row["kind"] == "train"] == [1, 2, 3, 4, 5]
