"""What the native rollout engine's tests share: the tiny megatron-core GPT they build (:func:`tiny_gpt_args`) and
seeded random prompts over its vocabulary (:func:`random_prompts`; ids below 6 are left to stop tokens)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_fp4.models import GPTModelArgs

VOCAB = 96


def tiny_gpt_args(**kw) -> GPTModelArgs:
    """Two layers, hidden 128, GQA 4/2, qkv bias, vocabulary ``VOCAB``; ``kw`` overrides any field."""
    base = dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                vocab_size=VOCAB, max_seq_len=64, add_qkv_bias=True, init_method_std=0.08)
    base.update(kw)
    return GPTModelArgs(**base)


def random_prompts(lengths: Sequence[int], seed: int = 7) -> list[list[int]]:
    """One prompt per length, token ids drawn uniformly from [6, VOCAB) by a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, VOCAB, (n,), generator=g).tolist() for n in lengths]
