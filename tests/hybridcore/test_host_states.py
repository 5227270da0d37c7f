"""engine.optimizer_states: host (optim.HostStates): AdamW's moments wait in host memory between steps and come to
the device only while the optimizer steps. On this CPU-only machine the move itself is a no-op; what is tested is
that training is bit-for-bit the same, that between steps the moments are the engine's own reused host buffers
(a checkpoint load's fresh tensors included), that the step counters are left alone, and the refusals."""
from __future__ import annotations

import pytest
import torch

from bench.micro import STEP_KW, micro_model
from hybridcore.engine import make_engine
from hybridcore.errors import InputError
from hybridcore.parallel import Layout
from stages.params import load_params
from tests.hybridcore.test_zero import train


def held_by_host_buffers(engine) -> dict:
    """{(param, name): storage pointer} of every moment, asserting each one is the engine's host buffer."""
    hs, seen = engine.host_states, {}
    for p, state, k, v in hs._moments():
        assert v is hs.host[id(p), k], k
        assert torch.is_tensor(state["step"]) and state["step"].dim() == 0  # the counter stays where it was
        seen[id(p), k] = v.untyped_storage().data_ptr()
    return seen


def test_host_states_train_bit_for_bit_from_reused_host_buffers(tmp_path):
    want = make_engine(micro_model(), **STEP_KW)
    want_norms = train(want, 3)
    engine = make_engine(micro_model(), host_states=True, **STEP_KW)
    norms = train(engine, 2)
    buffers = held_by_host_buffers(engine)
    n = sum(p.numel() for p in engine.trained)
    assert len(buffers) == 2 * len(engine.trained) and engine.host_states.nbytes() == 2 * 4 * n
    engine.save(tmp_path / "ckpt")
    norms += train(engine, 1, first=2)
    assert norms == want_norms
    assert held_by_host_buffers(engine) == buffers  # the same buffers again, not new ones
    for k, v in want.whole_state_dict().items():
        assert torch.equal(engine.whole_state_dict()[k], v), k

    resumed = make_engine(micro_model(seed=7), host_states=True, **STEP_KW)
    resumed.load(tmp_path / "ckpt")  # the loaded moments are fresh tensors on the parameters' device
    assert train(resumed, 1, first=2) == want_norms[2:]
    held_by_host_buffers(resumed)  # and back in host buffers after the next step
    for k, v in want.whole_state_dict().items():
        assert torch.equal(resumed.whole_state_dict()[k], v), k


def test_host_states_are_the_torch_engines():
    with pytest.raises(ValueError, match="host_states is the torch engine's"):
        make_engine(micro_model(), layout=Layout(zero_stage=1), host_states=True, cpu_adam=False, **STEP_KW)


@pytest.mark.parametrize("engine, message", [
    ({"optimizer_states": "host", "layout": {"zero_stage": 1}},
     r"^engine\.optimizer_states: host is the plain torch engine's, but engine\.layout asks for DeepSpeed; expected "
     r"device \(engine\.layout\.offload_optimizer"),
    ({"optimizer_states": "host", "rollout": {"offload_optimizer": True}},
     r"^engine\.rollout\.offload_optimizer: true, but engine\.optimizer_states: host already keeps the states off "
     r"the device between steps; expected false$"),
])
def test_host_states_refused_where_they_cannot_apply(engine, message):
    with pytest.raises(InputError, match=message):
        load_params("tiny", {"engine": engine})


def test_the_stages_trainer_reads_engine_optimizer_states():
    from stages.common import trainer
    kw = dict(lr=1e-3, steps=2, warmup_ratio=0.0, min_lr_ratio=1.0, max_grad_norm=1.0, micro_batch=1)
    assert trainer(load_params("tiny", {"engine": {"optimizer_states": "host"}}), micro_model(), **kw).host_states
    assert trainer(load_params("tiny"), micro_model(), **kw).host_states is None
