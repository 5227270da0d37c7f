"""LoRA adapters via peft: add them with checked targets, switch between them, and export merged weights.

Stages keep working on the plain transformers model (`PeftModel.get_base_model()`): peft injects its LoRA
layers into it in place, so calling it applies the active adapter, and rollout backends, activation
checkpointing and `forward.py` see an ordinary HF model.
"""
from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from hybridcore.errors import InputError
from hybridcore.quant import dequantized_weight


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]


def compute_dtype(model) -> Optional[torch.dtype]:
    """The dtype LoRA's matmuls should run in: the frozen base's (bf16/fp16) when every trained parameter is a
    float32 master weight over such a base (LoRA/QLoRA on a bf16 model); None otherwise (a float32 model, DeepSpeed's
    bf16 parameters, nothing trained)."""
    trained, frozen = set(), set()
    for prm in model.parameters():
        if prm.requires_grad:
            trained.add(prm.dtype)
        elif prm.is_floating_point():  # bitsandbytes' packed 4-bit weights are uint8: not the compute dtype
            frozen.add(prm.dtype)
    if trained != {torch.float32} or len(frozen) != 1:
        return None
    low = frozen.pop()
    return low if low in (torch.bfloat16, torch.float16) else None


def mixed_precision(model):
    """torch.autocast at `compute_dtype(model)` (else nothing), around a model body's forward: what HF Trainer's
    bf16 mode does. Without it peft casts each LoRA layer's input to float32 and autograd keeps that copy for
    backward: at the Llama-3-8B shape ~0.6 GiB per recomputed layer at 4,096 tokens, and the prefill's MLP
    input twice over. The adapters' weights, gradients and AdamW states stay float32; heads run outside.
    Without autograd (rollout prefill, scoring) autocast keeps no cache of the adapters' cast copies: each weight
    is cast once per forward anyway, and the cache held all of them to the context's end (0.08 GiB at 8B, r16)."""
    dtype = compute_dtype(model)
    if dtype is None:
        return contextlib.nullcontext()
    device = next(model.parameters()).device
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=torch.is_grad_enabled())


def linear_names(model) -> list[str]:
    """The leaf names of every Linear (quantised ones included): what `targets` may name."""
    names = set()
    for name, m in model.named_modules():
        parts = name.split(".")
        if not name or not isinstance(m, torch.nn.Linear) or {"lora_A", "lora_B"} & set(parts):
            continue
        names.add(parts[-2] if parts[-1] == "base_layer" else parts[-1])  # a layer peft already wrapped
    return sorted(names)


def check_targets(model, spec: LoraSpec, field: str) -> None:
    names = linear_names(model)
    missing = [t for t in spec.targets if t not in names]
    if missing or not spec.targets:
        raise InputError(f"{field}.lora.targets: {', '.join(map(repr, missing)) or 'an empty list'} "
                         f"{'is' if len(missing) == 1 else 'are'} not a Linear module of this model; "
                         f"expected names from: {', '.join(names)}")


def add_lora(model, spec: LoraSpec, field: str, adapter: str, peft_model=None):
    """Add adapter `adapter` to `model` (a plain HF model) or to an existing `peft_model`; returns the
    PeftModel. The new adapter's B is zero, so the model's outputs do not change. LoRA layers over 4-bit weights
    compute through qlora_linear's one autograd function."""
    from peft import LoraConfig, get_peft_model

    check_targets(model if peft_model is None else peft_model.get_base_model(), spec, field)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0,
                        bias="none")
    if peft_model is None:
        peft_model = get_peft_model(model, config, adapter_name=adapter)
    else:
        peft_model.add_adapter(adapter, config)
    from hybridcore import qlora_linear  # imports this module
    qlora_linear.install(peft_model)
    return peft_model


def linear4bit_layers(model) -> list[torch.nn.Module]:
    """bitsandbytes' own Linear4bit layers (peft's LoRA wrapper around one has the same class name)."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, Linear4bit)]


def lora_wrappers(model) -> list[torch.nn.Module]:
    """peft's LoRA layers around a bitsandbytes Linear4bit."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    bases = set(map(id, linear4bit_layers(model)))
    return [m for m in model.modules() if isinstance(m, LoraLayer) and id(m.get_base_layer()) in bases]


def lora_adapter(wrapper) -> str | None:
    """The one plain LoRA adapter a peft wrapper's forward would add, or None where its forward does more than
    base + (B(A(x))) * scaling: no adapter or several active, merged or disabled adapters, DoRA or another variant."""
    active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if len(active) != 1 or wrapper.merged or wrapper.disable_adapters or active[0] in getattr(wrapper, "lora_variant",
                                                                                               {}):
        return None
    return active[0]


def adapter_parameters(model, adapter: str) -> dict[str, torch.nn.Parameter]:
    """The named LoRA parameters of one adapter in a model with peft layers injected."""
    return {n: p for n, p in model.named_parameters()
            if f".lora_A.{adapter}." in n or f".lora_B.{adapter}." in n}


def _tuner_layers(model):
    from peft.tuners.tuners_utils import BaseTunerLayer
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def activate(model, adapter: Optional[str], layers=None) -> None:
    """Set the adapter that runs from now on (None: all off); requires_grad is left as it is."""
    for m in _tuner_layers(model) if layers is None else layers:
        if adapter is None:
            m._disable_adapters = True
        else:
            m._active_adapter, m._disable_adapters = [adapter], False


@contextlib.contextmanager
def use_adapter(model, adapter: Optional[str]):
    """Make `adapter` the active one inside the block (None: every adapter off, i.e. the frozen base).

    peft's own set_adapter also flips requires_grad (it freezes inactive adapters), which would hide an
    adapter's gradients from its optimizer's clipping between switches; this only changes which adapter runs.
    """
    layers = _tuner_layers(model)
    saved = [(m._active_adapter, m._disable_adapters) for m in layers]
    activate(model, adapter, layers)
    try:
        yield model
    finally:
        for m, (active, disabled) in zip(layers, saved):
            m._active_adapter, m._disable_adapters = active, disabled


def merged_weights(model, adapters: Callable[[object], list[str]], buffers: bool = False, tied_once: bool = False
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every weight of the un-adapted architecture, one module at a time: a LoRA
    layer yields its base weight plus the deltas of `adapters(layer)`, a 4/8-bit layer its dequantised weight
    (only those are new tensors; plain parameters come as they are). buffers: persistent buffers too;
    tied_once: a parameter shared by two modules (tied embeddings) under its first name only."""
    from peft.tuners.lora import LoraLayer

    seen: set[int] = set()
    lora_prefixes: list[str] = []
    for name, m in model.named_modules():
        if any(name.startswith(p) for p in lora_prefixes):
            continue  # a LoRA layer's own children (base_layer, lora_A/B) are handled with it
        prefix = f"{name}." if name else ""
        if isinstance(m, LoraLayer):
            lora_prefixes.append(prefix)
            base = m.get_base_layer()
            w = dequantized_weight(base)
            deltas = [m.get_delta_weight(a) for a in adapters(m)]
            if deltas:
                w = w.float() + sum(d.float() for d in deltas)
            yield prefix + "weight", w
            if getattr(base, "bias", None) is not None:
                yield prefix + "bias", base.bias.detach()
            continue
        for k, p in m.named_parameters(recurse=False):
            if tied_once and id(p) in seen:
                continue
            seen.add(id(p))
            quantized = k == "weight" and type(p).__name__ in ("Params4bit", "Int8Params")
            yield prefix + k, (dequantized_weight(m) if quantized else p.detach())
        if buffers:
            for k, v in m.named_buffers(recurse=False):
                if k not in m._non_persistent_buffers_set:
                    yield prefix + k, v.detach()


def merged_state_dict(model, adapter: Optional[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Plain weights of `model` with `adapter` merged in (None: the base alone), quantised layers
    dequantised, every floating tensor in `dtype`: the state dict of the un-adapted architecture."""
    weights = merged_weights(model, lambda m: [adapter] if adapter is not None and adapter in m.lora_A else [],
                             buffers=True)
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu() for k, v in weights}


def save_merged(model, tokenizer, out_dir: Path, adapter: Optional[str], dtype: torch.dtype) -> None:
    """An HF folder of `model` with `adapter` merged and quantisation not baked in: what `from_pretrained`
    loads as a plain model (the artifact contract)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    sd = merged_state_dict(model, adapter, dtype)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out_emb is not None and out_emb.weight is model.get_input_embeddings().weight:
        # tied: stored once, under the input embedding, as save_pretrained does; from_pretrained re-ties it
        for name, m in model.named_modules():
            if m is out_emb:
                sd.pop(f"{name}.weight", None)
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def save_adapters(peft_model, out_dir: Path, extra: Optional[dict[str, torch.nn.Module]] = None) -> None:
    """peft's adapter folder(s) under `out_dir`, plus extra trained modules (a value head) as safetensors."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    # LoRA targets only Linear layers (check_targets), so embeddings never change; "auto" would look the base
    # model up on the Hub when its folder is gone
    peft_model.save_pretrained(str(out_dir), safe_serialization=True, save_embedding_layers=False)
    for name, module in (extra or {}).items():
        save_file({k: v.detach().contiguous() for k, v in module.state_dict().items()},
                  str(out_dir / f"{name}.safetensors"))
    (out_dir / "README.md").unlink(missing_ok=True)  # peft's model card template says nothing about this run
    (out_dir / "adapters.json").write_text(json.dumps({"adapters": sorted(peft_model.peft_config),
                                                      "extra": sorted(extra or {})}))
