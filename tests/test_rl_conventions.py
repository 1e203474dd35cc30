"""slime / Megatron-LM RL conventions (issue 23): their flags beside ours with the same meaning, slime-style prompt
files through the datasets library with a chat template, math-verify rewards, GSPO, DAPO over-sampling with refill,
LR warm-up, several evaluation sets with pass@k, --hf-checkpoint starting weights; a slime command line and the
same run spelled with our own flags give the same metrics step for step."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_fp4.rl.actor import lr_schedule
from megatron_fp4.rl.arguments import build_parser, parse_args
from megatron_fp4.rl.config import section_fields

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING_KEYS = ("_per_s", "_s", "_seconds")

#: slime spelling -> ours: each pair sets the same field to the same value.
SLIME_FLAGS = [
    (["--n-samples-per-prompt", "4"], ["--group-size", "4"]),
    (["--eps-clip", "0.3"], ["--clip-low", "0.3"]),
    (["--eps-clip-high", "0.28"], ["--clip-high", "0.28"]),
    (["--kl-loss-coef", "0.01"], ["--kl-beta", "0.01"]),
    (["--rollout-max-response-len", "6"], ["--max-response-length", "6"]),
    (["--rollout-temperature", "0.7"], ["--temperature", "0.7"]),
    (["--rollout-top-p", "0.9"], ["--top-p", "0.9"]),
    (["--rollout-top-k", "-1"], ["--top-k", "-1"]),
    (["--advantage-estimator", "reinforce_plus_plus"], ["--advantage", "reinforce_plus_plus"]),
    (["--num-rollout", "7"], ["--train-iters", "7"]),
    (["--fp4-format", "mxfp4"], ["--fp4-block-format", "mxfp4"]),  # our own old spelling, kept as an alias
]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_DATASETS_OFFLINE"] = "1"
    return env


def _rows(path, kinds=("train", "eval")):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{k: v for k, v in r.items() if not k.endswith(TIMING_KEYS) and "weight_sync" not in k}
            for r in rows if r["kind"] in kinds]


@pytest.mark.parametrize("slime,ours", SLIME_FLAGS)
def test_slime_flags_set_our_fields(slime, ours):
    assert vars(parse_args(slime)) == vars(parse_args(ours))


def test_every_alias_is_listed_in_the_readme_table():
    """The README's slime table names every alias the config defines (one source: config.py's aliases)."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    table = readme[readme.index("| slime / Megatron-LM RL flag"):]
    for _, f, _ in section_fields():
        for alias in f.metadata["aliases"]:
            assert f"`{alias}" in table, alias


def test_batch_sizes_mean_what_slime_means():
    a = parse_args([])  # the default: one optimizer step per rollout of 32 prompts x 16 samples
    assert (a.rollout_batch_size, a.group_size, a.global_batch_size, a.over_sampling_batch_size) == (32, 16, 512, 32)
    a = parse_args(["--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "4"])
    assert a.global_batch_size == 8
    with pytest.raises(ValueError, match="--global-batch-size=12 .* must divide --rollout-batch-size x "
                                         "--n-samples-per-prompt = 8 x 4 = 32"):
        parse_args(["--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "12"])
    with pytest.raises(ValueError, match="contradicts --num-steps-per-rollout=2"):
        parse_args(["--rollout-batch-size", "8", "--group-size", "4", "--global-batch-size", "8",
                    "--num-steps-per-rollout", "2"])
    with pytest.raises(ValueError, match="--over-sampling-batch-size=4 must be >= --rollout-batch-size=8"):
        parse_args(["--rollout-batch-size", "8", "--over-sampling-batch-size", "4"])
    assert parse_args(["--eps-clip", "0.3"]).clip_high == 0.3  # slime: --eps-clip-high defaults to --eps-clip


@pytest.mark.parametrize("argv,match", [
    (["--eval-prompt-data", "aime"], "expected NAME PATH pairs"),
    (["--eval-prompt-data", "a", "/no/such.jsonl"], "--eval-prompt-data a: no such file"),
    (["--prompt-data", "/no/such.parquet"], "--prompt-data: no such file"),
    (["--dataset", "synthetic:add", "--prompt-data", __file__], "both name the training data"),
    (["--hf-checkpoint", ROOT], "not a Hugging Face model folder (no config.json)"),
    (["--prompt-data", __file__], "allowed file types: .jsonl, .json, .parquet"),
    (["--apply-chat-template"], "--apply-chat-template needs a Hugging Face tokenizer"),
    (["--group-rm"], "--group-rm needs --custom-rm-path"),
    (["--custom-rm-path", "no_such_module.fn"], "--custom-rm-path='no_such_module.fn': cannot import module"),
    (["--rm-type", "regex"], "--rm-type='regex' is not valid; allowed: gsm8k, math, math_rule"),
    (["--advantage-estimator", "ppo"], "allowed: grpo, drgrpo, gspo, reinforce_plus_plus"),
    (["--overlong-buffer-len", "8"], "--overlong-buffer-len=8 must be smaller than --max-response-length=8"),
    (["--init", "random", "--hf-checkpoint", "x"], "not a Hugging Face model folder"),
])
def test_bad_conventions_flags_name_the_flag(argv, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        parse_args(argv)


def test_use_wandb_without_wandb_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match="--use-wandb needs the wandb package, which is not installed: pip install "
                                         "wandb"):
        parse_args(["--use-wandb"])


def test_eval_prompt_data_from_yaml_and_print_config(tmp_path):
    from megatron_fp4.rl.arguments import config_yaml, load_args

    data = tmp_path / "e.jsonl"
    data.write_text('{"input": "1 + 1 ?", "label": "2"}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"eval-prompt-data: [toy, {data}]\nn-samples-per-prompt: 4\n")
    a = parse_args(["--config", str(cfg)])
    assert a.eval_prompt_data == ("toy", str(data)) and a.group_size == 4
    assert parse_args(["--eval-prompt-data", "toy", str(data)]).eval_prompt_data == ("toy", str(data))
    assert f"eval-prompt-data:\n- toy\n- {data}" in config_yaml(load_args(["--eval-prompt-data", "toy", str(data)]))
    assert "--n-samples-per-prompt" in build_parser().format_help()


def test_hf_checkpoint_adapter_reads_what_the_converter_writes(tmp_path):
    """HFCheckpointWeights (the --hf-checkpoint path) presents exactly the tensors tools/convert_hf_to_megatron.py
    writes, for a tied Qwen2 and an untied Llama."""
    from test_tools_helpers import make_hf_model

    from megatron_fp4.models.checkpoint_io import MegatronCheckpoint, stage_param_names
    from megatron_fp4.models.loading import convert_hf_to_megatron
    from megatron_fp4.models.hf_weights import HFCheckpointWeights, hf_gpt_model_args

    for name in ("qwen2_tied", "llama"):
        make_hf_model(name, tmp_path / name)
        convert_hf_to_megatron(tmp_path / name, tmp_path / f"{name}_tp2", tensor_model_parallel_size=2,
                               progress=False)
        hf, conv = HFCheckpointWeights(tmp_path / name), MegatronCheckpoint(tmp_path / f"{name}_tp2")
        names = stage_param_names(hf.model_args, 0, 1)
        assert len(names) == 3 + 2 * (7 if name == "qwen2_tied" else 6) - (1 if name == "qwen2_tied" else 0)
        assert all(torch.equal(hf.full_tensor(n), conv.full_tensor(n)) for n in names)
        assert hf.args["hf_vocab_size"] == conv.args["hf_vocab_size"]
        margs = hf_gpt_model_args(hf)
        assert (margs.num_layers, margs.vocab_size, margs.tie_embeddings) == (
            conv.model_args["num_layers"], conv.model_args["vocab_size"], name == "qwen2_tied")


def _toy_task(tmp_path):
    """An HF folder (tiny Qwen2 + a byte-level BPE tokenizer with a chat template), its converted checkpoint, a
    parquet training file and a jsonl evaluation file with custom keys."""
    from rl_helpers import addition_rows, make_chat_tokenizer, make_tiny_qwen2, write_records

    hf = tmp_path / "hf"
    make_tiny_qwen2(hf, vocab_size=64, seed=1)
    assert make_chat_tokenizer(hf) == 64
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_hf_to_megatron.py"), "--hf-path",
                        str(hf), "--save", str(tmp_path / "converted"), "--no-progress"], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    train = write_records(tmp_path / "train.parquet", addition_rows(64, "problem_text", "gold", seed=0))
    evals = write_records(tmp_path / "eval.jsonl", addition_rows(6, "problem_text", "gold", seed=1))
    return hf, tmp_path / "converted", train, evals


@pytest.mark.slow
def test_slime_command_line_equals_our_spelling(tmp_path):
    """A slime-style command line (its flags, a parquet file with custom keys, the chat template, math-verify
    rewards, GSPO, DAPO over-sampling with refill and overlong shaping, LR warm-up, two optimizer steps per rollout,
    an evaluation set with pass@k, --hf-checkpoint starting weights) runs 3 steps on CPU; the same run spelled with
    our own flags (a converted checkpoint by --ref-load instead of --hf-checkpoint) logs the same metrics."""
    hf, converted, train, evals = _toy_task(tmp_path)
    data = ["--prompt-data", str(train), "--input-key", "problem_text", "--label-key", "gold", "--apply-chat-template",
            "--eval-prompt-data", "toy", str(evals), "--eval-interval", "3", "--seed", "5", "--micro-batch-size", "8",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--over-sampling-batch-size", "8",
            "--dynamic-sampling", "--overlong-buffer-len", "2", "--no-overlong-filter", "--max-prompt-length", "24"]
    slime = ["--hf-checkpoint", str(hf), "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
             "--global-batch-size", "8", "--advantage-estimator", "gspo", "--eps-clip", "0.2", "--eps-clip-high",
             "0.28", "--use-kl-loss", "--kl-loss-coef", "0.01", "--rollout-max-response-len", "4",
             "--rollout-temperature", "1.0", "--num-rollout", "3", "--n-samples-per-eval-prompt", "4"]
    ours = ["--ref-load", str(converted), "--tokenizer-model", str(hf), "--rollout-batch-size", "4", "--group-size",
            "4", "--num-steps-per-rollout", "2", "--advantage", "gspo", "--clip-low", "0.2", "--clip-high", "0.28",
            "--kl-beta", "0.01", "--max-response-length", "4", "--temperature", "1.0", "--train-iters", "3",
            "--n-samples-per-eval-prompt", "4"]
    logs = {}
    for name, argv in (("slime", slime), ("ours", ours)):
        logs[name] = tmp_path / f"{name}.jsonl"
        r = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_rl.py"), *data, *argv, "--log-jsonl",
                            str(logs[name])], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert "[warmup]" not in r.stdout  # named starting weights: no supervised warm-up by default
        assert "feeds 2 optimizer steps of --global-batch-size 8 samples" in r.stdout
    slime_rows, our_rows = _rows(logs["slime"]), _rows(logs["ours"])
    train_rows = [row for row in slime_rows if row["kind"] == "train"]
    assert [row["step"] for row in train_rows] == [1, 2, 3]
    # what the run exercised: refill rounds, two optimizer steps with the warm-up LR, rewards, pass@k on the set
    assert all(row["dynamic_sampling_rounds"] >= 1 for row in train_rows)
    assert any(row["dynamic_sampling_rounds"] > 1 for row in train_rows)
    learned = [row for row in train_rows if row.get("optimizer_steps") == 2]
    assert learned and all(math.isfinite(row["loss"]) and row["grad_norm"] > 0 for row in learned)
    for row in learned:  # the LR of the second optimizer step of the rollout: linear warm-up over 2, then cosine
        want = lr_schedule(2 * (row["step"] - 1) + 1, lr=1e-3, min_lr=1e-4, warmup_iters=2, total_iters=6)
        assert row["lr"] == pytest.approx(want, rel=1e-12)
    assert any(row["reward_mean"] > 0 for row in train_rows)
    assert all(row["overlong_penalty_mean"] <= 0 for row in train_rows)
    evals_rows = [row for row in slime_rows if row["kind"] == "eval"]
    assert evals_rows and {"toy/accuracy", "toy/pass@1", "toy/pass@2", "toy/pass@4", "toy/accuracy_bf16"} <= set(
        evals_rows[-1])
    assert slime_rows == our_rows


@pytest.mark.slow
def test_hf_checkpoint_starts_a_tensor_parallel_run(tmp_path):
    """--hf-checkpoint at TP=2 (torchrun, gloo): the weights the run starts from and saves at step 0 are the HF
    folder's, split over the two ranks and merged back bit for bit."""
    from rl_helpers import make_chat_tokenizer, make_tiny_qwen2

    from megatron_fp4.models.checkpoint_io import layer_offset, to_global_name
    from megatron_fp4.models.hf_weights import HFCheckpointWeights
    from megatron_fp4.rl.checkpoint_weights import TrainerCheckpointWeights

    hf = tmp_path / "hf"
    make_tiny_qwen2(hf, vocab_size=64, seed=2)
    make_chat_tokenizer(hf)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(ROOT, "pretrain_rl.py"), "--hf-checkpoint", str(hf), "--dataset",
                        "synthetic:add", "--num-synthetic-examples", "100", "--eval-samples", "4",
                        "--tensor-model-parallel-size", "2", "--train-iters", "0", "--max-response-length", "2",
                        "--save", str(tmp_path / "run")], env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "(TP 2)" in r.stdout and "[warmup]" not in r.stdout
    saved, want = TrainerCheckpointWeights(tmp_path / "run"), HFCheckpointWeights(hf)
    offset = layer_offset(saved.model_args["num_layers"], 0, saved.pp)
    names = {to_global_name(k, offset) for k in saved.shard_keys(0, 0)}
    assert saved.tp == 2 and names == set(want.shard_keys(0, 0))
    assert all(torch.equal(saved.full_tensor(n), want.full_tensor(n)) for n in names)
