"""The tiny default pipeline as torchrun jobs of two data-parallel ranks (engine.layout.dp=2, gloo on CPU),
through the CLI and the flow like any run: it still learns by the same bars as the one-process run. PPO runs 8 of
the preset's 40 iterations: its gain comes in the first few (3 iterations at dp=1 already reach 99 % task accuracy
from SFT's 69 %), and each is a full two-rank rollout, update and exchange, so the other 32 only add time."""
from __future__ import annotations

import json
import time

from tests.conftest import ROOT, run_cli


def test_tiny_pipeline_learns_with_two_data_parallel_ranks(tmp_path):
    t0 = time.time()
    proc = run_cli(["run", str(ROOT / "params" / "tiny.yaml"), "--set", "engine.layout.dp=2", "--set",
                    "ppo.iterations=8", "--summary-json", "summary.json"], tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = json.loads((tmp_path / "summary.json").read_text())["stages"]
    for stage in ("sft", "reward", "ppo"):  # each ran as a two-rank job: one stderr log per rank in its artifact
        assert len(list((tmp_path / s[stage]["artifact"] / "logs").rglob("stderr.log"))) == 2, stage
    assert s["reward"]["metrics"]["heldout_accuracy"] > 0.75
    ev = s["evaluate"]["metrics"]
    assert ev["prompts"] >= 200
    assert ev["ppo_reward"] > ev["sft_reward"]
    assert ev["ppo_accuracy"] >= ev["sft_accuracy"] + 0.03
    assert time.time() - t0 < 900
