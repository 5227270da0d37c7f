"""bench/nf4_decode.py --tiny on CPU (Triton's interpreter, toy shapes, no graphs): the script end to end for its
baselines and LoRA rows, each checked against its fp32 reference (the rows with a LoRA adapter against
x @ W^T + x @ A^T @ B^T * scale). The kernel configs themselves are tests/hybridcore/test_nf4.py's cases."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_checks_the_lora_rows(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself, before triton's first import
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "nf4_decode.py"), "--tiny", "--batches", "8",
                           "--budget-s", "1", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "nf4_decode.json").read_text())
    rows = res["steps"]["8"]
    assert res["lora_rows"] == ["bnb+lora_peft", "auto+lora_peft", "auto+lora_epilogue", "auto+lora_epilogue_fp32",
                                "grouped+lora_epilogue", "grouped_pair+lora_epilogue", "grouped_pair2+lora_epilogue"]
    assert res["lora_rank"] == 16
    # grouped: q/k/v and gate/up a launch each
    for name in ("bnb", "grouped", "grouped_pair", "grouped_pair2", *res["lora_rows"]):
        assert rows[name]["ok"] and 0 <= rows[name]["err_eager"] < 0.02 and rows[name]["ms"] > 0, (name, rows[name])
    assert res["skipped"]  # past --budget-s the configs are listed, not run
    per = res["per_projection"]  # each projection's linears alone, for the dense, fused and fused + LoRA rows
    for method in ("bf16", "auto", "auto+lora_epilogue"):
        assert set(per[method]) == {"q", "k", "v", "o", "gate", "up", "down"}
        assert all(r["us_per_call"] > 0 for r in per[method].values())
        # against the dequantised weight: bf16 is the unquantised one (its error is NF4's rounding, not checked)
        assert method == "bf16" or all(0 <= r["err"] < 0.02 for r in per[method].values()), per[method]
