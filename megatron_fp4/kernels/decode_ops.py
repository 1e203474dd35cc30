"""Fused elementwise kernels for one decode step of the native engine (a few tokens per call: launch-bound).

A decoder layer's decode step ran ~40 kernels, most of them tiny elementwise ones (torch's RMSNorm on bf16 inputs
with fp32 weights takes its unfused path; RoPE is five kernels per tensor); these put each group into one launch:

    y, s = add_rms_norm(x, delta, norm)        # s = x + delta (x's dtype), y = RMSNorm(s) as torch.nn.RMSNorm
    q = rope_kv_write(qkv, cos, sin, kc, vc, pos, group, bias, rows)   # + bias, RoPE, k and v to the caches
    o = rope_attention(qkv, cos, sin, kc, vc, pos, group, scale, bias)  # the same, then attention over each
                                               # sequence's cache up to its position (its own k, v from registers)
    a = swiglu(a)                              # silu(a[:, :F]) * a[:, F:]
    y = split_sum(t, dtype, bias)              # a GEMM's split-K partial sums + bias, rounded once
    tok, lp = sample(logits, u, temperature)   # softmax(logits / T)'s CDF inverted at (1 - u), its logprob
    record_tokens(state, tok, lp, stop_ids)    # the step's bookkeeping: store, count, stop, advance

Each has its PyTorch twin (``*_reference``: what the static decode path computes without them) and matches it up
to the rounding of one fused computation (fp32 inside, one rounding to the output dtype where torch rounds after
every op: tests/test_decode_ops.py). CUDA, or Triton's CPU interpreter (fp32/fp16 in the tests; the interpreter
rounds fp32 to bf16 by truncation).

``delta``, ``a`` and ``qkv`` may also be a decode GEMM's output as stored, ``[splits, B, N]`` fp32 partial sums
(:func:`megatron_fp4.kernels.cuda_decode.w4_decode` with ``out_dtype`` None): they are added in split order in fp32
(``qkv``: then its linear's bias) and rounded to the model's dtype as they are read, as the GEMM's own bf16 output
would be (deterministic: no atomics), so the step needs no zero-fill, bias or cast kernel per linear.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_fp4.kernels._common import HAS_TRITON, kernels_usable, pdl_launch, tl, triton

__all__ = ["add_rms_norm", "add_rms_norm_reference", "attention_splits", "decode_attention_reference", "invert_cdf",
           "record_tokens", "record_tokens_reference", "rope_attention", "rope_attention_reference", "rope_reference",
           "rope_kv_write", "rope_kv_write_reference", "sample", "sample_reference", "split_sum", "sum_splits",
           "swiglu", "swiglu_reference"]


# ----------------------------------------------------------------------------------------------------------------
# PyTorch twins: the ops the static decode path runs without the kernels
# ----------------------------------------------------------------------------------------------------------------
def sum_splits(t: torch.Tensor, dtype: torch.dtype, dims: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``t`` with ``dims`` dimensions, or ``[splits, ...]`` of them (split-K partial sums): added in split order in fp32
    (as the kernels here read them), ``bias`` added in fp32, and rounded to ``dtype``."""
    parts = [t] if t.dim() == dims else list(t.unbind(0))
    acc = parts[0].float() if len(parts) > 1 or bias is not None else parts[0]
    for part in parts[1:]:
        acc = acc + part.float()
    return (acc if bias is None else acc + bias.float()).to(dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: Optional[torch.Tensor], norm: torch.nn.Module
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    s = x if delta is None else x + sum_splits(delta, x.dtype, x.dim())
    return norm(s), s


def rope_reference(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``t [..., hd]``: t * cos + rotate_half(t) * sin (cos, sin broadcast against t)."""
    h = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., h:], t[..., :h]), dim=-1) * sin


def rope_kv_write_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, pos: torch.Tensor, group: int,
                            bias: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``qkv [T, ng, group + 2, hd]`` for T tokens (megatron's layout: a kv group's query heads, then k, then v; or
    ``[splits, T, ng, group + 2, hd]`` partial sums, see the module doc), ``bias`` (the linear's, ``[ng * (group + 2)
    * hd]``) added to their fp32 sum before it rounds to the caches' dtype; ``cos, sin [S, hd]`` the tables by
    position, ``pos [T]`` each token's; caches ``[slots, ng, S, hd]``, ``rows [T]`` each token's slot (None: token
    t's is t, one token per sequence as in a decode step; a prefill's prompt tokens share their sequence's). Writes
    rotated k and v at (row, pos); returns the rotated queries ``[T, ng, group, hd]``."""
    if qkv.dim() == 5 or bias is not None:
        qkv = sum_splits(qkv, k_cache.dtype, 4, None if bias is None else bias.view(qkv.shape[-3:]))
    rows = torch.arange(qkv.shape[0], device=qkv.device) if rows is None else rows
    cos, sin = cos[pos], sin[pos]
    q = rope_reference(qkv[:, :, :group], cos[:, None, None], sin[:, None, None])
    k_cache[rows, :, pos] = rope_reference(qkv[:, :, group], cos[:, None], sin[:, None])
    v_cache[rows, :, pos] = qkv[:, :, group + 1]
    return q


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """One query token per sequence, ``q [B, ng, G, hd]`` (G query heads per kv group), against its cache rows 0..pos
    of ``k_cache, v_cache [B, ng, S, hd]``: PyTorch SDPA with a mask (what the static decode path runs)."""
    valid = (torch.arange(k_cache.shape[2], device=q.device)[None, :] <= pos[:, None]).view(q.shape[0], 1, 1, -1)
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=valid, scale=scale)


def rope_attention_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, pos: torch.Tensor, group: int, scale: float,
                             bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`rope_kv_write_reference` (one token per sequence), then :func:`decode_attention_reference`."""
    q = rope_kv_write_reference(qkv, cos, sin, k_cache, v_cache, pos, group, bias)
    return decode_attention_reference(q, k_cache, v_cache, pos, scale)


def swiglu_reference(a: torch.Tensor, out_dtype: Optional[torch.dtype] = None, splits: bool = False
                     ) -> torch.Tensor:
    """``a [..., 2F]`` (``splits``: ``[splits, ..., 2F]`` partial sums, added first)."""
    a0, a1 = torch.chunk(sum_splits(a, out_dtype or a.dtype, a.dim() - splits), 2, dim=-1)
    return F.silu(a0) * a1


def _cdf_block(vocab: int) -> int:
    """The block of :func:`invert_cdf`: the largest power of two up to 1024 dividing ``vocab`` (Qwen2.5's 152064:
    512, Llama 3's 128256: 256), else 256 (the probabilities are then padded to whole blocks)."""
    blk = min(1024, vocab & -vocab)
    return blk if blk >= 64 else 256


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first token of each row of ``probs [B, V]`` (non-negative) whose cumulative sum reaches (1 - u) x the row's
    total, in two levels: block sums and their cumulative sum pick the block, a cumulative sum inside that block
    the token. No scan over the whole vocabulary (on the H200 torch's scan over 152k values took 0.25 ms of each
    7B decode step) and never a zero-probability token: the target is above the blocks before (they sum to less) and
    at most the chosen block's own sum."""
    B, V = probs.shape
    blk = _cdf_block(V)
    p = (F.pad(probs, (0, -V % blk)) if V % blk else probs).view(B, -1, blk)
    sums = p.sum(-1)
    csum = sums.cumsum(-1)
    x = ((1.0 - u.to(csum.dtype)) * csum[:, -1]).unsqueeze(-1)
    b = torch.searchsorted(csum, x).clamp_(max=csum.shape[1] - 1)
    before = torch.where(b > 0, csum.gather(1, (b - 1).clamp_(min=0)), torch.zeros_like(x))
    inner = p.gather(1, b.unsqueeze(-1).expand(B, 1, blk)).squeeze(1).cumsum(-1)
    j = torch.searchsorted(inner, torch.minimum(x - before, inner[:, -1:])).clamp_(max=blk - 1)
    return (b * blk + j).squeeze(-1).clamp_(max=V - 1)


def sample_reference(logits: torch.Tensor, u: torch.Tensor, temperature: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B]) of ``logits [B, V]`` (any float dtype, read as fp32) given uniforms ``u [B]`` in
    [0, 1): the first token whose cumulative softmax(logits / T) reaches (1 - u) x the total (:func:`invert_cdf`),
    and the log of its probability."""
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    probs = torch.softmax(scaled, dim=-1)
    tok = invert_cdf(probs, u)
    return tok, probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1).log()


def record_tokens_reference(state: dict, tok: torch.Tensor, lp: torch.Tensor, stop_ids: torch.Tensor) -> None:
    """A decode step's bookkeeping for its slots [0, B) (B = ``tok.shape[0]``), on the device: each live slot (not
    ``done``) stores its token and logprob at its count (``n_gen``, capped at the last column), counts it, is
    ``stopped`` by a token in ``stop_ids`` and ``done`` by that or its ``limit``, keeps the token as its next input
    (``tok``) and advances its position (``pos``); finished slots keep theirs. ``state``: the static decode path's
    tensors (``done``, ``n_gen``, ``out_tok``, ``out_lp``, ``stopped``, ``limit``, ``tok``, ``pos``; the output
    columns are ``out_tok.shape[1]``)."""
    B = tok.shape[0]
    done, n_gen = state["done"][:B], state["n_gen"][:B]
    ot, ol = state["out_tok"][:B], state["out_lp"][:B]
    idx = n_gen.clamp(max=ot.shape[1] - 1).unsqueeze(1)
    live = ~done
    ot.scatter_(1, idx, torch.where(live, tok, ot.gather(1, idx).squeeze(1)).unsqueeze(1))
    ol.scatter_(1, idx, torch.where(live, lp, ol.gather(1, idx).squeeze(1)).unsqueeze(1))
    stop = (tok.unsqueeze(1) == stop_ids.unsqueeze(0)).any(dim=1) & live
    n_gen.add_(live.long())
    state["stopped"][:B] |= stop
    state["pos"][:B] += live.long()
    done |= stop | (n_gen >= state["limit"][:B])
    state["tok"][:B] = torch.where(live, tok, state["tok"][:B])


# ----------------------------------------------------------------------------------------------------------------
# Triton device code
# ----------------------------------------------------------------------------------------------------------------
if HAS_TRITON:
    from megatron_fp4.kernels._common import pdl_enter

    @triton.jit
    def _residual_row(x_ptr, d_ptr, s_ptr, N, eps, stride_x, stride_d, stride_s, stride_split, SPLITS: tl.constexpr,
                      HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        """One row (program_id 0): s = x + d rounded to x's dtype and stored (d = the splits' partial sums added in
        order in fp32, then rounded to x's dtype: read as the GEMM's own rounded output). Returns (s in fp32 [BLOCK],
        r = rsqrt(mean(s^2) + eps), the columns, their mask)."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * stride_d + cols, mask=m, other=0.0).to(tl.float32)
            for k in tl.static_range(1, SPLITS):  # (unrolled: the splits' loads in flight together)
                d += tl.load(d_ptr + k * stride_split + row * stride_d + cols, mask=m, other=0.0).to(tl.float32)
            d = d.to(x_ptr.dtype.element_ty)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(s_ptr + row * stride_s + cols, x, mask=m)
        xf = x.to(tl.float32)
        return xf, 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps), cols, m

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, y_ptr, s_ptr, N, eps, stride_x, stride_d, stride_y, stride_s,
                             stride_split, SPLITS: tl.constexpr, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr = False):
        """One row: s and r (:func:`_residual_row`), y = s * r * w in fp32 rounded once to y's dtype
        (torch.nn.RMSNorm's computation)."""
        pdl_enter(PDL)
        xf, r, cols, m = _residual_row(x_ptr, d_ptr, s_ptr, N, eps, stride_x, stride_d, stride_s, stride_split,
                                       SPLITS, HAS_DELTA, BLOCK)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + tl.program_id(0) * stride_y + cols, (xf * r * w).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_rows(qkv_ptr, bias_ptr, cos_ptr, sin_ptr, t, g, p, G, H, stride_t, stride_g, stride_r, stride_split,
                   stride_c, DT: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, RP: tl.constexpr,
                   BD: tl.constexpr):
        """Token t's rows of kv group g ([RP, BD]: rows 0..G-1 its query heads, G the key, G + 1 the value, 2H
        values each): the splits' partial sums added in order in fp32, then the bias, rounded to DT; rows 0..G
        rotated at position p as x * cos + rotate_half(x) * sin (the halves swapped, the first negated), in fp32
        (the caller rounds once); row G + 1 as it is. Returns (rows, r, d, their mask)."""
        r = tl.arange(0, RP)[:, None]
        d = tl.arange(0, BD)[None, :]
        mask = (r < G + 2) & (d < 2 * H)
        sw = tl.where(d < H, d + H, d - H)  # the other half's column
        base = qkv_ptr + t * stride_t + g * stride_g + r * stride_r
        x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
        xs = tl.load(base + sw, mask=mask, other=0.0).to(tl.float32)
        for k in tl.static_range(1, SPLITS):
            x += tl.load(base + k * stride_split + d, mask=mask, other=0.0).to(tl.float32)
            xs += tl.load(base + k * stride_split + sw, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            bbase = bias_ptr + (g * (G + 2) + r) * (2 * H)
            x += tl.load(bbase + d, mask=mask, other=0.0).to(tl.float32)
            xs += tl.load(bbase + sw, mask=mask, other=0.0).to(tl.float32)
        x = x.to(DT).to(tl.float32)  # (a no-op for one split in DT)
        xs = xs.to(DT).to(tl.float32)
        cmask = d < 2 * H
        c = tl.load(cos_ptr + p * stride_c + d, mask=cmask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + p * stride_c + d, mask=cmask, other=0.0).to(tl.float32)
        rot = x * c + tl.where(d < H, -xs, xs) * s
        return tl.where(r <= G, rot, x), r, d, mask

    @triton.jit
    def _rope_kv_kernel(qkv_ptr, bias_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, pos_ptr, rows_ptr, G, H,
                        stride_t, stride_g, stride_r, stride_split, stride_c, stride_q, stride_qg, stride_qr,
                        stride_kb, stride_kg, stride_ks, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_ROWS: tl.constexpr, RP: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
        """One (token, kv group): :func:`_rope_rows` at the token's position, rounded to q's dtype; the queries to
        q, the key and value to the token's cache slot (rows_ptr's, else the token's own index) at that position."""
        pdl_enter(PDL)
        b = tl.program_id(0)
        g = tl.program_id(1)
        p = tl.load(pos_ptr + b)
        y, r, d, mask = _rope_rows(qkv_ptr, bias_ptr, cos_ptr, sin_ptr, b, g, p, G, H, stride_t, stride_g, stride_r,
                                   stride_split, stride_c, q_ptr.dtype.element_ty, SPLITS, HAS_BIAS, RP, BD)
        y = y.to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + b * stride_q + g * stride_qg + r * stride_qr + d, y, mask=mask & (r < G))
        slot = b
        if HAS_ROWS:
            slot = tl.load(rows_ptr + b)
        kv = slot * stride_kb + g * stride_kg + p * stride_ks + d + r * 0
        tl.store(kc_ptr + kv, y, mask=mask & (r == G))
        tl.store(vc_ptr + kv, y.to(vc_ptr.dtype.element_ty), mask=mask & (r == G + 1))

    @triton.jit
    def _rope_attention_kernel(qkv_ptr, bias_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, ml_ptr, G, scale,
                               keys_per_split, stride_t, stride_g, stride_r, stride_split, stride_c, stride_kb,
                               stride_kg, stride_ks, stride_ob, stride_og, stride_or, SPLITS: tl.constexpr,
                               HAS_BIAS: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                               SPLIT: tl.constexpr, IP: tl.constexpr, PDL: tl.constexpr = False):
        """One (sequence, kv group[, split of the cache]): :func:`_rope_rows` of its step's qkv at its position p
        (the key and value written to the cache at p by the program whose rows hold p: no program reads that row),
        then its G query heads (rows, padded to GP) against cache rows 0..p-1 (SPLIT: those of rows [split *
        keys_per_split, + keys_per_split)), BLOCK_N keys at a time, and the step's own key and value from
        registers: online softmax in fp32, P rounded to the cache's dtype for the PV product (as flash attention).
        SPLIT: the split's unnormalized output and its (max, sum) go to o_ptr / ml_ptr (fp32, [B, ng, splits, GP,
        ...]) for _attention_combine_kernel."""
        pdl_enter(PDL)
        b = tl.program_id(0)
        g = tl.program_id(1)
        dt = k_ptr.dtype.element_ty
        p = tl.load(pos_ptr + b)
        y, r, d, _ = _rope_rows(qkv_ptr, bias_ptr, cos_ptr, sin_ptr, b, g, p, G, HD // 2, stride_t, stride_g,
                                stride_r, stride_split, stride_c, dt, SPLITS, HAS_BIAS, GP, HD)
        y = y.to(dt).to(tl.float32)
        q = tl.where(r < G, y, 0.0).to(dt)
        k_new = tl.sum(tl.where(r == G, y, 0.0), axis=0)  # [HD]: the step's key and value (DT numbers)
        v_new = tl.sum(tl.where(r == G + 1, y, 0.0), axis=0)
        lo = 0
        hi = p
        holds = p >= 0  # (this program's rows hold p)
        if SPLIT:
            lo = tl.program_id(2) * keys_per_split
            hi = tl.minimum(p, lo + keys_per_split)
            holds = (p >= lo) & (p < lo + keys_per_split)
        kbase = k_ptr + b * stride_kb + g * stride_kg
        vbase = v_ptr + b * stride_kb + g * stride_kg
        n = tl.arange(0, BLOCK_N)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, HD], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            cols = start + n
            kv_mask = cols[:, None] < hi
            k = tl.load(kbase + cols[:, None] * stride_ks + d, mask=kv_mask, other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=IP)
            sc = tl.where(cols[None, :] < hi, sc * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            v = tl.load(vbase + cols[:, None] * stride_ks + d, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(pr.to(dt), v, input_precision=IP)
            m_i = m_new
        if holds:  # the step's own key and value: to the cache at p (read by no program), and from registers here
            dd = tl.arange(0, HD)
            tl.store(kbase + p * stride_ks + dd, k_new.to(dt))
            tl.store(vbase + p * stride_ks + dd, v_new.to(dt))
            sc = tl.sum(q.to(tl.float32) * k_new[None, :], axis=1) * scale
            m_new = tl.maximum(m_i, sc)
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new)
            l_i = l_i * alpha + pr
            acc = acc * alpha[:, None] + pr.to(dt).to(tl.float32)[:, None] * v_new[None, :]
            m_i = m_new
        if SPLIT:
            sp = tl.program_id(2)
            nsp = tl.num_programs(2)
            row = (b * tl.num_programs(1) + g) * nsp + sp  # [B, ng, splits] flattened
            tl.store(o_ptr + row * GP * HD + r * HD + d, acc)
            rr = tl.arange(0, GP)
            tl.store(ml_ptr + row * 2 * GP + rr, m_i)
            tl.store(ml_ptr + row * 2 * GP + GP + rr, l_i)
        else:
            o = acc / l_i[:, None]
            tl.store(o_ptr + b * stride_ob + g * stride_og + r * stride_or + d, o.to(o_ptr.dtype.element_ty),
                     mask=r < G)

    @triton.jit
    def _attention_combine_kernel(part_ptr, ml_ptr, o_ptr, G, stride_ob, stride_og, stride_or, SPLITS: tl.constexpr,
                                  GP: tl.constexpr, HD: tl.constexpr, PDL: tl.constexpr = False):
        """One (sequence, kv group): the splits' partial outputs merged by their softmax maxima and sums (an empty
        split has max -inf and sum 0: weight 0; split 0 always holds row 0)."""
        pdl_enter(PDL)
        b = tl.program_id(0)
        g = tl.program_id(1)
        r = tl.arange(0, GP)
        d = tl.arange(0, HD)[None, :]
        base = (b * tl.num_programs(1) + g) * SPLITS
        m = tl.full([GP], float("-inf"), tl.float32)
        for sp in range(SPLITS):  # (loops, not unrolled: 16 unrolled splits spilled registers with Triton 3.6)
            m = tl.maximum(m, tl.load(ml_ptr + (base + sp) * 2 * GP + r))
        l_sum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, HD], tl.float32)
        for sp in range(SPLITS):
            w = tl.exp(tl.load(ml_ptr + (base + sp) * 2 * GP + r) - m)
            l_sum += w * tl.load(ml_ptr + (base + sp) * 2 * GP + GP + r)
            acc += w[:, None] * tl.load(part_ptr + (base + sp) * GP * HD + r[:, None] * HD + d)
        o = acc / l_sum[:, None]
        tl.store(o_ptr + b * stride_ob + g * stride_og + r[:, None] * stride_or + d, o.to(o_ptr.dtype.element_ty),
                 mask=r[:, None] < G)

    @triton.jit
    def _split_sum_kernel(t_ptr, b_ptr, y_ptr, N, stride_t, stride_y, stride_split, DT: tl.constexpr,
                          SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """y = DT(t's splits added in order in fp32 [+ bias in fp32]): one rounding, as :func:`sum_splits`."""
        pdl_enter(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        acc = tl.load(t_ptr + row * stride_t + cols, mask=m, other=0.0).to(tl.float32)
        for k in tl.static_range(1, SPLITS):
            acc += tl.load(t_ptr + k * stride_split + row * stride_t + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, acc.to(DT), mask=m)

    @triton.jit
    def _sample_partials_kernel(x_ptr, m_ptr, s_ptr, V, NB, stride_x, T, BLOCK: tl.constexpr,
                                PDL: tl.constexpr = False):
        """One (row, block of BLOCK logits): m = max(x / T), s = sum(exp(x / T - m)) (m = -inf, s = 0: all -inf)."""
        pdl_enter(PDL)
        row = tl.program_id(0)
        blk = tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / T
        m = tl.max(x, axis=0)
        s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), axis=0)
        tl.store(m_ptr + row * NB + blk, m)
        tl.store(s_ptr + row * NB + blk, s)

    @triton.jit
    def _sample_pick_kernel(x_ptr, m_ptr, s_ptr, u_ptr, tok_ptr, lp_ptr, V, NB, stride_x, T, BLOCK: tl.constexpr,
                            NBP: tl.constexpr, PDL: tl.constexpr = False):
        """One row: the blocks' sums on the row's max M, w_b = s_b exp(m_b - M), their total and cumulative sum; the
        first block whose cumulative sum reaches (1 - u) x total, then the first token inside it whose cumulative
        exp(x / T - m_b) reaches the rest (at most the block's own sum, and above zero: never a zero-probability
        token); logprob x / T - M - log(total)."""
        pdl_enter(PDL)
        row = tl.program_id(0)
        j = tl.arange(0, NBP)
        jm = j < NB
        m = tl.load(m_ptr + row * NB + j, mask=jm, other=float("-inf"))
        M = tl.max(m, axis=0)
        w = tl.where(jm & (m > float("-inf")), tl.load(s_ptr + row * NB + j, mask=jm, other=0.0) * tl.exp(m - M),
                     0.0)
        total = tl.sum(w, axis=0)
        c = tl.cumsum(w, axis=0)
        target = (1.0 - tl.load(u_ptr + row)) * total
        last = tl.max(tl.where(w > 0, j, 0), axis=0)  # (rounding may leave the target above every sum)
        b = tl.minimum(tl.sum((jm & (c < target)).to(tl.int32), axis=0), last)
        before = tl.sum(tl.where(j == b - 1, c, 0.0), axis=0)
        m_b = tl.sum(tl.where(j == b, m, 0.0), axis=0)
        w_b = tl.sum(tl.where(j == b, w, 0.0), axis=0)
        cols = b * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / T
        ce = tl.cumsum(tl.exp(x - m_b), axis=0)  # (on the block's own max, as its sum s_b)
        rest = tl.minimum(target - before, w_b) / tl.exp(m_b - M)  # in the block's scale
        rest = tl.maximum(tl.minimum(rest, tl.max(ce, axis=0)), 1e-38)
        k = tl.minimum(tl.sum((ce < rest).to(tl.int32), axis=0), BLOCK - 1)
        tok = tl.minimum(b * BLOCK + k, V - 1)
        x_tok = tl.sum(tl.where(tl.arange(0, BLOCK) == tok - b * BLOCK, x, 0.0), axis=0)
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, x_tok - M - tl.log(total))

    @triton.jit
    def _record_kernel(tok_ptr, lp_ptr, stop_ptr, done_ptr, n_ptr, ot_ptr, ol_ptr, stopped_ptr, limit_ptr, cur_ptr,
                       pos_ptr, B, NSTOP, LAST, stride_ot, stride_ol, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """:func:`record_tokens_reference` for slots [0, B) in one program."""
        pdl_enter(PDL)
        b = tl.arange(0, BLOCK)
        m = b < B
        live = m & (tl.load(done_ptr + b, mask=m, other=1) == 0)
        tok = tl.load(tok_ptr + b, mask=m, other=0)
        n = tl.load(n_ptr + b, mask=m, other=0)
        idx = tl.minimum(n, LAST)
        tl.store(ot_ptr + b * stride_ot + idx, tok, mask=live)
        tl.store(ol_ptr + b * stride_ol + idx, tl.load(lp_ptr + b, mask=m, other=0.0), mask=live)
        stop = tl.zeros([BLOCK], dtype=tl.int1)
        for i in range(NSTOP):
            stop = stop | (tok == tl.load(stop_ptr + i))
        stop = stop & live
        n = n + live.to(n.dtype)
        tl.store(n_ptr + b, n, mask=m)
        tl.store(stopped_ptr + b, stop, mask=stop)
        tl.store(done_ptr + b, stop | (n >= tl.load(limit_ptr + b, mask=m, other=0)), mask=live)
        tl.store(cur_ptr + b, tok, mask=live)
        tl.store(pos_ptr + b, tl.load(pos_ptr + b, mask=live, other=0) + 1, mask=live)

    @triton.jit
    def _swiglu_kernel(a_ptr, y_ptr, F_, stride_a, stride_y, stride_split, DT: tl.constexpr,
                       SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """a (its splits' partial sums added in order in fp32) rounded to DT, silu(a0) rounded to it (as F.silu),
        times a1, rounded once more (as torch's multiply)."""
        pdl_enter(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < F_
        dt = DT
        a0 = tl.load(a_ptr + row * stride_a + cols, mask=m, other=0.0).to(tl.float32)
        a1 = tl.load(a_ptr + row * stride_a + F_ + cols, mask=m, other=0.0).to(tl.float32)
        for k in tl.static_range(1, SPLITS):
            a0 += tl.load(a_ptr + k * stride_split + row * stride_a + cols, mask=m, other=0.0).to(tl.float32)
            a1 += tl.load(a_ptr + k * stride_split + row * stride_a + F_ + cols, mask=m, other=0.0).to(tl.float32)
        a0 = a0.to(dt).to(tl.float32)
        a1 = a1.to(dt).to(tl.float32)
        s = (a0 / (1.0 + tl.exp(-a0))).to(dt).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, (s * a1).to(dt), mask=m)


# ----------------------------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------------------------
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16} if HAS_TRITON else {}


def _norm_warps(block: int) -> int:
    """Warps of the RMSNorm kernels for rows of ``block`` (a power of two) columns: 8 at 4096."""
    return min(16, max(4, block // 512))


def _rms_params(norm: torch.nn.Module, x: torch.Tensor) -> Optional[tuple[torch.Tensor, float]]:
    """(weight, eps) of a torch RMSNorm over x's last dim, or None where the kernel does not apply."""
    w = getattr(norm, "weight", None)
    if (type(norm) is not torch.nn.RMSNorm or w is None or w.dim() != 1 or w.shape[0] != x.shape[-1]
            or x.dim() != 2 or x.stride(-1) != 1):
        return None
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    return w, float(eps)


def add_rms_norm(x: torch.Tensor, delta: Optional[torch.Tensor], norm: torch.nn.Module
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``norm(x + delta)``, ``x + delta``) for ``x, delta [B, N]`` (``delta`` None: no add; or ``[splits, B, N]``
    partial sums, see the module doc): one kernel for a torch RMSNorm (output in x's dtype, as torch's), the twin
    otherwise."""
    p = _rms_params(norm, x)
    if p is None or not kernels_usable(x) or (delta is not None and (delta.shape[-2:] != x.shape or delta.dim() > 3
                                                                     or delta.stride(-1) != 1)):
        return add_rms_norm_reference(x, delta, norm)
    w, eps = p
    s = torch.empty_like(x) if delta is not None else x
    d = delta if delta is not None else x  # (read only with a delta)
    splits, stride_split = (d.shape[0], d.stride(0)) if d.dim() == 3 else (1, 0)
    BLOCK = triton.next_power_of_2(x.shape[1])
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _add_rms_norm_kernel[(x.shape[0],)](x, d, w, y, s, x.shape[1], eps, x.stride(0), d.stride(-2), y.stride(0),
                                        s.stride(0), stride_split, SPLITS=splits, HAS_DELTA=delta is not None,
                                        BLOCK=BLOCK, num_warps=_norm_warps(BLOCK), **pdl_launch())
    return y, s


def add_rms_norm_resq(x: torch.Tensor, delta: Optional[torch.Tensor], norm: torch.nn.Module, fmt: str
                      ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(ResQ 2:4's bf16 sum of ``norm(x + delta)``, ``x + delta``) in one CUDA kernel
    (:func:`megatron_fp4.kernels.cuda_quantize.norm_resq`: :func:`add_rms_norm`'s Triton arithmetic, then the ResQ
    quantize), or None where it does not apply (then :func:`add_rms_norm` and the ResQ linear serve)."""
    p = _rms_params(norm, x)
    return None if p is None else rms_norm_resq(x, delta, p[0], p[1], fmt)


def rms_norm_resq(x: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float, fmt: str
                  ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`add_rms_norm_resq` for an RMSNorm given by its ``weight`` and ``eps`` (another library's norm module,
    e.g. SGLang's in the plug-in), or None where the kernel does not apply."""
    from megatron_fp4.kernels import cuda_quantize

    if not cuda_quantize.norm_resq_usable(x, delta, weight, fmt):
        return None
    return cuda_quantize.norm_resq(x, delta, weight, eps, fmt, _norm_warps(1 << (x.shape[1] - 1).bit_length()))


#: Keys per step of the decode attention kernel.
ATTENTION_BLOCK_N = 64
#: The decode attention splits a cache longer than this many keys per split when (sequence, kv group) programs alone
#: would leave streaming multiprocessors idle (few sequences, long contexts: a second, combining kernel then merges
#: the splits); shorter caches take one kernel.
ATTENTION_MIN_SPLIT_KEYS = 512
#: Warps of the decode attention kernel (at 4 it spills registers for sm_90 at head size 128, Triton 3.6 and 3.9).
ATTENTION_WARPS = 8
#: At most this many splits (the combining kernel reads them one after another).
ATTENTION_MAX_SPLITS = 16


def attention_splits(programs: int, keys: int, sms: int) -> int:
    """Cache splits of the decode attention for ``programs`` (sequence, kv group) pairs over ``keys`` cache rows on
    ``sms`` multiprocessors: enough to give every multiprocessor a program, each split at least
    :data:`ATTENTION_MIN_SPLIT_KEYS` keys, at most :data:`ATTENTION_MAX_SPLITS`; 1 where the programs already fill
    the GPU or the cache is short."""
    return max(1, min(-(-sms // programs), keys // ATTENTION_MIN_SPLIT_KEYS, ATTENTION_MAX_SPLITS))


def _rope_usable(parts: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, pos: torch.Tensor, group: int, bias: Optional[torch.Tensor],
                 rows: Optional[torch.Tensor] = None) -> bool:
    """Whether the RoPE kernels' ``_rope_rows`` (and cache writes) take these operands: ``parts [splits, T, ng,
    group + 2, hd]`` and the caches with unit last strides, cos / sin tables alike, ``pos`` (and ``rows``) read
    as contiguous, the bias ``[ng * (group + 2) * hd]`` contiguous."""
    return (kernels_usable(parts, cos, sin, k_cache, v_cache, pos, *([] if rows is None else [rows]))
            and parts.shape[3] == group + 2 and parts.stride(-1) == 1 and k_cache.stride(-1) == 1
            and v_cache.stride() == k_cache.stride() and cos.stride(-1) == 1 and cos.stride() == sin.stride()
            and all(t.numel() <= 1 or t.stride(0) == 1 for t in (pos, rows) if t is not None)
            and (bias is None or (bias.numel() == math.prod(parts.shape[2:]) and bias.is_contiguous())))


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, pos: torch.Tensor, group: int, scale: float,
                   bias: Optional[torch.Tensor] = None, splits: Optional[int] = None) -> torch.Tensor:
    """:func:`rope_attention_reference` (``qkv [B, ng, group + 2, hd]`` or its splits' partial sums, the step's one
    token per sequence; caches ``[B, ng, S, hd]``) in one kernel that reads each sequence's cache only up to its
    position (SDPA with a mask reads all S rows: ~20 us a layer on the 7B shape at batch 64, profiled in session 29)
    and takes the step's own key and value from registers (no RoPE kernel, no queries written out); the twins where
    the kernel does not apply (a head size not a power of two, other layouts). Returns ``[B, ng, group, hd]``.
    ``splits``: cache splits (default :func:`attention_splits`; a static count, so a CUDA graph's replay at any
    position is valid)."""
    parts = qkv if qkv.dim() == 5 else qkv.unsqueeze(0)
    n_split, B, ng, R, hd = parts.shape
    if (not _rope_usable(parts, cos, sin, k_cache, v_cache, pos, group, bias) or hd < 16 or hd & (hd - 1)
            or k_cache.dtype not in _TL_DTYPES or v_cache.dtype != k_cache.dtype or k_cache.shape != v_cache.shape
            or k_cache.shape[:2] != (B, ng) or k_cache.shape[3] != hd or pos.shape != (B,)):
        return rope_attention_reference(qkv, cos, sin, k_cache, v_cache, pos, group, scale, bias)
    S = k_cache.shape[2]
    if splits is None:
        sms = torch.cuda.get_device_properties(qkv.device).multi_processor_count if qkv.is_cuda else 132
        splits = attention_splits(B * ng, S, sms)
    per_split = -(-S // splits)
    per_split = -(-per_split // ATTENTION_BLOCK_N) * ATTENTION_BLOCK_N  # (splits start on block edges)
    splits = -(-S // per_split)
    GP = max(16, triton.next_power_of_2(group + 2))
    o = torch.empty((B, ng, group, hd), dtype=k_cache.dtype, device=qkv.device)
    common = dict(GP=GP, HD=hd)
    ip = "ieee" if k_cache.dtype == torch.float32 else "tf32"  # (fp32 tests: exact dots, not TF32)
    args = (parts, parts if bias is None else bias, cos, sin, k_cache, v_cache, pos)
    strides = (group, float(scale), per_split, parts.stride(1), parts.stride(2), parts.stride(3), parts.stride(0),
               cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), o.stride(0), o.stride(1),
               o.stride(2))
    kw = dict(SPLITS=n_split, HAS_BIAS=bias is not None, BLOCK_N=ATTENTION_BLOCK_N, IP=ip, num_warps=ATTENTION_WARPS,
              **common)
    if splits == 1:
        _rope_attention_kernel[(B, ng)](*args, o, o, *strides, SPLIT=False, **kw, **pdl_launch())
        return o
    part = torch.empty((B, ng, splits, GP, hd), dtype=torch.float32, device=qkv.device)
    ml = torch.empty((B, ng, splits, 2, GP), dtype=torch.float32, device=qkv.device)
    _rope_attention_kernel[(B, ng, splits)](*args, part, ml, *strides, SPLIT=True, **kw, **pdl_launch())
    _attention_combine_kernel[(B, ng)](part, ml, o, group, o.stride(0), o.stride(1), o.stride(2), SPLITS=splits,
                                       **common, **pdl_launch())
    return o


def split_sum(t: torch.Tensor, dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`sum_splits` of a GEMM's output ``t``, ``[M, N]`` or its split-K partial sums ``[splits, M, N]``, plus
    ``bias [N]``, rounded once to ``dtype``, in one kernel (no zero-fill, atomics, bias cast or add kernels: what
    a linear with a bias, or a split-K GEMM's bf16 output, costs otherwise)."""
    parts = t if t.dim() == 3 else t.unsqueeze(0)
    if (not kernels_usable(parts) or t.dim() not in (2, 3) or parts.stride(-1) != 1 or dtype not in _TL_DTYPES
            or (bias is not None and (bias.shape != parts.shape[-1:] or bias.stride(-1) != 1
                                      or bias.device != t.device))):
        return sum_splits(t, dtype, 2, bias)
    S, M, N = parts.shape
    y = torch.empty((M, N), dtype=dtype, device=t.device)
    BLOCK = min(1024, triton.next_power_of_2(N))
    _split_sum_kernel[(M, triton.cdiv(N, BLOCK))](parts, parts if bias is None else bias, y, N, parts.stride(1),
                                                  y.stride(0), parts.stride(0), DT=_TL_DTYPES[dtype], SPLITS=S,
                                                  HAS_BIAS=bias is not None, BLOCK=BLOCK, **pdl_launch())
    return y


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, pos: torch.Tensor, group: int, bias: Optional[torch.Tensor] = None,
                  rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`rope_kv_write_reference` in one kernel (one program per token and kv group): a decode step's tokens,
    or a prefill's prompt tokens as rows (``rows``: their sequences' cache slots)."""
    parts = qkv if qkv.dim() == 5 else qkv.unsqueeze(0)
    S, T, ng, R, hd = parts.shape
    if not _rope_usable(parts, cos, sin, k_cache, v_cache, pos, group, bias, rows) or hd % 2:
        return rope_kv_write_reference(qkv, cos, sin, k_cache, v_cache, pos, group, bias, rows)
    q = torch.empty((T, ng, group, hd), dtype=k_cache.dtype, device=qkv.device)
    H = hd // 2
    _rope_kv_kernel[(T, ng)](parts, parts if bias is None else bias, cos, sin, q, k_cache, v_cache, pos,
                             pos if rows is None else rows, group, H, parts.stride(1), parts.stride(2),
                             parts.stride(3), parts.stride(0), cos.stride(0), q.stride(0), q.stride(1), q.stride(2),
                             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), SPLITS=S,
                             HAS_BIAS=bias is not None, HAS_ROWS=rows is not None,
                             RP=triton.next_power_of_2(group + 2), BD=triton.next_power_of_2(hd), **pdl_launch())
    return q


def swiglu(a: torch.Tensor, out_dtype: Optional[torch.dtype] = None, splits: bool = False) -> torch.Tensor:
    """:func:`swiglu_reference` for ``a [..., 2F]`` (``splits``: ``[splits, B, 2F]`` partial sums, see the module doc)
    in one kernel (``out_dtype``: a's by default; an fp32 ``a`` is read as its cast to ``out_dtype``)."""
    if not splits and a.dim() > 2 and a.is_contiguous():  # (the prefill's [b, L, 2F]: rows)
        y = swiglu(a.view(-1, a.shape[-1]), out_dtype)
        return y.view(*a.shape[:-1], y.shape[-1])
    dtype = out_dtype or a.dtype
    if (not kernels_usable(a) or a.dim() != 2 + splits or a.shape[-1] % 2 or a.stride(-1) != 1
            or dtype not in _TL_DTYPES):
        return swiglu_reference(a, out_dtype, splits)
    B, F2 = a.shape[-2:]
    F_ = F2 // 2
    y = torch.empty((B, F_), dtype=dtype, device=a.device)
    BLOCK = min(1024, triton.next_power_of_2(F_))
    n_splits, stride_split = (a.shape[0], a.stride(0)) if splits else (1, 0)
    _swiglu_kernel[(B, triton.cdiv(F_, BLOCK))](a, y, F_, a.stride(-2), y.stride(0), stride_split,
                                                DT=_TL_DTYPES[dtype], SPLITS=n_splits, BLOCK=BLOCK, **pdl_launch())
    return y


#: Logits per program of :func:`sample`'s first kernel (a Qwen2.5 row of 152,064: 75 programs; 64 rows, 4,800).
SAMPLE_BLOCK = 2048


def sample(logits: torch.Tensor, u: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_reference` in two kernels that read the logits in their own dtype (no fp32 copy, no softmax
    written out): blocks of :data:`SAMPLE_BLOCK` logits of every row in parallel (their max and sum of
    exponentials; torch's softmax and sums ran one program per row, 64 for a decode batch), then one program per row
    picks the block and the token in it. The same tokens as the twin but where (1 - u) x total falls within fp32
    rounding of a CDF step, and its logprobs to fp32 rounding (another summation order). No host sync."""
    if (not kernels_usable(logits, u) or logits.dim() != 2 or logits.stride(-1) != 1 or u.dim() != 1
            or u.shape[0] != logits.shape[0] or not u.is_contiguous() or not temperature > 0):
        return sample_reference(logits, u, temperature)
    B, V = logits.shape
    BLOCK = min(SAMPLE_BLOCK, triton.next_power_of_2(V))
    NB = triton.cdiv(V, BLOCK)
    m = torch.empty((B, NB), dtype=torch.float32, device=logits.device)
    s = torch.empty_like(m)
    tok = torch.empty(B, dtype=torch.long, device=logits.device)
    lp = torch.empty(B, dtype=torch.float32, device=logits.device)
    _sample_partials_kernel[(B, NB)](logits, m, s, V, NB, logits.stride(0), float(temperature), BLOCK=BLOCK,
                                     **pdl_launch())
    _sample_pick_kernel[(B,)](logits, m, s, u.float(), tok, lp, V, NB, logits.stride(0), float(temperature),
                              BLOCK=BLOCK, NBP=triton.next_power_of_2(NB), **pdl_launch())
    return tok, lp


def record_tokens(state: dict, tok: torch.Tensor, lp: torch.Tensor, stop_ids: torch.Tensor) -> None:
    """:func:`record_tokens_reference` in one kernel (it was ~15 small ones per decode step)."""
    B = tok.shape[0]
    names = ("done", "n_gen", "out_tok", "out_lp", "stopped", "limit", "tok", "pos")
    if (not kernels_usable(tok, lp, stop_ids, *(state[n] for n in names)) or B > 1024 or tok.dtype != torch.long
            or any(not state[n].is_contiguous() for n in names) or not stop_ids.is_contiguous()
            or not tok.is_contiguous() or not lp.is_contiguous()):
        return record_tokens_reference(state, tok, lp, stop_ids)
    _record_kernel[(1,)](tok, lp, stop_ids, state["done"], state["n_gen"], state["out_tok"], state["out_lp"],
                         state["stopped"], state["limit"], state["tok"], state["pos"], B, stop_ids.numel(),
                         state["out_tok"].shape[1] - 1, state["out_tok"].stride(0), state["out_lp"].stride(0),
                         BLOCK=max(16, triton.next_power_of_2(B)), **pdl_launch())
