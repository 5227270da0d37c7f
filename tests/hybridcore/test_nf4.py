"""The fused NF4 kernel (hybridcore/nf4.py) under Triton's interpreter, against bitsandbytes' own dequantisation
followed by a plain matmul, on random NF4 weights. The kernel runs in a process of its own (nf4_worker.py):
TRITON_INTERPRET only takes effect when set before triton is first imported."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hybridcore.nf4_worker import MATMULS

WORKER = Path(__file__).with_name("nf4_worker.py")


@pytest.fixture(scope="module")
def results() -> dict:
    proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("nested", ["True", "False"])
def test_reference_dequantisation_equals_bitsandbytes(results, nested):
    """The nibble order (even column = high nibble), the code and the absmax blocks as bitsandbytes has them."""
    assert results["dequant_equal"][nested] is True


@pytest.mark.parametrize("lookup", ["select", "table"])
@pytest.mark.parametrize("m, n, k, split_k", MATMULS)
def test_fused_matmul_equals_dequantise_then_matmul(results, m, n, k, split_k, lookup):
    """Batches across the 16-row tile, N past a 32-wide block, K past a 128-wide chunk (masks on every edge), K
    split among programs that add into one output; shape and dtype kept (-1 when not)."""
    err = results["matmul_err"][f"{m}-{n}-{k}-{split_k}-{lookup}"]
    assert 0 <= err <= 1e-5


def test_leading_dimensions_and_bad_shapes(results):
    assert 0 <= results["leading_err"] <= 1e-5
    assert "takes 128" in results["bad_shape"]
