"""The training engines in one process: ZeRO-2 with CPU optimizer offload trains like plain AdamW, DeepSpeedCPUAdam
included; checkpoints resume exactly; ZeRO-3 refuses what it would get wrong."""
from __future__ import annotations

import os
import time

import pytest
import torch

from hybridcore import optim
from hybridcore.errors import InputError, NotYetSupported
from hybridcore.parallel import Layout
from hybridcore.engine import Engine, backend_for, make_engine
from hybridcore.zero import STALE_BUILD_S, clear_stale_build_locks, ds_config
from bench.micro import BATCH, MICRO, STEP_KW, batch, micro_model, token_loss

F32 = 4


def train(engine: Engine, steps: int, first: int = 0) -> list[float]:
    norms = []
    for step in range(first, first + steps):
        ids = batch(seed=100 + step)
        n = ids[:, 1:].numel()
        for s in range(0, BATCH, MICRO):
            engine.backward(token_loss(engine.model, ids[s:s + MICRO]) / n)
        norms.append(engine.step())
    return norms


def plain(steps: int):
    """optim.py's path, written out: the reference every backend must match."""
    model = micro_model()
    opt = optim.adamw(model, STEP_KW["lr"], STEP_KW["weight_decay"])
    sched = optim.warmup_cosine(opt, STEP_KW["total_steps"], STEP_KW["warmup_ratio"], STEP_KW["min_lr_ratio"])
    norms = []
    for step in range(steps):
        ids = batch(seed=100 + step)
        n = ids[:, 1:].numel()
        for s in range(0, BATCH, MICRO):
            (token_loss(model, ids[s:s + MICRO]) / n).backward()
        norms.append(optim.step(model, opt, sched, STEP_KW["max_grad_norm"]))
    return norms, model.state_dict(), sched.get_last_lr()[0]


def test_backend_choice_and_config():
    assert backend_for(Layout()) == "torch"
    assert backend_for(Layout(dp=2)) == backend_for(Layout(zero_stage=1)) == "deepspeed"
    cfg = ds_config(Layout(zero_stage=3, offload_optimizer=True, offload_params=True), bf16=True, max_grad_norm=0.5,
                    micro_batch=4, cpu_adam=True, bucket_elements=2 ** 20)
    z = cfg["zero_optimization"]
    assert (z["stage"], z["offload_optimizer"]["device"], z["offload_param"]["device"]) == (3, "cpu", "cpu")
    assert cfg["gradient_clipping"] == 0.5 and cfg["bf16"]["enabled"] is True
    assert cfg["managed_gradient_accumulation"] is False and cfg["gradient_accumulation_steps"] == 1


@pytest.mark.parametrize("cpu_adam", [False, True], ids=["torch-adamw", "DeepSpeedCPUAdam"])
def test_zero2_cpu_offload_matches_plain_adamw(cpu_adam):
    """3 steps of 4 micro-batches. Tolerance 1e-5 absolute on weights (measured: 2e-7 with torch AdamW on the
    offloaded partition, 1e-6 with DeepSpeedCPUAdam's vectorised update), 1e-5 relative on grad norms."""
    ref_norms, ref, ref_lr = plain(3)
    engine = make_engine(micro_model(), layout=Layout(zero_stage=2, offload_optimizer=True), micro_batch=MICRO,
                         cpu_adam=cpu_adam, **STEP_KW)
    if cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        assert isinstance(engine._client_optimizer, DeepSpeedCPUAdam)
    else:
        assert type(engine._client_optimizer) is torch.optim.AdamW
    norms = train(engine, 3)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert engine.lr == pytest.approx(ref_lr, rel=1e-12)
    got = engine.whole_state_dict()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    # optimizer states: fp32 master + two moments of every parameter (+ torch AdamW's step scalar per group)
    n = sum(p.numel() for p in engine.module.parameters())
    ob = engine.optimizer_bytes()
    assert ob["device"] + ob["cpu"] == F32 * 3 * n + (0 if cpu_adam else F32 * 2)
    # with an accelerator the offloaded states are all on the CPU; on a CPU-only machine both are host memory
    assert ob["device"] == 0


@pytest.mark.parametrize("layout", [Layout(), Layout(zero_stage=2, offload_optimizer=True)],
                         ids=["torch", "zero2-offload"])
def test_save_and_load_resume_exactly(tmp_path, layout):
    """2 steps, save, a fresh engine loads, 1 step == 3 uninterrupted steps (bit for bit on CPU)."""
    whole = make_engine(micro_model(), layout=layout, cpu_adam=False, **STEP_KW)
    want_norms = train(whole, 3)
    want = whole.whole_state_dict()
    first = make_engine(micro_model(), layout=layout, cpu_adam=False, **STEP_KW)
    train(first, 2)
    first.save(tmp_path / "ckpt")
    second = make_engine(micro_model(seed=7), layout=layout, cpu_adam=False, **STEP_KW)  # other weights
    second.load(tmp_path / "ckpt")
    assert second.lr == first.lr != make_engine(micro_model(), cpu_adam=False, **STEP_KW).lr  # schedule restored
    norms = train(second, 1, first=2)
    assert norms == [want_norms[2]]
    got = second.whole_state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_layout_needing_more_processes_than_running_is_refused():
    with pytest.raises(InputError, match=r"dp=2 x tp=1 = 2 processes, but this run has 1; start it with torchrun"):
        make_engine(micro_model(), layout=Layout(dp=2, zero_stage=1), cpu_adam=False, **STEP_KW)


def test_load_refuses_another_layout(tmp_path):
    make_engine(micro_model(), cpu_adam=False, **STEP_KW).save(tmp_path / "ckpt")
    other = make_engine(micro_model(), layout=Layout(zero_stage=1), cpu_adam=False, **STEP_KW)
    with pytest.raises(NotYetSupported, match=r"resharding.*#8"):
        other.load(tmp_path / "ckpt")


@pytest.mark.parametrize("layout", [Layout(zero_stage=3), Layout(zero_stage=3, offload_optimizer=True,
                                                                    offload_params=True)],
                         ids=["zero3", "zero3-offload-params"])
def test_zero3_accumulates_micro_batches_like_plain_adamw(layout):
    """3 steps of 4 micro-batches. ZeRO-3's gradients equal plain torch's to 2e-7 relative, but it clips with an
    fp64 norm, and AdamW turns a relative 1e-8 change of a gradient near eps (1e-8) into a change of up to
    lr in that weight: measured, one embedding weight of 98,624 moves 2.7e-4 (lr is 1e-2) and the whole update
    differs by 9e-5 of its norm. Tolerances: 1e-3 per weight and 5e-4 of the update's norm."""
    ref_norms, ref, _ = plain(3)
    start = micro_model().state_dict()
    engine = make_engine(micro_model(), layout=layout, micro_batch=MICRO, cpu_adam=False, **STEP_KW)
    assert engine.model is not engine.module  # forwards must go through DeepSpeed's engine (see DeepSpeedEngine)
    assert train(engine, 3) == pytest.approx(ref_norms, rel=1e-5)
    got = engine.whole_state_dict()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-3, msg=lambda m: f"{k}: {m}")
    off = sum(float(((got[k] - ref[k]) ** 2).sum()) for k in ref) ** 0.5
    update = sum(float(((ref[k] - start[k]) ** 2).sum()) for k in ref) ** 0.5
    assert off < 5e-4 * update
    n_params = sum(p.numel() for p in micro_model().parameters())  # one rank: its partition is everything
    held = engine.held_bytes()
    assert held["params"] == F32 * n_params and held["optimizer"] == F32 * (3 * n_params + 2)
    assert all(p.numel() == 0 for p in engine.module.parameters()), "ZeRO-3 left a parameter gathered"


def test_bf16_model_trains_with_fp32_master_weights():
    """precision bf16: DeepSpeed keeps bf16 parameters and an fp32 master partition with fp32 moments."""
    model = micro_model().to(torch.bfloat16)
    engine = make_engine(model, layout=Layout(zero_stage=2), micro_batch=MICRO, cpu_adam=False, **STEP_KW)
    ids = batch(seed=100)
    n = ids[:, 1:].numel()
    losses = []
    for _ in range(4):
        loss = token_loss(engine.model, ids) / n
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    n_params = sum(p.numel() for p in micro_model().parameters())
    held = engine.held_bytes()
    assert engine.module.model.embed_tokens.weight.dtype == torch.bfloat16
    assert held["params"] == 2 * n_params and held["optimizer"] == F32 * (3 * n_params + 2)


def test_a_killed_builds_lock_is_removed_and_a_running_builds_kept(tmp_path, capsys):
    """A build killed mid-way leaves OP/lock, on which torch's next build would wait forever."""
    old, fresh = tmp_path / "cpu_adam" / "lock", tmp_path / "deepspeed_shm_comm" / "lock"
    for lock in (old, fresh):
        lock.parent.mkdir()
        lock.touch()
    past = time.time() - STALE_BUILD_S - 60
    os.utime(old, (past, past))
    assert clear_stale_build_locks(tmp_path) == [old]
    assert not old.exists() and fresh.exists()
    err = capsys.readouterr().err
    assert str(old) in err and "did not finish" in err and len(err.strip().splitlines()) == 1
