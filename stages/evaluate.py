"""Evaluation: greedy answers of the SFT policy and of the trained one (the policy stage that ran: ppo or dpo) on
held-out prompts, scored by the reward model when the run trained one and, where the prompts carry an `answer`,
judged by a checker. Metrics are named by policy: `sft_accuracy`, `ppo_accuracy` or `dpo_accuracy`, ...

The checker is `evaluate.checker` ("FILE.py:NAME", called NAME(prompt, response, row) -> bool), else exact match
after whitespace normalisation (the built-in task: its answer is the response's first number). Exact match is
reported beside any checker, and so is the share of responses that ended (a stop token before max_new_tokens).
Every held-out row goes to evaluation.jsonl, the first `samples` to samples.jsonl.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch

from hybridcore.actor import HybridActor
from hybridcore.batch import micro_batches
from hybridcore.chat import stop_ids
from hybridcore.errors import TrainingFault
from hybridcore.forward import batched, sequence_scores, sequences
from hybridcore.models import load_tokenizer, resident
from stages import data, user_code
from stages.common import check_prompt_room, context_of, device, frozen, load_policy, load_scorer, seed_all
from stages.examples import PromptSet, max_new_tokens, prompt_set
from stages.params import policy_stage


def checker(p) -> Callable:
    """evaluate.checker, else the built-in task's first-number check or exact match for users' prompts."""
    if p.evaluate.checker is not None:
        return user_code.load(p.evaluate.checker, "evaluate.checker")
    return data.first_number if p.data.prompts.path is None else data.exact_match


class CheckerFault(TrainingFault):
    """The user's checker raised or returned something other than a bool."""


def verdicts(check: Callable, ps: PromptSet, responses: list[str], name: str) -> list[bool]:
    out = []
    for i, (text, response, row) in enumerate(zip(ps.texts, responses, ps.rows), 1):
        try:
            v = check(text, response, row)
        except Exception as e:
            raise CheckerFault(f"evaluate.checker raised {type(e).__name__} on held-out prompt {i} ({name} "
                               f"response {response[:40]!r}): {(str(e).splitlines() or [''])[0][:200]}") from None
        if not isinstance(v, bool) and not (type(v).__name__ == "bool_" and hasattr(v, "item")):
            raise CheckerFault(f"evaluate.checker returned {type(v).__name__} {v!r:.40} on held-out prompt {i}; "
                               f"expected True or False")
        out.append(bool(v))
    return out


@torch.no_grad()
def answers(policy, tok, prompts: list[list[int]], new_tokens: int, batch_size: int) -> list[list[int]]:
    actor = HybridActor(frozen(policy), tok)
    out = []
    with actor.rollout():
        for s in micro_batches(len(prompts), batch_size):
            out += actor.generate(prompts[s], new_tokens, greedy=True)
    return out


def new_tokens(p, inputs: dict[str, Path], positions: Optional[int], prompts: list[list[int]]) -> int:
    """evaluate.max_new_tokens, else ppo's, else derived from the data as PPO derives it."""
    limit = p.evaluate.max_new_tokens if p.evaluate.max_new_tokens is not None else p.ppo.max_new_tokens
    return max_new_tokens(limit, inputs, "evaluate.max_new_tokens", positions, prompts)


def run(p, inputs: dict[str, Path], out: Path, sink) -> dict:
    cfg = p.evaluate
    seed_all(p.pipeline.seed)
    tok = load_tokenizer(str(inputs["sft"] / "model"))
    judge = Judge(p, inputs, tok)
    ps = judge.ps
    policies = ["sft", policy_stage(p)]
    metrics = {"prompts": len(ps.ids)}
    rows = [{"prompt": row.get("prompt"), "prompt_text": t, "answer": a}  # prompt: as the file has it (text or turns)
            for row, t, a in zip(ps.rows, ps.texts, judge.gold or [None] * len(ps.ids))]
    for name in policies:
        policy = load_policy(p, inputs[name] / "model", "actor")
        n_new = new_tokens(p, inputs, context_of(policy), ps.ids)
        check_prompt_room(policy, ps.texts, ps.ids, n_new, "evaluate.max_new_tokens", data.source(p, "prompts"))
        responses = answers(policy, tok, ps.ids, n_new, cfg.batch_size)
        del policy  # the next policy loads in its place
        metrics.update(judge.policy(name, responses, rows))
    metrics["max_new_tokens"] = n_new
    trained = policies[1]
    for what in ("reward", "accuracy"):
        if f"sft_{what}" in metrics:
            metrics[f"{what}_gain"] = metrics[f"{trained}_{what}"] - metrics[f"sft_{what}"]
    sink.log(metrics, 0)
    for name, keep in (("evaluation.jsonl", rows), ("samples.jsonl", rows[: cfg.samples])):
        with open(out / name, "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(row) + "\n" for row in keep))
    return metrics


class Judge:
    """What a policy's answers are measured by: the RM (when the run trained one), the checker, exact match and
    whether the answer ended."""

    def __init__(self, p, inputs: dict[str, Path], tok):
        self.p, self.tok, self.stops = p, tok, stop_ids(tok)
        self.rm = None
        self.home = torch.device("cpu") if p.engine.roles.reward.offload else None  # the RM waits there
        if "reward" in inputs:
            self.rm = frozen(load_scorer(p, inputs["reward"] / "model", "reward", tok.pad_token_id))
            if self.home is not None:
                self.rm.to(self.home)
        self.ps = prompt_set(tok, data.load("prompts", p).heldout, data.source(p, "prompts"))
        self.gold, self.check = self.ps.answers(), checker(p)

    def rewards(self, decoded: list[str]) -> list[Optional[float]]:
        if self.rm is None:
            return [None] * len(decoded)
        scored = [self.ps.scored(i, text) for i, text in enumerate(decoded)]
        with resident(self.rm, device(self.p), self.home):
            return batched(sequence_scores, self.rm, sequences(scored, self.tok.pad_token_id, self.rm.device),
                           self.p.evaluate.batch_size).tolist()

    def policy(self, name: str, responses: list[list[int]], rows: list[dict]) -> dict:
        """`name`'s metrics; each row gets its answer and verdicts."""
        ps, metrics = self.ps, {}
        decoded = self.tok.batch_decode(responses, skip_special_tokens=True)
        rewards = self.rewards(decoded)
        ended = [bool(r) and r[-1] in self.stops for r in responses]
        if self.rm is not None:
            metrics[f"{name}_reward"] = sum(rewards) / len(rewards)
        metrics[f"{name}_ended"] = sum(ended) / len(ended)
        correct = exact = [None] * len(decoded)
        if self.gold is not None:
            correct = verdicts(self.check, ps, decoded, name)
            exact = [data.exact_match(t, r, row) for t, r, row in zip(ps.texts, decoded, ps.rows)]
            metrics[f"{name}_accuracy"] = sum(correct) / len(correct)
            metrics[f"{name}_exact_match"] = sum(exact) / len(exact)
        for row, text, r, c, e, end in zip(rows, decoded, rewards, correct, exact, ended):
            row.update({f"{name}_response": text, f"{name}_reward": r, f"{name}_correct": c,
                        f"{name}_exact_match": e, f"{name}_ended": end})
        return metrics
