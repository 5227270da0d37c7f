"""Unit tests for hybridcore.actor.HybridActor: one set of weights for rollout and training."""
import random
from collections import Counter

import pytest
import torch

from hybridcore.actor import HybridActor
from hybridcore.batch import pack
from hybridcore.forward import response_logprobs
from hybridcore.models import build_preset, train_tokenizer

NAMES = ["mia", "leo", "ana", "tom", "zoe", "max", "ivy", "sam"]
FRUITS = ["pears", "apples", "plums", "figs", "limes"]
MAX_NEW = 12


def make_texts(n=200, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        out.append(f"{rng.choice(NAMES)} has {a} {rng.choice(FRUITS)} and gets {b} more. total: {a + b}")
    return out


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(make_texts(), 384)


@pytest.fixture(scope="module")
def prompts(tok):
    """Eight prompts of pairwise different lengths (1..30 tokens)."""
    texts = make_texts(16, seed=5)
    lens = [5, 12, 1, 20, 8, 30, 3, 16]
    out = [tok(texts[2 * i] + ". " + texts[2 * i + 1], add_special_tokens=False)["input_ids"][:n]
           for i, n in enumerate(lens)]
    assert [len(p) for p in out] == lens
    return out


def fresh_model(tok):
    torch.manual_seed(0)
    return build_preset("micro", tok, seed=0).float()


def with_likely_eos(model, tok, prompts, max_new: int = MAX_NEW):
    """Make eos 1.5x as likely (in logit) as the model's favourite greedy token, so some rows stop early."""
    actor = HybridActor(model.eval(), tok, backend="hf")
    with actor.rollout():
        out = actor.generate(prompts, max_new, greedy=True)
    top = Counter(t for row in out for t in row).most_common(1)[0][0]
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 1.5 * model.lm_head.weight[top]
    return model


@pytest.fixture(scope="module")
def eos_model(tok, prompts):
    """A micro model in eval mode whose eos logit is 1.5x the logit of its most generated token, so that some
    greedy responses stop at eos and others run to MAX_NEW tokens."""
    return with_likely_eos(fresh_model(tok), tok, prompts)


@pytest.fixture(scope="module")
def alone(tok, prompts, eos_model):
    """Greedy responses of eos_model generated for each prompt on its own (batch of 1, no padding)."""
    actor = HybridActor(eos_model, tok)
    with actor.rollout():
        return [actor.generate([p], MAX_NEW, greedy=True)[0] for p in prompts]


def param_ptrs(model):
    return {n: p.data_ptr() for n, p in model.named_parameters()}


def param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ------------------------------------------------------------------------------------------------ transitions


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("was_training", [True, False])
def test_rollout_reuses_the_training_weights(tok, prompts, was_training, backend):
    """Inside rollout the very same parameter objects/storage serve generation; the mode is restored after."""
    model = fresh_model(tok)
    model.train(was_training)
    actor = HybridActor(model, tok, backend=backend)
    ptrs, params = param_ptrs(model), dict(model.named_parameters())
    n_params, n_bytes = sum(p.numel() for p in model.parameters()), param_bytes(model)
    n_tensors = len(model.state_dict())
    assert torch.is_grad_enabled()
    with actor.rollout() as a:
        assert a is actor and actor.in_rollout
        assert not model.training and all(not m.training for m in model.modules())
        assert not torch.is_grad_enabled()
        assert param_ptrs(model) == ptrs
        assert all(p is params[n] for n, p in model.named_parameters())
        actor.generate(prompts[:3], 4, greedy=True)
        assert param_ptrs(model) == ptrs
        assert sum(p.numel() for p in model.parameters()) == n_params and param_bytes(model) == n_bytes
        assert len(model.state_dict()) == n_tensors
    assert not actor.in_rollout
    assert torch.is_grad_enabled()
    assert param_ptrs(model) == ptrs
    assert all(p is params[n] for n, p in model.named_parameters())
    assert model.training == was_training
    assert all(m.training == was_training for m in model.modules())
    assert set(actor.last_transition_s) == {"enter", "exit"}
    assert set(actor.last_transition_bytes) == {"enter", "exit", "kv_cache"}  # memory deltas: 0 on CPU
    assert (actor.last_transition_bytes["kv_cache"] > 0) == (backend == "native")


def test_rollout_restores_state_after_exception(tok):
    """An exception inside rollout still restores train mode, autograd and in_rollout."""
    model = fresh_model(tok).train()
    actor = HybridActor(model, tok)
    with pytest.raises(ValueError):
        with actor.rollout():
            raise ValueError("boom")
    assert model.training and torch.is_grad_enabled() and not actor.in_rollout


def test_rollout_runs_its_transitions_in_order_and_unwinds_a_failed_entry(tok, prompts):
    """rollout() enters mode, optimizer offload and the backend in that order and leaves them in reverse, each timed
    on its own; when one fails on entry, the ones entered before it are left again (train mode, states back)."""
    model = fresh_model(tok).train()
    opt = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.tensor([prompts[1]])).logits.sum().backward()
    opt.step()
    actor = HybridActor(model, tok, optimizer=opt, offload_optimizer=True)
    assert [t.name for t in actor.transitions] == ["mode", "optimizer_offload", "rollout_backend"]
    calls = []
    for t in actor.transitions:
        for phase in ("enter", "exit"):
            def spy(fn=getattr(t, phase), name=t.name, phase=phase):
                calls.append((phase, name))
                return fn()
            setattr(t, phase, spy)
    with actor.rollout():
        actor.generate(prompts[:2], 3, greedy=True)
    names = ["mode", "optimizer_offload", "rollout_backend"]
    assert calls == [("enter", n) for n in names] + [("exit", n) for n in reversed(names)]
    assert set(actor.last_transitions) == set(names)
    assert all(set(v) == {"enter_s", "exit_s", "enter_bytes", "exit_bytes"} and v["enter_s"] >= 0
               for v in actor.last_transitions.values())
    state_devices = [v.device for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]

    def broken():
        raise RuntimeError("backend failed to start")
    actor.transitions[-1].enter = broken
    with pytest.raises(RuntimeError, match="failed to start"):
        with actor.rollout():
            pass
    assert model.training and not actor.in_rollout
    assert [v.device for s in opt.state.values() for v in s.values() if torch.is_tensor(v)] == state_devices
    assert not actor.offload._offloaded  # restored, nothing left to bring back
    host = {t.data_ptr() for t in actor.offload.host_states.values()}
    assert host and not host & {v.data_ptr() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)}


def test_rollout_toggles_activation_checkpointing(tok, prompts):
    """With activation checkpointing on, rollout turns it off inside and back on after."""
    model = fresh_model(tok).train()
    actor = HybridActor(model, tok, activation_checkpointing=True)
    assert model.is_gradient_checkpointing
    with actor.rollout():
        assert not model.is_gradient_checkpointing
        actor.generate(prompts[:2], 3, greedy=True)
    assert model.is_gradient_checkpointing and model.training


def test_generate_outside_rollout_raises(tok, prompts):
    """generate() outside `with actor.rollout():` raises RuntimeError (also after leaving a rollout)."""
    actor = HybridActor(fresh_model(tok).eval(), tok)
    with pytest.raises(RuntimeError, match="rollout"):
        actor.generate(prompts[:1], 3, greedy=True)
    with actor.rollout():
        pass
    with pytest.raises(RuntimeError, match="rollout"):
        actor.generate(prompts[:1], 3, greedy=True)


# ------------------------------------------------------------------------------------------------ generation


def test_native_is_the_default_backend(tok):
    assert HybridActor(fresh_model(tok), tok).backend.name == "native"


def test_eos_model_gives_mixed_stops(tok, alone):
    """Sanity check of the fixture: some greedy responses stop early at eos, some run to MAX_NEW tokens."""
    out = alone
    assert any(r[-1] == tok.eos_token_id and len(r) < MAX_NEW for r in out)
    assert any(tok.eos_token_id not in r and len(r) == MAX_NEW for r in out)


@pytest.mark.parametrize("bs", [1, 3, 5])
def test_greedy_batch_equals_one_by_one(tok, prompts, eos_model, alone, bs):
    """Greedy generation of a left-padded batch equals generating each prompt alone; responses end at eos."""
    actor = HybridActor(eos_model, tok)
    eos = tok.eos_token_id
    with actor.rollout():
        for start in range(0, len(prompts), bs):
            chunk = prompts[start:start + bs]
            out = actor.generate(chunk, MAX_NEW, greedy=True)
            assert len(out) == len(chunk)
            assert out == alone[start:start + bs]
    for r in alone:
        assert 1 <= len(r) <= MAX_NEW
        if eos in r:
            assert r.index(eos) == len(r) - 1  # stops right after eos
        else:
            assert len(r) == MAX_NEW
        assert tok.pad_token_id not in r


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_rollout_equals_one_batch_and_keeps_one_cache(tok, prompts, eos_model, alone, chunk):
    """chunk_size splits the rollout into equal chunks (the last one filled up, its extra rows dropped): greedy
    responses equal the per-prompt ones, in order, and one KV cache of `size` rows serves every chunk."""
    actor = HybridActor(eos_model, tok, chunk_size=chunk)
    with actor.rollout():
        out = actor.generate(prompts, MAX_NEW, greedy=True)
        cache_rows = actor.backend._decoder.batch
    n = len(prompts)
    assert out == alone
    assert actor.last_stats["chunks"] == -(-n // chunk) and cache_rows == actor.last_stats["chunk_rows"] <= chunk


@pytest.mark.parametrize("prefill_tokens", [1, 8 * 7, 4096])
def test_chunked_prefill_equals_one_pass(tok, prompts, eos_model, alone, prefill_tokens):
    """The prompt prefilled in chunks (the smallest, capacity / PREFILL_CHUNKS columns; 7 columns; one chunk past
    the prompt's end): the same greedy responses."""
    actor = HybridActor(eos_model, tok, backend_options={"prefill_tokens": prefill_tokens})
    with actor.rollout():
        assert actor.generate(prompts, MAX_NEW, greedy=True) == alone


def test_a_long_prompt_in_a_large_batch_is_prefilled_in_at_most_prefill_chunks_forwards(tok, eos_model):
    """prefill_tokens alone would give 2-token rows here (a prefill as slow as decoding): PREFILL_CHUNKS caps the
    forwards, and the responses equal one pass's."""
    from hybridcore.rollout import PREFILL_CHUNKS
    long = [[(7 * i + j) % 50 + 3 for j in range(3 * PREFILL_CHUNKS + i % 3)] for i in range(6)]
    responses = {}
    for tokens in (6 * 2, 10 ** 6):
        actor = HybridActor(eos_model, tok, backend_options={"prefill_tokens": tokens})
        with actor.rollout():
            responses[tokens] = actor.generate(long, MAX_NEW, greedy=True)
        responses[tokens, "chunks"] = actor.backend.last_stats["prefill_chunks"]
    uncapped = -(-max(map(len, long)) // (12 // len(long)))  # 2 positions a chunk: 25 forwards
    assert responses[12, "chunks"] <= PREFILL_CHUNKS < uncapped and responses[10 ** 6, "chunks"] == 1
    assert responses[12] == responses[10 ** 6]


def test_rollout_logprobs_are_the_training_logprobs_of_the_sampled_tokens(tok, prompts, eos_model):
    """The native rollout keeps each sampled token's log-prob under the model's own softmax (not the temperature's):
    the training forward gives the same numbers for the same tokens (fp32 micro model: to rounding)."""
    actor = HybridActor(eos_model, tok, chunk_size=3)
    torch.manual_seed(0)
    with actor.rollout():
        out = actor.generate(prompts[:5], MAX_NEW, temperature=1.3, top_k=20)
    assert [len(lp) for lp in actor.last_logprobs] == [len(r) for r in out]
    batch = pack(prompts[:5], out, tok.pad_token_id)
    with torch.no_grad():
        train = response_logprobs(eos_model, batch)
    for i, lp in enumerate(actor.last_logprobs):
        torch.testing.assert_close(torch.tensor(lp), train[i, :len(lp)], atol=1e-4, rtol=1e-4)
    assert max(abs(x) for lp in actor.last_logprobs for x in lp) > 0.1  # not all near-certain tokens


def test_greedy_batch_reordered_prompts(tok, prompts, eos_model):
    """Reversing the order of prompts in a batch reverses the responses (rows do not leak into each other)."""
    actor = HybridActor(eos_model, tok)
    with actor.rollout():
        fwd = actor.generate(prompts[:5], MAX_NEW, greedy=True)
        rev = actor.generate(prompts[:5][::-1], MAX_NEW, greedy=True)
    assert rev == fwd[::-1]


def test_top_k_1_sampling_equals_greedy(tok, prompts, eos_model):
    """Sampling with top_k=1 gives the greedy responses whatever the seed."""
    actor = HybridActor(eos_model, tok)
    with actor.rollout():
        greedy = actor.generate(prompts[:5], MAX_NEW, greedy=True)
        for seed in (0, 1):
            torch.manual_seed(seed)
            assert actor.generate(prompts[:5], MAX_NEW, top_k=1) == greedy


def test_sampling_reproducible_with_seed(tok, prompts):
    """With a fixed torch.manual_seed sampling repeats exactly; another seed gives other samples."""
    actor = HybridActor(fresh_model(tok).eval(), tok)
    with actor.rollout():
        torch.manual_seed(123)
        a = actor.generate(prompts[:5], MAX_NEW, temperature=1.0)
        torch.manual_seed(123)
        b = actor.generate(prompts[:5], MAX_NEW, temperature=1.0)
        torch.manual_seed(321)
        c = actor.generate(prompts[:5], MAX_NEW, temperature=1.0)
    assert a == b
    assert a != c
    for r in a:
        eos = tok.eos_token_id
        assert (eos in r and r.index(eos) == len(r) - 1) or len(r) == MAX_NEW


# ------------------------------------------------------------------------------------------------ training


def test_training_after_rollout_updates_the_rollout_weights(tok, prompts):
    """After a rollout, loss.backward + optimizer.step change the same tensors the rollout generated with."""
    model = fresh_model(tok).train()
    actor = HybridActor(model, tok)
    with actor.rollout():
        rollout_ptrs = param_ptrs(model)
        rollout_params = [p for p in model.parameters()]
        responses = actor.generate(prompts[:4], 6, greedy=True)
    assert model.training
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = pack(prompts[:4], responses, tok.pad_token_id)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def loss_fn():
        lp = response_logprobs(model, batch)
        return -(lp * batch.response_mask).sum() / batch.response_mask.sum()

    loss0 = loss_fn()
    assert loss0.requires_grad
    loss0.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    opt.step()
    opt.zero_grad()
    assert param_ptrs(model) == rollout_ptrs
    assert all(p is q for p, q in zip(model.parameters(), rollout_params))
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert "lm_head.weight" in changed and "model.embed_tokens.weight" in changed
    assert any("layers.0" in n for n in changed)
    with torch.no_grad():
        assert loss_fn() < loss0.detach()
    # the next rollout sees the updated weights
    with actor.rollout():
        assert param_ptrs(model) == rollout_ptrs
        assert not torch.equal(model.lm_head.weight, before["lm_head.weight"])
