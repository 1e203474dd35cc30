"""Reward functions for --custom-rm-path in the tests, spelled as slime calls them: fn(args, sample) -> float (sync or
async), or fn(args, samples) -> list[float] with --group-rm."""

from __future__ import annotations

import asyncio


def response_length(args, sample) -> float:
    """The number of response tokens (a reward that always varies within a group)."""
    return float(sample.response_length)


async def label_in_response(args, sample) -> float:
    """1.0 when the label's text appears in the response (async, as a remote reward model would be)."""
    await asyncio.sleep(0)
    return 1.0 if str(sample.label) in sample.response else 0.0


def rank_in_group(args, samples) -> list[float]:
    """Each sample's position in its group (a group reward)."""
    return [float(i) for i, _ in enumerate(samples)]


def not_a_number(args, sample):
    return "high"


def one_number_per_group(args, samples) -> float:
    """Wrong for --group-rm: one number instead of one per sample."""
    return 1.0
