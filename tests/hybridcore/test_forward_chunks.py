"""The LM head in chunks: response log-probs, entropies and token losses equal the whole-logits formulas
(values and gradients), and no chunk is larger than asked, so peak float32 logits are bounded by it."""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from hybridcore import rl
from hybridcore.batch import pack
from hybridcore.forward import response_logits, response_logprobs, response_logprobs_entropy, response_nll
from hybridcore.models import build_preset, train_tokenizer

TEXTS = [f"leo has {a} figs and gets {b} more. total: {a + b}" for a in range(1, 10) for b in range(1, 10)]


@pytest.fixture(scope="module")
def setup():
    tok = train_tokenizer(TEXTS, 384)
    model = build_preset("micro", tok, seed=0).float()
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS[:5]]
    batch = pack([x[:5 + i % 3] for i, x in enumerate(ids)], [x[8:11 + i % 4] for i, x in enumerate(ids)],
                 tok.pad_token_id)
    return model, batch


def whole(model, batch):
    """The formulas computed on the whole micro-batch's logits, as the stages did before chunking."""
    logits = response_logits(model, batch)
    nll = F.cross_entropy(logits.float().flatten(0, 1), batch.responses.flatten(), reduction="none")
    return (rl.token_logprobs(logits, batch.responses), rl.entropy_from_logits(logits),
            nll.view_as(batch.responses), logits.argmax(-1) == batch.responses)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_values_equal_whole_logits(setup, chunk):
    """Every chunk size gives the whole-logits log-probs, entropies, losses and argmax hits."""
    model, batch = setup
    with torch.no_grad():
        logp, ent, nll, hit = whole(model, batch)
        got_logp, got_ent = response_logprobs_entropy(model, batch, chunk_tokens=chunk)
        got_nll, got_hit = response_nll(model, batch, chunk_tokens=chunk)
        assert_close(response_logprobs(model, batch, chunk_tokens=chunk), logp, rtol=1e-6, atol=1e-6)
    assert_close(got_logp, logp, rtol=1e-6, atol=1e-6)
    assert_close(got_ent, ent, rtol=1e-6, atol=1e-6)
    assert_close(got_nll, nll, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_hit, hit)


@pytest.mark.parametrize("chunk", [5, 4096])
def test_chunked_gradients_equal_whole_logits(setup, chunk):
    """Under autograd each chunk is recomputed in backward (one chunk: kept); the gradients are the
    whole-logits ones."""
    model, batch = setup
    m = batch.response_mask.float()

    def grads(fn):
        model.zero_grad(set_to_none=True)
        logp, ent = fn()
        ((logp * m).sum() + 0.1 * (ent * m).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    expected = grads(lambda: whole(model, batch)[:2])
    got = grads(lambda: response_logprobs_entropy(model, batch, chunk_tokens=chunk))
    model.zero_grad(set_to_none=True)
    for name in expected:
        assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_no_chunk_exceeds_chunk_tokens(setup):
    """The LM head never sees more than chunk_tokens positions at once, in forward or backward."""
    model, batch = setup
    sizes = []
    hook = model.get_output_embeddings().register_forward_hook(lambda mod, inp, out: sizes.append(out.shape[0]))
    try:
        logp, _ = response_logprobs_entropy(model, batch, chunk_tokens=6)
        logp.sum().backward()
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
    B, R = batch.response_mask.shape
    assert max(sizes) == 6 and sum(sizes) == 2 * B * R  # every position once in forward, once recomputed


def test_entropy_only_logged_keeps_no_graph_and_the_same_gradients(setup):
    """entropy_grad=False (no entropy bonus): the same values, the entropy without autograd, and the log-probs'
    gradients those of the whole logits."""
    model, batch = setup
    m = batch.response_mask.float()
    logp, ent = response_logprobs_entropy(model, batch, chunk_tokens=5, entropy_grad=False)
    assert not ent.requires_grad and logp.requires_grad
    (logp * m).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want_logp, want_ent = whole(model, batch)[:2]
    (want_logp * m).sum().backward()
    for n, p in model.named_parameters():
        assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    model.zero_grad(set_to_none=True)
    assert_close(ent, want_ent.detach(), rtol=1e-6, atol=1e-6)


def test_default_chunk_holds_chunk_bytes_of_float32_logits():
    from hybridcore.forward import CHUNK_BYTES, chunk_tokens_for
    assert chunk_tokens_for(128256) == 261 and 261 * 128256 * 4 <= CHUNK_BYTES < 262 * 128256 * 4
    assert chunk_tokens_for(384) * 384 * 4 <= CHUNK_BYTES and chunk_tokens_for(10 ** 9) == 1
