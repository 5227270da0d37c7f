"""Rows made into token ids, the same way for every stage and for a user's own script.

- SFT: standard rows are `tok(prompt)` (the tokenizer's special tokens, e.g. BOS) then `response` + EOS;
  conversational rows are their chat-template rendering, trained on the assistant turns only (hybridcore/chat.py).
- The reward model reads one whole sequence and pools where `AutoModelForSequenceClassification` pools (the last
  token that is not padding): `tok(prompt + response)` for text, `apply_chat_template(conversation)` for turns. So
  the exported RM scores a text under plain transformers exactly as the pipeline scored it; PPO and evaluation
  score their samples through the same text.
- DPO reads each side of a preference pair as SFT reads a row, split at the response (`policy_pairs`): the prompt's
  ids, then the response + EOS (text) or the final assistant turn(s) (turns); only the response's log-probs count.
- Rollout prompts: `tok(prompt)`, or `apply_chat_template(turns, add_generation_prompt=True)`.

Lengths follow the data: a null `max_seq_len` is the longest row; a null `max_new_tokens` is the longest
response of the SFT and preference data (with its end token) plus 25 %, recorded by those stages as
`longest_response_tokens` and read back from their manifests.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hybridcore import chat
from hybridcore.errors import InputError, say
from stages import data

SLACK = 0.25  # max_new_tokens = the longest response seen x (1 + SLACK): a policy may write a little more


def prompt_ids(tok, text: str) -> list[int]:
    """`tok(text)` as a user's script calls it (BOS where the tokenizer adds one), minus a trailing EOS that a
    few tokenizers append: a prompt is continued, not ended."""
    ids = tok(text)["input_ids"]
    if ids and ids[-1] == tok.eos_token_id and tok(text, add_special_tokens=False)["input_ids"][-1:] != ids[-1:]:
        ids = ids[:-1]
    return ids


def scored_ids(tok, prompt, response, conversational: bool, where: str = "data") -> list[int]:
    """What the reward model reads for a prompt and a response: turns + assistant turn(s) rendered by the chat
    template, or the text prompt + response through the plain tokenizer call."""
    if conversational:
        turns = response if isinstance(response, list) else [{"role": "assistant", "content": response}]
        return chat.ids(tok, chat.render(tok, list(prompt) + turns, where=where))
    return tok(prompt + response)["input_ids"]


def reply_tokens(tok, turns_or_text, conversational: bool, where: str) -> int:
    """Tokens of the longest assistant reply in a response (text + EOS, or an assistant turn with its end)."""
    if not conversational:
        return len(tok(turns_or_text, add_special_tokens=False)["input_ids"]) + 1
    pieces = chat.segments(tok, turns_or_text, where)
    return max((len(chat.ids(tok, t)) for t, trained in pieces if trained), default=0)


def _fit(ds, lengths: list[int], limit: Optional[int], field: str, what: str, positions: Optional[int],
         report: bool = True) -> int:
    """The max_seq_len in force: `limit`, or (null) the longest row, never past the model's positions."""
    longest = max(lengths)
    cap = limit if limit is not None else positions
    for i, n in enumerate(lengths):
        if cap is not None and n > cap:
            why = f"over {field}={limit}" if limit is not None else f"over the model's {positions} positions"
            raise InputError(f"{what} {data.where(ds, i)}: {n} tokens long, {why} (expected at most {cap}: shorten "
                             f"it{' or raise ' + field if limit is not None else ''})")
    if limit is None and report:
        _once(f"{field}: {longest} (the longest row of {what}; set {field} to choose)")
    return limit if limit is not None else longest


_said: set[str] = set()


def _once(line: str) -> None:
    from hybridcore.parallel import is_main
    if line not in _said and is_main():
        _said.add(line)
        say(line)


def _longest_run(mask: list[int]) -> int:
    """The longest stretch of trained tokens: a conversation's longest assistant turn."""
    best = run = 0
    for m in mask:
        run = run + 1 if m else 0
        best = max(best, run)
    return best


@dataclass
class SftExamples:
    prompts: list[list[int]]
    responses: list[list[int]]
    masks: list[list[int]]       # 1 on the response tokens that carry loss (every assistant turn's)
    longest_reply: int           # tokens of the longest assistant reply, with its end token


def sft_examples(tok, ds, conversational: bool, limit: Optional[int], what: str, positions: Optional[int],
                 report: bool = True) -> SftExamples:
    """report: print a max_seq_len derived from the data (not when a stand-in tokenizer checks the rows)."""
    prompts, responses, masks, longest = [], [], [], 0
    for i, row in enumerate(ds):
        if conversational:
            at = f"{what} {data.where(ds, i)}"
            ids, mask = chat.encode(tok, row["messages"], at)
            k = max(mask.index(1), 1)  # the first token has nothing before it to be predicted from
            prompts.append(ids[:k])
            responses.append(ids[k:])
            masks.append(mask[k:])
            longest = max(longest, _longest_run(mask))
        else:
            prompts.append(prompt_ids(tok, row["prompt"]))
            responses.append(tok(row["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            masks.append([1] * len(responses[-1]))
            longest = max(longest, len(responses[-1]))
    _fit(ds, [len(a) + len(b) for a, b in zip(prompts, responses)], limit, "sft.max_seq_len", what, positions,
         report)
    return SftExamples(prompts, responses, masks, longest)


@dataclass
class PairExamples:
    chosen: list[list[int]]      # the RM's whole input for prompt + chosen
    rejected: list[list[int]]
    longest_reply: int


def pair_examples(tok, ds, conversational: bool, limit: Optional[int], what: str, positions: Optional[int],
                  report: bool = True, field: str = "reward.max_seq_len") -> PairExamples:
    chosen, rejected, longest = [], [], 0
    for i, row in enumerate(ds):
        where = f"{what} {data.where(ds, i)}"
        c = scored_ids(tok, row["prompt"], row["chosen"], conversational, where)
        r = scored_ids(tok, row["prompt"], row["rejected"], conversational, where)
        if c == r:
            raise InputError(f"{where}: chosen and rejected are the same tokens once rendered (a pair must differ)")
        chosen.append(c)
        rejected.append(r)
        for side in ("chosen", "rejected"):
            full = list(row["prompt"]) + row[side] if conversational else row[side]
            longest = max(longest, reply_tokens(tok, full, conversational, where))
    _fit(ds, [max(len(c), len(r)) for c, r in zip(chosen, rejected)], limit, field, what, positions, report)
    return PairExamples(chosen, rejected, longest)


@dataclass
class PolicyPairs:
    """Preference pairs as a policy reads them (DPO): each side's prompt ids, response ids and the response tokens
    whose log-probs are summed (as SFT tokenises a row: a text response + EOS, or the final assistant turn(s) with
    the template's end of turn; the prompt is what comes before, so it is never scored)."""
    chosen: SftExamples
    rejected: SftExamples
    longest_reply: int

    def __len__(self) -> int:
        return len(self.chosen.prompts)


def _policy_side(tok, prompt, response, conversational: bool, where: str):
    """(prompt ids, response ids, response mask, longest assistant reply) of one side of a preference pair."""
    if conversational:
        ids, mask, split = _cut_conversation(tok, list(prompt), list(response), where)
        longest = _longest_run(mask)
    else:  # as sft_examples: tok(prompt), then the response + EOS
        head = prompt_ids(tok, prompt)
        reply = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids, mask, split, longest = head + reply, [0] * len(head) + [1] * len(reply), len(head), len(reply)
    split = max(split, 1)  # the first token has nothing before it to be predicted from
    return ids[:split], ids[split:], mask[split:], longest


def _cut_conversation(tok, prompt: list, response: list, where: str) -> tuple[list[int], list[int], int]:
    """(ids, assistant mask, where the response starts) of prompt + response turns, encoded segment by segment as
    SFT encodes a conversation (chat.encode), the cut where the response's first assistant turn starts (after the
    generation prompt: the ids before it are what a rollout would feed)."""
    turns = prompt + response
    first = len(prompt) + next(i for i, t in enumerate(response) if t["role"] == "assistant")
    cut = len(chat.render(tok, turns[:first], generation_prompt=True, where=where)) if first else 0
    ids, mask, at, split = [], [], 0, None
    for text, trained in chat.segments(tok, turns, where):
        if at == cut:
            split = len(ids)
        piece = chat.ids(tok, text)
        ids, mask, at = ids + piece, mask + [int(trained)] * len(piece), at + len(text)
    if split is None:  # chat.segments cuts at every assistant turn, so only a safeguard
        raise InputError(f"{where}: the chat template's rendering of the prompt is not where the response starts; "
                         f"expected a template that only appends as turns are added")
    return ids, mask, split


def policy_pairs(tok, ds, conversational: bool, limit: Optional[int], what: str, positions: Optional[int],
                 field: str = "dpo.max_seq_len", report: bool = True) -> PolicyPairs:
    """Every preference row split into prompt and response for each side; a longer side than `limit` (null: the
    longest row) is an InputError naming the row."""
    sides = {"chosen": SftExamples([], [], [], 0), "rejected": SftExamples([], [], [], 0)}
    for i, row in enumerate(ds):
        where = f"{what} {data.where(ds, i)}"
        got = {k: _policy_side(tok, row["prompt"], row[k], conversational, where) for k in sides}
        if got["chosen"][:3] == got["rejected"][:3]:
            raise InputError(f"{where}: chosen and rejected are the same tokens once rendered (a pair must differ)")
        for k, ex in sides.items():
            a, b, m, longest = got[k]
            ex.prompts.append(a)
            ex.responses.append(b)
            ex.masks.append(m)
            ex.longest_reply = max(ex.longest_reply, longest)
    c, r = sides["chosen"], sides["rejected"]
    _fit(ds, [max(len(c.prompts[j]) + len(c.responses[j]), len(r.prompts[j]) + len(r.responses[j]))
              for j in range(len(c.prompts))], limit, field, what, positions, report)
    return PolicyPairs(c, r, max(c.longest_reply, r.longest_reply))


@dataclass
class PromptSet:
    """Rollout prompts: the ids the policy continues, the text a checker sees, the file's rows."""
    tok: object
    ids: list[list[int]]
    texts: list[str]              # the prompt as text (rendered with the generation prompt for turns)
    turns: list                   # the prompt's turns (conversational), else the texts again
    rows: list[dict]
    conversational: bool

    def scored(self, i: int, response_text: str) -> list[int]:
        """What the reward model reads for prompt i answered by `response_text` (decoded, special tokens off)."""
        return scored_ids(self.tok, self.turns[i], response_text, self.conversational)

    def answers(self) -> Optional[list[str]]:
        """Each row's `answer`, or None when the prompts have none."""
        if not all("answer" in r for r in self.rows):
            return None
        return [str(r["answer"]) for r in self.rows]


def prompt_set(tok, ds, what: str) -> PromptSet:
    conversational = data.is_conversational(ds, "prompts")
    ids, texts, turns = [], [], []
    for i, row in enumerate(ds):
        if conversational:
            text = chat.render(tok, row["prompt"], generation_prompt=True, where=f"{what} {data.where(ds, i)}")
            ids.append(chat.ids(tok, text))
            texts.append(text)
            turns.append(row["prompt"])
        else:
            ids.append(prompt_ids(tok, row["prompt"]))
            texts.append(row["prompt"])
            turns.append(row["prompt"])
    return PromptSet(tok, ids, texts, turns, data.rows(ds), conversational)


def longest_reply(inputs: dict[str, Path]) -> int:
    """The longest response of the SFT and preference data, as those stages recorded it in their manifests."""
    n = 0
    for stage in ("sft", "reward", "dpo"):
        if stage in inputs:
            metrics = json.loads((inputs[stage] / "manifest.json").read_text()).get("metrics", {})
            n = max(n, int(metrics.get("longest_response_tokens", 0)))
    return n


def max_new_tokens(limit: Optional[int], inputs: dict[str, Path], field: str, positions: Optional[int],
                   prompts: list[list[int]]) -> int:
    """`limit`, or (null) the longest response of the data + 25 % (at least 2 tokens more), within the context."""
    if limit is not None:
        return limit
    longest = longest_reply(inputs)
    n = longest + max(2, math.ceil(longest * SLACK))
    if positions is not None:  # a prompt too long for any reply is named by check_prompt_room
        n = max(1, min(n, positions - max(map(len, prompts))))
    _once(f"{field}: {n} (the longest SFT/preference response is {longest} tokens with its end, + 25 %; set "
          f"{field} to choose)")
    return n
