"""Supervised warm-up: cross-entropy on the examples' target completions (response tokens only), before GRPO, so
that a randomly initialized model starts where rewards are not all zero."""

from __future__ import annotations

import random
import time

import torch

from megatron_fp4.rl.actor import Actor
from megatron_fp4.rl.config import WarmupConfig
from megatron_fp4.rl.data import Example
from megatron_fp4.rl.distributed import dp_rank_and_size
from megatron_fp4.rl.sequences import pack_sequences
from megatron_fp4.rl.tokenizer import Tokenizer

__all__ = ["SupervisedWarmup"]


class SupervisedWarmup:
    """Draws batches of training examples (one stream over calls: warming up in chunks draws the same batches as
    one uninterrupted warm-up) and takes supervised steps of the actor at --sft-lr."""

    def __init__(self, cfg: WarmupConfig, actor: Actor, tokenizer: Tokenizer, examples: list[Example],
                 seed: int, max_prompt_length: int, max_response_length: int) -> None:
        self.cfg, self.actor, self.tokenizer, self.examples = cfg, actor, tokenizer, examples
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.dp_rank, self.dp_size = dp_rank_and_size()
        self.rng = random.Random(seed * 1000 + 17 + self.dp_rank)

    def run(self, iters: int, progress: bool = True) -> list[float]:
        """``iters`` supervised iterations; returns their NLL per token. The LR is the schedule's step-0 value after."""
        if iters <= 0:
            return []
        tok, actor = self.tokenizer, self.actor
        actor.set_lr(self.cfg.sft_lr)
        per_rank = max(1, self.cfg.sft_batch_size // self.dp_size)
        losses = []
        t0 = time.monotonic()
        for it in range(iters):
            exs = self.rng.sample(self.examples, min(per_rank, len(self.examples)))
            # the lengths a rollout has: a prompt keeps its end, a target its start (a long record costs no more)
            prompts = [tok.encode(e.prompt)[-self.max_prompt_length:] for e in exs]
            targets = [(tok.encode(e.target) + [tok.eos_id])[:self.max_response_length] for e in exs]
            seqs = pack_sequences(prompts, targets, [[0.0] * len(t) for t in targets], torch.zeros(len(exs)),
                                  tok.pad_id)
            losses.append(actor.supervised_update(seqs))
            if it == 0:
                t1 = time.monotonic()  # the pace is measured from here: the first iteration pays start-up
            if progress and torch.distributed.get_rank() == 0 and (it % 25 == 0 or it == iters - 1):
                now = time.monotonic()
                eta = f" | eta {(now - t1) / it * (iters - it - 1):.0f}s" if it else ""
                print(f"[warmup] iter {it + 1}/{iters} | nll {losses[-1]:.4f} | {now - t0:.0f}s{eta}", flush=True)
        actor.set_lr(actor.lr_at(0))
        return losses
