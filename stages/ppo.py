"""PPO: the actor (from SFT) learns from the reward model's scores, held near a frozen reference.

Per rollout batch: sample responses from the actor's own weights (the hybrid actor, no copy); score
them with the RM; old log-probs, reference log-probs and values without autograd; per-token reward =
-kl_coef * KL + RM score on the last token; GAE with whitened advantages; then several epochs over
minibatches of clipped policy and clipped value updates. The critic is the RM's backbone and score
head applied per token (or a fresh head on the SFT model).

With engine.share_base the actor and critic are LoRA adapters on one frozen base and the reference is
that base with the adapters off (hybridcore/shared_base.py); `Models.use(role)` picks which one computes.
"""
from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from hybridcore import rl
from hybridcore.actor import HybridActor
from hybridcore.batch import encode, micro_batches, pack
from hybridcore.forward import batched, response_logprobs, response_logprobs_entropy, response_values, sequence_scores
from hybridcore.freezing import TrainableState, assert_frozen
from hybridcore.models import DTYPES, load_tokenizer
from hybridcore.shared_base import SharedBase, value_head
from stages import data
from hybridcore.interrupts import fault_active, fault_point
from stages.common import (Resumable, StepLog, checkpoint_parts, checkpointed, export, finite, frozen, load_policy,
                           load_scorer, lora_spec, optimizer_metrics, role_precision, seed_all, trainer, with_lora)


def prompt_stream(prompts: list[list[int]], size: int, seed: int):
    """Endless batches of prompts, reshuffled each pass."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(prompts)))
        rng.shuffle(order)
        for start in range(0, len(order) - size + 1, size):
            yield [prompts[i] for i in order[start:start + size]]


@dataclass
class Models:
    """PPO's four roles. `actor_params` / `critic_params` are what each optimiser updates and clips (the whole
    model, or adapters and a value head); `peft` is set when the actor has adapters."""
    policy: torch.nn.Module
    ref: torch.nn.Module
    critic: torch.nn.Module
    rm: torch.nn.Module
    actor_params: object
    critic_params: object
    checkpoint: dict
    peft: object = None
    adapter: str = "default"
    shared: Optional[SharedBase] = None

    def use(self, role: str):
        return self.shared.use(role) if self.shared is not None else contextlib.nullcontext()

    def frozen_check(self, optimizers) -> None:
        assert_frozen("ppo", {"actor": self.policy, "reference": self.ref, "critic": self.critic, "reward": self.rm},
                      optimizers)


def load_models(p, inputs: dict[str, Path], tok) -> Models:
    cfg = p.ppo
    sft, rm_dir = inputs["sft"] / "model", inputs["reward"] / "model"
    rm = frozen(load_scorer(p, rm_dir, "reward", tok.pad_token_id))
    if p.engine.share_base:
        base = load_policy(p, sft, "actor")
        head = value_head(base.config.hidden_size, DTYPES[role_precision(p, "actor")],  # on the actor's base
                          rm.score if cfg.critic_init == "reward" else None,
                          getattr(base.config, "initializer_range", 0.02), p.pipeline.seed).to(base.device)
        sb = SharedBase(base, lora_spec(p, "actor"), lora_spec(p, "critic"), head)
        return Models(sb.model, sb.model, sb.critic, rm, sb.actor_params, sb.critic_params,
                      {"actor": sb.actor_params, "critic": sb.critic_params}, sb.peft, "actor", sb)
    policy, peft = with_lora(p, load_policy(p, sft, "actor"), "actor")
    ref = frozen(load_policy(p, sft, "reference"))
    critic_from = rm_dir if cfg.critic_init == "reward" else sft
    critic, critic_peft = with_lora(p, load_scorer(p, critic_from, "critic", tok.pad_token_id), "critic",
                                    keep_trainable=("score",))
    return Models(policy, ref, critic, rm,
                  policy if peft is None else TrainableState.of(policy),
                  critic if critic_peft is None else TrainableState.of(critic),
                  {"actor": checkpointed(policy, peft), "critic": checkpointed(critic, critic_peft)}, peft)


@torch.no_grad()
def make_experience(cfg, batch, m: Models, eos_id, micro: int) -> dict:
    """Everything the updates need from one rollout, computed without autograd."""
    mask = batch.response_mask.float()
    with m.use("actor"):
        old_logp = batched(response_logprobs, m.policy, batch, micro)
    with m.use("reference"):
        ref_logp = batched(response_logprobs, m.ref, batch, micro)
    with m.use("critic"):
        values = batched(response_values, m.critic, batch, micro)
    scores = batched(sequence_scores, m.rm, batch, micro)
    ended = (batch.responses == eos_id).any(1)
    if cfg.missing_eos_penalty is not None:
        scores = scores + (~ended).float() * cfg.missing_eos_penalty
    kl = rl.kl_penalty(old_logp, ref_logp, cfg.kl_estimator) * mask
    rewards = -cfg.kl_coef * kl
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(batch), device=rewards.device), last] += scores
    adv, returns = rl.gae(rewards, values * mask, mask, cfg.gamma, cfg.lam)
    return {"old_logp": old_logp, "ref_logp": ref_logp, "values": values * mask, "returns": returns,
            "advantages": rl.masked_whiten(adv, mask), "scores": scores, "kl": kl, "mask": mask, "ended": ended}


def update(cfg, batch, exp, m: Models, engines, micro: int, seed: int, it: int) -> dict:
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
                sub, mask = batch.select(idx), exp["mask"][idx]
                share = mask.sum() / n_tok  # micro-batch's share of the minibatch's tokens
                with m.use("actor"):  # backward inside too: checkpointed layers recompute with this adapter
                    logp, ent = response_logprobs_entropy(m.policy, sub)
                    pl, clipfrac, approx_kl = rl.policy_loss(logp, exp["old_logp"][idx], exp["advantages"][idx],
                                                             mask, cfg.clip_range)
                    entropy = rl.masked_mean(ent, mask)
                    engines[0].backward((pl - cfg.entropy_coef * entropy) * share)
                with m.use("critic"):
                    values = response_values(m.critic, sub)
                    vl, vclip = rl.value_loss(values, exp["values"][idx], exp["returns"][idx], mask, cfg.value_clip)
                    engines[1].backward(vl * share)
                for k, v in zip(stats, (pl, vl, clipfrac, vclip, approx_kl, entropy)):
                    stats[k].append(v.item())
            ok = finite("ppo", it, cfg.on_nonfinite, policy_loss=stats["policy_loss"][-1],
                        value_loss=stats["value_loss"][-1])
            for engine in engines:
                if ok:
                    engine.step()
                else:
                    engine.zero_grad()
    return {k: sum(v) / len(v) for k, v in stats.items()}


def backend_options(p, prompts: list[list[int]]) -> dict:
    """The rollout backend's settings from params: only vllm takes any."""
    if p.engine.rollout.backend != "vllm":
        return {}
    v = p.engine.rollout.vllm
    return {"bucket_mib": v.bucket_mib, "kv_cache_gib": v.kv_cache_gib, "gpu_memory_utilization":
            v.gpu_memory_utilization, "sleep": v.sleep, "seed": p.pipeline.seed,
            "max_model_len": max(len(x) for x in prompts) + p.ppo.max_new_tokens}


def run(p, inputs: dict[str, Path], out: Path, sink) -> dict:
    cfg = p.ppo
    seed_all(p.pipeline.seed)
    tok = load_tokenizer(str(inputs["sft"] / "model"))
    m = load_models(p, inputs, tok)
    prompts, _ = encode(tok, data.load("prompts", p).train["prompt"])
    if len(prompts) < cfg.rollout_batch_size:
        from hybridcore.errors import InputError
        raise InputError(f"data.prompts: {len(prompts)} prompts is fewer than ppo.rollout_batch_size="
                         f"{cfg.rollout_batch_size}")
    updates = cfg.iterations * cfg.ppo_epochs * (cfg.rollout_batch_size // cfg.minibatch_size)
    engines = [trainer(p, params, lr=lr, steps=updates, warmup_ratio=cfg.warmup_ratio, min_lr_ratio=1.0,
                       max_grad_norm=cfg.max_grad_norm, micro_batch=cfg.micro_batch_size)
               for params, lr in ((m.actor_params, cfg.actor_lr), (m.critic_params, cfg.critic_lr))]
    m.frozen_check([e.trained for e in engines])
    actor = HybridActor(m.policy, tok, p.engine.activation_checkpointing,
                        optimizer=engines[0].optimizer if p.engine.rollout.offload_optimizer else None,
                        offload_optimizer=p.engine.rollout.offload_optimizer, backend=p.engine.rollout.backend,
                        backend_options=backend_options(p, prompts))
    m.policy.train()
    m.critic.train()
    stream = prompt_stream(prompts, cfg.rollout_batch_size, p.pipeline.seed)
    log = StepLog("ppo", cfg.iterations, sink)
    loop = Resumable("ppo", out, cfg, *checkpoint_parts({"actor_": engines[0], "critic_": engines[1]}, m.checkpoint),
                     log)
    start, state = loop.resume()
    history = state.get("history", [])
    try:
        for it in range(cfg.iterations):
            batch_prompts = next(stream)  # the prompt order is a pure function of the seed: replay it on resume
            if it < start:
                continue
            fault_point("ppo", it)
            torch.manual_seed(p.pipeline.seed * 100_003 + it)
            t0 = time.perf_counter()
            with m.use("actor"), actor.rollout():
                responses = actor.generate(batch_prompts, cfg.max_new_tokens, temperature=cfg.temperature,
                                           top_k=cfg.top_k, top_p=cfg.top_p)
            t1 = time.perf_counter()
            batch = pack(batch_prompts, responses, tok.pad_token_id, m.policy.device)
            exp = make_experience(cfg, batch, m, tok.eos_token_id, cfg.micro_batch_size)
            if fault_active("ppo", "nan", it):
                exp["scores"][0] = float("nan")
            t2 = time.perf_counter()
            if not finite("ppo", it, cfg.on_nonfinite, reward=exp["scores"].sum(), advantages=exp["advantages"].sum()):
                loop.after_step(it + 1, history=history)
                continue
            stats = update(cfg, batch, exp, m, engines, cfg.micro_batch_size, p.pipeline.seed + it, it)
            actor.reserve_host_states()  # the offload buffers are pinned here, never inside a transition
            t3 = time.perf_counter()
            mask = exp["mask"]
            metrics = {"reward": float(exp["scores"].mean()), "kl": float(exp["kl"].sum(1).mean()),
                       "response_length": float(mask.sum(1).mean()), "ended_fraction": float(exp["ended"].float().mean()),
                       "explained_variance": float(rl.explained_variance(exp["values"], exp["returns"], mask)),
                       "rollout_s": t1 - t0, "scoring_s": t2 - t1, "update_s": t3 - t2,
                       "transition_enter_s": actor.last_transition_s.get("enter", 0.0),
                       "transition_exit_s": actor.last_transition_s.get("exit", 0.0), **stats,
                       **{f"rollout_{k}": float(v) for k, v in actor.backend.last_stats.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)}}
            history.append(metrics)
            log.step(it, stats["policy_loss"], int(batch.attention_mask.sum()), **metrics)
            loop.after_step(it + 1, history=history)
    finally:
        actor.close()  # a vLLM engine lets go of its memory before evaluation runs in this process
    summary = {**log.close(), **optimizer_metrics({"actor_": engines[0], "critic_": engines[1]})}
    if not history:
        raise RuntimeError("ppo: every rollout batch was skipped as non-finite; nothing was trained")
    k = max(1, len(history) // 10)
    first, last = history[:k], history[-k:]
    summary.update({f"{name}_{tag}": sum(h[name] for h in part) / len(part)
                    for name in ("reward", "kl", "response_length", "clipfrac", "value_loss", "explained_variance",
                                 "entropy")
                    for tag, part in (("first", first), ("last", last))})
    with m.use("actor"):
        export(p, "actor", m.policy, m.peft, tok, out, m.adapter,
               {"value_head": m.shared.head} if m.shared is not None else None)
    return summary
