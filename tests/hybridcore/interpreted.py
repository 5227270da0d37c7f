"""Run a worker script under Triton's interpreter in a process of its own (TRITON_INTERPRET only takes effect when
set before triton is first imported, and in the test session torch.compile imports it earlier) and read the JSON
it prints last."""
import json
import os
import subprocess
import sys
from pathlib import Path


def run_interpreted(worker: Path) -> dict:
    proc = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
