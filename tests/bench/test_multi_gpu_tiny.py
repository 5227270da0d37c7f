"""bench/multi_gpu.py at --shape tiny --gpus 2 on CPU/gloo: every layout of world 2 runs as its own torchrun job,
the JSON holds every figure, and the greedy rollouts of all layouts are the same tokens as transformers' own
greedy generate on the same weights (so the tp / dp / resharded paths roll out the one model)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "multi_gpu.py"


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_multi_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_bench(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """The bench in its own process group. The default timeout sits above the bench's own --budget-s 400 (past
    which it skips layouts, which the test names): on a fresh clone this is the suite's first DeepSpeed job, so
    it also builds DeepSpeed's CPU ops, and on a busy 2-core machine that took it past 240 s once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the driver kills its running torchrun job's group, then exits
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"bench did not finish in {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_tiny_world2_every_layout(tmp_path):
    mod = bench_module()
    r = run_bench(["--shape", "tiny", "--gpus", "2", "--out", str(tmp_path), "--budget-s", "400"])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads((tmp_path / "multi_gpu.json").read_text())
    rows = res["layouts"]
    assert [x["name"] for x in rows] == [x["name"] for x in mod.layouts(2)] == \
        ["one GPU", "dp=2 ZeRO-2", "tp=2", "tp=2 -> rollout tp=1"]
    s = mod.SHAPES["tiny"]
    for row in rows:
        assert "error" not in row and "skipped" not in row, row
        for k in ("step_s", "rollout_s", "scoring_s", "update_s", "tokens_per_s", "rollout_tokens_per_s",
                  "scaling_efficiency", "transition_enter_s", "transition_exit_s", "peak_gib_max", "build_s"):
            assert isinstance(row[k], float) and row[k] > 0 and math.isfinite(row[k]), (row["name"], k, row[k])
        # each phase is the slowest rank's: the slowest rank's step lies between the largest phase and their sum
        phases = (row["rollout_s"], row["scoring_s"], row["update_s"])
        assert max(phases) <= row["step_s"] <= sum(phases) + 1e-6
        assert row["tokens_per_s"] == s.batch * (s.prompt + s.new) / row["step_s"]
        assert len(row["peak_gib_per_rank"]) == row["world"] and min(row["peak_gib_per_rank"]) > 0
        assert row["transition_bytes"]["kv_cache"] > 0
        assert math.isfinite(row["policy_loss"]) and math.isfinite(row["value_loss"])
    base = rows[0]
    assert base["world"] == 1 and base["scaling_efficiency"] == 1.0
    for row in rows[1:]:
        assert row["scaling_efficiency"] == row["tokens_per_s"] / (2 * base["tokens_per_s"])
    # tp=2 rolls out 2-way (half the split weights gathered); rollout tp 1 regroups a whole copy on each rank
    assert "reshard_peak" not in rows[1]["transition_bytes"]
    assert rows[3]["transition_bytes"]["reshard_peak"] > rows[2]["transition_bytes"]["reshard_peak"] > 0

    # greedy: every layout's first rollout is transformers' greedy generate on the same weights and prompts
    assert res["tokens_equal"] is True
    from transformers import LlamaForCausalLM
    model = mod.build(LlamaForCausalLM, s.actor, torch.float32, torch.device("cpu"), seed=1).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, s.actor["vocab_size"], (s.batch, s.prompt), generator=gen)
    with torch.no_grad():
        ref = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=s.new, do_sample=False,
                             min_new_tokens=s.new, pad_token_id=mod.PAD)[:, s.prompt:].tolist()
    assert sum(len(set(row)) > 2 for row in ref) >= s.batch - 1, f"degenerate greedy tokens: {ref}"
    for row in rows:
        assert row["tokens"] == ref and row["tokens_match_first"] == 1.0, row["name"]
    md = (tmp_path / "multi_gpu.md").read_text()
    assert all(f"| {row['name']} | {row['world']} |" in md for row in rows)


def test_unknown_layout_is_one_line(tmp_path):
    r = run_bench(["--shape", "tiny", "--gpus", "2", "--out", str(tmp_path), "--only", "tp=3"], timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--only" in lines[0] and "'tp=3'" in lines[0] and "tp=2" in lines[0], r.stderr
