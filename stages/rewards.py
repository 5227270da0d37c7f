"""PPO's reward of each response: reward_model_weight x the reward model's score (when the reward stage ran) plus
the user's ppo.reward_function (when named), then ppo.missing_eos_penalty for responses that never ended.

The function is the user's code, run in this process on decoded text: NAME(prompts, responses, rows) ->
list[float], one finite number per response. Whatever it does wrong stops the stage with one line naming the
function, the iteration and the response, since a silently bad reward would train the policy on nonsense.
"""
from __future__ import annotations

import math
import numbers
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from hybridcore.errors import TrainingFault
from hybridcore.forward import batched, sequence_scores, sequences
from stages import user_code

FIELD = "ppo.reward_function"


class RewardFunctionFault(TrainingFault):
    """ppo.reward_function raised, or returned other than one finite number per response."""


@dataclass
class Responses:
    """One rollout as the reward sources read it; row i is prompt i (text and the prompt file's row) answered by
    response i (decoded without special tokens)."""
    it: int
    prompts: list[str]
    texts: list[str]
    rows: list[dict]
    scored: Optional[object] = None  # the whole texts as token ids, what the RM reads (None when it does not)


class Rewards:
    """The run's reward sources, fixed at the start: the RM (its score x weight) and/or the user's function."""

    def __init__(self, cfg, uses_rm: bool, fn: Optional[Callable] = None, name: str = ""):
        self.cfg, self.uses_rm, self.fn, self.name = cfg, uses_rm, fn, name

    @classmethod
    def of(cls, p, inputs: dict) -> "Rewards":
        """From the params: the RM when the reward stage ran and weighs anything; the function when named."""
        spec = p.ppo.reward_function
        fn = user_code.load(spec, FIELD) if spec is not None else None
        return cls(p.ppo, "reward" in inputs and p.ppo.reward_model_weight > 0, fn,
                   f"{FIELD} {spec}" if spec is not None else "")

    def read(self, ps, tok, it: int, rows: list[int], responses: list[list[int]], device) -> Responses:
        """What the sources read of a rollout whose row j answered prompt `rows[j]` of the prompt set `ps`."""
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        scored = (sequences([ps.scored(i, t) for i, t in zip(rows, texts)], tok.pad_token_id, device)
                  if self.uses_rm else None)
        return Responses(it, [ps.texts[i] for i in rows], texts, [ps.rows[i] for i in rows], scored)

    def score(self, m, r: Responses, ended: torch.Tensor, micro: int) -> tuple[torch.Tensor, dict]:
        """(each response's reward [B], each source's own part when there are two: `rm_score`, `function_reward`)."""
        parts = {}
        if self.uses_rm:
            with m.resident("reward", m.rm):
                parts["rm_score"] = batched(sequence_scores, m.rm, r.scored, micro)
        if self.fn is not None:
            parts["function_reward"] = torch.tensor(self.call(r), dtype=torch.float32, device=ended.device)
        scores = None
        for name, part in parts.items():  # the weight on the RM's score only; 1.0 x a score is that score exactly
            part = part * self.cfg.reward_model_weight if name == "rm_score" else part
            scores = part if scores is None else scores + part
        if self.cfg.missing_eos_penalty is not None:
            scores = scores + (~ended).float() * self.cfg.missing_eos_penalty
        return scores, (parts if len(parts) > 1 else {})

    def call(self, r: Responses) -> list[float]:
        """The user's function on one rollout, its answer checked: one finite number per response."""
        try:
            out = self.fn(list(r.prompts), list(r.texts), list(r.rows))
        except Exception as e:  # the user's code: any error is theirs to see, in one line, with where it came from
            where = traceback.extract_tb(e.__traceback__)[-1]
            raise RewardFunctionFault(f"{self.name} raised {type(e).__name__} at ppo iteration {r.it} "
                                      f"({Path(where.filename).name} line {where.lineno}): "
                                      f"{(str(e).splitlines() or [''])[0][:200]}") from None
        try:
            values = list(out)
        except TypeError:
            values = None
        if values is None or len(values) != len(r.texts):
            found = f"{len(values)} values" if values is not None else f"a {type(out).__name__}"
            raise RewardFunctionFault(f"{self.name} returned {found} for {len(r.texts)} responses at ppo iteration "
                                      f"{r.it}; expected a list of {len(r.texts)} numbers, one per response")
        for i, v in enumerate(values):
            if not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise RewardFunctionFault(f"{self.name} returned {v!r:.40} for response {i} ({r.texts[i][:40]!r}) at "
                                          f"ppo iteration {r.it}; expected a finite number")
        return [float(v) for v in values]
