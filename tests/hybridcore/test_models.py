"""Unit tests for hybridcore.models: presets, tokenizer, safetensors-only loading and vocab checks."""
import copy
import json
import pickle
import random

import pytest
import torch
from torch.testing import assert_close
from transformers import PreTrainedTokenizerFast

from hybridcore.errors import InputError
from hybridcore.models import (EOS, PRESETS, build_preset, check_model_folder, check_vocab, load_causal_lm,
                               load_sequence_scorer, load_tokenizer, param_count, save_model, train_tokenizer)

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
def saved(tok, model, tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "model"
    save_model(model, tok, path)
    return path


def sample_batch(tok):
    texts = make_texts(3, seed=9)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    n = min(map(len, ids))
    return torch.tensor([x[:n] for x in ids])


# ------------------------------------------------------------------------------------------------ folders


def test_check_model_folder_missing(tmp_path):
    """A folder that does not exist is refused with the field name and 'not found'."""
    with pytest.raises(InputError, match=r"^sft\.model: folder .* not found"):
        check_model_folder(str(tmp_path / "nope"), field="sft.model")


def test_check_model_folder_without_config(tmp_path):
    """A folder without config.json is refused, naming config.json."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(InputError, match=r"config\.json"):
        check_model_folder(str(tmp_path))


def test_check_model_folder_pickle_only(tmp_path):
    """A folder with only pytorch_model.bin (a pickle) is refused, mentioning pickle and safetensors."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps({"w": [1, 2, 3]}))
    with pytest.raises(InputError) as e:
        check_model_folder(str(tmp_path))
    msg = str(e.value)
    assert "pickle" in msg and "safetensors" in msg and "pytorch_model.bin" in msg
    with pytest.raises(InputError, match="pickle"):  # loaders refuse it before from_pretrained could unpickle
        load_causal_lm(str(tmp_path))
    with pytest.raises(InputError, match="pickle"):
        load_sequence_scorer(str(tmp_path))


def test_check_model_folder_no_weights(tmp_path):
    """A folder with config.json but no weight files at all is refused, naming safetensors."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InputError, match=r"safetensors"):
        check_model_folder(str(tmp_path))


def test_check_model_folder_accepts_saved_model(saved):
    """A folder written by save_model passes check_model_folder and holds safetensors, no pickles."""
    assert check_model_folder(str(saved)) == saved
    names = {p.name for p in saved.iterdir()}
    assert "config.json" in names and any(n.endswith(".safetensors") for n in names)
    assert not any(n.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt")) for n in names)


# ------------------------------------------------------------------------------------------------ round trips


@torch.no_grad()
def test_load_causal_lm_same_logits(tok, model, saved):
    """load_causal_lm on a saved folder reproduces the original model's logits."""
    loaded = load_causal_lm(str(saved)).eval()
    assert loaded.dtype == torch.float32 and param_count(loaded) == param_count(model)
    ids = sample_batch(tok)
    assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6, rtol=0)


@torch.no_grad()
def test_load_sequence_scorer_shares_the_trunk(tok, model, saved):
    """load_sequence_scorer keeps the saved trunk, adds a 1-output score head and sets pad_token_id."""
    scorer = load_sequence_scorer(str(saved), pad_token_id=tok.pad_token_id).eval()
    assert scorer.config.num_labels == 1 and scorer.config.pad_token_id == tok.pad_token_id
    assert scorer.score.out_features == 1
    ids = sample_batch(tok)
    assert_close(scorer.base_model(input_ids=ids).last_hidden_state,
                 model.model(input_ids=ids).last_hidden_state, atol=1e-6, rtol=0)


def test_load_tokenizer_round_trip(tok, saved):
    """load_tokenizer on a saved folder encodes the same ids, keeps pad/eos and pads on the left."""
    loaded = load_tokenizer(str(saved))
    for text in make_texts(20, seed=4) + ["zoe has 12 figs. total: 99", "unseen words: quokka!"]:
        assert loaded(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert loaded.pad_token_id == tok.pad_token_id and loaded.eos_token_id == tok.eos_token_id
    assert len(loaded) == len(tok) and loaded.padding_side == "left"


def test_load_tokenizer_without_pad_uses_eos(tok, tmp_path):
    """A tokenizer saved without a pad token gets pad = eos on load."""
    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token=EOS)
    assert bare.pad_token_id is None
    bare.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token_id == loaded.eos_token_id == tok.eos_token_id


def test_load_tokenizer_missing_folder(tmp_path):
    """load_tokenizer on a missing folder raises InputError naming the field."""
    with pytest.raises(InputError, match=r"^model\.tokenizer: folder .* not found"):
        load_tokenizer(str(tmp_path / "nope"))


# ------------------------------------------------------------------------------------------------ tokenizer


def test_trained_tokenizer_special_tokens(tok):
    """The trained tokenizer has distinct pad and eos, pads on the left and keeps digits as single tokens."""
    assert tok.pad_token_id is not None and tok.eos_token_id is not None
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.padding_side == "left"
    assert len(tok) <= 384
    ids = tok("total: 1234", add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in ids[-4:]] == ["1", "2", "3", "4"]
    assert tok.decode(tok("mia has 3 pears", add_special_tokens=False)["input_ids"]) == "mia has 3 pears"


# ------------------------------------------------------------------------------------------------ presets


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_build_preset_shapes(tok, name):
    """build_preset: vocab a multiple of 32 covering the tokenizer, head_dim >= 32, Linear sizes multiples of 32."""
    m = build_preset(name, tok, seed=0)
    c = m.config
    assert c.vocab_size % 32 == 0 and len(tok) <= c.vocab_size < len(tok) + 32
    assert m.get_input_embeddings().num_embeddings == c.vocab_size
    assert m.lm_head.out_features == c.vocab_size
    assert c.hidden_size % c.num_attention_heads == 0
    head_dim = c.hidden_size // c.num_attention_heads
    assert head_dim >= 32 and head_dim % 32 == 0
    assert c.intermediate_size % 32 == 0 and c.hidden_size % 32 == 0
    assert c.pad_token_id == tok.pad_token_id and c.eos_token_id == tok.eos_token_id
    assert c.num_hidden_layers == PRESETS[name]["num_hidden_layers"]
    for mod in m.modules():
        if isinstance(mod, torch.nn.Linear):
            assert mod.in_features % 32 == 0 and mod.out_features % 32 == 0


def test_build_preset_seeded(tok):
    """The same seed builds identical weights; another seed builds different ones."""
    a, b, c = (build_preset("micro", tok, seed=s) for s in (0, 0, 1))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])


# ------------------------------------------------------------------------------------------------ vocab


def test_check_vocab(tok, model):
    """check_vocab passes when the tokenizer fits the embedding and raises InputError when it is larger."""
    check_vocab(model, tok, "sft")
    big = copy.deepcopy(tok)
    emb = model.get_input_embeddings().num_embeddings
    big.add_tokens([f"<extra_{i}>" for i in range(emb - len(tok) + 1)])
    assert len(big) == emb + 1
    with pytest.raises(InputError, match=rf"^ppo: the tokenizer has {emb + 1} tokens .* {emb} rows"):
        check_vocab(model, big, "ppo")
    assert len(tok) < emb + 1  # the shared tokenizer was not touched
