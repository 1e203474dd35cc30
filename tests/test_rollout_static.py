"""The native engine's static-KV-cache paths (megatron_fp4/rollout/static_decode.py) against its megatron path.

CPU (fp32, "static": eager steps): greedy tokens and logprobs equal the megatron path's and a teacher-forced forward
up to fp32 rounding, with sequences capped and refilled, stop tokens, length limits, top-k/top-p sampling and
teacher forcing; the path selection (token-local precisions only, hooks) and argument checks; in-place weight
refresh. GPU (``gpu``): CUDA-graph decode against the eager static steps and the megatron path, and graphs that
survive a weight update.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_fp4.kernels import decode_ops
from megatron_fp4.kernels._common import pdl_enabled
from megatron_fp4.models import build_gpt_model
from megatron_fp4.parallel import initialize_parallel
from megatron_fp4.resq import QuantizedWeightCache, RolloutPrecision, copy_into
from megatron_fp4.rollout import (NativeRolloutEngine, RolloutUnderflowMonitor, SamplingParams,
                                  teacher_forced_logprobs)
from megatron_fp4.rollout.static_decode import StaticCacheGenerator, graph_sample, precision_is_token_local
from rollout_helpers import random_prompts, tiny_gpt_args


def _args(**kw):
    return tiny_gpt_args(**{"max_seq_len": 48, **kw})


@pytest.fixture(scope="module")
def model():
    initialize_parallel(1, 1, seed=1234)
    return build_gpt_model(_args())


@pytest.fixture(scope="module")
def prompts():
    return random_prompts((5, 9, 3, 6, 3, 11, 2))


def _assert_stops(prompts, samples, stops, max_new, max_seq):
    """Each sample ends at its first stop token ("stop") or runs to the length limit without one ("length")."""
    for p, s in zip(prompts, samples):
        assert len(s.token_ids) == len(s.logprobs) >= 1
        if s.finish_reason == "stop":
            assert s.token_ids[-1] in stops and not set(s.token_ids[:-1]) & set(stops)
        else:
            assert not set(s.token_ids) & set(stops) and len(s.token_ids) == min(max_new, max_seq - len(p))


def _maxdiff(a, b):
    return max(abs(x - y) for s, r in zip(a, b) for x, y in zip(s, r))


def _unfused(monkeypatch):
    """Pin the unfused static steps, which these CPU-semantics tests compare against: on a CUDA machine the fused
    decode-step kernels are the default (MEGATRON_FP4_DECODE_FUSED), and the engine's path label says so."""
    monkeypatch.setenv("MEGATRON_FP4_DECODE_FUSED", "0")


def _fused(path):
    """The engine's path label for the fused decode-step kernels: "+pdl" when they launch with programmatic
    dependent launch (MEGATRON_FP4_PDL=1, as benchmarks/h200_checks.sh engine-pdl runs these tests)."""
    return path + ("+pdl" if pdl_enabled() else "")


@pytest.mark.parametrize("precision", [RolloutPrecision("bf16"), RolloutPrecision("w4a4", "hif4", "2:4"),
                                       RolloutPrecision("w4a16", "mxfp4")], ids=lambda p: p.label)
def test_static_greedy_equals_megatron_path(model, prompts, precision, monkeypatch):
    _unfused(monkeypatch)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    ref = NativeRolloutEngine(model, precision).generate(prompts, params)
    eng = NativeRolloutEngine(model, precision, decode="static", max_batch_size=3, graph_chunk=4)
    out = eng.generate(prompts, params)
    assert eng.last_generate_stats["path"] == "static"
    assert [s.token_ids for s in out] == [s.token_ids for s in ref]
    assert [s.finish_reason for s in out] == [s.finish_reason for s in ref]
    assert [s.prompt_length for s in out] == [len(p) for p in prompts]
    assert _maxdiff([s.logprobs for s in out], [s.logprobs for s in ref]) < 1e-4
    tf = teacher_forced_logprobs(model, prompts, [s.token_ids for s in out], precision)
    assert _maxdiff([s.logprobs for s in out], tf) < 1e-4


@pytest.mark.parametrize("precision", [RolloutPrecision("bf16"), RolloutPrecision("w4a4", "hif4", "2:4")],
                         ids=lambda p: p.label)
def test_fused_decode_kernels_equal_the_unfused_steps(model, prompts, precision, monkeypatch):
    """MEGATRON_FP4_DECODE_FUSED=1: the decode steps' norms + residual adds, RoPE + KV writes and SwiGLU run as
    megatron_fp4/kernels/decode_ops.py's fused kernels (here in Triton's interpreter); same greedy tokens, logprobs
    within fp32 rounding of the unfused static path, the same stop and length handling."""
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(7,))
    _unfused(monkeypatch)
    ref = NativeRolloutEngine(model, precision, decode="static", max_batch_size=3, graph_chunk=4)
    monkeypatch.setenv("MEGATRON_FP4_DECODE_FUSED", "1")
    eng = NativeRolloutEngine(model, precision, decode="static", max_batch_size=3, graph_chunk=4)
    want, got = ref.generate(prompts, params), eng.generate(prompts, params)
    assert eng.last_generate_stats["path"] == _fused("static+fused") and ref.last_generate_stats["path"] == "static"
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert [s.finish_reason for s in got] == [s.finish_reason for s in want]
    assert _maxdiff([s.logprobs for s in got], [s.logprobs for s in want]) < 1e-4


def test_fused_step_attention_kernel_and_its_switch(model, prompts, monkeypatch):
    """The fused step rotates, writes K/V and attends in decode_ops.rope_attention (each cache read up to its
    position); MEGATRON_FP4_DECODE_ATTENTION=sdpa puts the RoPE kernel and SDPA with the mask back (the same tokens,
    logprobs within fp32 rounding), and a wrong value names the variable and the allowed ones."""
    precision = RolloutPrecision("bf16")
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(7,))
    monkeypatch.setenv("MEGATRON_FP4_DECODE_FUSED", "1")
    calls = []
    monkeypatch.setattr(decode_ops, "rope_attention",
                        lambda *a, _f=decode_ops.rope_attention: calls.append(a[0].shape) or _f(*a))
    got = NativeRolloutEngine(model, precision, decode="static", max_batch_size=3).generate(prompts, params)
    assert calls and all(len(s) == 5 for s in calls)  # (qkv as stored: [splits, B, ng, G + 2, hd])
    calls.clear()
    monkeypatch.setenv("MEGATRON_FP4_DECODE_ATTENTION", "sdpa")
    want = NativeRolloutEngine(model, precision, decode="static", max_batch_size=3).generate(prompts, params)
    assert not calls
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert _maxdiff([s.logprobs for s in got], [s.logprobs for s in want]) < 1e-4
    monkeypatch.setenv("MEGATRON_FP4_DECODE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="MEGATRON_FP4_DECODE_ATTENTION='flash' is not valid; allowed values: "
                                         "'kernel', 'sdpa'"):
        NativeRolloutEngine(model, precision, decode="static", max_batch_size=3).generate(prompts, params)


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_fused_steps_take_split_partial_sums(model, prompts, monkeypatch, qkv_bias):
    """The fused decode steps ask the rollout linears for their output as stored (rollout_linear as_stored): with a
    backend that stores split-K partial sums (three here, along K), qkv, proj, fc1 and fc2 reach the fused kernels as
    [splits, B, n] (qkv's bias added by the RoPE kernel to its splits' sum), and the tokens and logprobs are those of
    the same backend's summed outputs."""
    from megatron_fp4.resq import register_rollout_backend, rollout_backend_for

    if not qkv_bias:
        model = build_gpt_model(_args(add_qkv_bias=False))

    asked = []

    def split_backend(x2, weight, precision, cache, out_dtype):
        asked.append(out_dtype)
        k = x2.shape[-1]
        cuts = [0, k // 3, 2 * k // 3, k]
        parts = torch.stack([x2[:, a:b].float() @ weight[:, a:b].float().t() for a, b in zip(cuts, cuts[1:])])
        if out_dtype is None and x2.shape[0] <= 64:
            return parts
        return (parts[0] + parts[1] + parts[2]).to(out_dtype or x2.dtype)

    precision = RolloutPrecision("w4a16", "hif4")
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(7,))
    device = next(model.parameters()).device.type  # (on a CUDA machine the model is there: its kernels' backend)
    served = rollout_backend_for(device)
    register_rollout_backend(device, split_backend)
    try:
        _unfused(monkeypatch)
        want = NativeRolloutEngine(model, precision, decode="static", max_batch_size=3).generate(prompts, params)
        assert None not in asked
        monkeypatch.setenv("MEGATRON_FP4_DECODE_FUSED", "1")
        eng = NativeRolloutEngine(model, precision, decode="static", max_batch_size=3)
        got = eng.generate(prompts, params)
    finally:
        register_rollout_backend(device, served)
    assert eng.last_generate_stats["path"] == _fused("static+fused") and None in asked
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert _maxdiff([s.logprobs for s in got], [s.logprobs for s in want]) < 1e-4


@pytest.mark.parametrize("chunk", [1, 4])
def test_capture_warm_up_leaves_no_trace(model, prompts, monkeypatch, chunk):
    """The graph path's capture first runs two decode steps (autotuning, lazy weight forms) and restores the slots'
    state but not the K/V cache: those steps write only rows that every later step writes before it reads them.
    Here (CPU) each "graph" is an eager step with such a warm-up before every replay: seeded sampling gives the static
    path's tokens and logprobs exactly, with refills and stops, for chunks of one step too (the warm-up's steps read
    the chunk's first uniforms, which a one-step chunk has)."""
    precision = RolloutPrecision("w4a4", "hif4", "2:4")
    params = SamplingParams(temperature=0.9, max_new_tokens=12, stop_token_ids=(7,), seed=3)
    want = NativeRolloutEngine(model, precision, decode="static", max_batch_size=3,
                               graph_chunk=chunk).generate(prompts, params)
    warm_ups = []

    def capture(self, st, B, p, stop_ids):
        def replay():
            warm_ups.append(B)
            saved = self._save_slots(st)
            self._warm_up(st, B, p, stop_ids)
            self._restore_slots(st, saved)
            self._step(st, B, p, stop_ids)
        return types.SimpleNamespace(replay=replay)

    monkeypatch.setattr(StaticCacheGenerator, "_capture", capture)
    eng = NativeRolloutEngine(model, precision, decode="static", max_batch_size=3, graph_chunk=chunk)
    monkeypatch.setattr(eng, "_path", lambda: "graph")
    got = eng.generate(prompts, params)
    assert len(warm_ups) >= 12 and {s.finish_reason for s in want} == {"stop", "length"}
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert [s.logprobs for s in got] == [s.logprobs for s in want]


def test_static_sampling_stops_limits_and_seeds(model, prompts):
    eng = NativeRolloutEngine(model, RolloutPrecision("w4a4", "mxfp4"), decode="static", max_batch_size=2,
                              graph_chunk=3)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=40, stop_token_ids=(3, 4, 5),
                            seed=5)
    a = eng.generate(prompts, params)
    b = eng.generate(prompts, params)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]  # seeded: reproducible
    _assert_stops(prompts, a, (3, 4, 5), max_new=40, max_seq=48)  # max_seq_len caps prompt + response
    tf = teacher_forced_logprobs(model, prompts, [s.token_ids for s in a], eng.precision, temperature=0.8)
    assert _maxdiff([s.logprobs for s in a], tf) < 1e-4
    assert eng.generate([], params) == []


def test_forced_logprobs_score_the_megatron_paths_tokens(model, prompts):
    p = RolloutPrecision("w4a4", "hif4", "2:4", resq_combine="bf16")
    samples = NativeRolloutEngine(model, p).generate(prompts, SamplingParams(max_new_tokens=8, seed=1))
    eng = NativeRolloutEngine(model, p, decode="static", max_batch_size=4)
    forced = eng.forced_logprobs(prompts, [s.token_ids for s in samples])
    assert [len(f) for f in forced] == [len(s.token_ids) for s in samples]
    assert _maxdiff(forced, [s.logprobs for s in samples]) < 1e-4


def test_graph_sample_inverts_the_cdf():
    logits = torch.tensor([[0.0, 1.0, 2.0, -float("inf")], [5.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=1.0)
    probs = torch.softmax(logits, -1)
    p0 = probs[0, 0].item()
    # the token is the first whose CDF reaches (1 - u) x total: u near 1 -> token 0, u = 0 -> the last token with
    # nonzero probability (never the -inf one)
    for u, want in ((0.0, 2), (0.999, 0), (1 - p0 + 1e-4, 0), (1 - p0 - 1e-4, 1)):
        tok, lp = graph_sample(logits, torch.tensor([u, u]), params)
        assert tok.tolist()[0] == want, u
        assert torch.allclose(lp[0], torch.log_softmax(logits[0], -1)[want])
    tok, lp = graph_sample(logits, torch.zeros(2), SamplingParams(temperature=0.0))
    assert tok.tolist() == [2, 0] and torch.allclose(lp, torch.log_softmax(logits, -1).max(-1).values)
    # top-k keeps the most likely token only: every uniform picks it
    tok, _ = graph_sample(logits, torch.rand(2), SamplingParams(top_k=1))
    assert tok.tolist() == [2, 0]


@pytest.mark.parametrize("vocab", [4096, 1000, 49152, 37])
def test_two_level_cdf_inversion_matches_the_full_scan(vocab):
    """invert_cdf (block sums, then a scan inside one block) picks the token the full cumulative sum picks, except
    where the target falls within fp32 rounding of a CDF step, and never a zero-probability token (padded
    vocabularies and empty blocks included)."""
    from megatron_fp4.kernels.decode_ops import invert_cdf

    g = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(64, vocab, generator=g) * 3, -1)
    probs[:, ::3] = 0  # zero-probability tokens, and whole empty blocks
    probs[:, : min(vocab // 2, 700)] = 0
    probs[:, -1] = 0
    u = torch.rand(64, generator=g)
    u[:4] = torch.tensor([0.0, 1 - 1e-7, 0.5, 1e-7])
    tok = invert_cdf(probs, u)
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, ((1 - u.double()) * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    assert (probs.gather(1, tok.unsqueeze(1)) > 0).all()
    near = (cdf.gather(1, want.unsqueeze(1)) - (1 - u.double().unsqueeze(1)) * cdf[:, -1:]).abs().squeeze(1) < 1e-6
    assert torch.equal(tok[~near], want[~near]) and (~near).sum() >= 60
    # and its frequencies are the distribution's (one row, 20k draws, within 5 sigma per likely token)
    p = torch.softmax(torch.randn(vocab, generator=g), -1)
    n = 20000
    counts = torch.bincount(invert_cdf(p.expand(n, vocab), torch.rand(n, generator=g)), minlength=vocab).double()
    sigma = (n * p.double() * (1 - p.double())).sqrt()
    likely = p > 0.01
    assert ((counts - n * p.double()).abs()[likely] <= 5 * sigma[likely] + 1).all()


def test_path_selection_and_argument_checks(model, prompts, monkeypatch):
    _unfused(monkeypatch)
    assert not precision_is_token_local(RolloutPrecision("w4a4", "hif4", "channel"))
    eng = NativeRolloutEngine(model, RolloutPrecision("w4a4", "hif4", "channel"), decode="static")
    eng.generate(prompts[:2], SamplingParams(max_new_tokens=2, seed=0))
    assert eng.last_generate_stats["path"] == "megatron"  # the channel selector depends on the batch
    eng.set_precision(RolloutPrecision("w4a4", "hif4"))
    with RolloutUnderflowMonitor(model, "hif4", "2:4") as mon:
        eng.generate(prompts[:2], SamplingParams(max_new_tokens=2, seed=0))
    assert eng.last_generate_stats["path"] == "megatron" and mon.collect()  # hooks see every linear
    eng.generate(prompts[:2], SamplingParams(max_new_tokens=2, seed=0))
    assert eng.last_generate_stats["path"] == "static"
    assert NativeRolloutEngine(model, decode="auto").decode == ("graph" if torch.cuda.is_available()
                                                                 else "megatron")
    with pytest.raises(ValueError, match="decode='fast' is not valid"):
        NativeRolloutEngine(model, decode="fast")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs the model on a CUDA device"):
            NativeRolloutEngine(model, decode="graph")


def test_decode_default_from_environment(model, monkeypatch):
    monkeypatch.setenv("MEGATRON_FP4_ROLLOUT_DECODE", "static")
    assert NativeRolloutEngine(model).decode == "static"
    monkeypatch.delenv("MEGATRON_FP4_ROLLOUT_DECODE")
    assert NativeRolloutEngine(model).decode == "megatron"


def test_weight_cache_refresh_in_place(model):
    w = torch.randn(32, 64)
    cache = QuantizedWeightCache()
    first = cache.get(w, "hif4")
    ptr = first.data_ptr()
    with torch.no_grad():
        w.mul_(2.0)
    cache.refresh([w], "hif4", in_place=True)
    again = cache.get(w, "hif4")
    assert again.data_ptr() == ptr and cache.last_refresh_in_place
    assert torch.equal(again, torch.ops.aten.clone(again)) and torch.allclose(again.float(), first.float())
    from megatron_fp4.formats import get_format

    assert torch.equal(again, get_format("hif4").fake_quantize(w, dim=-1))
    assert copy_into({"a": torch.zeros(2), "b": (1, torch.ones(3))}, {"a": torch.ones(2), "b": (1, torch.zeros(3))})
    assert not copy_into(torch.zeros(2), torch.zeros(3))
    assert not copy_into({"flag": True}, {"flag": False})


# ---------------------------------------------------------------------------------------------------------------
# GPU: CUDA graphs
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("precision", [RolloutPrecision("bf16"), RolloutPrecision("w4a16", "hif4"),
                                       RolloutPrecision("w4a4", "mxfp4", "2:4", resq_combine="bf16"),
                                       RolloutPrecision("w4a4", "hif4", "2:4")], ids=lambda p: p.label)
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_gpu_graph_path_matches_eager(precision, fused, monkeypatch):
    """fused: megatron_fp4/kernels/decode_ops.py in the decode steps (MEGATRON_FP4_DECODE_FUSED=1), graph and eager
    alike."""
    monkeypatch.setenv("MEGATRON_FP4_DECODE_FUSED", "1" if fused else "0")
    initialize_parallel(1, 1, seed=3)
    m = build_gpt_model(_args(params_dtype=torch.bfloat16, init_method_std=0.02, max_seq_len=96))
    ps = random_prompts((5, 17, 9, 30, 2, 12) * 3, seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=0, stop_token_ids=(3,))
    graph = NativeRolloutEngine(m, precision, decode="graph", max_batch_size=8, graph_chunk=8)
    out = graph.generate(ps, params)
    st = graph.last_generate_stats
    assert st["path"] == (_fused("graph+fused") if fused else "graph") and st["graphs"] >= 1
    tf = teacher_forced_logprobs(m, ps, [s.token_ids for s in out], precision)
    assert _maxdiff([s.logprobs for s in out], tf) < 0.1  # bf16 model: rounding order + FP4 boundary flips
    _assert_stops(ps, out, (3,), max_new=24, max_seq=96)
    eager = NativeRolloutEngine(m, precision, decode="static", max_batch_size=8)
    forced = eager.forced_logprobs(ps, [s.token_ids for s in out])
    assert _maxdiff([s.logprobs for s in out], forced) < 0.1
    # graphs survive a weight update (prepared weights rewritten in place): no new capture, new weights used
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.01)
    graph.update_weights(None)
    assert graph._static.has_graphs  # refreshed in place: the captured graphs stay valid
    # small tensors take the memory the first call's temporaries had: a graph that read a per-call stop-id tensor
    # would compare the sampled tokens with these values and never stop (seen on SmolLM2: BF16 rollouts ran to the
    # length limit)
    churn = [torch.full((1,), 5, dtype=torch.long, device="cuda") for _ in range(256)]
    out2 = graph.generate(ps, params)
    del churn
    _assert_stops(ps, out2, (3,), max_new=24, max_seq=96)
    assert any(s.finish_reason == "stop" for s in out2)
    tf2 = teacher_forced_logprobs(m, ps, [s.token_ids for s in out2], precision)
    assert _maxdiff([s.logprobs for s in out2], tf2) < 0.1
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    a = graph.generate(ps, greedy)
    b = NativeRolloutEngine(m, precision, decode="megatron").generate(ps, greedy)
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b)) / len(ps)
    assert same >= 0.5, same  # bf16 greedy ties diverge now and then; most sequences agree exactly


@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
def test_fused_resq_operands_reach_the_linears(model, prompts, monkeypatch, fmt):
    """W4A4 + ResQ 2:4 (bf16 sum) on the fused path, by default: the norms before qkv and fc1 and the SwiGLU before
    fc2 make those linears' ResQ operand, which they multiply as W4A16. With the CUDA kernels stood in for by the
    reference ops (the kernels' bits are tests/test_cuda_quantize.py's GPU tests), the greedy tokens and logprobs are
    those of MEGATRON_FP4_FUSED_NORM_RESQ=0 and MEGATRON_FP4_FUSED_SWIGLU_RESQ=0 (the unfused ResQ linears, which
    call neither fused op) exactly, every layer's three operands came from the fused ops, and ResQ with the exact
    combine keeps its own linears."""
    from megatron_fp4.kernels import cuda_quantize
    from megatron_fp4.resq import resq_activation

    precision = RolloutPrecision("w4a4", fmt, "2:4", resq_combine="bf16")
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    prompts = prompts[:4]
    monkeypatch.setenv("MEGATRON_FP4_DECODE_FUSED", "1")
    dtype = next(model.parameters()).dtype  # (the kernels' is bf16; the CPU model's what the unfused path computes)
    calls = {"norm": 0, "swiglu": 0}

    def operand(h):  # the ResQ linear's own activation (bf16 sum), held in the model's dtype
        return resq_activation(h, fmt, "2:4", dim=-1, out_dtype=torch.bfloat16).to(h.dtype)

    def norm_resq(x, delta, norm, f):
        assert f == fmt
        calls["norm"] += 1
        h, s = decode_ops.add_rms_norm(x, delta, norm)
        return operand(h), s

    def swiglu_resq(a, f):
        assert f == fmt
        calls["swiglu"] += 1
        return operand(decode_ops.swiglu(a, dtype, splits=a.dim() == 3))

    monkeypatch.setattr(decode_ops, "add_rms_norm_resq", norm_resq)
    monkeypatch.setattr(cuda_quantize, "swiglu_resq_usable", lambda a, f: True)
    monkeypatch.setattr(cuda_quantize, "swiglu_resq", swiglu_resq)
    monkeypatch.setenv("MEGATRON_FP4_FUSED_NORM_RESQ", "0")
    monkeypatch.setenv("MEGATRON_FP4_FUSED_SWIGLU_RESQ", "0")
    want = NativeRolloutEngine(model, precision, decode="static", max_batch_size=3).generate(prompts, params)
    assert calls == {"norm": 0, "swiglu": 0}
    monkeypatch.delenv("MEGATRON_FP4_FUSED_NORM_RESQ")
    monkeypatch.delenv("MEGATRON_FP4_FUSED_SWIGLU_RESQ")
    got = NativeRolloutEngine(model, precision, decode="static", max_batch_size=3).generate(prompts, params)
    layers = len(model.decoder.layers)
    # (the norms: each decode step's two per layer; the SwiGLU: every layer of each forward, the prefills' too)
    assert calls["norm"] > 0 and calls["norm"] % (2 * layers) == 0 and calls["swiglu"] > calls["norm"] // 2
    assert calls["swiglu"] % layers == 0
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert [s.logprobs for s in got] == [s.logprobs for s in want]
    # not for other precisions: W4A4 + ResQ with the exact combine keeps its own linears
    calls.update(norm=0, swiglu=0)
    NativeRolloutEngine(model, RolloutPrecision("w4a4", fmt, "2:4"), decode="static",
                        max_batch_size=3).generate(prompts[:1], params)
    assert calls == {"norm": 0, "swiglu": 0}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hif4", "mxfp4"])
@pytest.mark.parametrize("switch", ["MEGATRON_FP4_FUSED_SWIGLU_RESQ", "MEGATRON_FP4_FUSED_NORM_RESQ"])
def test_gpu_fused_resq_operands_equal_the_resq_linears(fmt, switch, monkeypatch):
    """On a model wide enough for the fused CUDA kernels (hidden 1024, ffn 2816), the graph path with the fused
    SwiGLU + ResQ and norm + ResQ operands (the default) gives the tokens and logprobs of each switch off exactly
    (the same operands, the same GEMMs)."""
    monkeypatch.setenv("MEGATRON_FP4_DECODE_FUSED", "1")
    initialize_parallel(1, 1, seed=3)
    m = build_gpt_model(_args(params_dtype=torch.bfloat16, init_method_std=0.02, max_seq_len=96, hidden_size=1024,
                              ffn_hidden_size=2816, num_attention_heads=8, num_query_groups=2))
    ps = random_prompts((5, 17, 9, 30, 2, 12), seed=0)
    precision = RolloutPrecision("w4a4", fmt, "2:4", resq_combine="bf16")
    for params in (SamplingParams(temperature=0.0, max_new_tokens=16),
                   SamplingParams(temperature=1.0, max_new_tokens=16, seed=0)):
        got = NativeRolloutEngine(m, precision, decode="graph", max_batch_size=8).generate(ps, params)
        monkeypatch.setenv(switch, "0")
        want = NativeRolloutEngine(m, precision, decode="graph", max_batch_size=8).generate(ps, params)
        monkeypatch.delenv(switch)
        assert [s.token_ids for s in got] == [s.token_ids for s in want]
        assert [s.logprobs for s in got] == [s.logprobs for s in want]
