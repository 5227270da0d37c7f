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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Optional

import torch

from hybridcore import rl
from hybridcore.actor import HybridActor
from hybridcore.batch import pack
from hybridcore.forward import (batched, response_logprobs, response_logprobs_entropy, response_values, sequence_scores,
                                sequences)
from hybridcore.errors import say
from hybridcore.freezing import TrainableState, assert_frozen
from hybridcore.ledger import MemoryLedger
from hybridcore.models import DTYPES, load_tokenizer, resident, set_activation_checkpointing
from hybridcore.oom import OomBackoff
from hybridcore.parallel import current as layout_now, dp_mean, dp_share, dp_sum
from hybridcore.shared_base import SharedBase, value_head
from hybridcore.interrupts import fault_active, fault_point
from hybridcore.engine import checkpoint_parts
from stages.common import (Resumable, StepLog, check_prompt_room, checkpointed, checkpointing,
                           context_of, export, finite, frozen, load_policy, load_scorer, lora_spec, optimizer_metrics, planned,
                           role_precision, seed_all, tp_split, trainer, with_lora)


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

    def frozen_check(self, optimizers) -> None:
        assert_frozen("ppo", {"actor": self.policy, "reference": self.ref, "critic": self.critic, "reward": self.rm},
                      optimizers)


def load_models(p, inputs: dict[str, Path], tok) -> Models:
    cfg = p.ppo
    sft, rm_dir = inputs["sft"] / "model", inputs["reward"] / "model"
    rm = frozen(load_scorer(p, rm_dir, "reward", tok.pad_token_id))
    homes = offload_homes(p)
    if "reward" in homes:  # quantised on the device as it loaded, then parked until each scoring
        rm.to(homes["reward"])
    if p.engine.share_base:
        base = load_policy(p, sft, "actor")
        head = value_head(base.config.hidden_size, DTYPES[role_precision(p, "actor")],  # on the actor's base
                          rm.score if cfg.critic_init == "reward" else None,
                          getattr(base.config, "initializer_range", 0.02), p.pipeline.seed).to(base.device)
        sb = SharedBase(base, lora_spec(p, "actor"), lora_spec(p, "critic"), head)
        return Models(sb.model, sb.model, sb.critic, rm, sb.actor_params, sb.critic_params,
                      {"actor": sb.actor_params, "critic": sb.critic_params}, sb.peft, "actor", sb, homes)
    # tp > 1: the trained roles are split over the tp group; reference and reward stay whole (replicated)
    policy, peft = with_lora(p, tp_split(p, load_policy(p, sft, "actor")), "actor")
    ref = frozen(load_policy(p, sft, "reference"))
    if "reference" in homes:
        ref.to(homes["reference"])
    critic_from = rm_dir if cfg.critic_init == "reward" else sft
    critic, critic_peft = with_lora(p, tp_split(p, load_scorer(p, critic_from, "critic", tok.pad_token_id)),
                                    "critic", keep_trainable=("score",))
    return Models(policy, ref, critic, rm,
                  policy if peft is None else TrainableState.of(policy),
                  critic if critic_peft is None else TrainableState.of(critic),
                  {"actor": checkpointed(policy, peft), "critic": checkpointed(critic, critic_peft)}, peft,
                  homes=homes)


def offload_homes(p) -> dict:
    """Frozen roles whose weights wait on the CPU between scorings (engine.roles.<role>.offload)."""
    return {role: torch.device("cpu") for role in ("reward", "reference") if getattr(p.engine.roles, role).offload}


@torch.no_grad()
def make_experience(cfg, batch, scored, m: Models, stops: list[int], micro: int) -> dict:
    """Everything the updates need from one rollout, computed without autograd. `scored` holds what the RM reads
    (each prompt + response as whole text: stages/examples.py); a response ended if it holds a stop token."""
    mask = batch.response_mask.float()
    with m.use("actor"):
        old_logp = batched(response_logprobs, m.policy, batch, micro)
    with m.use("reference"), m.resident("reference", m.ref):
        ref_logp = batched(response_logprobs, m.ref, batch, micro)
    with m.use("critic"):
        values = batched(response_values, m.critic, batch, micro)
    with m.resident("reward", m.rm):
        scores = batched(sequence_scores, m.rm, scored, micro)
    ended = (torch.isin(batch.responses, torch.tensor(stops, device=batch.responses.device))
             & batch.response_mask.bool()).any(1)
    if cfg.missing_eos_penalty is not None:
        scores = scores + (~ended).float() * cfg.missing_eos_penalty
    kl = rl.kl_penalty(old_logp, ref_logp, cfg.kl_estimator) * mask
    rewards = -cfg.kl_coef * kl
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(batch), device=rewards.device), last] += scores
    adv, returns = rl.gae(rewards, values * mask, mask, cfg.gamma, cfg.lam)
    return {"old_logp": old_logp, "ref_logp": ref_logp, "values": values * mask, "returns": returns,
            "advantages": rl.masked_whiten(adv, mask, reduce=dp_sum if layout_now().layout.dp > 1 else None),
            "scores": scores, "kl": kl, "mask": mask, "ended": ended}


ACTOR_STATS = ("policy_loss", "clipfrac", "approx_kl", "entropy")
CRITIC_STATS = ("value_loss", "value_clipfrac")


def no_phase(name: str):
    """The default `phase` of update(): no memory ledger."""
    return contextlib.nullcontext()


def update_backoffs(micro: int) -> tuple[OomBackoff, OomBackoff]:
    """The actor's and the critic's out-of-memory back-off, kept for the whole stage (a smaller size sticks).
    `ppo:oom:<step>` injects a fault into the actor pass, `ppo:critic:oom:<step>` into the critic pass."""
    return OomBackoff("ppo actor", micro, fault="ppo"), OomBackoff("ppo critic", micro, fault="ppo:critic")


def update(cfg, batch, exp, m: Models, engines, backoffs: tuple[OomBackoff, OomBackoff], seed: int, it: int,
           phase: Callable[[str], ContextManager] = no_phase) -> dict:
    """ppo_epochs passes over minibatches; token-mean losses over each whole minibatch.

    Each minibatch runs an actor pass (every micro-batch's policy-loss backward) and then a critic pass, each under
    its own OomBackoff. The gradients equal those of interleaving the two per micro-batch: actor and critic train
    disjoint parameters (with share_base, different adapters; the actor's loss runs with the critic adapter off),
    and each parameter's gradient is still accumulated over the micro-batches in the same order. Statistics are
    token-weighted over the minibatch, so they do not depend on the micro-batch size either."""
    g = torch.Generator().manual_seed(seed)
    stats: dict[str, list[float]] = {k: [] for k in ("policy_loss", "value_loss", "clipfrac", "value_clipfrac",
                                                     "approx_kl", "entropy")}
    n = len(batch)
    size = cfg.minibatch_size // layout_now().layout.dp  # this rank's part of each global minibatch
    for _ in range(cfg.ppo_epochs):
        perm = torch.randperm(n, generator=g)
        for start in range(0, n, size):
            sums = minibatch(cfg, batch, exp, m, engines, backoffs, it, perm[start:start + size], phase)
            for k, v in sums.items():
                stats[k].append(v)
            pl_sum, vl_sum = dp_sum([sums["policy_loss"], sums["value_loss"]])  # all ranks skip alike
            ok = finite("ppo", it, cfg.on_nonfinite, policy_loss=pl_sum, value_loss=vl_sum)
            for engine in engines:
                if ok:
                    engine.step()
                else:
                    engine.zero_grad()
    out = dp_mean({k: sum(v) / len(v) for k, v in stats.items()})
    out.update(actor_micro_batch=float(backoffs[0].micro_batch), critic_micro_batch=float(backoffs[1].micro_batch))
    return out


def minibatch(cfg, batch, exp, m: Models, engines, backoffs, it: int, mb: torch.Tensor, phase) -> dict[str, float]:
    """The actor's and then the critic's backward passes over one minibatch (row indices `mb`), each under its
    OomBackoff; the statistics, token-weighted over the global minibatch."""
    n_tok = dp_sum(exp["mask"][mb].sum()).clamp(min=1)  # the global minibatch's tokens
    sums: dict[str, float] = {}

    def rows(s: slice, keys: tuple[str, ...]):
        idx = mb[s]
        mask = exp["mask"][idx]
        if s.start == 0:  # a pass redone at a smaller micro-batch sums its statistics again from zero
            sums.update({k: 0.0 for k in keys})
        return idx, batch.select(idx), mask, mask.sum() / n_tok  # share of the minibatch's tokens

    def actor_step(s: slice) -> float:
        idx, sub, mask, share = rows(s, ACTOR_STATS)
        with m.use("actor"):  # backward inside too: checkpointed layers recompute with this adapter
            logp, ent = engines[0].forward(response_logprobs_entropy, m.policy, sub)  # ZeRO-3: see forward
            pl, clipfrac, approx_kl = rl.policy_loss(logp, exp["old_logp"][idx], exp["advantages"][idx], mask,
                                                     cfg.clip_range)
            entropy = rl.masked_mean(ent, mask)
            engines[0].backward((pl - cfg.entropy_coef * entropy) * share)
        for k, v in zip(ACTOR_STATS, (pl, clipfrac, approx_kl, entropy)):
            sums[k] += float(v.detach() * share)
        return float(pl.detach() * share)

    def critic_step(s: slice) -> float:
        idx, sub, mask, share = rows(s, CRITIC_STATS)
        with m.use("critic"):
            values = engines[1].forward(response_values, m.critic, sub)
            vl, vclip = rl.value_loss(values, exp["values"][idx], exp["returns"][idx], mask, cfg.value_clip)
            engines[1].backward(vl * share)
        for k, v in zip(CRITIC_STATS, (vl, vclip)):
            sums[k] += float(v.detach() * share)
        return float(vl.detach() * share)

    for name, r, step_fn in (("actor_update", 0, actor_step), ("critic_update", 1, critic_step)):
        with phase(name):
            backoffs[r].run(it, len(mb), step_fn, engines[r].zero_grad)
    return sums


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
                f"ending, so the reward model scored cut-off text (raise ppo.max_new_tokens; the summary counts "
                f"such iterations)")


def probe(m: Models, prompts: list[list[int]], max_new_tokens: int):
    """The memory planner's probe: one actor and one critic micro-step on `rows` copies of the longest prompt with a
    full-length response (the peak of the two is what the update needs)."""
    j = max(range(len(prompts)), key=lambda j: len(prompts[j]))
    response = [prompts[j][-1]] * max_new_tokens

    def micro_step(rows: int) -> None:
        try:
            sub = pack([prompts[j]] * rows, [response] * rows, 0, m.policy.device)
            with m.use("actor"):
                logp, ent = response_logprobs_entropy(m.policy, sub)
                (logp.mean() + ent.mean()).backward()
            with m.use("critic"):
                response_values(m.critic, sub).mean().backward()
        finally:  # also after an out-of-memory error: no gradient may reach the first real update
            for q in (*m.actor_params.parameters(), *m.critic_params.parameters()):
                q.grad = None
    return micro_step


def rollout_offload(p, m: Models, layout, prompts: list[list[int]], n_new: int, plan_metrics: dict) -> bool:
    """engine.rollout.offload_optimizer, or the memory planner's call (plain AdamW: under ZeRO DeepSpeed owns the
    states) when the rollout's KV cache would not fit beside the actor's optimizer states."""
    if p.engine.rollout.offload_optimizer or p.engine.memory_budget_gib is None or layout.zero_stage > 0:
        return p.engine.rollout.offload_optimizer
    from hybridcore import planner
    actor, critic = list(m.actor_params.parameters()), list(m.critic_params.parameters())
    actor_states = planner.optimizer_state_bytes(actor, 0, False)
    held = planner.held_bytes((m.policy, m.ref, m.critic, m.rm)) + planner.optimizer_state_bytes(critic, 0, False)
    kv = planner.kv_cache_bytes(m.policy.config, p.ppo.rollout_batch_size // p.engine.layout.dp,
                                max(map(len, prompts)) + n_new, DTYPES[role_precision(p, "actor")])
    on = planner.choose_rollout_offload(p.engine.memory_budget_gib, held + actor_states, actor_states, kv)
    plan_metrics["planned_rollout_offload"] = float(on)
    if on:
        say(f"ppo: memory planner moves the actor's optimizer states to the CPU while it rolls out (a "
            f"{kv / 2 ** 20:.1f} MiB KV cache does not fit beside them)")
    return on


def backend_options(p, prompts: list[list[int]], n_new: int) -> dict:
    """The rollout backend's settings from params: only vllm takes any."""
    if p.engine.rollout.backend != "vllm":
        return {}
    v = p.engine.rollout.vllm
    return {"bucket_mib": v.bucket_mib, "kv_cache_gib": v.kv_cache_gib, "gpu_memory_utilization":
            v.gpu_memory_utilization, "sleep": v.sleep, "seed": p.pipeline.seed,
            "max_model_len": max(len(x) for x in prompts) + n_new}


@dataclass
class Loop:
    """What one PPO run holds between iterations."""
    p: object
    m: Models
    tok: object
    ps: object  # stages.examples.PromptSet: token ids, texts, what the RM reads
    n_new: int
    micro: int
    engines: list
    actor: HybridActor
    ledger: MemoryLedger
    backoffs: tuple[OomBackoff, OomBackoff]
    plan_metrics: dict
    history: list = field(default_factory=list)


def run(p, inputs: dict[str, Path], out: Path, sink) -> dict:
    cfg = p.ppo
    seed_all(p.pipeline.seed)
    tok = load_tokenizer(str(inputs["sft"] / "model"))
    m = load_models(p, inputs, tok)
    ps, n_new = prompts_of(p, inputs, tok, m)
    r = build(p, m, tok, ps, n_new, sink)
    stream = prompt_stream(len(ps.ids), cfg.rollout_batch_size, p.pipeline.seed)
    log = StepLog("ppo", cfg.iterations, sink)
    loop = Resumable("ppo", out, cfg, *checkpoint_parts({"actor_": r.engines[0], "critic_": r.engines[1]},
                                                        m.checkpoint), log)
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
        export(p, "actor", r.engines[0], m.policy, m.peft, tok, out, m.adapter,
               {"value_head": m.shared.head} if m.shared is not None else None)
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


def build(p, m: Models, tok, ps, n_new: int, sink) -> Loop:
    """The planner's micro-batch and layout, the actor's and the critic's engines, the hybrid actor."""
    cfg, prompts = p.ppo, ps.ids
    updates = cfg.iterations * cfg.ppo_epochs * (cfg.rollout_batch_size // cfg.minibatch_size)
    m.policy.train()
    m.critic.train()
    set_activation_checkpointing(m.policy, checkpointing(p, "actor"))  # before the planner's probe measures
    if m.shared is None:  # a shared critic runs on the actor's layers
        set_activation_checkpointing(m.critic, checkpointing(p, "critic"))
    micro, layout, plan_metrics = planned(
        p, "ppo", cfg.minibatch_size // p.engine.layout.dp, cfg.micro_batch_size, (m.policy, m.ref, m.critic, m.rm),
        [*m.actor_params.parameters(), *m.critic_params.parameters()], probe(m, prompts, n_new), sink)
    engines = [trainer(p, params, lr=lr, steps=updates, warmup_ratio=cfg.warmup_ratio, min_lr_ratio=1.0,
                       max_grad_norm=cfg.max_grad_norm, micro_batch=micro, layout=layout)
               for params, lr in ((m.actor_params, cfg.actor_lr), (m.critic_params, cfg.critic_lr))]
    m.frozen_check([e.trained for e in engines])
    offload = rollout_offload(p, m, layout, prompts, n_new, plan_metrics)
    actor = HybridActor(m.policy, tok, checkpointing(p, "actor"),
                        optimizer=engines[0].optimizer if offload else None,
                        offload_optimizer=offload, backend=p.engine.rollout.backend,
                        backend_options=backend_options(p, prompts, n_new),
                        rollout_tp=p.engine.rollout.tp,  # tp peers: same prompts, all responses
                        train_engine=engines[0])  # its rollout weights: the ZeRO-3 gather, the tp regrouping
    m.policy.train()
    m.critic.train()
    ledger = MemoryLedger(m.policy.device, models=(m.policy, m.ref, m.critic, m.rm), engines=engines)
    return Loop(p, m, tok, ps, n_new, micro, engines, actor, ledger, update_backoffs(micro), plan_metrics)


def iteration(r: Loop, it: int, picked: list[int]) -> dict | None:
    """One rollout, scoring and update over this rank's share `picked` of the prompts; its metrics (None when the
    batch was skipped as non-finite)."""
    p, cfg, m, tok, actor, ledger = r.p, r.p.ppo, r.m, r.tok, r.actor, r.ledger
    batch_prompts = [r.ps.ids[i] for i in picked]
    fault_point("ppo", it)
    # each dp rank samples its share with its own stream (rank 0's is the one-process stream)
    torch.manual_seed(p.pipeline.seed * 100_003 + it + 1_000_003 * layout_now().dp_rank)
    t0 = time.perf_counter()
    with ledger.phase("rollout") as mem, m.use("actor"), actor.rollout():
        responses = actor.generate(batch_prompts, r.n_new, temperature=cfg.temperature, top_k=cfg.top_k,
                                   top_p=cfg.top_p)
        mem.hold("kv_cache", actor.backend.kv_cache_bytes)  # freed when the rollout ends
    t1 = time.perf_counter()
    with ledger.phase("scoring") as mem:
        m.moved_in = lambda: mem.hold("weights", ledger.held_now()["weights"])  # offloaded roles count
        batch = pack(batch_prompts, responses, tok.pad_token_id, m.policy.device)
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        scored = sequences([r.ps.scored(i, t) for i, t in zip(picked, texts)], tok.pad_token_id, m.policy.device)
        exp = make_experience(cfg, batch, scored, m, actor.stop_ids, r.micro)
    if fault_active("ppo", "nan", it):
        exp["scores"][0] = float("nan")
    t2 = time.perf_counter()
    reward_sum, adv_sum = dp_sum([exp["scores"].sum().item(), exp["advantages"].sum().item()])
    if not finite("ppo", it, cfg.on_nonfinite, reward=reward_sum, advantages=adv_sum):
        return None
    stats = update(cfg, batch, exp, m, r.engines, r.backoffs, p.pipeline.seed + it, it, phase=ledger.phase)
    actor.reserve_host_states()  # the offload buffers are pinned here, never inside a transition
    metrics = {**rollout_metrics(exp, r.n_new), "rollout_s": t1 - t0, "scoring_s": t2 - t1,
               "update_s": time.perf_counter() - t2, "transition_enter_s": actor.last_transition_s.get("enter", 0.0),
               "transition_exit_s": actor.last_transition_s.get("exit", 0.0), **stats,
               **{f"rollout_{k}": float(v) for k, v in actor.backend.last_stats.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}, **ledger.metrics()}
    r.history.append(metrics)
    warn_truncated(metrics["truncated_fraction"], it, r.n_new, r.history)
    return {**metrics, "tokens": int(dp_sum(int(batch.attention_mask.sum())))}


def rollout_metrics(exp: dict, n_new: int) -> dict[str, float]:
    """Reward, KL, lengths and value fit of one rollout batch. Equal shares per rank: the mean of the ranks' means
    is the batch's (explained variance: approximately)."""
    mask = exp["mask"]
    return dp_mean({"reward": float(exp["scores"].mean()), "kl": float(exp["kl"].sum(1).mean()),
                    "response_length": float(mask.sum(1).mean()),
                    "ended_fraction": float(exp["ended"].float().mean()),
                    "truncated_fraction": truncated_fraction(exp, n_new),
                    "explained_variance": float(rl.explained_variance(exp["values"], exp["returns"], mask))})


def summarise(r: Loop, logged: dict) -> dict:
    """The stage's summary: the log's, optimizer and memory figures, and first-tenth vs last-tenth means."""
    history, ledger = r.history, r.ledger
    summary = {**logged, **optimizer_metrics({"actor_": r.engines[0], "critic_": r.engines[1]}), **ledger.summary(),
               **r.plan_metrics}
    for line in ledger.table().splitlines() if ledger.last else ():
        say(line)
    if not history:
        raise RuntimeError("ppo: every rollout batch was skipped as non-finite; nothing was trained")
    k = max(1, len(history) // 10)
    first, last = history[:k], history[-k:]
    summary.update({f"{name}_{tag}": sum(h[name] for h in part) / len(part)
                    for name in ("reward", "kl", "response_length", "clipfrac", "value_loss", "explained_variance",
                                 "entropy", "truncated_fraction")
                    for tag, part in (("first", first), ("last", last))})
    summary.update(max_new_tokens=r.n_new,
                   truncated_iterations=sum(h["truncated_fraction"] > TRUNCATED_WARN for h in history))
    return summary
