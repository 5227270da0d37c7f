"""GPU: one decode step's attention over the native rollout's static KV cache at two rollout shapes, the
flash-decoding kernel (hybridcore/decode_attention.py) in a spread of tile configurations against the SDPA call that
grouped_attention (hybridcore/rollout.py) makes today, in one run.

Per shape, `layers` distinct bf16 caches (one per decoder layer, so that no layer reads what another left in L2),
rows left-padded by up to a quarter of the columns (False holes at the start of the mask). Each method's attention
over all layers is captured in one CUDA graph and replayed for every `filled` value, the device tensor and the mask
advanced in place between replays as the rollout's graph sees them: SDPA (`sdpa`) reads all C columns whatever is
filled, the kernel (`filled:NAME`) only those before `filled`. `sdpa_sliced` is SDPA over the first `filled`
columns alone, one graph per value: what a shape-changing step would cost, not something one graph can replay.
Correctness first: every method's output, eager and as the graph left it, against decode_attention.reference in
fp32 on layer 0 (max |error| relative to max |reference|; ok below 2e-2 in bf16). Figures: microseconds per layer
and GB/s of the K/V bytes before `filled` (what attention must read). A config that would start after --budget-s
is skipped and listed as such, one that fails is a row with its error. Needs torch and triton only. Writes
decode_attention.json into --out (default $OUT, else the system's temp folder), again after every row.
    python3 bench/decode_attention.py [--shapes qwen2.5-1.5b llama3-8b] [--budget-s 300] [--out DIR] [--commit SHA]
    python bench/decode_attention.py --tiny   # CPU: Triton's interpreter, a toy shape, no graphs -- the script's check
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.decode_profile import timed_ms  # noqa: E402
from hybridcore import decode_attention  # noqa: E402  (torch only; triton on first kernel use)

SHAPES = {  # decode shapes of the rollouts bench/rollout.py and bench/grpo_peer.py run
    "qwen2.5-1.5b": dict(batch=256, heads=12, kv_heads=2, head_dim=128, capacity=512, filled=(256, 384, 511),
                         layers=28),
    "llama3-8b": dict(batch=8, heads=32, kv_heads=8, head_dim=128, capacity=2048, filled=(1024, 1536, 2047),
                      layers=32),
    "tiny": dict(batch=2, heads=4, kv_heads=2, head_dim=64, capacity=96, filled=(40, 95), layers=1),
}
# (name, decode_attention.launch tiles): unset ones are decode_attention.DEFAULTS (128 columns a program in tiles of
# 64, 4 warps, 2 stages; the combine 16 chunks a step, 2 warps), the untimed guesses this times
CONFIGS = [
    ("default", {}),
    ("chunk64", dict(chunk=64)), ("chunk256", dict(chunk=256)), ("chunk512", dict(chunk=512, block_n=128)),
    ("chunk256_n128", dict(chunk=256, block_n=128)), ("n32", dict(block_n=32)), ("n128", dict(block_n=128)),
    ("w2", dict(num_warps=2)), ("w8", dict(num_warps=8)), ("s1", dict(num_stages=1)), ("s3", dict(num_stages=3)),
    ("chunk256_s3", dict(chunk=256, num_stages=3)), ("combine_w1", dict(combine_warps=1)),
    ("combine_w4", dict(combine_warps=4)),
]
TINY_CONFIGS = [("default", {}), ("chunk32_n16", dict(chunk=32, block_n=16)),
                ("chunk64_n32", dict(chunk=64, block_n=32))]


def build(shape: dict, device: str, seed: int = 0) -> dict:
    """Per-layer q, k, v (bf16), the left-padded base mask, a `filled` tensor and the mask the methods read."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B, H, Hkv, D, C = (shape[k] for k in ("batch", "heads", "kv_heads", "head_dim", "capacity"))
    bf16 = dict(device=device, dtype=torch.bfloat16, generator=gen)
    layers = [(torch.randn(B, Hkv, H // Hkv, D, **bf16), torch.randn(B, Hkv, C, D, **bf16),
               torch.randn(B, Hkv, C, D, **bf16)) for _ in range(shape["layers"])]
    pads = torch.randint(0, C // 4, (B, 1), device=device, generator=gen)
    base = torch.arange(C, device=device)[None, :] >= pads  # left padding: False holes at the start of each row
    return {"layers": layers, "base": base, "mask": base.clone(), "filled": torch.zeros(1, dtype=torch.long,
                                                                                        device=device)}


def set_filled(state: dict, n: int) -> None:
    """Columns written so far = n, in place (the graphs read these tensors): the mask False from column n on."""
    state["filled"].fill_(n)
    cols = torch.arange(state["base"].shape[1], device=state["base"].device)
    state["mask"].copy_(state["base"] & (cols[None, :] < n))


def methods(configs, scale: float) -> dict:
    """name -> fn(q, k, v, state) for one layer."""
    def sdpa(q, k, v, s):  # grouped_attention's call for a one-token step: the whole cache, masked
        return F.scaled_dot_product_attention(q, k, v, attn_mask=s["mask"][:, None, None, :], scale=scale)

    out = {"sdpa": sdpa}
    for name, kwargs in configs:
        out[f"filled:{name}"] = lambda q, k, v, s, kwargs=kwargs: decode_attention.launch(
            q, k, v, s["mask"], s["filled"], scale, **kwargs)
    return out


def error(out, ref) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def replay_ms(g, reps: int) -> float:
    g.replay()  # warm
    return timed_ms(g.replay, torch.device("cuda"), reps)


def measure(fn, state: dict, values, refs: dict, graph: bool, reps: int = 20) -> dict:
    """{filled: {us_per_layer, err_eager, err_graph}} of one method: eager calls first (Triton compiles there), then
    one graph of every layer, replayed for each value with `filled` and the mask advanced in place."""
    layers, rows = state["layers"], {}
    for n in values:
        set_filled(state, n)
        rows[n] = {"err_eager": error(fn(*layers[0], state), refs[n])}
        if not graph:  # --tiny: the wall time of eager calls (the interpreter: a smoke figure, not a speed)
            start = time.perf_counter()
            [fn(*layer, state) for layer in layers]
            rows[n]["us_per_layer"] = (time.perf_counter() - start) * 1e6 / len(layers)
    if not graph:
        return rows
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [fn(*layer, state) for layer in layers]
    for n in values:
        set_filled(state, n)
        rows[n]["us_per_layer"] = replay_ms(g, reps) * 1e3 / len(layers)
        rows[n]["err_graph"] = error(outs[0], refs[n])
    return rows


def sliced(state: dict, values, refs: dict, scale: float, graph: bool) -> dict:
    """SDPA over the first `filled` columns only: one graph per value (a reference point, not a rollout path)."""
    rows = {}
    for n in values:
        set_filled(state, n)
        fn = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
            q, k[:, :, :n], v[:, :, :n], attn_mask=state["mask"][:, None, None, :n], scale=scale)
        rows[n] = {"err_eager": error(fn(*state["layers"][0]), refs[n])}
        if not graph:
            start = time.perf_counter()
            [fn(*layer) for layer in state["layers"]]
            rows[n]["us_per_layer"] = (time.perf_counter() - start) * 1e6 / len(state["layers"])
            continue
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = [fn(*layer) for layer in state["layers"]]
        rows[n]["us_per_layer"] = replay_ms(g, 20) * 1e3 / len(state["layers"])
        rows[n]["err_graph"] = error(outs[0], refs[n])
    return rows


def run_shape(a, name: str, res: dict, t0: float) -> None:
    """Every method at one shape into res["shapes"][name], res written out after each method."""
    shape, graph = SHAPES[name], not a.tiny
    state = build(shape, "cpu" if a.tiny else "cuda")
    scale, values = shape["head_dim"] ** -0.5, shape["filled"]
    refs = {}
    for n in values:
        set_filled(state, n)
        refs[n] = decode_attention.reference(*state["layers"][0], state["mask"], state["filled"], scale)
    bytes_per_column = 2 * shape["batch"] * shape["kv_heads"] * shape["head_dim"] * 2  # K and V, bf16
    rows = res["shapes"].setdefault(name, {"shape": shape, "methods": {}})["methods"]
    fns = methods(TINY_CONFIGS if a.tiny else CONFIGS, scale)
    for method in ["sdpa", "sdpa_sliced", *[m for m in fns if m != "sdpa"]]:
        if method.startswith("filled:") and time.time() - t0 > a.budget_s:
            res["skipped"].append(f"{name}/{method}")
            continue
        try:
            got = (sliced(state, values, refs, scale, graph) if method == "sdpa_sliced"
                   else measure(fns[method], state, values, refs, graph))
            for n, row in got.items():
                row["ok"] = max(row["err_eager"], row.get("err_graph", 0.0)) < 2e-2
                row["gb_per_s"] = n * bytes_per_column / row["us_per_layer"] / 1e3
            rows[method] = {str(n): row for n, row in got.items()}
            print(f"{name:<13} {method:<22}" + "".join(
                f"  f={n}: {row['us_per_layer']:8.1f} us{'' if row['ok'] else ' WRONG'}" for n, row in got.items()),
                flush=True)
        except Exception as e:  # noqa: BLE001 -- recorded, and the other methods still run
            rows[method] = {"error": f"{type(e).__name__}: {e}"[:1000]}
            print(f"{name:<13} {method:<22} FAILED {rows[method]['error'][:200]}", flush=True)
        with open(os.path.join(a.out, "decode_attention.json"), "w") as f:
            json.dump(res, f, indent=1)


def summary(res: dict) -> None:
    """Per shape and filled: sdpa, sdpa_sliced, the default config and the fastest right config."""
    for name, shape in res["shapes"].items():
        m = shape["methods"]
        for n in map(str, shape["shape"]["filled"]):
            right = sorted((r[n]["us_per_layer"], k) for k, r in m.items()
                           if k.startswith("filled:") and "error" not in r and r[n]["ok"])
            base = ", ".join(f"{k} {m[k][n]['us_per_layer']:.1f} us" for k in ("sdpa", "sdpa_sliced", "filled:default")
                             if n in m.get(k, {}))
            best = f"best {right[0][1]} {right[0][0]:.1f} us" if right else "no kernel config right"
            print(f"{name} filled {n}: {base}, {best}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-1.5b", "llama3-8b"], choices=sorted(SHAPES))
    ap.add_argument("--budget-s", type=float, default=300.0, help="no kernel config starts after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="CPU, Triton's interpreter, the tiny shape, no graphs")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.gettempdir(),
                    help="folder for decode_attention.json (default $OUT, else the temp folder, never the worktree)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import (decode_attention imports it on first use)
        a.shapes = ["tiny"]
    elif not torch.cuda.is_available():
        sys.exit("bench/decode_attention.py: no CUDA device; expected a GPU (or --tiny for the CPU check)")
    import triton
    res = {"gpu": "cpu (interpreter)" if a.tiny else torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "commit": a.commit, "tiny": a.tiny, "defaults": decode_attention.DEFAULTS,
           "configs": dict(TINY_CONFIGS if a.tiny else CONFIGS), "shapes": {}, "skipped": []}
    t0 = time.time()
    for name in a.shapes:
        run_shape(a, name, res, t0)
    summary(res)
    wrong = [f"{s}/{k}" for s, v in res["shapes"].items() for k, r in v["methods"].items()
             if "error" in r or not all(row["ok"] for row in r.values())]
    print("wrong or failed:", wrong or "none", "; skipped (budget):", res["skipped"] or "none",
          f"; wall {time.time() - t0:.0f} s;", os.path.join(a.out, "decode_attention.json"))
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
