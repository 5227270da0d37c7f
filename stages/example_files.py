"""The built-in task written out as users' files, in either documented format: a working example of each format
(`hybrid-rlhf example-data DIR [--conversational]`) and the input of the tests that run users' files.

Conversational rows follow TRL's conventions: SFT rows are two problems in one chat under a system turn (every
assistant turn is trained); preference rows alternate the explicit form (prompt turns, then chosen and rejected
assistant turns) and the implicit one (two whole conversations sharing their prompt); prompts are turns plus the
answer. Each file holds the built-in training rows and then its held-out rows; the pipeline re-splits a user's
file by data.heldout_fraction.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from stages import data

SYSTEM = "Add the numbers."


def _turn(role: str, content: str) -> dict:
    return {"role": role, "content": content.strip()}


def _question(prompt: str) -> list[dict]:
    return [_turn("system", SYSTEM), _turn("user", prompt)]


def standard_rows(kind: str, params) -> list[dict]:
    split = data.load(kind, params)
    return split.train.to_list() + split.heldout.to_list()


def conversational_rows(kind: str, params) -> list[dict]:
    rows = standard_rows(kind, params)
    if kind == "sft":  # two demonstrations per conversation, both trained
        return [{"messages": [*_question(a["prompt"]), _turn("assistant", a["response"]), _turn("user", b["prompt"]),
                              _turn("assistant", b["response"])]} for a, b in zip(rows[0::2], rows[1::2])]
    if kind == "preferences":
        out = []
        for i, r in enumerate(rows):
            chosen, rejected = [_turn("assistant", r["chosen"])], [_turn("assistant", r["rejected"])]
            if i % 2 == 0:
                out.append({"prompt": _question(r["prompt"]), "chosen": chosen, "rejected": rejected})
            else:  # implicit prompt: the shared turns of the two conversations
                out.append({"chosen": _question(r["prompt"]) + chosen, "rejected": _question(r["prompt"]) + rejected})
        return out
    return [{"prompt": _question(r["prompt"]), "answer": r["answer"]} for r in rows]


def write(out_dir: Path, params, conversational: bool) -> dict[str, Path]:
    """sft.jsonl, preferences.jsonl and prompts.jsonl under out_dir, and reward.py (a verifier for
    ppo.reward_function: stages/example_reward.py); returns {kind: path}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind in data.KINDS:
        rows = (conversational_rows if conversational else standard_rows)(kind, params)
        paths[kind] = out_dir / f"{kind}.jsonl"
        paths[kind].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    shutil.copyfile(Path(__file__).with_name("example_reward.py"), out_dir / "reward.py")
    return paths
