"""Export a live tensor-parallel GPTModel to Hugging Face (``megatron_fp4.rl.export.export_hf`` on every rank).

    torchrun --nproc-per-node 2 tests/dist/export_live.py --load CONVERTED --save HF_DIR --out logits.pt

Builds the model of a converted checkpoint at TP = world size, loads it, moves every weight by a seeded amount (so
the export is not the checkpoint it came from), computes the TP-sharded model's logits of fixed token ids, exports
it collectively and, on rank 0, saves ``{"ids", "logits"}`` to ``--out`` for the test to compare with transformers.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from megatron_fp4.models import build_gpt_model  # noqa: E402
from megatron_fp4.models.checkpoint_io import gpt_model_args_from_checkpoint, load_checkpoint_into_model  # noqa: E402
from megatron_fp4.parallel import initialize_parallel  # noqa: E402
from megatron_fp4.rl.export import export_hf  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--load", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    initialize_parallel(world, 1, seed=0)
    margs = gpt_model_args_from_checkpoint(a.load, fp4_recipe=None, params_dtype=torch.float32)
    model = build_gpt_model(margs, parallel_output=False).eval()
    load_checkpoint_into_model(model, a.load)
    with torch.no_grad():  # the same shift on every rank keeps replicated tensors (norms) equal
        g = torch.Generator().manual_seed(123)
        for _, p in sorted(model.named_parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    ids = torch.randint(0, margs.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None).float()
    export_hf(model, a.save)
    if torch.distributed.get_rank() == 0:
        torch.save({"ids": ids, "logits": logits}, a.out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
