"""Fused core attention (megatron_fp4.parallel.attention): SDPADotProductAttention equals megatron-core's unfused
DotProductAttention in fp32, outputs and gradients within 1e-5: causal MHA and GQA, the softmax scale, explicit
masks, KV-cache decode shapes, packed sequences, a whole GPTModel and the rollout engine's megatron decode path; the
spec and the driver flag choose it. TP=2 runs in tests/test_parallel_attention_logprobs.py."""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_fp4.models import GPTModelArgs, build_gpt_model, gpt_transformer_config
from megatron_fp4.parallel import SDPADotProductAttention, get_gpt_layer_fp4_spec, initialize_parallel, set_seed
from megatron_fp4.parallel.attention import ATTENTION_BACKENDS, resolve_attention_backend

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def _parallel():
    initialize_parallel(1, 1, seed=0)


def _config(heads=4, groups=2, hidden=64, **overrides):
    args = GPTModelArgs(num_layers=2, hidden_size=hidden, ffn_hidden_size=128, num_attention_heads=heads,
                        num_query_groups=groups, vocab_size=64, max_seq_len=64)
    return gpt_transformer_config(args, **overrides)


def _pair(config, layer_number=1, **kw):
    make = dict(config=config, layer_number=layer_number, attn_mask_type=AttnMaskType.causal,
                attention_type="self", **kw)
    return DotProductAttention(**make), SDPADotProductAttention(**make)


def _qkv(sq, sk, b, heads, groups, hn, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, heads, hn, generator=g).to(dtype).requires_grad_()
    k = torch.randn(sk, b, groups, hn, generator=g).to(dtype).requires_grad_()
    v = torch.randn(sk, b, groups, hn, generator=g).to(dtype).requires_grad_()
    return q, k, v


#: Where the modules run: megatron-core's attention allocates on the current CUDA device when there is one.
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _run(module, q, k, v, mask=None, grad=None, **kw):
    """(output, dq, dk, dv) of one forward + backward with upstream gradient ``grad`` (seeded random default), on
    :data:`DEV`; results on the CPU."""
    q, k, v = (t.detach().clone().to(DEV).requires_grad_() for t in (q, k, v))
    out = module(q, k, v, None if mask is None else mask.to(DEV), **kw)
    if grad is None:
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(grad.to(DEV))
    return tuple(t.cpu() for t in (out.detach(), q.grad, k.grad, v.grad))


def _close(a, b, **tol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **(tol or TOL))


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (8, 1)])
def test_causal_equals_unfused(heads, groups):
    local, sdpa = _pair(_config(heads, groups))
    q, k, v = _qkv(13, 13, 3, heads, groups, 64 // heads)
    ref, out = _run(local, q, k, v), _run(sdpa, q, k, v)
    assert out[0].shape == (13, 3, 64)
    _close(out, ref)


def test_softmax_scale_and_query_key_layer_scaling():
    local, sdpa = _pair(_config(), softmax_scale=0.3)
    q, k, v = _qkv(9, 9, 2, 4, 2, 16)
    _close(_run(sdpa, q, k, v), _run(local, q, k, v))
    local, sdpa = _pair(_config(apply_query_key_layer_scaling=True), layer_number=3)
    assert sdpa.scale_mask_softmax.scale == 3
    _close(_run(sdpa, q, k, v), _run(local, q, k, v))


def test_explicit_left_padding_mask():
    """The rollout's prefill mask (True = masked): rows of padding queries (all keys masked) are unused and left
    out of the comparison."""
    local, sdpa = _pair(_config())
    b, s = 3, 10
    pads = torch.tensor([0, 3, 6])
    ar = torch.arange(s)
    mask = ((ar[None, :] > ar[:, None])[None] | (ar[None, None, :] < pads[:, None, None])).unsqueeze(1)
    real = (ar[None, :] >= pads[:, None]).T[:, :, None]  # [s, b, 1]: query rows with a key to attend
    grad = torch.randn(s, b, 64, generator=torch.Generator().manual_seed(2)) * real
    q, k, v = _qkv(s, s, b, 4, 2, 16)
    ref, out = _run(local, q, k, v, mask, grad), _run(sdpa, q, k, v, mask, grad)
    torch.testing.assert_close(out[0] * real, ref[0] * real, **TOL)
    assert torch.isfinite(out[0]).all()
    _close(out[1:], ref[1:])


def test_decode_shapes():
    """A KV-cache decode step (sq = 1: every cached key, as megatron-core), with and without a padding mask, and
    sq != sk > 1 (causal aligned to the bottom right; megatron-core's unfused path needs the explicit mask)."""
    local, sdpa = _pair(_config())
    q, k, v = _qkv(1, 9, 3, 4, 2, 16)
    _close(_run(sdpa, q, k, v), _run(local, q, k, v))
    pad = (torch.arange(9)[None, :] < torch.tensor([0, 2, 5])[:, None]).view(3, 1, 1, 9)
    _close(_run(sdpa, q, k, v, pad), _run(local, q, k, v, pad))
    q, k, v = _qkv(4, 9, 2, 4, 2, 16)
    after = torch.arange(9)[None, :] > torch.arange(4)[:, None] + 5
    _close(_run(sdpa, q, k, v), _run(local, q, k, v, after.view(1, 1, 4, 9)))


@pytest.mark.parametrize("padded", [False, True])
def test_packed_sequences_equal_one_by_one(padded):
    """THD packing (cu_seqlens): each sequence attends causally to itself only, as the unfused path run on each;
    with cu_seqlens_q_padded the padding after each sequence (its slot's tail) is never attended by it (the
    padding's own outputs are unused: zero upstream gradient there)."""
    local, sdpa = _pair(_config())
    lengths, gap = [5, 3, 6], 2 if padded else 0
    cu = torch.tensor([0, 5, 8, 14], dtype=torch.int32)
    starts = [i * gap + int(c) for i, c in enumerate(cu[:-1])]
    t = starts[-1] + lengths[-1] + gap
    q, k, v = _qkv(t, t, 1, 4, 2, 16)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    if padded:
        params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = torch.tensor(
            starts + [t], dtype=torch.int32)
    grad = torch.randn(t, 64, generator=torch.Generator().manual_seed(3))
    gaps = torch.ones(t, dtype=torch.bool)
    for start, n in zip(starts, lengths):
        gaps[start:start + n] = False
    grad[gaps] = 0.0
    qq, kk, vv = (x.detach().clone().squeeze(1).requires_grad_() for x in (q, k, v))
    out = sdpa(qq, kk, vv, None, packed_seq_params=params)  # [t, heads, hn] in: the "thd" layout
    assert out.shape == (t, 64)
    out.backward(grad)
    for start, n in zip(starts, lengths):
        sl = slice(start, start + n)
        ref = _run(local, q[sl], k[sl], v[sl], grad=grad[sl].view(n, 1, 64))
        torch.testing.assert_close(out[sl].detach(), ref[0].view(n, 64), **TOL)
        for got, want in zip((qq.grad, kk.grad, vv.grad), ref[1:]):
            torch.testing.assert_close(got[sl], want.squeeze(1), **TOL)
    assert bool(gaps.any()) == padded


def _per_sequence(q, k, v, cu, scale):
    """One causal SDPA call per THD sequence (GQA inside SDPA): the reference of the varlen path."""
    import torch.nn.functional as F
    outs, bounds = [], cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                           is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def _varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1)):
    """torch 2.11's ``varlen_attn`` signature (the H200 image: no ``enable_gqa``; FlashAttention there), computed
    by plain SDPA per sequence, which refuses unequal head counts as ``enable_gqa=False`` does."""
    assert window_size == (-1, 0) and key.shape[1] == query.shape[1], (window_size, key.shape, query.shape)
    return _per_sequence(query, key, value, cu_seq_q, scale)


def _varlen_newer(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                  window_size=(-1, -1), enable_gqa=False):
    assert window_size == (-1, 0) and enable_gqa == (key.shape[1] != query.shape[1])
    return _per_sequence(query, key, value, cu_seq_q, scale)


def _varlen_older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None,
                  scale=None):
    assert is_causal and key.shape[1] == query.shape[1]
    return _per_sequence(query, key, value, cu_seq_q, scale)


@pytest.mark.parametrize("attn", [_varlen_2_11, _varlen_newer, _varlen_older])
@pytest.mark.parametrize("groups", [4, 2, 1])
def test_varlen_call_fits_each_pytorch_signature(attn, groups):
    """The packed path's varlen_attn call is built from the installed PyTorch's signature: on torch 2.11 (the H200
    image, no ``enable_gqa``) a GQA key/value is repeated per query head, on newer releases passed as is with
    ``enable_gqa``. Outputs and gradients equal one SDPA call per sequence (a first version passed ``enable_gqa``
    unconditionally: a TypeError on the H200, found by reading 2.11's source)."""
    from megatron_fp4.parallel.attention import varlen_causal_attention
    g = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 5, 8, 14], dtype=torch.int32)
    q = torch.randn(14, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(14, groups, 16, generator=g, requires_grad=True)
    v = torch.randn(14, groups, 16, generator=g, requires_grad=True)
    up = torch.randn(14, 4, 16, generator=g)
    got = varlen_causal_attention(q, k, v, cu, 6, 0.25, attn=attn)
    grads = torch.autograd.grad(got, (q, k, v), up)
    want = _per_sequence(q, k, v, cu, 0.25)
    for a, b in zip((got, *grads), (want, *torch.autograd.grad(want, (q, k, v), up))):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [12, 2])
def test_gpu_varlen_pack_equals_per_sequence_sdpa(groups, monkeypatch):
    """On CUDA in bf16 the packed path runs PyTorch's FlashAttention varlen (GQA included, forward and backward)
    and equals one causal SDPA call per sequence within bf16 rounding."""
    import functools

    from megatron_fp4.parallel import attention
    assert attention.varlen_attn is not None
    calls = []

    @functools.wraps(attention.varlen_attn)
    def counted(*a, **kw):
        calls.append(kw)
        return counted.__wrapped__(*a, **kw)

    monkeypatch.setattr(attention, "varlen_attn", counted)
    _, sdpa = _pair(_config(heads=12, groups=groups, hidden=12 * 128))
    sdpa = sdpa.cuda()
    g = torch.Generator(device="cuda").manual_seed(5)
    lengths = torch.tensor([300, 17, 464, 1, 200])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32).cuda()
    t = int(lengths.sum())
    q, k, v = (torch.randn(t, h, 128, device="cuda", generator=g).bfloat16().requires_grad_()
               for h in (12, groups, groups))
    up = torch.randn(t, 12 * 128, device="cuda", generator=g).bfloat16()
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=464,
                             max_seqlen_kv=464)
    got = sdpa(q, k, v, None, packed_seq_params=params)
    grads = torch.autograd.grad(got, (q, k, v), up)
    want = _per_sequence(q, k, v, cu, sdpa._sdpa_scale()).reshape(t, -1)
    wgrads = torch.autograd.grad(want, (q, k, v), up)
    assert len(calls) == 1, calls  # the varlen kernel, not the per-sequence loop
    for a, b in zip((got, *grads), (want, *wgrads)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_packed_gpt_model_equals_one_forward_per_sequence():
    """A whole GPTModel on a THD pack (positions restart per sequence, RoPE per sequence through cu_seqlens) gives
    each sequence's own logits (megatron-core's unfused attention does not take packed sequences)."""
    _, sdpa = _gpt_pair()
    g = torch.Generator().manual_seed(6)
    lengths = [5, 3, 7]
    dev = _device(sdpa)
    seqs = [torch.randint(0, 96, (n,), generator=g).to(dev) for n in lengths]
    cu = torch.tensor([0, 5, 8, 15], dtype=torch.int32, device=dev)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    pos = torch.cat([torch.arange(n, device=dev) for n in lengths])[None]
    packed = sdpa(torch.cat(seqs)[None], pos, None, packed_seq_params=params)
    assert packed.shape == (1, 15, 96)
    for s, a, b in zip(seqs, cu[:-1].tolist(), cu[1:].tolist()):
        alone = sdpa(s[None], torch.arange(len(s), device=dev)[None], None)
        torch.testing.assert_close(packed[0, a:b], alone[0], **TOL)


def test_sliding_window_falls_back_to_unfused():
    local, sdpa = _pair(_config(window_size=(3, 0)))
    q, k, v = _qkv(9, 9, 2, 4, 2, 16)
    for a, b in zip(_run(sdpa, q, k, v), _run(local, q, k, v)):
        assert torch.equal(a, b)


def test_dropout_in_training_only():
    _, sdpa = _pair(_config(attention_dropout=0.5))
    local, _ = _pair(_config(attention_dropout=0.5))
    q, k, v = _qkv(9, 9, 2, 4, 2, 16)
    sdpa.eval()
    local.eval()
    _close(_run(sdpa, q, k, v), _run(local, q, k, v))
    sdpa.train()
    set_seed(5)
    a = sdpa(q, k, v, None)
    set_seed(5)
    b = sdpa(q, k, v, None)
    assert torch.equal(a, b) and not torch.allclose(a, _run(local.eval(), q, k, v)[0])


def test_bf16_is_as_close_to_fp32_as_unfused():
    """In bf16 both paths round; SDPA (softmax in fp32, no bf16 probabilities) is no further from the fp32 result
    than the unfused path (relative error of the output and of each input gradient)."""
    local, sdpa = _pair(_config(bf16=True, params_dtype=torch.bfloat16))
    q, k, v = _qkv(33, 33, 2, 4, 2, 16, dtype=torch.bfloat16)
    ref32 = _run(_pair(_config())[0], q.float(), k.float(), v.float())
    ref, out = _run(local, q, k, v), _run(sdpa, q, k, v)
    for a, b, c in zip(out, ref, ref32):
        err_sdpa, err_local = (float((x.float() - c).norm() / c.norm()) for x in (a, b))
        assert err_sdpa < 1e-2 and err_sdpa <= 1.5 * err_local, (err_sdpa, err_local)


def _device(model) -> torch.device:
    """Where build_gpt_model put the model (the current GPU when there is one)."""
    return next(model.parameters()).device


def _gpt_pair(**kw):
    args = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                vocab_size=96, max_seq_len=48, add_qkv_bias=True, init_method_std=0.08, **kw)
    local = build_gpt_model(GPTModelArgs(**args, attention_backend="local"))
    sdpa = build_gpt_model(GPTModelArgs(**args, attention_backend="sdpa"))
    sdpa.load_state_dict(local.state_dict())
    return local, sdpa


def test_gpt_model_forward_backward_equals_unfused():
    local, sdpa = _gpt_pair()
    assert (local.attention_backend, sdpa.attention_backend) == ("local", "sdpa")
    assert isinstance(sdpa.decoder.layers[1].self_attention.core_attention, SDPADotProductAttention)
    assert type(local.decoder.layers[1].self_attention.core_attention) is DotProductAttention
    g = torch.Generator().manual_seed(4)
    dev = _device(local)
    ids = torch.randint(0, 96, (3, 21), generator=g).to(dev)
    pos = torch.arange(21, device=dev)[None].expand(3, -1)
    w = torch.randn(3, 21, 96, generator=g).to(dev)
    out = {}
    for name, m in (("local", local), ("sdpa", sdpa)):
        logits = m(ids, pos, None)
        (logits * w).sum().backward()
        out[name] = logits.detach(), {n: p.grad for n, p in m.named_parameters()}
    torch.testing.assert_close(out["sdpa"][0], out["local"][0], **TOL)
    for n, grad in out["local"][1].items():
        assert grad.norm() > 0, n
        rel = float((out["sdpa"][1][n] - grad).norm() / grad.norm())
        assert rel < 1e-5, (n, rel)


def test_from_model_reads_back_the_backend_and_the_recipe():
    """GPTModelArgs.from_model gives what built the model: the resolved attention backend, and the FP4 recipe from
    megatron_fp4_recipe (megatron-core's own fp4_recipe field is Transformer Engine's string)."""
    from megatron_fp4.recipe import HiF4BlockScaling

    recipe = HiF4BlockScaling()
    m = build_gpt_model(GPTModelArgs(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                     vocab_size=32, max_seq_len=16, fp4_recipe=recipe, attention_backend="sdpa"))
    args = GPTModelArgs.from_model(m)
    assert args.attention_backend == "sdpa" and args.fp4_recipe is recipe


def test_rollout_megatron_decode_path_equals_unfused():
    """The native engine's reference decode path (megatron-core's forward with its KV cache, left-padding masks,
    sq = 1 steps) gives the same tokens and logprobs with either attention."""
    from megatron_fp4.rollout import NativeRolloutEngine, SamplingParams

    local, sdpa = _gpt_pair()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(6, 96, (n,), generator=g).tolist() for n in (5, 9, 3)]
    res = {}
    for name, m in (("local", local), ("sdpa", sdpa)):
        engine = NativeRolloutEngine(m.eval(), decode="megatron")
        res[name] = [(s.token_ids, s.logprobs) for s in
                     engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))]
    for (t1, l1), (t2, l2) in zip(res["local"], res["sdpa"]):
        assert t1 == t2
        assert max(abs(a - b) for a, b in zip(l1, l2)) < 1e-5


def test_spec_and_flag_choose_the_backend():
    def core(backend):
        return get_gpt_layer_fp4_spec(attention_backend=backend).submodules.self_attention.submodules.core_attention

    assert core("sdpa") is SDPADotProductAttention and core("local") is DotProductAttention
    assert core("auto") is (SDPADotProductAttention if torch.cuda.is_available() else DotProductAttention)
    assert resolve_attention_backend("auto") in ("sdpa", "local")
    with pytest.raises(ValueError, match="attention_backend='flash' is not valid; allowed: auto, sdpa, local"):
        get_gpt_layer_fp4_spec(attention_backend="flash")
    from megatron_fp4.rl.arguments import parse_args
    from megatron_fp4.rl.config import RLConfig

    assert parse_args([]).attention_backend == "auto"
    assert RLConfig.from_args(parse_args(["--attention-backend", "sdpa"])).model.attention_backend == "sdpa"
    assert ATTENTION_BACKENDS == ("auto", "sdpa", "local")
    with pytest.raises(ValueError, match="--attention-backend='flash' is not valid; allowed: auto, sdpa, local"):
        parse_args(["--attention-backend", "flash"])
