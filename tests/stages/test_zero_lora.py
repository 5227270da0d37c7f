"""DeepSpeed ZeRO-1/2 over LoRA adapters on a frozen 4-bit/8-bit base (params/test-qlora.yaml), in one process.

DeepSpeed sees only the trained parameters (hybridcore/zero.py TrainedOnly), so ZeRO changes where AdamW's states
live, not the maths: SFT under ZeRO-2 with the states offloaded to the CPU (DeepSpeedCPUAdam) ends where plain AdamW
ends, within float rounding (fp32 adapters: 2e-5); PPO with share_base (two adapters + a value head on one 4-bit base)
runs under ZeRO-2 and ends where plain AdamW ends; and a stopped run resumes from DeepSpeed checkpoints that hold the
adapters alone."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridcore.errors import InputError
from hybridcore.interrupts import FAULT_ENV, Interrupted, clear_stop
from stages.keys import stage_keys
from stages.params import load_params
from stages.runner import run_stage

SFT = {"epochs": 2, "checkpoint_every": 3}
ZERO2_OFFLOAD = {"zero_stage": 2, "offload_optimizer": True}


def params(root: Path, layout: dict | None = None):
    return load_params("test-qlora", {"pipeline": {"artifacts_dir": str(root)}, "sft": SFT,
                                      "engine": {"layout": layout or {}, "rollout": {"offload_optimizer": False}}})


def tensors(artifact) -> dict[str, torch.Tensor]:
    """The merged model and the adapters (and value head) an artifact holds."""
    out = {f"model/{k}": v for k, v in load_file(str(Path(artifact) / "model" / "model.safetensors")).items()}
    for f in sorted((Path(artifact) / "adapter").rglob("*.safetensors")):
        out.update({f"{f.relative_to(artifact)}/{k}": v for k, v in load_file(str(f)).items()})
    return out


def assert_close(a, b, atol: float) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys() and any("lora" in k for k in ta)
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=0, atol=atol, msg=k)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """SFT, RM and PPO of the QLoRA + share_base preset with plain AdamW."""
    p = params(tmp_path_factory.mktemp("plain"))
    keys = stage_keys(p)
    return {s: run_stage(p, s, keys) for s in ("sft", "reward", "ppo")}


@pytest.fixture(scope="module")
def zero2_offload(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero2-offload")
    p = params(root, ZERO2_OFFLOAD)
    return root, run_stage(p, "sft", stage_keys(p))


@pytest.fixture
def backends(watch_engine_steps) -> list[str]:
    """The training-engine backends that stepped during the test, and what DeepSpeed was given to train."""
    return watch_engine_steps(lambda e: (e.backend, sorted(n for n, _ in e.module.named_parameters())))


def test_zero_over_lora_and_quantised_roles_is_accepted():
    p = load_params("test-qlora", {"engine": {"layout": {"zero_stage": 1}, "rollout": {"offload_optimizer": False}}})
    assert p.engine.layout.zero_stage == 1 and p.engine.share_base
    with pytest.raises(InputError, match="engine.rollout.offload_optimizer: true under ZeRO"):
        load_params("test-qlora", {"engine": {"layout": {"zero_stage": 2}}})  # the preset's rollout offload


def test_qlora_sft_under_zero2_cpu_offload_matches_plain_adamw(plain, zero2_offload):
    _, result = zero2_offload
    assert result.metrics["optimizer_device_mib"] == 0 and result.metrics["optimizer_cpu_mib"] > 0
    # AdamW's states are for the adapters only: two fp32 moments + an fp32 master copy, well under the base's size
    assert result.metrics["optimizer_cpu_mib"] < 1.0
    assert result.metrics["steps"] == plain["sft"].metrics["steps"]
    assert_close(result.artifact, plain["sft"].artifact, atol=2e-5)


def test_share_base_ppo_under_zero2_runs_and_matches_plain_adamw(plain, tmp_path, backends):
    p = params(tmp_path, {"zero_stage": 2})
    keys = stage_keys(p)
    results = {s: run_stage(p, s, keys) for s in ("sft", "reward", "ppo")}
    assert {b for b, _ in backends} == {"deepspeed"}
    trained = {name for _, names in backends for name in names}
    assert trained and all("lora" in n or n.startswith("value_head") or n.startswith("score") for n in trained), \
        sorted(trained)[:5]
    assert results["ppo"].metrics["steps"] == 2
    assert_close(results["ppo"].artifact, plain["ppo"].artifact, atol=5e-5)


def test_stopped_qlora_sft_under_zero2_resumes_from_adapter_only_checkpoint(zero2_offload, tmp_path, monkeypatch,
                                                                           capsys):
    """SIGTERM before step 3: a checkpoint after step 4 (DeepSpeed's files: adapters only), Interrupted; the rerun
    resumes there and ends where the uninterrupted ZeRO-2 run ends."""
    _, whole = zero2_offload
    p = params(tmp_path, ZERO2_OFFLOAD)
    monkeypatch.setenv(FAULT_ENV, "sft:term:3")
    try:
        with pytest.raises(Interrupted):
            run_stage(p, "sft", stage_keys(p))
    finally:
        clear_stop()
    monkeypatch.delenv(FAULT_ENV)
    ckpt = next((tmp_path / "sft").glob("*.partial")) / "checkpoints" / "step-4"
    states = list((ckpt / "engine").rglob("*model_states.pt"))
    assert states, sorted(str(x) for x in ckpt.rglob("*"))
    module = torch.load(states[0], map_location="cpu", weights_only=False)["module"]
    assert module and all("lora" in k for k in module), sorted(module)[:5]  # no base weight in the checkpoint
    capsys.readouterr()
    resumed = run_stage(p, "sft", stage_keys(p))
    assert "sft: resuming from step-4" in capsys.readouterr().out
    assert resumed.metrics["steps"] == whole.metrics["steps"]
    assert_close(resumed.artifact, whole.artifact, atol=1e-6)
