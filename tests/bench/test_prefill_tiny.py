"""bench/prefill.py --tiny on CPU: the compiled-against-eager prefill benchmark end to end (its rows, the compile
really taken, the first tokens compared), so the GPU call that times it cannot fail on the script itself."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_times_both_prefills(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "prefill.py"), "--tiny", "--repeats", "2",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "prefill.json").read_text())
    eager, compiled = res["rows"]["eager"], res["rows"]["compiled"]
    assert not eager["prefill_compiled"] and compiled["prefill_compiled"] and compiled["compile_error"] is None
    assert eager["prefill_s"] > 0 and compiled["prefill_s"] > 0 and len(compiled["prefill_s_all"]) == 2
    assert compiled["first_token_agreement"] == 1.0 and compiled["first_logprob_max_diff"] < 1e-3 and res["speedup"] > 0
