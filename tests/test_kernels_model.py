"""A whole megatron-core GPT model trained through the Triton kernel backend (CPU: Triton's interpreter; a GPU: the
kernels) gives the reference backend's GRPO losses and gradients: the FP4 linears' operands in both GEMM layouts,
the weight cache (W and W^T once per schedule), MXFP4's FP8 mode (E5M2 rows) and the actor's schedule over two
micro-batches, together, before any GPU time is spent on a benchmark."""

from __future__ import annotations

import dataclasses
import os
from functools import partial

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: kernels in the CPU interpreter

pytest.importorskip("triton")

from megatron_fp4 import ops  # noqa: E402
from megatron_fp4.models import GPTModelArgs, build_gpt_model, gpt_transformer_config  # noqa: E402
from megatron_fp4.ops.kernels_backend import KernelBackend  # noqa: E402
from megatron_fp4.parallel import initialize_parallel  # noqa: E402
from megatron_fp4.recipe import recipe_for_format  # noqa: E402
from megatron_fp4.rl import actor, grpo  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _batches(vocab):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        B, T = 2, 16
        mask = torch.ones(B, T)
        mask[:, :3] = 0
        out.append({"inputs": torch.randint(1, vocab, (B, T), generator=g),
                    "labels": torch.randint(1, vocab, (B, T), generator=g), "mask": mask,
                    "logp_rollout": -torch.rand(B, T, generator=g) * mask, "advantages": torch.randn(B, generator=g)})
    return out


@pytest.mark.parametrize("fmt,mode", [("hif4", "exact"), ("mxfp4", "exact"), ("mxfp4", "fp8")])
def test_model_losses_and_gradients_through_the_kernels(fmt, mode):
    initialize_parallel(1, 1, seed=5)
    recipe = dataclasses.replace(recipe_for_format(fmt), gemm_mode=mode)
    args = GPTModelArgs(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                        vocab_size=64, max_seq_len=32, init_method_std=0.08, fp4_recipe=recipe)
    model = build_gpt_model(args, config=gpt_transformer_config(args, calculate_per_token_loss=True))
    loss_fn = partial(actor._grpo_loss, grpo.GRPOConfig(group_size=2, kl_beta=0.0))

    def run():
        model.zero_grad(set_to_none=True)
        store = actor.run_schedule(model, _batches(64), loss_fn, forward_only=False)
        return ([float(d["loss"]) for d in store],
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    class Counting(KernelBackend):  # the kernels served the linears: both operand kinds, each weight's pair once
        calls = {"operands": 0, "weights": 0, "weight pairs": 0}

        def quantize_both(self, x, fmt, mode, b_cols=False):
            self.calls["operands"] += 1
            return super().quantize_both(x, fmt, mode, b_cols)

        def quantize(self, x, fmt, rounding, generator, mode, weight):
            self.calls["weights"] += int(weight)
            return super().quantize(x, fmt, rounding, generator, mode, weight)

        def quantize_weight_both(self, x, fmt, mode):
            self.calls["weight pairs"] += 1
            return super().quantize_weight_both(x, fmt, mode)

    with ops.use_reference_backend():
        want_loss, want_grad = run()
    prev = ops.fp4_gemm_backend_for(DEV)
    ops.register_fp4_gemm_backend(DEV, Counting())
    try:
        got_loss, got_grad = run()
    finally:
        ops.unregister_fp4_gemm_backend(DEV)
        if prev is not None:
            ops.register_fp4_gemm_backend(DEV, prev)
    linears = 4 * args.num_layers  # qkv, proj, fc1, fc2 per layer
    # X and dY per micro-batch; W and W^T once per schedule (two micro-batches), in one call
    assert Counting.calls == {"operands": 2 * 2 * linears, "weights": 0, "weight pairs": linears}
    tol = 1e-5 if DEV == "cpu" else 2e-2  # the interpreter's dots are exact fp32; a GPU's FP8 mode is not
    for a, b in zip(got_loss, want_loss):
        assert abs(a - b) <= tol * max(abs(b), 1e-6), (got_loss, want_loss)
    assert set(got_grad) == set(want_grad) and len(want_grad) > 10
    for n, g in want_grad.items():
        rel = float((got_grad[n] - g).norm() / max(float(g.norm()), 1e-12))
        assert rel < tol, (n, rel)
