#!/usr/bin/env python
"""Check that converted megatron-fp4 checkpoints give transformers' logits, at any TP/PP (run under torchrun).

    torchrun --nproc-per-node 2 tools/verify_conversion.py --tensor-model-parallel-size 2 \\
        --hf-path hf/qwen --load ckpt/qwen [--hf-path hf/llama --load ckpt/llama ...] [--atol 1e-4]

For each (--hf-path, --load) pair it builds the megatron-core GPTModel at the requested TP/PP, loads the
checkpoint (resharded if it was written at another TP/PP), runs a forward pass over random tokens (pipeline
stages exchange activations point to point) and compares the TP-gathered logits with
``AutoModelForCausalLM.from_pretrained(hf_path)`` in fp32. Prints one ``VERIFY {json}`` line per pair on the
last stage; exits 1 when a pair differs by more than --atol.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import _common  # noqa: F401
from _common import positive_int, run_cli, tool_parser

PROG = "verify_conversion.py"


def finite_non_negative(text: str) -> float:
    """argparse type of --atol: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not valid; expected a finite number >= 0")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = tool_parser(PROG, __doc__)
    p.add_argument("--hf-path", action="append", required=True, help="HF folder (repeat, paired with --load)")
    p.add_argument("--load", action="append", required=True, help="megatron-fp4 checkpoint (repeat)")
    p.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1)
    p.add_argument("--batch-size", type=positive_int, default=2)
    p.add_argument("--seq-length", type=positive_int, default=12)
    p.add_argument("--atol", type=finite_non_negative, default=1e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save", default=None,
                   help="also save each loaded model at this run's TP/PP to SAVE/<pair index> (exercises the "
                        "distributed save_model_checkpoint)")
    return p.parse_args(argv)


def pipeline_forward(model, ids, hidden_size: int, dtype):
    """Logits [b, s, V] on the last pipeline stage (None elsewhere); activations sent stage to stage."""
    import torch
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    pos = torch.arange(s).expand(b, s)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    if not first:
        recv = torch.empty(s, b, hidden_size, dtype=dtype)
        torch.distributed.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(recv)
    with torch.no_grad():
        out = model(ids, pos, None)
    if not last:
        torch.distributed.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if len(args.hf_path) != len(args.load):
        raise ValueError("give --hf-path and --load the same number of times (they are paired)")
    for flag, paths in (("--hf-path", args.hf_path), ("--load", args.load)):
        for path in paths:
            if not os.path.isdir(path):
                raise FileNotFoundError(f"{flag} {path}: no such directory")
    from megatron_fp4.models.checkpoint_io import MegatronCheckpoint
    from megatron_fp4.models.loading import open_source
    from megatron_fp4.ownership import check_output_dir

    for hf_path, load in zip(args.hf_path, args.load):  # both readable before any process group starts
        open_source(hf_path)
        MegatronCheckpoint(load)
    if args.save:
        for index in range(len(args.load)):
            check_output_dir(f"{args.save}/{index}", "converted", arg="--save")
    import torch
    from megatron.core import parallel_state as ps

    from megatron_fp4.models import GPTModelArgs, build_gpt_model
    from megatron_fp4.models.checkpoint_io import load_checkpoint_into_model, model_args_from_json, \
        save_model_checkpoint
    from megatron_fp4.parallel import destroy_parallel, initialize_parallel

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    initialize_parallel(tp, pp, seed=args.seed)
    failed = 0
    for index, (hf_path, load) in enumerate(zip(args.hf_path, args.load)):
        ckpt = MegatronCheckpoint(load)
        margs = model_args_from_json(ckpt.model_args)
        margs["params_dtype"] = torch.float32
        model = build_gpt_model(GPTModelArgs(**margs), parallel_output=False).eval()
        load_checkpoint_into_model(model, ckpt)
        vocab = int(ckpt.args["hf_vocab_size"])
        g = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, vocab, (args.batch_size, args.seq_length), generator=g)
        logits = pipeline_forward(model, ids, margs["hidden_size"], torch.float32)
        bad = torch.zeros(1)
        if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
            with torch.no_grad():
                ref = hf(ids).logits
            diff = (logits[..., :vocab].float() - ref).abs().max().item()
            padded_ok = logits.shape[-1] == margs["vocab_size"]
            ok = diff <= args.atol and padded_ok
            print("VERIFY " + json.dumps({"hf_path": hf_path, "load": load, "tp": tp, "pp": pp,
                                          "ckpt_tp": ckpt.tp, "ckpt_pp": ckpt.pp, "max_abs_diff": diff,
                                          "logit_std": ref.std().item(), "ok": ok}), flush=True)
            bad += float(not ok)
        torch.distributed.all_reduce(bad)
        if args.save:
            save_model_checkpoint(model, f"{args.save}/{index}", 1, margs, like=ckpt)
        failed += int(bad.item() > 0)
    destroy_parallel()
    if failed:
        print(f"{PROG}: error: {failed} checkpoint(s) differ from transformers by more than {args.atol}",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    run_cli(main, PROG)
