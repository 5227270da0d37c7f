"""Model loading: tiny presets built from a config, or a local HF folder loaded without unpickling.

Every model handed between stages is an HF-format folder (safetensors + config + tokenizer), so that
`from_pretrained` and vLLM load it as it is.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
from pathlib import Path
from typing import Iterable, Optional

import torch
import transformers
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
    """A byte-level BPE trained on the run's own texts; digits stay single tokens so numbers are legible. It
    carries the built-in chatml template and its two tokens, so conversational rows run on a preset."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    from hybridcore.chat import BUILTIN, CHATML_TOKENS
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS, *CHATML_TOKENS],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left",
                                  extra_special_tokens=list(CHATML_TOKENS))
    out.chat_template = BUILTIN["chatml"]  # conversational data runs on the preset too (hybridcore/chat.py)
    return out


def build_preset(name: str, tokenizer, seed: int) -> LlamaForCausalLM:
    """A randomly initialised Llama of a built-in shape; vocab rounded up to a multiple of 32."""
    shape = {k: v for k, v in PRESETS[name].items() if k != "tokenizer_vocab"}
    vocab = -(-len(tokenizer) // 32) * 32
    config = LlamaConfig(vocab_size=vocab, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None, tie_word_embeddings=False, **shape)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def read_config(path: str | Path, field: str = "model.path") -> dict:
    """config.json of a model folder as a dict; not JSON, or not an object, is an InputError."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise InputError(f"{field}: {path} has no config.json (expected an HF model folder)")
    try:
        config = json.loads(f.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InputError(f"{field}: {f} is not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                         f"expected a JSON object") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{field}: {f} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                         f"expected a JSON object") from None
    if not isinstance(config, dict):
        raise InputError(f"{field}: {f} holds a JSON {type(config).__name__}, expected an object")
    return config


def _weights(p: Path, field: str, allow_pickle: bool) -> list[Path]:
    """The folder's weight files: safetensors (headers checked, shards of an index present), or pickles
    when explicitly allowed."""
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            if not all(isinstance(s, str) for s in shards):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise InputError(f"{field}: {index} is not a valid safetensors index (expected JSON with a "
                             f"'weight_map' object)") from None
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise InputError(f"{field}: {p} lacks shard(s) {', '.join(missing[:3])} listed in {index.name} "
                             f"(expected every shard of the index)")
    files = sorted(p.glob("*.safetensors"))
    if files:
        from safetensors import safe_open
        for f in files:
            try:
                with safe_open(str(f), framework="pt"):
                    pass
            except Exception as e:  # SafetensorError derives from Exception only
                raise InputError(f"{field}: {f} is not a readable safetensors file ({str(e)[:200]}); "
                                 f"expected weights saved with safetensors") from None
        return files
    pickles = sorted(q for q in p.iterdir() if q.suffix in PICKLE_SUFFIXES and q.is_file())
    if pickles and allow_pickle:
        return pickles
    if pickles:
        raise InputError(f"{field}: {p} has only pickled weights ({', '.join(q.name for q in pickles)}); loading "
                         f"them could run code: convert them to safetensors (or set model.allow_pickle: true "
                         f"if you trust the folder)")
    raise InputError(f"{field}: {p} has no *.safetensors weights (expected model.safetensors or shards with "
                     f"model.safetensors.index.json)")


def check_model_folder(path: str, field: str = "model.path", allow_pickle: bool = False,
                       trust_remote_code: bool = False) -> Path:
    """A model folder a user hands in: a JSON config.json and safetensors weights whose headers read;
    pickles are refused unless `allow_pickle`, and a model that needs the folder's own Python code unless
    `trust_remote_code` (a model_type transformers knows loads with transformers' code, auto_map or not).
    Reads headers only, never the weights."""
    p = Path(path)
    if not p.is_dir():
        raise InputError(f"{field}: folder {path} not found (expected a local HF model folder)")
    config = read_config(p, field)
    _weights(p, field, allow_pickle)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise InputError(f"{field}: {p / 'config.json'} has no model_type (found keys: "
                         f"{', '.join(sorted(map(str, config))[:8]) or 'none'}); expected an HF model config")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    if model_type not in CONFIG_MAPPING_NAMES and not trust_remote_code:
        if config.get("auto_map"):
            raise InputError(f"{field}: {p} needs its own Python code (model_type '{model_type}', auto_map in "
                             f"config.json), which is refused by default; set model.trust_remote_code: true "
                             f"only if you trust the folder")
        raise InputError(f"{field}: {p / 'config.json'} has model_type '{model_type}', which transformers "
                         f"{transformers.__version__} does not know (expected a supported architecture)")
    return p


POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def config_limits(config: dict) -> tuple[Optional[int], Optional[int]]:
    """(vocab_size, max positions) of a config.json dict; a multimodal config's text_config when it has one."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab = text.get("vocab_size")
    positions = next((text[k] for k in POSITION_KEYS if isinstance(text.get(k), int)), None)
    return (vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None), positions


def has_tokenizer_files(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def weight_files(path: str, allow_pickle: bool = False) -> list[Path]:
    """The weight files check_model_folder accepted (for size estimates)."""
    return _weights(Path(path), "model.path", allow_pickle)


def param_count_of_folder(path: str, allow_pickle: bool = False) -> int:
    """Number of parameters from the safetensors headers (no weights read); pickles: bytes / 2 as a guess."""
    from safetensors import safe_open
    files = weight_files(path, allow_pickle)
    if files[0].suffix != ".safetensors":
        return sum(f.stat().st_size for f in files) // 2
    n = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                n += math.prod(st.get_slice(k).get_shape())
    return n


def preset_param_count(name: str) -> int:
    """Parameters of a built-in preset (vocab at its tokenizer size, rounded as build_preset does)."""
    s = PRESETS[name]
    h, i, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    kv = h * s["num_key_value_heads"] // s["num_attention_heads"]
    vocab = -(-s["tokenizer_vocab"] // 32) * 32
    return 2 * vocab * h + h + layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)


@contextlib.contextmanager
def _quiet_transformers():
    """from_pretrained's 'newly initialized' notice is expected when a score head is added."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def resolve_device(name: str = "auto") -> torch.device:
    """engine.device: "auto" is the current GPU when torch sees one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("engine.device: cuda, but torch sees no GPU here (expected auto or cpu on this machine)")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


def _kwargs(precision: str, attention: str, trust_remote_code: bool, path: str, quantization: str = "none",
            quant_field: str = "quantization", model_cls=None, device: str = "cpu") -> dict:
    # use_safetensors=True makes from_pretrained refuse pickles itself; False only when check_model_folder
    # accepted pickles (allow_pickle) because the folder has no safetensors.
    kwargs = dict(dtype=DTYPES[precision], attn_implementation=attention, trust_remote_code=trust_remote_code,
                  use_safetensors=any(Path(path).glob("*.safetensors")))
    if str(device) != "cpu":  # weights load straight onto the GPU (quantised ones are packed on the way)
        kwargs["device_map"] = {"": str(device)}
    if quantization != "none":
        from hybridcore.quant import bnb_config, check_4bit_config
        kwargs["quantization_config"] = bnb_config(quantization, DTYPES[precision], quant_field)
        if quantization == "4bit" and not torch.cuda.is_available():
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, num_labels=1)
            check_4bit_config(config, model_cls, quant_field, trust_remote_code)
    return kwargs


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


def load_causal_lm(path: str, precision: str = "fp32", attention: str = "sdpa", trust_remote_code: bool = False,
                   field: str = "model.path", allow_pickle: bool = False, quantization: str = "none",
                   quant_field: str = "quantization", device: str = "cpu"):
    """quantization: none | 8bit | 4bit (bitsandbytes; see hybridcore/quant.py), errors named by quant_field."""
    check_model_folder(path, field, allow_pickle, trust_remote_code)
    kwargs = _kwargs(precision, attention, trust_remote_code, path, quantization, quant_field, AutoModelForCausalLM,
                     device)
    try:
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        raise InputError(f"{field}: could not load {path} as a causal LM ({_first_line(e)})") from None
    return _after_load(model, quantization)


def _after_load(model, quantization: str):
    """A loaded model's last touches: its RMSNorms through hybridcore/rmsnorm.py's kernels (on a GPU); a 4-bit
    model's one weight layout (quant.py)."""
    from hybridcore import rmsnorm
    rmsnorm.install(model)
    if quantization == "4bit":
        from hybridcore.quant import keep_one_4bit_layout
        keep_one_4bit_layout(model)
    return model


@functools.cache
def _with_forward(cls: type, forward) -> type:
    return type(cls.__name__, (cls,), {"forward": forward, "own_class": cls, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def set_forward(module: torch.nn.Module, forward, on: bool = True) -> bool:
    """Give `module` our `forward` through a subclass of its class (isinstance checks, state dicts, hooks and peft
    see the same module), or (on=False) its own class's forward again; whether anything changed."""
    own = type(module).__dict__.get("own_class", type(module))
    target = _with_forward(own, forward) if on else own
    if type(module) is target:
        return False
    module.__class__ = target
    return True


def load_sequence_scorer(path: str, precision: str = "fp32", attention: str = "sdpa",
                         trust_remote_code: bool = False, pad_token_id: Optional[int] = None,
                         field: str = "model.path", allow_pickle: bool = False, quantization: str = "none",
                         quant_field: str = "quantization", device: str = "cpu"):
    """An AutoModelForSequenceClassification with one label: a reward model, or a critic's starting point
    (its `score` head, applied per token, gives values)."""
    check_model_folder(path, field, allow_pickle, trust_remote_code)
    kwargs = _kwargs(precision, attention, trust_remote_code, path, quantization, quant_field,
                     AutoModelForSequenceClassification, device)
    try:
        with _quiet_transformers():
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kwargs)
    except (OSError, ValueError) as e:
        raise InputError(f"{field}: could not load {path} as a sequence scorer ({_first_line(e)})") from None
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return _after_load(model, quantization)


def load_tokenizer(path: str, trust_remote_code: bool = False, field: str = "model.tokenizer"):
    p = Path(path)
    if not p.is_dir():
        raise InputError(f"{field}: folder {path} not found (expected a tokenizer folder)")
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # the tokenizers library raises plain Exceptions for a malformed tokenizer.json
        raise InputError(f"{field}: could not load a tokenizer from {path} ({type(e).__name__}: {_first_line(e)}); "
                         f"expected a transformers tokenizer folder (tokenizer.json, tokenizer_config.json)") from None
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


@contextlib.contextmanager
def resident(model, device, home=None):
    """`model`'s weights on `device` inside the block and back on `home` after it. A frozen role used once per PPO
    step (the reward model scoring a rollout) then holds no GPU memory through the rollout and the updates, at
    the price of one host -> device copy (4-bit weights move as they are). A frozen model moves through
    HostWeights (pinned once, nothing copied back); a model with trained parameters with .to() both ways.
    home=None: no move."""
    if home is None or torch.device(home) == torch.device(device):
        yield model
        return
    host = HostWeights.of(model)
    if host is None:
        model.to(device)
        try:
            yield model
        finally:
            model.to(home)
        return
    host.to(device)
    try:
        yield model
    finally:
        host.back()


class HostWeights:
    """A frozen model's weights kept in host memory, pinned once (on a CUDA machine), and lent to a device: each
    tensor is copied into a fresh device tensor asynchronously (pinned memory lets the copy run without a staging
    buffer), and on the way back the parameters simply point at their host tensors again, since nothing changed
    them. bitsandbytes 4-bit weights move their quantisation state along. None for a model that trains any
    parameter or holds 8-bit weights (their state lives on the module): those move with .to()."""

    def __init__(self, model):
        every = (t for m in model.modules() for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
        self.tensors = list({id(t): t for t in every}.values())  # a tied weight once
        pin = torch.cuda.is_available()
        self.host = []
        for t in self.tensors:
            if pin and not t.data.is_pinned():
                t.data = t.data.pin_memory()
            self.host.append(t.data)
        self.states = [t.quant_state for t in self.tensors if getattr(t, "quant_state", None) is not None]

    @classmethod
    def of(cls, model) -> "HostWeights | None":
        if any(p.requires_grad for p in model.parameters()) or any(
                type(p).__name__ == "Int8Params" for p in model.parameters()):
            return None
        if getattr(model, "_host_weights", None) is None:
            model._host_weights = cls(model)
        return model._host_weights

    def to(self, device) -> None:
        for t, host in zip(self.tensors, self.host):
            t.data = torch.empty_like(host, device=device).copy_(host, non_blocking=True)
        for state in self.states:
            state.to(device)

    def back(self) -> None:
        for t, host in zip(self.tensors, self.host):
            t.data = host
        for state in self.states:
            state.to(self.host[0].device)


def park(model, home: torch.device):
    """Move a frozen model to `home`, where it waits between its uses (an offloaded role), and in host memory pin
    its weights now (HostWeights.of): each later lend to the device copies asynchronously, and pinning gigabytes
    (7.8 GiB for the 14B reward model) is not paid inside the first use."""
    model.to(home)
    if torch.device(home).type == "cpu":
        HostWeights.of(model)
    return model


def save_model(model, tokenizer, out_dir: Path, state_dict: dict | None = None) -> None:
    """HF format with safetensors weights, loadable by from_pretrained and vLLM; `state_dict` (whole weights
    gathered from a sharded layout) in place of the model's own."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True,
                          state_dict=None if state_dict is None else dict(state_dict))  # save_pretrained empties it
    tokenizer.save_pretrained(out_dir)


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def config_of(path: str):
    return AutoConfig.from_pretrained(path)
