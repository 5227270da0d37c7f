"""Unit tests for hybridcore.rl, checked against values worked out by hand (see the comments)."""
import math

import pytest
import torch
from torch.testing import assert_close

from hybridcore import rl

ATOL = dict(atol=1e-5, rtol=0)


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


# Three ragged, right-padded rows (lengths 3, 4, 1); padding holds junk that must be ignored.
REWARDS = t([[1.0, 0.0, 2.0, 5.0], [0.0, 1.0, 0.0, 2.0], [3.0, 9.0, 9.0, 9.0]])
VALUES = t([[0.5, 1.0, 1.0, 7.0], [1.0, 2.0, 0.0, 1.0], [2.0, 4.0, 4.0, 4.0]])
MASK = t([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])


def test_gae_ragged_batch_discounted():
    """GAE with gamma=0.9, lam=0.8 on ragged rows matches the hand recursion; padding is exactly 0."""
    # gamma*lam = 0.72; delta_t = r_t + 0.9 * V_{t+1} - V_t, with V after the last real token = 0.
    # row 0: d2 = 2 - 1 = 1            -> A2 = 1
    #        d1 = 0 + 0.9*1 - 1 = -0.1 -> A1 = -0.1 + 0.72*1 = 0.62
    #        d0 = 1 + 0.9*1 - 0.5 = 1.4 -> A0 = 1.4 + 0.72*0.62 = 1.8464
    # row 1: d3 = 2 - 1 = 1            -> A3 = 1
    #        d2 = 0 + 0.9*1 - 0 = 0.9  -> A2 = 0.9 + 0.72*1 = 1.62
    #        d1 = 1 + 0.9*0 - 2 = -1   -> A1 = -1 + 0.72*1.62 = 0.1664
    #        d0 = 0 + 0.9*2 - 1 = 0.8  -> A0 = 0.8 + 0.72*0.1664 = 0.919808
    # row 2: d0 = 3 - 2 = 1 (no bootstrap from the padded V=4) -> A0 = 1
    # returns = A + V on real tokens: row 0 [2.3464, 1.62, 2], row 1 [1.919808, 2.1664, 1.62, 2], row 2 [3]
    adv, ret = rl.gae(REWARDS, VALUES, MASK, gamma=0.9, lam=0.8)
    assert_close(adv, t([[1.8464, 0.62, 1.0, 0.0], [0.919808, 0.1664, 1.62, 1.0], [1.0, 0.0, 0.0, 0.0]]), **ATOL)
    assert_close(ret, t([[2.3464, 1.62, 2.0, 0.0], [1.919808, 2.1664, 1.62, 2.0], [3.0, 0.0, 0.0, 0.0]]), **ATOL)
    pad = MASK == 0
    assert torch.all(adv[pad] == 0) and torch.all(ret[pad] == 0)


def test_gae_undiscounted_is_reward_to_go_minus_value():
    """With gamma=lam=1, advantages are reward-to-go minus value and returns are reward-to-go."""
    # row 0: rewards [1, 0, 2] -> reward-to-go [3, 2, 2]; minus V [0.5, 1, 1] -> [2.5, 1, 1]
    # row 1: rewards [0, 1, 0, 2] -> [3, 3, 2, 2]; minus V [1, 2, 0, 1] -> [2, 1, 2, 1]
    # row 2: rewards [3] -> [3]; minus V [2] -> [1]
    adv, ret = rl.gae(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0)
    assert_close(adv, t([[2.5, 1.0, 1.0, 0.0], [2.0, 1.0, 2.0, 1.0], [1.0, 0.0, 0.0, 0.0]]), **ATOL)
    assert_close(ret, t([[3.0, 2.0, 2.0, 0.0], [3.0, 3.0, 2.0, 2.0], [3.0, 0.0, 0.0, 0.0]]), **ATOL)


# Real tokens 1, 2, 3 | 6: mean 12/4 = 3; deviations -2, -1, 0, 3; squares sum 14;
# unbiased var 14/3 = 4.6666667; biased 14/4 = 3.5; 1/std = sqrt(3/14) = 0.46291005.
X_MASK = t([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize("pad", [1000.0, -5.0])
def test_masked_mean_and_var(pad):
    """masked_mean (global and per-row) and masked_var ignore padded values entirely."""
    x = t([[1.0, 2.0, 3.0, pad], [6.0, pad, pad, pad]])
    assert_close(rl.masked_mean(x, X_MASK), t(3.0), **ATOL)
    assert_close(rl.masked_mean(x, X_MASK, dim=1), t([2.0, 6.0]), **ATOL)  # (1+2+3)/3, 6/1
    assert_close(rl.masked_var(x, X_MASK), t(14.0 / 3.0), **ATOL)
    assert_close(rl.masked_var(x, X_MASK, unbiased=False), t(3.5), **ATOL)


def test_masked_mean_all_padding_is_zero():
    """An all-padding mask gives a mean of 0 rather than NaN."""
    assert_close(rl.masked_mean(t([[4.0, 5.0]]), t([[0, 0]])), t(0.0), **ATOL)


@pytest.mark.parametrize("pad", [1000.0, -5.0])
def test_masked_whiten(pad):
    """Whitened real tokens are (x-3)*sqrt(3/14) with mean 0 and unbiased var 1; padding is 0."""
    x = t([[1.0, 2.0, 3.0, pad], [6.0, pad, pad, pad]])
    # (1-3)*0.46291005 = -0.9258201, (2-3)* = -0.46291005, 0, (6-3)* = 1.38873015
    expected = t([[-0.9258201, -0.46291005, 0.0, 0.0], [1.38873015, 0.0, 0.0, 0.0]])
    out = rl.masked_whiten(x, X_MASK)
    assert_close(out, expected, **ATOL)
    assert torch.all(out[X_MASK == 0] == 0)
    assert_close(rl.masked_mean(out, X_MASK), t(0.0), **ATOL)
    assert_close(rl.masked_var(out, X_MASK), t(1.0), **ATOL)
    # shift_mean=False adds the mean (3) back on real tokens only
    kept = rl.masked_whiten(x, X_MASK, shift_mean=False)
    assert_close(kept, t([[2.0741799, 2.53708995, 3.0, 0.0], [4.38873015, 0.0, 0.0, 0.0]]), **ATOL)


def test_kl_penalty_estimators():
    """k1, k2, k3 on log-ratios 0.5, -0.2, 0 match hand values; k3 is non-negative."""
    logp = t([-1.0, -1.5, -2.0])
    ref_logp = t([-1.5, -1.3, -2.0])  # log-ratio x = [0.5, -0.2, 0]
    assert_close(rl.kl_penalty(logp, ref_logp, "k1"), t([0.5, -0.2, 0.0]), **ATOL)
    # k2 = x^2 / 2 = [0.125, 0.02, 0]
    assert_close(rl.kl_penalty(logp, ref_logp, "k2"), t([0.125, 0.02, 0.0]), **ATOL)
    # k3 = exp(-x) - 1 + x: exp(-0.5) = 0.60653066 -> 0.10653066; exp(0.2) = 1.22140276 -> 0.02140276; 0
    k3 = rl.kl_penalty(logp, ref_logp, "k3")
    assert_close(k3, t([0.10653066, 0.02140276, 0.0]), **ATOL)
    assert torch.all(k3 >= 0)
    assert_close(rl.kl_penalty(logp, ref_logp), t([0.5, -0.2, 0.0]), **ATOL)  # default is k1


def test_kl_penalty_unknown_estimator_raises():
    """An unknown estimator name raises ValueError."""
    with pytest.raises(ValueError):
        rl.kl_penalty(t([0.0]), t([0.0]), "k4")


def test_policy_loss_clipping():
    """PPO loss, clip fraction and approx KL on a mix of clipped/unclipped tokens, clip=0.2."""
    ratios = [1.5, 0.5, 1.1, 0.7, 1.5, 3.0]  # last token is padding
    old_logp = t([[-1.0] * 6])
    logp = old_logp + t([[math.log(r) for r in ratios]])
    adv = t([[1.0, -1.0, 2.0, 1.0, -1.0, 5.0]])
    mask = t([[1, 1, 1, 1, 1, 0]])
    # per token: unclipped -A*r, clipped -A*clamp(r, 0.8, 1.2), loss term = max of the two
    # r=1.5, A=+1: -1.5 vs -1.2 -> -1.2 (clipped)
    # r=0.5, A=-1:  0.5 vs  0.8 ->  0.8 (clipped)
    # r=1.1, A=+2: -2.2 vs -2.2 -> -2.2 (inside the range, not clipped)
    # r=0.7, A=+1: -0.7 vs -0.8 -> -0.7 (not clipped: pessimistic side)
    # r=1.5, A=-1:  1.5 vs  1.2 ->  1.5 (not clipped: pessimistic side)
    # loss = (-1.2 + 0.8 - 2.2 - 0.7 + 1.5) / 5 = -1.8 / 5 = -0.36; clipfrac = 2/5 = 0.4
    # approx_kl = mean(0.5 * ln(r)^2): ln r = 0.40546511, -0.69314718, 0.09531018, -0.35667494, 0.40546511
    #   squares 0.16440195, 0.48045301, 0.00908403, 0.12721702, 0.16440195 -> sum 0.94555796
    #   -> 0.5 * 0.94555796 / 5 = 0.09455580
    loss, clipfrac, approx_kl = rl.policy_loss(logp, old_logp, adv, mask, clip=0.2)
    assert_close(loss, t(-0.36), **ATOL)
    assert_close(clipfrac, t(0.4), **ATOL)
    assert_close(approx_kl, t(0.0945558), **ATOL)


def test_policy_loss_on_policy_is_minus_mean_advantage():
    """With ratio 1 everywhere the loss is -mean(A) over real tokens and nothing is clipped."""
    logp = t([[-0.3, -2.0, -1.0]])
    adv = t([[2.0, -0.5, 100.0]])
    mask = t([[1, 1, 0]])
    loss, clipfrac, approx_kl = rl.policy_loss(logp, logp.clone(), adv, mask, clip=0.2)
    assert_close(loss, t(-0.75), **ATOL)  # -(2 - 0.5) / 2
    assert_close(clipfrac, t(0.0), **ATOL)
    assert_close(approx_kl, t(0.0), **ATOL)


def test_value_loss_clipping():
    """Clipped value loss and clip fraction on a mix of tokens, clip=0.2."""
    values = t([[1.5, 1.5, 0.1, 1.0, 100.0]])
    old_values = t([[1.0, 1.0, 0.0, 2.0, 0.0]])
    returns = t([[2.0, 1.0, 1.0, 0.0, -50.0]])
    mask = t([[1, 1, 1, 1, 0]])
    # clipped V = old + clamp(new - old, -0.2, 0.2); terms (V - R)^2, take the max
    # tok0: Vc = 1.2; unclipped (1.5-2)^2 = 0.25, clipped (1.2-2)^2 = 0.64 -> 0.64 (clipped)
    # tok1: Vc = 1.2; unclipped (1.5-1)^2 = 0.25, clipped (1.2-1)^2 = 0.04 -> 0.25
    # tok2: Vc = 0.1 (inside); both (0.1-1)^2 = 0.81 -> 0.81
    # tok3: Vc = 1.8; unclipped (1-0)^2 = 1, clipped (1.8-0)^2 = 3.24 -> 3.24 (clipped)
    # loss = 0.5 * (0.64 + 0.25 + 0.81 + 3.24) / 4 = 0.5 * 4.94 / 4 = 0.6175; clipfrac = 2/4 = 0.5
    loss, clipfrac = rl.value_loss(values, old_values, returns, mask, clip=0.2)
    assert_close(loss, t(0.6175), **ATOL)
    assert_close(clipfrac, t(0.5), **ATOL)


def test_token_logprobs_hand_log_softmax():
    """token_logprobs matches a hand log-softmax over a 3-token vocab."""
    ln2, ln3 = math.log(2.0), math.log(3.0)
    # logits [0, ln2, ln3] -> softmax [1, 2, 3] / 6
    # logits [7+ln3, 7, 7] -> softmax [3, 1, 1] / 5 (shift-invariant); [1, 1, 1] -> uniform 1/3
    logits = t([[[0.0, ln2, ln3], [0.0, ln2, ln3]], [[7.0 + ln3, 7.0, 7.0], [1.0, 1.0, 1.0]]])
    labels = torch.tensor([[0, 2], [0, 1]])
    # log(1/6) = -1.79175947, log(3/6) = -0.69314718, log(3/5) = -0.51082562, log(1/3) = -1.09861229
    out = rl.token_logprobs(logits, labels)
    assert out.dtype == torch.float32 and out.shape == (2, 2)
    assert_close(out, t([[-1.79175947, -0.69314718], [-0.51082562, -1.09861229]]), **ATOL)


def test_token_logprobs_bf16_computed_in_float32():
    """bf16 logits give a float32 result computed in float32 (logsumexp of 100s stays exact)."""
    # softmax of 4 equal logits is 1/4 -> log(1/4) = -1.38629436; in bf16, 100 + ln4 = 101.386 would
    # round to 101.5 and give an error of ~0.11, so this checks the upcast.
    logits = torch.full((2, 3, 4), 100.0, dtype=torch.bfloat16)
    labels = torch.tensor([[0, 1, 2], [3, 0, 1]])
    out = rl.token_logprobs(logits, labels)
    assert out.dtype == torch.float32
    assert_close(out, torch.full((2, 3), -1.38629436), **ATOL)


def test_entropy_from_logits():
    """Uniform logits over V=5 give ln 5; one dominant logit gives ~0; output is float32."""
    uniform = torch.zeros(2, 3, 5, dtype=torch.bfloat16)
    ent = rl.entropy_from_logits(uniform)
    assert ent.dtype == torch.float32 and ent.shape == (2, 3)
    assert_close(ent, torch.full((2, 3), 1.60943791), **ATOL)  # ln 5
    assert_close(rl.entropy_from_logits(t([[3.0] * 5])), t([1.60943791]), **ATOL)
    # [50, 0, 0, 0]: the other tokens have p ~ e^-50, entropy ~ 4 * 50 * e^-50 ~ 0
    peaked = t([[50.0, 0.0, 0.0, 0.0]])
    assert_close(rl.entropy_from_logits(peaked), t([0.0]), atol=1e-6, rtol=0)


def test_explained_variance():
    """Perfect values give 1, the constant mean of returns gives 0, a near miss gives 0.85."""
    returns = t([[1.0, 2.0, 3.0, 1000.0], [4.0, -1000.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert_close(rl.explained_variance(returns.clone(), returns, mask), t(1.0), **ATOL)
    # mean of real returns (1, 2, 3, 4) is 2.5; padded values are junk
    const = t([[2.5, 2.5, 2.5, 7.0], [2.5, 7.0, 7.0, 7.0]])
    assert_close(rl.explained_variance(const, returns, mask), t(0.0), **ATOL)
    # values [1, 2, 3, 3]: residuals [0, 0, 0, 1] -> mean 0.25, sq devs 3*0.0625 + 0.5625 = 0.75,
    # unbiased var 0.25; Var(returns) = (2.25+0.25+0.25+2.25)/3 = 5/3; EV = 1 - 0.25/(5/3) = 0.85
    near = t([[1.0, 2.0, 3.0, -9.0], [3.0, 9.0, 9.0, 9.0]])
    assert_close(rl.explained_variance(near, returns, mask), t(0.85), **ATOL)


# ---------------------------------------------------------------------------------------------- critic-free estimators

def test_group_advantages_by_hand():
    """GRPO, groups of 3: [1, 2, 3] has mean 2 and unbiased std 1 -> [-1, 0, 1]; [5, 5, 5] has no spread -> 0."""
    scores = t([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    assert_close(rl.group_advantages(scores, 3), t([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]), **ATOL)
    # unscaled, groups of 2: [0, 4] -> mean 2 -> [-2, 2], [1, 1] -> 0; scaled: std of [0, 4] = 2.828 -> +-0.7071
    assert_close(rl.group_advantages(t([0.0, 4.0, 1.0, 1.0]), 2, scale=False), t([-2.0, 2.0, 0.0, 0.0]), **ATOL)
    assert_close(rl.group_advantages(t([0.0, 4.0]), 2), t([-1 / math.sqrt(2), 1 / math.sqrt(2)]), **ATOL)


def test_leave_one_out_baselines_by_hand():
    """RLOO: each score minus the mean of the others in its group."""
    # groups of 2: [1, 2] -> 1-2, 2-1; [3, 6] -> 3-6, 6-3
    assert_close(rl.leave_one_out_advantages(t([1.0, 2.0, 3.0, 6.0]), 2), t([-1.0, 1.0, -3.0, 3.0]), **ATOL)
    # one group of 3: 1-(2+6)/2 = -3, 2-(1+6)/2 = -1.5, 6-(1+2)/2 = 4.5
    assert_close(rl.leave_one_out_advantages(t([1.0, 2.0, 6.0]), 3), t([-3.0, -1.5, 4.5]), **ATOL)


@pytest.mark.parametrize("fn", [rl.group_advantages, rl.leave_one_out_advantages])
def test_group_estimators_refuse_single_samples_and_ragged_groups(fn):
    with pytest.raises(ValueError, match=">= 2 samples per prompt"):
        fn(t([1.0, 2.0]), 1)
    with pytest.raises(ValueError, match="groups of 2"):
        fn(t([1.0, 2.0, 3.0]), 2)


def test_reinforce_pp_advantages_by_hand():
    """Returns = sum of rewards from each token to the end: row 0 [0.1, -0.2, 1.0 | pad] -> [0.9, 0.8, 1.0],
    row 1 [0.5 | pad] -> [0.5]; whitened over the four real tokens: mean 0.8, unbiased std sqrt(0.14 / 3) =
    0.216025 -> [0.46291, 0, 0.92582] and [-1.38873]; padding 0 (its junk reward 9 never counts)."""
    rewards = t([[0.1, -0.2, 1.0, 9.0], [0.5, 9.0, 9.0, 9.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    want = t([[0.46291, 0.0, 0.92582, 0.0], [-1.38873, 0.0, 0.0, 0.0]])
    assert_close(rl.reinforce_pp_advantages(rewards, mask), want, atol=1e-4, rtol=0)


def test_loss_aggregation_by_hand():
    """token_mean: (1 + 2 + 3 + 4) / 4 = 2.5; seq_mean: mean(2, 4) = 3."""
    per_token = t([[1.0, 2.0, 3.0, 7.0], [4.0, 7.0, 7.0, 7.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert_close(rl.aggregate(per_token, mask, "token_mean"), t(2.5), **ATOL)
    assert_close(rl.aggregate(per_token, mask, "seq_mean"), t(3.0), **ATOL)
    with pytest.raises(ValueError, match="token_mean or seq_mean"):
        rl.aggregate(per_token, mask, "sum")


def test_dpo_loss_by_hand():
    """beta 0.5; chosen rewards 0.5 x ([-1, -2] - [-2, -2]) = [0.5, 0], rejected 0.5 x ([-3, -1] - [-2, -2]) =
    [-0.5, 0.5]; h = (chosen - rejected) / beta = [2, -1]. sigmoid: -log sigmoid([1, -0.5]) = [0.313262, 0.974077],
    mean 0.643670; ipo: (h - 1)^2 = [1, 4], mean 2.5; accuracy 1 of 2."""
    args = (t([-1.0, -2.0]), t([-3.0, -1.0]), t([-2.0, -2.0]), t([-2.0, -2.0]), 0.5)
    loss, chosen, rejected, acc = rl.dpo_loss(*args)
    assert_close(loss, t(0.643670), **ATOL)
    assert_close(chosen, t([0.5, 0.0]), **ATOL)
    assert_close(rejected, t([-0.5, 0.5]), **ATOL)
    assert_close(acc, t(0.5), **ATOL)
    assert_close(rl.dpo_loss(*args, kind="ipo")[0], t(2.5), **ATOL)
    with pytest.raises(ValueError, match="sigmoid or ipo"):
        rl.dpo_loss(*args, kind="hinge")
