"""Corpus of bad model folders: a micro model saved once, copied and broken per case, then handed to the
real pre-flight path as model.path. Each ends as one InputError line naming the field and the folder or
file, what was found and what was expected, and costs no artifact already built."""
from __future__ import annotations

import json
import random
import string

import pytest
import torch
from safetensors.torch import load_file

from hybridcore.artifacts import read_verified
from hybridcore.errors import InputError
from hybridcore.models import EOS, check_model_folder, load_causal_lm, train_tokenizer
from tests.inputs.helpers import check, copy_model, refuse, write_jsonl


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _to_pickle(folder):
    """Replace model.safetensors with the same weights in pytorch_model.bin, written by torch.save."""
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def _remote_code(folder):
    _edit_config(folder, model_type="my-llama", auto_map={"AutoModelForCausalLM": "modeling_my.MyLlama"})
    (folder / "modeling_my.py").write_text("raise SystemExit('this code must never run')\n")


def _big_tokenizer(folder):
    """A tokenizer with more tokens than the micro model's embedding rows, saved over the folder's own."""
    rng = random.Random(0)
    texts = ["".join(rng.choice(string.ascii_lowercase) for _ in range(8)) for _ in range(3000)]
    train_tokenizer(texts, 1024).save_pretrained(folder)


def _no_eos_tokenizer(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _index_with_missing_shard(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                  "lm_head.weight": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _unlink(*names):
    return lambda folder: [(folder / n).unlink() for n in names]


# breaks a copy of the micro folder -> texts the message must hold besides "model.path"
CASES = {
    "missing config.json": (_unlink("config.json"), ["has no config.json", "expected an HF model folder"]),
    "config.json that is not JSON": (lambda f: (f / "config.json").write_text("model_type: llama\n"),
                                     ["config.json is not valid JSON", "expected a JSON object"]),
    "config.json holding a list": (lambda f: (f / "config.json").write_text("[1, 2]"),
                                   ["holds a JSON list, expected an object"]),
    "config.json without model_type": (lambda f: (f / "config.json").write_text('{"vocab_size": 288}'),
                                       ["has no model_type", "found keys: vocab_size"]),
    "an unknown model_type": (lambda f: _edit_config(f, model_type="not-a-model"),
                              ["model_type 'not-a-model'", "does not know"]),
    "code that would have to run (trust_remote_code off)": (
        _remote_code, ["needs its own Python code", "auto_map", "set model.trust_remote_code: true"]),
    "missing weights": (_unlink("model.safetensors"), ["has no *.safetensors weights"]),
    "pickle-only weights": (_to_pickle, ["only pickled weights (pytorch_model.bin)", "could run code",
                                         "model.allow_pickle: true"]),
    "truncated safetensors": (lambda f: (f / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{"),
                              ["model.safetensors is not a readable safetensors file"]),
    "an index naming a missing shard": (_index_with_missing_shard,
                                        ["lacks shard(s) model-00002-of-00002.safetensors", "index.json"]),
    "tokenizer larger than the embedding": (
        _big_tokenizer, ["the tokenizer in", "has 1024 tokens", "vocab_size 384", "no larger than its embedding"]),
    "no tokenizer files": (_unlink("tokenizer.json", "tokenizer_config.json"),
                           ["has no tokenizer files", "or model.tokenizer"]),
    "a tokenizer.json that is not a tokenizer": (lambda f: (f / "tokenizer.json").write_text('{"version": 1}'),
                                                 ["could not load a tokenizer", "expected a transformers tokenizer"]),
    "a tokenizer without eos": (_no_eos_tokenizer, ["has no eos token"]),
    "a context too short for max_new_tokens": (lambda f: _edit_config(f, max_position_embeddings=4),
                                               ["ppo.max_new_tokens (4) leaves no room for a prompt",
                                                "4 positions", "config.json"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_model_folders_are_refused(case, built, micro_model, tmp_path):
    """A broken model folder is one InputError line naming model.path; the artifact survives."""
    brk, expected = CASES[case]
    folder = copy_model(micro_model, tmp_path / "model")
    brk(folder)
    field = "model.path"
    refuse(built, check(built, {"model": {"path": str(folder)}}), field, str(folder), *expected)


def test_missing_model_folder(built, tmp_path):
    """A model.path that does not exist is refused, naming it."""
    refuse(built, check(built, {"model": {"path": str(tmp_path / "nowhere")}}), "model.path", "not found")


def test_missing_tokenizer_folder(built, micro_model, tmp_path):
    """A model.tokenizer folder that does not exist is refused, naming model.tokenizer."""
    refuse(built, check(built, {"model": {"path": str(micro_model), "tokenizer": str(tmp_path / "tok")}}),
           "model.tokenizer: folder", "not found")


def test_row_too_long_for_a_known_tokenizer(built, micro_model, tmp_path):
    """With a model folder the tokenizer is known up front: a row over sft.max_seq_len is refused before SFT,
    naming the row and both numbers."""
    rows = [{"prompt": f"mia has {i % 10} pears. total:", "response": " 3"} for i in range(30)]
    rows[2]["prompt"] = "mia has " + "pears and apples " * 40 + "total:"
    f = write_jsonl(tmp_path / "s.jsonl", rows)
    refuse(built, check(built, {"model": {"path": str(micro_model)}, "data": {"sft": {"path": str(f)}},
                                "sft": {"max_seq_len": 64}}),
           "data.sft.path", "row 3 (line 3):", "over sft.max_seq_len=64")
    rows[2]["prompt"] = "mia has " + "pears and apples " * 90 + "total:"
    f = write_jsonl(tmp_path / "s.jsonl", rows)
    refuse(built, check(built, {"model": {"path": str(micro_model)}, "data": {"sft": {"path": str(f)}}}),
           "data.sft.path", "row 3 (line 3):", "over the model's 256 positions")


def test_an_explicit_max_seq_len_past_the_context(built, micro_model, tmp_path):
    folder = copy_model(micro_model, tmp_path / "model")
    _edit_config(folder, max_position_embeddings=32)
    refuse(built, check(built, {"model": {"path": str(folder)}, "sft": {"max_seq_len": 64}}),
           "sft.max_seq_len (64) is longer than the model's context", "32 positions", "config.json")


def test_prompt_plus_new_tokens_past_the_context(built, micro_model, tmp_path):
    """A prompt that fits alone but not with ppo.max_new_tokens after it is refused before any stage."""
    rows = [{"prompt": f"ana has {i % 10} keys. total:"} for i in range(40)]
    rows[0]["prompt"] = "ana has " + "keys and coins " * 25 + "total:"
    f = write_jsonl(tmp_path / "q.jsonl", rows)
    refuse(built, check(built, {"model": {"path": str(micro_model)}, "data": {"prompts": {"path": str(f)}},
                                "ppo": {"max_new_tokens": 200}}),
           "data.prompts.path", "row 1 (line 1):", "with ppo.max_new_tokens=200", "256 positions")


# --- what the same checks let through -------------------------------------------------------------


def test_intact_model_folder_passes(built, micro_model):
    """The unbroken micro folder passes every pre-flight check."""
    check(built, {"model": {"path": str(micro_model)}})()
    assert read_verified(built.artifact) == built.manifest


def test_pickled_weights_load_only_when_allowed(built, micro_model, tmp_path):
    """model.allow_pickle: true lets a pickle-only folder through pre-flight and loads the same weights;
    without it the loader refuses the folder too."""
    folder = copy_model(micro_model, tmp_path / "model")
    _to_pickle(folder)
    check(built, {"model": {"path": str(folder), "allow_pickle": True}})()
    with pytest.raises(InputError, match="allow_pickle"):
        load_causal_lm(str(folder))
    model = load_causal_lm(str(folder), allow_pickle=True)
    reference = load_causal_lm(str(micro_model))
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


def test_remote_code_folder_passes_the_check_only_when_trusted(micro_model, tmp_path):
    """check_model_folder accepts a folder that needs its own code once trust_remote_code is on."""
    folder = copy_model(micro_model, tmp_path / "model")
    _remote_code(folder)
    assert check_model_folder(str(folder), trust_remote_code=True) == folder


def test_micro_folder_tokenizer_names_eos(micro_model):
    """The unbroken micro folder's tokenizer names an eos token, so the no-eos case breaks exactly that."""
    assert json.loads((micro_model / "tokenizer_config.json").read_text())["eos_token"] == EOS
