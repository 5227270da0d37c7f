"""Evaluation: greedy answers of the SFT and PPO policies on held-out prompts, scored by the reward
model and, where the prompts carry an answer, checked for task accuracy."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridcore.actor import HybridActor
from hybridcore.batch import encode, micro_batches, pack
from hybridcore.forward import batched, sequence_scores
from hybridcore.models import load_tokenizer, resident
from stages import data
from stages.common import check_prompt_room, device, frozen, load_policy, load_scorer, seed_all


@torch.no_grad()
def answers(policy, tok, prompts: list[list[int]], cfg) -> list[list[int]]:
    actor = HybridActor(frozen(policy), tok)
    out = []
    with actor.rollout():
        for s in micro_batches(len(prompts), cfg.batch_size):
            out += actor.generate(prompts[s], cfg.max_new_tokens, greedy=True)
    return out


def run(p, inputs: dict[str, Path], out: Path, sink) -> dict:
    cfg = p.evaluate
    seed_all(p.pipeline.seed)
    tok = load_tokenizer(str(inputs["sft"] / "model"))
    rm = frozen(load_scorer(p, inputs["reward"] / "model", "reward", tok.pad_token_id))
    home = torch.device("cpu") if p.engine.roles.reward.offload else None  # the RM waits there while policies run
    if home is not None:
        rm.to(home)
    held = data.load("prompts", p).heldout
    texts = held["prompt"]
    gold = held["answer"] if "answer" in held.column_names else [None] * len(texts)
    prompts, _ = encode(tok, texts)
    metrics, rows = {"prompts": len(prompts)}, [dict(prompt=t, answer=a) for t, a in zip(texts, gold)]
    for name in ("sft", "ppo"):
        policy = load_policy(p, inputs[name] / "model", "actor")
        check_prompt_room(policy, texts, prompts, cfg.max_new_tokens, "evaluate.max_new_tokens",
                          "data.prompts (held out)")
        responses = answers(policy, tok, prompts, cfg)
        del policy  # the next policy loads in its place
        with resident(rm, device(p), home):
            rewards = batched(sequence_scores, rm, pack(prompts, responses, tok.pad_token_id, rm.device),
                              cfg.batch_size)
        decoded = tok.batch_decode(responses, skip_special_tokens=True)
        checks = [data.check_answer(r, a) for r, a in zip(decoded, gold)]
        metrics[f"{name}_reward"] = float(rewards.mean())
        if all(c is not None for c in checks):
            metrics[f"{name}_accuracy"] = sum(checks) / len(checks)
        for row, text, r, c in zip(rows, decoded, rewards.tolist(), checks):
            row.update({f"{name}_response": text, f"{name}_reward": r, f"{name}_correct": c})
    metrics["reward_gain"] = metrics["ppo_reward"] - metrics["sft_reward"]
    if "sft_accuracy" in metrics:
        metrics["accuracy_gain"] = metrics["ppo_accuracy"] - metrics["sft_accuracy"]
    sink.log(metrics, 0)
    with open(out / "samples.jsonl", "w", encoding="utf-8") as f:
        for row in rows[: cfg.samples]:
            f.write(json.dumps(row) + "\n")
    return metrics
