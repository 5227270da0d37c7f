"""The one-pass sampler (hybridcore/sampling.py): its kernel under Triton's interpreter against torch's argmax and
log-softmax, its draws against softmax(logits / T), and the native rollout through it; the torch path and the
calls the kernel refuses in this process (no TRITON_INTERPRET: the kernel cannot run on this CPU)."""
import math
from pathlib import Path

import pytest
import torch

from hybridcore import sampling
from tests.hybridcore.interpreted import run_interpreted
from tests.hybridcore.sampling_worker import DRAWS, LEVELS, TEMPERATURE, VOCABS

WORKER = Path(__file__).with_name("sampling_worker.py")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(WORKER)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_is_torch_argmax_and_logp_its_log_softmax(results, vocab, dtype):
    """Vocabularies under one block of lanes, exactly one and three and a bit (split among 4 programs a row); a
    tie across blocks (the first column wins, as torch.argmax), a row -inf but one column, a row all -inf (column 0,
    as argmax)."""
    k = results["kernel"]
    assert k["splits"][str(VOCABS[-1])] == 4 and k["splits"][str(VOCABS[0])] == 1
    assert k["greedy"][f"{vocab}-{dtype}"]
    assert k["logp_err"][f"{vocab}-{dtype}"] <= 1e-6  # fp32 sums in another order
    assert all(tok == 0 and not_finite for tok, not_finite in k["all_inf_row"])


def test_draws_follow_softmax_over_temperature(results):
    """DRAWS rows of the same bf16 logits at T = 0.7: each level's frequency within 4 standard errors of
    softmax(logits / T) (at T = 1 the most likely level would be 0.51, not 0.68: 8 errors off)."""
    p = torch.tensor(LEVELS).bfloat16().float().div(TEMPERATURE).softmax(-1).tolist()
    for got, want in zip(results["kernel"]["freq"], p):
        assert abs(got - want) <= 4 * math.sqrt(want * (1 - want) / DRAWS) + 1 / DRAWS, (got, want)
    assert results["kernel"]["sampled_logp_err"] <= 1e-6  # the log-prob under the raw logits, not over T


def test_draws_repeat_under_torch_seed_and_differ_otherwise(results):
    k = results["kernel"]
    assert k["repeats_under_seed"] and k["next_call_differs"] and k["rows_differ"]


def test_native_rollout_through_the_kernel_equals_the_torch_sampler(results):
    """A tiny Llama's greedy rollout: every step's token drawn by the kernel, the same tokens and log-probs as
    with the torch sampler."""
    fused, plain = results["rollout"]["fused"], results["rollout"]["torch"]
    assert fused["kernel_calls"] == 12 and plain["kernel_calls"] == 0
    assert fused["tokens"] == plain["tokens"]
    assert max(abs(a - b) for ra, rb in zip(fused["logp"], plain["logp"]) for a, b in zip(ra, rb)) <= 1e-5


def test_torch_path_on_this_cpu():
    """Without the interpreter the kernel cannot run here: the default takes torch's sampler, whose log-prob is
    the sampled token's under the raw logits."""
    x = torch.randn(4, 50)
    assert not sampling.fused_applies(x)
    tok, lp = sampling.draw(x, temperature=0.5)
    assert torch.allclose(lp, torch.log_softmax(x, -1).gather(1, tok[:, None]).squeeze(1))
    tok, _ = sampling.draw(x, greedy=True)
    assert torch.equal(tok, x.argmax(-1))


@pytest.mark.parametrize("kwargs", [{}, {"top_k": 5}, {"top_p": 0.9}])
def test_fused_refused_where_it_cannot_run(kwargs, monkeypatch):
    """fused=True on a CPU without the interpreter, or with top-k / top-p (they need a sort), fails in one line
    naming what it takes."""
    if kwargs:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the device would do: the truncation is what is refused
    with pytest.raises(ValueError, match="without top-k / top-p; got"):
        sampling.draw(torch.randn(2, 50), fused=True, **kwargs)
