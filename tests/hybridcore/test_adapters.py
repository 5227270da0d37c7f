"""LoRA and bitsandbytes on the micro model: target checks, adapter switching, merged export that plain
transformers loads with the adapter model's outputs, the shared base's reference, and 4-bit shape checks."""
import contextlib
import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hybridcore.adapters import (LoraSpec, adapter_parameters, add_lora, compute_dtype, linear_names, mixed_precision,
                                 save_adapters, save_merged, use_adapter)
from hybridcore.batch import pack
from hybridcore.errors import InputError
from hybridcore.forward import batched, response_logprobs, token_scores
from hybridcore.models import build_preset, load_causal_lm, save_model, train_tokenizer
from hybridcore.quant import bnb_config, check_4bit_shapes
from hybridcore.shared_base import SharedBase, value_head

TEXTS = [f"mia has {a} pears and gets {b} more. total: {a + b}" for a in range(1, 10) for b in range(1, 10)]
SPEC = LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, 384)


@pytest.fixture(scope="module")
def folder(tok, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("micro") / "model"
    save_model(build_preset("micro", tok, seed=0), tok, path)
    return path


@pytest.fixture(scope="module")
def batch(tok):
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS[:6]]
    return pack([x[:6 + i % 3] for i, x in enumerate(ids)], [x[9:12 + i % 4] for i, x in enumerate(ids)],
                tok.pad_token_id)


def randomise_adapter(model, adapter: str, seed: int) -> None:
    """LoRA starts with B = 0 (a no-op); give every B weights so that the adapter changes outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapter_parameters(model, adapter).items():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_unknown_lora_target_names_field_and_choices(folder):
    """A target that is not a Linear of the model: an InputError naming the field and the available names."""
    model = load_causal_lm(str(folder))
    with pytest.raises(InputError, match=r"^engine\.roles\.actor\.lora\.targets: 'qproj' is not a Linear module "
                                         r"of this model; expected names from: .*q_proj.*v_proj"):
        add_lora(model, LoraSpec(4, 8, ("q_proj", "qproj")), "engine.roles.actor", "default")
    assert linear_names(model) == ["down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj",
                                   "v_proj"]


@pytest.mark.parametrize("quantization", ["none", "4bit"])
def test_merged_folder_loads_plain_with_the_adapter_models_outputs(folder, tok, batch, tmp_path, quantization):
    """model/ (adapter merged, quantisation not baked in) loaded by plain from_pretrained gives the adapter
    model's log-probs; adapter/ holds the LoRA weights only."""
    model = load_causal_lm(str(folder), quantization=quantization)
    peft = add_lora(model, SPEC, "engine.roles.actor", "default")
    plain = peft.get_base_model()
    randomise_adapter(plain, "default", seed=1)
    expected = batched(response_logprobs, plain, batch, 3)
    save_merged(plain, tok, tmp_path / "model", "default", torch.float32)
    save_adapters(peft, tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert not hasattr(merged.config, "quantization_config")
    assert all(type(p).__name__ == "Parameter" for p in merged.parameters())
    got = batched(response_logprobs, merged, batch, 3)
    assert_close(got, expected, rtol=1e-4, atol=1e-4)
    base_only = batched(response_logprobs, load_causal_lm(str(folder), quantization=quantization), batch, 3)
    assert (got - base_only).abs().max() > 1e-3  # the adapter really is in model/
    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")).keys()
    assert keys and all("lora_" in k for k in keys)


def test_8bit_merged_folder_is_close_to_the_8bit_adapter_model(folder, tok, batch, tmp_path):
    """8-bit: the merged folder is the dequantised base plus the adapter; the int8 model also quantises its
    activations, so the two agree only to int8 precision."""
    peft = add_lora(load_causal_lm(str(folder), quantization="8bit"), SPEC, "engine.roles.actor", "default")
    plain = peft.get_base_model()
    randomise_adapter(plain, "default", seed=2)
    expected = batched(response_logprobs, plain, batch, 6)
    save_merged(plain, tok, tmp_path / "model", "default", torch.float32)
    got = batched(response_logprobs, AutoModelForCausalLM.from_pretrained(tmp_path / "model"), batch, 6)
    assert_close(got, expected, rtol=0.02, atol=0.05)


def test_use_adapter_switches_outputs_and_leaves_requires_grad(folder, batch):
    """use_adapter picks which adapter runs (None: the base) and restores the previous one; unlike peft's
    set_adapter it never changes requires_grad."""
    base = load_causal_lm(str(folder))
    peft = add_lora(base, SPEC, "engine.roles.actor", "actor")
    add_lora(None, LoraSpec(4, 8, ("q_proj",)), "engine.roles.critic", "critic", peft_model=peft)
    model = peft.get_base_model()
    randomise_adapter(model, "actor", 3)
    randomise_adapter(model, "critic", 4)
    for p in model.parameters():
        p.requires_grad_(".lora_" in "".join(n for n, q in model.named_parameters() if q is p))
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    out = {}
    for name in ("actor", "critic", None):
        with use_adapter(model, name):
            out[name] = batched(response_logprobs, model, batch, 6)
        assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert (out["actor"] - out["critic"]).abs().max() > 1e-3 and (out["actor"] - out[None]).abs().max() > 1e-3
    with use_adapter(model, "actor"):
        assert torch.equal(batched(response_logprobs, model, batch, 6), out["actor"])


def test_shared_base_reference_equals_a_separate_frozen_copy(folder, batch):
    """share_base: the reference (adapters off) gives exactly the log-probs of a separately loaded frozen
    4-bit copy, while the actor and critic adapters do change the model."""
    base = load_causal_lm(str(folder), quantization="4bit")
    sb = SharedBase(base, SPEC, LoraSpec(4, 8, ("q_proj", "k_proj")),
                    value_head(base.config.hidden_size, torch.float32, None, 0.02, seed=0))
    randomise_adapter(sb.model, "actor", 5)
    randomise_adapter(sb.model, "critic", 6)
    with sb.use("reference"):
        ref = batched(response_logprobs, sb.model, batch, 4)
    with sb.use("actor"):
        actor = batched(response_logprobs, sb.model, batch, 4)
    copy = load_causal_lm(str(folder), quantization="4bit").requires_grad_(False).eval()
    assert torch.equal(ref, batched(response_logprobs, copy, batch, 4))
    assert (actor - ref).abs().max() > 1e-3
    trained = {id(p) for p in (*sb.actor_params.parameters(), *sb.critic_params.parameters())}
    assert {n for n, p in sb.model.named_parameters() if p.requires_grad} == \
        {n for n, p in sb.model.named_parameters() if id(p) in trained}
    assert list(sb.critic.parameters()) == [sb.head.weight]  # the critic owns only its value head


def test_bnb_config_is_nf4_with_double_quantisation_and_compute_dtype():
    """4bit means NF4, double quantisation, the role's precision as compute dtype; output heads stay plain."""
    c = bnb_config("4bit", torch.bfloat16, "engine.roles.actor.quantization")
    assert (c.load_in_4bit, c.bnb_4bit_quant_type, c.bnb_4bit_use_double_quant) == (True, "nf4", True)
    assert c.bnb_4bit_compute_dtype == torch.bfloat16 and "lm_head" in c.llm_int8_skip_modules
    assert bnb_config("8bit", torch.float32, "x").load_in_8bit and bnb_config("none", torch.float32, "x") is None


def test_4bit_needs_out_features_divisible_by_32_on_cpu():
    """A Linear whose out_features is not a multiple of 32 is named up front, before bitsandbytes fails."""
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    with pytest.raises(InputError, match=r"^engine\.roles\.actor\.quantization=4bit: .*gate_proj "
                                         r"\(out_features=80\)"):
        check_4bit_shapes(model, "engine.roles.actor.quantization")


def test_4bit_model_computes_the_same_in_rollout_and_training(folder, batch):
    """PPO's ratio is exp(train log-prob - rollout log-prob): a 4-bit model must give the same numbers in eval
    mode without autograd (rollout, scoring) as in train mode with it (bitsandbytes' CPU repacking is off)."""
    model = load_causal_lm(str(folder), quantization="4bit")
    model.train()
    model.get_input_embeddings().weight.requires_grad_(True)  # so that the forward runs with autograd
    training = response_logprobs(model, batch)
    assert training.requires_grad
    model.eval()
    rollout = batched(response_logprobs, model, batch, 6)
    assert_close(rollout, training.detach(), rtol=1e-6, atol=1e-6)


def test_merged_folder_of_a_tied_embedding_model(tok, batch, tmp_path):
    """A model whose LM head shares the input embedding is saved with the tensor once and loads tied."""
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    peft = add_lora(model, SPEC, "engine.roles.actor", "default")
    randomise_adapter(peft.get_base_model(), "default", seed=7)
    expected = batched(response_logprobs, peft.get_base_model(), batch, 6)
    save_merged(peft.get_base_model(), tok, tmp_path, "default", torch.float32)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    assert_close(batched(response_logprobs, merged, batch, 6), expected, rtol=1e-5, atol=1e-5)


def test_4bit_shape_check_runs_before_loading_a_folder(tok, tmp_path):
    """load_causal_lm with 4bit names the offending layer for a folder whose sizes the CPU kernel cannot take."""
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=80, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    save_model(LlamaForCausalLM(config), tok, tmp_path)
    with pytest.raises(InputError, match=r"^engine\.roles\.critic\.quantization=4bit: .*out_features=80"):
        load_causal_lm(str(tmp_path), quantization="4bit", quant_field="engine.roles.critic.quantization")


def _saved_float32(model, batch, mixed: bool) -> list[int]:
    """Sizes of the float32 activations autograd keeps for the model body's backward (parameters left out)."""
    saved, params = [], {id(p) for p in model.parameters()}

    def keep(t):
        if t.dtype == torch.float32 and id(t) not in params and t.numel() >= batch.input_ids.numel() * 64:
            saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        with mixed_precision(model) if mixed else contextlib.nullcontext():
            model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             position_ids=batch.position_ids, use_cache=False)
    return saved


def test_lora_on_a_bf16_base_computes_in_bf16_from_float32_masters(folder, batch):
    """A bf16 base with float32 adapters runs under bf16 autocast (forward.py): autograd keeps no float32 copy of a
    LoRA layer's input (peft casts each one to float32 without it); the adapters and their gradients stay float32,
    and the gradients of the log-probs point where those of the same weights computed all in float32 do."""
    model = add_lora(load_causal_lm(str(folder), precision="bf16"), SPEC, "engine.roles.actor",
                     "default").get_base_model()
    randomise_adapter(model, "default", 0)
    exact = copy.deepcopy(model).float()
    assert compute_dtype(model) == torch.bfloat16 and compute_dtype(exact) is None
    c, tokens = model.config, batch.input_ids.numel()
    lora_inputs = c.num_hidden_layers * tokens * (2 * c.hidden_size + c.intermediate_size)  # q_proj, v_proj, down_proj
    # the norms' own float32 math is kept either way
    assert sum(_saved_float32(model, batch, False)) - sum(_saved_float32(model, batch, True)) == lora_inputs
    grads = []
    for m in (model, exact):
        response_logprobs(m, batch).sum().backward()
        grads.append({n: p.grad for n, p in adapter_parameters(m, "default").items()})
    for name, g in grads[0].items():
        assert g.dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(g.flatten(), grads[1][name].flatten(), dim=0)
        assert cos > 0.999, (name, cos)


@pytest.mark.parametrize("shared", [True, False])
def test_a_critic_with_a_trained_bf16_head_computes_its_body_under_autocast(folder, batch, shared):
    """A critic whose trained parameters are float32 adapters and a bf16 head (shared base: the value head is its
    only parameter; a LoRA critic: its `score` kept trainable) runs its body under bf16 autocast like the actor:
    compute_dtype of the whole scorer is None (two trained dtypes), so token_scores asks the body's."""
    base = load_causal_lm(str(folder), precision="bf16")
    head = value_head(base.config.hidden_size, torch.bfloat16, None, 0.02, seed=0)
    if shared:
        critic = SharedBase(base, SPEC, SPEC, head).critic
        body = critic.base_model
    else:
        critic = torch.nn.Module()
        critic.base_model, critic.score = add_lora(base, SPEC, "engine.roles.critic", "default").get_base_model()\
            .model, head.requires_grad_(True)
        body = critic.base_model
    assert compute_dtype(critic) is None and compute_dtype(body) == torch.bfloat16
    seen = []
    hook = body.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda *_: seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")))
    try:
        values = token_scores(critic, batch)
    finally:
        hook.remove()
    assert seen == [torch.bfloat16] and values.dtype == torch.float32 and values.shape == batch.input_ids.shape


def test_a_float32_head_over_a_bf16_body_trains_where_a_bf16_one_cannot(folder, batch):
    """The stages train a scorer's head in float32 (stages/common.py with_lora, the value head of stages/ppo.py):
    token_scores feeds it the bf16 body's hidden state in float32 and its gradient flows into the adapters; one AdamW
    step at 1e-5 moves every weight, where the same step on the bf16 head rounds most away (a 0.02 weight's bf16
    step is ~1e-4: only weights near zero move)."""
    moved = {}
    for dtype in (torch.float32, torch.bfloat16):
        base = load_causal_lm(str(folder), precision="bf16")
        sb = SharedBase(base, SPEC, SPEC, value_head(base.config.hidden_size, dtype, None, 0.02, seed=0))
        head, before = sb.head.weight, sb.head.weight.detach().clone()
        opt = torch.optim.AdamW(sb.critic_params.parameters(), lr=1e-5)  # the critic's adapters and its head
        with sb.use("critic"):
            values = token_scores(sb.critic, batch)
        assert values.dtype == torch.float32
        values.square().mean().backward()
        assert all(p.grad is not None for p in sb.critic_params.parameters())  # through the cast into the body
        opt.step()
        moved[dtype] = float((head.detach() != before).float().mean())
    assert moved[torch.float32] == 1.0 and moved[torch.bfloat16] < 0.25, moved


def test_forwards_without_autograd_cache_no_cast_adapters(folder):
    """Training's forward keeps autocast's cache (a cast weight reused by backward); a forward without autograd (the
    rollout's prefill, scoring) does not, so the adapters' bf16 copies go as soon as each layer is done."""
    model = add_lora(load_causal_lm(str(folder), precision="bf16"), SPEC, "engine.roles.actor",
                     "default").get_base_model()
    with mixed_precision(model):
        assert torch.is_autocast_cache_enabled()
    with torch.no_grad(), mixed_precision(model):
        assert not torch.is_autocast_cache_enabled()


def test_compute_dtype_only_for_float32_trained_over_a_lower_precision_base(folder):
    fp32 = add_lora(load_causal_lm(str(folder)), SPEC, "engine.roles.actor", "default").get_base_model()
    assert compute_dtype(fp32) is None
    frozen = load_causal_lm(str(folder), precision="bf16").requires_grad_(False)
    assert compute_dtype(frozen) is None  # nothing trained: scoring roles run as loaded
    assert isinstance(mixed_precision(frozen), contextlib.nullcontext)
