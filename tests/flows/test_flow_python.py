"""The flow called from Python, as a user or a deployment does: typed overrides are validated by
Prefect before a run is created."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = r"""
import json, sys
from flows import rlhf
from prefect.exceptions import ParameterTypeError
summary = rlhf(preset="test", overrides={"pipeline": {"artifacts_dir": "art"}, "tracking": {"enabled": False}})
try:
    rlhf(preset="test", overrides={"ppo": {"kl_coef": "lots"}})
    rejected = None
except ParameterTypeError as e:
    rejected = str(e)
print(json.dumps({"summary": summary, "rejected": rejected}))
"""


def test_flow_from_python_with_overrides(tmp_path):
    """rlhf(preset, overrides) runs the micro pipeline; a wrongly typed override is refused by Prefect,
    naming the field, before any run is created."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    stages = out["summary"]["stages"]
    assert list(stages) == ["sft", "reward", "ppo", "evaluate"]
    assert all((tmp_path / "art" / s / r["key"] / "manifest.json").is_file() for s, r in stages.items())
    assert out["summary"]["mlflow_run_id"] is None
    assert out["rejected"] and "kl_coef" in out["rejected"]
