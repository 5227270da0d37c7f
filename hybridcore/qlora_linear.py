"""QLoRA's linear layer as one autograd function: y = x @ W^T + bias + scaling * (x @ A^T) @ B^T, W frozen 4-bit.

peft's forward for a LoRA layer around a bitsandbytes Linear4bit (peft/tuners/lora/bnb.py) computes the base
output, clones it ("defensively"), computes the adapter's delta, multiplies it by the scaling and adds it: three
elementwise passes over [tokens, out_features] a linear, and in backward their mirror images (the scaling's
multiply again, and the add's two branches of the input's gradient summed by autograd). In one Llama-3-8B PPO step
the kernels of that kind took 1.2 s of its 7.45 s (bf16 add 0.45, copy 0.43, multiply 0.29: bench/RESULTS.md
2026-12-07 13:23, step_profile), beside the residual stream's adds and the casts that share those kernels.

Here the delta goes into the base product's own output by one addmm (the GEMM accumulates into the buffer it
writes), and backward does the same for the input's gradient: x's gradient is g @ W + (scaling * g @ B) @ A, one
product and one accumulating product. W is dequantised in forward and again in backward, as bitsandbytes' own
MatMul4Bit does (keeping it would hold its bf16 bytes a layer), and x's gradient is skipped where x needs none.

`install(model)` gives peft's 4-bit LoRA layers this forward (a subclass of peft's class, so isinstance and peft's
merging, saving and adapter switching see the same layers); the layer falls back to peft's own forward wherever
it would do more or other than that sum (`adapters.lora_adapter`: no adapter or several active, merged or disabled
adapters, DoRA), for extra arguments, an active dropout, a trained bias, one row (bitsandbytes' inference kernel
for a lone token beats dequantising the weight), under torch.compile (the compiled decode step keeps its measured
path), and where the dtypes differ without autocast (peft would compute the adapter in its own dtype then).
"""
from __future__ import annotations

import torch

from hybridcore.adapters import lora_adapter, lora_wrappers
from hybridcore.models import set_forward
from hybridcore.quant import dequantized_weight


class QLoraProduct(torch.autograd.Function):
    """base(x) + scaling * (x @ A^T) @ B^T in `dtype` for a frozen 4-bit `base` (a bitsandbytes Linear4bit) and
    trained A [r, in], B [out, r]; the result in x's dtype."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, base, scaling: float, dtype: torch.dtype):
        with torch.autocast(x.device.type, enabled=False):
            rows = x.reshape(-1, x.shape[-1]).to(dtype)
            w = dequantized_weight(base).to(dtype)
            u = rows @ lora_a.to(dtype).t()
            y = torch.mm(rows, w.t()) if base.bias is None else torch.addmm(base.bias.to(dtype), rows, w.t())
            y.addmm_(u, lora_b.to(dtype).t(), alpha=scaling)
        ctx.save_for_backward(rows, u, lora_a, lora_b)
        ctx.base, ctx.scaling, ctx.x_shape, ctx.x_dtype = base, scaling, x.shape, x.dtype
        return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        rows, u, lora_a, lora_b = ctx.saved_tensors
        dtype, scaling = rows.dtype, ctx.scaling
        gx = ga = gb = None
        with torch.autocast(rows.device.type, enabled=False):
            g = grad.reshape(-1, grad.shape[-1]).to(dtype)
            gu = (g @ lora_b.to(dtype)).mul_(scaling)  # the gradient of u = x @ A^T
            if ctx.needs_input_grad[0]:
                gx = torch.mm(g, dequantized_weight(ctx.base).to(dtype))
                gx.addmm_(gu, lora_a.to(dtype))
                gx = gx.view(ctx.x_shape).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                ga = (gu.t() @ rows).to(lora_a.dtype)
            if ctx.needs_input_grad[2]:
                gb = (g.t() @ u).mul_(scaling).to(lora_b.dtype)
        return gx, ga, gb, None, None, None


def product_dtype(layer, adapter: str, x: torch.Tensor) -> torch.dtype | None:
    """The dtype peft's forward would compute both products in: autocast's where it is on; without it x's, where
    x, the adapter and the base layer's compute dtype agree; else None (peft's own forward)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    base = layer.get_base_layer()
    dtypes = {x.dtype, layer.lora_A[adapter].weight.dtype, layer.lora_B[adapter].weight.dtype,
              getattr(base, "compute_dtype", None) or x.dtype}
    return x.dtype if len(dtypes) == 1 else None


def plain_sum(layer, adapter: str | None, x: torch.Tensor, extra: bool) -> bool:
    """Whether peft's forward is base + scaling * B(A(x)) and worth the fused product here (see the module's
    docstring for what falls back)."""
    if adapter is None or extra or torch.compiler.is_compiling() or x.numel() == x.shape[-1]:
        return False
    base, dropout = layer.get_base_layer(), layer.lora_dropout[adapter]
    idle = isinstance(dropout, torch.nn.Identity) or not dropout.training or dropout.p == 0
    trained_bias = base.bias is not None and base.bias.requires_grad
    return idle and not trained_bias and getattr(base.weight, "quant_state", None) is not None


def qlora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    adapter = lora_adapter(self)
    if plain_sum(self, adapter, x, bool(args or kwargs)):
        dtype = product_dtype(self, adapter, x)
        if dtype is not None:
            return QLoraProduct.apply(x, self.lora_A[adapter].weight, self.lora_B[adapter].weight,
                                      self.get_base_layer(), float(self.scaling[adapter]), dtype)
    return super(type(self), self).forward(x, *args, **kwargs)


def install(model, fused: bool = True) -> int:
    """Give every peft LoRA layer around a bitsandbytes Linear4bit in `model` the fused forward (fused=False: peft's
    own again); returns how many layers changed."""
    return sum(set_forward(layer, qlora_forward, fused) for layer in lora_wrappers(model))
