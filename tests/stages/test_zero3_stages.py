"""The stages under DeepSpeed ZeRO-3 (engine.layout.zero_stage 3, tp=1), parameters optionally on the CPU.

Training forwards run through DeepSpeed's engine (DeepSpeedEngine.forward), so ZeRO-3 accumulates each micro-batch's
gradient partition instead of overwriting it: SFT and the RM end where plain AdamW ends. PPO rolls out from the
actor's parameters gathered in place (HybridActor + DeepSpeedEngine.rollout_weights) and re-partitions them after; its greedy
tokens are those of a plain model holding the same weights. A dp=2 ZeRO-3 SFT (a torchrun job) equals plain AdamW
too, and a killed ZeRO-3 + offload SFT resumes bit for bit. About 2 minutes on 2 busy cores."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from hybridcore.actor import HybridActor
from hybridcore.artifacts import read_verified
from hybridcore.errors import NotYetSupported
from hybridcore.interrupts import FAULT_ENV
from hybridcore.models import load_tokenizer
from stages.keys import stage_keys
from stages.params import load_params
from stages.runner import run_stage
from tests.conftest import ROOT

SFT = {"epochs": 2}  # 8 steps of 16 rows, 2 micro-batches each
ZERO3_OFFLOAD = {"zero_stage": 3, "offload_params": True, "offload_optimizer": True}


def params(root: Path, layout: dict | None = None, **sections):
    return load_params("test", {"pipeline": {"artifacts_dir": str(root)}, "sft": SFT,
                                "engine": {"layout": layout or {}}, **sections})


def weights(artifact) -> dict[str, torch.Tensor]:
    return load_file(str(Path(artifact) / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """SFT and RM with plain AdamW (what ZeRO-3's SFT must reproduce, and PPO's inputs), in a store shared by the
    tests of this module."""
    root = tmp_path_factory.mktemp("store")
    p = params(root)
    keys = stage_keys(p)
    return root, {s: run_stage(p, s, keys) for s in ("sft", "reward")}


@pytest.fixture
def backends(watch_engine_steps) -> list[tuple[str, int]]:
    """(backend, zero stage) of every training-engine step taken during the test: a silently ignored layout fails."""
    return watch_engine_steps(lambda e: (e.backend, e.layout.zero_stage))


def test_sft_under_zero3_equals_plain_adamw(plain, backends):
    """Tolerance 1e-4 per weight (measured 1.6e-6): ZeRO-3 clips with an fp64 norm, and AdamW can turn a relative
    1e-8 change of a gradient near eps into much more in that weight (tests/hybridcore/test_zero.py). Forwards
    that bypass DeepSpeed's engine (ZeRO-3's micro-step never counted, so each micro-batch's gradient partition
    overwrites the last) end ~5e-2 away on a micro model: the bound catches that mistake."""
    root, ref_results = plain
    p = params(root, {"zero_stage": 3})
    result = run_stage(p, "sft", stage_keys(p))
    assert not result.cached and result.key != ref_results["sft"].key
    assert backends and set(backends) == {("deepspeed", 3)}
    assert result.metrics["steps"] == ref_results["sft"].metrics["steps"] == 8
    assert read_verified(Path(result.artifact)) is not None
    got, ref = weights(result.artifact), weights(ref_results["sft"].artifact)
    assert got.keys() == ref.keys()
    for k in ref:  # the export gathered whole tensors, not ZeRO-3's empty placeholders
        assert got[k].shape == ref[k].shape, k
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-4, msg=k)
    assert result.metrics["train_loss"] == pytest.approx(ref_results["sft"].metrics["train_loss"], rel=1e-4)


def test_reward_model_under_zero3_equals_plain_adamw(plain, backends):
    """The RM stage from the plain SFT: pair scores through DeepSpeed's engine, same tolerance as SFT."""
    root, ref_results = plain
    p = params(root, {"zero_stage": 3})
    result = run_stage(p, "reward", {**stage_keys(p), "sft": ref_results["sft"].key})
    assert set(backends) == {("deepspeed", 3)}
    got, ref = weights(result.artifact), weights(ref_results["reward"].artifact)
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-4, msg=k)


def test_ppo_under_zero3_offload_rolls_out_from_gathered_weights(plain, backends, monkeypatch):
    """Parameters and optimizer states on the CPU (offload_params + offload_optimizer). Every rollout: the actor's
    weights, gathered beforehand through the engine's whole_state_dict, give a plain model the very greedy tokens the
    actor generates inside rollout(); inside, its parameters are whole tensors; after, partitioned again (numel 0,
    ZeRO-3's placeholder), and the transition recorded the bytes it gathered."""
    root, ref_results = plain
    seen: list[dict] = []
    rollout, generate = HybridActor.rollout, HybridActor.generate

    @contextlib.contextmanager
    def spy_rollout(self):
        assert self.train_engine is not None, "PPO under ZeRO-3 built its actor without the train engine"
        record = {"state": self.train_engine.whole_state_dict()}
        with rollout(self) as actor:
            record["whole"] = all(q.numel() > 0 for q in self.model.parameters())
            yield actor
            record.update(self._spy)
        record["partitioned_after"] = all(q.numel() == 0 for q in self.model.parameters())
        record["gathered_bytes"] = self.last_transition_bytes.get("zero3_gathered")
        seen.append(record)

    def spy_generate(self, prompts, max_new_tokens, **kw):
        self._spy = {"prompts": prompts, "max_new_tokens": max_new_tokens,
                     "greedy": generate(self, prompts, max_new_tokens, greedy=True)}
        return generate(self, prompts, max_new_tokens, **kw)

    monkeypatch.setattr(HybridActor, "rollout", spy_rollout)
    monkeypatch.setattr(HybridActor, "generate", spy_generate)
    p = params(root, ZERO3_OFFLOAD)
    keys = {**stage_keys(p), **{s: ref_results[s].key for s in ("sft", "reward")}}  # the plain SFT and RM
    result = run_stage(p, "ppo", keys)
    monkeypatch.undo()
    assert set(backends) == {("deepspeed", 3)}
    assert result.metrics["actor_optimizer_cpu_mib"] > 0 and result.metrics["actor_optimizer_device_mib"] == 0
    assert len(seen) == p.ppo.iterations == 2
    assert not torch.equal(seen[0]["state"]["lm_head.weight"], seen[1]["state"]["lm_head.weight"])  # it trained
    sft_dir = Path(ref_results["sft"].artifact) / "model"
    tok = load_tokenizer(str(sft_dir))
    n_params = sum(v.numel() for v in seen[0]["state"].values())
    for r in seen:
        assert r["whole"] and r["partitioned_after"]
        assert r["gathered_bytes"] == 4 * n_params  # fp32, one rank: the whole model
        twin = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sft_dir))
        twin.load_state_dict(r["state"])
        replay = HybridActor(twin, tok)  # plain weights, the same native backend
        with rollout(replay):
            assert generate(replay, r["prompts"], r["max_new_tokens"], greedy=True) == r["greedy"]
    assert read_verified(Path(result.artifact)) is not None
    final = weights(result.artifact)
    assert final.keys() == seen[0]["state"].keys() and all(v.numel() > 0 for v in final.values())


def test_zero3_refusals():
    """What ZeRO-3 in the stages does not do yet is refused in one line naming it."""
    lora = {"rank": 4, "alpha": 8, "targets": ["q_proj"]}
    for overrides, message in (
            ({"roles": {"actor": {"lora": lora}}}, "engine.layout.zero_stage=3 with LoRA"),
            ({"share_base": True, "roles": {"actor": {"lora": lora}, "critic": {"lora": lora}}},
             "engine.layout.zero_stage=3 with LoRA, quantised roles or share_base"),
            ({"rollout": {"backend": "vllm"}}, "engine.layout.zero_stage=3 with engine.rollout.backend=vllm"),
            ({"memory_budget_gib": 4}, "engine.layout.zero_stage=3 with engine.memory_budget_gib")):
        with pytest.raises(NotYetSupported, match=message):
            load_params("test", {"engine": {"layout": {"zero_stage": 3}, **overrides}})


def test_dp2_zero3_sft_as_a_torchrun_job_equals_plain_adamw(plain):
    """Two ranks over gloo, each holding half of every parameter: each rank trains its half of every global batch,
    the export gathers the shards (every rank calls it, rank 0 writes), and the result is plain dp=1 AdamW's within
    the ZeRO-3 tolerance above (measured 1.6e-6)."""
    root, ref_results = plain
    p = params(root, {"dp": 2, "zero_stage": 3})
    result = run_stage(p, "sft", stage_keys(p))
    assert not result.cached and read_verified(Path(result.artifact)) is not None
    assert sorted(q.parent.name for q in (Path(result.artifact) / "logs").rglob("stderr.log")) == ["0", "1"]
    assert result.metrics["steps"] == 8
    got, ref = weights(result.artifact), weights(ref_results["sft"].artifact)
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-4, msg=k)


def test_kill_under_zero3_offload_resumes_bit_for_bit(tmp_path):
    """SIGKILL at step 5 under ZeRO-3 with parameters and optimizer states on the CPU, rerun: it resumes from
    step-3 (DeepSpeed's partitioned files, weights included) and ends exactly where an uninterrupted run ends."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "stages.runner", str(ROOT / "params" / "test.yaml"), "sft",
            "--set", "engine.layout.zero_stage=3", "--set", "engine.layout.offload_params=true",
            "--set", "engine.layout.offload_optimizer=true", "--set", "sft.epochs=2", "--set", "sft.checkpoint_every=3"]

    def run(root: Path, fault: str | None = None):
        e = {**env, FAULT_ENV: fault} if fault else env
        return subprocess.run(args + ["--set", f"pipeline.artifacts_dir={root}"], env=e, capture_output=True,
                              text=True, timeout=600)

    whole = run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = run(tmp_path / "resumed", "sft:5")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run(tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step-3" in resumed.stdout
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (whole, resumed))
    wa, wb = weights(a["artifact"]), weights(b["artifact"])
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["metrics"]["train_loss"] == b["metrics"]["train_loss"]
