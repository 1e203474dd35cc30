"""GRPO math (SPEC 5): group advantages, the clipped token-level loss with TIS and k3 KL, filters and metrics.

Pure PyTorch, model independent. Shapes: B responses (= num_groups * G, grouped contiguously), T response tokens.
All per-token inputs are [B, T] log-probabilities of the sampled tokens; `mask` is [B, T] (bool or 0/1) and marks
the response tokens that enter the loss. Only `logp_train` carries gradient: every other input is detached here.
The math runs in fp32 (fp64 inputs stay fp64): bf16/fp16 logprobs are upcast first.

    A_i   = (r_i - mean_g) / (std_g + eps)        (Dr.GRPO: A_i = r_i - mean_g)
    rho   = exp(logp_train - logp_old)            (GSPO: exp of the mean over the response's tokens, per sequence,
                                                   and the surrogate counted once per sequence: / |y| per token)
    w_tis = min(exp(logp_old - logp_rollout), C)   (truncated importance sampling vs the rollout engine)
    kl    = exp(d) - d - 1,  d = logp_ref - logp_train     (k3 estimator of KL(pi || pi_ref); d clamped to +-20 and
                                                           kl to <= 10, as verl / OpenRLHF)
    L_tok = -min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A) * w_tis + beta * kl
            (dual-clip PPO, clip_c = c > 1: for A < 0 the surrogate is at least c*A, i.e. L_tok's policy term at
             most -c*A; the log-ratio inside rho is clamped to +-20 before exp, as verl does)
    L     = sum(L_tok * mask) / N,   N = mask.sum() or the given global token count

Also here: REINFORCE++'s advantages (discounted returns whitened over the batch, ``discounted_returns`` and
``whiten``), DAPO's overlong reward shaping (``overlong_penalty``).

Std estimator: std_g is the UNBIASED sample standard deviation (Bessel, divides by G-1) by default, as
torch.std, TRL and verl compute it; `unbiased=False` gives the population estimator (divides by G).

Data/micro-batch parallelism: pass `num_tokens` = the number of loss tokens of the whole global batch to every
call; then the per-micro-batch losses SUM to the full-batch loss (and so do their gradients). With a data-parallel
all-reduce that AVERAGES gradients over R ranks, multiply each rank's loss by R (or all-reduce with SUM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["GRPOConfig", "RATIO_LEVELS", "group_advantages", "dynamic_sampling_keep", "response_mask", "is_truncated",
           "overlong_filter", "overlong_penalty", "discounted_returns", "masked_moments", "whiten", "masked_mean",
           "kl_k3", "tis_weights", "policy_ratio", "grpo_token_loss", "grpo_loss", "grpo_metrics",
           "grpo_metric_tensors", "rollout_metrics", "token_logprobs", "entropy_from_logits"]

#: "token": PPO/GRPO's per-token ratio; "sequence": GSPO's per-sequence ratio (geometric mean over the response).
RATIO_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO hyper-parameters; defaults are the paper's Qwen2.5-3B GSM8K setting (SPEC 1)."""

    group_size: int = 16            # responses per prompt (G)
    clip_low: float = 0.2           # eps_low: rho is clipped below at 1 - clip_low
    clip_high: float = 0.2          # eps_high: rho is clipped above at 1 + clip_high (clip-higher when > clip_low)
    tis_cap: float = 5.0            # C: cap of the truncated importance weight (math.inf = untruncated IS)
    use_tis: bool = True            # weight tokens by w_tis against the rollout engine's logprobs
    kl_beta: float = 0.001          # beta of the k3 KL penalty to the frozen reference (0 disables it)
    adv_eps: float = 1e-6           # eps in (r - mean) / (std + eps)
    normalize_std: bool = True      # False = Dr.GRPO (no division by the group std)
    std_unbiased: bool = True       # group std estimator: unbiased (G - 1) or population (G)
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal
    overlong_filter: bool = True    # mask responses truncated at max length out of the loss
    ratio_level: str = "token"      # "sequence" = GSPO's sequence-level importance ratio
    clip_c: float | None = None     # dual-clip PPO's c (> 1): the A < 0 surrogate is bounded below by c * A

    def __post_init__(self) -> None:
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"group_size must be an int >= 2, got {self.group_size!r}")
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low!r}")
        if not self.clip_high >= 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high!r}")
        if not self.tis_cap > 0.0:
            raise ValueError(f"tis_cap must be > 0 (math.inf disables truncation), got {self.tis_cap!r}")
        if not (self.kl_beta >= 0.0 and math.isfinite(self.kl_beta)):
            raise ValueError(f"kl_beta must be finite and >= 0, got {self.kl_beta!r}")
        if not self.adv_eps >= 0.0:
            raise ValueError(f"adv_eps must be >= 0, got {self.adv_eps!r}")
        if self.ratio_level not in RATIO_LEVELS:
            raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {self.ratio_level!r}")
        if self.clip_c is not None and not self.clip_c > 1.0:
            raise ValueError(f"clip_c (dual-clip PPO) must be > 1 or None, got {self.clip_c!r}")

    def loss_kwargs(self) -> dict:
        """Keyword arguments of grpo_loss / grpo_metrics taken from this config."""
        return dict(clip_low=self.clip_low, clip_high=self.clip_high,
                    tis_cap=self.tis_cap if self.use_tis else None, kl_beta=self.kl_beta,
                    ratio_level=self.ratio_level, clip_c=self.clip_c)

    def advantage_kwargs(self) -> dict:
        """Keyword arguments of group_advantages taken from this config."""
        return dict(group_size=self.group_size, eps=self.adv_eps, normalize_std=self.normalize_std,
                    unbiased=self.std_unbiased)


def _grouped(rewards: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """View rewards as [num_groups, G]: 2-D input as is, 1-D input split into contiguous groups."""
    if rewards.dim() == 2:
        if group_size is not None and rewards.shape[1] != group_size:
            raise ValueError(f"rewards has groups of {rewards.shape[1]}, but group_size={group_size}")
        return rewards
    if rewards.dim() != 1 or group_size is None:
        raise ValueError("rewards must be [num_groups, G], or 1-D with group_size given")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of group_size={group_size}")
    return rewards.view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int | None = None, *, eps: float = 1e-6,
                     normalize_std: bool = True, unbiased: bool = True) -> torch.Tensor:
    """Per-response advantages (r - group mean) / (group std + eps); Dr.GRPO when normalize_std=False.

    rewards: [num_groups, G] or flat [num_groups * G] (contiguous groups, group_size given). Returns the same
    shape, float32. std is unbiased (G - 1) unless unbiased=False (population, G).
    """
    g = _grouped(rewards.detach().to(torch.float32), group_size)
    if g.shape[1] < 2:
        raise ValueError(f"GRPO needs at least 2 responses per group, got {g.shape[1]}")
    adv = g - g.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (g.std(dim=1, unbiased=unbiased, keepdim=True) + eps)
    return adv.view(rewards.shape)


def dynamic_sampling_keep(rewards: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """Bool [num_groups]: True for groups whose rewards are not all equal (the ones dynamic sampling keeps)."""
    g = _grouped(rewards.detach(), group_size)
    return g.amax(dim=1) != g.amin(dim=1)


def response_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """Bool [B, max_len]: True for the first lengths[b] positions of each row."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def is_truncated(lengths: torch.Tensor, max_response_length: int, eos_seen: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Bool [B]: the response reached max_response_length (and, when eos_seen is given, produced no EOS)."""
    trunc = lengths >= max_response_length
    if eos_seen is not None:
        trunc = trunc & ~eos_seen.bool()
    return trunc


def overlong_filter(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """The loss mask with every token of truncated responses removed (overlong filtering)."""
    return mask.bool() & ~truncated.bool()[:, None]


def overlong_penalty(lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment [B] (<= 0, added to the reward): 0 up to max_response_length - buffer_len
    tokens, then falling linearly to -factor at max_response_length (buffer_len 0: no penalty)."""
    lengths = lengths.detach().to(torch.float32)
    if buffer_len <= 0:
        return torch.zeros_like(lengths)
    if buffer_len >= max_response_length:
        raise ValueError(f"buffer_len={buffer_len} must be smaller than max_response_length={max_response_length}")
    exceed = lengths - (max_response_length - buffer_len)
    return (-exceed / buffer_len * factor).clamp(max=0.0)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ returns [B, T]: the response's scalar reward placed on its last masked token, discounted back
    along the response, G_t = gamma^(number of masked tokens after t) * r; 0 outside mask."""
    m = mask.to(torch.float32)
    after = m.flip(1).cumsum(1).flip(1) - m  # masked tokens after position t
    return rewards.detach().to(torch.float32)[:, None] * torch.pow(torch.tensor(float(gamma)), after) * m


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares, count] of x over mask (float64): add them over ranks, then :func:`whiten`."""
    m = mask.bool()
    v = torch.where(m, x.detach().to(torch.float64), torch.zeros((), dtype=torch.float64))
    return torch.stack([v.sum(), (v * v).sum(), m.sum().to(torch.float64)])


def whiten(x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor | None = None, eps: float = 1e-8
           ) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (population variance; 0 outside mask), as REINFORCE++
    normalizes advantages over the global batch: ``moments`` are :func:`masked_moments` summed over all ranks."""
    s, ss, n = (masked_moments(x, mask) if moments is None else moments).tolist()
    n = max(n, 1.0)
    mean = s / n
    var = max(ss / n - mean * mean, 0.0)
    out = (x.detach().to(torch.float32) - mean) / math.sqrt(var + eps)
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype))


def _count(mask: torch.Tensor, num_tokens: int | float | torch.Tensor | None) -> torch.Tensor:
    if num_tokens is None:
        return mask.sum().to(torch.float32).clamp_min(1.0)
    n = torch.as_tensor(num_tokens, dtype=torch.float32, device=mask.device)
    if n.numel() != 1 or not bool(n > 0):
        raise ValueError(f"num_tokens must be a positive scalar, got {num_tokens!r}")
    return n


def masked_mean(x: torch.Tensor, mask: torch.Tensor, num_tokens: int | float | torch.Tensor | None = None
                ) -> torch.Tensor:
    """sum(x over mask) / N with N = mask.sum() (at least 1) or the given global token count."""
    m = mask.bool()
    return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / _count(m, num_tokens)


#: k3's log-ratio and value clamps (verl's and OpenRLHF's ``low_var_kl``): a token the policy and the reference
#: disagree on by more than 88 nats makes exp overflow, the loss inf and the update skipped. FP4 training forwards are
#: discontinuous: on SmolLM2-135M one Adam-sized step (+-2e-6 per weight) moves the MXFP4 training forward's
#: per-token logprobs by 0.73 nats on average and up to 10 (docs/results/real_model_sensitivity.md), and on the H200
#: MXFP4 runs skipped steps 2-19 for a non-finite loss (most likely this) before the clamp.
KL_LOG_RATIO_CLAMP = 20.0
KL_VALUE_CLAMP = 10.0


def kl_k3(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): exp(d) - d - 1 with d = ref - logp (>= 0), d clamped to
    +-KL_LOG_RATIO_CLAMP and the value to at most KL_VALUE_CLAMP, as verl and OpenRLHF do (no gradient where a clamp
    holds)."""
    d = (logp_ref - logp).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1.0).clamp(max=KL_VALUE_CLAMP)


def tis_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, cap: float) -> torch.Tensor:
    """Detached truncated importance weights min(exp(logp_old - logp_rollout), cap)."""
    return torch.exp(logp_old.detach() - logp_rollout.detach()).clamp(max=cap)


def _prepare(logp_train, logp_old, logp_rollout, advantages, mask, logp_ref):
    """Zero the masked-out positions (so padding garbage cannot make inf/nan) and detach non-train inputs."""
    m = mask.bool()
    if logp_train.shape != m.shape:
        raise ValueError(f"logp_train shape {tuple(logp_train.shape)} != mask shape {tuple(m.shape)}")
    dtype = torch.promote_types(logp_train.dtype, torch.float32)  # bf16/fp16 logprobs are upcast: exp() needs it
    zero = torch.zeros((), dtype=dtype, device=logp_train.device)

    def clean(x, name):
        if x is None:
            return None
        if x.shape != m.shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} != mask shape {tuple(m.shape)}")
        return torch.where(m, x.detach().to(dtype), zero)

    lt = torch.where(m, logp_train.to(dtype), zero)
    lo = clean(logp_old, "logp_old") if logp_old is not None else lt.detach()
    lr = clean(logp_rollout, "logp_rollout")
    lref = clean(logp_ref, "logp_ref")
    adv = advantages.detach().to(dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = adv.expand_as(lt)
    return m, lt, lo, lr, adv, lref


#: The policy ratio's log is clamped to +-this before exp (verl's compute_policy_loss does the same): FP4 training
#: forwards move some tokens' logprobs by several nats per step (see KL_LOG_RATIO_CLAMP), and exp of a log-ratio
#: above ~88 is inf in fp32, which a negative advantage turns into an infinite loss.
RATIO_LOG_CLAMP = 20.0


def policy_ratio(lt: torch.Tensor, lo: torch.Tensor, mask: torch.Tensor, ratio_level: str = "token") -> torch.Tensor:
    """The importance ratio [B, T] of the (masked, prepared) train and old logprobs: exp(lt - lo) per token, or
    GSPO's s = exp(mean over the response of (lt - lo)), the same for every token of a sequence (d s / d logp_t =
    s / |y|); the log-ratio clamped to +-RATIO_LOG_CLAMP (no gradient beyond)."""
    if ratio_level == "token":
        return torch.exp((lt - lo).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP))
    if ratio_level != "sequence":
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    m = mask.to(lt.dtype)
    seq = ((lt - lo) * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp_min(1.0)
    return torch.exp(seq.clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)).expand_as(lt)


def _surrogate(rho: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float,
               clip_c: float | None) -> torch.Tensor:
    """PPO's clipped surrogate min(rho A, clip(rho) A), with dual clip max(., c A) where A < 0 when clip_c is set."""
    surr = torch.minimum(rho * adv, rho.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
    if clip_c is None:
        return surr
    return torch.where(adv < 0, torch.maximum(surr, clip_c * adv), surr)


def grpo_token_loss(logp_train: torch.Tensor, logp_old: torch.Tensor | None, logp_rollout: torch.Tensor | None,
                    advantages: torch.Tensor, mask: torch.Tensor, *, logp_ref: torch.Tensor | None = None,
                    clip_low: float = 0.2, clip_high: float = 0.2, tis_cap: float | None = 5.0,
                    kl_beta: float = 0.0, ratio_level: str = "token", clip_c: float | None = None) -> torch.Tensor:
    """Per-token GRPO loss [B, T] (zero outside mask); see the module docstring for the formula.

    logp_old None = on-policy (logp_train detached, rho = 1 with gradient). logp_rollout None or tis_cap None =
    no TIS (w = 1). advantages: [B] per response or [B, T]. logp_ref is needed when kl_beta > 0.
    ratio_level "sequence": GSPO (Zheng et al. 2025): the clipped surrogate of the sequence-level ratio (see
    :func:`policy_ratio`), counted once per sequence: each of its |y| tokens carries 1/|y| of it, so a sequence's
    tokens share its update equally whatever its length (the GSPO paper's objective; slime's default per-sample loss
    and verl's seq-mean-token-mean give the same). TIS weights and the KL term stay per token.
    """
    m, lt, lo, lr, adv, lref = _prepare(logp_train, logp_old, logp_rollout, advantages, mask, logp_ref)
    rho = policy_ratio(lt, lo, m, ratio_level)
    surr = _surrogate(rho, adv, clip_low, clip_high, clip_c)
    if ratio_level == "sequence":
        surr = surr / m.sum(dim=1, keepdim=True).clamp_min(1).to(surr.dtype)
    if lr is not None and tis_cap is not None:
        surr = surr * tis_weights(lo, lr, tis_cap)
    loss = -surr
    if kl_beta:
        if lref is None:
            raise ValueError("kl_beta > 0 needs logp_ref (the frozen reference policy's logprobs)")
        loss = loss + kl_beta * kl_k3(lt, lref)
    return torch.where(m, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


def grpo_loss(logp_train: torch.Tensor, logp_old: torch.Tensor | None, logp_rollout: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, *, logp_ref: torch.Tensor | None = None,
              clip_low: float = 0.2, clip_high: float = 0.2, tis_cap: float | None = 5.0, kl_beta: float = 0.0,
              num_tokens: int | float | torch.Tensor | None = None, ratio_level: str = "token",
              clip_c: float | None = None) -> torch.Tensor:
    """Scalar GRPO loss: the token losses summed over mask and divided by N (mask.sum() or num_tokens)."""
    tok = grpo_token_loss(logp_train, logp_old, logp_rollout, advantages, mask, logp_ref=logp_ref,
                          clip_low=clip_low, clip_high=clip_high, tis_cap=tis_cap, kl_beta=kl_beta,
                          ratio_level=ratio_level, clip_c=clip_c)
    return tok.sum() / _count(mask.bool(), num_tokens)


@torch.no_grad()
def grpo_metric_tensors(logp_train: torch.Tensor, logp_old: torch.Tensor | None, logp_rollout: torch.Tensor | None,
                        advantages: torch.Tensor, mask: torch.Tensor, *, logp_ref: torch.Tensor | None = None,
                        entropy: torch.Tensor | None = None, clip_low: float = 0.2, clip_high: float = 0.2,
                        tis_cap: float | None = 5.0, kl_beta: float = 0.0, ratio_level: str = "token",
                        clip_c: float | None = None) -> dict[str, torch.Tensor]:
    """:func:`grpo_metrics` as 0-dim fp32 tensors on the inputs' device: no host sync (what the training loop
    calls per micro-batch; it reads them once per step)."""
    m, lt, lo, lr, adv, lref = _prepare(logp_train, logp_old, logp_rollout, advantages, mask, logp_ref)
    mf = m.to(torch.float32)
    n = mf.sum().clamp_min(1.0)

    def mean(x):
        return (x.to(torch.float32) * mf).sum() / n

    def masked_max(x):  # x >= 0: 0 when nothing is masked in
        return torch.where(m, x, torch.zeros_like(x)).max().to(torch.float32)

    rho = policy_ratio(lt, lo, m, ratio_level)
    clipped = rho.clamp(1.0 - clip_low, 1.0 + clip_high)
    out = {
        "num_tokens": mf.sum(),
        "ppo_clip_frac": mean(-adv * clipped > -adv * rho),
        "ppo_clip_frac_low": mean((rho < 1.0 - clip_low) & (adv < 0)),
        "ppo_clip_frac_high": mean((rho > 1.0 + clip_high) & (adv > 0)),
        "ratio_mean": mean(rho),
        "ratio_max": masked_max(rho),
        "advantage_mean": mean(adv),
        "loss": (grpo_token_loss(logp_train, logp_old, logp_rollout, advantages, mask, logp_ref=logp_ref,
                                 clip_low=clip_low, clip_high=clip_high, tis_cap=tis_cap,
                                 kl_beta=kl_beta if logp_ref is not None else 0.0,
                                 ratio_level=ratio_level, clip_c=clip_c).sum() / n).to(torch.float32),
    }
    if clip_c is not None:  # verl's pg_clipfrac_lower: tokens whose loss the dual clip bounds (no gradient)
        out["ppo_dual_clip_frac"] = mean((adv < 0) & (torch.maximum(rho, clipped) > clip_c))
    if lr is not None:
        raw = torch.exp(lo - lr)
        diff = (lt - lr).abs()
        out["logp_abs_diff_mean"] = mean(diff)
        out["logp_abs_diff_max"] = masked_max(diff)
        out["tis_weight_mean"] = mean(raw.clamp(max=tis_cap) if tis_cap is not None else raw)
        out["tis_clip_frac"] = mean(raw > tis_cap) if tis_cap is not None else torch.zeros_like(n)
    if lref is not None:
        out["kl_mean"] = mean(kl_k3(lt, lref))
    if entropy is not None:
        out["entropy_mean"] = mean(entropy.detach())
    return out


def grpo_metrics(logp_train: torch.Tensor, logp_old: torch.Tensor | None, logp_rollout: torch.Tensor | None,
                 advantages: torch.Tensor, mask: torch.Tensor, **kwargs) -> dict[str, float]:
    """Masked-mean diagnostics of one (micro-)batch as python floats (keyword arguments as
    :func:`grpo_metric_tensors`, which returns them as tensors without a host sync).

    ppo_clip_frac: tokens where the clipped surrogate is the one used (its gradient is zero), split into
    ppo_clip_frac_low (rho < 1 - eps_low, A < 0) and ppo_clip_frac_high (rho > 1 + eps_high, A > 0);
    ppo_dual_clip_frac (with clip_c): tokens with A < 0 whose surrogate the dual clip raised to c * A;
    tis_clip_frac: tokens whose importance weight hit the cap; kl_mean: k3 KL to the reference;
    logp_abs_diff_mean / _max: |logp_train - logp_rollout| (train-rollout mismatch); entropy_mean when given.
    """
    t = grpo_metric_tensors(logp_train, logp_old, logp_rollout, advantages, mask, **kwargs)
    return dict(zip(t, torch.stack(list(t.values())).tolist()))


@torch.no_grad()
def rollout_metrics(rewards: torch.Tensor, response_lengths: torch.Tensor, truncated: torch.Tensor,
                    group_size: int) -> dict[str, float]:
    """Reward mean/std, accuracy (reward >= 1), response length mean/max, truncated ratio, group statistics."""
    r = rewards.detach().to(torch.float32).flatten()
    g = _grouped(r, group_size)
    lengths = response_lengths.detach().to(torch.float32).flatten()
    return {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(unbiased=False)),
        "accuracy": float((r >= 1.0).to(torch.float32).mean()),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "truncated_ratio": float(truncated.detach().to(torch.float32).mean()),
        "groups_all_equal_frac": float((~dynamic_sampling_keep(g)).to(torch.float32).mean()),
        "groups_all_correct_frac": float((g >= 1.0).all(dim=1).to(torch.float32).mean()),
        "groups_all_wrong_frac": float((g < 1.0).all(dim=1).to(torch.float32).mean()),
    }


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens) [B, T] from logits [B, T, V] (log_softmax in fp32); logits[:, t] must predict tokens[:, t].

    The reference: it holds a [B, T, V] fp32 copy. The actor computes the same from vocab-parallel logits in chunks
    (:func:`megatron_fp4.rl.logprobs.vocab_parallel_logprobs`; bit for bit this at TP = 1)."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy [B, T] of the categorical distribution given by logits [B, T, V] (fp32); the reference
    of :func:`megatron_fp4.rl.logprobs.vocab_parallel_entropy`."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
