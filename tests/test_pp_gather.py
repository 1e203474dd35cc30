"""Pipeline-parallel weight gather for rollout (torchrun, 2 ranks, gloo, CPU): the stages' parameters gathered by
megatron_fp4.models.pp_gather equal the full (PP = 1 layout) model's, with untied and tied embeddings; a stage copied
from a full model equals the stage; a PP = 2 checkpoint loads into a full-depth model built under PP = 2; the rollout
manager's sync with an engine on the first stage alone (SGLang's layout) pushes the whole depth from there and gives
the native engine beside it the whole depth on every stage.
This file is also the worker script: ``torchrun --nproc-per-node 2 tests/test_pp_gather.py --out DIR``."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import zlib

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_LAYERS = 4


def _canonical(name: str, shape) -> torch.Tensor:
    """A value for each global parameter name, independent of how the model is split."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g)


def _global(local: str, offset: int) -> str:
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", local)
    return f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else local


def worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    from megatron.core import parallel_state as ps

    from megatron_fp4.models import (
        GPTModelArgs,
        build_gpt_model,
        gpt_transformer_config,
    )
    from megatron_fp4.models.checkpoint_io import (
        load_checkpoint_into_model,
        save_model_checkpoint,
    )
    from megatron_fp4.models.pp_gather import (
        copy_stage_from_full_model,
        gather_pipeline_parameters,
        stage_layer_offset,
    )
    from megatron_fp4.parallel import initialize_parallel

    initialize_parallel(pipeline_model_parallel_size=int(os.environ["WORLD_SIZE"]), seed=0)
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    offset = pp_rank * (NUM_LAYERS // pp)  # the test's own arithmetic, not the helper's
    checks: dict[str, bool] = {}
    for tie in (False, True):
        tag = "tied" if tie else "untied"
        args = GPTModelArgs(num_layers=NUM_LAYERS, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                            num_query_groups=2, vocab_size=48, max_seq_len=16, add_qkv_bias=True, tie_embeddings=tie)

        def full_model(args=args):
            return build_gpt_model(args, config=gpt_transformer_config(args, pipeline_model_parallel_size=1),
                                   pre_process=True, post_process=True)

        full, stage = full_model(), build_gpt_model(args)
        with torch.no_grad():
            for n, p in full.named_parameters():
                p.copy_(_canonical(n, p.shape))
            for n, p in stage.named_parameters():
                g = _global(n, offset)
                # megatron's last stage keeps a copy of the tied embedding as output_layer.weight
                p.copy_(_canonical("embedding.word_embeddings.weight" if tie and g == "output_layer.weight" else g,
                                   p.shape))
        full_state = dict(full.named_parameters())
        checks[f"{tag}/full_model_has_all_layers"] = (len(full.decoder.layers) == NUM_LAYERS
                                                     and stage_layer_offset(full) == 0)
        checks[f"{tag}/stage_offset"] = stage_layer_offset(stage) == offset
        checks[f"{tag}/stage_is_a_stage"] = len(stage.decoder.layers) == NUM_LAYERS // pp
        gathered = gather_pipeline_parameters(stage, list(full_state))
        checks[f"{tag}/gathered_names"] = sorted(n for n, _ in gathered) == sorted(full_state)
        checks[f"{tag}/gathered_values"] = all(torch.equal(t, full_state[n]) for n, t in gathered)

        fresh = build_gpt_model(args)
        copy_stage_from_full_model(fresh, full)
        checks[f"{tag}/copy_from_full"] = all(torch.equal(a, b) for a, b in
                                              zip(fresh.parameters(), stage.parameters()))

        # a checkpoint saved at PP = 2 loads into a full-depth model although parallel_state says PP = 2
        ckpt = os.path.join(out_dir, f"ckpt_{tag}")
        save_model_checkpoint(stage, ckpt, "release", args)
        loaded = full_model()
        load_checkpoint_into_model(loaded, ckpt)
        checks[f"{tag}/checkpoint_into_full"] = all(torch.equal(p, full_state[n])
                                                    for n, p in loaded.named_parameters())
        checks.update({f"{tag}/{k}": v for k, v in _first_stage_sync_checks(stage, full_model(), full_state).items()})
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, checks)
    if torch.distributed.get_rank() == 0:
        merged = {f"rank{r}/{k}": v for r, c in enumerate(every) for k, v in c.items()}
        with open(os.path.join(out_dir, "checks.json"), "w") as f:
            json.dump(merged, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _first_stage_sync_checks(stage, diagnostics_model, full_state) -> dict[str, bool]:
    """RolloutManager.sync_weights at PP = 2 with a recording engine on the first stage only (FirstStageEngine, as
    --rollout-backend sglang builds it) and a native engine over a zeroed full-depth model beside it."""
    from megatron.core import parallel_state as ps

    from megatron_fp4.resq import RolloutPrecision
    from megatron_fp4.rl.config import RolloutConfig
    from megatron_fp4.rl.rollout_manager import RolloutManager
    from megatron_fp4.rollout import NativeRolloutEngine, RolloutEngine, WeightSyncStats
    from megatron_fp4.rollout.tp_group import FirstStageEngine

    bf16 = RolloutPrecision("bf16")

    class Recorder(RolloutEngine):
        precision = bf16
        pushed: dict = {}

        def generate(self, prompts, sampling_params):
            raise AssertionError("not generating here")

        def update_weights(self, named_tensors):
            self.pushed = {n: t.clone() for n, t in named_tensors}
            return WeightSyncStats(num_tensors=len(self.pushed))

        def release_memory(self):
            pass

        def resume_memory(self):
            pass

    with torch.no_grad():
        for p in diagnostics_model.parameters():
            p.zero_()
    first = ps.is_pipeline_first_stage(ignore_virtual=True)
    recorder = Recorder() if first else None
    engine = FirstStageEngine(recorder, bf16, ps.get_pipeline_model_parallel_group())
    manager = RolloutManager(RolloutConfig(), engine, tokenizer=None, train_examples=[None], seed=0,
                             diagnostics_engine=NativeRolloutEngine(diagnostics_model, bf16))
    metrics = manager.sync_weights(stage, step=1, last_checkpoint=None)
    diag = dict(manager.diagnostics_engine.model.named_parameters())
    return {"sync/pushed_whole_depth_on_first_stage": (not first or (
                sorted(recorder.pushed) == sorted(full_state)
                and all(torch.equal(t, full_state[n]) for n, t in recorder.pushed.items()))),
            "sync/pushed_count_logged": metrics["rollout/weight_sync_tensors"] == (len(full_state) if first else 0),
            "sync/diagnostics_engine_whole_depth": all(torch.equal(p, full_state[n]) for n, p in diag.items())}


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pp_gather"))
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    with socket.socket() as sock:  # an explicit free port: "--master-port 0" can hang the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                        "127.0.0.1", "--master-port", str(port), os.path.abspath(__file__), "--out", out],
                       check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    with open(os.path.join(out, "checks.json")) as f:
        return json.load(f)


def test_gathered_stages_equal_the_full_model(checks):
    assert len(checks) == 2 * 2 * 10
    failed = sorted(k for k, ok in checks.items() if not ok)
    assert not failed, failed


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    worker(ap.parse_args().out)
