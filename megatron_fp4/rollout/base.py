"""The rollout-engine interface: generate token ids + logprobs, take weights from the trainer, free/restore memory.

Every engine (the in-process native one, the SGLang plug-in) implements :class:`RolloutEngine`; the RL trainer
only talks to this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

__all__ = ["SamplingParams", "RolloutSample", "WeightSyncStats", "RolloutEngine", "FINISH_REASONS"]

#: "stop": a stop token was sampled (it is the last token of the response); "length": the length limit was hit.
FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses; defaults are plain sampling at temperature 1."""

    #: Softmax temperature; 0 means greedy (argmax, ties: lowest token id).
    temperature: float = 1.0
    #: Nucleus sampling: keep the smallest set of top tokens whose probability reaches top_p (1.0 = off).
    top_p: float = 1.0
    #: Keep only the top_k most likely tokens (0 or -1 = off).
    top_k: int = 0
    #: Maximum number of generated tokens per sample (the stop token included).
    max_new_tokens: int = 64
    #: Token ids that end a response (kept as its last token, finish reason "stop").
    stop_token_ids: tuple[int, ...] = ()
    #: Seed of the sampling generator (None: nondeterministic); the same seed and inputs give the same samples.
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature={self.temperature!r} is not valid; it must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} is not valid; it must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} is not valid; it must be an integer >= -1 (0/-1: off)")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} is not valid; it must be an integer >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """Whether sampling is argmax."""
        return self.temperature == 0.0


@dataclass
class RolloutSample:
    """One generated response."""

    #: Generated token ids (the prompt excluded; a sampled stop token included as the last one).
    token_ids: list[int]
    #: Log-probability of each generated token under the distribution it was sampled from
    #: (log_softmax(logits / temperature), before top-k/top-p truncation; temperature 1 when greedy).
    logprobs: list[float]
    #: "stop" or "length".
    finish_reason: str
    #: Length of the prompt this sample continues.
    prompt_length: int = 0


@dataclass
class WeightSyncStats:
    """What one ``update_weights`` call did and how long each part took (seconds)."""

    num_tensors: int = 0
    num_bytes: int = 0
    copy_seconds: float = 0.0
    quantize_seconds: float = 0.0
    total_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_metrics(self, prefix: str = "rollout/weight_sync_") -> dict[str, float]:
        """Flat metrics for a logger."""
        return {f"{prefix}tensors": self.num_tensors, f"{prefix}bytes": self.num_bytes,
                f"{prefix}copy_s": self.copy_seconds, f"{prefix}quantize_s": self.quantize_seconds,
                f"{prefix}total_s": self.total_seconds}


class RolloutEngine(ABC):
    """A rollout policy: generation with logprobs, weights pushed by the trainer, memory released between uses."""

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling_params: SamplingParams) -> list[RolloutSample]:
        """One response per prompt (repeat a prompt G times for a group of G)."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        """Load trainer weights (megatron-core parameter names) and re-quantize them once; returns timings."""

    @abstractmethod
    def release_memory(self) -> None:
        """Free what generation holds (KV cache, quantized weights; weights offloaded if on an accelerator)."""

    @abstractmethod
    def resume_memory(self) -> None:
        """Undo :meth:`release_memory` before the next generate."""
