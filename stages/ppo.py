"""PPO: the actor (from SFT) learns from the reward model's scores, held near a frozen reference.

Per rollout batch: sample responses from the actor's own weights (the hybrid actor, no copy); score
them with the RM; old log-probs, reference log-probs and values without autograd; per-token reward =
-kl_coef * KL + RM score on the last token; GAE with whitened advantages; then several epochs over
minibatches of clipped policy and clipped value updates. The critic is the RM's backbone and score
head applied per token (or a fresh head on the SFT model).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from hybridcore import rl
from hybridcore.actor import HybridActor
from hybridcore.batch import encode, micro_batches, pack
from hybridcore.forward import batched, response_logits, response_logprobs, response_values, sequence_scores
from hybridcore.models import load_tokenizer, save_model
from hybridcore.optim import adamw, step, warmup_cosine
from stages import data
from hybridcore.interrupts import fault_active, fault_point
from stages.common import Resumable, StepLog, finite, frozen, load_policy, load_scorer, seed_all


def prompt_stream(prompts: list[list[int]], size: int, seed: int):
    """Endless batches of prompts, reshuffled each pass."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(prompts)))
        rng.shuffle(order)
        for start in range(0, len(order) - size + 1, size):
            yield [prompts[i] for i in order[start:start + size]]


@torch.no_grad()
def make_experience(cfg, batch, actor, ref, rm, critic, eos_id, micro: int) -> dict:
    """Everything the updates need from one rollout, computed without autograd."""
    mask = batch.response_mask.float()
    old_logp = batched(response_logprobs, actor, batch, micro)
    ref_logp = batched(response_logprobs, ref, batch, micro)
    values = batched(response_values, critic, batch, micro)
    scores = batched(sequence_scores, rm, batch, micro)
    ended = (batch.responses == eos_id).any(1)
    if cfg.missing_eos_penalty is not None:
        scores = scores + (~ended).float() * cfg.missing_eos_penalty
    kl = rl.kl_penalty(old_logp, ref_logp, cfg.kl_estimator) * mask
    rewards = -cfg.kl_coef * kl
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(batch)), last] += scores
    adv, returns = rl.gae(rewards, values * mask, mask, cfg.gamma, cfg.lam)
    return {"old_logp": old_logp, "ref_logp": ref_logp, "values": values * mask, "returns": returns,
            "advantages": rl.masked_whiten(adv, mask), "scores": scores, "kl": kl, "mask": mask, "ended": ended}


def update(cfg, batch, exp, actor, critic, opts, micro: int, seed: int, it: int) -> dict:
    """ppo_epochs passes over minibatches; token-mean losses over each whole minibatch."""
    g = torch.Generator().manual_seed(seed)
    stats: dict[str, list[float]] = {k: [] for k in ("policy_loss", "value_loss", "clipfrac", "value_clipfrac",
                                                     "approx_kl", "entropy")}
    n = len(batch)
    for _ in range(cfg.ppo_epochs):
        perm = torch.randperm(n, generator=g)
        for start in range(0, n, cfg.minibatch_size):
            mb = perm[start:start + cfg.minibatch_size]
            n_tok = exp["mask"][mb].sum().clamp(min=1)
            for s in micro_batches(len(mb), micro):
                idx = mb[s]
                sub, m = batch.select(idx), exp["mask"][idx]
                share = m.sum() / n_tok  # micro-batch's share of the minibatch's tokens
                logits = response_logits(actor, sub)
                logp = rl.token_logprobs(logits, sub.responses)
                pl, clipfrac, approx_kl = rl.policy_loss(logp, exp["old_logp"][idx], exp["advantages"][idx], m,
                                                         cfg.clip_range)
                entropy = rl.masked_mean(rl.entropy_from_logits(logits), m)
                ((pl - cfg.entropy_coef * entropy) * share).backward()
                values = response_values(critic, sub)
                vl, vclip = rl.value_loss(values, exp["values"][idx], exp["returns"][idx], m, cfg.value_clip)
                (vl * share).backward()
                for k, v in zip(stats, (pl, vl, clipfrac, vclip, approx_kl, entropy)):
                    stats[k].append(v.item())
            ok = finite("ppo", it, cfg.on_nonfinite, policy_loss=stats["policy_loss"][-1],
                        value_loss=stats["value_loss"][-1])
            for model, (opt, sched) in zip((actor, critic), opts):
                if ok:
                    step(model, opt, sched, cfg.max_grad_norm)
                else:
                    opt.zero_grad(set_to_none=True)
    return {k: sum(v) / len(v) for k, v in stats.items()}


def run(p, inputs: dict[str, Path], out: Path, sink) -> dict:
    cfg = p.ppo
    seed_all(p.pipeline.seed)
    tok = load_tokenizer(str(inputs["sft"] / "model"))
    actor = HybridActor(load_policy(p, inputs["sft"] / "model", "actor"), tok, p.engine.activation_checkpointing)
    ref = frozen(load_policy(p, inputs["sft"] / "model", "reference"))
    rm = frozen(load_scorer(p, inputs["reward"] / "model", "reward", tok.pad_token_id))
    critic_from = inputs["reward"] if cfg.critic_init == "reward" else inputs["sft"]
    critic = load_scorer(p, critic_from / "model", "critic", tok.pad_token_id)
    prompts, _ = encode(tok, data.load("prompts", p).train["prompt"])
    if len(prompts) < cfg.rollout_batch_size:
        from hybridcore.errors import InputError
        raise InputError(f"data.prompts: {len(prompts)} prompts is fewer than ppo.rollout_batch_size="
                         f"{cfg.rollout_batch_size}")
    updates = cfg.iterations * cfg.ppo_epochs * (cfg.rollout_batch_size // cfg.minibatch_size)
    opts = [(o, warmup_cosine(o, updates, cfg.warmup_ratio, 1.0))
            for o in (adamw(actor.model, cfg.actor_lr), adamw(critic, cfg.critic_lr))]
    actor.model.train()
    critic.train()
    stream = prompt_stream(prompts, cfg.rollout_batch_size, p.pipeline.seed)
    log = StepLog("ppo", cfg.iterations, sink)
    loop = Resumable("ppo", out, cfg, {"actor": actor.model, "critic": critic},
                     {"actor_optimizer": opts[0][0], "actor_schedule": opts[0][1],
                      "critic_optimizer": opts[1][0], "critic_schedule": opts[1][1]}, log)
    start, state = loop.resume()
    history = state.get("history", [])
    for it in range(cfg.iterations):
        batch_prompts = next(stream)  # the prompt order is a pure function of the seed: replay it on resume
        if it < start:
            continue
        fault_point("ppo", it)
        torch.manual_seed(p.pipeline.seed * 100_003 + it)
        t0 = time.perf_counter()
        with actor.rollout():
            responses = actor.generate(batch_prompts, cfg.max_new_tokens, temperature=cfg.temperature,
                                       top_k=cfg.top_k, top_p=cfg.top_p)
        t1 = time.perf_counter()
        batch = pack(batch_prompts, responses, tok.pad_token_id)
        exp = make_experience(cfg, batch, actor.model, ref, rm, critic, tok.eos_token_id, cfg.micro_batch_size)
        if fault_active("ppo", "nan", it):
            exp["scores"][0] = float("nan")
        t2 = time.perf_counter()
        if not finite("ppo", it, cfg.on_nonfinite, reward=exp["scores"].sum(), advantages=exp["advantages"].sum()):
            loop.after_step(it + 1, history=history)
            continue
        stats = update(cfg, batch, exp, actor.model, critic, opts, cfg.micro_batch_size, p.pipeline.seed + it, it)
        t3 = time.perf_counter()
        mask = exp["mask"]
        metrics = {"reward": float(exp["scores"].mean()), "kl": float(exp["kl"].sum(1).mean()),
                   "response_length": float(mask.sum(1).mean()), "ended_fraction": float(exp["ended"].float().mean()),
                   "explained_variance": float(rl.explained_variance(exp["values"], exp["returns"], mask)),
                   "rollout_s": t1 - t0, "scoring_s": t2 - t1, "update_s": t3 - t2,
                   "transition_enter_s": actor.last_transition_s.get("enter", 0.0),
                   "transition_exit_s": actor.last_transition_s.get("exit", 0.0), **stats}
        history.append(metrics)
        log.step(it, stats["policy_loss"], int(batch.attention_mask.sum()), **metrics)
        loop.after_step(it + 1, history=history)
    summary = log.close()
    if not history:
        raise RuntimeError("ppo: every rollout batch was skipped as non-finite; nothing was trained")
    k = max(1, len(history) // 10)
    first, last = history[:k], history[-k:]
    summary.update({f"{name}_{tag}": sum(h[name] for h in part) / len(part)
                    for name in ("reward", "kl", "response_length", "clipfrac", "value_loss", "explained_variance",
                                 "entropy")
                    for tag, part in (("first", first), ("last", last))})
    save_model(actor.model, tok, out / "model")
    return summary
