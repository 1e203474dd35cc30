"""Native rollout under tensor parallelism (torchrun, gloo, CPU): TP=2 generation equals TP=1 on the same weights
(greedy tokens, seeded samples, logprobs) in BF16 and W4A4 (+ ResQ 2:4). This file is also the worker script:
``python tests/test_rollout_tp.py --out DIR`` (TP = world size)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import zlib

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECISIONS = (("bf16", "hif4", "none"), ("w4a4", "hif4", "2:4"), ("w4a4", "mxfp4", "none"), ("w16a4", "mxfp4", "2:4"))


def _canonical(name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    return 0.08 * torch.randn(shape, generator=g)


def _shard(full: torch.Tensor, param, rank: int, tp: int) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = full.chunk(tp * stride, dim=dim)
    return torch.cat([chunks[s * tp + rank] for s in range(stride)], dim=dim)


def _full_shape(param, tp: int):
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return shape


def worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    from megatron.core import parallel_state as ps

    from megatron_fp4.models import GPTModelArgs, build_gpt_model
    from megatron_fp4.parallel import initialize_parallel
    from megatron_fp4.resq import RolloutPrecision
    from megatron_fp4.rollout import NativeRolloutEngine, SamplingParams

    world = int(os.environ.get("WORLD_SIZE", "1"))
    initialize_parallel(tensor_model_parallel_size=world, seed=0)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    args = GPTModelArgs(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                        num_query_groups=2, vocab_size=96, max_seq_len=48, add_qkv_bias=True)
    model = build_gpt_model(args)
    engine = NativeRolloutEngine(model)
    engine.update_weights(
        (n, _shard(_canonical(n, _full_shape(p, tp)), p, rank, tp)) for n, p in model.named_parameters())
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, 96, (n,), generator=g).tolist() for n in (4, 7, 3)]
    results = {}
    for mode, fmt, sparsity in PRECISIONS:
        engine.set_precision(RolloutPrecision(mode, fmt, sparsity))
        greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(3,)))
        sampled = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=10, seed=5))
        results[f"{mode}/{fmt}/{sparsity}"] = {
            "greedy": [(s.token_ids, s.logprobs) for s in greedy],
            "sampled": [(s.token_ids, s.logprobs) for s in sampled],
        }
    if torch.distributed.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, f"tp{tp}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _run(cmd):
    # drop the distributed variables an in-process initialize_parallel() of another test left behind
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rollout_tp"))
    script = os.path.abspath(__file__)
    _run([sys.executable, script, "--out", out])
    with socket.socket() as sock:  # an explicit free port: "--master-port 0" can hang the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
          "--master-port", str(port), script, "--out", out])
    return torch.load(os.path.join(out, "tp1.pt")), torch.load(os.path.join(out, "tp2.pt"))


@pytest.mark.parametrize("key", ["/".join(p) for p in PRECISIONS])
def test_tp2_generation_equals_tp1(results, key):
    tp1, tp2 = results[0][key], results[1][key]
    for kind in ("greedy", "sampled"):
        for (t1, l1), (t2, l2) in zip(tp1[kind], tp2[kind]):
            assert t1 == t2, (key, kind)
            assert max(abs(a - b) for a, b in zip(l1, l2)) < 1e-4, (key, kind)
    assert sum(len(t) for t, _ in tp1["sampled"]) > 10


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    worker(ap.parse_args().out)
