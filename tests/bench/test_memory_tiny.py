"""bench/memory.py --shape tiny on CPU: the PPO memory bench end to end (the pipeline's PpoStep, the ledger's
phases, every ablation row of the tiny shape), its JSON complete. The GPU figures come from the same code paths."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def test_tiny_run_times_every_row(tmp_path):
    from bench.memory import PHASES, rows_for
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "memory.py"), "--shape", "tiny", "--out",
                           str(tmp_path), "--profile"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "memory-tiny.json").read_text())
    assert set(res["default"]["phases"]) == set(PHASES["gae"]) and res["default"]["peak_gib"] > 0
    assert res["rollout_stats"]["steps"] == res["workload"]["response"]
    assert "profile_error" not in res, res.get("profile_error")  # a failed profile is recorded, not raised
    prof = res["decode_profile"]  # --profile: the default actor's decode step, kernels by kind
    assert prof["kernels"]["kernels_per_unit"] > 0 and prof["eager_step_ms"] > 0 and prof["capacity"] >= 32
    assert prof["prefill"]["kernels"]["total_ms"] > 0
    step = res["step_profile"]  # and one more step's scoring and update
    assert step["kernels"]["kernels_per_unit"] > prof["kernels"]["kernels_per_unit"] and step["profiled_wall_s"] > 0
    check_step_attribution(step)
    rows = {r["row"]: r for r in res["ablation"]}
    assert list(rows) == [name for name, _, _ in rows_for("tiny")]
    assert "bitsandbytes 4-bit decode" not in rows  # on a CPU the default already decodes through bitsandbytes
    assert "transformers RMSNorm" not in rows and "peft LoRA forward" in rows  # its norms: transformers' there
    for name, row in rows.items():
        assert "error" not in row and "oom" not in row and row["step_s"] > 0, (name, row.get("error"))
    # a row whose rollout no earlier row built (another actor: the optimizer offloaded) rolls out once untimed
    # first; a row on the default's actor does not
    assert rows["optimizer offload on"]["rollout_warmup_s"] > 0
    assert "rollout_warmup_s" not in rows["optimizer states on the host"]
    assert "rollout warmed first" in (tmp_path / "memory-tiny.md").read_text()


def check_step_attribution(step: dict) -> None:
    """step_profile by phase and by operator: each trained phase's kernels (on CPU, top-level operators) inside its
    own wall time, every kernel placed, the longest kernels and operators (input shapes and dtypes) listed."""
    from bench.memory import SHAPES, STEP_TOP_KERNELS, STEP_TOP_OPS
    k = step["kernels"]
    phases = k["by_phase"]["phases"]
    for name in ("scoring", "actor_update", "critic_update"):
        p = phases[name]
        assert 0 < p["total_ms"] <= 1e3 * step["phase_wall_s"][name] * 1.05, (name, p, step["phase_wall_s"])
        assert p["ms_by_kind"]["gemm"] > 0 and p["kernels_per_unit"] == sum(p["kernels_by_kind"].values())
    assert abs(k["by_phase"]["unlinked_ms"]) < 1e-6 * k["total_ms"]  # on CPU every top-level operator is placed
    assert sum(p["kernels_per_unit"] for p in phases.values()) == k["kernels_per_unit"]
    assert len(k["top_kernels_ms"]) == STEP_TOP_KERNELS
    ops = k["top_ops"]
    assert len(ops) == STEP_TOP_OPS and [r["ms"] for r in ops] == sorted((r["ms"] for r in ops), reverse=True)
    for r in ops:
        assert r["calls"] > 0 and r["ms"] > 0 and abs(sum(r["ms_by_phase"].values()) - r["ms"]) < 1e-6 * r["ms"]
    hidden = str(SHAPES["tiny"][1]["hidden_size"])
    products = [r for r in ops if r["op"] == "aten::mm" and hidden in r["shapes"]]
    assert products and all(r["dtypes"].count(",") == 1 for r in products), products  # the two operands' dtypes
