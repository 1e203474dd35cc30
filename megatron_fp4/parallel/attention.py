"""Fused core attention on PyTorch's ``scaled_dot_product_attention`` (SDPA), a drop-in for megatron-core's unfused
DotProductAttention in the FP4 layer spec.

:class:`SDPADotProductAttention` subclasses megatron-core's ``DotProductAttention``: the constructor (heads and
query groups per TP rank, softmax scale, ``apply_query_key_layer_scaling``, dropout, checkpoint sharding) is
megatron-core's; only ``forward`` differs. Layout as megatron-core's core attention: query ``[sq, b, np, hn]``,
key/value ``[sk, b, ng, hn]`` (this rank's heads), output ``[sq, b, np * hn]``; GQA through SDPA's ``enable_gqa``
(no repeated key/value copies).

Which SDPA kernel runs (PyTorch picks; on Hopper in bf16/fp16 the FlashAttention-2 backend when it applies):

- no ``attention_mask``, causal layer, sq == sk (training, the RL loss, prefill): ``is_causal=True`` and no mask,
  the flash backend's case. RL batches are right-padded and the padding is masked out of the loss, so they need no
  padding mask: a real token never attends to a later (padding) position.
- sq == 1 without a mask (a KV-cache decode step): no mask, as megatron-core (the one query sees every cached key).
- sq != sk > 1 without a mask: causal aligned to the bottom right (query i sees keys up to i + sk - sq), as an
  explicit mask (megatron-core's unfused path has no such case).
- an explicit ``attention_mask`` (megatron-core's convention: bool, True = masked; e.g. the rollout's left-padding
  masks): passed to SDPA as a boolean mask, so the memory-efficient or math backend runs (flash takes no mask). A
  query row whose keys are all masked (a padding query) attends to every key instead of producing NaN; its output
  is unused, as megatron-core's uniform attention there.
- packed sequences (``packed_seq_params`` with ``qkv_format="thd"``: ``[t, heads, hn]`` and ``cu_seqlens``): on
  CUDA in bf16/fp16 without dropout one FlashAttention varlen call (``torch.nn.attention.varlen.varlen_attn``,
  causal, no host sync when ``max_seqlen_q`` is given); otherwise one causal SDPA call per sequence (the lengths
  read on the host). With ``cu_seqlens_q_padded`` each padded slot is one causal sequence: the real tokens come
  first in their slot, so they never see the padding after them (whose outputs are unused).
- sliding-window attention and the off-by-one / learnable softmax offset: megatron-core's unfused computation
  (``DotProductAttention.forward``), unchanged.

Dropout (``attention_dropout`` while training) is SDPA's ``dropout_p`` under megatron's RNG tracker fork (as the
unfused path): same rate, different random draws from the unfused path. Softmax runs in fp32 inside every SDPA
backend (megatron's ``attention_softmax_in_fp32``).

The backend of a model is chosen by :func:`megatron_fp4.parallel.get_gpt_layer_fp4_spec`'s ``attention_backend``
(:data:`ATTENTION_BACKENDS`): "sdpa" (this module), "local" (megatron-core's DotProductAttention, the reference;
Megatron-LM's ``--attention-backend local`` names the same module) or "auto" (sdpa on CUDA, local on the CPU).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

try:  # PyTorch's FlashAttention varlen entry point (CUDA); without it packed sequences take the per-sequence loop
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older PyTorch
    varlen_attn = None

__all__ = ["ATTENTION_BACKENDS", "resolve_attention_backend", "core_attention_module", "SDPADotProductAttention"]

#: Values of the spec's ``attention_backend`` and the driver's ``--attention-backend``.
ATTENTION_BACKENDS = ("auto", "sdpa", "local")

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.causal_bottom_right)


def resolve_attention_backend(backend: str) -> str:
    """"sdpa" or "local" for ``backend`` ("auto": sdpa when CUDA is available, else local); ValueError otherwise."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is not valid; allowed: {', '.join(ATTENTION_BACKENDS)}")
    if backend == "auto":
        return "sdpa" if torch.cuda.is_available() else "local"
    return backend


def core_attention_module(backend: str) -> type:
    """The core-attention class of ``backend``: SDPADotProductAttention or megatron-core's DotProductAttention."""
    return SDPADotProductAttention if resolve_attention_backend(backend) == "sdpa" else DotProductAttention


def _attend_mask(masked: torch.Tensor) -> torch.Tensor:
    """SDPA's boolean mask (True = attend) of a megatron mask (True = masked); fully masked rows attend to all."""
    attend = ~masked.bool()
    return attend | ~attend.any(dim=-1, keepdim=True)


@functools.lru_cache(maxsize=None)
def _parameter_names(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def varlen_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            longest: int, scale: float, attn=None) -> torch.Tensor:
    """``varlen_attn`` (``attn``: the module's by default) on THD ``[t, heads, hn]`` sequences, each causal, with the
    keyword arguments the installed PyTorch takes. Its signature has changed between releases: torch 2.11 (the H200
    image) has ``window_size`` and no ``enable_gqa``, so there a GQA key/value is repeated per query head (megatron's
    grouping: query head h reads group h // (heads / groups)); newer releases take ``enable_gqa``; an older one
    ``is_causal`` instead of ``window_size``."""
    attn = attn or varlen_attn
    params = _parameter_names(attn)
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    return attn(query, key, value, cu_seqlens, cu_seqlens, longest, longest, scale=scale, **kw)


class SDPADotProductAttention(DotProductAttention):
    """megatron-core's core attention computed by ``torch.nn.functional.scaled_dot_product_attention`` (see the
    module docstring for which SDPA backend each case takes and what falls back)."""

    def _sdpa_scale(self) -> float:
        # DotProductAttention divides softmax_scale by the layer number under apply_query_key_layer_scaling and its
        # softmax multiplies the scores back by it: the product is the scale of the scores
        coeff = self.scale_mask_softmax.scale
        return self.softmax_scale * (coeff if coeff is not None else 1.0)

    def _dropout_p(self) -> float:
        return self.attention_dropout.p if self.training else 0.0

    def _rng(self, p: float):
        if p > 0.0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        """Context ``[sq, b, np * hn]`` of query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` (or ``[t, np * hn]``
        from packed ``[t, heads, hn]`` inputs)."""
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by SDPADotProductAttention (nor by "
                                      "megatron-core's DotProductAttention)")
        if self.softmax_offset is not None or self.scale_mask_softmax.window_size is not None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=None, packed_seq_params=packed_seq_params)
        if packed_seq_params is not None:
            return self._packed_forward(query, key, value, attention_mask, packed_seq_params)
        sq, b, np_, hn = query.shape
        sk = key.shape[0]
        # the unfused path ignores attn_mask_type and uses the layer's own (megatron-core's behaviour, kept)
        causal = self.attn_mask_type in _CAUSAL_TYPES
        mask, is_causal = None, False
        if attention_mask is not None:
            mask = _attend_mask(attention_mask)
        elif causal and sq > 1:
            if sq == sk:
                is_causal = True
            else:  # bottom-right aligned: query i is position i + sk - sq
                mask = (torch.arange(sk, device=query.device)[None, :]
                        <= torch.arange(sq, device=query.device)[:, None] + (sk - sq))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        p = self._dropout_p()
        with self._rng(p):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal,
                                                 scale=self._sdpa_scale(), enable_gqa=k.shape[1] != np_)
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    def _packed_forward(self, query, key, value, attention_mask, params: PackedSeqParams) -> torch.Tensor:
        """Packed ("thd") sequences, each causal on its own: FlashAttention varlen on CUDA, else SDPA per sequence."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"packed_seq_params.qkv_format={params.qkv_format!r} is not supported; "
                                      f"allowed: 'thd'")
        if attention_mask is not None:
            raise NotImplementedError("packed sequences with an attention_mask are not supported (each sequence is "
                                      "causal)")
        if self.attn_mask_type not in _CAUSAL_TYPES:
            raise NotImplementedError(f"packed sequences need a causal layer, got {self.attn_mask_type}")
        if query.dim() == 4:  # [t, 1, heads, hn]
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        cu_q, cu_k = params.cu_seqlens_q, params.cu_seqlens_kv
        if cu_k is not None and cu_k is not cu_q and not torch.equal(cu_q, cu_k):
            raise NotImplementedError("packed self-attention needs cu_seqlens_kv == cu_seqlens_q")
        slots = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else cu_q
        t, np_, hn = query.shape
        p = self._dropout_p()
        gqa = key.shape[1] != np_
        if (varlen_attn is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
                and p == 0.0):
            slots = slots.to(device=query.device, dtype=torch.int32)
            padded = params.cu_seqlens_q_padded is not None
            longest = None if padded else params.max_seqlen_q
            if longest is None:
                longest = int((slots[1:] - slots[:-1]).max())
            out = varlen_causal_attention(query, key, value, slots, int(longest), self._sdpa_scale())
            return out.reshape(t, np_ * hn)
        out = query.new_zeros(t, np_, hn)
        bounds = slots.tolist()
        with self._rng(p):
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end <= start:
                    continue
                sl = slice(start, end)
                o = F.scaled_dot_product_attention(query[sl].transpose(0, 1), key[sl].transpose(0, 1),
                                                   value[sl].transpose(0, 1), dropout_p=p, is_causal=True,
                                                   scale=self._sdpa_scale(), enable_gqa=gqa)
                out[sl] = o.transpose(0, 1)
        return out.reshape(t, np_ * hn)
