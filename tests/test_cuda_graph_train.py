"""Training with megatron-core's CUDA graphs (``cuda_graph_impl="local"``: each transformer layer's forward and
backward captured once, replayed every micro-batch) gives the eager path's GRPO losses and gradients, for BF16 and
the FP4 recipes on the Triton kernels, across optimizer steps that rewrite the weights in place: the graphs read the
FP4 weights from persistent buffers that ``ops.refresh_persistent_weights`` rewrites once per schedule (one graph of
its own), so a replay sees the new weights without quantizing them per micro-batch. After capture no FP4 host
code runs: the graphs replace the linears' Python and kernel launches (why the FP4 step was host-bound on the
H200, docs/PERFORMANCE.md)."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from megatron_fp4 import ops
from megatron_fp4.models import GPTModelArgs, build_gpt_model, gpt_transformer_config
from megatron_fp4.parallel import initialize_parallel, set_seed
from megatron_fp4.recipe import recipe_for_format
from megatron_fp4.rl import actor, grpo

pytestmark = pytest.mark.gpu


def _batches(vocab, n=2, B=2, T=128):
    g = torch.Generator().manual_seed(0)
    return [{"inputs": torch.randint(1, vocab, (B, T), generator=g),
             "labels": torch.randint(1, vocab, (B, T), generator=g), "mask": torch.ones(B, T),
             "logp_rollout": -torch.rand(B, T, generator=g), "advantages": torch.randn(B, generator=g)}
            for _ in range(n)]


@pytest.mark.parametrize("name", ["bf16", "hif4", "mxfp4", "mxfp4-fp8"])
def test_graphed_layers_match_eager_across_steps(name):
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord, delete_cuda_graphs

    initialize_parallel(1, 1, seed=5)
    fmt, _, mode = name.partition("-")
    recipe = None if fmt == "bf16" else dataclasses.replace(recipe_for_format(fmt), gemm_mode=mode or "exact")
    args = GPTModelArgs(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                        num_query_groups=2, vocab_size=512, max_seq_len=128, fp4_recipe=recipe,
                        params_dtype=torch.bfloat16, attention_backend="sdpa")
    loss_fn = partial(actor._grpo_loss, grpo.GRPOConfig(group_size=2, kl_beta=0.0))
    batches = _batches(args.vocab_size)

    set_seed(5, cuda_graphs=True)
    eager = build_gpt_model(args, config=gpt_transformer_config(args, calculate_per_token_loss=True))
    graphed = build_gpt_model(args, config=gpt_transformer_config(args, calculate_per_token_loss=True,
                                                                  cuda_graph_impl="local"))
    graphed_params = dict(graphed.named_parameters())  # the graphed model keeps layer 0's input norm fp32
    for name_, e in eager.named_modules():  # (models.gpt._norms_to_params_dtype): its eager twin does the same
        if isinstance(e, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            e.to(graphed_params[f"{name_}.weight"].dtype)
    graphed.load_state_dict(eager.state_dict())

    calls = {"quantize": 0}
    backend = ops.fp4_gemm_backend_for("cuda")
    if recipe is not None:  # count the FP4 linears' host calls (BF16 has none)
        orig = backend.quantize_both

        def counting_quantize_both(x, f, m, b_cols=False):
            calls["quantize"] += 1
            return orig(x, f, m, b_cols)

        backend.quantize_both = counting_quantize_both

    def step(model):
        model.zero_grad(set_to_none=True)
        store = actor.run_schedule(model, batches, loss_fn, forward_only=False)
        loss = [float(d["loss"]) for d in store]
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():  # SGD, in place (what megatron's optimizer does to the model's parameters)
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.5)
        return loss, grads

    try:
        history = []
        for i in range(4):  # graphed: step 0 records and captures (eager numbers), steps 1-3 replay
            want_loss, want_grad = step(eager)
            calls["quantize"] = 0
            got_loss, got_grad = step(graphed)
            history.append(want_loss)
            if i == 0:
                assert _CudagraphGlobalRecord.cudagraph_created, "no CUDA graphs were captured"
                if recipe is not None:  # W and W^T of the 2 x 4 linears, held for the graphs
                    assert len(ops._PERSISTENT.entries) == 16, len(ops._PERSISTENT.entries)
            elif recipe is not None:
                assert calls["quantize"] == 0, "FP4 host code ran: the layers were not replayed from their graphs"
            moved = max(abs(a - b) for a, b in zip(history[-1], history[0])) if i else None
            for a, b in zip(got_loss, want_loss):
                assert abs(a - b) <= 1e-3 * max(abs(b), 1e-3), (i, got_loss, want_loss)
            if moved is not None:  # the weights moved enough that stale weights in a graph would show
                assert moved > 20 * max(abs(a - b) for a, b in zip(got_loss, want_loss)), (i, history)
            assert set(got_grad) == set(want_grad)
            for n, g in want_grad.items():
                rel = float((got_grad[n] - g).norm() / max(float(g.norm()), 1e-12))
                assert rel < 2e-2, (i, n, rel)  # flash attention's backward is not bit-deterministic
    finally:
        if recipe is not None:
            del backend.quantize_both
        delete_cuda_graphs()
        ops.clear_persistent_weights()
        torch.cuda.set_stream(torch.cuda.default_stream())
        set_seed(5)


def test_driver_with_cuda_graphs(tmp_path):
    """``pretrain_rl.py --cuda-graph-impl local``: the first GRPO step (micro-batches of 6 padded to one shape: 16
    samples make 6 + 6 + 4; graphs recorded, then captured) logs the eager run's losses and gradient norm; in the
    replayed steps the training log-probs stay as close to the BF16 rollout's as the eager run's (stale weights in a
    graph would not); an HiF4 run trains under the graphs too."""
    import json
    import math
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests"),
                                                       os.environ.get("PYTHONPATH", "")]))
    tiny = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--num-synthetic-examples", "600", "--eval-samples", "32",
            "--rollout-batch-size", "4", "--group-size", "4", "--micro-batch-size", "6", "--sft-iters", "0",
            "--max-response-length", "6", "--eval-interval", "100", "--seed", "7", "--train-iters", "3",
            "--init", "random", "--custom-rm-path", "custom_rewards.rank_in_group", "--group-rm", "--bf16",
            "--rollout-precision", "bf16", "--resq", "none"]
    rows = {}
    for name, extra in (("eager", ["--no-fp4-train"]), ("graphs", ["--no-fp4-train", "--cuda-graph-impl", "local"]),
                        ("hif4_graphs", ["--cuda-graph-impl", "local"])):
        log = tmp_path / f"{name}.jsonl"
        r = subprocess.run([sys.executable, os.path.join(root, "pretrain_rl.py"), *tiny, *extra, "--log-jsonl",
                            str(log)], env=env, cwd=root, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        rows[name] = [json.loads(line) for line in open(log) if '"train"' in line]
        assert len(rows[name]) == 3, rows[name]
    a, b = rows["eager"][0], rows["graphs"][0]
    assert a["reward_mean"] == b["reward_mean"]  # same starting weights: the same rollout
    for k in ("loss", "grad_norm", "entropy_mean"):
        assert math.isclose(a[k], b[k], rel_tol=2e-2, abs_tol=1e-4), (k, a[k], b[k])
    for a, b in zip(rows["eager"][1:], rows["graphs"][1:]):
        assert b["logp_abs_diff_mean"] <= 3 * a["logp_abs_diff_mean"] + 1e-3, (a, b)
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows["hif4_graphs"])
