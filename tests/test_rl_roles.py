"""The GRPO roles, each on its own in one gloo process: the distributed helpers, the rollout manager, the actor,
the checkpointer, the evaluator, and the trainer's step over them."""

from __future__ import annotations

import pytest
import torch

from megatron_fp4.parallel import initialize_parallel
from megatron_fp4.rl import distributed as dist
from megatron_fp4.rl.arguments import parse_args, rl_config
from megatron_fp4.rl.checkpointer import plan_start
from megatron_fp4.rl.grpo import group_advantages
from megatron_fp4.rl.rewards import score
from megatron_fp4.rl.setup import build_trainer

TINY = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--num-synthetic-examples", "300", "--eval-samples", "16",
        "--rollout-batch-size", "4", "--group-size", "4", "--micro-batch-size", "8", "--sft-iters", "0",
        "--max-response-length", "4", "--seed", "3", "--train-iters", "5"]


def _trainer(*extra):
    cfg = rl_config(parse_args([*TINY, *extra]))
    initialize_parallel(1, 1, seed=cfg.run.seed)
    trainer, _ = build_trainer(cfg, plan_start(cfg.checkpoint))
    trainer.sync_weights()  # the rollout copy was built with its own random weights: give it the policy's
    return trainer


def _weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items() if not k.endswith("_extra_state")}


def test_distributed_helpers_in_one_process():
    initialize_parallel(1, 1, seed=0)
    assert dist.dp_rank_and_size() == (0, 1)
    assert dist.dp_sum(2.5) == 2.5 and dist.dp_max(-1.0) == -1.0 and dist.from_last_stage(4.0) == 4.0
    obj = {"a": [1, 2]}
    assert dist.from_first_stage(obj) is obj
    assert dist.any_rank(True) and not dist.any_rank(False) and dist.any_on_model_parallel(torch.tensor(True))
    store = [{"loss": torch.tensor(2.0), "num_tokens": torch.tensor(2.0), "ratio_max": torch.tensor(1.5)},
             {"loss": torch.tensor(4.0), "num_tokens": torch.tensor(2.0), "ratio_max": torch.tensor(1.2)}]
    assert dist.reduce_token_stats(store) == {"loss": 1.5, "ratio_max": 1.5}


def test_rollout_manager_returns_scored_filtered_sequences():
    # --dynamic-sampling-max-rounds 1: dynamic sampling drops groups without refilling (masked out of the loss)
    trainer = _trainer("--dynamic-sampling", "--dynamic-sampling-max-rounds", "1", "--fp4-format", "none")
    rollout = trainer.rollout
    seqs, metrics = rollout.rollout(step=0)
    n, G = 4 * 4, 4
    assert len(seqs) == n and seqs.rewards.shape == (n,) and set(seqs.rewards.tolist()) <= {0.0, 1.0}
    assert rollout.sampler.position == (0, 4)
    # the loss mask covers response tokens only, and none of a group whose rewards are all equal
    equal = (seqs.rewards.view(-1, G).amax(1) == seqs.rewards.view(-1, G).amin(1)).repeat_interleave(G)
    assert float(seqs.mask[equal].sum()) == 0.0
    assert seqs.num_tokens == float(seqs.mask.sum())
    assert metrics["kept_groups_frac"] == 1 - float(equal.float().mean())
    assert 0 <= metrics["reward_mean"] <= 1 and metrics["rollout_tokens_per_s"] > 0
    # the logprobs the actor weights tokens with are the engine's, at the response positions
    assert bool((seqs.logp_rollout[seqs.mask > 0] <= 0).all())


def test_dynamic_sampling_refills_from_over_sampled_rounds():
    """DAPO: rounds of --over-sampling-batch-size prompts until --rollout-batch-size groups have unequal rewards
    (here a --custom-rm-path reward: the response length, which a random model's mostly truncated responses share)."""
    trainer = _trainer("--dynamic-sampling", "--over-sampling-batch-size", "6", "--fp4-format", "none",
                       "--custom-rm-path", "custom_rewards.response_length", "--max-response-length", "2",
                       "--no-overlong-filter")
    rollout = trainer.rollout
    seqs, metrics = rollout.rollout(step=0)
    G, rounds = 4, int(metrics["dynamic_sampling_rounds"])
    assert len(seqs) == 4 * G and rollout.sampler.position == (0, 6 * rounds)
    assert rounds > 1 and metrics["kept_groups_frac"] == 1.0  # refilled: every group of the batch passes
    assert 0 < metrics["dynamic_sampling_pass_frac"] < 1
    groups = seqs.rewards.view(-1, G)
    assert bool((groups.amax(1) > groups.amin(1)).all())
    # the rewards are the custom function's: each response's length (its masked tokens)
    assert torch.equal(seqs.rewards, (seqs.mask > 0).sum(1).float())


def test_overlong_reward_shaping_and_reinforce_plus_plus_advantages():
    trainer = _trainer("--fp4-format", "none", "--overlong-buffer-len", "2", "--overlong-penalty-factor", "0.5",
                       "--no-overlong-filter", "--advantage-estimator", "reinforce_plus_plus", "--gamma", "0.9")
    seqs, metrics = trainer.rollout.rollout(step=0)
    lengths = (seqs.mask > 0).sum(1)
    raw = seqs.rewards - (-(lengths - 2).clamp(min=0) / 2 * 0.5)  # max length 4, buffer 2: -0.25 per extra token
    assert set(raw.tolist()) <= {0.0, 1.0} and metrics["overlong_penalty_mean"] < 0
    adv = trainer.actor.advantages(seqs)  # per-token discounted returns, whitened over the batch's loss tokens
    assert adv.shape == seqs.mask.shape and float(adv[seqs.mask == 0].abs().sum()) == 0
    vals = adv[seqs.mask > 0]
    assert abs(float(vals.mean())) < 1e-5 and abs(float(vals.std(unbiased=False)) - 1) < 1e-3
    seqs.num_tokens = float(seqs.mask.sum())
    metrics = trainer.actor.update(seqs, step=1, last_checkpoint=None)
    assert "skipped" not in metrics and metrics["grad_norm"] > 0


def test_several_optimizer_steps_per_rollout_with_lr_warmup():
    """--global-batch-size counts samples (slime): 4 prompts x 4 samples with 8 per step = 2 optimizer steps, each on
    its half, the ratio taken against the rollout's policy; the LR warms up per optimizer step."""
    trainer = _trainer("--fp4-format", "none", "--global-batch-size", "8", "--lr", "1e-2", "--min-lr", "1e-3",
                       "--lr-warmup-iters", "3")
    actor = trainer.actor
    assert actor.steps_per_rollout == 2
    assert [actor.lr_at(0, 0), actor.lr_at(0, 1), actor.lr_at(1, 0), actor.lr_at(1, 1)] == pytest.approx(
        [0.0, 1e-2 / 3, 2e-2 / 3, 1e-2])
    seqs, _ = trainer.rollout.rollout(step=0)
    seqs.rewards = torch.arange(len(seqs), dtype=torch.float32) % 3  # groups with different rewards: a gradient
    seqs.mask = torch.ones_like(seqs.mask) * (seqs.logp_rollout != 0)
    seqs.num_tokens = float(seqs.mask.sum())
    before = _weights(actor.module)
    actor.set_lr(actor.lr_at(0))
    metrics = actor.update(seqs, step=1, last_checkpoint=None)
    assert metrics["optimizer_steps"] == 2 and metrics["lr"] == pytest.approx(1e-2 / 3) and metrics["grad_norm"] > 0
    # the update's phases, timed (forward + backward and optimizer summed over both optimizer steps); together no
    # more than the update's wall time (tokens / tokens per second)
    phases = ("train/ref_logprobs_s", "train/old_logprobs_s", "train/forward_backward_s", "train/optimizer_s")
    assert all(metrics[k] > 0 for k in phases)
    assert sum(metrics[k] for k in phases) <= seqs.num_tokens / metrics["train_tokens_per_s"] * (1 + 1e-6)
    # the first optimizer step ran at LR 0 (warm-up), so the weights moved by the second step only
    assert any(not torch.equal(before[k], v) for k, v in _weights(actor.module).items())


def test_evaluator_sets_and_pass_at_k(tmp_path):
    from rl_helpers import write_records

    data = write_records(tmp_path / "toy.jsonl", [{"q": f"{a}+1=", "a": str(a + 1)} for a in range(5)])
    trainer = _trainer("--fp4-format", "none", "--eval-prompt-data", "toy", str(data), "--eval-input-key", "q",
                       "--eval-label-key", "a", "--rm-type", "math_rule", "--n-samples-per-eval-prompt", "4",
                       "--eval-temperature", "1.5")
    ev = trainer.evaluator
    assert list(ev.sets) == ["", "toy"] and len(ev.sets["toy"]) == 5
    out = ev.evaluate()
    assert set(out) == {"accuracy", "pass@1", "pass@2", "pass@4", "toy/accuracy", "toy/pass@1", "toy/pass@2",
                        "toy/pass@4"}
    assert out["pass@1"] == pytest.approx(out["accuracy"]) and out["pass@1"] <= out["pass@2"] <= out["pass@4"]
    samples = trainer.rollout.generate_eval(ev.sets["toy"], n=4, temperature=1.5, seed=ev.seed)
    correct = [r >= 1 for r in trainer.rollout.score(ev.sets["toy"], samples, 4)]
    assert out["toy/accuracy"] == sum(correct) / 20  # mean@4 over the set's 5 prompts


def test_actor_update_computes_advantages_and_steps_or_skips():
    trainer = _trainer("--fp4-format", "none", "--lr", "1e-2")
    actor = trainer.actor
    seqs, _ = trainer.rollout.rollout(step=0)
    seqs.rewards = torch.arange(len(seqs), dtype=torch.float32) % 3  # groups with different rewards: a gradient
    seqs.mask = torch.ones_like(seqs.mask) * (seqs.logp_rollout != 0)
    seqs.num_tokens = float(seqs.mask.sum())
    before = _weights(actor.module)
    metrics = actor.update(seqs, step=1, last_checkpoint=None)
    assert torch.equal(seqs.advantages, group_advantages(seqs.rewards, group_size=4))
    assert "skipped" not in metrics and metrics["grad_norm"] > 0 and metrics["lr"] == 1e-2
    assert any(not torch.equal(before[k], v) for k, v in _weights(actor.module).items())

    seqs.rewards = seqs.rewards * float("nan")  # a non-finite loss: the update is skipped, the weights kept
    before = _weights(actor.module)
    metrics = actor.update(seqs, step=2, last_checkpoint=None)
    assert metrics["skipped"] == 1.0 and actor.guard.consecutive == 1
    assert all(torch.equal(before[k], v) for k, v in _weights(actor.module).items())


def test_lr_schedule_is_cosine_to_min_lr():
    actor = _trainer("--fp4-format", "none", "--lr", "1e-3", "--min-lr", "1e-4").actor
    assert actor.lr_at(0) == 1e-3 and abs(actor.lr_at(5) - 1e-4) < 1e-12
    assert abs(actor.lr_at(2) - (1e-4 + 0.45e-3 * (1 + torch.cos(torch.tensor(torch.pi * 0.4)).item()))) < 1e-9


def test_checkpointer_saves_and_resumes_the_roles_state(tmp_path):
    trainer = _trainer("--fp4-format", "none", "--save", str(tmp_path / "run"))
    trainer.start(plan_start(trainer.cfg.checkpoint))  # warm start: evaluated and saved as step 0
    trainer.train_step()
    path = trainer.save()
    saved, position = _weights(trainer.actor.module), trainer.rollout.sampler.position
    trainer.train_step()
    assert trainer.rollout.sampler.position != position
    resumed = trainer.checkpointer.resume(str(tmp_path / "run"), trainer.actor, trainer.rollout.sampler)
    assert (resumed.step, resumed.path) == (1, path) and "warm_start" in resumed.extra
    assert trainer.rollout.sampler.position == position
    assert all(torch.equal(saved[k], v) for k, v in _weights(trainer.actor.module).items())


def test_evaluator_scores_greedy_responses():
    trainer = _trainer("--fp4-format", "none")
    ev = trainer.evaluator
    samples = trainer.rollout.generate_greedy(ev.examples)
    want = sum(score(trainer.rollout.tokenizer.decode(s.token_ids), e.reference, e.kind)
               for s, e in zip(samples, ev.examples)) / len(ev.examples)
    assert ev.evaluate() == {"accuracy": want}


def test_trainer_step_is_rollout_then_update_then_sync():
    trainer = _trainer()  # HiF4 training, W4A4 + ResQ 2:4 rollout
    metrics = trainer.train_step()
    assert trainer.step == 1
    assert {"reward_mean", "loss", "lr", "rollout/weight_sync_total_s"} <= set(metrics)
    assert trainer.actor.optimizer.param_groups[0]["lr"] == trainer.actor.lr_at(1)


def test_a_step_with_nothing_to_learn_keeps_the_weights_and_advances_the_lr():
    trainer = _trainer("--fp4-format", "none", "--dynamic-sampling")
    real = trainer.rollout.rollout

    def all_filtered(step):  # every group's rewards equal: dynamic sampling leaves no token
        seqs, metrics = real(step)
        seqs.mask.zero_()
        seqs.num_tokens = 0.0
        return seqs, metrics

    trainer.rollout.rollout = all_filtered
    before = _weights(trainer.actor.module)
    metrics = trainer.train_step()
    assert metrics["skipped"] == 1.0 and trainer.step == 1
    assert all(torch.equal(before[k], v) for k, v in _weights(trainer.actor.module).items())
    assert trainer.actor.optimizer.param_groups[0]["lr"] == trainer.actor.lr_at(1)


def test_the_static_decode_path_runs_a_grpo_step():
    """--rollout-decode static (the graph path's eager twin, which CPU can run) serves the rollout manager."""
    trainer = _trainer("--rollout-decode", "static", "--fp4-format", "none")
    assert trainer.rollout.engine.decode == "static"
    metrics = trainer.train_step()
    assert trainer.step == 1 and metrics["response_length_mean"] > 0 and metrics["logp_abs_diff_mean"] < 1e-3


def test_save_debug_rollout_data_writes_slime_style_files(tmp_path):
    """--save-debug-rollout-data (slime's): each rollout's batch and each evaluation's samples (every set, every
    precision) in a torch.save file of plain values, with slime's Sample keys; what it holds is what was scored."""
    from rl_helpers import write_records

    data = write_records(tmp_path / "toy.jsonl", [{"q": f"{a}+1=", "a": str(a + 1)} for a in range(5)])
    template = str(tmp_path / "debug" / "{rollout_id}.pt")
    trainer = _trainer("--eval-prompt-data", "toy", str(data), "--eval-input-key", "q", "--eval-label-key", "a",
                       "--save-debug-rollout-data", template)  # W4A4 + ResQ rollout: accuracy and accuracy_bf16
    trainer.start(plan_start(trainer.cfg.checkpoint))  # the step-0 evaluation: eval_0.pt
    trainer.train_step()                                # the first rollout: 0.pt
    keys = {"group_index", "index", "prompt", "tokens", "response", "response_length", "label", "reward", "status",
            "metadata", "rollout_log_probs"}

    train = torch.load(tmp_path / "debug" / "0.pt", weights_only=True)
    assert train["rollout_id"] == 0 and len(train["samples"]) == 4 * 4
    for i, s in enumerate(train["samples"]):
        assert set(s) == keys and s["index"] == i and s["group_index"] == i // 4
        assert len(s["rollout_log_probs"]) == s["response_length"] <= 4 and s["status"] in ("completed", "truncated")
        example = next(e for e in trainer.rollout.train_examples if e.prompt == s["prompt"])
        assert s["label"] == example.reference and s["reward"] == score(s["response"], example.reference, example.kind)
        response = s["tokens"][len(s["tokens"]) - s["response_length"]:]
        assert s["response"] == trainer.rollout.tokenizer.decode(response)

    ev = torch.load(tmp_path / "debug" / "eval_0.pt", weights_only=True)
    warm = trainer.extra["warm_start"]
    assert ev["rollout_id"] == "eval_0" and len(ev["samples"]) == 2 * (16 + 5)
    for set_name, prefix, n in (("", "", 16), ("toy", "toy/", 5)):
        for metric in ("accuracy", "accuracy_bf16"):
            got = [s for s in ev["samples"] if s["eval_set"] == set_name and s["eval_metric"] == metric]
            assert [s["group_index"] for s in got] == list(range(n))
            assert sum(s["reward"] for s in got) / n == warm[prefix + metric]
    toy = [s for s in ev["samples"] if s["eval_set"] == "toy" and s["eval_metric"] == "accuracy_bf16"]
    greedy = trainer.rollout.generate_greedy(trainer.evaluator.sets["toy"], trainer.bf16_precision)
    prompts = trainer.rollout.prompt_ids(trainer.evaluator.sets["toy"])
    assert [s["tokens"] for s in toy] == [p + g.token_ids for p, g in zip(prompts, greedy)]
    assert [s["label"] for s in toy] == [str(a + 1) for a in range(5)]


def test_save_debug_rollout_data_needs_the_rollout_id_placeholder(tmp_path):
    with pytest.raises(ValueError, match=r"--save-debug-rollout-data='.*x\.pt' must contain \{rollout_id\}"):
        parse_args(["--save-debug-rollout-data", str(tmp_path / "x.pt")])
