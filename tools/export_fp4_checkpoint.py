#!/usr/bin/env python
"""Export an FP4 rollout checkpoint: an HF-style folder with packed FP4 linear weights and a quantization_config.

    python tools/export_fp4_checkpoint.py --hf-path Qwen2.5-3B --save fp4/qwen2.5-3b-hif4 --format hif4 --resq 2:4
    python tools/export_fp4_checkpoint.py --load ckpt/run1 --save fp4/run1-mxfp4 --format mxfp4 --resq none
    python tools/export_fp4_checkpoint.py --load runs/grpo --iteration 100 --save fp4/grpo --format hif4 --resq 2:4

Every linear of every transformer block (q/k/v/o, gate/up/down) is stored as the reference quantizer's packed
codes and scales (``megatron_fp4.formats``), grouped along in_features; embeddings, norms, biases and lm_head stay
in the source dtype. --resq, --resq-combine and --activation-format are recorded for the rollout engine (they do
not change the weights). Load with ``megatron_fp4.models.fp4_checkpoint.load_fp4_checkpoint`` or ``load_gpt``.
"""

from __future__ import annotations

import argparse
import os

import _common  # noqa: F401
from _common import add_output_args, iteration_arg, non_negative_int, parse_size, run_cli, tool_parser

PROG = "export_fp4_checkpoint.py"

RESQ = ("none", "2:4", "channel", "tile32x64", "dense")  # == megatron_fp4.models.fp4_checkpoint.RESQ_SPARSITIES
RESQ_COMBINES = ("exact", "bf16")  # == megatron_fp4.resq.RESQ_COMBINES (the parser stays import-free)


def parse_args(argv=None) -> argparse.Namespace:
    p = tool_parser(PROG, __doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-path", help="high-precision HF folder")
    src.add_argument("--load", help="a pretrain_rl.py --save directory or a megatron-fp4 checkpoint directory")
    p.add_argument("--iteration", default=None, type=iteration_arg,
                   help="with --load: the iteration to export (default: the latest)")
    p.add_argument("--save", required=True, help="output folder")
    p.add_argument("--format", required=True, choices=("hif4", "mxfp4"), help="FP4 weight format")
    p.add_argument("--resq", required=True, choices=RESQ, help="Rollout-ResQ sparsity the rollout engine uses")
    p.add_argument("--resq-combine", default="exact", choices=RESQ_COMBINES,
                   help="exact, or bf16: the rollout engine rounds Q(X) + S(Q(R)) to one BF16 operand (one GEMM)")
    p.add_argument("--activation-format", default=None,
                   help="rollout activation format (default: --format; 'none' for W4A16)")
    p.add_argument("--high-precision-first-layers", type=non_negative_int, default=0,
                   help="keep the linears of the first N transformer layers in high precision")
    p.add_argument("--high-precision-last-layers", type=non_negative_int, default=0,
                   help="keep the linears of the last N transformer layers in high precision")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    max_shard_bytes = parse_size(args.max_shard_size)
    from megatron_fp4.models.fp4_checkpoint import export_fp4_checkpoint
    from megatron_fp4.ownership import check_output_dir

    if args.iteration is not None and args.load is None:
        raise ValueError("--iteration needs --load (an --hf-path folder has no iterations)")
    src = args.hf_path if args.hf_path is not None else args.load
    if not os.path.exists(src):
        raise FileNotFoundError(f"{'--hf-path' if args.hf_path is not None else '--load'} {src}: no such directory")
    check_output_dir(args.save, "hf", sources=[src])  # before anything is read
    source = args.hf_path
    if args.load is not None:
        from megatron_fp4.rl.export import open_checkpoint

        source = open_checkpoint(args.load, args.iteration)
    out = export_fp4_checkpoint(
        source, args.save, format=args.format, resq=args.resq, resq_combine=args.resq_combine,
        activation_format=args.activation_format, high_precision_first_layers=args.high_precision_first_layers,
        high_precision_last_layers=args.high_precision_last_layers,
        max_shard_bytes=max_shard_bytes, progress=not args.no_progress,
        overwrite=args.overwrite)
    print(f"wrote {out} (format {args.format}, resq {args.resq})")


if __name__ == "__main__":
    run_cli(main, PROG)
