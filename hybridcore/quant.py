"""Quantised loading through bitsandbytes: 8-bit, or 4-bit NF4 with double quantisation and a compute dtype.

bitsandbytes is optional (the GPU box may lack it), so it is imported only when a role asks for it. Output
heads (`lm_head`, a scorer's `score`) stay unquantised: they are small next to the body and a value or
score head must stay trainable.
"""
from __future__ import annotations

import torch

from hybridcore.errors import InputError

QUANTIZATIONS = ("none", "8bit", "4bit")
SKIP_MODULES = ["lm_head", "score"]
BLOCK_N = 32  # bitsandbytes' CPU 4-bit kernel needs every quantised Linear's out_features divisible by this


def bnb_config(quantization: str, compute_dtype: torch.dtype, field: str):
    """transformers' BitsAndBytesConfig for a role, or None for `none`."""
    if quantization == "none":
        return None
    if quantization not in QUANTIZATIONS:
        raise InputError(f"{field}: found {quantization!r}, expected one of {', '.join(QUANTIZATIONS)}")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise InputError(f"{field}={quantization} needs the bitsandbytes package, which is not installed here "
                         f"(install bitsandbytes or set quantization: none)") from None
    from transformers import BitsAndBytesConfig
    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=SKIP_MODULES)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype, llm_int8_skip_modules=SKIP_MODULES)


def check_4bit_shapes(model, field: str) -> None:
    """On CPU a 4-bit forward fails deep inside bitsandbytes ("N must be divisible by block_n") unless every
    quantised Linear's out_features is a multiple of 32; say so before loading. `model` may be on `meta`."""
    bad = sorted({f"{name.rsplit('.', 1)[-1]} (out_features={m.out_features})"
                  for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in SKIP_MODULES
                  and m.out_features % BLOCK_N})
    if bad:
        raise InputError(f"{field}=4bit: on CPU every quantised Linear needs out_features divisible by {BLOCK_N}; "
                         f"found {', '.join(bad[:5])} (use 8bit or none, or a model whose sizes are multiples "
                         f"of {BLOCK_N})")


def check_4bit_config(config, model_cls, field: str, trust_remote_code: bool = False) -> None:
    """check_4bit_shapes on a model built on the meta device from `config` (no memory, no weights)."""
    with torch.device("meta"):
        model = model_cls.from_config(config, trust_remote_code=trust_remote_code)
    check_4bit_shapes(model, field)


def keep_one_4bit_layout(model) -> None:
    """bitsandbytes repacks a 4-bit weight for its AVX512-bf16 CPU kernel on the first forward in eval mode
    without autograd, with absmax rounded to bf16: from then on the model computes slightly different
    numbers in rollout/scoring than in training, and the repacked weight no longer dequantises as stored.
    One layout for every phase: the repacking is turned off (CPU only; CUDA never repacks)."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def is_quantized(module: torch.nn.Module) -> bool:
    return any(type(p).__name__ in ("Params4bit", "Int8Params") for p in module.parameters())


def dequantized_weight(layer: torch.nn.Module) -> torch.Tensor:
    """A Linear's weight as a plain tensor, whether it is a bitsandbytes 4/8-bit layer or not."""
    w = layer.weight
    kind = type(w).__name__
    if kind == "Params4bit":
        import bitsandbytes as bnb
        if getattr(w.quant_state, "packing_format_for_cpu", False):  # repacked for the CPU kernel: undo it
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse
            w.data, w.quant_state = _convert_weight_packed_for_cpu_inverse(w.data, w.quant_state)
        return bnb.functional.dequantize_4bit(w.data, w.quant_state)
    if kind == "Int8Params":
        from peft.utils.integrations import dequantize_bnb_weight
        return dequantize_bnb_weight(w, state=layer.state)
    return w.detach()
