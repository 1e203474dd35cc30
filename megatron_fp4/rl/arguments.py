"""Command-line arguments of pretrain_rl.py: Megatron-style flags, an optional YAML config, validation.

Precedence: built-in defaults (the tiny CPU run) < ``--config FILE.yaml`` < flags given on the command line.
YAML keys are the flag names with dashes or underscores (``group-size: 8`` or ``group_size: 8``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Optional, Sequence

FP4_FORMATS = ("hif4", "mxfp4", "nvfp4", "none")
ROLLOUT_PRECISIONS = ("bf16", "w4a16", "w16a4", "w4a4")
RESQ_SPARSITIES = ("none", "2:4", "channel", "tile32x64", "dense")
RESQ_COMBINES = ("exact", "bf16")  # megatron_fp4.resq.RESQ_COMBINES (kept import-free here: the parser loads fast)
ROLLOUT_BACKENDS = ("native", "sglang")
ADVANTAGES = ("grpo", "drgrpo")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (defaults = the embedded tiny CPU run: synthetic addition, HiF4 + ResQ 2:4)."""
    p = argparse.ArgumentParser(
        prog="pretrain_rl.py",
        description="GRPO post-training with FP4 (HiF4 / MXFP4) training and rollout on megatron-core. "
                    "With no arguments: a tiny CPU run on synthetic addition in HiF4 with ResQ 2:4 rollout.")
    p.add_argument("--config", default=None, help="YAML file of arguments (command-line flags override it)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialize full weights on the CPU, then shard them: the same random model at any TP/PP "
                        "(always the case on CPU; on GPUs megatron otherwise seeds each TP rank's shard itself)")

    g = p.add_argument_group("model (ignored with --load of a converted checkpoint, which carries its own)")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=512)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=2)
    g.add_argument("--seq-length", type=int, default=None,
                   help="max positions (default: max prompt + max response length)")
    g.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model file or HF tokenizer folder (default: build one for synthetic data)")
    g.add_argument("--vocab-size", type=int, default=24, help="vocabulary of a tokenizer built on the fly")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters (GPU); default fp32")

    g = p.add_argument_group("FP4")
    g.add_argument("--fp4-format", default="hif4", choices=FP4_FORMATS)
    g.add_argument("--fp4-train", dest="fp4_train", action="store_true", default=True,
                   help="quantize the training GEMMs (fprop, dgrad, wgrad) [default]")
    g.add_argument("--no-fp4-train", dest="fp4_train", action="store_false", help="train in high precision")
    g.add_argument("--rollout-precision", default="w4a4", choices=ROLLOUT_PRECISIONS)
    g.add_argument("--resq", default="2:4", choices=RESQ_SPARSITIES, help="Rollout-ResQ residual sparsity")
    g.add_argument("--resq-combine", default="exact", choices=RESQ_COMBINES,
                   help="exact: add the residual's product exactly; bf16: round Q(X) + S(Q(R)) once to one BF16 "
                        "operand (one GEMM: the fast path on Hopper, see docs/PERFORMANCE.md)")
    g.add_argument("--rollout-backend", default="native", choices=ROLLOUT_BACKENDS)
    g.add_argument("--fp4-high-precision-first-layers", type=int, default=0)
    g.add_argument("--fp4-high-precision-last-layers", type=int, default=0)

    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="synthetic:add", help="gsm8k:PATH | math:PATH | synthetic:add | synthetic:arith")
    g.add_argument("--eval-dataset", default=None, help="held-out data (default: split off --eval-samples)")
    g.add_argument("--num-synthetic-examples", type=int, default=4000)
    g.add_argument("--synthetic-digits", type=int, default=1, help="max digits per operand of synthetic:add")
    g.add_argument("--synthetic-operands", type=int, default=4, help="operands per synthetic:add problem")
    g.add_argument("--eval-samples", type=int, default=256)

    g = p.add_argument_group("GRPO")
    g.add_argument("--group-size", type=int, default=16)
    g.add_argument("--global-batch-size", type=int, default=32, help="prompts per step")
    g.add_argument("--micro-batch-size", type=int, default=256, help="sequences per training micro-batch")
    g.add_argument("--max-prompt-length", type=int, default=16)
    g.add_argument("--max-response-length", type=int, default=8)
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--min-lr", type=float, default=1e-4, help="cosine decay floor (= --lr for a constant lr)")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0 = off)")
    g.add_argument("--kl-beta", type=float, default=0.001)
    g.add_argument("--clip-low", type=float, default=0.2)
    g.add_argument("--clip-high", type=float, default=0.2)
    g.add_argument("--tis-cap", type=float, default=5.0, help="truncated importance sampling cap (0 = off)")
    g.add_argument("--advantage", default="grpo", choices=ADVANTAGES)
    g.add_argument("--dynamic-sampling", action="store_true", help="drop groups whose rewards are all equal")
    g.add_argument("--no-overlong-filter", dest="overlong_filter", action="store_false", default=True)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--train-iters", type=int, default=250, help="GRPO steps (0: warm-up, evaluate and save only)")
    g.add_argument("--ppo-epochs", type=int, default=1, help="optimizer passes over each rollout batch")

    g = p.add_argument_group("warm-up (supervised on the examples' targets, before GRPO)")
    g.add_argument("--sft-iters", type=int, default=100,
                   help="supervised warm-up iterations for a randomly initialized model (use 0 with --load)")
    g.add_argument("--sft-lr", type=float, default=3e-3)
    g.add_argument("--sft-batch-size", type=int, default=64)
    g.add_argument("--sft-target-accuracy", type=float, default=None,
                   help="stop the warm-up early once greedy held-out accuracy (BF16) reaches this fraction, checked "
                        "every --sft-eval-interval iterations: sets the warm start to a level where GRPO matters")
    g.add_argument("--sft-eval-interval", type=int, default=25)

    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--load", default=None, help="checkpoint dir to resume from (or a converted HF checkpoint)")
    g.add_argument("--init-from", default=None,
                   help="RL checkpoint dir whose latest model weights start the policy and the reference (no "
                        "optimizer, step or data state; skips the warm-up; saved at any TP/PP, resharded on load); "
                        "ignored when --save/--load resumes")
    g.add_argument("--save", default=None, help="checkpoint dir (default: no checkpoints)")
    g.add_argument("--save-interval", type=int, default=50)
    g.add_argument("--keep-last", type=int, default=2, help="checkpoints kept in --save")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--max-nonfinite-steps", type=int, default=3,
                   help="stop after this many consecutive steps with a non-finite loss or gradient")
    g.add_argument("--results-json", default=None, help="write the final metrics and accuracy here")
    g.add_argument("--log-jsonl", default=None, help="append every step's metrics as one JSON line (rank 0)")
    g.add_argument("--log-underflow-interval", type=int, default=0,
                   help="every N GRPO steps (and at step 0) log the per-layer rollout FP4 underflow rate without "
                        "and with ResQ (--resq, or 2:4 when --resq none) on up to 64 held-out prompts (0 = off)")
    return p


def _positive(args, *names):
    for n in names:
        v = getattr(args, n)
        if v is None or v <= 0:
            raise ValueError(f"--{n.replace('_', '-')}={v!r} is not valid; it must be > 0")


def _non_negative(args, *names):
    for n in names:
        v = getattr(args, n)
        if v is None or v < 0:
            raise ValueError(f"--{n.replace('_', '-')}={v!r} is not valid; it must be >= 0")


def validate_args(args: argparse.Namespace, world_size: int = 1) -> argparse.Namespace:
    """Check ranges and cross-argument constraints; raise ValueError naming the argument and allowed values."""
    _positive(args, "tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size",
              "ffn_hidden_size", "num_attention_heads", "num_query_groups", "vocab_size", "group_size",
              "global_batch_size", "micro_batch_size", "max_prompt_length", "max_response_length", "lr",
              "save_interval", "eval_interval", "log_interval", "max_nonfinite_steps",
              "temperature", "ppo_epochs", "sft_lr", "sft_batch_size", "num_synthetic_examples",
              "synthetic_digits", "synthetic_operands", "keep_last", "sft_eval_interval")
    _non_negative(args, "train_iters", "log_underflow_interval", "kl_beta", "clip_low", "clip_high", "tis_cap",
                  "sft_iters", "eval_samples", "top_k",
                  "weight_decay", "clip_grad", "fp4_high_precision_first_layers", "fp4_high_precision_last_layers")
    if args.sft_target_accuracy is not None and not 0 <= args.sft_target_accuracy <= 1:
        raise ValueError(f"--sft-target-accuracy={args.sft_target_accuracy} is not valid; it must be in [0, 1]")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p={args.top_p} is not valid; it must be in (0, 1]")
    if args.min_lr is not None and not 0 <= args.min_lr <= args.lr:
        raise ValueError(f"--min-lr={args.min_lr} is not valid; it must be in [0, --lr={args.lr}]")
    if args.clip_low >= 1:
        raise ValueError(f"--clip-low={args.clip_low} is not valid; it must be in [0, 1)")
    if args.group_size < 2:
        raise ValueError(f"--group-size={args.group_size} is not valid; GRPO needs at least 2 samples per prompt")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size={tp} x "
                         f"--pipeline-model-parallel-size={pp}")
    if args.num_attention_heads % tp or args.num_query_groups % tp:
        raise ValueError(f"--tensor-model-parallel-size={tp} must divide --num-attention-heads="
                         f"{args.num_attention_heads} and --num-query-groups={args.num_query_groups}")
    if args.num_attention_heads % args.num_query_groups:
        raise ValueError(f"--num-query-groups={args.num_query_groups} must divide --num-attention-heads="
                         f"{args.num_attention_heads}")
    if args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--num-attention-heads={args.num_attention_heads} must divide --hidden-size="
                         f"{args.hidden_size}")
    if args.num_layers % pp:
        raise ValueError(f"--pipeline-model-parallel-size={pp} must divide --num-layers={args.num_layers}")
    dp = world_size // (tp * pp)
    if args.global_batch_size % dp:
        raise ValueError(f"--global-batch-size={args.global_batch_size} must be a multiple of the data-parallel "
                         f"size {dp} (world {world_size} / (TP {tp} x PP {pp}))")
    kind, sep, rest = args.dataset.partition(":")
    if kind not in ("gsm8k", "math", "synthetic") or not sep or not rest:
        raise ValueError(f"--dataset={args.dataset!r} is not valid; allowed: gsm8k:PATH, math:PATH, "
                         f"synthetic:add, synthetic:arith")
    if args.init_from is not None and not os.path.isdir(args.init_from):
        raise ValueError(f"--init-from={args.init_from!r}: no such directory")
    if kind in ("gsm8k", "math") and not os.path.isfile(rest):
        raise ValueError(f"--dataset={args.dataset!r}: no such file {rest!r}")
    if kind == "synthetic" and rest not in ("add", "arith"):
        raise ValueError(f"--dataset={args.dataset!r} is not valid; synthetic tasks: add, arith")
    if kind != "synthetic" and args.tokenizer_model is None and args.load is None:
        raise ValueError(f"--dataset={args.dataset!r} needs --tokenizer-model (or --load of a converted checkpoint "
                         "that holds one)")
    if args.fp4_format == "none" and args.rollout_precision != "bf16":
        # FP4 rollout needs a format; "none" means everything in high precision
        args.rollout_precision = "bf16"
        args.resq = "none"
    if args.rollout_precision not in ("w4a4", "w16a4") and args.resq != "none":
        raise ValueError(f"--resq={args.resq!r} needs FP4 rollout activations (--rollout-precision w4a4 or w16a4); "
                         f"got --rollout-precision {args.rollout_precision!r}")
    if args.resq_combine != "exact" and args.resq == "none":
        raise ValueError(f"--resq-combine={args.resq_combine!r} needs a ResQ residual (--resq other than 'none')")
    if args.rollout_backend == "sglang" and (tp * pp) > 1:
        raise ValueError("--rollout-backend sglang currently runs with TP=PP=1 trainers only")
    if args.seq_length is None:
        args.seq_length = args.max_prompt_length + args.max_response_length
    if args.seq_length < args.max_prompt_length + args.max_response_length:
        raise ValueError(f"--seq-length={args.seq_length} must be >= --max-prompt-length + --max-response-length "
                         f"({args.max_prompt_length + args.max_response_length})")
    return args


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml

    if not os.path.isfile(path):
        raise ValueError(f"--config: no such file {path!r}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of argument names to values")
    return {k.replace("-", "_"): v for k, v in data.items()}


def parse_args(argv: Optional[Sequence[str]] = None, world_size: int = 1) -> argparse.Namespace:
    """Parse defaults < YAML config < command line, then validate."""
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        cfg = _load_yaml(pre.config)
        known = {a.dest for a in parser._actions}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"--config {pre.config!r}: unknown argument(s) {unknown}")
        parser.set_defaults(**cfg)
    args = parser.parse_args(argv)
    return validate_args(args, world_size)
