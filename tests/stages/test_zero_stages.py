"""The stages on DeepSpeed ZeRO in one process (engine.layout.zero_stage 1-2, optimizer states optionally on
the CPU with DeepSpeedCPUAdam), and the out-of-memory back-off inside a stage.

ZeRO changes where optimizer states live and how gradients are reduced, not the maths: SFT and PPO under ZeRO-2
must end where plain AdamW ends (fp32, so within float rounding of the reductions). A stage killed under ZeRO
resumes from DeepSpeed's own checkpoint files (hash-verified first) and ends where the uninterrupted run ends."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridcore.errors import InputError
from hybridcore.interrupts import FAULT_ENV
from stages.keys import stage_keys
from stages.params import load_params
from stages.runner import run_stage
from tests.conftest import ROOT

ZERO2_OFFLOAD = {"zero_stage": 2, "offload_optimizer": True}
SFT = {"epochs": 2, "checkpoint_every": 3}


def weights(artifact) -> dict[str, torch.Tensor]:
    return load_file(str(Path(artifact) / "model" / "model.safetensors"))


def assert_close_weights(a, b, atol: float) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol, msg=k)


def params(root: Path, layout: dict | None = None, **sections):
    return load_params("test", {"pipeline": {"artifacts_dir": str(root)}, "sft": SFT,
                                "engine": {"layout": layout or {}}, **sections})


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """SFT, RM and PPO with plain AdamW: what ZeRO must reproduce."""
    p = params(tmp_path_factory.mktemp("plain"))
    keys = stage_keys(p)
    return {s: run_stage(p, s, keys) for s in ("sft", "reward", "ppo")}


@pytest.fixture
def backends(watch_engine_steps) -> list[str]:
    """The training-engine backends that stepped during the test (so a silently ignored layout cannot pass)."""
    return watch_engine_steps(lambda e: e.backend)


def test_sft_under_zero2_with_cpu_adam_offload_equals_plain_adamw(plain, tmp_path, backends):
    p = params(tmp_path, ZERO2_OFFLOAD)
    result = run_stage(p, "sft", stage_keys(p))
    assert backends and set(backends) == {"deepspeed"}
    assert result.metrics["optimizer_device_mib"] == 0 and result.metrics["optimizer_cpu_mib"] > 0
    assert result.key != plain["sft"].key  # the layout is part of the engine section, so of the key
    assert result.metrics["steps"] == plain["sft"].metrics["steps"]
    assert_close_weights(result.artifact, plain["sft"].artifact, atol=2e-5)


def test_ppo_under_zero2_equals_plain_adamw(plain, tmp_path, backends):
    """Actor and critic each on their own ZeRO-2 engine (states on the device), RM and SFT from the same recipe."""
    p = params(tmp_path, {"zero_stage": 2})
    keys = stage_keys(p)
    results = {s: run_stage(p, s, keys) for s in ("sft", "reward", "ppo")}
    assert set(backends) == {"deepspeed"}
    assert results["ppo"].metrics["actor_optimizer_cpu_mib"] > 0  # CPU machine: "device" memory is host memory
    assert_close_weights(results["reward"].artifact, plain["reward"].artifact, atol=2e-5)
    assert_close_weights(results["ppo"].artifact, plain["ppo"].artifact, atol=5e-5)


def test_kill_under_zero2_resumes_from_deepspeed_checkpoint(tmp_path):
    """SIGKILL at step 5 under ZeRO-2 + offload, rerun: resumes from step-3 (DeepSpeed's files, hashes checked)
    and ends where an uninterrupted ZeRO-2 run ends."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "stages.runner", str(ROOT / "params" / "test.yaml"), "sft",
            "--set", "engine.layout.zero_stage=2", "--set", "engine.layout.offload_optimizer=true",
            "--set", f"sft.epochs={SFT['epochs']}", "--set", f"sft.checkpoint_every={SFT['checkpoint_every']}"]

    def run(root: Path, fault: str | None = None):
        e = {**env, FAULT_ENV: fault} if fault else env
        return subprocess.run(args + ["--set", f"pipeline.artifacts_dir={root}"], env=e, capture_output=True,
                              text=True, timeout=900)

    whole = run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = run(tmp_path / "resumed", "sft:5")
    assert killed.returncode == -9, killed.stderr[-3000:]
    ckpt = next((tmp_path / "resumed" / "sft").glob("*.partial")) / "checkpoints" / "step-3"
    assert (ckpt / "engine" / "engine.json").is_file()
    assert "engine" in "".join(json.loads((ckpt / "checkpoint.json").read_text())["files"])
    resumed = run(tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step-3" in resumed.stdout
    a = json.loads(whole.stdout.strip().splitlines()[-1])
    b = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert_close_weights(a["artifact"], b["artifact"], atol=1e-6)
    assert a["metrics"]["train_loss"] == pytest.approx(b["metrics"]["train_loss"], abs=1e-6)


def test_injected_oom_in_sft_halves_the_micro_batch_and_keeps_the_step(plain, tmp_path, monkeypatch, capsys):
    """An out-of-memory error in step 2 (injected) is survived: the step is redone at half the micro-batch, the
    rest of the stage runs at that size, and the result is the uninterrupted run's within float rounding."""
    monkeypatch.setenv(FAULT_ENV, "sft:oom:2")
    p = params(tmp_path)
    result = run_stage(p, "sft", stage_keys(p))
    out = capsys.readouterr().out
    assert "sft: out of memory at step 2 with micro-batch 8 x 2; redoing it with micro-batch 4 x 4" in out
    assert result.metrics["steps"] == plain["sft"].metrics["steps"]
    assert_close_weights(result.artifact, plain["sft"].artifact, atol=1e-5)


def test_zero_layout_refusals():
    with pytest.raises(InputError, match="engine.rollout.offload_optimizer: true under ZeRO"):
        load_params("test", {"engine": {"layout": {"zero_stage": 1}, "rollout": {"offload_optimizer": True}}})
    with pytest.raises(InputError, match="offload_optimizer: true needs zero_stage 1, 2 or 3"):
        load_params("test", {"engine": {"layout": {"offload_optimizer": True}}})
