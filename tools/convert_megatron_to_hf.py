#!/usr/bin/env python
"""Convert a megatron-fp4 checkpoint or a pretrain_rl.py run (any TP/PP) into a Hugging Face folder that
transformers can load.

    python tools/convert_megatron_to_hf.py --load ckpt/qwen2.5-3b-tp2 --save hf/qwen2.5-3b [--iteration 100]
    python tools/convert_megatron_to_hf.py --load runs/grpo --save hf/grpo      # a pretrain_rl.py --save directory

Writes config.json (the source model's config, dims checked), the tokenizer files saved with the checkpoint and
safetensors files of at most --max-shard-size each (+ model.safetensors.index.json when there are several).
"""

from __future__ import annotations

import argparse

import _common  # noqa: F401
from _common import DTYPES, add_output_args, iteration_arg, parse_size, run_cli, tool_parser

PROG = "convert_megatron_to_hf.py"


def parse_args(argv=None) -> argparse.Namespace:
    p = tool_parser(PROG, __doc__)
    p.add_argument("--load", required=True, help="a pretrain_rl.py --save directory or a megatron-fp4 checkpoint "
                                                 "directory (or one iteration directory of either)")
    p.add_argument("--save", required=True, help="output HF folder")
    p.add_argument("--iteration", default=None, type=iteration_arg, help="iteration to convert (default: the latest)")
    p.add_argument("--dtype", default=None, choices=tuple(DTYPES),
                   help="cast the weights (default: as stored; float32 from a --bf16 RL run exports its fp32 master "
                        "weights)")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    max_shard_bytes = parse_size(args.max_shard_size)
    import torch

    from megatron_fp4.ownership import check_output_dir
    from megatron_fp4.rl.export import export_hf

    check_output_dir(args.save, "hf", sources=[args.load])  # before anything is read
    out = export_hf(args.load, args.save, iteration=args.iteration,
                    dtype=getattr(torch, args.dtype) if args.dtype else None,
                    max_shard_bytes=max_shard_bytes, progress=not args.no_progress,
                    overwrite=args.overwrite)
    print(f"wrote {out}")


if __name__ == "__main__":
    run_cli(main, PROG)
