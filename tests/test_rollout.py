"""Native rollout engine on a tiny megatron-core GPTModel (CPU, fp32): logprobs vs a teacher-forced forward in the
same rollout precision, greedy determinism, BF16 greedy vs the megatron-core forward, seeded sampling, weight sync,
memory release, the precision swap and per-layer underflow diagnostics."""

from __future__ import annotations

import pytest
import torch

from megatron_fp4.models import build_gpt_model
from megatron_fp4.parallel import initialize_parallel
from megatron_fp4.recipe import HiF4BlockScaling, fp4_autocast
from megatron_fp4.resq import RolloutPrecision, paper_rollout_precisions, rollout_linear
from megatron_fp4.rollout import (
    NativeRolloutEngine,
    RolloutEngine,
    RolloutUnderflowMonitor,
    SamplingParams,
    filter_logits,
    sample_tokens,
    full_forward_logits,
    rollout_linear_modules,
    rollout_precision,
    teacher_forced_logprobs,
)
from megatron_fp4.rollout.precision import RolloutLinearMixin
from rollout_helpers import VOCAB, random_prompts, tiny_gpt_args

STOP = (3, 4, 5)


@pytest.fixture(scope="module")
def model():
    initialize_parallel(1, 1, seed=1234)
    return build_gpt_model(tiny_gpt_args())


@pytest.fixture(scope="module")
def prompts():
    return random_prompts((5, 9, 3, 6, 3))


PRECISIONS = [
    RolloutPrecision("bf16"),
    RolloutPrecision("w4a16", "hif4"),
    RolloutPrecision("w16a4", "mxfp4"),
    RolloutPrecision("w4a4", "hif4"),
    RolloutPrecision("w4a4", "mxfp4"),
    RolloutPrecision("w4a4", "hif4", "2:4"),
    RolloutPrecision("w4a4", "mxfp4", "2:4"),
    RolloutPrecision("w4a4", "hif4", "2:4", resq_combine="bf16"),
    RolloutPrecision("w4a4", "hif4", "dense"),
    RolloutPrecision("w4a4", "mxfp4", activation_method="occ"),
]


def _check_sample_shape(samples, params):
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) >= 1
        assert s.finish_reason in ("stop", "length")
        if s.finish_reason == "stop":
            assert s.token_ids[-1] in params.stop_token_ids
            assert not set(s.token_ids[:-1]) & set(params.stop_token_ids)
        else:
            assert len(s.token_ids) == params.max_new_tokens
        assert all(lp <= 0.0 for lp in s.logprobs)


@pytest.mark.parametrize("prefill", ["padded", "aligned"])
@pytest.mark.parametrize("precision", PRECISIONS, ids=lambda p: p.label)
def test_logprobs_match_teacher_forced(model, prompts, precision, prefill):
    engine = NativeRolloutEngine(model, precision, max_batch_size=3, prefill=prefill)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, max_new_tokens=10, stop_token_ids=STOP, seed=3)
    samples = engine.generate(prompts, params)
    _check_sample_shape(samples, params)
    ref = teacher_forced_logprobs(model, prompts, [s.token_ids for s in samples], precision, temperature=0.9)
    diff = max(abs(a - b) for s, r in zip(samples, ref) for a, b in zip(s.logprobs, r))
    assert diff < 1e-4, (precision.label, diff)
    assert engine.last_generate_stats["generated_tokens"] == sum(len(s.token_ids) for s in samples)


@pytest.mark.parametrize("precision", [RolloutPrecision("bf16"), RolloutPrecision("w4a4", "hif4", "2:4")],
                         ids=lambda p: p.label)
def test_greedy_is_deterministic_and_batch_independent(model, prompts, precision):
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=STOP)
    a = NativeRolloutEngine(model, precision).generate(prompts, params)
    b = NativeRolloutEngine(model, precision).generate(prompts, params)
    c = NativeRolloutEngine(model, precision, max_batch_size=1).generate(prompts, params)
    d = NativeRolloutEngine(model, precision, prefill="aligned").generate(prompts, params)
    assert [s.token_ids for s in a] == [s.token_ids for s in b] == [s.token_ids for s in c] == [s.token_ids for s in d]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]
    for x, y, z in zip(a, c, d):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5
        assert max(abs(p - q) for p, q in zip(x.logprobs, z.logprobs)) < 1e-5


def _greedy_by_recompute(model, prompt, max_new, stop):
    """Greedy decoding by argmax of a full-sequence megatron-core forward at every step (no KV cache)."""
    seq = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            tok = int(full_forward_logits(model, [seq])[0, -1].argmax())
            out.append(tok)
            seq.append(tok)
            if tok in stop:
                break
    return out


def test_bf16_greedy_equals_megatron_core_forward(model, prompts):
    model.eval()
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=STOP)
    samples = NativeRolloutEngine(model, RolloutPrecision("bf16")).generate(prompts, params)
    for p, s in zip(prompts, samples):
        assert s.token_ids == _greedy_by_recompute(model, p, 12, STOP)
    assert sum(len(s.token_ids) for s in samples) > 3 * len(prompts)  # not everything stops at once


def test_rollout_ignores_training_recipe():
    # a model trained in FP4 (config recipe) still rolls out in the rollout precision only
    initialize_parallel(1, 1, seed=99)
    fp4_model = build_gpt_model(tiny_gpt_args(fp4_recipe=HiF4BlockScaling())).eval()
    seqs = [[7, 8, 9, 10, 11, 12]]
    with torch.no_grad():
        with fp4_autocast(enabled=False):
            hp = full_forward_logits(fp4_model, seqs)
        trained_fp4 = full_forward_logits(fp4_model, seqs)  # the training recipe: Q(X) Q(W)^T
        with rollout_precision(fp4_model, RolloutPrecision("bf16")):
            assert torch.equal(full_forward_logits(fp4_model, seqs), hp)
        with rollout_precision(fp4_model, RolloutPrecision("w4a4", "hif4")):
            # the W4A4 rollout form is the training fprop (same format, same quantization along K)
            torch.testing.assert_close(full_forward_logits(fp4_model, seqs), trained_fp4, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hp, trained_fp4)


def test_precision_swap_and_restore(model):
    linears = rollout_linear_modules(model)
    assert sorted({n.split(".")[-1] for n in linears}) == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]
    assert len(linears) == 8 and "output_layer" not in linears
    classes = {n: type(m) for n, m in linears.items()}
    p = RolloutPrecision("w4a4", "mxfp4", "2:4")
    fc2 = linears["decoder.layers.1.mlp.linear_fc2"]
    x = torch.randn(5, 2, fc2.weight.shape[1])
    with torch.no_grad(), rollout_precision(model, p):
        assert all(isinstance(m, RolloutLinearMixin) for m in linears.values())
        y, _ = fc2(x)
        torch.testing.assert_close(y, rollout_linear(x, fc2.weight, None, p))
        with rollout_precision(model, RolloutPrecision("bf16")):
            yb, _ = fc2(x)
        torch.testing.assert_close(yb, x @ fc2.weight.t())
        assert fc2.rollout_precision == p  # nested context restored the outer precision
    assert {n: type(m) for n, m in linears.items()} == classes


def test_seeded_sampling_is_reproducible(model, prompts):
    engine = NativeRolloutEngine(model, RolloutPrecision("w4a4", "hif4", "2:4"))
    mk = lambda seed: SamplingParams(temperature=1.0, max_new_tokens=8, seed=seed)  # noqa: E731
    a, b, c = engine.generate(prompts, mk(11)), engine.generate(prompts, mk(11)), engine.generate(prompts, mk(12))
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]
    assert [s.token_ids for s in a] != [s.token_ids for s in c]


def test_weight_sync_quantizes_once_and_matches_source(prompts):
    initialize_parallel(1, 1, seed=1)
    trainer = build_gpt_model(tiny_gpt_args())
    initialize_parallel(1, 1, seed=2)
    rollout_model = build_gpt_model(tiny_gpt_args())
    precision = RolloutPrecision("w4a4", "hif4", "2:4")
    engine = NativeRolloutEngine(rollout_model, precision)
    assert isinstance(engine, RolloutEngine)
    cache = engine.weight_cache
    assert len(cache) == 8
    stats = engine.update_weights(trainer.named_parameters())
    assert stats.num_tensors == len(list(trainer.parameters())) and stats.num_bytes > 0
    assert stats.total_seconds >= stats.quantize_seconds > 0.0 and stats.extra["quantized_weights"] == 8
    assert set(stats.as_metrics()) >= {"rollout/weight_sync_total_s", "rollout/weight_sync_quantize_s"}
    calls = cache.quantize_calls
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    synced = engine.generate(prompts, params)
    assert cache.quantize_calls == calls  # no re-quantization per token
    expected = NativeRolloutEngine(trainer, precision).generate(prompts, params)
    assert [s.token_ids for s in synced] == [s.token_ids for s in expected]
    with pytest.raises(KeyError, match="unknown parameter"):
        engine.update_weights([("decoder.nope.weight", torch.zeros(1))])
    name, p = next(iter(trainer.named_parameters()))
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([(name, torch.zeros(p.shape[0] + 1))])
    # a model shared with the trainer: weights updated in place, update_weights(None) only re-quantizes
    shared = NativeRolloutEngine(trainer, precision)
    with torch.no_grad():
        for q in trainer.parameters():
            q.data.mul_(1.5)  # .data writes are invisible to the version counter
    s2 = shared.update_weights(None)
    assert s2.num_tensors == 0 and s2.quantize_seconds > 0
    again = shared.generate(prompts, params)
    ref = teacher_forced_logprobs(trainer, prompts, [s.token_ids for s in again], precision, temperature=1.0)
    assert max(abs(a - b) for s, r in zip(again, ref) for a, b in zip(s.logprobs, r)) < 1e-4


def test_release_and_resume_memory(model, prompts):
    engine = NativeRolloutEngine(model, RolloutPrecision("w4a16", "mxfp4"))
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(prompts, params)
    engine.release_memory()
    assert len(engine.weight_cache) == 0
    engine.resume_memory()
    assert len(engine.weight_cache) == 8
    assert [s.token_ids for s in engine.generate(prompts, params)] == [s.token_ids for s in before]


def test_length_limits_and_validation(model):
    aligned = NativeRolloutEngine(model, RolloutPrecision(), max_seq_len=12, prefill="aligned")
    out = aligned.generate([[7] * 10, [8] * 4], SamplingParams(temperature=0.0, max_new_tokens=20))
    assert len(out[0].token_ids) == 2 and out[0].finish_reason == "length"  # capped by max_seq_len
    assert len(out[1].token_ids) == 8 and out[1].prompt_length == 4
    engine = NativeRolloutEngine(model, RolloutPrecision(), max_seq_len=12)  # padded: the cap is on padded length
    out = engine.generate([[7] * 10, [8] * 4], SamplingParams(temperature=0.0, max_new_tokens=20))
    assert [len(o.token_ids) for o in out] == [2, 2] and {o.finish_reason for o in out} == {"length"}
    with pytest.raises(ValueError, match="prefill"):
        NativeRolloutEngine(model, prefill="left")
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([[7] * 12], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[VOCAB]], SamplingParams())
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(max_new_tokens=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert engine.generate([], SamplingParams()) == []


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.7)).tolist() == [[False, False, True, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.71)).tolist() == [[False, False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.1)).tolist() == [[False, True, True, True, True]]
    # top_k=1 (and a tiny top_p) sampling is argmax; the logprob is of the untruncated tempered distribution
    logits = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    for params in (SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=0.7, top_p=1e-6)):
        toks, lps = sample_tokens(logits, params, torch.Generator().manual_seed(0))
        assert torch.equal(toks, logits.argmax(-1))
        torch.testing.assert_close(lps, torch.log_softmax(logits / 0.7, -1).gather(-1, toks[:, None])[:, 0])


def test_underflow_monitor_per_layer(model, prompts):
    engine = NativeRolloutEngine(model, paper_rollout_precisions("mxfp4")["FP4"])
    with RolloutUnderflowMonitor(model, "mxfp4", "2:4") as mon:
        engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4))
    counts = mon.counts()
    rates = mon.collect()
    assert set(rates) == set(rollout_linear_modules(model))
    for name, r in rates.items():
        nz, u_fp4, u_resq = counts[name]
        assert nz > 0 and 0 <= u_resq <= u_fp4
        assert 0.0 <= r["resq"] <= r["fp4"] <= 1.0
    assert sum(c[1] for c in counts.values()) > sum(c[2] for c in counts.values())
    assert mon.collect() == {}  # reset after collect
    # the engine's shortcut measures the same thing in its own format
    direct = engine.measure_underflow(prompts, SamplingParams(temperature=0.0, max_new_tokens=4), "2:4")
    assert direct.keys() == rates.keys()
    for name in rates:
        assert direct[name] == pytest.approx(rates[name])


@pytest.mark.parametrize("sparsity", ["channel", "tile32x64"])
def test_batch_dependent_sparsities_run(model, prompts, sparsity):
    # "channel"/"tile32x64" select over the tokens of each call, so a token's numbers depend on its batch (no
    # teacher-forced identity); check they run, give valid samples and differ from plain FP4 somewhere
    p = RolloutPrecision("w4a4", "hif4", sparsity)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    samples = NativeRolloutEngine(model, p).generate(prompts, params)
    _check_sample_shape(samples, params)
    plain = NativeRolloutEngine(model, RolloutPrecision("w4a4", "hif4")).generate(prompts, params)
    assert [s.logprobs for s in samples] != [s.logprobs for s in plain]


def test_kernel_backend_adapter_plan_and_fallback(model, prompts, monkeypatch):
    pytest.importorskip("megatron_fp4.kernels.dispatch")
    from megatron_fp4.kernels import _common
    from megatron_fp4.resq import ROLLOUT_LINEAR_PATHS, rollout_backend_for
    from megatron_fp4.rollout_kernels import _plan, register_kernel_backend, unregister_kernel_backend

    fmts = ("hif4", "mxfp4")
    fp4 = dict(activations="fp4", resq_combine="exact")
    assert _plan(RolloutPrecision("w4a4", "hif4", "2:4"), torch.bfloat16, fmts) == dict(fp4, resq="2:4")
    assert _plan(RolloutPrecision("w4a4", "hif4", "2:4", resq_combine="bf16"), torch.bfloat16, fmts) == dict(
        fp4, resq="2:4", resq_combine="bf16")
    assert _plan(RolloutPrecision("w4a4", "mxfp4"), torch.float32, fmts) == dict(fp4, resq="none")
    assert _plan(RolloutPrecision("w4a16", "hif4"), torch.bfloat16, fmts) == dict(activations="bf16")
    assert _plan(RolloutPrecision("w4a16", "hif4"), torch.float32, fmts) is None  # kernel would round x to bf16
    for p in (RolloutPrecision("w16a4", "hif4"), RolloutPrecision("w4a4", "hif4", "dense"),
              RolloutPrecision("w4a4", "hif4", activation_method="occ"), RolloutPrecision("w4a4", "nvfp4")):
        assert _plan(p, torch.bfloat16, fmts) is None
    # on CPU tensors without Triton's interpreter the registered backend declines and the reference runs (the
    # kernels through the backend, interpreted, are tests/test_kernels.py's and test_rollout_static.py's: minutes
    # here). Only kernels_usable is told so: TRITON_INTERPRET itself stays, since Triton reads it where a module's
    # kernels are defined, and a module first imported under 0 would keep compiled kernels for the later tests.
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    precision = RolloutPrecision("w4a4", "mxfp4", "2:4")
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    ref = NativeRolloutEngine(model, precision).generate(prompts, params)
    assert register_kernel_backend("cpu")
    try:
        assert rollout_backend_for("cpu") is not None
        before = dict(ROLLOUT_LINEAR_PATHS)
        got = NativeRolloutEngine(model, precision).generate(prompts, params)
    finally:
        unregister_kernel_backend("cpu")
    assert ROLLOUT_LINEAR_PATHS["backend"] == before["backend"]
    assert ROLLOUT_LINEAR_PATHS["reference"] > before["reference"]
    assert [s.token_ids for s in got] == [s.token_ids for s in ref]
