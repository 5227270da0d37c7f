"""Pre-flight checks on the engine: the memory floor (weights, gradients and optimizer states per stage, and
the refusal when the machine has less than that) and the vllm extra when the params ask for it."""
from __future__ import annotations

import pytest

from hybridcore.errors import InputError
from stages import checks
from stages.params import Params, load_params

N = 10**9  # parameters: round numbers make the byte counts readable


def test_floor_counts_each_role_its_precision_and_training_state():
    p = load_params("test")  # fp32 everywhere
    # PPO: actor and critic trained (weights + grad + 2 AdamW states = 16 B), reference and RM frozen (4 B)
    assert checks.static_bytes(p, "ppo", N) == (16 + 16 + 4 + 4) * N
    assert checks.static_bytes(p, "sft", N) == 16 * N
    assert checks.static_bytes(p, "evaluate", N) == 3 * 4 * N


def test_floor_with_qlora_and_a_shared_base():
    """4-bit actor with LoRA on a shared base: the base counts once at half a byte; the bf16 RM stays."""
    doc = load_params("test").model_dump(mode="json")
    lora = {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}
    doc["engine"].update(precision="bf16", share_base=True,
                         roles={"actor": {"quantization": "4bit", "lora": lora},
                                "critic": {"quantization": "4bit", "lora": lora}})
    p = Params.model_validate(doc)
    assert checks.static_bytes(p, "ppo", N) == int((0.5 + 2) * N)
    assert checks.static_bytes(p, "reward", N) == 4 * 2 * N  # the RM stage trains a full bf16 model


def test_preflight_refuses_a_run_that_cannot_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(checks, "available_memory", lambda p: (2**20, "the test's RAM"))
    p = load_params("test", {"pipeline": {"artifacts_dir": str(tmp_path)}})
    with pytest.raises(InputError) as e:
        checks.preflight(p)
    msg = str(e.value)
    assert msg.startswith("engine: ppo needs at least") and "the test's RAM is 1 MiB" in msg, msg
    assert "4-bit" in msg and "\n" not in msg
    monkeypatch.setattr(checks, "available_memory", lambda p: (2**40, "the test's RAM"))
    checks.preflight(p)  # the same run passes with room to spare


def test_vllm_backend_without_the_extra_is_refused_before_any_stage(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    p = load_params("test", {"pipeline": {"artifacts_dir": str(tmp_path)},
                             "engine": {"rollout": {"backend": "vllm"}}})
    with pytest.raises(InputError) as e:
        checks.preflight(p)
    assert str(e.value).startswith("engine.rollout.backend: vllm is not installed") and "hybrid-rlhf[vllm]" in str(e.value)
    checks.preflight(load_params("test", {"pipeline": {"artifacts_dir": str(tmp_path), "stages": ["sft"]},
                                          "engine": {"rollout": {"backend": "vllm"}}}))  # no PPO: not needed


def test_engine_device_cuda_without_a_gpu_is_refused_up_front(tmp_path):
    """This machine has no GPU: asking for one is a one-line input error before anything runs; auto is the CPU."""
    import torch
    from hybridcore.models import resolve_device
    assert not torch.cuda.is_available()
    assert resolve_device("auto") == torch.device("cpu")
    p = load_params("test", {"pipeline": {"artifacts_dir": str(tmp_path)}, "engine": {"device": "cuda"}})
    with pytest.raises(InputError, match=r"^engine.device: cuda, but torch sees no GPU here"):
        checks.preflight(p)


def test_batches_go_where_the_model_is():
    from hybridcore.batch import pack
    b = pack([[1, 2], [3]], [[4], [5, 6]], 0, device="meta")
    assert {t.device.type for t in (b.input_ids, b.attention_mask, b.position_ids, b.response_mask)} == {"meta"}
    assert pack([[1, 2]], [[4]], 0).input_ids.device.type == "cpu"


def test_prompt_too_long_for_a_tokenizer_trained_by_sft_is_one_line_after_sft(tmp_path):
    """With a built-in preset the tokenizer exists only after SFT, so the pre-flight check cannot count prompt
    tokens: PPO does, before any rollout, naming the prompt and the limit; SFT and the RM stay published."""
    import json
    import random

    from stages.keys import stage_keys
    from stages.runner import run_stage
    rng = random.Random(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(str(rng.randrange(10)) for _ in range(600))}) + "\n"
                               for _ in range(20)))
    prefs = tmp_path / "preferences.jsonl"  # own prompts need own pairs for the RM (pre-flight refuses otherwise)
    prefs.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "chosen": f" {i + 1}", "rejected": f" {i + 2}"})
                             + "\n" for i in range(40)))
    p = load_params("test", {"pipeline": {"artifacts_dir": str(tmp_path / "art")},
                             "data": {"prompts": {"path": str(prompts)}, "preferences": {"path": str(prefs)}}})
    keys = stage_keys(p)
    done = [run_stage(p, s, keys) for s in ("sft", "reward")]
    with pytest.raises(InputError, match=r"^data.prompts.path: .*: the prompt starting '\d \d \d.*' is \d+ tokens, and with "
                                         r"ppo.max_new_tokens=\d+ that exceeds the model's 256 positions"):
        run_stage(p, "ppo", keys)
    assert all(run_stage(p, s, keys).cached for s in ("sft", "reward")) and len(done) == 2
