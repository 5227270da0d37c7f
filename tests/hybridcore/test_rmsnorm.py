"""hybridcore/rmsnorm.py: LlamaRMSNorm's forward and backward as Triton kernels, run under Triton's interpreter in a
process of its own (rmsnorm_worker.py), and which modules qualify."""
from pathlib import Path

import pytest
import torch

from hybridcore import rmsnorm
from tests.hybridcore.interpreted import run_interpreted
from tests.hybridcore.rmsnorm_worker import CASES

WORKER = Path(__file__).with_name("rmsnorm_worker.py")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(WORKER)


@pytest.mark.parametrize("case", CASES)
def test_kernels_compute_transformers_rmsnorm_and_its_gradient(results, case):
    """y and dx against LlamaRMSNorm's (relative to their largest value): float32 to its rounding, 16-bit to one
    rounding of the output (the sum of squares in another order can move a value across a rounding boundary);
    the same output dtypes (an fp32 weight over bf16 x gives fp32, as torch's promotion does); no rows, no launch."""
    r = results["rows"]["-".join(map(str, case))]
    tol = 1e-6 if case[1] == "float32" else 1e-2
    assert r["y"] <= tol and r["dx"] <= tol * 5, r
    assert r["dtypes"] == [True, True] and r["empty"] == [0, case[0]]


def test_a_loaded_models_norms_go_through_the_kernels(results):
    """load_causal_lm swaps every decoder norm and the final one; log-probs and adapter gradients of a 4-bit + LoRA
    model equal those through transformers' norms (float32: to rounding)."""
    m = results["model"]
    assert m["swapped"] == 2 * m["layers"] + 1
    assert m["calls"] == 2 * m["layers"] + 1  # one forward pass with the kernels, none without
    assert m["logprobs"] < 1e-4 and m["grads"] < 1e-3, m


def test_which_norms_qualify():
    """LlamaRMSNorm's forward and its copies (Qwen2's) qualify; Gemma's (1 + weight, in float32) does not; a
    swapped module swaps back, and on a CPU outside the interpreter the forward is transformers' own."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    assert rmsnorm.llama_form(LlamaRMSNorm(64)) and rmsnorm.llama_form(Qwen2RMSNorm(64))
    assert not rmsnorm.llama_form(GemmaRMSNorm(64))
    model = torch.nn.Sequential(LlamaRMSNorm(64), GemmaRMSNorm(64), torch.nn.Linear(64, 64))
    assert rmsnorm.install(model) == 1 and rmsnorm.install(model) == 0
    assert isinstance(model[0], LlamaRMSNorm) and type(model[0]) is not LlamaRMSNorm
    x = torch.randn(3, 64)
    assert torch.equal(model[0](x), LlamaRMSNorm.forward(model[0], x))  # a CPU: transformers' forward
    assert rmsnorm.install(model, fused=False) == 1 and type(model[0]) is LlamaRMSNorm
