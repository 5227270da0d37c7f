"""Judge a finished run's exported folders with plain transformers, as a user's script would: the RM's score of
each evaluated answer against the reward the pipeline recorded, and the PPO policy's greedy answers through its
own tokenizer (chat template for turns) against the pipeline's rollout. Needs only torch + transformers, so it runs
on the GPU machine after bench/stages_smoke.sh.

    python bench/plain_check.py ARTIFACTS_DIR [--rows 32] [--device cuda]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


def only(root: Path, stage: str) -> Path:
    found = [p for p in (root / stage).iterdir() if p.is_dir() and not p.name.endswith(".partial")]
    assert len(found) == 1, f"expected one {stage} artifact under {root}, found {len(found)}"
    return found[0]


def inputs(tok, prompt, response=None, generation=False):
    if isinstance(prompt, list):  # turns: what apply_chat_template makes of them
        turns = prompt + ([{"role": "assistant", "content": response}] if response is not None else [])
        return tok.apply_chat_template(turns, add_generation_prompt=generation, tokenize=True, return_dict=True,
                                       return_tensors="pt")["input_ids"]
    return tok(prompt + (response or ""), return_tensors="pt")["input_ids"]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifacts")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    root = Path(a.artifacts)
    ev = only(root, "evaluate")
    rows = [json.loads(x) for x in (ev / "evaluation.jsonl").read_text().splitlines()][:a.rows]
    new = int(json.loads((ev / "manifest.json").read_text())["metrics"]["max_new_tokens"])  # as evaluation ran
    rm_dir, ppo_dir = only(root, "reward") / "model", only(root, "ppo") / "model"
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir).to(a.device).eval()
    tok = AutoTokenizer.from_pretrained(rm_dir)
    diffs = [abs(float(rm(input_ids=inputs(tok, r["prompt"], r["sft_response"]).to(a.device)).logits[0, 0])
                 - r["sft_reward"]) for r in rows]
    policy = AutoModelForCausalLM.from_pretrained(ppo_dir).to(a.device).eval()
    ptok = AutoTokenizer.from_pretrained(ppo_dir)
    same = 0
    for r in rows:
        ids = inputs(ptok, r["prompt"], generation=True).to(a.device)
        out = policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
        same += ptok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == r["ppo_response"]
    print(json.dumps({"rows": len(rows), "rm_max_abs_diff": max(diffs), "ppo_plain_generate_equal": same,
                      "conversational": isinstance(rows[0]["prompt"], list), "device": a.device}))


if __name__ == "__main__":
    main()
