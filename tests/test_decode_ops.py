"""megatron_fp4/kernels/decode_ops.py (the native engine's fused decode-step kernels) against their PyTorch twins, in
Triton's CPU interpreter (fp32 and fp16: the interpreter rounds fp32 to bf16 by truncation) or on a GPU (bf16 too)."""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from megatron_fp4.kernels import decode_ops  # noqa: E402
from megatron_fp4.kernels._common import interpreting  # noqa: E402
from sm90 import ROOT, compile_env  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and not interpreting():
    pytest.skip("Triton interpreter not active for kernels/", allow_module_level=True)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def _tol(dtype):
    """One fused computation against torch's op-by-op roundings: a couple of units in the last place."""
    return {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3),
            torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}[dtype]


def _rope_tables(S, hd, dtype):
    """RoPE's cos and sin tables by position ``[S, hd]`` (base 10000, the halves alike), as the engine makes them."""
    ang = torch.outer(torch.arange(S, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, hd, 2) / hd))
    emb = torch.cat((ang, ang), dim=-1)
    return torch.cos(emb).to(dtype).to(DEV), torch.sin(emb).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("w_dtype", [torch.float32, None])
def test_add_rms_norm_matches_torch(dtype, with_delta, w_dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 96, generator=g) * 3).to(dtype).to(DEV)
    delta = torch.randn(5, 96, generator=g).to(dtype).to(DEV) if with_delta else None
    norm = torch.nn.RMSNorm(96, eps=1e-6).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    if w_dtype is None:
        norm = norm.to(dtype)  # weights in the activations' dtype
    y, s = decode_ops.add_rms_norm(x, delta, norm)
    y_ref, s_ref = decode_ops.add_rms_norm_reference(x, delta, norm)
    assert y.dtype == y_ref.dtype and s.dtype == s_ref.dtype
    assert torch.equal(s, s_ref)  # the residual add rounds once, as torch's
    torch.testing.assert_close(y, y_ref, **_tol(dtype))
    # not a torch RMSNorm (LayerNorm): the twin serves the call
    ln = torch.nn.LayerNorm(96).to(DEV).to(dtype)
    y2, _ = decode_ops.add_rms_norm(x, delta, ln)
    assert torch.equal(y2, decode_ops.add_rms_norm_reference(x, delta, ln)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3])
def test_rope_kv_write_matches_torch(dtype, group):
    g = torch.Generator().manual_seed(1)
    B, ng, hd, S = 4, 2, 16, 9
    qkv = torch.randn(B, ng, group + 2, hd, generator=g).to(dtype).to(DEV)
    pos = torch.tensor([0, 3, 8, 5], device=DEV)
    cos, sin = _rope_tables(S, hd, dtype)  # the tables, read at pos
    caches = [torch.randn(B, ng, S, hd, generator=g).to(dtype).to(DEV) for _ in range(2)]
    kc, vc = caches[0].clone(), caches[1].clone()
    kr, vr = caches[0].clone(), caches[1].clone()
    q = decode_ops.rope_kv_write(qkv, cos, sin, kc, vc, pos, group)
    q_ref = decode_ops.rope_kv_write_reference(qkv, cos, sin, kr, vr, pos, group)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    torch.testing.assert_close(kc, kr, **_tol(dtype))
    assert torch.equal(vc, vr)  # values are copied, not rotated
    untouched = torch.ones(B, S, dtype=torch.bool)
    untouched[torch.arange(B), pos.cpu()] = False
    assert torch.equal(kc.cpu().transpose(1, 2)[untouched], caches[0].cpu().transpose(1, 2)[untouched])
    # the same rotation as torch's rotate-half RoPE on each token at its position
    torch.testing.assert_close(q_ref, decode_ops.rope_reference(qkv[:, :, :group], cos[pos][:, None, None],
                                                                sin[pos][:, None, None]), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b", [3, 1])
def test_rope_kv_write_prefill_rows_go_to_their_sequences_slots(dtype, b):
    """A prefill's prompt tokens as rows (``rows``: each token's cache slot, positions 0..L-1 per sequence): every
    token's k and v land at (its sequence's slot, its position), other slots and positions untouched; q per token.
    b = 1: ``rows`` as an expanded view of stride 0 (what reshape makes of one slot), read as its values (the twin),
    and as the engine makes them, contiguous (the kernel)."""
    g = torch.Generator().manual_seed(2)
    L, ng, group, hd, S, nslots = 5, 2, 2, 16, 8, 6
    qkv = torch.randn(b * L, ng, group + 2, hd, generator=g).to(dtype).to(DEV)
    cos, sin = _rope_tables(S, hd, dtype)
    slots = torch.tensor([4, 1, 3][:b], device=DEV)
    pos, rows = torch.arange(L, device=DEV).repeat(b), slots[:, None].expand(b, L).reshape(-1)
    caches = [torch.randn(nslots, ng, S, hd, generator=g).to(dtype).to(DEV) for _ in range(2)]
    kc, vc = caches[0].clone(), caches[1].clone()
    kr, vr = caches[0].clone(), caches[1].clone()
    q = decode_ops.rope_kv_write(qkv, cos, sin, kc, vc, pos, group, rows=rows)
    q_ref = decode_ops.rope_kv_write_reference(qkv, cos, sin, kr, vr, pos, group, rows=rows)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    torch.testing.assert_close(kc, kr, **_tol(dtype))
    assert torch.equal(vc, vr)
    for j, slot in enumerate(slots.tolist()):
        assert torch.equal(vc[slot, :, :L].cpu(), qkv[j * L:(j + 1) * L, :, group + 1].transpose(0, 1).cpu())
        k_want = decode_ops.rope_reference(qkv[j * L:(j + 1) * L, :, group], cos[:L, None], sin[:L, None])
        torch.testing.assert_close(kr[slot, :, :L], k_want.transpose(0, 1), atol=0, rtol=0)
    untouched = torch.ones(nslots, S, dtype=torch.bool)
    untouched[slots.cpu()[:, None], torch.arange(L)[None, :]] = False
    for got, orig in ((kc, caches[0]), (vc, caches[1])):
        assert torch.equal(got.cpu().transpose(1, 2)[untouched], orig.cpu().transpose(1, 2)[untouched])
    if b == 1:  # (that view took the twin) the engine's contiguous rows of one slot take the kernel: the same
        kc1, vc1 = caches[0].clone(), caches[1].clone()
        q1 = decode_ops.rope_kv_write(qkv, cos, sin, kc1, vc1, pos, group, rows=rows.contiguous())
        torch.testing.assert_close(q1, q_ref, **_tol(dtype))
        torch.testing.assert_close(kc1, kr, **_tol(dtype))
        assert torch.equal(vc1, vr)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_torch(dtype):
    g = torch.Generator().manual_seed(2)
    a = (torch.randn(3, 2 * 1500, generator=g) * 4).to(dtype).to(DEV)  # F = 1500: two column blocks, a ragged one
    torch.testing.assert_close(decode_ops.swiglu(a), decode_ops.swiglu_reference(a), **_tol(dtype))


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("splits", [1, 3])
def test_split_partial_sums_read_as_the_rounded_sum(dtype, splits):
    """A decode GEMM's output as stored, [splits, B, N] fp32 partial sums, goes straight to the fused kernels (no
    zero-fill, no cast kernel): they add the splits in order and round to the model's dtype as they read, so the
    results are those of the rounded sum (sum_splits, the twins' reading)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 96, generator=g) * 3).to(dtype).to(DEV)
    parts = torch.randn(splits, 5, 96, generator=g).to(DEV)
    delta = decode_ops.sum_splits(parts, dtype, 2)
    assert torch.equal(delta, functools.reduce(torch.add, parts.unbind(0)).to(dtype))
    norm = torch.nn.RMSNorm(96, eps=1e-6).to(DEV)
    y, s = decode_ops.add_rms_norm(x, parts, norm)
    y_sum, s_sum = decode_ops.add_rms_norm(x, delta, norm)
    assert s.dtype == dtype and torch.equal(s, s_sum) and torch.equal(y, y_sum)
    assert torch.equal(decode_ops.add_rms_norm_reference(x, parts, norm)[1], s_sum)
    a_parts = (torch.randn(splits, 3, 2 * 1500, generator=g) * 4).to(DEV)
    out = decode_ops.swiglu(a_parts, dtype, splits=True)
    a = decode_ops.sum_splits(a_parts, dtype, 2)
    assert out.dtype == dtype and torch.equal(out, decode_ops.swiglu(a))
    assert torch.equal(decode_ops.swiglu_reference(a_parts, dtype, splits=True), decode_ops.swiglu_reference(a))
    # without splits a 3-D input is a batch of rows (the prefill's [b, L, 2F]), in the kernel too
    rows = decode_ops.swiglu(a_parts.to(dtype))
    assert rows.shape == (splits, 3, 1500) and torch.equal(rows[-1], decode_ops.swiglu(a_parts[-1].to(dtype)))
    torch.testing.assert_close(rows, decode_ops.swiglu_reference(a_parts.to(dtype)), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G, hd", [(7, 32), (6, 32), (1, 32), (7, 128)])  # (7, 128): Qwen2.5-7B's heads
@pytest.mark.parametrize("splits", [1, 3])
def test_rope_attention_matches_its_twins(dtype, G, hd, splits):
    """RoPE, the K/V writes and the decode attention in one kernel (each sequence's cache read up to the row before
    its position, BLOCK_N keys a step, online softmax, the step's own key and value from registers; or the cache in
    splits, empty ones included, merged by a second kernel) against rope_kv_write_reference + SDPA with the static
    path's mask, on a strided cache slice as the engine passes it, qkv as two splits' partial sums and a bias
    (positions within, at and across block edges; rows past pos hold garbage that must not count)."""
    g = torch.Generator().manual_seed(6)
    B, ng, S = 5, 2, 150
    cache = (torch.randn(2, 3, B + 1, ng, S, hd, generator=g) * 2).to(dtype).to(DEV)  # [kv, layer, slots, ...]
    parts = torch.randn(2, B, ng, G + 2, hd, generator=g).to(DEV)
    bias = (torch.randn(ng * (G + 2) * hd, generator=g) * 0.5).to(dtype).to(DEV)
    cos, sin = _rope_tables(S, hd, dtype)
    pos = torch.tensor([0, 63, 64, 100, S - 1]).to(DEV)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else _tol(dtype)  # (sums in another order)

    def run(fn, c, *extra):
        c = c.clone()
        return fn(parts, cos, sin, c[0, 1, :B], c[1, 1, :B], pos, G, 0.3, bias, *extra), c

    got, c_got = run(decode_ops.rope_attention, cache, splits)
    want, c_want = run(decode_ops.rope_attention_reference, cache)
    assert got.shape == want.shape == (B, ng, G, hd) and got.dtype == dtype
    # the RoPE kernel's queries and cache rows (one rounding: tested against torch's above), then SDPA with the mask
    c_rope = cache.clone()
    q = decode_ops.rope_kv_write(parts, cos, sin, c_rope[0, 1, :B], c_rope[1, 1, :B], pos, G, bias)
    assert torch.equal(c_got, c_rope)  # the same rows written, bit for bit
    torch.testing.assert_close(got, decode_ops.decode_attention_reference(q, c_rope[0, 1, :B], c_rope[1, 1, :B],
                                                                          pos, 0.3), **tol)
    # against the whole twin, whose RoPE rounds q and k op by op (a unit in the last place apart from the kernel's
    # fused rotation): the scores move by |q||k| units, so the outputs by a few (H200, split variant, bf16: 0.10 at
    # values up to ~8; fp32 at head size 128: 1.5e-5)
    twin_tol = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-2, rtol=3e-2),
                torch.bfloat16: dict(atol=0.15, rtol=3e-2)}[dtype]
    torch.testing.assert_close(got, want, **twin_tol)
    at = torch.zeros(S, dtype=torch.bool).repeat(B, 1)
    at[torch.arange(B), pos.cpu()] = True

    def rows(c, kv):  # the layer's cache rows of the B slots, [B, S, ng, hd]
        return c[kv, 1, :B].cpu().transpose(1, 2)

    assert torch.equal(rows(c_got, 1)[at], rows(c_want, 1)[at])  # the values as they are
    for kv in (0, 1):  # no other row written
        assert torch.equal(rows(c_got, kv)[~at], rows(cache, kv)[~at])
    assert torch.equal(c_got[:, [0, 2]], cache[:, [0, 2]]) and torch.equal(c_got[:, 1, B:], cache[:, 1, B:])
    # the rows past each position do not count
    c2 = cache.clone()
    for i, p in enumerate(pos.tolist()):
        c2[0, 1, i, :, p + 1:], c2[1, 1, i, :, p + 1:] = 1e4, float("nan")
    assert torch.equal(run(decode_ops.rope_attention, c2, splits)[0], got)
    if splits == 1:  # what the splits' merge rounds differently
        torch.testing.assert_close(run(decode_ops.rope_attention, cache, 3)[0], got, **tol)
    # a head size that is not a power of two: the twins
    c3 = cache[..., :24].contiguous()
    p3 = parts[..., :24].contiguous()
    b3 = bias.view(ng, G + 2, hd)[..., :24].contiguous().view(-1)
    o3 = decode_ops.rope_attention(p3, cos[:, :24], sin[:, :24], c3[0, 1, :B], c3[1, 1, :B], pos, G, 0.3, b3)
    c4 = cache[..., :24].contiguous()
    o4 = decode_ops.rope_attention_reference(p3, cos[:, :24], sin[:, :24], c4[0, 1, :B], c4[1, 1, :B], pos, G, 0.3,
                                             b3)
    assert torch.equal(o3, o4) and torch.equal(c3, c4)


def test_attention_splits_only_where_programs_leave_the_gpu_idle():
    """One kernel at the rollout's batches and short caches; long caches of few sequences in splits of at least
    ATTENTION_MIN_SPLIT_KEYS keys, up to one program per multiprocessor and at most ATTENTION_MAX_SPLITS."""
    assert decode_ops.attention_splits(64 * 4, 256, 132) == 1  # 7B shape, batch 64
    assert decode_ops.attention_splits(64 * 2, 256, 132) == 1  # 1.5B shape: short cache
    assert decode_ops.attention_splits(64 * 2, 16384, 132) == 2
    assert decode_ops.attention_splits(4, 16384, 132) == decode_ops.ATTENTION_MAX_SPLITS == 16  # (33 without it)
    assert decode_ops.attention_splits(8, 8192, 132) == 16
    assert decode_ops.attention_splits(4, 2048, 132) == 4
    assert decode_ops.attention_splits(1, 300, 132) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stored", [False, 1, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_split_sum_is_sum_splits_in_one_kernel(dtype, stored, with_bias):
    """split_sum: a GEMM's fp32 output, or its [splits, M, N] partial sums, added in split order, plus the bias in fp32,
    rounded once to dtype: sum_splits' numbers (fp16 exactly; the interpreter truncates fp32 to bf16, hence no bf16
    on the CPU); bad inputs go to the twin."""
    g = torch.Generator().manual_seed(4)
    t = torch.randn(*((stored,) if stored else ()), 5, 1500, generator=g).to(DEV)  # two column blocks, a ragged one
    bias = (torch.randn(1500, generator=g) * 2).to(dtype).to(DEV) if with_bias else None
    got = decode_ops.split_sum(t, dtype, bias)
    assert got.shape == (5, 1500) and got.dtype == dtype
    want = decode_ops.sum_splits(t, dtype, 2, bias)
    assert torch.equal(got, want)
    acc = functools.reduce(torch.add, t.unbind(0)) if stored else t
    assert torch.equal(want, (acc if bias is None else acc + bias.float()).to(dtype))
    if with_bias:  # a bias of the wrong length: the twin (which raises as torch does)
        with pytest.raises(RuntimeError):
            decode_ops.split_sum(t, dtype, bias[:-1])


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rope_reads_qkv_splits_and_bias(dtype, splits, with_bias):
    """qkv as the decode GEMM stored it, [splits, B, ng, G + 2, hd] fp32, and the linear's bias: the RoPE kernel adds
    the splits in order, then the bias, in fp32 and rounds once (sum_splits with the bias), then rotates as it does a
    rounded qkv: the same q and caches bit for bit, kernel and twin."""
    g = torch.Generator().manual_seed(4)
    B, ng, group, hd, S = 4, 2, 3, 16, 9
    parts = (torch.randn(splits, B, ng, group + 2, hd, generator=g) * 2).to(DEV)
    bias = (torch.randn(ng * (group + 2) * hd, generator=g) * 0.5).to(dtype).to(DEV) if with_bias else None
    qkv = decode_ops.sum_splits(parts, dtype, 4, None if bias is None else bias.view(ng, group + 2, hd))
    expect = functools.reduce(torch.add, parts.unbind(0))
    expect = (expect if bias is None else expect + bias.float().view(ng, group + 2, hd)).to(dtype)
    assert torch.equal(qkv, expect)
    pos = torch.tensor([0, 3, 8, 5], device=DEV)
    cos = (torch.rand(S, hd, generator=g) * 2 - 1).to(dtype).to(DEV)  # tables by position
    sin = (torch.rand(S, hd, generator=g) * 2 - 1).to(dtype).to(DEV)
    caches = [torch.randn(B, ng, S, hd, generator=g).to(dtype).to(DEV) for _ in range(2)]
    outs = []
    for fn, args in ((decode_ops.rope_kv_write, (parts, bias)), (decode_ops.rope_kv_write, (qkv, None)),
                     (decode_ops.rope_kv_write_reference, (parts, bias))):
        kc, vc = caches[0].clone(), caches[1].clone()
        q = fn(args[0], cos, sin, kc, vc, pos, group, args[1])
        assert q.dtype == dtype
        outs.append((q, kc, vc))
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)  # the kernel: splits + bias read as their rounded sum
    assert torch.equal(outs[0][2], outs[2][2])  # values: copied, twin and kernel alike
    for a, b in zip(outs[0][:2], outs[2][:2]):
        torch.testing.assert_close(a, b, **_tol(dtype))  # RoPE: one fused computation against torch's roundings


_SM90_SCRIPT = r"""
import json, os, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_fp4.kernels import decode_ops

nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def sass(kernel, signature, constexprs, num_warps):
    k = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(k.asm["cubin"])
        fh.flush()
        return subprocess.run([nvdisasm, "-c", fh.name], capture_output=True, text=True, check=True).stdout


bf, f32, c = "*bf16", "*fp32", "constexpr"
out = {}
strides = {f"stride_{n}": "i32" for n in ("t", "g", "r", "split", "c", "kb", "kg", "ks", "ob", "og", "or")}
attention = dict(qkv_ptr=f32, bias_ptr=bf, cos_ptr=bf, sin_ptr=bf, k_ptr=bf, v_ptr=bf, pos_ptr="*i64", o_ptr=bf,
                 ml_ptr=f32, G="i32", scale="fp32", keys_per_split="i32", **strides, SPLITS=c, HAS_BIAS=c, GP=c, HD=c,
                 BLOCK_N=c, SPLIT=c, IP=c)
consts = dict(SPLITS=2, HAS_BIAS=True, GP=16, HD=128, BLOCK_N=decode_ops.ATTENTION_BLOCK_N, IP="tf32")
text = sass(decode_ops._rope_attention_kernel, attention, dict(consts, SPLIT=False), decode_ops.ATTENTION_WARPS)
split = sass(decode_ops._rope_attention_kernel, dict(attention, o_ptr=f32), dict(consts, SPLIT=True),
             decode_ops.ATTENTION_WARPS)
combine = sass(decode_ops._attention_combine_kernel,
               dict(part_ptr=f32, ml_ptr=f32, o_ptr=bf, G="i32", stride_ob="i32", stride_og="i32", stride_or="i32",
                    SPLITS=c, GP=c, HD=c), dict(SPLITS=decode_ops.ATTENTION_MAX_SPLITS, GP=16, HD=128), 4)
out["attention"] = text.count("STL") + split.count("STL") + combine.count("STL")
out["attention_mma"] = text.count("HMMA") > 0 and split.count("HMMA") > 0
rows = {f"stride_{n}": "i32" for n in ("t", "g", "r", "split", "c", "q", "qg", "qr", "kb", "kg", "ks")}
rope = dict(qkv_ptr=f32, bias_ptr=bf, cos_ptr=bf, sin_ptr=bf, q_ptr=bf, kc_ptr=bf, vc_ptr=bf, pos_ptr="*i64",
            rows_ptr="*i64", G="i32", H="i32", **rows, SPLITS=c, HAS_BIAS=c, HAS_ROWS=c, RP=c, BD=c)
out["rope"] = sass(decode_ops._rope_kv_kernel, rope, dict(SPLITS=2, HAS_BIAS=True, HAS_ROWS=True, RP=16, BD=128),
                   4).count("STL")
blk = decode_ops.SAMPLE_BLOCK
partials = dict(x_ptr=bf, m_ptr=f32, s_ptr=f32, V="i32", NB="i32", stride_x="i32", T="fp32", BLOCK=c)
pick = dict(x_ptr=bf, m_ptr=f32, s_ptr=f32, u_ptr=f32, tok_ptr="*i64", lp_ptr=f32, V="i32", NB="i32",
            stride_x="i32", T="fp32", BLOCK=c, NBP=c)
out["sample"] = (sass(decode_ops._sample_partials_kernel, partials, dict(BLOCK=blk), 4).count("STL")
                 + sass(decode_ops._sample_pick_kernel, pick, dict(BLOCK=blk, NBP=128), 4).count("STL"))
record = dict(tok_ptr="*i64", lp_ptr=f32, stop_ptr="*i64", done_ptr="*i1", n_ptr="*i64", ot_ptr="*i64", ol_ptr=f32,
              stopped_ptr="*i1", limit_ptr="*i64", cur_ptr="*i64", pos_ptr="*i64", B="i32", NSTOP="i32", LAST="i32",
              stride_ot="i32", stride_ol="i32", BLOCK=c)
out["record"] = sass(decode_ops._record_kernel, record, dict(BLOCK=64), 4).count("STL")
print(json.dumps(out))
"""


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU the tests above compile and run the kernels themselves")
def test_decode_step_kernels_compile_for_sm90_without_spills():
    """The RoPE + attention kernel (head size 128, on tensor cores), the RoPE kernel with a prefill's slots, the
    sampling kernels (blocks of SAMPLE_BLOCK logits) and the bookkeeping kernel compile for the H200 (Triton's own
    ptxas, no GPU needed, in a process without the interpreter) with no register spills: what the CPU interpreter
    cannot show."""
    import json
    import subprocess
    import sys

    env = compile_env()  # (the H200's Triton where .sm90-triton/ holds it: tests/sm90.py)
    r = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    if r.returncode != 0 and "nvdisasm" in r.stderr and "No such file" in r.stderr:
        pytest.skip("this Triton has no NVIDIA tools")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"attention": 0,
                                                             "attention_mma": True, "rope": 0, "sample": 0,
                                                             "record": 0}


_PDL_SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_fp4.kernels import decode_ops

f32, c = "*fp32", "constexpr"
sig = dict(tok_ptr="*i64", lp_ptr=f32, stop_ptr="*i64", done_ptr="*i1", n_ptr="*i64", ot_ptr="*i64", ol_ptr=f32,
           stopped_ptr="*i1", limit_ptr="*i64", cur_ptr="*i64", pos_ptr="*i64", B="i32", NSTOP="i32", LAST="i32",
           stride_ot="i32", stride_ol="i32", BLOCK=c, PDL=c)
out = {}
for pdl in (False, True):
    k = triton.compile(ASTSource(fn=decode_ops._record_kernel, signature=sig, constexprs=dict(BLOCK=64, PDL=pdl)),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": pdl})
    ptx = k.asm["ptx"]
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    out[str(pdl)] = [bool(k.metadata.launch_pdl), body.find("griddepcontrol.wait"),
                     body.find("griddepcontrol.launch_dependents"), body.find("ld.global")]
print(json.dumps(out))
"""


def test_pdl_launch_keywords(monkeypatch):
    """MEGATRON_FP4_PDL=1 adds the kernels' PDL constexpr and Triton's launch_pdl option, except in the interpreter
    (no grid dependency control there); off by default."""
    from megatron_fp4.kernels._common import PDL_ENV, pdl_launch

    monkeypatch.delenv(PDL_ENV, raising=False)
    assert pdl_launch() == {}
    monkeypatch.setenv(PDL_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl_launch() == {}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pdl_launch() == {"PDL": True, "launch_pdl": True}


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU the engine's tests run the kernels with PDL themselves")
def test_pdl_kernels_wait_before_their_first_load_on_sm90():
    """A decode kernel compiled for the H200 with PDL (Triton's compiler and ptxas, no GPU) carries the launch
    option and begins with griddepcontrol.wait and launch_dependents, before its first global load; without PDL
    neither instruction is there."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _PDL_SCRIPT], capture_output=True, text=True, env=compile_env(),
                       cwd=ROOT, timeout=600)
    if r.returncode != 0 and "nvdisasm" in r.stderr and "No such file" in r.stderr:
        pytest.skip("this Triton has no NVIDIA tools")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["False"][:3] == [False, -1, -1]
    launch_pdl, wait, launch, load = out["True"]
    assert launch_pdl and 0 <= wait < launch < load, out


@pytest.mark.parametrize("vocab, block", [(5000, 1024), (4096, 1024), (37, 1024), (5000, None)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_kernels_pick_the_twins_tokens(vocab, block, temperature, monkeypatch):
    """decode_ops.sample (blocks of logits in parallel, then one program per row) against sample_reference (torch's
    softmax and the two-level CDF inversion): the same tokens except where (1 - u) x total falls within fp32 rounding
    of a CDF step, logprobs to fp32 rounding, never a -inf (zero-probability) token: -inf logits, a whole block of
    them (the first), u at its ends; blocks of 1024 so a row has several, the last one partial, and the launch's own
    SAMPLE_BLOCK (None)."""
    if block is not None:
        monkeypatch.setattr(decode_ops, "SAMPLE_BLOCK", block)
    g = torch.Generator().manual_seed(vocab)
    B = 24
    logits = torch.randn(B, vocab, generator=g) * 3
    logits[:, ::5] = -float("inf")
    logits[: B // 2, : min(1024, vocab // 2)] = -float("inf")
    logits[:, -1] = -float("inf")
    u = torch.rand(B, generator=g)
    u[:4] = torch.tensor([0.0, 1 - 1e-7, 0.5, 1e-7])
    logits, u = logits.to(DEV), u.to(DEV)
    tok, lp = decode_ops.sample(logits, u, temperature)
    tok_ref, lp_ref = decode_ops.sample_reference(logits, u, temperature)
    assert tok.dtype == torch.long and lp.dtype == torch.float32
    assert torch.isfinite(logits.gather(1, tok.unsqueeze(1))).all()  # never a zero-probability token
    probs = torch.softmax(logits.double().cpu() / temperature, -1)
    cdf = probs.cumsum(-1)
    t = ((1 - u.double().cpu()) * cdf[:, -1]).unsqueeze(1)
    near = (cdf.gather(1, tok_ref.cpu().unsqueeze(1)) - t).abs().squeeze(1) < 1e-5
    assert torch.equal(tok.cpu()[~near], tok_ref.cpu()[~near]) and (~near).sum() >= B - 4  # (u's ends: near)
    lp_exact = torch.log(probs.gather(1, tok.cpu().unsqueeze(1))).squeeze(1)
    torch.testing.assert_close(lp.cpu().double(), lp_exact, atol=2e-5, rtol=0)
    torch.testing.assert_close(lp_ref.cpu()[~near], lp.cpu()[~near], atol=2e-5, rtol=0)


def test_sample_kernels_draw_the_distribution_and_read_bf16_as_is():
    """Uniforms on a fine grid pick each token in proportion to its probability (the inversion is exact up to one
    grid step per token), and bf16 logits are read as their fp32 values (no copy first): the same tokens."""
    g = torch.Generator().manual_seed(3)
    vocab, n = 100, 1000
    row = torch.randn(vocab, generator=g).to(torch.bfloat16).float()
    u = ((torch.arange(n, dtype=torch.float64) + 0.5) / n).float()
    tok, _ = decode_ops.sample(row.expand(n, vocab).contiguous().to(DEV), u.to(DEV))
    counts = torch.bincount(tok.cpu(), minlength=vocab).double()
    assert ((counts - n * torch.softmax(row.double(), -1)).abs() <= 1.0 + 1e-9).all()
    rows = torch.randn(8, vocab, generator=g).to(torch.bfloat16)
    uu = torch.rand(8, generator=g)
    for t in (1.0, 0.5):
        a = decode_ops.sample(rows.to(DEV), uu.to(DEV), t)
        b = decode_ops.sample(rows.float().to(DEV), uu.to(DEV), t)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("B", [5, 40])
def test_record_tokens_kernel_is_its_twin(B):
    """A decode step's bookkeeping in one kernel, against its torch twin on the same state: live slots (some done
    already) store token and logprob at their count (the last column once full), count, stop on any stop id, finish
    at their limit, keep the token and advance; finished slots change nowhere. Slots past B untouched."""
    g = torch.Generator().manual_seed(B)
    slots, max_new = B + 3, 6
    state = dict(done=torch.rand(slots, generator=g) < 0.3, n_gen=torch.randint(0, 8, (slots,), generator=g),
                 out_tok=torch.randint(0, 50, (slots, max_new), generator=g), out_lp=torch.randn(slots, max_new),
                 stopped=torch.rand(slots, generator=g) < 0.1, limit=torch.randint(1, 9, (slots,), generator=g),
                 tok=torch.randint(0, 50, (slots,), generator=g), pos=torch.randint(0, 30, (slots,), generator=g))
    tok = torch.randint(0, 12, (B,), generator=g)
    state["done"][:4] = torch.tensor([False, True, False, False])  # slot 0 stops, 1 is done, 2 reaches its limit,
    tok[0], tok[2:4] = 3, 5  # 3 stores at the last column (count past it)
    state["n_gen"][2], state["limit"][2], state["n_gen"][3], state["limit"][3] = 4, 5, 7, 9
    before = {k: v.clone() for k, v in state.items()}
    state, tok = {k: v.to(DEV) for k, v in state.items()}, tok.to(DEV)
    lp = -torch.rand(B, generator=g).to(DEV)
    stop_ids = torch.tensor([3, 7], device=DEV)
    want = {k: v.clone() for k, v in state.items()}
    decode_ops.record_tokens(state, tok, lp, stop_ids)
    decode_ops.record_tokens_reference(want, tok, lp, stop_ids)
    for k in state:
        assert torch.equal(state[k], want[k]), k
    got = {k: v.cpu() for k, v in state.items()}
    assert got["stopped"][0] and got["done"][0] and got["out_tok"][0, before["n_gen"][0].clamp(max=max_new - 1)] == 3
    assert all(torch.equal(got[k][1], before[k][1]) for k in got)  # done: nothing changes
    assert got["done"][2] and not got["stopped"][2] and got["n_gen"][2] == 5 and got["pos"][2] == before["pos"][2] + 1
    assert not got["done"][3] and got["out_tok"][3, -1] == 5 and got["n_gen"][3] == 8 and got["tok"][3] == 5
    assert all(torch.equal(got[k][B:], before[k][B:]) for k in got)
