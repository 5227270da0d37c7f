"""GPU: one decode step's 4-bit linears at the Llama-3-8B shape, fused NF4 kernel (hybridcore/nf4.py) against
bitsandbytes' matmul_4bit (today's rollout path) and bf16 dense, in one run.

The 7 decoder linears x 32 layers (random weights, NF4 with double quantisation as the pipeline loads them),
each method's 224 matmuls captured in one CUDA graph and replayed, so launch overhead is out of the comparison.
Correctness first: every method's output for the first layer against x @ dequantised(W)^T. Needs torch,
triton and the bitsandbytes wheel (carried). Writes $OUT/nf4_decode.json.
    python bench/nf4_decode.py [--batches 1 8 16 64] [--layers 32]
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybridcore import nf4  # noqa: E402

HIDDEN, INTER, KV = 4096, 14336, 1024  # Llama-3-8B
SHAPES = {"q": (HIDDEN, HIDDEN), "k": (KV, HIDDEN), "v": (KV, HIDDEN), "o": (HIDDEN, HIDDEN),
          "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
# (block_n, block_k, split_k, num_warps, num_stages) of the fused kernel, each timed in the same run
CONFIGS = [(32, 128, 1, 4, 2, "table"), (16, 64, 16, 2, 2, "table"), (32, 128, 1, 4, 2, "select"),
           (16, 64, 16, 2, 2, "select"), (16, 128, 8, 4, 3, "select"), (64, 128, 4, 4, 3, "select")]


def build(layers: int):
    import bitsandbytes.functional as bnbf

    weights = []
    for _ in range(layers):
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True,
                                               quant_storage=torch.uint8)

            class P:  # what NF4Weight.from_bnb reads of a Params4bit
                data, quant_state = packed, state
            weights.append({"name": name, "dense": w, "packed": packed, "state": state,
                            "nf4": nf4.NF4Weight.from_bnb(P)})
    return weights


def methods(weights, cfg):
    import bitsandbytes as bnb
    bn, bk, split, warps, stages, lookup = cfg
    return {
        "bnb": lambda x, w: bnb.matmul_4bit(x, w["packed"].t(), quant_state=w["state"]),
        "fused": lambda x, w: nf4.matmul(x, w["nf4"], block_n=bn, block_k=bk, split_k=split, num_warps=warps,
                                              num_stages=stages, lookup=lookup),
        "bf16": lambda x, w: x @ w["dense"].t(),
    }


def step_ms(fn, weights, batch: int, reps: int = 20) -> float:
    """One decode step (every linear once, each fed an input of its width) replayed from a CUDA graph."""
    xs = {k: torch.randn(batch, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, INTER)}
    for w in weights:  # warm-up: Triton compiles, bitsandbytes allocates
        fn(xs[w["nf4"].shape[1]], w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(xs[w["nf4"].shape[1]], w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def check(weights, batch: int) -> dict:
    """Max |error| of each method on the first layer against x @ dequantised(W)^T in fp32, relative to its max."""
    out = {}
    for w in weights[:7]:
        x = torch.randn(batch, w["nf4"].shape[1], device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w["nf4"].dequantize().t()
        for cfg in (CONFIGS[0], CONFIGS[3]):
            for name, fn in methods(weights, cfg).items():
                if name != "bf16":
                    err = float((fn(x, w).float() - ref).abs().max() / ref.abs().max())
                    out[f"{name}_{w['name']}_{cfg[5]}_split{cfg[2]}"] = err
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--layers", type=int, default=32)
    a = ap.parse_args()
    t0 = time.time()
    weights = build(a.layers)
    int4_bytes = sum(w["packed"].numel() + w["nf4"].absmax.numel() * 4 for w in weights)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": a.layers,
           "int4_bytes": int4_bytes, "check_rel_err": check(weights, 8), "steps_ms": {}}
    import triton
    res["triton"] = triton.__version__
    for b in a.batches:
        row = {"bnb": step_ms(methods(weights, CONFIGS[0])["bnb"], weights, b),
               "bf16": step_ms(methods(weights, CONFIGS[0])["bf16"], weights, b)}
        for cfg in CONFIGS:
            row["fused_" + "x".join(map(str, cfg))] = step_ms(methods(weights, cfg)["fused"], weights, b)
        res["steps_ms"][b] = row
        print(b, {k: round(v, 3) for k, v in row.items()}, flush=True)
    res["wall_s"] = time.time() - t0
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "nf4_decode.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res["check_rel_err"], indent=1))


if __name__ == "__main__":
    main()
