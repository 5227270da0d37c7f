"""The 4-bit rollout's decode linears through the fused NF4 kernel (hybridcore/nf4.py) instead of bitsandbytes.

A rollout transition (hybridcore/transitions.py's protocol): on entry every bitsandbytes Linear4bit of the model
gets a forward that sends small batches (2 to `max_rows` rows: the decode steps) through `nf4.matmul`, which
reads each packed weight once, and everything else (a longer prefill, a lone row) through bitsandbytes' own forward;
on exit the layers' own forwards come back, so training never sees it. peft's LoRA layers wrap the base layer; where
one adapter is active (plain LoRA: no DoRA or other variant, no dropout at work) the wrapper's forward computes
u = x @ A^T (in the layer's compute dtype) and the kernel adds (u @ B^T) * scaling inside its epilogue (nf4.matmul's `lora`), so an adapter costs
one small product a projection instead of two products and an add; any other wrapper adds its deltas around
whichever forward its base layer has. The weights are frozen (QLoRA trains only adapters; the adapters do not
change inside a rollout either). The kernels read bitsandbytes' own tensors, the double-quantised absmax included (resolved
per block inside the kernel), so the rollout holds no copy of them; only the second level's small tables are made
fp32 where they are not (an fp32 absmax resolved on entry, as this first did, cost an eighth of the packed bytes:
0.41 GiB at the Llama-3-8B shape, bench/RESULTS.md 2026-12-06).

The kernel is called through a custom op (`torch.ops.hybridcore.nf4_matmul`), which torch.compile keeps as one
opaque node: traced into, the launcher's Python broke the compiled decode step inside every attention, and each
decoder layer's `layer_idx` then forced a recompile of the rest, past dynamo's limit of 8 (2026-12-06, H100).
"""
from __future__ import annotations

import os

import torch

from hybridcore import nf4

# the decode batches, in rows, sent through the fused kernel (bench/nf4_decode.py, H100: the 8B decoder's 224
# linears take 5.7 ms at 8 and 16 rows against bitsandbytes' 11.6, which dequantises the whole weight for more than
# one row, 2026-12-07; for one row bitsandbytes' own gemv kernel was faster, 4.0 ms against 5.4, 2026-12-06)
MIN_ROWS, MAX_ROWS = 2, 16


def linear4bit_layers(model) -> list[torch.nn.Module]:
    """bitsandbytes' own Linear4bit layers (peft's LoRA wrapper around one has the same class name)."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, Linear4bit)]


@torch.library.custom_op("hybridcore::nf4_matmul", mutates_args=(),
                         schema="(Tensor x, Tensor packed, Tensor absmax, Tensor code, Tensor? absmax2, Tensor? code2, "
                                "Tensor? offset, int n, int k, int blocksize, int blocksize2, Tensor? u=None, "
                                "Tensor? lora_b=None, Tensor? scale=None) -> Tensor")
def nf4_matmul(x, packed, absmax, code, absmax2, code2, offset, n, k, blocksize, blocksize2, u=None, lora_b=None,
               scale=None):
    """nf4.matmul with its default tiles on an NF4Weight given as its tensors (what a custom op can take); u, lora_b
    and scale: its `lora` delta, or None."""
    return nf4.matmul(x, nf4.NF4Weight(packed, absmax, code, (n, k), blocksize, absmax2, code2, offset, blocksize2),
                      lora=None if u is None else (u, lora_b, scale))


@nf4_matmul.register_fake
def _(x, packed, absmax, code, absmax2, code2, offset, n, k, blocksize, blocksize2, u=None, lora_b=None, scale=None):
    return x.new_empty(*x.shape[:-1], n)


def op_arguments(weight: nf4.NF4Weight) -> tuple:
    """nf4_matmul's arguments after x for `weight`, fixed for the rollout."""
    return (weight.packed, weight.absmax, weight.code, weight.absmax2, weight.code2, weight.offset, *weight.shape,
            weight.blocksize, weight.blocksize2)


def base_product(layer, args: tuple, x: torch.Tensor, *lora: torch.Tensor) -> torch.Tensor:
    """A Linear4bit's forward through the op, in its compute dtype, plus its bias; lora: u, lora_b, scale."""
    dtype = getattr(layer, "compute_dtype", None) or x.dtype
    y = nf4_matmul(x.to(dtype), *args, *lora)
    if layer.bias is not None:
        y = y + layer.bias.to(dtype)
    return y.to(x.dtype)


def fused_forward(layer, weight: nf4.NF4Weight, max_rows: int, min_rows: int = MIN_ROWS):
    own, args = type(layer).forward, op_arguments(weight)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not min_rows <= x.numel() // x.shape[-1] <= max_rows:
            return own(layer, x)
        return base_product(layer, args, x)
    return forward


def lora_adapter(wrapper) -> str | None:
    """The one plain LoRA adapter a peft wrapper's forward would add, or None where its forward does more than
    base + (B(A(x))) * scaling: no adapter or several active, merged or disabled adapters, DoRA or another variant."""
    active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if len(active) != 1 or wrapper.merged or wrapper.disable_adapters or active[0] in getattr(wrapper, "lora_variant",
                                                                                               {}):
        return None
    return active[0]


def fused_lora_forward(wrapper, adapter: str, weight: nf4.NF4Weight, max_rows: int, min_rows: int = MIN_ROWS):
    """A peft LoRA wrapper's forward for decode rows: u = x @ A^T in the base layer's compute dtype (A and B copied
    to it here, once a rollout: peft keeps them in fp32 for training, and an fp32 product of 8 rows took twice a
    bf16 one's time on an H100, bench/RESULTS.md 2026-12-07), then base + (u @ B^T) * scaling in the kernel, in
    fp32 accumulation. Everything else (other row counts, extra arguments, autocast, a dropout at work) takes the wrapper's own
    forward."""
    own, base = type(wrapper).forward, wrapper.get_base_layer()
    lora_a, lora_b, dropout = wrapper.lora_A[adapter], wrapper.lora_B[adapter], wrapper.lora_dropout[adapter]
    scale = torch.tensor([float(wrapper.scaling[adapter])], dtype=torch.float32, device=weight.packed.device)
    args = op_arguments(weight)
    dtype = getattr(base, "compute_dtype", None) or lora_a.weight.dtype
    a, b = lora_a.weight.detach().to(dtype), lora_b.weight.detach().to(dtype)

    def forward(x: torch.Tensor, *rest, **kwargs) -> torch.Tensor:
        idle_dropout = isinstance(dropout, torch.nn.Identity) or not dropout.training or dropout.p == 0
        if (rest or kwargs or not idle_dropout or torch.is_autocast_enabled()
                or not min_rows <= x.numel() // x.shape[-1] <= max_rows):
            return own(wrapper, x, *rest, **kwargs)
        u = torch.nn.functional.linear(x.to(a.dtype), a)
        return base_product(base, args, x, u, b, scale)
    return forward


def lora_wrappers(model) -> list[torch.nn.Module]:
    """peft's LoRA layers around a bitsandbytes Linear4bit."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    bases = set(map(id, linear4bit_layers(model)))
    return [m for m in model.modules() if isinstance(m, LoraLayer) and id(m.get_base_layer()) in bases]


class FusedNf4Decode:
    """The model's Linear4bit layers decode through the fused kernel while the rollout lasts."""

    name = "fused_nf4_decode"

    def __init__(self, model, max_rows: int = MAX_ROWS):
        self.model, self.layers, self.wrappers = model, linear4bit_layers(model), []
        if not self.layers:
            raise ValueError("fused 4-bit decode: the model has no bitsandbytes Linear4bit layer")
        self.max_rows = max_rows

    def enter(self) -> dict[str, int]:
        device = self.layers[0].weight.device
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("engine.rollout.decode_4bit=fused runs its Triton kernel on CUDA (on a CPU only under "
                               "Triton's interpreter, TRITON_INTERPRET=1: tests); expected a GPU, or bitsandbytes")
        weights = {id(layer): nf4.NF4Weight.from_bnb(layer.weight) for layer in self.layers}
        for layer in self.layers:
            layer.forward = fused_forward(layer, weights[id(layer)], self.max_rows)
        self.wrappers = []
        for wrapper in lora_wrappers(self.model):
            adapter = lora_adapter(wrapper)
            if adapter is not None:
                weight = weights[id(wrapper.get_base_layer())]
                wrapper.forward = fused_lora_forward(wrapper, adapter, weight, self.max_rows)
                self.wrappers.append(wrapper)
        return {}

    def exit(self) -> dict[str, int]:
        for layer in self.layers + self.wrappers:
            layer.__dict__.pop("forward", None)
        self.wrappers = []
        return {}
