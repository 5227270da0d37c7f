"""A fused NF4 dequantise-and-multiply for small batches (the decode step of a 4-bit rollout).

bitsandbytes' 4-bit path dequantises the whole weight to bf16 for every call and then multiplies, so a decode
step at batch 8 reads each weight three times (4-bit in, bf16 out, bf16 in again). This kernel reads the packed
4-bit weight once and multiplies as it goes: each program owns BLOCK_N output features, walks K in BLOCK_K
chunks, looks the nibbles up in the 16-entry NF4 code, scales them by their block's absmax and accumulates
x @ W^T in fp32. Even columns live in a byte's high nibble and odd columns in its low one (bitsandbytes'
layout), so the kernel splits x into its even and odd columns instead of interleaving the weights.

Training keeps bitsandbytes' own path; this is for inference on weights that do not change inside a rollout.
`NF4Weight.from_bnb` reads a bitsandbytes Params4bit (double quantisation resolved once to fp32 absmax);
`dequantize` is the plain-torch reference the tests hold the kernel to. On a CPU the kernel runs under Triton's
interpreter (TRITON_INTERPRET=1 set before triton is first imported: tests/hybridcore/nf4_worker.py runs in a
process of its own for that), which is how CI tests it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class NF4Weight:
    """An [N, K] weight in bitsandbytes' NF4 layout: `packed` uint8 [N*K/2] (row-major, two columns a byte),
    `absmax` fp32, one per `blocksize` consecutive elements of the flattened weight, `code` the 16 NF4 levels."""
    packed: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    shape: tuple[int, int]
    blocksize: int

    @classmethod
    def from_bnb(cls, weight) -> "NF4Weight":
        """From a bitsandbytes Params4bit (or its packed data + quant_state): nested absmax dequantised once."""
        state = weight.quant_state
        if state.quant_type != "nf4":
            raise ValueError(f"NF4Weight: quant_type {state.quant_type!r}, expected 'nf4'")
        absmax = state.absmax
        if state.nested:
            import bitsandbytes.functional as bnbf
            absmax = bnbf.dequantize_blockwise(absmax, state.state2) + state.offset
        n, k = state.shape
        if k % 2:
            raise ValueError(f"NF4Weight: {k} input features, expected an even number (two columns a byte)")
        return cls(weight.data.reshape(-1), absmax.float().contiguous(), state.code.float().contiguous(),
                   (n, k), state.blocksize)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The whole [N, K] weight, in plain torch (the reference)."""
        hi, lo = (self.packed >> 4).long(), (self.packed & 15).long()
        flat = torch.stack([self.code[hi], self.code[lo]], dim=-1).reshape(-1)
        scale = self.absmax.repeat_interleave(self.blocksize)[: flat.numel()]
        return (flat * scale).reshape(self.shape).to(dtype)


def matmul(x: torch.Tensor, w: NF4Weight, block_n: int = 32, block_k: int = 128, split_k: int = 1,
           num_warps: int = 4, num_stages: int = 2, lookup: str = "select") -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype, fp32 accumulation, reading W's 4-bit bytes once. split_k > 1
    has that many programs share each block of outputs along K (atomic fp32 adds: more programs for the few
    outputs of a decode step). The tile sizes, split and Triton's warps and stages are bench/nf4_decode.py's to
    tune. lookup: how a nibble becomes its NF4 level, "select" (a 4-level tl.where tree over the 16 levels held
    in registers) or "table" (a load from the 16-entry code in memory per element)."""
    import triton

    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"nf4.matmul: x has {x.shape[-1]} features, the weight takes {k}")
    if lookup not in ("select", "table"):
        raise ValueError(f"nf4.matmul: lookup {lookup!r}, expected 'select' or 'table'")
    if block_k % 32 or w.blocksize % 2 or n * k >= 2 ** 31:
        raise ValueError("nf4.matmul: block_k must be a multiple of 32, the quantisation block even and the "
                         "weight under 2**31 elements")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    chunks = triton.cdiv(k, block_k)
    split_k = max(1, min(split_k, chunks))
    per_split = triton.cdiv(chunks, split_k) * block_k  # columns each split walks
    acc_dtype = x.dtype if split_k == 1 else torch.float32
    y = (torch.empty if split_k == 1 else torch.zeros)((m, n), dtype=acc_dtype, device=x.device)
    block_m = 16  # tl.dot's smallest tile; rows past m are masked
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)
    _kernel()[grid](x2, w.packed, w.absmax, w.code, y, m, n, k, x2.stride(0), y.stride(0), per_split,
                    BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, QBLOCK=w.blocksize, ATOMIC=split_k > 1,
                    SELECT=lookup == "select",
                    PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps,
                    num_stages=num_stages)
    return (y if split_k == 1 else y.to(x.dtype)).reshape(*lead, n)


@functools.cache
def _kernel():
    """Imported on first use, so TRITON_INTERPRET can be set by then (and triton is imported only when needed)."""
    from hybridcore.nf4_kernels import nf4_matmul
    return nf4_matmul
