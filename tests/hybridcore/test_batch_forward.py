"""Unit tests for hybridcore.batch and hybridcore.forward on a micro Llama built from a tokenizer trained here."""
import random

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from hybridcore.batch import Batch, left_pad, micro_batches, pack, position_ids, right_pad, shuffled_batches
from hybridcore.forward import (batched, pooled_index, response_logits, response_logprobs, response_values,
                                sequence_scores, sequences, token_scores)
from hybridcore.models import build_preset, load_sequence_scorer, save_model, train_tokenizer

NAMES = ["mia", "leo", "ana", "tom", "zoe", "max", "ivy", "sam"]
FRUITS = ["pears", "apples", "plums", "figs", "limes"]


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
def model(tok):
    torch.manual_seed(0)
    return build_preset("micro", tok, seed=0).float().eval()


@pytest.fixture(scope="module")
def scorer(tok, model, tmp_path_factory):
    path = tmp_path_factory.mktemp("scorer") / "model"
    save_model(model, tok, path)
    torch.manual_seed(1)  # the freshly initialised score head
    return load_sequence_scorer(str(path), pad_token_id=tok.pad_token_id).float().eval()


@pytest.fixture(scope="module")
def rows(tok):
    """Prompts of different lengths with responses of different lengths (one empty), all without pad tokens."""
    texts = make_texts(5, seed=1)
    cuts = [(4, 6), (15, 3), (9, 9), (22, 1), (2, 0)]
    prompts, responses = [], []
    for t, (p, r) in zip(texts, cuts):
        ids = tok(t, add_special_tokens=False)["input_ids"]
        prompts.append(ids[:p])
        responses.append(ids[p:p + r] + ([tok.eos_token_id] if r else []))
    assert len({len(p) for p in prompts}) == len(prompts)
    assert all(tok.pad_token_id not in p + r for p, r in zip(prompts, responses))
    return prompts, responses


# ------------------------------------------------------------------------------------------------ layout


def test_pack_layout_by_hand():
    """pack() left-pads prompts to end at prompt_len and right-pads responses; masks/positions/last_index hold."""
    b = pack([[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15], []], pad_id=0)
    assert b.prompt_len == 3 and len(b) == 3
    assert b.input_ids.tolist() == [[5, 6, 7, 11, 12, 0],
                                    [0, 0, 8, 13, 14, 15],
                                    [0, 9, 10, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0],
                                         [0, 0, 1, 1, 1, 1],
                                         [0, 1, 1, 0, 0, 0]]
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
    assert b.responses.tolist() == [[11, 12, 0], [13, 14, 15], [0, 0, 0]]
    # positions count 0, 1, 2, ... from each row's first real token
    for i in range(3):
        real = b.attention_mask[i].bool()
        assert b.position_ids[i][real].tolist() == list(range(int(real.sum())))
    assert b.last_index.tolist() == [4, 5, 2]
    for i in range(3):
        assert b.attention_mask[i, b.last_index[i]] == 1
        assert b.attention_mask[i, b.last_index[i] + 1:].sum() == 0


def test_pack_random_rows_invariants():
    """For random ragged rows, every prompt ends at column prompt_len and every response starts there."""
    g = random.Random(3)
    prompts = [[g.randint(2, 50) for _ in range(g.randint(1, 9))] for _ in range(7)]
    responses = [[g.randint(2, 50) for _ in range(g.randint(0, 6))] for _ in range(7)]
    b = pack(prompts, responses, pad_id=0)
    P = max(map(len, prompts))
    assert b.prompt_len == P
    assert b.input_ids.shape == (7, P + max(map(len, responses)))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        assert b.input_ids[i, P - len(p):P].tolist() == p
        assert b.input_ids[i, P:P + len(r)].tolist() == r
        assert b.attention_mask[i].tolist() == [0] * (P - len(p)) + [1] * (len(p) + len(r)) + \
            [0] * (b.input_ids.shape[1] - P - len(r))
        assert b.response_mask[i].sum() == len(r)
        assert b.position_ids[i, P - len(p):P + len(r)].tolist() == list(range(len(p) + len(r)))
        assert b.last_index[i] == P + len(r) - 1


def test_left_right_pad_and_position_ids():
    """left_pad/right_pad honour an explicit width and pad id; position_ids is the clamped mask cumsum."""
    ids, mask = left_pad([[1, 2], [3]], pad_id=9, width=4)
    assert ids.tolist() == [[9, 9, 1, 2], [9, 9, 9, 3]] and mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    ids, mask = right_pad([[1, 2], []], pad_id=9, width=3)
    assert ids.tolist() == [[1, 2, 9], [9, 9, 9]] and mask.tolist() == [[1, 1, 0], [0, 0, 0]]
    ids, mask = right_pad([[], []], pad_id=9)
    assert ids.shape == (2, 1) and mask.sum() == 0
    assert position_ids(torch.tensor([[0, 0, 1, 1, 1, 0]])).tolist() == [[0, 0, 0, 1, 2, 2]]


def test_select_keeps_prompt_len():
    """Batch.select picks rows of every tensor and keeps prompt_len."""
    b = pack([[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15], []], pad_id=0)
    s = b.select([2, 0])
    assert isinstance(s, Batch) and len(s) == 2 and s.prompt_len == 3
    assert s.input_ids.tolist() == [b.input_ids[2].tolist(), b.input_ids[0].tolist()]
    assert s.last_index.tolist() == [2, 4]


# ------------------------------------------------------------------------------------------------ forward


@torch.no_grad()
def test_response_logprobs_match_unpadded_rows(model, tok, rows):
    """response_logprobs on a left/right-padded batch equals each row run alone without padding."""
    prompts, responses = rows
    b = pack(prompts, responses, tok.pad_token_id)
    lp = response_logprobs(model, b)
    assert lp.shape == b.response_mask.shape and lp.dtype == torch.float32
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not r:
            continue
        full = model(input_ids=torch.tensor([p + r])).logits[0]
        logp = F.log_softmax(full.float(), dim=-1)
        expected = logp[len(p) - 1:len(p) + len(r) - 1].gather(1, torch.tensor(r).unsqueeze(1)).squeeze(1)
        assert_close(lp[i, :len(r)], expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_response_logits_shape_and_batched_matches(model, tok, rows):
    """response_logits is [B, R, V]; batched() over micro-batches of 2 equals the one-shot result."""
    prompts, responses = rows
    b = pack(prompts, responses, tok.pad_token_id)
    logits = response_logits(model, b)
    assert logits.shape == (len(b), b.response_mask.shape[1], model.config.vocab_size)
    whole = response_logprobs(model, b)
    mb = batched(response_logprobs, model, b, 2)
    m = b.response_mask.bool()
    assert_close(mb[m], whole[m], atol=1e-5, rtol=0)


def test_batched_runs_without_autograd(model, tok, rows):
    """batched() returns a tensor that does not require grad even for a model with trainable params."""
    prompts, responses = rows
    b = pack(prompts, responses, tok.pad_token_id)
    out = batched(response_logprobs, model, b, 3)
    assert not out.requires_grad and out.shape == b.response_mask.shape


@torch.no_grad()
def test_sequence_scores_match_hf_sequence_classification(scorer, tok, rows):
    """sequence_scores equals AutoModelForSequenceClassification's own pooled .logits[:, 0] (pad != eos)."""
    assert tok.pad_token_id != tok.eos_token_id
    prompts, responses = rows
    b = pack(prompts, responses, tok.pad_token_id)
    ours = sequence_scores(scorer, b)
    hf = scorer(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits[:, 0]
    assert ours.shape == (len(b),)
    assert_close(ours, hf.float(), atol=1e-5, rtol=0)


@torch.no_grad()
def test_sequence_scores_match_unpadded_rows(scorer, tok, rows):
    """Each row's sequence score equals the HF scorer on that row alone without padding (batch of 1)."""
    prompts, responses = rows
    b = pack(prompts, responses, tok.pad_token_id)
    ours = sequence_scores(scorer, b)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        alone = scorer(input_ids=torch.tensor([p + r])).logits[0, 0]
        assert_close(ours[i], alone.float(), atol=1e-4, rtol=0)


@torch.no_grad()
def test_response_values_shape_and_alignment(scorer, tok, rows):
    """response_values is [B, R]: the score head at the state before each response token, as run unpadded."""
    prompts, responses = rows
    b = pack(prompts, responses, tok.pad_token_id)
    v = response_values(scorer, b)
    R = b.response_mask.shape[1]
    assert v.shape == (len(b), R) and v.dtype == torch.float32
    ts = token_scores(scorer, b)
    assert ts.shape == b.input_ids.shape
    assert_close(v, ts[:, b.prompt_len - 1:b.prompt_len - 1 + R])
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not r:
            continue
        hidden = scorer.base_model(input_ids=torch.tensor([p + r])).last_hidden_state
        alone = scorer.score(hidden).squeeze(-1)[0].float()
        assert_close(v[i, :len(r)], alone[len(p) - 1:len(p) + len(r) - 1], atol=1e-4, rtol=0)


@torch.no_grad()
def test_sequence_scores_pool_where_transformers_pools_when_pad_is_eos(scorer, tok, rows):
    """With pad = EOS (a tokenizer that has no pad token), a row that ends in EOS pools at the token before it, as
    AutoModelForSequenceClassification does on the unpadded row."""
    prompts, responses = rows
    eos = tok.eos_token_id
    seqs = [p + r for p, r in zip(prompts, responses)]
    scorer.config.pad_token_id = eos
    try:
        ours = sequence_scores(scorer, sequences(seqs, eos))
        for i, s in enumerate(seqs):
            alone = scorer(input_ids=torch.tensor([s])).logits[0, 0]
            assert_close(ours[i], alone.float(), atol=1e-4, rtol=0)
        assert pooled_index(torch.tensor([[5, 6, eos, eos]]), eos).tolist() == [1]
    finally:
        scorer.config.pad_token_id = tok.pad_token_id


# ------------------------------------------------------------------------------------------------ batching


def test_shuffled_batches_deterministic_permutations():
    """shuffled_batches: same seed -> same batches; each epoch a permutation minus the dropped tail."""
    a = list(shuffled_batches(10, 3, epochs=3, seed=7))
    b = list(shuffled_batches(10, 3, epochs=3, seed=7))
    assert a == b
    assert len(a) == 9 and all(len(x) == 3 for x in a)
    epochs = [sum(a[e * 3:(e + 1) * 3], []) for e in range(3)]
    for ep in epochs:
        assert len(ep) == 9 and len(set(ep)) == 9 and set(ep) <= set(range(10))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert list(shuffled_batches(10, 3, epochs=3, seed=8)) != a


def test_shuffled_batches_exact_cover_and_small_n():
    """When batch_size divides n each epoch covers range(n) exactly; n < batch_size yields nothing."""
    out = list(shuffled_batches(12, 4, epochs=2, seed=0))
    assert len(out) == 6
    assert sorted(sum(out[:3], [])) == list(range(12)) and sorted(sum(out[3:], [])) == list(range(12))
    assert list(shuffled_batches(3, 4, epochs=2, seed=0)) == []


def test_micro_batches_cover_range():
    """micro_batches yields contiguous slices of at most `size` rows covering range(n) once."""
    sl = list(micro_batches(10, 4))
    assert sl == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert list(range(10)) == [i for s in sl for i in range(10)[s]]
    assert list(micro_batches(8, 4)) == [slice(0, 4), slice(4, 8)]
    assert list(micro_batches(3, 10)) == [slice(0, 3)]
    assert list(micro_batches(0, 4)) == []
