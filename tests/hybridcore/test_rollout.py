"""The native rollout backend against transformers' generate, its sampler, and the train <-> rollout
transition (no weight copy, KV cache freed, optimizer states offloaded and restored)."""
import gc
import warnings
import weakref
from collections import Counter

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from hybridcore.actor import HybridActor
from hybridcore.batch import pack
from hybridcore.forward import response_logits
from hybridcore.models import build_preset, train_tokenizer
from hybridcore import rollout
from hybridcore.rollout import HFGenerate, NativeRollout
from hybridcore.sampling import sample, truncate
from tests.hybridcore.test_actor import MAX_NEW, make_texts, with_likely_eos

LENGTHS = [5, 12, 1, 20, 8, 30, 3, 16, 7, 24]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(make_texts(), 384)


@pytest.fixture(scope="module")
def prompts(tok):
    texts = make_texts(2 * len(LENGTHS), seed=7)
    return [tok(texts[2 * i] + ". " + texts[2 * i + 1], add_special_tokens=False)["input_ids"][:n]
            for i, n in enumerate(LENGTHS)]


def gqa_model(tok, seed):
    """A Qwen2 with 4 query heads over 2 KV heads (grouped-query attention), which the micro preset lacks."""
    vocab = -(-len(tok) // 32) * 32
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                     tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).float()


@pytest.fixture(scope="module", params=["llama-micro", "qwen2-gqa"])
def eos_model(request, tok, prompts):
    if request.param == "llama-micro":
        model = build_preset("micro", tok, seed=0).float()
    else:
        model = gqa_model(tok, seed=1)
    return with_likely_eos(model, tok, prompts)


def run(model, tok, prompts, backend, max_new=MAX_NEW, **kw):
    actor = HybridActor(model, tok, backend=backend)
    with actor.rollout():
        return actor.generate(prompts, max_new, **kw)


# ------------------------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize("bs,n", [(1, 4), (4, 10), (10, 10)])
def test_greedy_equals_transformers_generate(tok, prompts, eos_model, bs, n):
    """fp32 greedy tokens of the native loop equal transformers' generate, for batches of mixed prompt lengths
    (left padding) where some rows stop at eos and others run to max_new_tokens."""
    eos = tok.eos_token_id
    native, hf = [], []
    for s in range(0, n, bs):
        native += run(eos_model, tok, prompts[s:min(s + bs, n)], "native", greedy=True)
        hf += run(eos_model, tok, prompts[s:min(s + bs, n)], "hf", greedy=True)
    assert native == hf
    assert any(r[-1] == eos and len(r) < MAX_NEW for r in native)
    assert any(eos not in r and len(r) == MAX_NEW for r in native)


def test_greedy_equal_lengths_and_static_generate(tok, prompts, eos_model):
    """Prompts of one length (no padding) and a long decode; also equal to generate with the static cache."""
    same = [p[:12] for p in prompts if len(p) >= 12]
    native = run(eos_model, tok, same, "native", max_new=40, greedy=True)
    assert native == run(eos_model, tok, same, "hf", max_new=40, greedy=True)
    actor = HybridActor(eos_model, tok)
    actor.backend = HFGenerate(eos_model, cache_implementation="static")
    with actor.rollout():
        assert actor.generate(same, 40, greedy=True) == native


def test_cache_reused_and_regrown_within_one_rollout(tok, prompts, eos_model):
    """Several generate calls in one rollout (same batch size, a longer prompt, another batch size) reuse or
    reallocate the static state and stay equal to generate; checking for all-done every 4 steps changes nothing."""
    actor = HybridActor(eos_model, tok)
    actor.backend = NativeRollout(eos_model, stop_check_every=4)
    batches = [prompts[:3], prompts[3:6], prompts[5:8], prompts[:5]]  # the 30-token prompt grows the capacity
    with actor.rollout():
        got = [actor.generate(b, MAX_NEW, greedy=True) for b in batches]
    assert got == [run(eos_model, tok, b, "hf", greedy=True) for b in batches]


def test_compiled_step_equals_generate(tok, prompts):
    """The decode step through torch.compile (the default under a CUDA graph; forced here on CPU, without a
    graph) gives generate's greedy tokens, with rows stopping at eos, and says that it was compiled."""
    model = with_likely_eos(gqa_model(tok, seed=1), tok, prompts)
    actor = HybridActor(model, tok)
    actor.backend = NativeRollout(model, compile=True)
    with actor.rollout():
        native = actor.generate(prompts[:6], MAX_NEW, greedy=True)
        assert actor.backend.last_stats["compiled"] and not actor.backend.last_stats["cuda_graph"]
    assert native == run(model, tok, prompts[:6], "hf", greedy=True)
    assert any(r[-1] == tok.eos_token_id and len(r) < MAX_NEW for r in native)


@pytest.mark.parametrize("what", ["decode step", "prefill"])
def test_compile_failure_falls_back_only_when_automatic(tok, prompts, monkeypatch, what):
    """compile=None (the CUDA default) survives a compiler failure of the decode step or of the prefill: a warning,
    `compile_error` set, and the plain forward's tokens (a failed prefill leaves the step compiled; a failed step
    does not try the prefill); compile=True raises it."""
    model = build_preset("micro", tok, seed=0).float().eval()
    expected = run(model, tok, prompts[:3], "native", greedy=True)

    def broken(*args, **kwargs):
        raise RuntimeError("inductor exploded")
    if what == "prefill":
        monkeypatch.setattr(rollout, "compiled_prefill_chunk", lambda: broken)
        monkeypatch.setattr(rollout, "_compiled_step", torch.compile(rollout.decode_step, backend="eager"))
    else:
        monkeypatch.setattr(rollout, "compiled_decode_step", lambda: broken)
    for compile in (None, True):
        actor = HybridActor(model, tok)
        actor.backend = NativeRollout(model, cuda_graph=False, compile=compile)
        with actor.rollout():
            monkeypatch.setattr(actor.backend, "_resolve_compile", lambda graph: compile)
            if compile:
                with pytest.raises(RuntimeError, match="inductor exploded"):
                    actor.generate(prompts[:3], MAX_NEW, greedy=True)
                continue
            with pytest.warns(RuntimeWarning, match=f"compile of the {what} failed"):
                got = actor.generate(prompts[:3], MAX_NEW, greedy=True)
            assert got == expected
            stats = actor.backend.last_stats
            assert stats["compile_error"] == "RuntimeError: inductor exploded"
            assert stats["compiled"] == (what == "prefill") and not stats["prefill_compiled"]


@pytest.mark.parametrize("what", ["decode step", "prefill"])
def test_a_failed_automatic_compile_is_not_retried_every_rollout(tok, prompts, monkeypatch, what):
    """Each rollout builds its decoder afresh (exit frees the KV cache); after one failed automatic compile the
    later ones run that part uncompiled at once, still reporting the failure (on a GPU each retry cost seconds
    and ~2 GiB at the 8B shape: bench/RESULTS.md 2026-12-06); a failed prefill leaves the step compiled."""
    model = build_preset("micro", tok, seed=0).float().eval()
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("inductor exploded")
    if what == "prefill":
        monkeypatch.setattr(rollout, "compiled_prefill_chunk", lambda: broken)
        monkeypatch.setattr(rollout, "_compiled_step", torch.compile(rollout.decode_step, backend="eager"))
    else:
        monkeypatch.setattr(rollout, "compiled_decode_step", lambda: broken)
    actor = HybridActor(model, tok)
    actor.backend = NativeRollout(model, cuda_graph=False)
    monkeypatch.setattr(actor.backend, "_resolve_compile", lambda graph: None)
    for _ in range(3):
        with actor.rollout(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            actor.generate(prompts[:3], MAX_NEW, greedy=True)
        assert actor.backend.last_stats["compile_error"] == "RuntimeError: inductor exploded"
        assert actor.backend.last_stats["compiled"] == (what == "prefill")
        assert not actor.backend.last_stats["prefill_compiled"]
        # the decoder's construction (cache, compile attempt, capture) is timed apart from the prefill
        assert all(actor.backend.last_stats[k] >= 0 for k in ("build_s", "prefill_s", "decode_s"))
    assert len(calls) == 1


def test_temperature_zero_is_greedy(tok, prompts, eos_model):
    greedy = run(eos_model, tok, prompts[:6], "native", greedy=True)
    torch.manual_seed(0)
    assert run(eos_model, tok, prompts[:6], "native", temperature=0.0) == greedy
    assert run(eos_model, tok, prompts[:6], "native", top_k=1) == greedy


# ------------------------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 5, 1.0), (0.7, 0, 0.8), (1.3, 20, 0.6), (1.0, 0, 0.3)])
def test_candidates_match_transformers_warpers(temperature, top_k, top_p):
    """The set a token is drawn from equals what transformers' temperature/top-k/top-p warpers keep."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 300, generator=g) * 3
    ref = logits / temperature
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    cand, idx = truncate(logits, temperature, top_k, top_p)
    full = torch.full_like(logits, float("-inf"))
    full.scatter_(1, idx, cand) if idx is not None else full.copy_(cand)
    assert torch.equal(torch.isfinite(full), torch.isfinite(ref))
    assert torch.allclose(full.softmax(-1), ref.softmax(-1), atol=1e-6)


def test_sampler_statistics():
    """Draws follow the truncated softmax: top-k never leaves the top k, top-p keeps only the nucleus, and the
    frequencies match the renormalised probabilities."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log().expand(20000, -1).contiguous()
    torch.manual_seed(0)
    k3 = Counter(sample(logits, top_k=3).tolist())
    assert set(k3) == {0, 1, 2}
    assert abs(k3[0] / 20000 - 0.4 / 0.8) < 0.02
    nucleus = Counter(sample(logits, top_p=0.7).tolist())  # 0.4 + 0.25 < 0.7 <= 0.4 + 0.25 + 0.15
    assert set(nucleus) == {0, 1, 2}
    assert abs(nucleus[2] / 20000 - 0.15 / 0.8) < 0.02
    assert set(sample(logits, top_p=0.3).tolist()) == {0}
    cold = Counter(sample(logits, temperature=0.5).tolist())
    expect = (probs.log() / 0.5).softmax(-1)
    assert all(abs(cold[i] / 20000 - expect[i]) < 0.02 for i in range(6))
    assert torch.equal(sample(logits[:4], temperature=0.0), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.5)])
def test_sampled_tokens_stay_in_the_models_truncated_distribution(tok, prompts, eos_model, top_k, top_p):
    """Every sampled token lies in the top k (or the top-p nucleus) of the model's own next-token distribution
    at that step, recomputed by a full forward over the finished sequences."""
    torch.manual_seed(3)
    responses = run(eos_model, tok, prompts, "native", top_k=top_k, top_p=top_p)
    batch = pack(prompts, responses, tok.pad_token_id)
    with torch.no_grad():
        logits = response_logits(eos_model, batch).float()
    chosen = logits.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)
    real = batch.response_mask.bool()
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[..., -1]
        assert (chosen[real] >= kth[real] - 1e-4).all()
    else:
        probs = logits.softmax(-1)
        above = (probs * (logits > chosen.unsqueeze(-1))).sum(-1)  # mass of the more probable tokens
        assert (above[real] < top_p + 1e-4).all()
        assert (above[real] > 0).any()  # not just greedy


# ------------------------------------------------------------------------------------------------ transitions


def test_no_weight_copy_and_cache_freed_on_exit(tok, prompts):
    """Inside rollout no live tensor duplicates a weight, the parameters keep their storage, and leaving
    rollout frees the KV cache (its tensors die) and restores the model's attention implementation."""
    model = build_preset("micro", tok, seed=1234).float().train()
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    actor = HybridActor(model, tok)
    with actor.rollout():
        actor.generate(prompts[:4], MAX_NEW, temperature=1.0)
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
        cache = actor.backend._decoder.cache
        alive = [weakref.ref(t) for t in cache.keys + cache.values]
        kv_bytes = cache.nbytes
        weights = [p for p in model.parameters() if p.numel() >= 4096]
        # real tensors only: an earlier torch.compile leaves fake tensors and dead weak proxies behind, and
        # models built on the meta device (quantised loading) leave meta tensors
        tensors = [o for o in gc.get_objects()
                   if not isinstance(o, weakref.ProxyTypes) and type(o) in (torch.Tensor, torch.nn.Parameter)
                   and o.device == weights[0].device]
        for p in weights:
            copies = [o for o in tensors if o.shape == p.shape and o.dtype == p.dtype
                      and o.data_ptr() != p.data_ptr() and torch.equal(o, p)]
            assert not copies
        del cache, tensors, weights
    gc.collect()
    assert all(r() is None for r in alive)
    assert actor.backend.kv_cache_bytes == 0
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert kv_bytes == 2 * cfg.num_hidden_layers * 4 * cfg.num_key_value_heads * 64 * head_dim * 4
    assert actor.last_transition_bytes["kv_cache"] == kv_bytes
    assert set(actor.last_transition_s) == {"enter", "exit"}
    assert set(actor.last_transition_bytes) == {"enter", "exit", "kv_cache"}
    assert model.config._attn_implementation == "sdpa" and model.training


def test_attention_restored_after_exception(tok):
    model = build_preset("micro", tok, seed=0).float()
    actor = HybridActor(model, tok)
    with pytest.raises(ValueError):
        with actor.rollout():
            assert model.config._attn_implementation != "sdpa"
            raise ValueError("boom")
    assert model.config._attn_implementation == "sdpa" and not actor.in_rollout


def adamw_after_one_step(tok, prompts):
    model = build_preset("micro", tok, seed=5).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = pack(prompts[:4], [[5, 6, 7]] * 4, tok.pad_token_id)
    loss = response_logits(model, batch).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt, batch


def test_optimizer_offload_round_trip(tok, prompts):
    """With offload_optimizer, every state tensor lives in another (CPU) buffer during rollout and comes back
    identical; the next optimizer step matches an actor that never offloaded."""
    model, opt, batch = adamw_after_one_step(tok, prompts)
    ref_model, ref_opt, _ = adamw_after_one_step(tok, prompts)
    before = {(i, k): v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    ptrs = {(i, k): v.data_ptr() for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    actor = HybridActor(model, tok, optimizer=opt, offload_optimizer=True)
    reserved = actor.reserve_host_states()
    assert reserved == sum(v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    buffers = {k: id(v) for k, v in actor.offload.host_states.items()}
    for _ in range(2):  # every rollout copies into the buffers reserved before it: none is allocated inside
        with actor.rollout():
            assert {k: id(v) for k, v in actor.offload.host_states.items()} == buffers
            for i, s in enumerate(opt.state.values()):
                for k, v in s.items():
                    assert v.device.type == "cpu" and v.data_ptr() != ptrs[(i, k)]
                    assert torch.equal(v, before[(i, k)])
            actor.generate(prompts[:2], 4, greedy=True)
        after = {(i, k): v for i, s in enumerate(opt.state.values()) for k, v in s.items()}
        assert after.keys() == before.keys()
        for key, v in after.items():
            assert torch.equal(v, before[key]) and v.dtype == before[key].dtype and v.device == before[key].device
    for m, o in ((model, opt), (ref_model, ref_opt)):
        response_logits(m, batch).float().logsumexp(-1).mean().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    with pytest.raises(ValueError, match="optimizer"):
        HybridActor(model, tok, offload_optimizer=True)


def test_unknown_backend_is_refused(tok):
    with pytest.raises(ValueError, match="native"):
        HybridActor(build_preset("micro", tok, seed=0), tok, backend="vllm-ish")


def test_decode_attention_is_the_filled_columns_kernel_on_cuda(tok, prompts, monkeypatch):
    """attention="auto" decodes through the kernel that reads only the filled cache columns on CUDA where it takes
    the model's heads and passes its self-check, else through SDPA (a CPU rollout says so in last_stats); an
    explicit "filled" that cannot run is an error naming why; an unknown value is refused. The kernel itself, and
    its self-check run for real: test_decode_attention.py."""
    from hybridcore import decode_attention
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    checked = []
    monkeypatch.setattr(decode_attention, "self_check", lambda *args: checked.append(args))  # passes: None
    model = gqa_model(tok, seed=1)  # head_dim 32, 2 query heads a KV head
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert NativeRollout(model)._resolve_attention(cuda) == "filled"
    assert checked == [(32, 2, torch.float32, cuda)]
    assert NativeRollout(model, attention="sdpa")._resolve_attention(cuda) == "sdpa"
    actor = HybridActor(model, tok)
    with actor.rollout():
        actor.generate(prompts[:2], 3, greedy=True)
    assert actor.backend.last_stats["attention"] == "sdpa"
    with pytest.raises(RuntimeError, match="attention='filled' runs a Triton kernel on CUDA"):
        NativeRollout(model, attention="filled")._resolve_attention(cpu)
    odd = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=96, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1))  # head_dim 48
    assert NativeRollout(odd)._resolve_attention(cuda) == "sdpa"
    with pytest.raises(ValueError, match="cannot take this model's heads: head_dim 48, expected a power of two"):
        NativeRollout(odd, attention="filled")._resolve_attention(cuda)
    with pytest.raises(ValueError, match="attention 'flash', expected one of auto, sdpa, filled"):
        NativeRollout(model, attention="flash")


def test_a_kernel_failing_its_self_check_falls_back_to_sdpa_only_when_automatic(tok, monkeypatch):
    """Where decode_attention.self_check fails (a GPU whose Triton builds the kernel differently), auto warns once
    and decodes with SDPA, keeping why in attention_error; "filled" raises it. self_check itself reports an
    exception and an output off the reference (plain torch here: no kernel runs)."""
    from hybridcore import decode_attention
    monkeypatch.setattr(decode_attention, "self_check", lambda *args: "CompilationError: at 12:4")
    model, cuda = gqa_model(tok, seed=1), torch.device("cuda")
    backend = NativeRollout(model)
    with pytest.warns(RuntimeWarning, match=r"failed its self-check \(CompilationError: at 12:4\); decoding with SDPA"):
        assert backend._resolve_attention(cuda) == "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend._resolve_attention(cuda) == "sdpa"  # once is enough
    assert backend.attention_error == "CompilationError: at 12:4"
    with pytest.raises(ValueError, match="attention='filled', but the kernel failed its self-check: Compilation"):
        NativeRollout(model, attention="filled")._resolve_attention(cuda)
    monkeypatch.undo()
    check = decode_attention.self_check.__wrapped__  # uncached
    monkeypatch.setattr(decode_attention, "attend", lambda q, *args: torch.zeros_like(q))
    assert "off the reference (relative), expected < 0.02" in check(64, 4, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(decode_attention, "attend", lambda *args: 1 / 0)
    assert check(64, 4, torch.float32, torch.device("cpu")) == "ZeroDivisionError: division by zero"


def test_rollouts_stop_at_any_stop_token(tok, prompts, eos_model):
    """Several stop ids (EOS and a chat template's end of turn): each row ends at the first of either, exactly as
    generate with a list of eos ids; HybridActor stops at EOS and the template's <|im_end|>."""
    from hybridcore.batch import left_pad
    ids, mask = left_pad(prompts, tok.pad_token_id)
    actor = HybridActor(eos_model, tok)
    hf = HFGenerate(eos_model)

    def gen(backend, stops):
        with actor.rollout():
            return backend.generate(ids, mask, MAX_NEW, eos_id=stops, pad_id=tok.pad_token_id, greedy=True)

    free = gen(actor.backend, None)
    before_eos = [r[:r.index(tok.eos_token_id) if tok.eos_token_id in r else MAX_NEW - 1] for r in free.tolist()]
    common = Counter(t for r in before_eos for t in r).most_common(1)[0][0]  # a token rows write before they end
    stops = [tok.eos_token_id, common]

    def upto_stop(out):
        rows = []
        for r in out.tolist():
            end = next((i for i, t in enumerate(r) if t in stops), len(r) - 1)
            rows.append(r[:end + 1])
        return rows

    ours = upto_stop(gen(actor.backend, stops))
    assert ours == upto_stop(gen(hf, stops))
    assert any(r[-1] == common and len(r) < MAX_NEW for r in ours)
    assert actor.stop_ids == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]


def test_prefill_chunks_cover_the_prompt_in_one_shape():
    """Back-to-back chunks of one size, the last ending at the prompt's end; a short prompt is one chunk."""
    assert rollout.prefill_starts(9, 4) == [0, 4, 5] and rollout.prefill_starts(8, 4) == [0, 4]
    assert rollout.prefill_starts(3, 4) == [0] and rollout.prefill_starts(4, 4) == [0]
    for P in range(5, 40):
        starts = rollout.prefill_starts(P, 4)
        covered = set().union(*(range(s, s + 4) for s in starts))
        assert covered == set(range(P)) and starts[-1] + 4 == P


def test_the_prefill_compiles_once_for_prompts_of_several_lengths(tok, prompts, monkeypatch):
    """The compiled prefill's chunks have one shape per batch size and capacity: rollouts whose prompts are 5, 9
    and 20 tokens long (one, overlapping and several chunks) compile it once, and give generate's greedy tokens."""
    compiles = Counter()

    def counting(name):
        def backend(gm, example_inputs):
            compiles[name] += 1
            return gm.forward
        return backend
    monkeypatch.setattr(rollout, "_compiled_prefill", torch.compile(rollout.prefill_chunk, dynamic=False,
                                                                    backend=counting("prefill")))
    monkeypatch.setattr(rollout, "_compiled_step", torch.compile(rollout.decode_step, dynamic=False,
                                                                 backend=counting("step")))
    model = gqa_model(tok, seed=1)
    actor = HybridActor(model, tok)
    actor.backend = NativeRollout(model, compile=True, prefill_tokens=12)  # 3 rows: 4 columns a chunk
    batches = [[p[:n] for p in prompts[3:6]] for n in (5, 9, 20)]
    with actor.rollout():
        got = [actor.generate(b, MAX_NEW, greedy=True) for b in batches]
        assert actor.backend.last_stats["prefill_compiled"] and actor.backend.last_stats["prefill_chunks"] == 5
    assert got == [run(model, tok, b, "hf", greedy=True) for b in batches]
    assert compiles == {"prefill": 1, "step": 1}


def test_a_4bit_models_prefill_is_not_compiled(tok, prompts, monkeypatch):
    """bitsandbytes models keep the eager prefill (not timed compiled) where the decode step compiles."""
    model = gqa_model(tok, seed=1)
    monkeypatch.setattr(rollout, "_compiled_step", torch.compile(rollout.decode_step, backend="eager"))
    monkeypatch.setattr(rollout, "is_quantized", lambda m: m is model)
    actor = HybridActor(model, tok)
    actor.backend = NativeRollout(model, cuda_graph=False, compile=True)
    with actor.rollout():
        actor.generate(prompts[:3], MAX_NEW, greedy=True)
        assert actor.backend.last_stats["compiled"] and not actor.backend.last_stats["prefill_compiled"]
