"""The supervised warm-up's progress line: its eta is paced by the iterations after the first, which pays start-up
(compilation, allocator growth) and would otherwise inflate the estimate of every later one."""

from __future__ import annotations

import types

import megatron_fp4.rl.warmup as warmup
from megatron_fp4.rl.config import WarmupConfig
from megatron_fp4.rl.data import Example


class _Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now


def test_warmup_eta_leaves_the_first_iterations_start_up_out(monkeypatch, capsys):
    clock = _Clock()
    monkeypatch.setattr(warmup, "time", clock)
    monkeypatch.setattr(warmup, "dp_rank_and_size", lambda: (0, 1))
    monkeypatch.setattr(warmup.torch.distributed, "get_rank", lambda: 0)

    def supervised_update(seqs):
        clock.now += 100.0 if clock.now == 0 else 1.0  # the first iteration 100 s, every later one 1 s
        return 1.0

    actor = types.SimpleNamespace(set_lr=lambda lr: None, lr_at=lambda step: 0.0, supervised_update=supervised_update)
    tok = types.SimpleNamespace(encode=lambda text: [7] * len(text), eos_id=2, pad_id=0)
    examples = [Example(prompt="1+1=", reference="2", kind="gsm8k", target="2")] * 4
    sft = warmup.SupervisedWarmup(WarmupConfig(sft_batch_size=2), actor, tok, examples, seed=0,
                                  max_prompt_length=8, max_response_length=4)
    assert sft.run(51) == [1.0] * 51
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[warmup] iter 1/51 | nll 1.0000 | 100s"  # no pace yet
    # after 26 iterations: 25 s since the first ended, 1 s each, 25 left (the whole run's mean would say 120 s)
    assert lines[1] == "[warmup] iter 26/51 | nll 1.0000 | 125s | eta 25s"
    assert lines[2] == "[warmup] iter 51/51 | nll 1.0000 | 150s | eta 0s"
