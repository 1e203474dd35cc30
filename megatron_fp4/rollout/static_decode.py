"""Static-KV-cache generation for the native engine: fused prefill, one decode step per CUDA-graph replay.

    gen = StaticCacheGenerator(model)                       # a megatron-core GPTModel (TP = 1, whole model)
    samples, stats = gen.generate(prompts, params, precision, cache, use_graphs=True, max_concurrent=64)

The megatron-core forward (:mod:`megatron_fp4.rollout.native`'s reference path) launches hundreds of small kernels
per token from Python. This path computes the same decoder layer by layer on the model's own parameters and
modules (norms, the rollout linears through :func:`megatron_fp4.resq.rollout_linear`, so FP4 kernels included):

- a static KV cache ``[layers, slots, kv heads, S, head dim]`` (one slot per concurrent sequence);
- prefill of new prompts, right-padded, through PyTorch SDPA (causal; right padding never reaches a real token),
  the prompt tokens as rows through the decode step's residual add + norm and RoPE + K/V-write ops;
- one decode step for all slots of a batch-size bucket, sampling and logprobs included, that updates its own
  inputs (token, position, counters, done flags) on the device: captured once per bucket as a CUDA graph and
  replayed ``chunk`` times between host checks (no host sync per token);
- at most ``max_concurrent`` sequences at once; finished slots are refilled with waiting prompts, and when none
  are left the live slots are compacted into the smallest bucket that holds them.

Sampling draws uniforms from a seeded generator once per chunk (outside the graph) and inverts the CDF of
softmax(filtered logits / T) inside it: the same distribution as :func:`~megatron_fp4.rollout.sampling.sample_tokens`
but another random stream, so seeded samples differ from the reference path's (greedy ones agree up to rounding).
Supported models: megatron-core GPTModels with RoPE, a gated-SiLU (SwiGLU) or plain MLP, GQA, optional qkv bias,
torch norms, tensor-parallel size 1 (:func:`static_decode_support` says why not otherwise).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from megatron_fp4.kernels import cuda_quantize, decode_ops
from megatron_fp4.kernels._common import switch_on
from megatron_fp4.resq import QuantizedWeightCache, RolloutPrecision, rollout_linear
from megatron_fp4.rollout.base import RolloutSample, SamplingParams
from megatron_fp4.rollout.sampling import filter_logits, filters

__all__ = ["StaticCacheGenerator", "static_decode_support", "precision_is_token_local", "BUCKETS"]

#: Batch-size buckets of the decode graphs (a bucket runs all its slots; idle ones are masked).
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def precision_is_token_local(precision: RolloutPrecision) -> bool:
    """Whether each token's rollout linear output depends on that token alone (not on the batch): all forms but
    the ResQ "channel" / "tile32x64" selectors. Only those run on the static path (padding and batch composition
    then cannot change a result)."""
    return precision.sparsity not in ("channel", "tile32x64")


def static_decode_support(model: torch.nn.Module) -> Optional[str]:
    """None if :class:`StaticCacheGenerator` can run ``model``, else the reason it cannot."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "decoder"):
        return "not a megatron-core GPTModel"
    if getattr(cfg, "tensor_model_parallel_size", 1) != 1:
        return "tensor parallel size > 1"
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        return "a pipeline stage, not the whole model"
    if getattr(model, "position_embedding_type", "rope") != "rope" or getattr(model, "rotary_pos_emb", None) is None:
        return "position embedding is not RoPE"
    if getattr(cfg, "num_moe_experts", None):
        return "mixture of experts"
    if getattr(cfg, "qk_layernorm", False) or getattr(cfg, "multi_latent_attention", False):
        return "qk layernorm / MLA"
    if getattr(cfg, "rotary_interleaved", False) or getattr(model.rotary_pos_emb, "seq_len_interpolation_factor",
                                                               None):
        return "interleaved or interpolated RoPE"
    if getattr(cfg, "gated_linear_unit", False) and cfg.activation_func is not F.silu:
        return "gated MLP with an activation other than SiLU"
    if getattr(cfg, "sequence_parallel", False) or getattr(cfg, "context_parallel_size", 1) != 1:
        return "sequence / context parallel"
    if getattr(model, "mtp_process", False):
        return "multi-token prediction"
    return None


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _bucket(n: int, cap: int) -> int:
    for b in BUCKETS:
        if b >= n:
            return min(b, cap)
    return cap


def graph_sample(logits: torch.Tensor, u: torch.Tensor, params: SamplingParams, fused: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B]) of ``logits [B, V]`` (read as fp32) given uniforms ``u [B]`` in [0, 1): the token
    is the first whose CDF of softmax(filter(logits / T)) reaches (1 - u) x total (never a zero-probability token;
    :func:`~megatron_fp4.kernels.decode_ops.invert_cdf`). No host sync (capturable). Logprob: log_softmax(logits / T)
    at the token (T = 1 when greedy); without top-k / top-p the log of the sampling probability itself (the same
    distribution), from decode_ops' sampling kernels when ``fused``."""
    if params.greedy:
        tok = logits.argmax(dim=-1)
        t = 1.0
    else:
        t = params.temperature
        if not filters(params.top_k, params.top_p, logits.shape[-1]):
            return (decode_ops.sample if fused else decode_ops.sample_reference)(logits, u, t)
        probs = torch.softmax(filter_logits(logits.float() / t, params.top_k, params.top_p), dim=-1)
        tok = decode_ops.invert_cdf(probs, u)
    lp = torch.log_softmax(logits.float() / t, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    return tok, lp


def _forced(logits: torch.Tensor, tok: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    t = params.temperature if params.temperature > 0 else 1.0
    return tok, torch.log_softmax(logits.float() / t, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)


@dataclass
class _Layer:
    ln1: torch.nn.Module
    qkv: torch.nn.Module
    proj: torch.nn.Module
    ln2: torch.nn.Module
    fc1: torch.nn.Module
    fc2: torch.nn.Module


class StaticCacheGenerator:
    """Generation with a static KV cache, SDPA prefill and (on CUDA) CUDA-graph decode steps; see the module doc."""

    def __init__(self, model: torch.nn.Module, fused: Optional[bool] = None) -> None:
        why = static_decode_support(model)
        if why is not None:
            raise NotImplementedError(f"StaticCacheGenerator cannot run this model: {why}")
        self.model = model
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_query_groups or cfg.num_attention_heads
        self.head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.heads // self.kv_heads
        self.gated = bool(cfg.gated_linear_unit)
        self.act = cfg.activation_func
        self.layers = []
        for layer in model.decoder.layers:
            att, mlp = layer.self_attention, layer.mlp
            self.layers.append(_Layer(layer.input_layernorm, att.linear_qkv, att.linear_proj, layer.pre_mlp_layernorm,
                                      mlp.linear_fc1, mlp.linear_fc2))
        self.final_norm = model.decoder.final_layernorm
        self.embedding = model.embedding.word_embeddings
        self.output_weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
                              else model.output_layer.weight)
        self.output_bias = getattr(model.output_layer, "bias", None)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self._precision = RolloutPrecision()
        self._cache: Optional[QuantizedWeightCache] = None
        self._graphs: dict = {}
        self._stop_ids: dict = {}  # stop token ids -> the device tensor every call (and graph) with them reads
        self._pool = None
        self._state: Optional[dict] = None
        self._forcing = False
        self._generation = 0
        self.last_stats: dict = {}
        #: Decode steps through megatron_fp4/kernels/decode_ops.py (fused RMSNorm + residual add, RoPE + KV write,
        #: SwiGLU, attention reading each cache up to its position): by default on a GPU (H200, batch 64, before the
        #: attention kernel: 1.5B BF16 12.1k -> 19.4k tok/s, 7B 6.5k -> 8.6k, docs/PERFORMANCE.md), off on the CPU
        #: (Triton's interpreter); ``fused`` or MEGATRON_FP4_DECODE_FUSED=1 / 0 overrides.
        on_gpu = any(p.is_cuda for p in model.parameters())
        self.fused = fused if fused is not None else os.environ.get("MEGATRON_FP4_DECODE_FUSED",
                                                                    "1" if on_gpu else "0") == "1"
        #: The fused step's attention: "kernel" (decode_ops.rope_attention: RoPE, the K/V writes and the attention
        #: over each cache up to its position in one kernel) or "sdpa" (the RoPE kernel, then SDPA with a mask over
        #: the whole cache, as the unfused path); MEGATRON_FP4_DECODE_ATTENTION.
        attention = os.environ.get("MEGATRON_FP4_DECODE_ATTENTION", "kernel")
        if attention not in ("kernel", "sdpa"):
            raise ValueError(f"MEGATRON_FP4_DECODE_ATTENTION={attention!r} is not valid; allowed values: 'kernel', "
                             f"'sdpa'")
        self.attention_kernel = self.fused and attention == "kernel"
        #: In W4A4 + ResQ 2:4 (bf16 sum), the fused step makes fc2's operand in one CUDA kernel (the SwiGLU and ResQ's
        #: quantize: ``cuda_quantize.swiglu_resq``) where it can run; MEGATRON_FP4_FUSED_SWIGLU_RESQ=0 turns it off.
        self.swiglu_resq = self.fused and switch_on(cuda_quantize.SWIGLU_RESQ_SWITCH)
        #: Likewise qkv's and fc1's operand comes from the residual add + RMSNorm before them (one CUDA kernel:
        #: ``decode_ops.add_rms_norm_resq``) in the decode step; MEGATRON_FP4_FUSED_NORM_RESQ=0 turns it off.
        self.norm_resq = self.fused and switch_on(cuda_quantize.NORM_RESQ_SWITCH)

    # -- buffers -----------------------------------------------------------------------------------------------------
    @property
    def has_graphs(self) -> bool:
        """Whether captured decode graphs exist (they read the weights and prepared weights by address)."""
        return bool(self._graphs)

    def _stop_tensor(self, ids: Sequence[int], device) -> torch.Tensor:
        """The stop token ids as a device tensor that lives as long as this object. A captured graph reads, at every
        replay, the memory of the tensor it was captured with: a per-call tensor would be freed when the capturing
        call returns and its memory reused by other tensors, and later replays would compare the sampled tokens
        with whatever was written there (the sequences then never stop, or stop at random)."""
        key = (tuple(ids) or (-1,), str(device))
        if key not in self._stop_ids:
            self._stop_ids[key] = torch.tensor(key[0], dtype=torch.long, device=device)
        return self._stop_ids[key]

    def invalidate(self) -> None:
        """Drop the captured graphs (weights re-prepared into new tensors); the KV cache is kept."""
        self._graphs.clear()
        self._pool = None  # a pool whose graphs are gone cannot be captured into again

    def reset(self) -> None:
        """Drop the KV cache, the state and every captured graph (weights moved, precision changed, memory freed)."""
        self._graphs.clear()
        self._state = None
        self._pool = None

    def _ensure_state(self, slots: int, seq: int, max_new: int, chunk: int, device, dtype) -> dict:
        st = self._state
        if (st is not None and st["slots"] >= slots and st["seq"] == seq and st["max_new"] == max_new
                and st["rand"].shape[0] == chunk and st["device"] == device and st["dtype"] == dtype):
            return st
        self.reset()
        L = len(self.layers)
        kv = (L, slots, self.kv_heads, seq, self.head_dim)
        rot = self.model.rotary_pos_emb
        inv = rot.inv_freq.to(device=device, dtype=torch.float32)
        freqs = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        st = dict(
            slots=slots, seq=seq, max_new=max_new, device=device, dtype=dtype,
            k=torch.zeros(kv, device=device, dtype=dtype), v=torch.zeros(kv, device=device, dtype=dtype),
            cos=torch.cos(emb).to(dtype), sin=torch.sin(emb).to(dtype),
            ar_seq=torch.arange(seq, device=device),
            tok=torch.zeros(slots, dtype=torch.long, device=device),
            pos=torch.zeros(slots, dtype=torch.long, device=device),
            n_gen=torch.zeros(slots, dtype=torch.long, device=device),
            done=torch.ones(slots, dtype=torch.bool, device=device),
            stopped=torch.zeros(slots, dtype=torch.bool, device=device),
            out_tok=torch.zeros((slots, max_new), dtype=torch.long, device=device),
            out_lp=torch.zeros((slots, max_new), dtype=torch.float32, device=device),
            limit=torch.zeros(slots, dtype=torch.long, device=device),  # per-slot max tokens (length cap)
            forced=torch.zeros((slots, max_new), dtype=torch.long, device=device),  # teacher-forced tokens
            step=torch.zeros((), dtype=torch.long, device=device),
            rand=torch.zeros((chunk, slots), dtype=torch.float32, device=device),
        )
        self._state = st
        return st

    # -- the model -----------------------------------------------------------------------------------------------------
    def _linear(self, mod: torch.nn.Module, x: torch.Tensor, as_stored: bool = False, bias: bool = True,
                on_sum: bool = False) -> torch.Tensor:
        """``as_stored``: ``[splits, B, n]``, the decode GEMM's fp32 split-K partial sums as stored (no atomics, no
        zero-fill, no cast kernel; with a bias already added up), for the fused kernels that add them in order and
        round to the model's dtype as they read them: the step is then deterministic (graph and eager alike).
        ``bias`` False: without the linear's bias (its reader adds it). ``on_sum``: ``x`` is already ResQ 2:4's bf16
        sum (a fused kernel made it, K padded to the format's block): the linear multiplies it as W4A16, the same
        GEMM on the same operand as W4A4 + ResQ 2:4 (bf16 sum) runs after its own quantize."""
        precision = self._precision
        if on_sum:
            x = x[:, :mod.weight.shape[1]]
            precision = RolloutPrecision("w4a16", precision.format)
        return rollout_linear(x, mod.weight, getattr(mod, "bias", None) if bias else None, precision,
                              cache=self._cache, as_stored=as_stored)

    def _mlp(self, layer: _Layer, h: torch.Tensor, as_stored: bool = False, on_sum: bool = False) -> torch.Tensor:
        """The MLP of the normed input ``h`` (``as_stored``: fc2's output as :meth:`_linear` says, and fc1's too
        where the fused SwiGLU reads it; ``on_sum``: ``h`` is fc1's ResQ operand, :meth:`_linear`). With
        :attr:`swiglu_resq` at W4A4 + ResQ 2:4 (bf16 sum), fc2's operand comes from one CUDA kernel where it takes
        fc1's output: the two kernels' bits, one launch and one round trip less."""
        splits = as_stored and self.fused and self.gated
        a = self._linear(layer.fc1, h, splits, on_sum=on_sum)
        p = self._precision
        if self.swiglu_resq and self.gated and p.bf16_sum_operand:
            if cuda_quantize.swiglu_resq_usable(a, p.format):
                return self._linear(layer.fc2, cuda_quantize.swiglu_resq(a, p.format), as_stored, on_sum=True)
        return self._linear(layer.fc2, self._act(a, h.dtype, splits), as_stored)

    def _add_norm_resq(self, x: torch.Tensor, delta: Optional[torch.Tensor], norm: torch.nn.Module
                       ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """:meth:`_add_norm`, or, with :attr:`norm_resq` at W4A4 + ResQ 2:4 (bf16 sum), (the next linear's ResQ
        operand of norm(x + delta), x + delta, True) in one kernel where it can run (``decode_ops.add_rms_norm_resq``:
        the two kernels' bits)."""
        if self.norm_resq and self._precision.bf16_sum_operand:
            got = decode_ops.add_rms_norm_resq(x, delta, norm, self._precision.format)
            if got is not None:
                return got[0], got[1], True
        return (*self._add_norm(x, delta, norm), False)

    def _act(self, a: torch.Tensor, dtype: torch.dtype, splits: bool = False) -> torch.Tensor:
        """The activation of fc1's output ``a`` (``splits``: its split sums as stored, fused SwiGLU only)."""
        if not self.gated:
            return self.act(a)
        if self.fused:  # gated MLPs here are SiLU (static_decode_support)
            return decode_ops.swiglu(a, dtype, splits)
        a0, a1 = torch.chunk(a, 2, dim=-1)
        return self.act(a0) * a1

    def _add_norm(self, x: torch.Tensor, delta: Optional[torch.Tensor], norm: torch.nn.Module
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + delta), x + delta); ``delta`` None: (norm(x), x)."""
        if self.fused:
            return decode_ops.add_rms_norm(x, delta, norm)
        return decode_ops.add_rms_norm_reference(x, delta, norm)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the final-normed hidden states ``h``, in the output layer's dtype (their readers take them as
        fp32: no fp32 copy of ``[B, V]`` per step where the sampling kernels read them as they are)."""
        return F.linear(h, self.output_weight, self.output_bias)

    def _prefill(self, st: dict, ids: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Run right-padded prompts ``ids [b, L]`` (lengths ``lens``) and write their K/V into cache ``slots``;
        returns logits [b, V] at each prompt's last token. The prompt tokens are rows, as a decode step's tokens:
        the same residual add + norm, and RoPE + K/V cache writes (each row at its sequence's slot and position)."""
        b, L = ids.shape
        x = F.embedding(ids.view(-1), self.embedding.weight)  # [b * L, h]
        pos = st["ar_seq"][:L].repeat(b)  # each row's position
        rows = slots[:, None].expand(b, L).contiguous().view(-1)  # its cache slot (repeat_interleave: a host sync)
        rope = decode_ops.rope_kv_write if self.fused else decode_ops.rope_kv_write_reference
        delta = None
        for i, layer in enumerate(self.layers):
            h, x = self._add_norm(x, delta, layer.ln1)
            qkv = self._linear(layer.qkv, h).view(b * L, self.kv_heads, self.group + 2, self.head_dim)
            kc, vc = st["k"][i], st["v"][i]  # [slots, ng, S, hd]
            q = rope(qkv, st["cos"], st["sin"], kc, vc, pos, self.group, rows=rows)  # [b * L, ng, G, hd]
            k, v = kc[slots, :, :L], vc[slots, :, :L]
            # GQA in SDPA itself (no K/V copies repeated per query head), except fp32 on CUDA: torch 2.11's fused
            # kernels take GQA in 16-bit types only, and its math kernel would hold every L x L score
            repeat = self.group > 1 and q.is_cuda and q.dtype == torch.float32
            if repeat:
                k, v = k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1)
            o = F.scaled_dot_product_attention(q.view(b, L, self.heads, self.head_dim).transpose(1, 2), k, v,
                                               is_causal=True, scale=self.scale,
                                               enable_gqa=self.group > 1 and not repeat)
            delta = self._linear(layer.proj, o.transpose(1, 2).reshape(b * L, self.heads * self.head_dim))
            h, x = self._add_norm(x, delta, layer.ln2)
            delta = self._mlp(layer, h)
        last = torch.arange(b, device=x.device) * L + lens - 1
        return self._logits(self._add_norm(x[last], delta[last], self.final_norm)[0])

    def _decode(self, st: dict, B: int) -> torch.Tensor:
        """One token for slots [0, B): reads st tok/pos, writes K/V at pos, returns logits [B, V]. Each residual
        add is done with the norm that follows it (one kernel each when ``fused``)."""
        tok, pos = st["tok"][:B], st["pos"][:B]
        x = F.embedding(tok, self.embedding.weight)  # [B, h]
        cos, sin = st["cos"], st["sin"]  # [S, hd]: the RoPE ops read them at pos
        valid = None if self.attention_kernel else (st["ar_seq"][None, :] <= pos[:, None]).view(B, 1, 1, -1)
        delta = None
        for i, layer in enumerate(self.layers):
            h, x, on_sum = self._add_norm_resq(x, delta, layer.ln1)
            kc, vc = st["k"][i, :B], st["v"][i, :B]  # [B, ng, S, hd]
            if self.fused:  # the RoPE kernels add qkv's splits in order, then (FP4: no cuBLAS epilogue) its bias
                bias = getattr(layer.qkv, "bias", None) if self._precision.mode != "bf16" else None
                qkv = self._linear(layer.qkv, h, True, bias=bias is None, on_sum=on_sum)
                qkv = qkv.view(qkv.shape[0], B, self.kv_heads, self.group + 2, self.head_dim)
            else:
                qkv, bias = self._linear(layer.qkv, h).view(B, self.kv_heads, self.group + 2, self.head_dim), None
            if self.attention_kernel:  # RoPE, k and v written at pos, attention: one kernel
                o = decode_ops.rope_attention(qkv, cos, sin, kc, vc, pos, self.group, self.scale, bias)
            else:
                rope = decode_ops.rope_kv_write if self.fused else decode_ops.rope_kv_write_reference
                q = rope(qkv, cos, sin, kc, vc, pos, self.group, bias)  # [B, ng, G, hd]; k, v written at pos
                o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=valid, scale=self.scale)  # [B, ng, G, hd]
            delta = self._linear(layer.proj, o.reshape(B, self.heads * self.head_dim), self.fused)
            h, x, on_sum = self._add_norm_resq(x, delta, layer.ln2)
            delta = self._mlp(layer, h, self.fused, on_sum)
        return self._logits(self._add_norm(x, delta, self.final_norm)[0])

    def _step(self, st: dict, B: int, params: SamplingParams, stop_ids: torch.Tensor) -> None:
        """Decode step of bucket B: forward, sample (uniforms st['rand'][step]), record and advance the live slots
        (:func:`~megatron_fp4.kernels.decode_ops.record_tokens`), all on the device."""
        logits = self._decode(st, B)
        u = st["rand"].index_select(0, st["step"].view(1)).view(-1)[:B]
        tok, lp = graph_sample(logits, u, params, self.fused)
        if self._forcing:
            idx = st["n_gen"][:B].clamp(max=st["max_new"] - 1).unsqueeze(1)
            tok, lp = _forced(logits, st["forced"][:B].gather(1, idx).squeeze(1), params)
        (decode_ops.record_tokens if self.fused else decode_ops.record_tokens_reference)(st, tok, lp, stop_ids)
        st["step"].add_(1)

    # -- generation ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, precision: RolloutPrecision,
                 cache: Optional[QuantizedWeightCache], max_seq_len: int, *, use_graphs: bool,
                 max_concurrent: Optional[int] = None, chunk: int = 16,
                 generator: Optional[torch.Generator] = None, forced: Optional[Sequence[Sequence[int]]] = None,
                 ) -> tuple[list[RolloutSample], int]:
        """One response per prompt (see the module doc); returns the samples and the number of decode steps.
        ``forced``: teacher forcing, one non-empty response per prompt, fed instead of sampled tokens (their
        logprobs are reported; ``params.max_new_tokens`` must cover them)."""
        generation = cache.generation if cache is not None else 0
        if precision != self._precision or cache is not self._cache or generation != self._generation:
            self.invalidate()  # the graphs read the prepared weights of another precision / cache version
        self._precision, self._cache, self._generation = precision, cache, generation
        self._forcing = forced is not None
        device = self.embedding.weight.device
        dtype = self.embedding.weight.dtype
        P = len(prompts)
        lens_all = [len(p) for p in prompts]
        seq = _round_up(min(max(lens_all) + params.max_new_tokens, max_seq_len), 64)
        cap = min(max_concurrent or P, P)
        prev = self._state["slots"] if self._state is not None else 0
        st = self._ensure_state(max(cap, prev), seq, params.max_new_tokens, chunk, device, dtype)
        nslots = st["slots"]
        stop_ids = self._stop_tensor(params.stop_token_ids, device)
        limits = [min(params.max_new_tokens, max_seq_len - n, seq - n) for n in lens_all]
        if forced is not None:
            if len(forced) != P or any(not 0 < len(r) <= lim for r, lim in zip(forced, limits)):
                raise ValueError("forced: one non-empty response per prompt, within the length limits")
            limits = [len(r) for r in forced]
        results: list[Optional[RolloutSample]] = [None] * P
        owner = [-1] * nslots  # prompt index held by each slot
        pending = list(range(P))[::-1]
        st["done"].fill_(True)
        key_params = (dataclasses.replace(params, seed=None), self._forcing)
        t_capture = 0.0
        steps = 0

        def draw(n: int) -> torch.Tensor:
            if generator is not None and generator.device.type != torch.device(device).type:
                return torch.rand((n, nslots), generator=generator).to(device)
            return torch.rand((n, nslots), generator=generator, device=device)

        def admit(free: list[int]) -> None:
            take = []
            while pending and len(take) < len(free):
                take.append(pending.pop())
            for s, p in zip(free, take):
                owner[s] = p
            i = 0
            while i < len(take):  # prefill pieces of at most ~16k padded tokens
                j, L = i + 1, lens_all[take[i]]
                while j < len(take) and max(L, lens_all[take[j]]) * (j + 1 - i) <= 16384:
                    L = max(L, lens_all[take[j]])
                    j += 1
                part, sl = take[i:j], free[i:j]
                ids = torch.zeros((len(part), L), dtype=torch.long)
                for r, k in enumerate(part):
                    ids[r, : lens_all[k]] = torch.tensor(prompts[k], dtype=torch.long)
                ids = ids.to(device)
                lens = torch.tensor([lens_all[k] for k in part], dtype=torch.long, device=device)
                limit = torch.tensor([limits[k] for k in part], dtype=torch.long, device=device)
                sl_t = torch.tensor(sl, dtype=torch.long, device=device)
                logits = self._prefill(st, ids, lens, sl_t)
                tok, lp = graph_sample(logits, draw(1)[0, : len(part)], params, self.fused)
                if forced is not None:
                    ft = torch.zeros((len(part), st["max_new"]), dtype=torch.long)
                    for r, k in enumerate(part):
                        ft[r, : len(forced[k])] = torch.tensor(list(forced[k]), dtype=torch.long)
                    st["forced"][sl_t] = ft.to(device)
                    tok, lp = _forced(logits, st["forced"][sl_t, 0], params)
                st["out_tok"][sl_t, 0] = tok
                st["out_lp"][sl_t, 0] = lp
                st["tok"][sl_t] = tok
                st["pos"][sl_t] = lens
                st["n_gen"][sl_t] = 1
                st["limit"][sl_t] = limit
                stopped = (tok.unsqueeze(1) == stop_ids.unsqueeze(0)).any(dim=1)
                st["stopped"][sl_t] = stopped
                st["done"][sl_t] = stopped | (limit <= 1)
                i = j

        admit(list(range(cap)))
        n_host = [0] * nslots  # tokens generated per slot as of the last check (host copy)
        for s in range(nslots):
            if owner[s] >= 0:
                n_host[s] = 1
        while True:
            used = [s for s in range(nslots) if owner[s] >= 0]
            if not used:
                break
            B = _bucket(max(used) + 1, nslots)
            n = max(1, min(chunk, max(limits[owner[s]] - n_host[s] for s in used)))
            if use_graphs:
                key = (B, key_params)
                g = self._graphs.get(key)
                if g is None:
                    t0 = time.perf_counter()
                    g = self._capture(st, B, params, stop_ids)
                    self._graphs[key] = g
                    t_capture += time.perf_counter() - t0
                st["rand"].copy_(draw(chunk))
                st["step"].zero_()
                for _ in range(n):
                    g.replay()
            else:
                st["rand"].copy_(draw(chunk))
                st["step"].zero_()
                for _ in range(n):
                    self._step(st, B, params, stop_ids)
            steps += n
            flags = torch.stack([st["done"][:B].long(), st["n_gen"][:B], st["stopped"][:B].long()]).cpu()
            done_cpu, n_cpu, stopped_cpu = (flags[0] != 0).tolist(), flags[1].tolist(), (flags[2] != 0).tolist()
            for s in range(B):
                n_host[s] = n_cpu[s]
            fin = [s for s in range(B) if owner[s] >= 0 and done_cpu[s]]
            if fin:
                idx = torch.tensor(fin, dtype=torch.long, device=device)
                toks, lps = st["out_tok"][idx].cpu(), st["out_lp"][idx].cpu()
                for r, s in enumerate(fin):
                    p, k = owner[s], n_cpu[s]
                    results[p] = RolloutSample(token_ids=toks[r, :k].tolist(), logprobs=lps[r, :k].tolist(),
                                               finish_reason="stop" if stopped_cpu[s] else "length",
                                               prompt_length=lens_all[p])
                    owner[s] = -1
                if pending:
                    admit(fin)
                    for s in fin:
                        n_host[s] = 1 if owner[s] >= 0 else 0
                else:
                    self._compact(st, owner, n_host)
        self.last_stats = {"capture_seconds": t_capture, "graphs": len(self._graphs)}
        return list(results), steps

    def _compact(self, st: dict, owner: list[int], n_host: list[int]) -> None:
        """Move live slots to the front when that lets a smaller bucket run them."""
        live = [s for s in range(len(owner)) if owner[s] >= 0]
        if not live or _bucket(len(live), st["slots"]) >= _bucket(max(live) + 1, st["slots"]):
            return
        src = torch.tensor(live, dtype=torch.long, device=st["tok"].device)
        n = len(live)
        for name in ("tok", "pos", "n_gen", "done", "stopped", "out_tok", "out_lp", "limit", "forced"):
            st[name][:n] = st[name][src]  # (indexing by a tensor copies: the source rows are read first)
        st["k"][:, :n] = st["k"][:, src]
        st["v"][:, :n] = st["v"][:, src]
        st["done"][n:] = True
        moved, counts = [owner[s] for s in live], [n_host[s] for s in live]
        for s in range(len(owner)):
            owner[s] = moved[s] if s < n else -1
            n_host[s] = counts[s] if s < n else 0

    #: What a decode step changes besides the K/V cache (saved and restored around the capture's warm-up).
    _SLOT_STATE = ("tok", "pos", "n_gen", "done", "stopped", "out_tok", "out_lp", "step")

    @classmethod
    def _save_slots(cls, st: dict) -> dict:
        return {k: st[k].clone() for k in cls._SLOT_STATE}

    @staticmethod
    def _restore_slots(st: dict, saved: dict) -> None:
        for k, v in saved.items():
            st[k].copy_(v)

    def _warm_up(self, st: dict, B: int, params: SamplingParams, stop_ids: torch.Tensor) -> None:
        """Two decode steps of bucket B before its capture (kernel autotuning and lazy weight forms happen here, not
        under capture); the caller restores :data:`_SLOT_STATE`. The steps write K/V only at the live slots' current
        and next positions, rows that every later step writes before it reads them: the cache needs no restore."""
        for _ in range(2):
            st["step"].zero_()  # each step reads the chunk's first uniforms (a chunk may be one step)
            self._step(st, B, params, stop_ids)

    def _capture(self, st: dict, B: int, params: SamplingParams, stop_ids: torch.Tensor):
        """Warm up on a side stream, then capture one decode step of bucket B; the slots' state is as before."""
        saved = self._save_slots(st)  # (on the current stream, where it is restored)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._warm_up(st, B, params, stop_ids)
        torch.cuda.current_stream().wait_stream(stream)
        self._restore_slots(st, saved)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._step(st, B, params, stop_ids)
        self._restore_slots(st, saved)
        return g
