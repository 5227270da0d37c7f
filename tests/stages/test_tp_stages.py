"""Tensor-parallel stages: the micro pipeline (2 heads, 2 kv heads, MLP 128: tp=2 splits one head per rank) as
torchrun jobs over gloo, through run_stage as the flow and CLI call it.

Every rank loads the same model and keeps its tp shard of the attention and MLP linears (the RM and the critic
split their backbone, score heads stay whole; PPO's reference and reward stay whole); tp peers take the same rows
and the export gathers the shards into one HF folder. After SFT's 4 AdamW steps the tp=2 and dp=2 x tp=2 weights
equal one process's within 5e-5 (measured 3.2e-6 on both: the tp all-reduces sum in another order and Adam's
m / sqrt(v) amplifies it), a twentieth of one step at sft.lr=1e-3, so a wrong or missing all-reduce shows.
The tp=2 SFT is first stopped on one rank (both ranks checkpoint their shards after the same step) and resumed.
Runtime on 2 cores: ~62 s (one-process SFT; tp=2: stopped SFT, resumed SFT, RM, PPO, evaluation) + ~83 s
(dp=2 x tp=2: SFT, RM, PPO, evaluation); the file ~150 s."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hybridcore import tensor_parallel
from hybridcore.artifacts import read_verified
from hybridcore.errors import InputError, NotYetSupported
from hybridcore.interrupts import FAULT_ENV, FAULT_RANK_ENV, Interrupted
from stages.keys import stage_keys
from stages.params import load_params
from stages.runner import run_stage
from tests.stages.test_distributed import Recorder, processes_naming

STAGES = ("sft", "reward", "ppo", "evaluate")
SPLIT = (*tensor_parallel.ATTENTION, *tensor_parallel.MLP)
ATOL = 5e-5  # see the module docstring


def params(root: Path, layout: dict | None = None, rollout_tp: int = 1):
    return load_params("test", {"pipeline": {"artifacts_dir": str(root)}, "sft": {"checkpoint_every": 2},
                                "engine": {"layout": layout or {}, "rollout": {"tp": rollout_tp}}})


def run_pipeline(root: Path, layout: dict, rollout_tp: int, stopped_sft: bool = False):
    """stopped_sft: SIGTERM reaches rank 1 alone before SFT step 1; every rank must stop after the same step (its
    tp peer too), write one checkpoint of per-rank shards, and the rerun resume from it."""
    p = params(root, layout, rollout_tp)
    keys = stage_keys(p)
    sinks = {s: Recorder() for s in STAGES}
    if stopped_sft:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(FAULT_ENV, "sft:term:1")
            mp.setenv(FAULT_RANK_ENV, "1")
            with pytest.raises(Interrupted, match=r"^sft: rank \d of 2: sft stopped after step 2, checkpoint"):
                run_stage(p, "sft", keys)
        partial = root / "sft" / f"{keys['sft']}.partial"
        assert sorted(x.name for x in partial.glob("checkpoints/step-2/engine/engine-tp*.pt")) == \
            ["engine-tp0.pt", "engine-tp1.pt"]
    return {s: run_stage(p, s, keys, sinks[s]) for s in STAGES}, sinks


def weights(result) -> dict[str, torch.Tensor]:
    return load_file(str(Path(result.artifact) / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def one_process_sft(tmp_path_factory):
    p = params(tmp_path_factory.mktemp("tp1"))
    return run_stage(p, "sft", stage_keys(p))


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """layout.tp=2 with the default engine.rollout.tp=1: each rollout regroups the actor into whole weights."""
    root = tmp_path_factory.mktemp("tp2")
    return (root, *run_pipeline(root, {"tp": 2}, rollout_tp=1, stopped_sft=True))


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory):
    """World 4 (DeepSpeed over the dp group, ZeRO-0, with the tp mpu), rolling out at tp=2."""
    root = tmp_path_factory.mktemp("dp2tp2")
    return (root, *run_pipeline(root, {"dp": 2, "tp": 2}, rollout_tp=2))


def assert_pipeline_ran(root: Path, results: dict, sinks: dict) -> None:
    for stage, r in results.items():
        assert not r.cached and read_verified(Path(r.artifact)) is not None, stage
    for stage in ("sft", "reward", "ppo"):  # torchrun jobs: a log per rank kept with the artifact
        assert (Path(results[stage].artifact) / "logs").is_dir(), stage
    assert results["sft"].metrics["steps"] == 4 and results["reward"].metrics["steps"] == 4
    assert math.isfinite(results["reward"].metrics["heldout_accuracy"])
    ppo_rows = [m for _, m in sinks["ppo"].rows if "reward" in m]
    assert len(ppo_rows) == 2 and all(math.isfinite(m["reward"]) and math.isfinite(m["value_loss"]) for m in ppo_rows)
    assert results["evaluate"].metrics  # the one-process evaluation read the consolidated PPO and RM folders
    assert processes_naming(str(root)) == []


def assert_one_hf_folder(result, like: dict[str, torch.Tensor]) -> None:
    """The artifact is whole HF weights (every tensor at its full shape), loadable by from_pretrained."""
    got = weights(result)
    assert got.keys() == like.keys()
    assert all(got[k].shape == like[k].shape for k in like)
    model = AutoModelForCausalLM.from_pretrained(Path(result.artifact) / "model")
    assert model.model.layers[0].self_attn.q_proj.weight.shape == like["model.layers.0.self_attn.q_proj.weight"].shape


def rank_bytes(whole: dict[str, torch.Tensor], tp: int) -> int:
    """fp32 bytes one rank holds of a model whose whole weights are `whole`: 1/tp of every attention and MLP
    linear, everything else (embeddings, norms, lm_head, score head) whole."""
    split = sum(v.numel() for k, v in whole.items() if k.split(".")[-2] in SPLIT)
    assert split % tp == 0 and split > len(whole)
    return 4 * (sum(v.numel() for v in whole.values()) - split + split // tp)


def assert_close(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=k)


def test_tp2_pipeline_runs_end_to_end_and_its_sft_equals_one_process(tp2, one_process_sft):
    root, results, sinks = tp2
    assert_pipeline_ran(root, results, sinks)
    assert_close(weights(results["sft"]), weights(one_process_sft), ATOL)
    assert results["sft"].metrics["train_loss"] == pytest.approx(one_process_sft.metrics["train_loss"], rel=1e-5)
    assert results["sft"].metrics["heldout_loss"] == pytest.approx(one_process_sft.metrics["heldout_loss"], rel=1e-5)
    assert sorted(p.parent.name for p in (Path(results["sft"].artifact) / "logs").rglob("stderr.log")) == ["0", "1"]
    rank0_out = "".join(x.read_text() for x in Path(results["sft"].artifact).glob("logs/**/0/stdout.log"))
    assert "sft: resuming from step-2" in rank0_out  # the stopped run's checkpoint (fixture tp2)
    # each rank trained its shards only (measured from the storages rank 0 holds), the one process everything
    whole = weights(one_process_sft)
    assert one_process_sft.metrics["params_mib"] * 2**20 == rank_bytes(whole, 1)
    assert results["sft"].metrics["params_mib"] * 2**20 == rank_bytes(whole, 2)
    assert results["reward"].metrics["params_mib"] * 2**20 == rank_bytes(weights(results["reward"]), 2)
    assert results["ppo"].metrics["actor_params_mib"] * 2**20 == rank_bytes(whole, 2)
    assert results["ppo"].metrics["critic_params_mib"] * 2**20 == rank_bytes(weights(results["reward"]), 2)


def test_tp2_ppo_with_rollout_tp1_trains_and_exports_one_whole_model(tp2):
    """Rollout at tp=1 under layout.tp=2: every rank regroups whole weights, generates half the prompts, and
    the responses are gathered; the PPO updates moved the actor and its export is the whole model."""
    _, results, sinks = tp2
    sft, ppo = weights(results["sft"]), weights(results["ppo"])
    assert_one_hf_folder(results["ppo"], sft)
    moved = max(float((ppo[k] - sft[k]).abs().max()) for k in sft if ".mlp." in k or ".self_attn." in k)
    assert moved > 1e-6  # the split linears were trained (and gathered from both ranks)
    lengths = [m["response_length"] for _, m in sinks["ppo"].rows if "response_length" in m]
    assert lengths and all(0 < n <= 4 for n in lengths)  # ppo.max_new_tokens=4


def test_dp2_tp2_pipeline_runs_end_to_end_and_its_sft_equals_one_process(dp2_tp2, one_process_sft):
    root, results, sinks = dp2_tp2
    assert_pipeline_ran(root, results, sinks)
    assert_close(weights(results["sft"]), weights(one_process_sft), ATOL)
    assert results["sft"].metrics["train_loss"] == pytest.approx(one_process_sft.metrics["train_loss"], rel=1e-5)
    assert sorted(p.parent.name for p in (Path(results["sft"].artifact) / "logs").rglob("stderr.log")) == \
        ["0", "1", "2", "3"]
    assert_one_hf_folder(results["ppo"], weights(one_process_sft))
    assert results["sft"].metrics["params_mib"] * 2**20 == rank_bytes(weights(one_process_sft), 2)  # ZeRO-0: whole


@pytest.mark.parametrize("overrides, cls, message", [
    ({"layout": {"tp": 2}, "rollout": {"tp": 4}}, InputError,
     r"^engine.rollout.tp: found 4, expected a divisor of engine.layout.tp=2"),
    ({"layout": {"tp": 2}, "roles": {"critic": {"lora": {"rank": 4, "alpha": 8, "targets": ["q_proj"]}}}},
     NotYetSupported, r"^engine.layout.tp=2 with LoRA, quantised roles or share_base.*#8"),
    ({"layout": {"tp": 2}, "rollout": {"backend": "vllm"}}, NotYetSupported,
     r"^engine.layout.tp=2 with engine.rollout.backend=vllm.*#8"),
    ({"layout": {"tp": 2}, "memory_budget_gib": 4}, NotYetSupported,
     r"^engine.layout.tp=2 with engine.memory_budget_gib.*#8"),
    ({"layout": {"tp": 2, "zero_stage": 3}}, InputError, r"^engine.layout: zero_stage=3 with tp=2"),
])
def test_tensor_parallel_params_are_checked_up_front(overrides, cls, message):
    with pytest.raises(cls, match=message) as e:
        load_params("test", {"engine": overrides})
    assert "\n" not in str(e.value)


def test_a_tp_that_does_not_divide_the_models_heads_fails_preflight(tmp_path):
    from stages.checks import preflight
    p = params(tmp_path, {"tp": 4})  # the micro preset has 2 heads and 2 kv heads
    with pytest.raises(InputError, match=r"^engine.layout.tp=4: the model's num_attention_heads=2, "
                                         r"num_key_value_heads=2 not divisible by 4; expected a tp that divides"):
        preflight(p)
    preflight(params(tmp_path, {"tp": 2}))  # and tp=2 passes
