"""PPO's advantage estimators, one small class each, chosen once from ppo.estimator (ESTIMATORS).

gae learns a critic (values per token); grpo, rloo and reinforce_pp need none, so the stage builds no critic for
them at all. Each turns a rollout's sequence scores [B] and per-token KL to the reference [B, T] into advantages
[B, T] (zero on padding). With ppo.kl_in_loss the KL stays out of the reward (the policy loss carries it instead).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from hybridcore import rl
from hybridcore.forward import batched, response_values
from hybridcore.parallel import current as layout_now, dp_sum


def kl_weight(cfg) -> float:
    """How much the per-token KL weighs in the reward: none when the loss carries it (ppo.kl_in_loss)."""
    return 0.0 if cfg.kl_in_loss else cfg.kl_coef


def token_rewards(cfg, scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-kl_coef x KL on every response token, the sequence's score added on its last one."""
    rewards = -kl_weight(cfg) * kl
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(scores), device=rewards.device), last] += scores
    return rewards


def batch_reduce():
    """Whitening statistics over the global batch: sums over the data-parallel ranks when there are several."""
    return dp_sum if layout_now().layout.dp > 1 else None


class Estimator(ABC):
    critic = False  # whether the stage builds, trains and checkpoints a critic for it

    def __init__(self, cfg):
        self.cfg = cfg

    def values(self, m, batch, micro: int):
        """The critic's values of the rollout ([B, T]), None for the critic-free estimators."""
        return None

    @abstractmethod
    def advantages(self, scores, kl, mask, values) -> dict:
        """{"advantages": [B, T], and what the updates need besides (gae: "values", "returns")}."""

    def metrics(self, exp: dict) -> dict[str, float]:
        return {}


class Gae(Estimator):
    """PPO's own: a learned critic, GAE over per-token rewards, advantages whitened over the batch."""
    critic = True

    def values(self, m, batch, micro: int):
        with m.use("critic"):
            return batched(response_values, m.critic, batch, micro)

    def advantages(self, scores, kl, mask, values) -> dict:
        """Every row at once: the deferred form (below) filled from the scoring forward's values and whitened."""
        exp = {"mask": mask, **self.deferred(scores, kl, mask)}
        self.fill(exp, slice(None), values)
        self.whiten(exp)
        return {k: exp[k] for k in ("values", "returns", "advantages")}

    def deferred(self, scores, kl, mask) -> dict:
        """advantages' stand-in when the critic's update pass supplies the values (PpoStep.values_from_update): the
        token rewards, and the values, returns and unwhitened advantages that `fill` writes row by row."""
        zeros = torch.zeros_like(mask)
        return {"rewards": token_rewards(self.cfg, scores, kl, mask), "values": zeros, "returns": zeros.clone(),
                "raw_advantages": zeros.clone()}

    def fill(self, exp: dict, idx, values: torch.Tensor) -> None:
        """Rows idx of a deferred exp from the critic's own forward: its values (detached), GAE's returns and
        advantages; `whiten` ends it once every row is in."""
        mask = exp["mask"][idx]
        values = values.detach().float() * mask
        adv, returns = rl.gae(exp["rewards"][idx], values, mask, self.cfg.gamma, self.cfg.lam)
        exp["values"][idx], exp["returns"][idx], exp["raw_advantages"][idx] = values, returns, adv

    def whiten(self, exp: dict) -> None:
        exp["advantages"] = rl.masked_whiten(exp.pop("raw_advantages"), exp["mask"], reduce=batch_reduce())

    def metrics(self, exp: dict) -> dict[str, float]:
        return {"explained_variance": float(rl.explained_variance(exp["values"], exp["returns"], exp["mask"]))}


class Grpo(Estimator):
    """Each response against the other responses to its prompt (the group), one advantage per response broadcast to
    its tokens. The KL in the reward, as verl does it: the sequence's reward is score - kl_coef x its summed KL, and
    the group statistics are taken of that (OpenRLHF instead normalises the bare scores and adds the KL per token)."""

    def sequence_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return rl.group_advantages(rewards, self.cfg.samples_per_prompt, scale=self.cfg.scale_rewards)

    def advantages(self, scores, kl, mask, values) -> dict:
        rewards = scores - kl_weight(self.cfg) * kl.sum(1)
        return {"advantages": self.sequence_advantages(rewards).unsqueeze(1) * mask}


class Rloo(Grpo):
    """Each response against the mean of the other N-1 responses to its prompt (REINFORCE leave-one-out)."""

    def sequence_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return rl.leave_one_out_advantages(rewards, self.cfg.samples_per_prompt)


class ReinforcePP(Estimator):
    """REINFORCE++: per-token returns (score on the last token, -kl_coef x KL on each) whitened over the batch;
    any samples_per_prompt (the baseline is the batch's, not a group's)."""

    def advantages(self, scores, kl, mask, values) -> dict:
        return {"advantages": rl.reinforce_pp_advantages(token_rewards(self.cfg, scores, kl, mask), mask,
                                                         reduce=batch_reduce())}


ESTIMATORS: dict[str, type[Estimator]] = {"gae": Gae, "grpo": Grpo, "rloo": Rloo, "reinforce_pp": ReinforcePP}


def of(cfg) -> Estimator:
    return ESTIMATORS[cfg.estimator](cfg)
