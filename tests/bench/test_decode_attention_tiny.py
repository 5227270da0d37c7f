"""bench/decode_attention.py --tiny on CPU (Triton's interpreter, one toy shape, no graphs): the script end to end,
every method right against the reference, its JSON complete. The GPU figures come from the same code paths."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_writes_every_method_right(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself, before triton's first import
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_attention.py"), "--tiny", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "decode_attention.json").read_text())
    methods = res["shapes"]["tiny"]["methods"]
    assert set(methods) == {"sdpa", "sdpa_sliced"} | {f"filled:{name}" for name in res["configs"]}
    for name, rows in methods.items():
        assert set(rows) == {"40", "95"}, name
        assert all(r["ok"] and r["err_eager"] < 2e-2 and r["us_per_layer"] > 0 for r in rows.values()), (name, rows)
    assert res["skipped"] == [] and res["defaults"]["partials"]["chunk"] > 0


def test_rollout_attention_tiny_writes_its_row(tmp_path):
    """bench/rollout_attention.py --tiny: the native rollout end to end on CPU (sdpa: the kernel needs CUDA)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "rollout_attention.py"), "--tiny", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads((tmp_path / "rollout_attention.json").read_text())["rows"]
    assert row["attention"] == "sdpa" and row["new_tokens"] == 16 and row["tok_per_s"] > 0 and row["prefill_s"] > 0
