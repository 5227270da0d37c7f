"""Activation checkpointing per trained role (engine.roles.<role>.activation_checkpointing; null = the engine's):
each stage turns it on or off for the role it trains, PPO for the actor and its own critic."""
from __future__ import annotations

import pytest

import stages.ppo as ppo
import stages.reward as reward
import stages.sft as sft
from hybridcore.errors import InputError
from stages.keys import stage_keys
from stages.params import check_supported, load_params
from stages.runner import run_stage


def test_each_stage_sets_its_roles_own_choice(tmp_path, monkeypatch):
    roles = {"actor": {"activation_checkpointing": False}, "critic": {"activation_checkpointing": True},
             "reward": {"activation_checkpointing": False}}
    p = load_params("test", {"pipeline": {"artifacts_dir": str(tmp_path)}, "ppo": {"iterations": 1},
                             "engine": {"activation_checkpointing": True, "roles": roles}})
    calls = []
    for module in (sft, reward, ppo):
        real = module.set_activation_checkpointing
        monkeypatch.setattr(module, "set_activation_checkpointing",
                            lambda model, on, m=module, real=real: (calls.append((m.__name__, type(model).__name__,
                                                                                   on)), real(model, on)))
    keys = stage_keys(p)
    for stage in ("sft", "reward", "ppo"):
        run_stage(p, stage, keys)
    on = {c for c in calls if c[2]}
    assert ("stages.sft", "LlamaForCausalLM", False) in calls and ("stages.sft", "LlamaForCausalLM", True) not in on
    assert ("stages.reward", "LlamaForSequenceClassification", False) in calls
    assert ("stages.reward", "LlamaForSequenceClassification", True) not in on
    assert ("stages.ppo", "LlamaForCausalLM", False) in calls
    assert ("stages.ppo", "LlamaForSequenceClassification", True) in calls   # the critic: its own setting


@pytest.mark.parametrize("engine,match", [
    ({"roles": {"reference": {"activation_checkpointing": True}}},
     r"^engine.roles.reference.activation_checkpointing: the reference policy is never trained"),
    ({"share_base": True, "roles": {"actor": {"lora": {"rank": 8, "alpha": 16, "targets": ["q_proj"]},
                                              "activation_checkpointing": True},
                                    "critic": {"lora": {"rank": 8, "alpha": 16, "targets": ["q_proj"]},
                                               "activation_checkpointing": False}}},
     r"^engine.roles.critic.activation_checkpointing: with engine.share_base the critic runs on the actor's"),
])
def test_role_checkpointing_refusals(engine, match):
    with pytest.raises(InputError, match=match):
        check_supported(load_params("test", {"engine": engine}))
