#!/usr/bin/env python
"""Convert a local Hugging Face Qwen2 / Qwen2.5 / Llama folder (or a GGUF file) into a TP x PP sharded megatron-fp4
checkpoint.

    python tools/convert_hf_to_megatron.py --hf-path Qwen2.5-3B --save ckpt/qwen2.5-3b-tp2 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1
    python tools/convert_hf_to_megatron.py --hf-path DIR --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --save ckpt/smol

The result loads with ``pretrain_rl.py --load ckpt/...`` (any TP/PP dividing the model) and with
``megatron_fp4.models.loading.load_gpt(dir)``. Layout: see tools/README.md.
"""

from __future__ import annotations

import argparse
import os

import _common  # noqa: F401  (puts the repository on sys.path)
from _common import iteration_arg, positive_int, run_cli, tool_parser

PROG = "convert_hf_to_megatron.py"


def parse_args(argv=None) -> argparse.Namespace:
    p = tool_parser(PROG, __doc__)
    p.add_argument("--hf-path", default=None, help="local HF folder: config.json + safetensors (sharded or not); "
                                                   "with --gguf-file, the folder holding the GGUF file")
    p.add_argument("--gguf-file", default=None,
                   help="read the model from this GGUF file (a name inside --hf-path, or a path when --hf-path is "
                        "not given) through transformers' GGUF loader: weights dequantized to fp32, tokenizer and "
                        "chat template copied (needs pip install gguf)")
    p.add_argument("--save", required=True, help="output checkpoint directory")
    p.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1)
    p.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=1,
                   help="pad the vocabulary to a multiple of this x TP (default 1: pad only as TP requires)")
    p.add_argument("--iteration", default="release", type=iteration_arg,
                   help='iteration to write: "release" (default) or a number')
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output in --save")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from megatron_fp4.models.loading import convert_hf_to_megatron

    hf_path, gguf_file = args.hf_path, args.gguf_file
    if hf_path is None:
        if gguf_file is None:
            raise ValueError("--hf-path is required (or --gguf-file PATH to convert a GGUF file)")
        hf_path, gguf_file = os.path.dirname(os.path.abspath(gguf_file)), os.path.basename(gguf_file)
    if not os.path.isdir(hf_path):
        raise FileNotFoundError(f"--hf-path {hf_path}: no such directory")
    it_dir = convert_hf_to_megatron(
        hf_path, args.save, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, iteration=args.iteration,
        progress=not args.no_progress, overwrite=args.overwrite, gguf_file=gguf_file)
    print(f"wrote {it_dir} (TP={args.tensor_model_parallel_size}, PP={args.pipeline_model_parallel_size})")


if __name__ == "__main__":
    run_cli(main, PROG)
