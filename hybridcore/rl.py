"""RL math as pure tensor functions: no models, no state, tested against hand-computed values.

Shapes: [batch, T] over response tokens, with `mask` 1 on real tokens and 0 on padding. Sequences are
ragged: each row's real tokens are a prefix (right padding), as rollouts produce them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean over the real tokens only (clamped so an all-padding batch gives 0, not NaN)."""
    return masked_sum(x, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_sum((x - mean) ** 2, mask) / n.clamp(min=1)
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  reduce=None) -> torch.Tensor:
    """Zero mean, unit variance over real tokens; padding stays 0 so it cannot leak into losses.

    reduce: sums a tensor over the data-parallel ranks, so that mean and variance are those of the global batch."""
    if reduce is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    else:
        n = reduce(mask.sum())
        mean = reduce(masked_sum(x, mask)) / n.clamp(min=1)
        var = reduce(masked_sum((x - mean) ** 2, mask)) / n.clamp(min=1)
        if n > 1:
            var = var * n / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over ragged sequences.

    The value after a sequence's last real token is 0 (the episode ends there), so padding never
    bootstraps. Returns (advantages, returns), both zero on padding.
    """
    mask = mask.to(values.dtype)
    T = rewards.shape[1]
    adv = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])
    for t in reversed(range(T)):
        next_v = values[:, t + 1] * mask[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        adv[:, t] = last
    return adv, (adv + values) * mask


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's k1/k2/k3)."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":  # unbiased and always >= 0
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl estimator must be k1, k2 or k3, got {estimator!r}")


def policy_loss(logp, old_logp, advantages, mask, clip: float, agg: str = "token_mean"):
    """PPO's clipped surrogate, reduced by `agg` (see aggregate). Returns (loss, clip fraction, approximate KL
    old->new); the last two are token means whatever `agg` says."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    loss = aggregate(torch.maximum(unclipped, clipped), mask, agg)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    approx_kl = masked_mean(0.5 * (logp - old_logp) ** 2, mask)
    return loss, clipfrac, approx_kl


def value_loss(values, old_values, returns, mask, clip: float):
    """Clipped value loss: the new value may move at most `clip` from the rollout's before the loss stops
    rewarding it. Returns (loss, clip fraction)."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(loss_unclipped, loss_clipped), mask)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    return loss, clipfrac


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) in float32, one row at a time so a [batch, T, vocab] float32 copy never exists."""
    out = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
    for i in range(logits.shape[0]):
        row = logits[i].float()
        out[i] = row.gather(-1, labels[i].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(row, dim=-1)
    return out


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of the softmax, in float32."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns): 1 is a perfect critic, 0 no better than a constant."""
    var_r = masked_var(returns, mask)
    return 1 - masked_var(returns - values, mask) / var_r.clamp(min=1e-8)


# ---------------------------------------------------------------------------------------------- critic-free estimators
# Sequence-level scores [B] with the N responses of one prompt contiguous (rows g*N .. g*N+N-1 are group g).

def group_advantages(scores: torch.Tensor, n: int, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each score minus its group's mean, divided by the group's (unbiased) std unless scale=False (Dr.
    GRPO's form). A group whose scores are all equal gets 0 everywhere."""
    g = _groups(scores, n)
    adv = g - g.mean(1, keepdim=True)
    if scale:
        adv = adv / (g.std(1, keepdim=True) + eps)
    return adv.reshape(-1)


def leave_one_out_advantages(scores: torch.Tensor, n: int) -> torch.Tensor:
    """RLOO: each score minus the mean of the other N-1 scores of its group (= N/(N-1) x its distance from the
    group mean)."""
    g = _groups(scores, n)
    others = (g.sum(1, keepdim=True) - g) / (n - 1)
    return (g - others).reshape(-1)


def _groups(scores: torch.Tensor, n: int) -> torch.Tensor:
    if n < 2 or scores.numel() % n:
        raise ValueError(f"group estimators need >= 2 samples per prompt and whole groups; got {scores.numel()} "
                         f"scores in groups of {n}")
    return scores.float().reshape(-1, n)


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, reduce=None) -> torch.Tensor:
    """REINFORCE++: per-token returns (the undiscounted sum of the rewards from each token to the end: the RM score
    on the last token, -kl_coef x KL on every token) whitened over the whole batch; zero on padding."""
    mask = mask.to(rewards.dtype)
    returns = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1]) * mask
    return masked_whiten(returns, mask, reduce=reduce)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean") -> torch.Tensor:
    """A per-token loss reduced to one number. token_mean: every real token of the batch weighs the same (DAPO's
    token-level form; long responses count in proportion to their length); seq_mean: each sequence's own token
    mean, then the mean over sequences (GRPO's original form)."""
    if mode == "token_mean":
        return masked_mean(per_token, mask)
    if mode == "seq_mean":
        return masked_mean(per_token, mask, dim=1).mean()
    raise ValueError(f"loss aggregation must be token_mean or seq_mean, got {mode!r}")


def dpo_loss(chosen_logp: torch.Tensor, rejected_logp: torch.Tensor, ref_chosen_logp: torch.Tensor,
             ref_rejected_logp: torch.Tensor, beta: float, kind: str = "sigmoid"):
    """DPO over summed response log-probs [B]: with h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)),
    sigmoid: -log sigmoid(beta h) (Rafailov et al.); ipo: (h - 1/(2 beta))^2 (Azar et al.). Returns (mean loss,
    chosen rewards beta (log pi(c) - log ref(c)), rejected rewards, the fraction of rows whose chosen reward is
    the higher)."""
    chosen = beta * (chosen_logp - ref_chosen_logp)
    rejected = beta * (rejected_logp - ref_rejected_logp)
    h = (chosen - rejected) / beta
    if kind == "sigmoid":
        loss = -F.logsigmoid(beta * h)
    elif kind == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo.loss must be sigmoid or ipo, got {kind!r}")
    return loss.mean(), chosen.detach(), rejected.detach(), (chosen > rejected).float().mean()
