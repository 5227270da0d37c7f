"""LlamaRMSNorm as one Triton kernel in forward and one in backward, for the eager forwards (training, scoring, a
4-bit model's prefill) on a GPU.

transformers' RMSNorm (Llama's, and the classes copied from it: Qwen2/3, Mistral, Phi-3) is eight elementwise
and reduction kernels in forward over [tokens, hidden], most in float32 (x to float32, its square, the mean, the
epsilon's add, the rsqrt, the multiply, back to x's dtype, the weight's multiply), and autograd's mirror images
in backward, at 65 norms a forward pass of the 8B model. The largest elementwise kernels of the 8B PPO step's
training after peft's (bench/RESULTS.md 2026-12-07 13:23, step_profile) have the shapes of its last two: a
float32-to-bf16 cast (0.27 s) and a bf16 multiply that broadcasts (0.29 s). Here forward reads x and writes y
once (keeping one float32 rstd a row for backward) and backward reads x and dy and writes dx once.

Where it applies (`install`, on every model hybridcore/models.py loads): a module whose forward is LlamaRMSNorm's
own code (compared as bytecode, so a copied class qualifies and Gemma's (1 + weight) form does not). It computes
what that forward computes, the sum of squares in another order: x * rstd rounded to x's dtype, times the weight,
rounded once. It falls back to transformers' forward on a CPU (outside Triton's interpreter: the tests), under
torch.compile (inductor fuses the norm itself: the compiled decode step and prefill), for a trained weight (full
fine-tuning: this backward computes no weight gradient), rows wider than MAX_HIDDEN, or dtypes other than FLOATS.
"""
from __future__ import annotations

import torch

from hybridcore.models import set_forward
from hybridcore.triton_device import runs_on

MAX_HIDDEN = 16384  # one row in one program's registers (Llama-3-70B's hidden size is 8,192)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def llama_form(module: torch.nn.Module) -> bool:
    """Whether `module` computes LlamaRMSNorm's forward (the same bytecode), over a 1-D weight."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    code, ref = getattr(type(module).forward, "__code__", None), LlamaRMSNorm.forward.__code__
    weight = getattr(module, "weight", None)
    return (code is not None and (code.co_code, code.co_consts, code.co_names) == (ref.co_code, ref.co_consts,
                                                                                   ref.co_names)
            and isinstance(weight, torch.Tensor) and weight.dim() == 1 and hasattr(module, "variance_epsilon"))


def _launch(x: torch.Tensor) -> dict:
    import triton
    block = triton.next_power_of_2(x.shape[-1])
    return dict(BLOCK=block, num_warps=8 if block >= 4096 else 4 if block >= 1024 else 2)


class RMSNormFunction(torch.autograd.Function):
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype) over the last dimension; no gradient for the weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from hybridcore import rmsnorm_kernels

        rows = x.reshape(-1, x.shape[-1])
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        y = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        if rows.shape[0]:
            rmsnorm_kernels.rms_forward[(rows.shape[0],)](rows, weight, y, rstd, rows.stride(0), y.stride(0),
                                                          rows.shape[1], eps, **_launch(rows))
        ctx.save_for_backward(rows, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        from hybridcore import rmsnorm_kernels

        rows, weight, rstd = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        g = dy.reshape(-1, dy.shape[-1])
        g = g if g.stride(-1) == 1 else g.contiguous()
        dx = torch.empty_like(rows)
        if rows.shape[0]:
            rmsnorm_kernels.rms_backward[(rows.shape[0],)](g, rows, weight, rstd, dx, g.stride(0), rows.stride(0),
                                                           dx.stride(0), rows.shape[1], **_launch(rows))
        return dx.view(ctx.x_shape), None, None


def fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if (not runs_on(hidden_states.device) or torch.compiler.is_compiling() or w.requires_grad
            or hidden_states.shape[-1] > MAX_HIDDEN or hidden_states.dtype not in FLOATS or w.dtype not in FLOATS):
        return super(type(self), self).forward(hidden_states)
    return RMSNormFunction.apply(hidden_states, w, float(self.variance_epsilon))


def install(model: torch.nn.Module, fused: bool = True) -> int:
    """Give every LlamaRMSNorm-form module of `model` the kernels' forward (fused=False: transformers' own again);
    returns how many changed."""
    return sum(set_forward(m, fused_forward, fused) for m in list(model.modules())
               if llama_form(m) or type(m).__dict__.get("forward") is fused_forward)
