"""The flash-decoding attention (hybridcore/decode_attention.py) under Triton's interpreter against the plain masked
softmax over the filled columns, the native rollout's greedy tokens through it against SDPA's, and the calls it
refuses. The kernels run in a process of their own (decode_attention_worker.py): TRITON_INTERPRET only takes effect
when set before triton is first imported. The refusals are checked here: they come before any kernel is imported."""
from pathlib import Path

import pytest
import torch

from hybridcore import decode_attention
from hybridcore.triton_device import runs_on
from tests.hybridcore.decode_attention_worker import CASES, NEW_TOKENS, PROMPTS
from tests.hybridcore.interpreted import run_interpreted

WORKER = Path(__file__).with_name("decode_attention_worker.py")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(WORKER)


@pytest.fixture(scope="module")
def rollouts(results) -> dict:
    return results["rollouts"]


@pytest.mark.parametrize("g, d, dtype, filled", CASES)
def test_kernel_equals_the_masked_softmax_over_the_filled_columns(results, g, d, dtype, filled):
    """1, 4 and 6 query heads a KV head, head_dim 64 and 128, over 3 chunks of 32 columns in tiles of 16: `filled`
    inside a tile, 1 and the whole cache; left padding that masks a whole chunk, a hole inside one. The columns
    from `filled` on are NaN in k and v, so reading one would show. Max |error| relative to the max |reference|:
    fp32 sums in another order only; bf16 rounds p for the second product and the output (the interpreter
    truncates). -1: wrong shape, dtype or a NaN."""
    err = results["err"][f"{g}-{d}-{dtype}-{filled}"]
    assert 0 <= err <= (1e-5 if dtype == "float32" else 2e-2), err


def test_default_tiles_through_the_custom_op(results):
    """attend (the op torch.compile sees) with DEFAULTS: 2 chunks of 128 columns, the second filled to 22."""
    assert 0 <= results["err"]["defaults"] <= 2e-2


def test_filled_as_a_0d_int32_tensor(results):
    assert results["int32_scalar_filled"] == 0.0


def test_filled_past_the_capacity_reads_only_the_cache(results):
    """A `filled` beyond C (the rollout never passes one) is read as C, not as a licence to read past the cache."""
    assert results["filled_past_capacity"] == 0.0


def test_a_row_with_nothing_to_attend_gives_zeros_not_nan(results):
    assert results["masked_row"] == 0.0


def test_self_check_passes(results):
    """What the rollout runs before it decodes through the kernels (default tiles): None, nothing wrong."""
    assert results["self_check"] == {"128-6-bfloat16": None, "64-1-float32": None}


def test_rollout_through_the_kernel_gives_sdpas_greedy_tokens(rollouts):
    """A Qwen2 with 2 query heads a KV head (head_dim 32), 4 left-padded prompts, rows stopping at EOS and rows
    running to the end, decode steps crossing from one chunk of the cache into the next: the same greedy tokens,
    the same log-probs to fp32 rounding."""
    sdpa, filled = rollouts["sdpa"], rollouts["filled"]
    assert len(sdpa["tokens"]) == PROMPTS and filled["tokens"] == sdpa["tokens"]
    assert any(len(r) < NEW_TOKENS for r in sdpa["tokens"]) and any(len(r) == NEW_TOKENS for r in sdpa["tokens"])
    for a, b in zip(filled["logps"], sdpa["logps"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert (sdpa["attention"], filled["attention"]) == ("sdpa", "filled")


def test_only_the_decode_steps_attend_through_the_kernel(rollouts):
    """Once per layer (2) and decode step (the first token comes from the prefill), one query row per query head of
    a KV head; the prefill stays on SDPA, and attention="sdpa" never calls the kernel. Before the rollout, the
    kernel's self-check once (2 rows)."""
    calls = rollouts["filled"]["calls"]
    assert calls == [[2, 2]] + [[PROMPTS, 2]] * (2 * (NEW_TOKENS - 1))
    assert rollouts["sdpa"]["calls"] == []


def test_the_decode_step_compiles_to_one_graph_around_the_kernel(rollouts):
    """torch.compile sees the kernel as one opaque op (hybridcore::decode_attention): the whole step is one graph,
    no break; through aot_eager (the op's fake, functionalisation) its logits are the plain step's, and SDPA's to
    fp32 rounding."""
    got = rollouts["compiled_step"]
    assert (got["graphs"], got["breaks"]) == (1, 0), got
    assert got["max_diff"] < 1e-5 and got["sdpa_diff"] < 1e-5, got


def call(q=(2, 2, 4, 64), k=(2, 2, 48, 64), dtype=torch.float32, mask=(2, 48), filled=torch.tensor([5]), **cfg):
    return decode_attention.launch(torch.zeros(q, dtype=dtype), torch.zeros(k, dtype=dtype),
                                   torch.zeros(k, dtype=dtype), torch.ones(mask, dtype=torch.bool), filled, 0.1, **cfg)


@pytest.mark.parametrize("kwargs, message", [
    (dict(q=(2, 4, 64)), "q, k, v have 3, 4, 4 dimensions, expected 4"),
    (dict(q=(2, 2, 4, 48), k=(2, 2, 48, 48)), "head_dim 48, expected a power of two from 16 to 256"),
    (dict(q=(2, 2, 65, 64)), "65 query heads per KV head, expected 1 to 64"),
    (dict(k=(2, 1, 48, 64)), "expected both [2, 2, C, 64]"),
    (dict(dtype=torch.int32), "expected one of float32, bfloat16, float16"),
    (dict(mask=(2, 40)), "mask is torch.bool (2, 40), expected torch.bool (2, 48)"),
    (dict(filled=torch.tensor([5.0])), "filled is torch.float32 of 1 elements, expected one int32 or int64"),
    (dict(chunk=40, block_n=16), "chunk 40, expected a positive multiple of block_n 16"),
    (dict(block_n=8), "block_n 8, expected a power of two >= 16")])
def test_bad_calls_are_refused(kwargs, message):
    with pytest.raises(ValueError, match="decode_attention.attend: ") as e:
        call(**kwargs)
    assert message in str(e.value)


def test_runs_on_cuda_or_under_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert runs_on(torch.device("cuda")) and not runs_on(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runs_on(torch.device("cpu"))
