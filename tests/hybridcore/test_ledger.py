"""hybridcore.ledger.MemoryLedger on CPU: what each phase holds, by kind, against numbers computed from the model."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybridcore.actor import HybridActor
from hybridcore.ledger import KINDS, MIB, MemoryLedger, quant_state_tensors
from hybridcore.engine import Engine, make_engine

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 2, 64, 2, 1, 96  # head_dim 32; grouped-query attention (2:1)


def tiny_llama(tied: bool = False, dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                         max_position_embeddings=256, tie_word_embeddings=tied, pad_token_id=0,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(dtype)


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() yields a tied one once


def engine(model) -> Engine:
    return make_engine(model, lr=1e-3, total_steps=10, warmup_ratio=0.0, max_grad_norm=1.0)


def loss_of(model, rows: int = 2, length: int = 16):
    ids = torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(1))
    return model(input_ids=ids, labels=ids).loss


def test_kinds_follow_a_training_step():
    """weights = the parameter bytes; gradients appear with backward and are gone after the optimizer step
    (which clears them); the optimizer then holds AdamW's two moments per parameter (+ its step counters)."""
    model = tiny_llama()
    eng = engine(model)
    ledger = MemoryLedger("cpu", models=[model], engines=[eng])
    try:
        with ledger.phase("forward"), torch.no_grad():
            loss_of(model)
        with ledger.phase("backward"):
            eng.backward(loss_of(model))
        with ledger.phase("step"):
            eng.step()
        m = ledger.metrics()
    finally:
        ledger.close()
    n = param_bytes(model)
    for phase in ("forward", "backward", "step"):
        assert m[f"mem_{phase}_weights_mib"] * MIB == n
        assert m[f"mem_{phase}_kv_cache_mib"] == 0
        kinds = sum(m[f"mem_{phase}_{k}_mib"] for k in KINDS)
        assert math.isclose(kinds, m[f"mem_{phase}_peak_mib"], rel_tol=1e-9)  # activations are the remainder
        assert m[f"mem_{phase}_activations_mib"] >= 0
    assert m["mem_forward_gradients_mib"] == 0 and m["mem_forward_optimizer_mib"] == 0
    assert m["mem_backward_gradients_mib"] * MIB == n  # every parameter is trained here
    assert m["mem_step_gradients_mib"] == 0
    n_tensors = len(list(model.parameters()))
    optimizer = m["mem_step_optimizer_mib"] * MIB
    assert 2 * n <= optimizer <= 2 * n + 8 * n_tensors  # exp_avg + exp_avg_sq, and one scalar `step` each


def test_shared_storage_counts_once_and_other_devices_not_at_all():
    """Tied embeddings are one storage; a model listed twice (the reference sharing the actor's base) adds
    nothing; weights on another device than the ledger's are not counted."""
    model = tiny_llama(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ledger = MemoryLedger("cpu", models=[model, model])
    assert ledger.held_now()["weights"] == param_bytes(model)
    assert MemoryLedger("meta", models=[model]).held_now()["weights"] == 0


def test_kv_cache_of_the_native_rollout_matches_the_config():
    """The rollout's static KV cache = layers x 2 (K and V) x batch x length x kv_heads x head_dim x dtype size,
    reported through the phase's hold() while the cache exists (it is freed before the phase ends)."""
    model = tiny_llama(dtype=torch.bfloat16).eval()
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=None)
    actor = HybridActor(model, tok, backend="native")
    batch, prompt, new = 3, 40, 24  # prompt + new = 64 = the cache's capacity granularity: no rounding up
    prompts = torch.randint(1, VOCAB, (batch, prompt), generator=torch.Generator().manual_seed(2)).tolist()
    ledger = MemoryLedger("cpu", models=[model])
    try:
        with ledger.phase("rollout") as mem, actor.rollout():
            out = actor.generate(prompts, new, greedy=True)
            mem.hold("kv_cache", actor.backend.kv_cache_bytes)
        assert actor.backend.kv_cache_bytes == 0  # freed on leaving the rollout
        m = ledger.metrics()
    finally:
        ledger.close()
    assert [len(r) for r in out] == [new] * batch
    head_dim = HIDDEN // HEADS
    expected = LAYERS * 2 * batch * (prompt + new) * KV_HEADS * head_dim * 2  # bf16: 2 bytes
    assert m["mem_rollout_kv_cache_mib"] * MIB == expected
    assert m["mem_rollout_peak_mib"] * MIB >= expected + param_bytes(model)


def test_quantised_weights_count_their_quantisation_state():
    """A 4-bit NF4 layer with double quantisation: its packed weight plus absmax/code of both levels."""
    import bitsandbytes as bnb
    layer = bnb.nn.Linear4bit(256, 128, bias=False, compute_dtype=torch.float32, compress_statistics=True,
                              quant_type="nf4")
    layer = layer.to("cpu")  # quantises here
    w = layer.weight
    extra = quant_state_tensors(w)
    assert len(extra) >= 4  # absmax (uint8 when nested), code, offset, and the nested absmax and code
    held = MemoryLedger("cpu", models=[layer]).held_now()["weights"]
    assert held == w.untyped_storage().nbytes() + sum(t.untyped_storage().nbytes() for t in extra)
    assert w.untyped_storage().nbytes() == 256 * 128 // 2  # 4 bits a weight


def test_phase_entered_again_keeps_its_peak_and_adds_seconds_until_metrics():
    ledger = MemoryLedger("cpu")
    try:
        for _ in range(2):
            with ledger.phase("update"):
                torch.ones(1)
        rec = ledger.records["update"]
        assert rec.calls == 2 and rec.seconds > 0
        m = ledger.metrics()
        assert set(m) == {f"mem_update_{k}_mib" for k in ("peak", *KINDS)}
        assert ledger.records == {}  # a new step
        with ledger.phase("update"):
            pass
        assert ledger.records["update"].calls == 1
        assert "update" in ledger.table() and ledger.summary().keys() == m.keys()
    finally:
        ledger.close()


def test_phases_do_not_nest_and_hold_checks_the_kind():
    ledger = MemoryLedger("cpu")
    try:
        with pytest.raises(RuntimeError, match="do not nest"):
            with ledger.phase("outer"):
                with ledger.phase("inner"):
                    pass
        with pytest.raises(ValueError, match="memory kind"):
            with ledger.phase("rollout") as mem:
                mem.hold("activations", 1)
    finally:
        ledger.close()


def test_ppo_stage_reports_the_ledger(tiny_run):
    """stages/ppo.py wires the ledger: the tiny pipeline's PPO summary holds the last step's four phases (the
    session's shared run, so no extra pipeline). The rollout's KV cache is the tiny preset's static cache: layers x
    2 x batch x capacity x kv_heads x head_dim x 4 bytes (fp32), the capacity a multiple of 64 columns."""
    from hybridcore.models import PRESETS

    m = tiny_run.summary["stages"]["ppo"]["metrics"]
    tiny = PRESETS["tiny"]
    for phase in ("rollout", "scoring", "critic_update", "actor_update"):
        kinds = [m[f"mem_{phase}_{k}_mib"] for k in KINDS]
        assert math.isclose(sum(kinds), m[f"mem_{phase}_peak_mib"], rel_tol=1e-6), phase
        assert m[f"mem_{phase}_weights_mib"] > 0
    assert m["mem_actor_update_gradients_mib"] > 0 and m["mem_rollout_gradients_mib"] == 0
    per_column = tiny["num_hidden_layers"] * 2 * 64 * tiny["num_key_value_heads"] * \
        (tiny["hidden_size"] // tiny["num_attention_heads"]) * 4  # rollout_batch_size 64
    kv = m["mem_rollout_kv_cache_mib"] * MIB
    assert kv > 0 and kv % (per_column * 64) == 0
    assert m["mem_scoring_kv_cache_mib"] == 0  # freed when the rollout ended
