"""PPO: the actor (from SFT) learns from rewards on its own responses, held near a frozen reference.

Per rollout batch: each picked prompt answered ppo.samples_per_prompt times by the actor's own weights (the hybrid
actor, no copy); each response rewarded (stages/rewards.py: the RM's score and/or the user's reward function); old
and reference log-probs without autograd; advantages by ppo.estimator (stages/estimators.py: gae with a learned
critic, or the critic-free grpo, rloo and reinforce_pp); then ppo_epochs over minibatches of the clipped policy
update (and, with gae, the clipped value update). gae's critic is the RM's backbone and score head applied per
token (or a fresh head on the SFT model); a critic-free run builds no critic at all.

With engine.share_base the trained roles are LoRA adapters on one frozen base and the reference is that base with
the adapters off (hybridcore/shared_base.py); `Models.use(role)` picks which one computes.
"""
from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Optional

import torch

from hybridcore import rl
from hybridcore.actor import HybridActor
from hybridcore.adapters import LoraSpec, add_lora, adapter_parameters, use_adapter
from hybridcore.batch import pack
from hybridcore.forward import batched, response_logprobs, response_logprobs_entropy, response_values
from hybridcore.errors import say
from hybridcore.freezing import TrainableState, assert_frozen
from hybridcore.ledger import MemoryLedger
from hybridcore.models import DTYPES, load_tokenizer, park, resident, set_activation_checkpointing
from hybridcore.oom import OomBackoff
from hybridcore.parallel import current as layout_now, dp_mean, dp_share, dp_sum
from hybridcore.shared_base import SharedBase, value_head
from hybridcore.interrupts import fault_active, fault_point
from hybridcore.engine import checkpoint_parts
from stages import estimators
from stages.common import (Resumable, StepLog, check_prompt_room, checkpointed, checkpointing,
                           context_of, export, finite, frozen, load_policy, load_scorer, lora_spec, optimizer_metrics, planned,
                           role_precision, seed_all, tp_split, trainer, with_lora)
from stages.params import fusable_4bit_decode
from stages.rewards import Responses, Rewards


def prompt_stream(n: int, size: int, seed: int):
    """Endless batches of prompt indices, reshuffled each pass."""
    rng = random.Random(seed)
    while True:
        order = list(range(n))
        rng.shuffle(order)
        for start in range(0, len(order) - size + 1, size):
            yield order[start:start + size]


@dataclass
class Models:
    """PPO's roles: `critic` is None for a critic-free estimator, `rm` None when no reward model scores.
    `actor_params` / `critic_params` are what each optimiser updates and clips (the whole model, or adapters and a
    value head); `peft` is set when the actor has adapters."""
    policy: torch.nn.Module
    ref: torch.nn.Module
    critic: Optional[torch.nn.Module]
    rm: Optional[torch.nn.Module]
    actor_params: object
    critic_params: object
    checkpoint: dict
    peft: object = None
    adapter: str = "default"
    shared: object = None  # SharedBase, or ActorOnBase without a critic
    homes: dict = field(default_factory=dict)   # role -> where an offloaded frozen role's weights live (the CPU)
    moved_in: Callable[[], None] = lambda: None  # called once an offloaded role is on the device (the ledger)

    def use(self, role: str):
        return self.shared.use(role) if self.shared is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def resident(self, role: str, model):
        """`model` on the training device while it scores; back home after when engine.roles.<role>.offload."""
        home = self.homes.get(role)
        with resident(model, self.policy.device, home):
            if home is not None:
                self.moved_in()
            yield

    def roles(self) -> dict[str, torch.nn.Module]:
        """The roles this run has, by name: what the freezing check, the planner and the memory ledger look at."""
        every = {"actor": self.policy, "reference": self.ref, "critic": self.critic, "reward": self.rm}
        return {name: model for name, model in every.items() if model is not None}

    def trained(self) -> dict[str, object]:
        """What each optimiser trains: the actor's parameters, and the critic's when there is one."""
        return {"actor": self.actor_params, **({"critic": self.critic_params} if self.critic is not None else {})}

    def train(self) -> None:
        """Training mode for the trained roles (activation checkpointing applies in training mode only)."""
        for model in (self.policy, self.critic):
            if model is not None:
                model.train()

    def frozen_check(self, optimizers) -> None:
        assert_frozen("ppo", self.roles(), optimizers)


class ActorOnBase:
    """engine.share_base without a critic: the actor's adapter on the frozen base; the reference = adapters off."""
    head = None

    def __init__(self, base, spec: LoraSpec):
        base.requires_grad_(False)
        self.peft = add_lora(base, spec, "engine.roles.actor", "actor")
        self.model = self.peft.get_base_model()
        self.actor_params = TrainableState(adapter_parameters(self.model, "actor"))
        self.model.requires_grad_(False)
        for q in self.actor_params.parameters():
            q.requires_grad_(True)

    def use(self, role: str):
        return use_adapter(self.model, "actor" if role == "actor" else None)


def load_models(p, inputs: dict[str, Path], tok) -> Models:
    """The roles from the SFT (and RM) artifacts: a critic only for an estimator that learns one, the RM only when
    the reward stage ran and its score weighs something (or a shared critic's value head starts from it)."""
    cfg, critic = p.ppo, estimators.ESTIMATORS[p.ppo.estimator].critic
    head_from_rm = critic and p.engine.share_base and cfg.critic_init == "reward"
    rm = None
    if "reward" in inputs and (cfg.reward_model_weight > 0 or head_from_rm):
        rm = frozen(load_scorer(p, inputs["reward"] / "model", "reward", tok.pad_token_id))
    homes = offload_homes(p)
    if rm is not None and "reward" in homes:  # quantised on the device as it loaded, then parked until each scoring
        park(rm, homes["reward"])
    if p.engine.share_base:
        return shared_models(p, inputs, rm, homes, critic)
    return separate_models(p, inputs, tok, rm, homes, critic)


def shared_models(p, inputs: dict[str, Path], rm, homes: dict, critic: bool) -> Models:
    """engine.share_base: the trained roles as adapters on the SFT model, the reference = that base, adapters off."""
    base = load_policy(p, inputs["sft"] / "model", "actor")
    if not critic:
        a = ActorOnBase(base, lora_spec(p, "actor"))
        return Models(a.model, a.model, None, rm, a.actor_params, None, {"actor": a.actor_params}, a.peft, "actor", a,
                      homes)
    head = value_head(base.config.hidden_size, torch.float32,  # on the actor's base; float32 as with_lora's heads
                      rm.score if p.ppo.critic_init == "reward" else None,
                      getattr(base.config, "initializer_range", 0.02), p.pipeline.seed).to(base.device)
    sb = SharedBase(base, lora_spec(p, "actor"), lora_spec(p, "critic"), head)
    return Models(sb.model, sb.model, sb.critic, rm, sb.actor_params, sb.critic_params,
                  {"actor": sb.actor_params, "critic": sb.critic_params}, sb.peft, "actor", sb, homes)


def separate_models(p, inputs: dict[str, Path], tok, rm, homes: dict, critic: bool) -> Models:
    """Each role its own model. tp > 1: the trained roles are split over the tp group; reference and reward stay
    whole (replicated)."""
    sft = inputs["sft"] / "model"
    policy, peft = with_lora(p, tp_split(p, load_policy(p, sft, "actor")), "actor")
    ref = frozen(load_policy(p, sft, "reference"))
    if "reference" in homes:
        ref.to(homes["reference"])
    m = Models(policy, ref, None, rm, policy if peft is None else TrainableState.of(policy), None,
               {"actor": checkpointed(policy, peft)}, peft, homes=homes)
    if critic:
        critic_from = inputs["reward"] / "model" if p.ppo.critic_init == "reward" else sft
        m.critic, critic_peft = with_lora(p, tp_split(p, load_scorer(p, critic_from, "critic", tok.pad_token_id)),
                                          "critic", keep_trainable=("score",))
        m.critic_params = m.critic if critic_peft is None else TrainableState.of(m.critic)
        m.checkpoint["critic"] = checkpointed(m.critic, critic_peft)
    return m


def with_rollout_logprobs(exp: dict, actor) -> dict:
    """exp["rollout_logp"]: each sampled token's log-prob as the rollout computed it (where the backend keeps them),
    beside training's old_logp: PpoStep.metrics logs their mean gap."""
    if actor.last_logprobs is not None:
        exp["rollout_logp"] = torch.zeros_like(exp["old_logp"])
        for i, lp in enumerate(actor.last_logprobs):
            exp["rollout_logp"][i, :len(lp)] = torch.tensor(lp)
    return exp


def offload_homes(p) -> dict:
    """Frozen roles whose weights wait on the CPU between scorings (engine.roles.<role>.offload)."""
    return {role: torch.device("cpu") for role in ("reward", "reference") if getattr(p.engine.roles, role).offload}


def no_phase(name: str):
    """The default `phase` of PpoStep: no memory ledger."""
    return contextlib.nullcontext()


@dataclass
class Pass:
    """One trained role's backward pass over a minibatch: its engine, out-of-memory back-off and statistics."""
    role: str
    engine: object
    backoff: OomBackoff
    stats: tuple[str, ...]  # the first is its loss
    micro_step: Callable


class PpoStep:
    """One PPO iteration's work on a rollout, for run() and bench/: `experience` (log-probs, values, rewards and
    advantages, without autograd), `update` (ppo_epochs of clipped minibatch updates, each trained role's backward
    pass under its own out-of-memory back-off) and `metrics` (what the rollout measured).

    engines: the actor's, then the critic's when the estimator learns one. `ppo:oom:<step>` injects an OOM into the
    actor pass, `ppo:critic:oom:<step>` into the critic pass."""

    def __init__(self, cfg, m: Models, engines: list, rewards: Rewards, micro: int, stops=(),
                 phase: Callable[[str], ContextManager] = no_phase):
        self.cfg, self.m, self.engines, self.rewards, self.micro, self.phase = cfg, m, engines, rewards, micro, phase
        self.stops = torch.tensor(list(stops), dtype=torch.long)
        self.estimator = estimators.of(cfg)
        if len(engines) != 1 + self.estimator.critic:
            raise ValueError(f"ppo.estimator {cfg.estimator} trains {1 + self.estimator.critic} role(s); "
                             f"got {len(engines)} engines")
        actor_stats = ("policy_loss", "clipfrac", "approx_kl", "entropy") + (("kl_loss",) if cfg.kl_in_loss else ())
        self.passes = [Pass("actor", engines[0], OomBackoff("ppo actor", micro, fault="ppo"), actor_stats,
                            self.actor_step),
                       Pass("critic", engines[-1], OomBackoff("ppo critic", micro, fault="ppo:critic"),
                            ("value_loss", "value_clipfrac"), self.critic_step)][:len(engines)]

    def named_engines(self) -> dict:
        """Each trained role's engine under its checkpoint and metrics prefix (actor_, critic_)."""
        return {f"{ps.role}_": ps.engine for ps in self.passes}

    def values_from_update(self, rows: int) -> bool:
        """Whether the critic's values come from its update pass (ppo.values_from_update): a learned critic, one
        epoch, and this rank's `rows` in one minibatch, so the critic's weights are the same in scoring and in its
        pass and the pass's own forward gives the values. Its pass then runs before the actor's, filling in the
        values, returns and advantages (Gae.fill) before the actor needs them; value clipping, around the same
        forward's values, clips nothing (nor does it before one epoch's first step, when the values agree)."""
        cfg = self.cfg
        return (self.estimator.critic and cfg.values_from_update and cfg.ppo_epochs == 1
                and cfg.minibatch_size // layout_now().layout.dp >= rows)

    @torch.no_grad()
    def experience(self, batch, responses: Responses) -> dict:
        """Everything the updates need from one rollout, computed without autograd: log-probs under the actor and
        the reference, the critic's values (gae; unless they come from its update pass), each response's reward,
        the estimator's advantages. A response ended if it holds a stop token."""
        cfg, m, micro = self.cfg, self.m, self.micro
        mask = batch.response_mask.float()
        deferred = self.values_from_update(len(mask))
        with m.use("actor"):
            old_logp = batched(response_logprobs, m.policy, batch, micro)
        with m.use("reference"), m.resident("reference", m.ref):
            ref_logp = batched(response_logprobs, m.ref, batch, micro)
        values = None if deferred else self.estimator.values(m, batch, micro)
        ended = (torch.isin(batch.responses, self.stops.to(batch.responses.device))
                 & batch.response_mask.bool()).any(1)
        scores, parts = self.rewards.score(m, responses, ended, micro)
        kl = rl.kl_penalty(old_logp, ref_logp, cfg.kl_estimator) * mask
        advantages = (self.estimator.deferred(scores, kl, mask) if deferred else
                      self.estimator.advantages(scores, kl, mask, values))
        return {"old_logp": old_logp, "ref_logp": ref_logp, "scores": scores, "kl": kl, "mask": mask,
                "ended": ended, **parts, **advantages}

    def update(self, batch, exp: dict, seed: int, it: int) -> dict:
        """ppo_epochs passes over minibatches (ppo.minibatch_size sequences over all ranks).

        Each minibatch runs the actor pass (every micro-batch's policy-loss backward) and then the critic pass, each
        under its own OomBackoff. The gradients equal those of interleaving the two per micro-batch: actor and
        critic train disjoint parameters (with share_base, different adapters; the actor's loss runs with the critic
        adapter off), and each parameter's gradient is still accumulated over the micro-batches in the same order.
        Statistics are weighted over the minibatch, so they do not depend on the micro-batch size either."""
        cfg = self.cfg
        g = torch.Generator().manual_seed(seed)
        stats: dict[str, list[float]] = {k: [] for ps in self.passes for k in ps.stats}
        n, size = len(batch), cfg.minibatch_size // layout_now().layout.dp  # this rank's part of each minibatch
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(n, generator=g)
            for start in range(0, n, size):
                sums = self.minibatch(batch, exp, it, perm[start:start + size])
                for k, v in sums.items():
                    stats[k].append(v)
                losses = dp_sum([sums[ps.stats[0]] for ps in self.passes])  # all ranks skip alike
                ok = finite("ppo", it, cfg.on_nonfinite, **{ps.stats[0]: v for ps, v in zip(self.passes, losses)})
                for ps in self.passes:
                    if ok:
                        ps.engine.step()
                    else:
                        ps.engine.zero_grad()
        out = dp_mean({k: sum(v) / len(v) for k, v in stats.items()})
        out.update({f"{ps.role}_micro_batch": float(ps.backoff.micro_batch) for ps in self.passes})
        return out

    def minibatch(self, batch, exp: dict, it: int, mb: torch.Tensor) -> dict[str, float]:
        """Each trained role's backward pass over one minibatch (row indices `mb`), the actor's first; the critic's
        first when its pass supplies the values (values_from_update), the advantages whitened after it."""
        n_tok = dp_sum(exp["mask"][mb].sum()).clamp(min=1)  # the global minibatch's tokens
        sums: dict[str, float] = {}
        deferred = "raw_advantages" in exp
        for ps in (self.passes[::-1] if deferred else self.passes):
            def micro_step(s: slice, ps=ps) -> float:
                if s.start == 0:  # a pass redone at a smaller micro-batch sums its statistics again from zero
                    sums.update({k: 0.0 for k in ps.stats})
                idx = mb[s]
                return ps.micro_step(batch.select(idx), exp, idx, n_tok, sums)
            with self.phase(f"{ps.role}_update"):
                ps.backoff.run(it, len(mb), micro_step, ps.engine.zero_grad)
            if deferred and ps.role == "critic":
                self.estimator.whiten(exp)
        return sums

    def actor_step(self, sub, exp: dict, idx, n_tok, sums: dict) -> float:
        """The policy objective's backward on one micro-batch: the clipped surrogate, the entropy bonus and (with
        ppo.kl_in_loss) kl_coef x the k3 KL to the reference, each reduced as ppo.loss_agg says and weighted by the
        micro-batch's part of the minibatch. Statistics other than the losses: token-weighted."""
        cfg, m, engine, agg = self.cfg, self.m, self.passes[0].engine, self.cfg.loss_agg
        mask = exp["mask"][idx]
        share = mask.sum() / n_tok  # of the minibatch's tokens
        weight = LOSS_WEIGHT[agg](mask, n_tok, cfg.minibatch_size)
        with m.use("actor"):  # backward inside too: checkpointed layers recompute with this adapter
            logp, ent = engine.forward(response_logprobs_entropy, m.policy, sub,  # ZeRO-3: see forward
                                       entropy_grad=cfg.entropy_coef != 0)  # else logged only: no graph kept
            pl, clipfrac, approx_kl = rl.policy_loss(logp, exp["old_logp"][idx], exp["advantages"][idx], mask,
                                                     cfg.clip_range, agg)
            entropy = rl.masked_mean(ent, mask)
            objective = pl - cfg.entropy_coef * rl.aggregate(ent, mask, agg)
            parts = [("policy_loss", pl, weight), ("clipfrac", clipfrac, share), ("approx_kl", approx_kl, share),
                     ("entropy", entropy, share)]
            if cfg.kl_in_loss:
                kl = rl.aggregate(rl.kl_penalty(logp, exp["ref_logp"][idx], "k3"), mask, agg)
                objective = objective + cfg.kl_coef * kl
                parts.append(("kl_loss", kl, weight))
            engine.backward(objective * weight)
        for k, v, w in parts:
            sums[k] += float(v.detach() * w)
        return float(pl.detach() * weight)

    def critic_step(self, sub, exp: dict, idx, n_tok, sums: dict) -> float:
        """The clipped value loss's backward on one micro-batch, weighted by its share of the minibatch's tokens."""
        m, engine = self.m, self.passes[1].engine
        mask = exp["mask"][idx]
        share = mask.sum() / n_tok
        with m.use("critic"):
            values = engine.forward(response_values, m.critic, sub)
            if "raw_advantages" in exp:  # values_from_update: this forward's values are the rollout's
                self.estimator.fill(exp, idx, values)
            vl, vclip = rl.value_loss(values, exp["values"][idx], exp["returns"][idx], mask, self.cfg.value_clip)
            engine.backward(vl * share)
        for k, v in zip(("value_loss", "value_clipfrac"), (vl, vclip)):
            sums[k] += float(v.detach() * share)
        return float(vl.detach() * share)

    def metrics(self, exp: dict, n_new: int) -> dict[str, float]:
        """Reward (and each source's part when two are mixed), KL, lengths and gae's value fit of one rollout. Equal
        shares per rank: the mean of the ranks' means is the batch's (explained variance: approximately)."""
        mask = exp["mask"]
        return dp_mean({"reward": float(exp["scores"].mean()), "kl": float(exp["kl"].sum(1).mean()),
                        "response_length": float(mask.sum(1).mean()),
                        "ended_fraction": float(exp["ended"].float().mean()),
                        "truncated_fraction": truncated_fraction(exp, n_new),
                        **self.estimator.metrics(exp),
                        **{k: float(exp[k].mean()) for k in ("rm_score", "function_reward") if k in exp},
                        **({"rollout_logprob_gap": float(((exp["rollout_logp"] - exp["old_logp"]).abs() * mask).sum()
                                                          / mask.sum().clamp(min=1))} if "rollout_logp" in exp else {})})


LOSS_WEIGHT = {  # a micro-batch's part of the minibatch's policy loss, as ppo.loss_agg counts it
    "token_mean": lambda mask, n_tok, rows: mask.sum() / n_tok,  # its tokens
    "seq_mean": lambda mask, n_tok, rows: mask.shape[0] / rows,  # its sequences (rows: the global minibatch's)
}
TRUNCATED_WARN = 0.1  # more responses than this cut at max_new_tokens: the RM scored unfinished text; say so


def truncated_fraction(exp: dict, n_new: int) -> float:
    """Responses that reached max_new_tokens without a stop token (cut off, not finished)."""
    cut = (~exp["ended"]) & (exp["mask"].sum(1) >= n_new)
    return float(cut.float().mean())


def warn_truncated(fraction: float, it: int, n_new: int, history: list[dict]) -> None:
    """One line, the first time an iteration cuts more than TRUNCATED_WARN of its responses (the summary counts)."""
    if fraction > TRUNCATED_WARN and sum(h["truncated_fraction"] > TRUNCATED_WARN for h in history) == 1:
        from hybridcore.parallel import is_main
        if is_main():
            say(f"warning: ppo iteration {it}: {fraction:.0%} of responses hit ppo.max_new_tokens={n_new} without "
                f"ending, so the reward scored cut-off text (raise ppo.max_new_tokens; the summary counts such "
                f"iterations)")


def probe(m: Models, prompts: list[list[int]], max_new_tokens: int):
    """The memory planner's probe: one micro-step of each trained role on `rows` copies of the longest prompt with a
    full-length response (the peak of the passes is what the update needs)."""
    j = max(range(len(prompts)), key=lambda j: len(prompts[j]))
    response = [prompts[j][-1]] * max_new_tokens

    def micro_step(rows: int) -> None:
        try:
            sub = pack([prompts[j]] * rows, [response] * rows, 0, m.policy.device)
            with m.use("actor"):
                logp, ent = response_logprobs_entropy(m.policy, sub)
                (logp.mean() + ent.mean()).backward()
            if m.critic is not None:
                with m.use("critic"):
                    response_values(m.critic, sub).mean().backward()
        finally:  # also after an out-of-memory error: no gradient may reach the first real update
            for params in m.trained().values():
                for q in params.parameters():
                    q.grad = None
    return micro_step


def rollout_plan(p, m: Models, engines: list, tok, prompts: list[list[int]], n_new: int, sink) -> tuple:
    """(chunk, offload, metrics): the most sequences the rollout generates at once and whether the actor's AdamW
    states leave the device while it rolls out; engine.rollout's settings, or under engine.memory_budget_gib the
    planner's choice, measured on a probe rollout (eager: the CUDA graph's small pool rides on the margin). vLLM
    sizes its own KV cache (engine.rollout.vllm.kv_cache_gib), so it is not planned here."""
    r, budget = p.engine.rollout, p.engine.memory_budget_gib
    if budget is None or r.backend == "vllm":
        return r.chunk_size, r.offload_optimizer, {}
    from hybridcore import planner
    layout = engines[0].layout
    parked = layout.offload_optimizer or p.engine.optimizer_states == "host"
    states = {role: planner.optimizer_state_bytes(list(t.parameters()), layout.zero_stage, parked)
              for role, t in m.trained().items()}
    held = planner.held_bytes(m.roles().values()) + sum(states.values()) - (states["actor"] if r.offload_optimizer
                                                                             else 0)
    rows = p.ppo.rollout_batch_size * p.ppo.samples_per_prompt // p.engine.layout.dp
    longest = max(prompts, key=len)
    capacity = -(-(len(longest) + n_new) // 64) * 64  # the native backend's cache rounds its length up so
    dtype = DTYPES[role_precision(p, "actor")]
    probing = HybridActor(m.policy, tok, checkpointing(p, "actor"), backend=r.backend,
                          backend_options={"cuda_graph": False, "compile": False, "attention": r.attention},
                          train_engine=engines[0])

    def probe(chunk: int) -> None:
        with m.use("actor"):
            probing.probe(longest, chunk, n_new)
    try:
        plan = planner.plan_rollout(budget, rows, r.chunk_size or rows, held, states["actor"],
                                    layout.zero_stage == 0 and not r.offload_optimizer and not parked,
                                    lambda c: planner.kv_cache_bytes(m.policy.config, c, capacity, dtype), probe,
                                    m.policy.device)
    finally:
        probing.close()
    m.train()
    say(plan.line(rows))
    sink.log(plan.metrics(), 0)
    return plan.chunk, plan.offload_optimizer or r.offload_optimizer, plan.metrics()


def backend_options(p, prompts: list[list[int]], n_new: int) -> dict:
    """The rollout backend's settings from params: the native backend's decode attention, the vllm engine's."""
    if p.engine.rollout.backend != "vllm":
        return {"attention": p.engine.rollout.attention}
    v = p.engine.rollout.vllm
    return {"bucket_mib": v.bucket_mib, "kv_cache_gib": v.kv_cache_gib, "gpu_memory_utilization":
            v.gpu_memory_utilization, "sleep": v.sleep, "seed": p.pipeline.seed,
            "max_model_len": max(len(x) for x in prompts) + n_new}


def fused_decode(p, device: torch.device) -> bool:
    """engine.rollout.decode_4bit: whether the native rollout decodes the 4-bit actor's linears through the fused
    NF4 kernel; auto: on a GPU (its Triton kernel runs on CUDA only; bitsandbytes' own path on a CPU)."""
    r = p.engine.rollout
    if r.decode_4bit != "auto":
        return r.decode_4bit == "fused"
    return device.type == "cuda" and fusable_4bit_decode(p.engine)


@dataclass
class Loop:
    """What one PPO run holds between iterations."""
    p: object
    m: Models
    tok: object
    ps: object  # stages.examples.PromptSet: token ids, texts, rows, what the RM reads
    n_new: int
    step: PpoStep
    actor: HybridActor
    ledger: MemoryLedger
    plan_metrics: dict
    history: list = field(default_factory=list)


def run(p, inputs: dict[str, Path], out: Path, sink) -> dict:
    cfg = p.ppo
    seed_all(p.pipeline.seed)
    tok = load_tokenizer(str(inputs["sft"] / "model"))
    rewards = Rewards.of(p, inputs)  # the user's function is imported before any model loads
    m = load_models(p, inputs, tok)
    ps, n_new = prompts_of(p, inputs, tok, m)
    r = build(p, m, tok, ps, n_new, rewards, sink)
    stream = prompt_stream(len(ps.ids), cfg.rollout_batch_size, p.pipeline.seed)
    log = StepLog("ppo", cfg.iterations, sink)
    loop = Resumable("ppo", out, cfg, *checkpoint_parts(r.step.named_engines(), m.checkpoint), log)
    start, state = loop.resume()
    r.history = state.get("history", [])
    try:
        for it in range(cfg.iterations):
            picked = dp_share(next(stream))  # a pure function of the seed (replayed on resume); each dp rank's share
            if it < start:
                continue
            metrics = iteration(r, it, picked)
            if metrics is not None:
                log.step(it, metrics["policy_loss"], metrics.pop("tokens"), **metrics)
            loop.after_step(it + 1, history=r.history)
    finally:
        r.actor.close()  # a vLLM engine lets go of its memory before evaluation runs in this process
        r.ledger.close()
    summary = summarise(r, log.close())
    with m.use("actor"):  # every rank: tp shards are gathered, rank 0 writes
        export(p, "actor", r.step.engines[0], m.policy, m.peft, tok, out, m.adapter,
               {"value_head": m.shared.head} if getattr(m.shared, "head", None) is not None else None)
    return summary


def prompts_of(p, inputs: dict[str, Path], tok, m: Models):
    """(the prompt set, max_new_tokens): the prompts file, checked against the rollout batch and the context."""
    from stages import data  # here, not at the top: bench/memory.py imports this module where datasets is absent
    from stages.examples import max_new_tokens, prompt_set
    ps = prompt_set(tok, data.load("prompts", p).train, data.source(p, "prompts"))
    n_new = max_new_tokens(p.ppo.max_new_tokens, inputs, "ppo.max_new_tokens", context_of(m.policy), ps.ids)
    check_prompt_room(m.policy, ps.texts, ps.ids, n_new, "ppo.max_new_tokens", data.source(p, "prompts"))
    if len(ps.ids) < p.ppo.rollout_batch_size:
        from hybridcore.errors import InputError
        raise InputError(f"data.prompts: {len(ps.ids)} prompts is fewer than ppo.rollout_batch_size="
                         f"{p.ppo.rollout_batch_size}")
    return ps, n_new


def build(p, m: Models, tok, ps, n_new: int, rewards: Rewards, sink) -> Loop:
    """The planner's micro-batch and layout, one engine per trained role, the hybrid actor, the step."""
    cfg, prompts, trained = p.ppo, ps.ids, m.trained()
    updates = cfg.iterations * cfg.ppo_epochs * (cfg.rollout_batch_size * cfg.samples_per_prompt
                                                 // cfg.minibatch_size)
    m.train()
    set_activation_checkpointing(m.policy, checkpointing(p, "actor"))  # before the planner's probe measures
    if m.critic is not None and m.shared is None:  # a shared critic runs on the actor's layers
        set_activation_checkpointing(m.critic, checkpointing(p, "critic"))
    micro, layout, plan_metrics = planned(
        p, "ppo", cfg.minibatch_size // p.engine.layout.dp, cfg.micro_batch_size, list(m.roles().values()),
        [q for params in trained.values() for q in params.parameters()], probe(m, prompts, n_new), sink)
    lrs = {"actor": cfg.actor_lr, "critic": cfg.critic_lr}
    engines = [trainer(p, params, lr=lrs[role], steps=updates, warmup_ratio=cfg.warmup_ratio, min_lr_ratio=1.0,
                       max_grad_norm=cfg.max_grad_norm, micro_batch=micro, layout=layout)
               for role, params in trained.items()]
    m.frozen_check([e.trained for e in engines])
    chunk, offload, rollout_metrics = rollout_plan(p, m, engines, tok, prompts, n_new, sink)
    plan_metrics.update(rollout_metrics)
    actor = HybridActor(m.policy, tok, checkpointing(p, "actor"), chunk_size=chunk,
                        fused_4bit=fused_decode(p, m.policy.device),
                        optimizer=engines[0].optimizer if offload else None,
                        offload_optimizer=offload, backend=p.engine.rollout.backend,
                        backend_options=backend_options(p, prompts, n_new),
                        rollout_tp=p.engine.rollout.tp,  # tp peers: same prompts, all responses
                        train_engine=engines[0])  # its rollout weights: the ZeRO-3 gather, the tp regrouping
    m.train()
    ledger = MemoryLedger(m.policy.device, models=list(m.roles().values()), engines=engines)
    step = PpoStep(cfg, m, engines, rewards, micro, actor.stop_ids, ledger.phase)
    return Loop(p, m, tok, ps, n_new, step, actor, ledger, plan_metrics)


def iteration(r: Loop, it: int, picked: list[int]) -> dict | None:
    """One rollout, scoring and update over this rank's share `picked` of the prompts, each answered
    samples_per_prompt times in contiguous rows (a group stays on one rank); its metrics (None when the batch was
    skipped as non-finite)."""
    p, cfg, m, actor, ledger = r.p, r.p.ppo, r.m, r.actor, r.ledger
    rows = [i for i in picked for _ in range(cfg.samples_per_prompt)]
    prompts = [r.ps.ids[i] for i in rows]
    fault_point("ppo", it)
    # each dp rank samples its share with its own stream (rank 0's is the one-process stream)
    torch.manual_seed(p.pipeline.seed * 100_003 + it + 1_000_003 * layout_now().dp_rank)
    t0 = time.perf_counter()
    with ledger.phase("rollout") as mem, m.use("actor"), actor.rollout():
        responses = actor.generate(prompts, r.n_new, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        mem.hold("kv_cache", actor.backend.kv_cache_bytes)  # freed when the rollout ends
    t1 = time.perf_counter()
    with ledger.phase("scoring") as mem:
        m.moved_in = lambda: mem.hold("weights", ledger.held_now()["weights"])  # offloaded roles count
        batch = pack(prompts, responses, r.tok.pad_token_id, m.policy.device)
        exp = r.step.experience(batch, r.step.rewards.read(r.ps, r.tok, it, rows, responses, m.policy.device))
    with_rollout_logprobs(exp, actor)
    if fault_active("ppo", "nan", it):
        exp["scores"][0] = float("nan")
    t2 = time.perf_counter()
    # (advantages deferred to the critic's pass: its value loss is checked, PpoStep.update)
    reward_sum, adv_sum = dp_sum([exp["scores"].sum().item(), exp["advantages"].sum().item() if "advantages" in exp
                                  else 0.0])
    if not finite("ppo", it, cfg.on_nonfinite, reward=reward_sum, advantages=adv_sum):
        return None
    stats = r.step.update(batch, exp, p.pipeline.seed + it, it)
    actor.reserve_host_states()  # the offload buffers are pinned here, never inside a transition
    metrics = {**r.step.metrics(exp, r.n_new), "rollout_s": t1 - t0, "scoring_s": t2 - t1,
               "update_s": time.perf_counter() - t2, "transition_enter_s": actor.last_transition_s.get("enter", 0.0),
               "transition_exit_s": actor.last_transition_s.get("exit", 0.0), **stats,
               **{f"rollout_{k}": float(v) for k, v in actor.last_stats.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}, **ledger.metrics()}
    r.history.append(metrics)
    warn_truncated(metrics["truncated_fraction"], it, r.n_new, r.history)
    return {**metrics, "tokens": int(dp_sum(int(batch.attention_mask.sum())))}


SUMMARISED = ("reward", "kl", "response_length", "clipfrac", "value_loss", "explained_variance", "entropy",
              "truncated_fraction", "rm_score", "function_reward", "kl_loss",
              "rollout_logprob_gap")  # those a run logs: first/last tenth


def summarise(r: Loop, logged: dict) -> dict:
    """The stage's summary: the log's, optimizer and memory figures, and first-tenth vs last-tenth means."""
    history, ledger = r.history, r.ledger
    summary = {**logged, **optimizer_metrics(r.step.named_engines()), **ledger.summary(), **r.plan_metrics}
    for line in ledger.table().splitlines() if ledger.last else ():
        say(line)
    if not history:
        raise RuntimeError("ppo: every rollout batch was skipped as non-finite; nothing was trained")
    k = max(1, len(history) // 10)
    first, last = history[:k], history[-k:]
    summary.update({f"{name}_{tag}": sum(h[name] for h in part) / len(part)
                    for name in SUMMARISED if all(name in h for h in history)
                    for tag, part in (("first", first), ("last", last))})
    summary.update(max_new_tokens=r.n_new,
                   truncated_iterations=sum(h["truncated_fraction"] > TRUNCATED_WARN for h in history))
    return summary
