"""Out-of-memory back-off: an injected OOM mid-step is survived with the same effective batch and the same
update as running at the halved micro-batch from the start."""
from __future__ import annotations

import pytest
import torch

from hybridcore.errors import TrainingFault
from hybridcore.interrupts import FAULT_ENV
from hybridcore.oom import OomBackoff
from hybridcore.parallel import Layout
from hybridcore.engine import make_engine
from bench.micro import BATCH, STEP_KW, batch, micro_model, token_loss


def train(micro: int, steps: int, fault: str | None, monkeypatch, layout=None):
    """`steps` optimizer steps of BATCH rows at micro-batch `micro`; returns (weights, grad norms, backoff, log)."""
    if fault:
        monkeypatch.setenv(FAULT_ENV, fault)
    else:
        monkeypatch.delenv(FAULT_ENV, raising=False)
    model = micro_model()
    engine = make_engine(model, layout=layout, cpu_adam=False, **STEP_KW)
    lines: list[str] = []
    backoff = OomBackoff("sft", micro, say=lines.append)
    norms, sizes = [], []
    for step in range(steps):
        ids = batch(seed=10 + step)
        n_tokens = ids[:, 1:].numel()

        def micro_step(rows: slice) -> float:
            sizes.append(rows.stop - rows.start)
            loss = token_loss(engine.model, ids[rows]) / n_tokens
            engine.backward(loss)
            return loss.item()

        backoff.run(step, BATCH, micro_step, engine.zero_grad)
        norms.append(engine.step())
    return engine.whole_state_dict(), norms, backoff, lines, sizes


@pytest.mark.parametrize("layout", [None, Layout(zero_stage=2), Layout(zero_stage=3)], ids=["torch", "zero2", "zero3"])
def test_injected_oom_halves_micro_batch_and_matches_halved_run(monkeypatch, layout):
    got, got_norms, backoff, lines, sizes = train(4, 3, "sft:oom:1", monkeypatch, layout)
    # reference: step 0 at micro-batch 4, steps 1-2 at micro-batch 2 (the size the back-off settles on)
    monkeypatch.delenv(FAULT_ENV, raising=False)
    model = micro_model()
    engine = make_engine(model, layout=layout, cpu_adam=False, **STEP_KW)
    ref_norms = []
    for step, micro in zip(range(3), (4, 2, 2)):
        ids = batch(seed=10 + step)
        n = ids[:, 1:].numel()
        for s in range(0, BATCH, micro):
            engine.backward(token_loss(engine.model, ids[s:s + micro]) / n)
        ref_norms.append(engine.step())
    ref = engine.whole_state_dict()
    assert backoff.micro_batch == 2 and backoff.backoffs == 1 and backoff.accumulation(BATCH) == 4
    assert len(lines) == 1 and "out of memory at step 1 with micro-batch 4 x 2" in lines[0] \
        and "micro-batch 2 x 4 (same 8 rows per step)" in lines[0], lines
    # step 0: 4+4; step 1: one micro-batch of 4 done, then the OOM, then 2+2+2+2; step 2: 2+2+2+2
    assert sizes == [4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2]
    # the partial gradients of the failed attempt were dropped: same norms and weights as the clean run
    assert got_norms == pytest.approx(ref_norms, rel=1e-6, abs=0)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-6)


def test_oom_at_micro_batch_one_is_a_clear_error(monkeypatch):
    with pytest.raises(TrainingFault, match=r"sft: out of memory at step 0 even with micro-batch 1"):
        train(1, 1, "sft:oom:0", monkeypatch)


def test_real_oom_error_type_is_caught(monkeypatch):
    """Not only the injected fault: any torch.OutOfMemoryError raised by the step triggers the back-off."""
    monkeypatch.delenv(FAULT_ENV, raising=False)
    backoff = OomBackoff("rm", 8, say=lambda _: None)
    calls = []

    def micro_step(rows: slice) -> float:
        calls.append(rows.stop - rows.start)
        if rows.stop - rows.start > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated by size)")
        return 1.0

    assert backoff.run(0, 8, micro_step, lambda: None) == 4.0
    assert backoff.micro_batch == 2 and calls == [8, 4, 2, 2, 2, 2]
