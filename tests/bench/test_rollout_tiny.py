"""bench/rollout.py --tiny on CPU: the rollout benchmark end to end (native runs, the sampler rows beside torch's
sampler, the profile, the fp32 greedy check against transformers' generate, the transitions, the baselines), its
JSON complete. The GPU figures come from the same code paths."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_measures_every_section(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout.py"), "--tiny", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]  # 1: an error or a failed greedy check
    res = json.loads((tmp_path / "rollout.json").read_text())
    assert res["errors"] == {} and res["correctness"]["passed"]
    rows = {r["backend"]: r for r in res["native"]}
    for name in ("native-sample-T1", "native-sample-T1-torch-sampler", "native-greedy-torch-sampler"):
        assert rows[name]["tok_per_s"] > 0 and rows[name]["step_ms"] > 0, name
    assert {r["backend"] for r in res["hf"]} >= {"hf-dynamic", "hf-static"}


def test_tiny_run_of_chosen_sections_and_batch(tmp_path):
    """--sections native hf --batches 2: issue 16's figure and its generate baselines alone, at one batch size; the
    other sections are not run (no profile, no greedy check) and a clean run still exits 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout.py"), "--tiny", "--out", str(tmp_path),
                           "--sections", "native", "hf", "--batches", "2"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "rollout.json").read_text())
    assert res["errors"] == {} and set(res["section_s"]) == {"native", "hf"}
    assert "profile" not in res and "correctness" not in res
    assert {r["batch"] for r in res["native"] + res["hf"]} == {2}
    assert {r["backend"] for r in res["hf"]} == {"hf-dynamic", "hf-static"}
