"""HostWeights: a frozen role's weights lent to a device and back without copying them back (CPU -> CPU here, so
these pin down the bookkeeping; the pinned host -> GPU speed is bench/memory.py's --rm cpu rows)."""
import tempfile
from pathlib import Path

import torch

from hybridcore.models import HostWeights, build_preset, load_causal_lm, resident, save_model, train_tokenizer

TEXTS = [f"box {i} holds {i % 7} keys" for i in range(40)]


def frozen(model):
    return model.requires_grad_(False).eval()


def ptrs(model):
    return [t.data_ptr() for t in (*model.parameters(), *model.buffers())]


def test_lent_and_returned_without_a_copy_back():
    tok = train_tokenizer(TEXTS, 384)
    model = frozen(build_preset("micro", tok, seed=0).float())
    ids = torch.tensor([tok("box 3 holds")["input_ids"]])
    want = model(ids).logits
    home = ptrs(model)
    host = HostWeights.of(model)
    assert HostWeights.of(model) is host  # made once per model
    for _ in range(2):
        host.to("cpu")
        lent = ptrs(model)
        assert all(a != b for a, b in zip(lent, home))  # fresh tensors on the device side
        assert torch.equal(model(ids).logits, want)
        host.back()
        assert ptrs(model) == home  # the very host tensors again: nothing was copied back or re-allocated
    # tied embeddings stay tied (one tensor moved once)
    tied = frozen(build_preset("micro", tok, seed=0).float())
    tied.lm_head.weight = tied.model.embed_tokens.weight
    HostWeights.of(tied).to("cpu")
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()


def test_a_model_with_trained_parameters_moves_with_to():
    tok = train_tokenizer(TEXTS, 384)
    model = build_preset("micro", tok, seed=0)
    assert HostWeights.of(model) is None
    with resident(model, "cpu", "cpu"):  # same device: nothing happens
        pass


def test_a_4bit_model_keeps_its_quantisation_state_through_the_move():
    tok = train_tokenizer(TEXTS, 384)
    with tempfile.TemporaryDirectory() as d:
        save_model(build_preset("micro", tok, seed=0), tok, Path(d))
        model = frozen(load_causal_lm(d, quantization="4bit"))
    ids = torch.tensor([tok("box 5 holds")["input_ids"]])
    with torch.no_grad():
        want = model(ids).logits
        host = HostWeights.of(model)
        assert host.states  # the Params4bit quant states travel too
        host.to("cpu")
        assert torch.equal(model(ids).logits, want)
        host.back()
        assert torch.equal(model(ids).logits, want)


def test_park_on_the_host_keeps_its_host_weights_ready():
    """park: moved to its home and, in host memory, its HostWeights made there and then (the pinning, on a CUDA
    machine), so the first lend copies at once; a model that trains keeps none (it moves with .to())."""
    tok = train_tokenizer(TEXTS, 384)
    model = frozen(build_preset("micro", tok, seed=0).float())
    from hybridcore.models import park
    assert park(model, torch.device("cpu")) is model
    assert model._host_weights is HostWeights.of(model) and model._host_weights is not None
    trained = build_preset("micro", tok, seed=0).float()
    park(trained, torch.device("cpu"))
    assert getattr(trained, "_host_weights", None) is None
