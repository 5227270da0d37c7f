"""The 8B PPO step's training operations one at a time, forward + backward, at one micro-batch (2 x 2,048 tokens, bf16),
against what transformers and peft run: RMSNorm (hybridcore/rmsnorm.py against LlamaRMSNorm), a QLoRA linear
(hybridcore/qlora_linear.py against peft's forward; needs bitsandbytes, else skipped) and the attention of a
grouped-query layer with a padding mask (transformers' sdpa: K and V repeated to every query head, against SDPA on
the KV heads themselves with enable_gqa on cuDNN's backend, which takes a mask; the outputs compared). CUDA.

    python3 bench/train_ops.py --out DIR     # writes train_ops.json: milliseconds each way, max differences
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

B, T, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, RANK = 2, 2048, 4096, 14336, 32, 8, 128, 16


def timed(fn, reps: int = 10) -> float:
    """Milliseconds a call of fn (forward + backward), after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / reps


def fwd_bwd(module_or_fn, x, grad):
    def run():
        x.grad = None
        module_or_fn(x).backward(grad)
    return run


def rmsnorm_rows() -> dict:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hybridcore import rmsnorm

    norm = LlamaRMSNorm(HIDDEN).cuda().to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(B, T, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    out = {"transformers_ms": timed(fwd_bwd(norm, x, grad))}
    ref = norm(x)
    rmsnorm.install(norm)
    out["kernels_ms"] = timed(fwd_bwd(norm, x, grad))
    out["max_diff"] = float((norm(x) - ref).abs().max())
    return out


def qlora_rows() -> dict:
    try:
        import bitsandbytes as bnb
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        return {"skipped": f"{type(e).__name__}: {e}"}
    from hybridcore import qlora_linear

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = bnb.nn.Linear4bit(HIDDEN, FFN, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")

    m = M()
    m.is_loaded_in_4bit = True  # what from_pretrained sets; peft picks its 4-bit LoRA layer by it
    m.up.weight = bnb.nn.Params4bit(torch.randn(FFN, HIDDEN) * 0.02, requires_grad=False, quant_type="nf4")
    m = m.cuda()
    model = get_peft_model(m, LoraConfig(r=RANK, lora_alpha=32, target_modules=["up"], lora_dropout=0.0))
    layer = model.base_model.model.up
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.02)
    x = torch.randn(B, T, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(B, T, FFN, device="cuda", dtype=torch.bfloat16)

    def call(inp):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return layer(inp)
    out = {"peft_ms": timed(fwd_bwd(call, x, grad))}
    ref = call(x)
    qlora_linear.install(model)
    out["fused_ms"] = timed(fwd_bwd(call, x, grad))
    out["max_diff"] = float((call(x) - ref).abs().max())
    out["ref_max"] = float(ref.abs().max())
    return out


def attention_rows() -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import repeat_kv

    q = torch.randn(B, HEADS, T, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, KV_HEADS, T, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    pad = torch.ones(B, T, dtype=torch.bool, device="cuda")
    pad[0, :300] = False  # row 0 left-padded
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device="cuda"))[None, None] & pad[:, None, None, :]
    mask |= ~pad[:, None, :, None]  # a padded query row attends everywhere (no NaN), as transformers' masks do
    grad = torch.randn(B, HEADS, T, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    rep = HEADS // KV_HEADS

    def repeated(_):
        return F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), attn_mask=mask)

    def grouped(_):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    out = {"repeat_kv_ms": timed(fwd_bwd(repeated, q, grad))}
    ref = repeated(None)
    try:
        out["gqa_cudnn_ms"] = timed(fwd_bwd(grouped, q, grad))
        out["max_diff"] = float((grouped(None) - ref).abs().max())
    except RuntimeError as e:
        out["gqa_cudnn_error"] = str(e).splitlines()[0][:300]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "shape": dict(B=B, T=T, hidden=HIDDEN, ffn=FFN, heads=HEADS, kv_heads=KV_HEADS, rank=RANK)}
    for name, fn in (("rmsnorm", rmsnorm_rows), ("qlora_linear", qlora_rows), ("attention", attention_rows)):
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 -- one op's failure is recorded; the others still run
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        print(name, res[name], flush=True)
    (a.out / "train_ops.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
