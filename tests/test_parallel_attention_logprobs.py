"""Tensor parallelism (torchrun, gloo, CPU, TP=2) of the fused attention and the vocab-parallel log-probs: a GPTModel
with SDPA attention equals the unfused one (logits and gradients within 1e-5, fp32); log-probs, entropy and their
gradients from each rank's vocabulary shard equal the full-vocabulary reference (fp32 and bf16 logits); the actor's
GRPO and NLL losses on vocab-parallel logits equal the reference losses on gathered logits, gradients included, and
THD-packed micro-batches equal padded ones. This file is also the worker script:
``torchrun --nproc-per-node 2 tests/test_parallel_attention_logprobs.py --out DIR``."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 96

pytestmark = pytest.mark.slow  # one torchrun launch of two processes, about a minute on 2 cores


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _margs(**kw):
    from megatron_fp4.models import GPTModelArgs

    return GPTModelArgs(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                        vocab_size=VOCAB, max_seq_len=32, add_qkv_bias=True, init_method_std=0.08, **kw)


def _batch(b: int = 3, s: int = 17) -> dict:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (b, s + 1), generator=g)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, 12:] = False
    mask[2, :5] = False
    return {"inputs": ids[:, :-1], "labels": ids[:, 1:], "mask": mask,
            "logp_rollout": -torch.rand(b, s, generator=g) * 4, "advantages": torch.randn(b, generator=g),
            "logp_old": -torch.rand(b, s, generator=g) * 4, "logp_ref": -torch.rand(b, s, generator=g) * 4}


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _attention(res: dict) -> None:
    """SDPA vs unfused GPTModel at TP=2: this rank's vocab-parallel logits and parameter gradients."""
    from megatron_fp4.models import build_gpt_model

    local = build_gpt_model(_margs(attention_backend="local"))
    sdpa = build_gpt_model(_margs(attention_backend="sdpa"))
    sdpa.load_state_dict(local.state_dict())
    b = _batch()
    pos = torch.arange(b["inputs"].shape[1])[None].expand_as(b["inputs"])
    w = torch.randn(*b["inputs"].shape, VOCAB // 2, generator=torch.Generator().manual_seed(5 + _rank()))
    out = {}
    for name, m in (("local", local), ("sdpa", sdpa)):
        logits = m(b["inputs"], pos, None)
        (logits * w).sum().backward()
        out[name] = logits.detach(), _grads(m)
    res["attn_logits_rel"] = _rel(out["sdpa"][0], out["local"][0])
    res["attn_grad_rel"] = {n: _rel(out["sdpa"][1][n], g) for n, g in out["local"][1].items()}
    res["attn_shard_shape"] = tuple(out["sdpa"][0].shape)


def _rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank()


def _functions(res: dict) -> None:
    """vocab_parallel_logprobs / _entropy on this rank's shard vs the full-vocabulary reference."""
    from megatron.core import parallel_state as ps

    from megatron_fp4.rl.grpo import entropy_from_logits, token_logprobs
    from megatron_fp4.rl.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs

    group, rank = ps.get_tensor_model_parallel_group(), _rank()
    g = torch.Generator().manual_seed(3)
    full = torch.randn(5, 7, 2 * 50, generator=g) * 4
    full[0, 0, 77] = 40.0  # a peaked row whose max sits on the second shard
    target = torch.randint(0, 100, (5, 7), generator=g)
    target[1, :] = 49  # the shard boundary
    target[2, :] = 50
    up = torch.randn(5, 7, generator=g)
    sl = slice(rank * 50, (rank + 1) * 50)
    for dtype, name, fused in ((torch.float32, "fp32", False), (torch.bfloat16, "bf16", False),
                               (torch.float32, "fused_fp32", True), (torch.bfloat16, "fused_bf16", True)):
        x = full.to(dtype)
        ref_in = x.clone().requires_grad_()
        ref = token_logprobs(ref_in, target)
        (ref * up).sum().backward()
        shard = x[..., sl].clone().requires_grad_()
        lp = vocab_parallel_logprobs(shard, target, group, chunk_rows=4, fused=fused)
        (lp * up).sum().backward()
        res[f"{name}_logp"] = (lp.detach(), ref.detach())
        res[f"{name}_grad"] = (shard.grad, ref_in.grad[..., sl])
        res[f"{name}_entropy"] = (vocab_parallel_entropy(shard, group, chunk_rows=4, fused=fused),
                                  entropy_from_logits(x))


def _losses(res: dict) -> None:
    """The actor's GRPO / NLL losses on vocab-parallel logits vs the reference losses on gathered logits."""
    from megatron_fp4.models import build_gpt_model
    from megatron_fp4.rl import actor, grpo

    par = build_gpt_model(_margs(attention_backend="local"), parallel_output=True)
    full = build_gpt_model(_margs(attention_backend="local"), parallel_output=False)
    full.load_state_dict(par.state_dict())
    b = _batch()
    pos = torch.arange(b["inputs"].shape[1])[None].expand_as(b["inputs"])
    cfg = grpo.GRPOConfig(group_size=3, kl_beta=0.01)

    def ref_grpo(batch, logits):
        lp = grpo.token_logprobs(logits, batch["labels"])
        tok = grpo.grpo_token_loss(lp, batch["logp_old"], batch["logp_rollout"], batch["advantages"], batch["mask"],
                                   logp_ref=batch["logp_ref"], **cfg.loss_kwargs())
        ent = grpo.entropy_from_logits(logits.detach())
        return tok.sum(), float((ent * batch["mask"]).sum() / batch["mask"].sum())

    for kind in ("grpo", "nll"):
        for m in (par, full):
            m.zero_grad(set_to_none=True)
        logits = par(b["inputs"], pos, None)
        if kind == "grpo":
            loss, _, mets = actor._grpo_loss(cfg, b, logits)
            ent = float(mets["entropy_mean"]) / float(mets["num_tokens"])
        else:
            loss, _, _ = actor._nll_loss(b, logits)
        loss.backward()
        flogits = full(b["inputs"], pos, None)
        if kind == "grpo":
            rloss, rent = ref_grpo(b, flogits)
            res["entropy_mean"] = (ent, rent)
        else:
            lp = grpo.token_logprobs(flogits, b["labels"])
            rloss = -(lp * b["mask"]).sum()
        rloss.backward()
        res[f"{kind}_loss"] = (float(loss), float(rloss))
        res[f"{kind}_grad_rel"] = {n: _rel(g, _grads(full)[n]) for n, g in _grads(par).items()}
        res[f"{kind}_logits_shape"] = (tuple(logits.shape), tuple(flogits.shape))


def _packing(res: dict) -> None:
    """The actor's GRPO loss through megatron's schedule, THD-packed vs padded micro-batches (SDPA attention)."""
    from functools import partial

    from megatron_fp4.models import build_gpt_model, gpt_transformer_config
    from megatron_fp4.rl import actor, grpo

    args = _margs(attention_backend="sdpa")
    model = build_gpt_model(args, config=gpt_transformer_config(args, calculate_per_token_loss=True))
    b = _batch()
    b["inputs"][1, 12:] = 0  # right padding after row 1's last loss token
    loss_fn = partial(actor._grpo_loss, grpo.GRPOConfig(group_size=3, kl_beta=0.01))
    out = {}
    for pack in (False, True):
        model.zero_grad(set_to_none=True)
        store = actor.run_schedule(model, [dict(b)], loss_fn, forward_only=False, pack=pack)
        out[pack] = float(store[0]["loss"]), _grads(model)
    res["packed_loss"] = (out[True][0], out[False][0])
    res["packed_grad_rel"] = {n: _rel(g, out[False][1][n]) for n, g in out[True][1].items()}


def worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    from megatron_fp4.parallel import initialize_parallel

    initialize_parallel(tensor_model_parallel_size=int(os.environ.get("WORLD_SIZE", "1")), seed=0)
    res = {"tp": torch.distributed.get_world_size()}
    _attention(res)
    _functions(res)
    _losses(res)
    _packing(res)
    torch.save(res, os.path.join(out_dir, f"rank{torch.distributed.get_rank()}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("attn_logprobs_tp"))
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    with socket.socket() as sock:  # an explicit free port: "--master-port 0" can hang the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                        "127.0.0.1", "--master-port", str(port), os.path.abspath(__file__), "--out", out],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]


def test_sdpa_gpt_model_equals_unfused_at_tp2(results):
    for r in results:
        assert r["tp"] == 2 and r["attn_shard_shape"] == (3, 17, VOCAB // 2)
        assert r["attn_logits_rel"] < 1e-5
        assert len(r["attn_grad_rel"]) == 17
        for name, rel in r["attn_grad_rel"].items():
            assert rel < 1e-5, (name, rel)


@pytest.mark.parametrize("fused", ["", "fused_"])
def test_vocab_parallel_functions_equal_the_reference_fp32(results, fused):
    """fused_: the fused kernels (megatron_fp4.kernels.logprobs, Triton's interpreter here), equal up to fp32
    summation order."""
    tol = {"logp": 1e-6, "grad": 1e-7, "entropy": 1e-6} if not fused else {"logp": 2e-6, "grad": 1e-7, "entropy": 1e-5}
    for r in results:
        lp, ref = r[f"{fused}fp32_logp"]
        torch.testing.assert_close(lp, ref, rtol=1e-6, atol=tol["logp"])
        got, want = r[f"{fused}fp32_grad"]
        torch.testing.assert_close(got, want, rtol=1e-6 if not fused else 1e-5, atol=tol["grad"])
        ent, ref_ent = r[f"{fused}fp32_entropy"]
        torch.testing.assert_close(ent, ref_ent, rtol=1e-6, atol=tol["entropy"])


@pytest.mark.parametrize("fused", ["", "fused_"])
def test_vocab_parallel_functions_bf16_logits(results, fused):
    """bf16 logits: both compute in fp32 from the same bf16 values; the gradients round to bf16. fused_: the fused
    kernels (megatron_fp4.kernels.logprobs, Triton's interpreter here) on each shard, their statistics combined
    over TP."""
    for r in results:
        lp, ref = r[f"{fused}bf16_logp"]
        torch.testing.assert_close(lp, ref, rtol=1e-6, atol=1e-6)
        got, want = r[f"{fused}bf16_grad"]
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-6)
        ent, ref_ent = r[f"{fused}bf16_entropy"]
        torch.testing.assert_close(ent, ref_ent, rtol=1e-6, atol=1e-6 if not fused else 1e-5)


@pytest.mark.parametrize("kind", ["grpo", "nll"])
def test_actor_losses_on_vocab_parallel_logits(results, kind):
    for r in results:
        (shard, full) = r[f"{kind}_logits_shape"]
        assert shard == (3, 17, VOCAB // 2) and full == (3, 17, VOCAB)
        loss, ref = r[f"{kind}_loss"]
        assert abs(loss - ref) <= 1e-6 * abs(ref), (loss, ref)
        assert len(r[f"{kind}_grad_rel"]) == 17
        for name, rel in r[f"{kind}_grad_rel"].items():
            assert rel < 1e-5, (name, rel)
    ent, ref_ent = results[0]["entropy_mean"]
    assert abs(ent - ref_ent) <= 1e-6 * ref_ent
    assert results[0]["grpo_loss"] == results[1]["grpo_loss"]  # every TP rank holds the same loss


def test_packed_micro_batches_equal_padded_at_tp2(results):
    for r in results:
        loss, ref = r["packed_loss"]
        assert ref != 0 and abs(loss - ref) <= 1e-5 * abs(ref), (loss, ref)
        assert len(r["packed_grad_rel"]) == 17
        for name, rel in r["packed_grad_rel"].items():
            assert rel < 1e-5, (name, rel)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    worker(ap.parse_args().out)
