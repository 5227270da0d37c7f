"""engine.roles.<reward|reference>.offload: a frozen role's weights wait on the CPU and come to the training
device only to score. On this CPU-only machine the move is CPU -> CPU, so these tests pin down the wiring and
the refusals; what it saves on a GPU is measured by bench/memory.py (the 14B shape needs it to fit 22 GiB)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import stages.ppo as ppo
from hybridcore.errors import InputError
from stages.keys import stage_keys
from stages.params import check_supported, load_params
from stages.runner import run_stage

OFFLOAD = {"engine": {"roles": {"reward": {"offload": True}, "reference": {"offload": True}}}}


def params(root: Path, extra: dict | None = None):
    over = {"pipeline": {"artifacts_dir": str(root)}, "ppo": {"iterations": 2}}
    return load_params("test", {**over, **(extra or {})})


def test_offloaded_scoring_roles_give_the_same_ppo_and_evaluation(tmp_path, monkeypatch):
    plain, off = params(tmp_path), params(tmp_path, OFFLOAD)
    keys = stage_keys(plain)
    for stage in ("sft", "reward"):
        run_stage(plain, stage, keys)
    moves = []
    real = ppo.resident

    def spy(model, device, home=None):
        moves.append((type(model).__name__, str(home)))
        return real(model, device, home)

    base = {s: run_stage(plain, s, keys) for s in ("ppo", "evaluate")}
    monkeypatch.setattr(ppo, "resident", spy)
    off_keys = stage_keys(off)
    assert off_keys["sft"] != keys["sft"]  # the engine section is in every key: run everything again
    for stage in ("sft", "reward"):
        run_stage(off, stage, off_keys)
    got = {s: run_stage(off, s, off_keys) for s in ("ppo", "evaluate")}
    # every scoring brought the offloaded roles in from their CPU home: reference and reward, once per iteration
    assert moves == [("LlamaForCausalLM", "cpu"), ("LlamaForSequenceClassification", "cpu")] * 2
    a = load_file(str(Path(base["ppo"].artifact) / "model" / "model.safetensors"))
    b = load_file(str(Path(got["ppo"].artifact) / "model" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    assert got["evaluate"].metrics == base["evaluate"].metrics


@pytest.mark.parametrize("roles,share,match", [
    ({"actor": {"offload": True}}, False, r"^engine.roles.actor.offload: true, but the actor trains"),
    ({"critic": {"offload": True}}, False, r"^engine.roles.critic.offload: true, but the critic trains"),
    ({"reference": {"offload": True}}, True, r"^engine.roles.reference.offload: true, but with engine.share_base"),
])
def test_offload_is_refused_where_it_cannot_apply(roles, share, match):
    lora = {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}
    engine = {"roles": {"actor": {"lora": lora}, "critic": {"lora": lora}}, "share_base": share}
    for role, v in roles.items():
        engine["roles"].setdefault(role, {}).update(v)
    with pytest.raises(InputError, match=match):
        check_supported(load_params("test", {"engine": engine}))
