"""Model loading: tiny presets built from a config, or a local HF folder loaded without unpickling.

Every model handed between stages is an HF-format folder (safetensors + config + tokenizer), so that
`from_pretrained` and vLLM load it as it is.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable, Optional

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast)
from transformers.utils import logging as hf_logging

from hybridcore.errors import InputError

# head_dim 32 and Linear sizes that are multiples of 32: what vLLM and bitsandbytes' 4-bit kernels need.
PRESETS = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=256, tokenizer_vocab=512),
    "micro": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=256, tokenizer_vocab=384),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PAD, EOS = "<|pad|>", "<|eos|>"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the run's own texts; digits stay single tokens so numbers are legible."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left")


def build_preset(name: str, tokenizer, seed: int) -> LlamaForCausalLM:
    """A randomly initialised Llama of a built-in shape; vocab rounded up to a multiple of 32."""
    shape = {k: v for k, v in PRESETS[name].items() if k != "tokenizer_vocab"}
    vocab = -(-len(tokenizer) // 32) * 32
    config = LlamaConfig(vocab_size=vocab, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None, tie_word_embeddings=False, **shape)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def check_model_folder(path: str, field: str = "model.path") -> Path:
    """A model folder a user hands in: config.json and safetensors weights; pickles are refused."""
    p = Path(path)
    if not p.is_dir():
        raise InputError(f"{field}: folder {path} not found (expected a local HF model folder)")
    if not (p / "config.json").is_file():
        raise InputError(f"{field}: {path} has no config.json (expected an HF model folder)")
    if not any(p.glob("*.safetensors")):
        pickles = sorted(q.name for q in p.iterdir() if q.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise InputError(f"{field}: {path} has only pickled weights ({', '.join(pickles)}); loading them "
                             f"could run code: convert them to safetensors")
        raise InputError(f"{field}: {path} has no *.safetensors weights")
    return p


@contextlib.contextmanager
def _quiet_transformers():
    """from_pretrained's 'newly initialized' notice is expected when a score head is added."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _kwargs(precision: str, attention: str, trust_remote_code: bool) -> dict:
    return dict(dtype=DTYPES[precision], attn_implementation=attention, trust_remote_code=trust_remote_code,
                use_safetensors=True)


def load_causal_lm(path: str, precision: str = "fp32", attention: str = "sdpa", trust_remote_code: bool = False,
                   field: str = "model.path"):
    check_model_folder(path, field)
    try:
        with _quiet_transformers():
            return AutoModelForCausalLM.from_pretrained(path, **_kwargs(precision, attention, trust_remote_code))
    except (OSError, ValueError) as e:
        raise InputError(f"{field}: could not load {path} as a causal LM ({str(e).splitlines()[0][:300]})") from None


def load_sequence_scorer(path: str, precision: str = "fp32", attention: str = "sdpa",
                         trust_remote_code: bool = False, pad_token_id: Optional[int] = None,
                         field: str = "model.path"):
    """An AutoModelForSequenceClassification with one label: a reward model, or a critic's starting point
    (its `score` head, applied per token, gives values)."""
    check_model_folder(path, field)
    try:
        with _quiet_transformers():
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, **_kwargs(precision, attention, trust_remote_code))
    except (OSError, ValueError) as e:
        raise InputError(f"{field}: could not load {path} as a sequence scorer ({str(e).splitlines()[0][:300]})") from None
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model


def load_tokenizer(path: str, trust_remote_code: bool = False, field: str = "model.tokenizer"):
    p = Path(path)
    if not p.is_dir():
        raise InputError(f"{field}: folder {path} not found (expected a tokenizer folder)")
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise InputError(f"{field}: could not load a tokenizer from {path} ({str(e).splitlines()[0][:300]})") from None
    if tok.eos_token_id is None:
        raise InputError(f"{field}: the tokenizer in {path} has no eos token (responses could never end)")
    if tok.pad_token_id is None:  # many base tokenizers have none; our batches carry explicit masks
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def check_vocab(model, tokenizer, where: str) -> None:
    emb = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > emb:
        raise InputError(f"{where}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has {emb} "
                         f"rows (expected the tokenizer to match the model)")


def set_activation_checkpointing(model, on: bool) -> None:
    """transformers renamed gradient_checkpointing_* to activation_checkpointing_* in 5.24; accept both."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    if on:
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        disable()


def save_model(model, tokenizer, out_dir: Path) -> None:
    """HF format with safetensors weights, loadable by from_pretrained and vLLM."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def config_of(path: str):
    return AutoConfig.from_pretrained(path)
