"""Tests for megatron_fp4.rl.grpo against numbers worked out by hand."""

import math

import pytest
import torch

from megatron_fp4.rl.grpo import (GRPOConfig, dynamic_sampling_keep, entropy_from_logits, group_advantages,
                                  grpo_loss, grpo_metrics, grpo_token_loss, is_truncated, kl_k3, masked_mean,
                                  overlong_filter, response_mask, rollout_metrics, tis_weights, token_logprobs)

# ---------------------------------------------------------------- advantages


def test_group_advantages_unbiased_std_by_hand():
    # group [1,0,0,0]: mean 0.25, squared deviations 0.5625 + 3*0.0625 = 0.75, unbiased var 0.75/3 = 0.25, std 0.5
    # -> A = 0.75/0.5 = 1.5 and -0.25/0.5 = -0.5.
    # group [1,0,0,1]: mean 0.5, sq dev 4*0.25 = 1, var 1/3, std 1/sqrt(3) -> A = +-0.5*sqrt(3) = +-0.8660254
    # group [1,1,1,1]: A = 0 (no division by zero thanks to eps).
    r = torch.tensor([[1.0, 0, 0, 0], [1, 0, 0, 1], [1, 1, 1, 1]])
    a = group_advantages(r, eps=0.0 + 1e-12)
    h = 0.5 * math.sqrt(3.0)
    expected = torch.tensor([[1.5, -0.5, -0.5, -0.5], [h, -h, -h, h], [0, 0, 0, 0]])
    torch.testing.assert_close(a, expected, rtol=1e-6, atol=1e-6)


def test_group_advantages_population_std_and_eps_and_flat_input():
    # population var of [1,0,0,0] = 0.75/4 = 0.1875, std = sqrt(3)/4 -> A = 0.75/(sqrt(3)/4) = sqrt(3)
    r = torch.tensor([1.0, 0, 0, 0])
    a = group_advantages(r, group_size=4, eps=0.0, unbiased=False)
    s = math.sqrt(3.0)
    torch.testing.assert_close(a, torch.tensor([s, -s / 3, -s / 3, -s / 3]))
    # eps enters as std + eps: 0.75 / (0.5 + 0.25) = 1.0 with the unbiased std 0.5
    a = group_advantages(r, group_size=4, eps=0.25)
    torch.testing.assert_close(a, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_dr_grpo_advantages_have_no_std_division():
    r = torch.tensor([2.0, 0, 1, 1, 5, 5])  # groups of 3: means 1 and 11/3
    a = group_advantages(r, group_size=3, normalize_std=False)
    torch.testing.assert_close(a, torch.tensor([1.0, -1, 0, 1 - 11 / 3, 5 - 11 / 3, 5 - 11 / 3]))


def test_group_advantage_argument_errors():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.zeros(3, 1))
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="tis_cap"):
        GRPOConfig(tis_cap=0.0)
    with pytest.raises(ValueError, match="clip_low"):
        GRPOConfig(clip_low=1.0)


# ---------------------------------------------------------------- loss, TIS, KL by hand
#
# Two responses of 3 tokens; row 1's last token is padding.  clip_low 0.2, clip_high 0.28 (clip-higher), cap C = 5.
#   A                  = [+1, -1]
#   rho                = [[1.5, 1.0, 0.9], [0.5, 1.1, (3.0)]]
#   exp(old - rollout) = [[1.0, 2.0, 8.0], [0.5, 1.0, (10.)]]  -> w_tis = [[1, 2, 5], [0.5, 1, -]]
#   ref - train        = [[ln 2, 0, 0], [0, 0, 0]]             -> k3 = [[1 - ln 2, 0, 0], [0, 0, 0]]
# surrogate min(rho*A, clip(rho, 0.8, 1.28)*A):
#   row 0 (A=+1): min(1.5, 1.28) = 1.28 (clipped); 1.0; min(0.9, 0.9) = 0.9
#   row 1 (A=-1): min(-0.5, -0.8) = -0.8 (clipped); min(-1.1, -1.1) = -1.1
# L_tok = -surr * w:  -1.28, -2.0, -4.5, 0.4, 1.1  -> sum -6.28 over N = 5 tokens
# L = -6.28/5 + beta * (1 - ln 2)/5
RHO = [[1.5, 1.0, 0.9], [0.5, 1.1, 3.0]]
W_RAW = [[1.0, 2.0, 8.0], [0.5, 1.0, 10.0]]
D_REF = [[math.log(2.0), 0.0, 0.0], [0.0, 0.0, 0.0]]
KW = dict(clip_low=0.2, clip_high=0.28, tis_cap=5.0)


def _inputs(requires_grad=True):
    logp_old = torch.log(torch.tensor([[0.5, 0.4, 0.8], [0.3, 0.6, 0.2]], dtype=torch.float64))
    logp_train = (logp_old + torch.log(torch.tensor(RHO, dtype=torch.float64))).requires_grad_(requires_grad)
    logp_rollout = (logp_old - torch.log(torch.tensor(W_RAW, dtype=torch.float64))).requires_grad_(requires_grad)
    logp_ref = (logp_train.detach() + torch.tensor(D_REF, dtype=torch.float64)).requires_grad_(requires_grad)
    logp_old = logp_old.clone().requires_grad_(requires_grad)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64, requires_grad=requires_grad)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return logp_train, logp_old, logp_rollout, logp_ref, adv, mask


def test_token_loss_by_hand():
    lt, lo, lr, lref, adv, mask = _inputs()
    tok = grpo_token_loss(lt, lo, lr, adv, mask, logp_ref=lref, kl_beta=0.0, **KW)
    expected = torch.tensor([[-1.28, -2.0, -4.5], [0.4, 1.1, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(tok.detach(), expected)


def test_loss_with_kl_by_hand_and_gradients_only_through_logp_train():
    lt, lo, lr, lref, adv, mask = _inputs()
    beta = 0.1
    loss = grpo_loss(lt, lo, lr, adv, mask, logp_ref=lref, kl_beta=beta, **KW)
    expected = -6.28 / 5 + beta * (1.0 - math.log(2.0)) / 5
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    loss.backward()
    for t in (lo, lr, lref, adv):
        assert t.grad is None
    # dL/dlogp_train per token = (-A * rho * w if unclipped else 0)/N + beta * (1 - exp(ref - train))/N
    #  (0,0): clipped, KL: 0.1*(1-2)/5 = -0.02      (0,1): -1*1.0*2/5 = -0.4      (0,2): -0.9*5/5 = -0.9
    #  (1,0): clipped -> 0                           (1,1): +1.1*1/5 = 0.22        (1,2): padding -> 0
    torch.testing.assert_close(lt.grad, torch.tensor([[-0.02, -0.4, -0.9], [0.0, 0.22, 0.0]], dtype=torch.float64))


def test_tis_and_kl_helpers_by_hand():
    lt, lo, lr, lref, adv, mask = _inputs()
    w = tis_weights(lo, lr, 5.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 5.0], [0.5, 1.0, 5.0]], dtype=torch.float64))
    assert not w.requires_grad
    kl = kl_k3(torch.zeros(3, dtype=torch.float64), torch.log(torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)))
    # d = ln 2: 2 - ln2 - 1; d = 0: 0; d = -ln 2: 0.5 + ln 2 - 1
    torch.testing.assert_close(kl, torch.tensor([1 - math.log(2), 0.0, math.log(2) - 0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="logp_ref"):
        grpo_loss(lt, lo, lr, adv, mask, kl_beta=0.1)


def test_kl_clamps_keep_the_loss_finite():
    """A token the policy and the reference disagree on by 100 nats: k3 would overflow (inf loss, skipped update);
    clamped as verl does, it counts 10 and passes no gradient, the other tokens theirs."""
    logp = torch.tensor([-101.0, -1.0, -2.0, -3.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0, -1.5, -1.0, -3.0], dtype=torch.float64)
    kl = kl_k3(logp, ref)
    d = ref[1:] - logp[1:].detach()
    torch.testing.assert_close(kl, torch.cat([torch.tensor([10.0], dtype=torch.float64), d.exp() - d - 1]))
    kl.sum().backward()
    torch.testing.assert_close(logp.grad, torch.cat([torch.zeros(1, dtype=torch.float64), 1 - d.exp()]))
    assert kl_k3(torch.tensor([-200.0]), torch.tensor([0.0])).item() == 10.0  # fp32: no inf on the way either
    lt, lo, lr, lref, adv, mask = _inputs()
    far = lref.clone()
    far[0, 0] = lt[0, 0].detach() + 150.0
    loss = grpo_loss(lt, lo, lr, adv, mask, logp_ref=far, kl_beta=0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lt.grad).all()


def test_ratio_log_clamp_and_dual_clip_by_hand():
    """A token whose FP4 training logprob jumped 100 nats above the old one: exp would overflow fp32 and a negative
    advantage make the loss inf; the log-ratio is clamped to +-20 first (verl). Dual-clip PPO (--eps-clip-c c)
    bounds a negative-advantage token's loss by -c * A, with no gradient there."""
    lt = torch.tensor([[100.0, 1.0, 0.2]], requires_grad=True)  # log-ratios against lo = 0
    lo = torch.zeros(1, 3)
    adv = torch.tensor([-1.0])
    mask = torch.ones(1, 3, dtype=torch.bool)
    tok = grpo_token_loss(lt, lo, None, adv, mask, tis_cap=None, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(tok.detach(), torch.tensor([[math.exp(20.0), math.e, math.exp(0.2)]]))
    tok.sum().backward()
    torch.testing.assert_close(lt.grad, torch.tensor([[0.0, math.e, math.exp(0.2)]]))  # clamped: no gradient
    lt.grad = None
    tok = grpo_token_loss(lt, lo, None, adv, mask, tis_cap=None, clip_low=0.2, clip_high=0.2, clip_c=2.0)
    torch.testing.assert_close(tok.detach(), torch.tensor([[2.0, 2.0, math.exp(0.2)]]))
    tok.sum().backward()
    torch.testing.assert_close(lt.grad, torch.tensor([[0.0, 0.0, math.exp(0.2)]]))  # rho < c: as before
    pos = grpo_token_loss(lt, lo, None, torch.tensor([1.0]), mask, tis_cap=None, clip_c=2.0)
    torch.testing.assert_close(pos.detach(), torch.tensor([[-1.2, -1.2, -1.2]]))  # A > 0: the dual clip does nothing
    m = grpo_metrics(lt.detach(), lo, None, adv, mask, tis_cap=None, clip_c=2.0)
    assert m["ppo_dual_clip_frac"] == pytest.approx(2 / 3) and m["ratio_max"] == pytest.approx(math.exp(20), rel=1e-6)
    assert "ppo_dual_clip_frac" not in grpo_metrics(lt.detach(), lo, None, adv, mask, tis_cap=None)
    with pytest.raises(ValueError, match="clip_c"):
        GRPOConfig(clip_c=1.0)
    assert GRPOConfig(clip_c=3.0).loss_kwargs()["clip_c"] == 3.0


def test_no_tis_on_policy_and_per_token_advantages():
    lt, lo, lr, lref, adv, mask = _inputs()
    # logp_old=None: on-policy, rho == 1 -> L = -sum(A)/N; per-token advantages [B,T] broadcast the same way
    loss = grpo_loss(lt, None, None, adv, mask, tis_cap=None)
    assert loss.item() == pytest.approx(-(3 * 1.0 + 2 * -1.0) / 5)
    loss.backward()
    torch.testing.assert_close(lt.grad, torch.tensor([[-0.2] * 3, [0.2, 0.2, 0.0]], dtype=torch.float64))
    loss2 = grpo_loss(lt.detach(), None, None, adv.detach()[:, None].expand(2, 3), mask)
    assert loss2.item() == pytest.approx(loss.item())


def test_micro_batch_split_with_global_token_count_equals_full_batch():
    torch.manual_seed(0)
    B, T = 6, 5
    lt = (torch.randn(B, T, dtype=torch.float64) * 0.3 - 1.0).requires_grad_()
    lo = lt.detach() + 0.2 * torch.randn(B, T, dtype=torch.float64)
    lr = lo + 0.5 * torch.randn(B, T, dtype=torch.float64)
    lref = lo + 0.1 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.randn(B, dtype=torch.float64)
    mask = response_mask(torch.tensor([5, 3, 1, 4, 2, 5]), T)
    kw = dict(kl_beta=0.05, clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    full = grpo_loss(lt, lo, lr, adv, mask, logp_ref=lref, **kw)
    (g_full,) = torch.autograd.grad(full, lt)
    n = int(mask.sum())
    parts = [grpo_loss(lt[s], lo[s], lr[s], adv[s], mask[s], logp_ref=lref[s], num_tokens=n, **kw)
             for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
    total = sum(parts)
    (g_split,) = torch.autograd.grad(total, lt)
    torch.testing.assert_close(total, full, rtol=0, atol=1e-14)
    torch.testing.assert_close(g_split, g_full, rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="num_tokens"):
        grpo_loss(lt, lo, lr, adv, mask, num_tokens=0)


def test_padding_garbage_cannot_poison_loss_or_grad():
    lt, lo, lr, lref, adv, mask = _inputs(requires_grad=False)
    lt = lt.clone()
    lt[1, 2] = float("inf")
    lr = lr.clone()
    lr[1, 2] = float("-inf")
    lt.requires_grad_()
    loss = grpo_loss(lt, lo, lr, adv, mask, **KW)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lt.grad).all()
    assert loss.item() == pytest.approx(-6.28 / 5)


# ---------------------------------------------------------------- metrics, filters


def test_metrics_by_hand():
    lt, lo, lr, lref, adv, mask = _inputs(requires_grad=False)
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    m = grpo_metrics(lt, lo, lr, adv, mask, logp_ref=lref, entropy=ent, kl_beta=0.1, **KW)
    assert m["num_tokens"] == 5
    assert m["ppo_clip_frac"] == pytest.approx(2 / 5)  # tokens (0,0) and (1,0)
    assert m["ppo_clip_frac_high"] == pytest.approx(1 / 5)  # rho 1.5 > 1.28 with A > 0
    assert m["ppo_clip_frac_low"] == pytest.approx(1 / 5)  # rho 0.5 < 0.8 with A < 0
    assert m["tis_clip_frac"] == pytest.approx(1 / 5)  # raw weight 8 > 5 (the padded 10 does not count)
    assert m["tis_weight_mean"] == pytest.approx((1 + 2 + 5 + 0.5 + 1) / 5)
    assert m["kl_mean"] == pytest.approx((1 - math.log(2)) / 5)
    # |logp_train - logp_rollout| = |ln rho + ln w_raw| -> ln1.5, ln2, ln7.2, |ln0.25|, ln1.1
    assert m["logp_abs_diff_mean"] == pytest.approx(math.log(1.5 * 2 * 7.2 * 4 * 1.1) / 5)
    assert m["logp_abs_diff_max"] == pytest.approx(math.log(7.2))
    assert m["entropy_mean"] == pytest.approx(15 / 5)
    assert m["ratio_mean"] == pytest.approx((1.5 + 1.0 + 0.9 + 0.5 + 1.1) / 5)
    assert m["loss"] == pytest.approx(-6.28 / 5 + 0.1 * (1 - math.log(2)) / 5)


def test_dynamic_sampling_and_overlong_filter():
    r = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0, 0])
    torch.testing.assert_close(dynamic_sampling_keep(r, 3), torch.tensor([False, True, False]))
    lengths = torch.tensor([2, 4, 4])
    eos = torch.tensor([True, True, False])
    trunc = is_truncated(lengths, 4, eos)
    torch.testing.assert_close(trunc, torch.tensor([False, False, True]))
    torch.testing.assert_close(is_truncated(lengths, 4), torch.tensor([False, True, True]))
    mask = overlong_filter(response_mask(lengths, 4), trunc)
    torch.testing.assert_close(mask, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool))
    x = torch.arange(12.0).view(3, 4)
    assert masked_mean(x, mask).item() == pytest.approx((0 + 1 + 4 + 5 + 6 + 7) / 6)
    assert masked_mean(x, torch.zeros(3, 4, dtype=torch.bool)).item() == 0.0


def test_rollout_metrics():
    r = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0, 0])
    m = rollout_metrics(r, torch.tensor([3, 4, 5, 6, 7, 8, 9, 10, 11]), torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 1]), 3)
    assert m["reward_mean"] == pytest.approx(4 / 9)
    assert m["accuracy"] == pytest.approx(4 / 9)
    assert m["response_length_mean"] == 7 and m["response_length_max"] == 11
    assert m["truncated_ratio"] == pytest.approx(2 / 9)
    assert m["groups_all_equal_frac"] == pytest.approx(2 / 3)
    assert m["groups_all_correct_frac"] == pytest.approx(1 / 3)
    assert m["groups_all_wrong_frac"] == pytest.approx(1 / 3)


def test_token_logprobs_and_entropy():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]]))
    lp = token_logprobs(logits, torch.tensor([[0, 2]]))
    torch.testing.assert_close(lp, torch.log(torch.tensor([[0.5, 1 / 3]])))
    ent = entropy_from_logits(logits)
    torch.testing.assert_close(ent, torch.tensor([[1.5 * math.log(2), math.log(3)]]))


def test_config_kwargs_feed_the_functions():
    cfg = GRPOConfig(group_size=4, clip_high=0.28, use_tis=False, kl_beta=0.0)
    assert cfg.loss_kwargs()["tis_cap"] is None and cfg.loss_kwargs()["clip_high"] == 0.28
    a = group_advantages(torch.tensor([1.0, 0, 0, 0]), **cfg.advantage_kwargs())
    torch.testing.assert_close(a, torch.tensor([1.5, -0.5, -0.5, -0.5]), rtol=1e-5, atol=1e-5)


def test_grpo_learns_a_bandit():
    """End-to-end sign check: GRPO with clipping, TIS and KL raises the probability of the rewarded action."""
    torch.manual_seed(0)
    logits = torch.zeros(1, 4, requires_grad=True)  # policy over 4 one-token "responses"
    ref = torch.log_softmax(torch.zeros(4), -1)
    opt = torch.optim.SGD([logits], lr=0.5)
    G = 8
    for _ in range(60):
        with torch.no_grad():
            probs = torch.softmax(logits, -1)[0]
            actions = torch.multinomial(probs, 2 * G, replacement=True)  # 2 groups of G
            rollout_lp = torch.log(probs[actions]) + 0.01 * torch.randn(2 * G)  # engine mismatch
        rewards = (actions == 2).float()
        adv = group_advantages(rewards, G)
        logp_old = torch.log_softmax(logits, -1)[0, actions].detach()
        for _ in range(2):  # two updates per batch: the second is off-policy and exercises the clip
            lp = torch.log_softmax(logits, -1)[0, actions]
            loss = grpo_loss(lp[:, None], logp_old[:, None], rollout_lp[:, None], adv,
                             torch.ones(2 * G, 1, dtype=torch.bool), logp_ref=ref[actions][:, None], kl_beta=0.01,
                             clip_low=0.2, clip_high=0.28, tis_cap=5.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert torch.softmax(logits, -1)[0, 2].item() > 0.9


def test_low_precision_logprobs_are_upcast():
    lt, lo, lr, lref, adv, mask = _inputs(requires_grad=False)
    lt16 = lt.to(torch.bfloat16).requires_grad_()
    loss = grpo_loss(lt16, lo.to(torch.bfloat16), lr.to(torch.bfloat16), adv, mask, **KW)
    assert loss.dtype == torch.float32
    ref = grpo_loss(lt16.detach().float(), lo.to(torch.bfloat16).float(), lr.to(torch.bfloat16).float(),
                    adv.float(), mask, **KW)
    assert loss.item() == ref.item()
    loss.backward()
    assert lt16.grad.dtype == torch.bfloat16 and torch.isfinite(lt16.grad).all()


# ---------------------------------------------------------------- GSPO, REINFORCE++, DAPO shaping, LR, pass@k


def test_gspo_ratio_is_the_geometric_mean_per_sequence_by_hand():
    # row 0: log-ratios 0.1, 0.3 over 2 tokens -> s = exp(0.2) for both; row 1: one token (0.5), one padded -> exp(0.5)
    lt = torch.tensor([[0.1, 0.3], [0.5, 9.0]], requires_grad=True)
    lo, mask = torch.zeros(2, 2), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    from megatron_fp4.rl.grpo import policy_ratio

    rho = policy_ratio(torch.where(mask > 0, lt, 0.0), lo, mask, "sequence")
    torch.testing.assert_close(rho[:, :1], torch.tensor([[math.exp(0.2)], [math.exp(0.5)]]))
    assert torch.equal(rho[0, 0], rho[0, 1])
    # on-policy GSPO: s = 1 and each sequence's surrogate -s*A counted once, so every token of it gets -A / |y|
    adv = torch.tensor([1.0, -2.0])
    tok = grpo_token_loss(lt, None, None, adv, mask, tis_cap=None, ratio_level="sequence")
    torch.testing.assert_close(tok.detach().sum(dim=1), -adv)
    tok.sum().backward()
    torch.testing.assert_close(lt.grad, torch.tensor([[-0.5, -0.5], [2.0, 0.0]]))
    # clipping acts on the sequence ratio: exp(0.2) > 1.1 clips row 0 (A > 0) as one unit
    m = grpo_metrics(lt.detach(), lo, None, adv, mask, clip_low=0.1, clip_high=0.1, tis_cap=None,
                     ratio_level="sequence")
    assert m["ppo_clip_frac"] == pytest.approx(2 / 3) and m["ratio_max"] == pytest.approx(math.exp(0.5))
    with pytest.raises(ValueError, match="ratio_level"):
        GRPOConfig(ratio_level="group")


def test_reinforce_plus_plus_returns_and_whitening_by_hand():
    from megatron_fp4.rl.grpo import discounted_returns, masked_moments, whiten

    r, mask = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 0]])
    # gamma 0.5: the reward sits on the last response token and halves per token back
    g = discounted_returns(r, mask, gamma=0.5)
    torch.testing.assert_close(g, torch.tensor([[0.25, 0.5, 1.0, 0], [0, 0, 0, 0], [0, 1.0, 2.0, 0]]))
    assert torch.equal(discounted_returns(r, mask, 1.0), r[:, None] * mask)
    # whitened over the 7 masked tokens: mean 4.75/7, population variance, 0 outside the mask
    w = whiten(g, mask)
    vals = g[mask > 0]
    torch.testing.assert_close(w[mask > 0], (vals - vals.mean()) / torch.sqrt(vals.var(unbiased=False) + 1e-8))
    assert float(w[mask == 0].abs().sum()) == 0.0
    # moments add over ranks: two halves give the whole batch's whitening
    halves = masked_moments(g[:1], mask[:1]) + masked_moments(g[1:], mask[1:])
    torch.testing.assert_close(whiten(g[1:], mask[1:], halves), w[1:])


def test_overlong_penalty_is_dapos_by_hand():
    from megatron_fp4.rl.grpo import overlong_penalty

    # max 10, buffer 4: free up to 6 tokens, then -1/4 per token down to -factor at 10
    got = overlong_penalty(torch.tensor([3, 6, 7, 9, 10]), 10, 4, factor=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.375, -0.5]))
    assert torch.equal(overlong_penalty(torch.tensor([10]), 10, 0), torch.zeros(1))
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), 4, 4)


def test_lr_schedule_warms_up_linearly_then_decays():
    from megatron_fp4.rl.actor import lr_schedule

    kw = dict(lr=1.0, min_lr=0.1, total_iters=10)
    assert [lr_schedule(i, warmup_iters=4, **kw) for i in range(4)] == [0.0, 0.25, 0.5, 0.75]  # Megatron-LM's
    assert lr_schedule(4, warmup_iters=4, **kw) == 1.0 and lr_schedule(10, warmup_iters=4, **kw) == 0.1
    assert lr_schedule(7, warmup_iters=4, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    # no warm-up: cosine over the whole run (the driver's schedule before warm-up existed, exactly)
    assert lr_schedule(3, warmup_iters=0, **kw) == 0.1 + 0.5 * 0.9 * (1 + math.cos(math.pi * 3 / 10))
    assert lr_schedule(3, lr=2.0, min_lr=None, warmup_iters=0, total_iters=10) == 2.0


def test_pass_at_k_unbiased_estimator_by_hand():
    from megatron_fp4.rl.evaluator import pass_at_k, pass_ks

    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(4, 2, 3) == 1.0  # fewer than k wrong: some draw of 3 always holds a right one
    assert pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4] and pass_ks(1) == [1]
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
