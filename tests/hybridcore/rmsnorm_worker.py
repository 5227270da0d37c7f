"""Runs hybridcore/rmsnorm.py's kernels under Triton's interpreter in a process of its own (TRITON_INTERPRET must be
set before triton is first imported): forward and backward on random rows against transformers' LlamaRMSNorm, and a
micro 4-bit + LoRA model's log-probs and adapter gradients with the kernels against without; prints JSON for
tests/hybridcore/test_rmsnorm.py to judge. Importing this module sets nothing: main() does."""
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# (hidden, dtype, weight dtype): a power of two, a width that is not (masked tail), bf16 with an fp32 weight
CASES = [(64, "float32", "float32"), (96, "bfloat16", "bfloat16"), (128, "bfloat16", "float32"),
         (40, "float16", "float16")]


def rows_case(hidden: int, dtype: str, wdtype: str) -> dict:
    """Max |kernel - transformers| of y and of dx (relative to the max |reference|) over [2, 5, hidden] x (a strided
    view: the kernel takes the row stride), the output dtypes, and a zero-row input."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hybridcore import rmsnorm

    g = torch.Generator().manual_seed(hidden)
    ref = LlamaRMSNorm(hidden, eps=1e-5).to(getattr(torch, wdtype)).requires_grad_(False)
    with torch.no_grad():
        ref.weight.copy_(1 + torch.randn(hidden, generator=g) * 0.3)
    fused = rmsnorm.RMSNormFunction
    base = (torch.randn(2, 5, 2 * hidden, generator=g) * 3).to(getattr(torch, dtype))
    dy = torch.randn(2, 5, hidden, generator=g).to(torch.promote_types(ref.weight.dtype, base.dtype))
    out = {}
    for name, f in (("ref", lambda x: ref(x)), ("fused", lambda x: fused.apply(x, ref.weight, 1e-5))):
        x = base[..., :hidden].detach().requires_grad_(True)  # every row strided: 2 * hidden apart
        y = f(x)
        y.backward(dy)
        out[name] = (y.detach().float(), x.grad.float(), str(y.dtype), str(x.grad.dtype))
    (y0, dx0, yd0, gd0), (y1, dx1, yd1, gd1) = out["ref"], out["fused"]
    empty = fused.apply(torch.zeros(0, hidden, dtype=base.dtype), ref.weight, 1e-5)
    return {"y": float((y1 - y0).abs().max() / y0.abs().max()), "dx": float((dx1 - dx0).abs().max() / dx0.abs().max()),
            "dtypes": [yd1 == yd0, gd1 == gd0], "empty": list(empty.shape)}


def model_case() -> dict:
    """A micro 4-bit model with LoRA on q/v/down: response log-probs and the adapters' gradients with the kernels
    (as models.py loads it) and with transformers' norms; how many norms were swapped."""
    import torch

    from hybridcore import rmsnorm
    from hybridcore.adapters import LoraSpec, adapter_parameters, add_lora
    from hybridcore.batch import pack
    from hybridcore.forward import response_logprobs
    from hybridcore.models import build_preset, load_causal_lm, save_model, train_tokenizer

    texts = [f"sam plants {a} rows of {b} beans: {a * b} beans" for a in range(1, 8) for b in range(1, 8)]
    tok = train_tokenizer(texts, 384)
    with tempfile.TemporaryDirectory() as d:
        save_model(build_preset("micro", tok, seed=0), tok, Path(d))
        model = load_causal_lm(d, quantization="4bit")
    swapped = sum(type(m).__dict__.get("forward") is rmsnorm.fused_forward for m in model.modules())
    model = add_lora(model, LoraSpec(8, 16.0, ("q_proj", "v_proj", "down_proj")), "x", "a").get_base_model()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in adapter_parameters(model, "a").items():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts[:4]]
    batch = pack([x[:6] for x in ids], [x[6:10] for x in ids], tok.pad_token_id)
    calls, results = [0], {}
    apply = rmsnorm.RMSNormFunction.apply
    rmsnorm.RMSNormFunction.apply = lambda *a: calls.__setitem__(0, calls[0] + 1) or apply(*a)
    for fused in (True, False):
        rmsnorm.install(model, fused)
        lp = response_logprobs(model, batch)
        lp.sum().backward()
        results[fused] = (lp.detach(), {n: p.grad.clone() for n, p in adapter_parameters(model, "a").items()})
        model.zero_grad(set_to_none=True)
    (lp1, g1), (lp0, g0) = results[True], results[False]
    return {"swapped": swapped, "layers": model.config.num_hidden_layers, "calls": calls[0],
            "logprobs": float((lp1 - lp0).abs().max()),
            "grads": max(float((g1[n] - g0[n]).abs().max() / g0[n].abs().max()) for n in g0)}


def main() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    print(json.dumps({"rows": {"-".join(map(str, c)): rows_case(*c) for c in CASES}, "model": model_case()}))


if __name__ == "__main__":
    main()
