"""Chunked log-probs and entropy (megatron_fp4.rl.logprobs) at TP = 1: bit for bit the full-vocabulary references
grpo.token_logprobs / entropy_from_logits (forward and gradient, fp32 and bf16 logits, any chunking), with no fp32
tensor larger than one chunk; the actor's GRPO and NLL losses unchanged bit for bit. TP = 2 (vocabulary shards) is in
tests/test_parallel_attention_logprobs.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_fp4.rl import actor, grpo
from megatron_fp4.rl.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs


def _logits(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3
    x[..., 0, 5] = 30.0  # a peaked row
    return x.to(dtype)


def _against_reference(x, vocab, **kw):
    """(reference log-probs, vocab_parallel_logprobs(**kw), their gradients) for random targets below ``vocab``."""
    target = torch.randint(0, vocab, x.shape[:-1], generator=torch.Generator().manual_seed(1))
    up = torch.randn(*x.shape[:-1], generator=torch.Generator().manual_seed(2))
    ref_in, new_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, new = grpo.token_logprobs(ref_in, target), vocab_parallel_logprobs(new_in, target, **kw)
    (ref * up).sum().backward()
    (new * up).sum().backward()
    return ref, new, ref_in, new_in, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [None, 1, 3, 7])
def test_bit_identical_to_the_reference(dtype, chunk_rows):
    x = _logits((4, 9, 101), dtype)
    ref, new, ref_in, new_in, _ = _against_reference(x, 101, chunk_rows=chunk_rows)
    assert new.dtype == torch.float32 and new.shape == (4, 9)
    assert torch.equal(new, ref)
    assert new_in.grad.dtype == dtype and torch.equal(new_in.grad, ref_in.grad)
    assert torch.equal(vocab_parallel_entropy(x, chunk_rows=chunk_rows), grpo.entropy_from_logits(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_equal_the_reference(dtype):
    """The fused path (megatron_fp4.kernels.logprobs: one read of the logits per pass; Triton's interpreter on the CPU,
    what CUDA tensors use by default) equals the references up to fp32 summation order, and the gradient up to one
    rounding of the logits' dtype; rows of -inf logits (a masked vocabulary) and a huge vocabulary block stay finite."""
    x = _logits((4, 9, 2500), dtype)
    x[1, 2, 100:2300] = -float("inf")
    ref, new, ref_in, new_in, target = _against_reference(x, 100, fused=True)
    torch.testing.assert_close(new, ref, rtol=1e-6, atol=2e-6)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6
    assert new_in.grad.dtype == dtype
    torch.testing.assert_close(new_in.grad.float(), ref_in.grad.float(), rtol=ulp, atol=1e-7)
    ent, ref_ent = vocab_parallel_entropy(x, fused=True), grpo.entropy_from_logits(x)
    assert torch.isnan(ref_ent[1, 2]) and torch.isfinite(ent).all() and torch.isfinite(new).all()  # 0 * -inf
    ok = torch.isfinite(ref_ent)
    torch.testing.assert_close(ent[ok], ref_ent[ok], rtol=1e-6, atol=1e-5)
    x[1, 2, 100:2300] = -1e4  # the same row with finite logits for the masked entries: the same entropy
    torch.testing.assert_close(ent[1, 2], grpo.entropy_from_logits(x)[1, 2], rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="fused=True: the fused log-prob kernels cannot run"):
        import os

        old = os.environ.pop("TRITON_INTERPRET", None)
        try:
            vocab_parallel_logprobs(x, target, fused=True)
        finally:
            if old is not None:
                os.environ["TRITON_INTERPRET"] = old


def test_non_contiguous_logits_and_shape_check():
    x = _logits((9, 4, 33), torch.float32).transpose(0, 1).requires_grad_()  # [4, 9, 33], not contiguous
    target = torch.randint(0, 33, (4, 9), generator=torch.Generator().manual_seed(1))
    lp = vocab_parallel_logprobs(x, target, chunk_rows=5)
    lp.sum().backward()
    ref_in = x.detach().clone().requires_grad_()
    grpo.token_logprobs(ref_in, target).sum().backward()
    assert torch.equal(lp, grpo.token_logprobs(x.detach(), target)) and torch.equal(x.grad, ref_in.grad)
    with pytest.raises(ValueError, match=r"logits \(4, 9, 33\) and target \(4, 8\) must agree"):
        vocab_parallel_logprobs(x, target[:, :8])


class _LargestFloat32(TorchDispatchMode):
    """The most elements of any fp32 tensor an op produces inside the block."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_full_vocabulary_fp32_tensor():
    """bf16 logits [64 tokens, 1000]: the reference makes [64, 1000] fp32 copies, the chunked path nothing larger
    than one chunk of 8 rows, forward and backward (entropy too)."""
    x = _logits((4, 16, 1000), torch.bfloat16)
    target = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(1))
    sizes = {}
    for name, fn in (("ref", lambda t: grpo.token_logprobs(t, target)),
                     ("new", lambda t: vocab_parallel_logprobs(t, target, chunk_rows=8))):
        t = x.clone().requires_grad_()
        with _LargestFloat32() as mode:
            fn(t).sum().backward()
        sizes[name] = mode.largest
    with _LargestFloat32() as mode:
        vocab_parallel_entropy(x, chunk_rows=8)
    assert sizes["ref"] == 64 * 1000
    assert sizes["new"] <= 8 * 1000 and mode.largest <= 8 * 1000


def _batch(b=4, t=11, vocab=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) > 0.2
    return {"labels": torch.randint(0, vocab, (b, t), generator=g), "mask": mask,
            "logp_rollout": -torch.rand(b, t, generator=g) * 3, "advantages": torch.randn(b, generator=g),
            "logp_old": -torch.rand(b, t, generator=g) * 3, "logp_ref": -torch.rand(b, t, generator=g) * 3}


def _reference_grpo_loss(cfg, batch, logits):
    """actor._grpo_loss as it was: full-vocabulary token_logprobs and entropy_from_logits."""
    lp = grpo.token_logprobs(logits, batch["labels"])
    m = batch["mask"]
    tok = grpo.grpo_token_loss(lp, batch.get("logp_old"), batch["logp_rollout"], batch["advantages"], m,
                               logp_ref=batch.get("logp_ref"), **cfg.loss_kwargs())
    with torch.no_grad():
        mets = grpo.grpo_metrics(lp, batch.get("logp_old"), batch["logp_rollout"], batch["advantages"], m,
                                 logp_ref=batch.get("logp_ref"), entropy=grpo.entropy_from_logits(logits),
                                 **cfg.loss_kwargs())
    return tok.sum(), mets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_actor_losses_unchanged_bit_for_bit(dtype):
    cfg = grpo.GRPOConfig(group_size=2, kl_beta=0.01)
    batch = _batch()
    x = _logits((4, 11, 37), dtype, seed=3)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss, n, mets = actor._grpo_loss(cfg, batch, a)
    ref, ref_mets = _reference_grpo_loss(cfg, batch, b)
    loss.backward()
    ref.backward()
    assert torch.equal(loss, ref) and torch.equal(a.grad, b.grad)
    assert int(n) == int(batch["mask"].sum())
    for k, v in ref_mets.items():
        if k not in ("num_tokens", "logp_abs_diff_max", "ratio_max"):
            assert float(mets[k]) == pytest.approx(v * float(n), rel=1e-6), k
    assert float(mets["entropy_mean"]) / float(n) == pytest.approx(ref_mets["entropy_mean"], rel=1e-6)
    a.grad = b.grad = None
    nll, _, _ = actor._nll_loss(batch, a)
    lp = grpo.token_logprobs(b, batch["labels"])
    ref_nll = -(lp * batch["mask"]).sum()
    nll.backward()
    ref_nll.backward()
    assert torch.equal(nll, ref_nll) and torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("tis", [True, False])
def test_grpo_loss_reads_nothing_back_to_the_host(tis, host_reads):
    """The per-micro-batch GRPO loss, its metrics and its backward never read a device value on the host (they used
    to, ~15 times per micro-batch); the statistics are read once per optimizer step, by reduce_token_stats."""
    cfg = grpo.GRPOConfig(group_size=2, kl_beta=0.01, use_tis=tis)
    batch = _batch()
    logits = _logits((4, 11, 37), torch.float32, seed=3).requires_grad_()
    with host_reads() as reads:
        loss, n, mets = actor._grpo_loss(cfg, batch, logits)
        loss.backward()
    assert reads.count == 0
    assert all(isinstance(v, torch.Tensor) for v in mets.values()) and {"loss", "ratio_max", "num_tokens"} <= set(mets)
    with host_reads() as reads:
        float(mets["loss"])
    assert reads.count == 1  # the counter does see a host read


@pytest.mark.gpu
def test_fused_kernels_on_the_gpu_at_the_qwen_vocabulary():
    """The fused kernels compiled for the GPU, on a Qwen2.5-sized vocabulary (151,936) and 2,048 bf16 rows: the same
    log-probs, gradients and entropy as the chunked PyTorch path; prints both paths' times (not asserted)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(2048, 151936, device="cuda", generator=g) * 3).to(torch.bfloat16)
    target = torch.randint(0, 151936, (2048,), device="cuda", generator=g)
    up = torch.randn(2048, device="cuda", generator=g)
    out = {}
    for fused in (False, True, False, True):  # the second round is timed (the first compiles)
        xi = x.clone().requires_grad_()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        lp = vocab_parallel_logprobs(xi, target, fused=fused)
        (lp * up).sum().backward()
        ent = vocab_parallel_entropy(x, fused=fused)
        end.record()
        torch.cuda.synchronize()
        out[fused] = (lp.detach(), xi.grad, ent, start.elapsed_time(end))
    print(f"logprobs + backward + entropy, 2048 x 151936 bf16: chunked {out[False][3]:.2f} ms, fused "
          f"{out[True][3]:.2f} ms")
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(out[True][1].float(), out[False][1].float(), rtol=2.0 ** -7, atol=1e-9)
    torch.testing.assert_close(out[True][2], out[False][2], rtol=1e-5, atol=1e-4)
