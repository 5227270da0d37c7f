"""QLoRA and share_base through the real stages (params/test-qlora.yaml: a 4-bit micro model, LoRA on every
trained role, actor and critic as adapters on one base): artifacts are plain merged folders plus adapters,
the merged policy equals the adapter model, resume works from adapter-only checkpoints, the setup's
autograd check catches a planted mistake, and the role params are validated."""
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from hybridcore.batch import pack
from hybridcore.errors import InputError
from hybridcore.forward import batched, response_logprobs
from hybridcore.freezing import FreezingError
from hybridcore.interrupts import Interrupted
from hybridcore.models import load_causal_lm, load_tokenizer
from hybridcore.optim import adamw
from stages import ppo
from stages.keys import stage_keys
from stages.params import load_params
from stages.runner import NullSink, run_stage

ITERATIONS = 2


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    """sft -> reward -> ppo -> evaluate of params/test-qlora.yaml, once for the module."""
    root = tmp_path_factory.mktemp("qlora")
    p = load_params("test-qlora", {"pipeline": {"artifacts_dir": str(root)},
                                   "ppo": {"iterations": ITERATIONS, "checkpoint_every": 1}})
    keys = stage_keys(p)
    results = {s: run_stage(p, s, keys) for s in ("sft", "reward", "ppo", "evaluate")}
    return p, {s: Path(r.artifact) for s, r in results.items()}, results


def test_pipeline_runs_and_artifacts_are_merged_folders(qlora):
    """Every stage ran; model/ folders are plain HF folders (no quantisation config) and adapter/ holds the
    LoRA weights (PPO: the actor and critic adapters and the value head)."""
    _, art, results = qlora
    assert results["evaluate"].metrics["prompts"] == 16
    assert results["ppo"].metrics["steps"] == ITERATIONS
    for stage, cls in (("sft", AutoModelForCausalLM), ("reward", AutoModelForSequenceClassification),
                       ("ppo", AutoModelForCausalLM)):
        config = json.loads((art[stage] / "model" / "config.json").read_text())
        assert "quantization_config" not in config, stage
        model = cls.from_pretrained(art[stage] / "model")
        assert all(type(p).__name__ == "Parameter" for p in model.parameters())
    assert sorted(json.loads((art["ppo"] / "adapter" / "adapters.json").read_text())["adapters"]) == \
        ["actor", "critic"]
    for config in (a for stage in ("sft", "reward", "ppo") for a in (art[stage] / "adapter").rglob("adapter_config.json")):
        base = json.loads(config.read_text()).get("base_model_name_or_path") or ""
        assert "preset-" not in base, (config, base)  # never the temporary folder the 4-bit preset loaded from
    head = load_file(str(art["ppo"] / "adapter" / "value_head.safetensors"))
    assert head["weight"].shape == (1, 64)
    for sub in ("actor", "critic"):
        keys = load_file(str(art["ppo"] / "adapter" / sub / "adapter_model.safetensors")).keys()
        assert keys and all("lora_" in k for k in keys)


def test_merged_ppo_policy_equals_the_actor_adapter_on_the_4bit_base(qlora):
    """ppo/model loaded by plain transformers gives the log-probs of the trained actor adapter on the
    4-bit SFT base it was trained on."""
    _, art, _ = qlora
    tok = load_tokenizer(str(art["sft"] / "model"))
    base = load_causal_lm(str(art["sft"] / "model"), quantization="4bit")
    adapted = PeftModel.from_pretrained(base, str(art["ppo"] / "adapter" / "actor"), adapter_name="actor")
    ids = [tok(f"tom has {a} plums and gets 3 more. total:", add_special_tokens=False)["input_ids"] for a in range(6)]
    batch = pack(ids, [[5 + a, 9, 12] for a in range(6)], tok.pad_token_id)
    expected = batched(response_logprobs, adapted.get_base_model(), batch, 6)
    merged = AutoModelForCausalLM.from_pretrained(art["ppo"] / "model")
    assert_close(batched(response_logprobs, merged, batch, 6), expected, rtol=1e-4, atol=1e-4)
    with adapted.disable_adapter():
        base_only = batched(response_logprobs, adapted.get_base_model(), batch, 6)
    assert (expected - base_only).abs().max() > 0  # PPO did change the adapter


def test_resume_from_adapter_only_checkpoint_is_exact(qlora, tmp_path, monkeypatch):
    """Stop PPO after its first iteration (checkpoint = adapters + value head + optimiser states), run it
    again: the result equals the uninterrupted run's bit for bit."""
    p, art, _ = qlora
    inputs = {"sft": art["sft"], "reward": art["reward"]}
    monkeypatch.setattr("stages.common.stop_requested", lambda: True)
    with pytest.raises(Interrupted):
        ppo.run(p, inputs, tmp_path, NullSink())
    monkeypatch.undo()
    ckpt = tmp_path / "checkpoints" / "step-1"
    actor, critic = load_file(str(ckpt / "actor.safetensors")), load_file(str(ckpt / "critic.safetensors"))
    assert actor and all(".lora_A.actor." in k or ".lora_B.actor." in k for k in actor)
    assert "value_head.weight" in critic
    assert all(k == "value_head.weight" or ".lora_A.critic." in k or ".lora_B.critic." in k for k in critic)
    ran = []
    monkeypatch.setattr("stages.ppo.fault_point", lambda stage, it: ran.append(it))
    ppo.run(p, inputs, tmp_path, NullSink())
    assert ran == list(range(1, ITERATIONS))  # it resumed: iteration 0 was not run again
    want, got = load_file(str(art["ppo"] / "model" / "model.safetensors")), load_file(
        str(tmp_path / "model" / "model.safetensors"))
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_ppo_setup_check_finds_a_planted_freezing_mistake(qlora):
    """The check PPO runs after setup passes on the real setup and names a reward-model weight left
    trainable, and a base weight of the shared model."""
    p, art, _ = qlora
    tok = load_tokenizer(str(art["sft"] / "model"))
    m = ppo.load_models(p, {"sft": art["sft"], "reward": art["reward"]}, tok)
    opts = [adamw(m.actor_params, 1e-4), adamw(m.critic_params, 1e-4)]
    m.frozen_check(opts)
    m.rm.score.weight.requires_grad_(True)
    with pytest.raises(FreezingError, match=r"reward\.score\.weight"):
        m.frozen_check(opts)
    m.rm.score.weight.requires_grad_(False)
    m.policy.get_input_embeddings().weight.requires_grad_(True)
    with pytest.raises(FreezingError, match=r"actor\.model\.embed_tokens\.weight"):
        m.frozen_check(opts)


LORA = {"rank": 4, "alpha": 8, "targets": ["q_proj"]}


@pytest.mark.parametrize("engine, match", [
    ({"roles": {"actor": {"quantization": "4bit"}}},
     r"engine\.roles\.actor\.quantization=4bit: a quantised model that is trained needs adapters \(QLoRA\)"),
    ({"roles": {"reward": {"quantization": "8bit"}}}, r"engine\.roles\.reward\.quantization=8bit"),
    ({"roles": {"reference": {"lora": LORA}}}, r"engine\.roles\.reference\.lora: .*never trained"),
    ({"share_base": True, "roles": {"actor": {"lora": LORA}}}, r"expected engine\.roles\.critic\.lora to be set"),
    ({"share_base": True, "roles": {"actor": {"lora": LORA, "quantization": "4bit"},
                                    "critic": {"lora": LORA, "quantization": "8bit"}}},
     r"engine\.roles\.critic: with engine\.share_base=true .*found quantization=8bit"),
    ({"roles": {"actor": {"lora": {**LORA, "rank": 0}}}}, r"engine\.roles\.actor\.lora\.rank: .*greater than 0"),
    ({"roles": {"actor": {"lora": {**LORA, "targets": []}}}}, r"engine\.roles\.actor\.lora\.targets"),
    ({"roles": {"actor": {"lora": {"rank": 4, "targets": ["q_proj"]}}}}, r"engine\.roles\.actor\.lora\.alpha"),
])
def test_role_params_are_checked(engine, match):
    """Role settings that cannot work are one-line InputErrors naming the field."""
    with pytest.raises(InputError, match=match):
        load_params("test", {"engine": engine})


def test_role_params_that_work_are_accepted():
    """The preset, 8-bit frozen roles, and optimizer offload during rollout load."""
    p = load_params("test-qlora")
    assert p.engine.share_base and p.engine.roles.actor.lora.targets == ["q_proj", "k_proj", "v_proj", "o_proj"]
    load_params("tiny-qlora")
    load_params("test", {"engine": {"roles": {"reference": {"quantization": "8bit"}},
                                    "rollout": {"offload_optimizer": True}}})


def test_unknown_target_at_load_names_the_field(tmp_path):
    """Targets are checked against the model when the stage loads it."""
    p = load_params("test", {"pipeline": {"artifacts_dir": str(tmp_path), "stages": ["sft"]},
                             "engine": {"roles": {"actor": {"lora": {**LORA, "targets": ["qkv"]}}}}})
    with pytest.raises(InputError, match=r"^engine\.roles\.actor\.lora\.targets: 'qkv' is not a Linear"):
        run_stage(p, "sft", stage_keys(p))


def test_separate_lora_roles_in_bf16(tmp_path):
    """Without share_base, each role is its own model: a 4-bit actor with LoRA, an 8-bit critic with LoRA and a
    trainable score head, an 8-bit frozen reference, a full-precision RM with LoRA; all in bf16. The stages
    run, the exports are plain bf16 folders, and PPO's setup check names a planted mistake."""
    lora = {"rank": 4, "alpha": 8}
    p = load_params("test", {"pipeline": {"artifacts_dir": str(tmp_path)},
                             "engine": {"precision": "bf16", "activation_checkpointing": True, "roles": {
                                 "actor": {"quantization": "4bit", "lora": {**lora, "targets": ["q_proj", "v_proj"]}},
                                 "critic": {"quantization": "8bit", "lora": {**lora, "targets": ["q_proj"]}},
                                 "reference": {"quantization": "8bit"},
                                 "reward": {"lora": {**lora, "targets": ["q_proj"]}}}}})
    keys = stage_keys(p)
    art = {s: Path(run_stage(p, s, keys).artifact) for s in ("sft", "reward", "ppo")}
    for stage in art:
        assert json.loads((art[stage] / "model" / "config.json").read_text())["dtype"] == "bfloat16"
        assert (art[stage] / "adapter" / "adapter_model.safetensors").is_file()
    assert "score.weight" in load_file(str(art["reward"] / "model" / "model.safetensors"))
    tok = load_tokenizer(str(art["sft"] / "model"))
    m = ppo.load_models(p, {"sft": art["sft"], "reward": art["reward"]}, tok)
    assert m.shared is None and m.ref is not m.policy
    opts = [adamw(m.actor_params, 1e-4), adamw(m.critic_params, 1e-4)]
    m.frozen_check(opts)
    assert m.critic.score.weight.requires_grad  # the critic's score head trains with its adapter
    next(m.ref.parameters()).requires_grad_(True)
    with pytest.raises(FreezingError, match=r"reference\.model\.embed_tokens\.weight"):
        m.frozen_check(opts)
