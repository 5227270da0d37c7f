"""Responses cut at max_new_tokens are counted, warned about once, and named in the end-of-run summary."""
from __future__ import annotations

import torch

from flows.cli import summary_table
from stages import ppo


def test_truncated_fraction_counts_rows_that_hit_the_limit_without_ending():
    exp = {"ended": torch.tensor([True, False, False, True]),
           "mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]).float()}
    assert ppo.truncated_fraction(exp, 5) == 0.25  # row 2 only: row 4 ended on its last token


def test_one_warning_line_the_first_time(capsys):
    history = []
    for it, fraction in enumerate([0.05, 0.5, 0.6, 0.0]):
        history.append({"truncated_fraction": fraction})
        ppo.warn_truncated(fraction, it, 8, history)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: ppo iteration 1: 50% of responses hit ppo.max_new_tokens=8 without ending, so the "
                   "reward scored cut-off text (raise ppo.max_new_tokens; the summary counts such iterations)"]


def test_the_summary_says_so():
    stage = {"artifact": "/a/ppo/k", "key": "k", "cached": False}
    summary = {"stages": {
        "ppo": {**stage, "metrics": {"truncated_iterations": 7.0, "steps": 40.0, "max_new_tokens": 8.0,
                                     "truncated_fraction_last": 0.62}},
        "evaluate": {**stage, "metrics": {"prompts": 256.0, "sft_reward": 0.1, "ppo_reward": 0.2, "sft_ended": 0.97,
                                          "ppo_ended": 0.4, "max_new_tokens": 8.0}}}}
    text = summary_table(summary)
    assert ("warning: ppo: 7 of 40 iterations cut more than 10% of their responses at max_new_tokens=8 (last "
            "tenth: 62%)") in text
    assert "warning: evaluate: only 40% of PPO's answers ended within max_new_tokens=8" in text
    assert "SFT's answers" not in text
    summary["stages"]["ppo"]["metrics"]["truncated_iterations"] = 0.0
    summary["stages"]["evaluate"]["metrics"]["ppo_ended"] = 1.0
    assert "warning" not in summary_table(summary)
