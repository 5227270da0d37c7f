"""GPU: one decode step's 4-bit linears at the Llama-3-8B shape, the fused NF4 kernels (hybridcore/nf4.py) in a spread
of configurations against bitsandbytes' matmul_4bit (today's rollout path) and bf16 dense, in one run.

The 7 decoder linears x 32 layers (random weights, NF4 with double quantisation as the pipeline loads them), each
method's 224 matmuls captured in one CUDA graph and replayed, so Python and the CPU's launch cost are out of the
comparison (each kernel's start on the GPU stays in every figure). Every (method, batch) is checked: the first
layer's 7 outputs, as the graph left them after the timed replays (a race in the split-K reduction would show), and
as one eager call gave them, against x @ dequantised(W)^T in fp32 (max |error| relative to the max |reference|;
bf16 dense multiplies the weights before quantisation, so its "error" is the quantisation's).
LORA_ROWS: the same linears with a LoRA adapter each (rank --lora-rank, fp32 A and B as peft keeps them), the
delta added as peft adds it (A and B products in fp32, the sum rounded, then added) after bitsandbytes or after
`auto`, and in the kernel's epilogue (nf4.matmul's `lora`) with u = x @ A^T and B in x's dtype (copies: what
hybridcore/fused_decode.py does) or in fp32 (`_fp32`: what it did until 2026-12-07); their reference
includes the delta. GROUPED: the linears that take one input (q/k/v, gate/up) in one nf4.group_matmul launch, as
the rollout runs them, with and without the LoRA epilogue (its A products one a group). CONFIGS: named nf4.matmul arguments and the batches each is timed at; a config that would
start after --budget-s is skipped and listed as such (the baselines and LoRA rows always run), one that fails is a
row with its error. Needs torch, triton and the bitsandbytes wheel
(carried). Writes nf4_decode.json into --out (default $OUT, else the system's temp folder), again after every row.
    python3 bench/nf4_decode.py [--batches 1 8 16 64] [--layers 32] [--lora-rank 16] [--budget-s 200] [--out DIR]
    python bench/nf4_decode.py --tiny   # CPU: Triton's interpreter, toy shapes, no graphs -- the script's own check
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.decode_profile import timed_ms  # noqa: E402
from hybridcore import nf4  # noqa: E402

HIDDEN, INTER, KV = 4096, 14336, 1024  # Llama-3-8B
SHAPES = {"q": (HIDDEN, HIDDEN), "k": (KV, HIDDEN), "v": (KV, HIDDEN), "o": (HIDDEN, HIDDEN),
          "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
TINY = {"q": (80, 128), "k": (16, 128), "v": (16, 128), "o": (128, 128), "gate": (48, 128), "up": (45, 128),
        "down": (128, 320)}  # --tiny: N of whole tiles of 16 where a group needs them, odd N, a K (320) not a
# multiple of 128 or 256
# (name, nf4.matmul arguments, batches), most telling first (a tight --budget-s drops the tail): unset arguments
# are nf4.DEFAULTS[kernel] (gemv 128 rows x 64 columns a step, 4 warps, no pipelining; dot 64 x 256, 4 warps,
# no pipelining), split_k "auto", reduce "serial", lookup "table", block_m the batch (gemv at most 8 rows a program,
# dot 16 to 64) and vec 16 bytes (8 past 4 rows of x). Configs that spill registers when compiled for sm_90
# (gemv with 256 columns a step, 2 rows a thread at 8 rows of x) are left out.
CONFIGS = [
    ("auto", {}, (1, 8, 16, 64)),  # what the rollout would get: kernel by batch (nf4.GEMV_MAX_M), all defaults
    ("scaled_dot", dict(kernel="scaled_dot"), (8, 16, 64)),  # one MMA per 256 columns, levels scaled before it
    # hybridcore/nf4_lut.py: levels looked up in shared memory (a 256-entry pair table / the 16-entry code), one MMA
    # per quantisation block scaled after it, the next block's loads issued a step ahead; untimed until these rows
    ("pair_dot", dict(kernel="pair_dot"), (8, 16, 64)),
    ("nibble_dot", dict(kernel="nibble_dot"), (8, 16, 64)),
    ("nibble_dot_w8", dict(kernel="nibble_dot", num_warps=8), (8,)),  # 128 rows on 8 warps: half the registers
    # two quantisation blocks a step, the levels scaled in fp32 before one MMA (untimed yet; bench/nf4_ptx.py: a
    # third fewer barriers a byte, twice the instructions; 64 rows a program keep 128 registers for pair_dot2)
    ("pair_dot2", dict(kernel="pair_dot2"), (8, 16)),
    ("nibble_dot2", dict(kernel="nibble_dot2"), (8,)),
    ("pair_dot2_n128", dict(kernel="pair_dot2", block_n=128), (8,)),
    ("pair_dot_n256_w8", dict(kernel="pair_dot", block_n=256, num_warps=8), (8, 16)),
    ("nibble_dot_n256_w8", dict(kernel="nibble_dot", block_n=256, num_warps=8), (8, 16)),
    ("pair_dot_n64", dict(kernel="pair_dot", block_n=64), (8, 16)),
    ("nibble_dot_n64", dict(kernel="nibble_dot", block_n=64), (8, 16)),
    ("pair_dot_k64", dict(kernel="pair_dot", block_k=64), (8, 16)),  # 4x the splits of K (k, v: 64 of one step)
    ("nibble_dot_k64", dict(kernel="nibble_dot", block_k=64), (8, 16)),
    ("pair_dot_split1", dict(kernel="pair_dot", split_k=1), (8,)),  # no partial sums, 32-112 programs a linear
    ("pair_dot_s2", dict(kernel="pair_dot", num_stages=2), (8,)),  # Triton's pipelining on top of the prefetch
    ("scaled_dot_n128", dict(kernel="scaled_dot", block_n=128), (8, 16)),
    ("scaled_dot_n32", dict(kernel="scaled_dot", block_n=32), (8, 16)),
    ("scaled_dot_k128", dict(kernel="scaled_dot", block_k=128), (8, 16)),
    ("scaled_dot_k512", dict(kernel="scaled_dot", block_k=512), (8, 16)),
    ("scaled_dot_s3", dict(kernel="scaled_dot", num_stages=3), (8, 16)),
    ("scaled_dot_w8", dict(kernel="scaled_dot", block_n=128, num_warps=8), (8, 16)),
    ("scaled_dot_split1", dict(kernel="scaled_dot", split_k=1), (8,)),
    ("gemv", dict(kernel="gemv"), (1, 8, 16)),
    ("dot", dict(kernel="dot"), (1, 8, 16, 64)),
    ("dot_k128_s3", dict(kernel="dot", block_k=128, num_stages=3), (8, 16, 64)),  # the defaults before 2026-12-06
    ("dot_k128_s1", dict(kernel="dot", block_k=128, num_stages=1), (1, 8, 64)),  # fewer bytes in flight a program
    ("gemv_k128", dict(kernel="gemv", block_k=128), (1, 8)),  # more bytes in flight a program
    ("gemv_n256", dict(kernel="gemv", block_n=256), (1,)),  # 2 rows a thread: each x converted for two
    ("gemv_split1", dict(kernel="gemv", split_k=1), (1, 8)),
    ("dot_split1", dict(kernel="dot", split_k=1), (8, 64)),
    ("gemv_split4", dict(kernel="gemv", split_k=4), (1,)),  # auto: 4 programs an SM (16 splits of q at batch 1)
    ("dot_split4", dict(kernel="dot", split_k=4), (8,)),
    ("gemv_atomic", dict(kernel="gemv", reduce="atomic"), (1, 8)),  # + a memset and a cast a linear
    ("dot_atomic", dict(kernel="dot", reduce="atomic"), (8, 64)),
    ("dot_n128_w8", dict(kernel="dot", block_n=128, num_warps=8), (8, 64)),
    ("dot_n128_s1", dict(kernel="dot", block_n=128, num_stages=1), (8,)),
    ("dot_n32_s1", dict(kernel="dot", block_n=32, num_stages=1), (8, 64)),  # mma.sync instead of wgmma
    ("dot_k256_s3", dict(kernel="dot", num_stages=3), (8, 64)),
    ("dot_k64_s4", dict(kernel="dot", block_k=64, num_stages=4), (8, 64)),
    ("dot_k512", dict(kernel="dot", block_k=512), (8, 16)),
    ("gemv_n64_w2", dict(kernel="gemv", block_n=64, num_warps=2), (1, 8)),
    ("gemv_n256_w8", dict(kernel="gemv", block_n=256, num_warps=8), (1,)),
    ("gemv_vec8", dict(kernel="gemv", vec=8), (1,)),
    ("gemv_m4", dict(kernel="gemv", block_m=4), (8,)),  # 2 programs a tile of W at batch 8, 16-byte vectors
    ("gemv_select", dict(kernel="gemv", lookup="select"), (1,)),  # ~20 selects an element instead of a load
    ("dot_select", dict(kernel="dot", lookup="select"), (8,)),
    ("dot_s2", dict(kernel="dot", num_stages=2), (8,)),
    ("dot_n16_w1", dict(kernel="dot", block_n=16, num_warps=1), (8,)),
    ("dot_m16", dict(kernel="dot", block_m=16), (64,)),  # 4 programs a tile of W, each reading it
    ("dot_m32", dict(kernel="dot", block_m=32), (64,)),
]


LORA_ROWS = ("bnb+lora_peft", "auto+lora_peft", "auto+lora_epilogue", "auto+lora_epilogue_fp32",
             "grouped+lora_epilogue", "grouped_pair+lora_epilogue", "grouped_pair2+lora_epilogue")  # at 8 and 16 rows
# rows whose linears that take one input run as one nf4.group_matmul (hybridcore/fused_decode.py's PACKED): q/k/v,
# o, gate/up, down, 4 launches a layer instead of 7; with LoRA, u = x @ A^T one product a group (its SharedInput)
# name -> (with LoRA, the kernel: None is the batch's default, nibble_dot at 8-16 rows)
GROUPED = {"grouped": (False, None), "grouped+lora_epilogue": (True, None), "grouped_pair": (False, "pair_dot"),
           "grouped_pair+lora_epilogue": (True, "pair_dot"), "grouped_pair2": (False, "pair_dot2"),
           "grouped_pair2+lora_epilogue": (True, "pair_dot2")}
GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))


def grouped_step(weights: list, lora: bool, kernel: str | None = None):
    """xs (by width) -> the outputs of `weights` (layer after layer in SHAPES order) as GROUPED rows compute them:
    one group_matmul a group, its output sliced back into the members' (views)."""
    groups = []
    for start in range(0, len(weights), len(SHAPES)):
        layer = {w["name"]: w for w in weights[start:start + len(SHAPES)]}
        groups += [[layer[name] for name in names] for names in GROUPS]
    stacks = [torch.cat([w["lora_a_x"] for w in members]) for members in groups]

    def step(xs: dict) -> list:
        outs = []
        for members, stack in zip(groups, stacks):
            x, loras = xs[members[0]["nf4"].shape[1]], None
            if lora:
                u, r = torch.nn.functional.linear(x, stack), members[0]["lora_a_x"].shape[0]
                loras = [(u[:, i * r:(i + 1) * r], w["lora_b_x"], w["scale"]) for i, w in enumerate(members)]
            y = nf4.group_matmul(x, [w["nf4"] for w in members], kernel=kernel, loras=loras)
            outs += list(y.split([w["nf4"].shape[0] for w in members], dim=-1))
        return outs
    return step


def build(layers: int, shapes: dict, device: str, rank: int = 16):
    import bitsandbytes.functional as bnbf

    weights = []
    for layer in range(layers):
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True,
                                               quant_storage=torch.uint8)

            class P:  # what NF4Weight.from_bnb reads of a Params4bit
                data, quant_state = packed, state
            q = nf4.NF4Weight.from_bnb(P)
            lora = {"lora_a": torch.randn(rank, k, device=device) / k ** 0.5, "lora_b": torch.randn(n, rank,
                                                                                                    device=device) * 0.02,
                    "scale": torch.tensor([2.0], device=device)}  # alpha / rank = 2: peft's scaling of the pipeline's
            lora.update(lora_a_x=lora["lora_a"].to(w.dtype), lora_b_x=lora["lora_b"].to(w.dtype))  # x's dtype
            weights.append({"name": name, "dense": w, "packed": packed, "state": state, "nf4": q,
                            "exact": q.dequantize() if layer == 0 else None, **lora})  # exact: the fp32 reference
    return weights


def methods(configs) -> dict:
    import bitsandbytes as bnb
    out = {"bnb": lambda x, w: bnb.matmul_4bit(x, w["packed"].t(), quant_state=w["state"]),
           "bf16": lambda x, w: x @ w["dense"].t()}
    for name, kwargs, _ in configs:
        out[name] = lambda x, w, kwargs=kwargs: nf4.matmul(x, w["nf4"], **kwargs)
    out["bnb+lora_peft"] = lambda x, w: out["bnb"](x, w) + peft_delta(x, w)
    out["auto+lora_peft"] = lambda x, w: nf4.matmul(x, w["nf4"]) + peft_delta(x, w)
    out["auto+lora_epilogue"] = lambda x, w: nf4.matmul(
        x, w["nf4"], lora=(torch.nn.functional.linear(x, w["lora_a_x"]), w["lora_b_x"], w["scale"]))
    out["auto+lora_epilogue_fp32"] = lambda x, w: nf4.matmul(
        x, w["nf4"], lora=(torch.nn.functional.linear(x.float(), w["lora_a"]), w["lora_b"], w["scale"]))
    return out


def peft_delta(x, w):
    """A LoRA adapter's delta as peft adds it to a bf16 result: x cast to the adapter's fp32, two products, the
    scaling, rounded back to x's dtype."""
    f = torch.nn.functional.linear
    return (f(f(x.float(), w["lora_a"]), w["lora_b"]) * w["scale"]).to(x.dtype)


def errors(outs, xs, weights, lora: bool = False) -> float:
    """Max over the first layer of max |out - ref| / max |ref|, ref = x @ W^T with W dequantised in fp32 (lora: plus
    (x @ A^T @ B^T) * scale in fp32)."""
    worst = 0.0
    for out, w in zip(outs, weights):
        x = xs[w["nf4"].shape[1]].float()
        ref = x @ w["exact"].t() + ((x @ w["lora_a"].t() @ w["lora_b"].t()) * w["scale"] if lora else 0.0)
        worst = max(worst, float((out.float() - ref).abs().max() / ref.abs().max()))
    return worst


def measure(fn, weights, batch: int, graph: bool, reps: int = 20, lora: bool = False, check: int = 7,
            step=None) -> dict:
    """ms of one decode step (every linear once, each fed an input of its width: fn(x, weight), or step(xs by
    width) -> every output) and the errors of the first `check` (the first layer's linears: those with an fp32
    reference)."""
    gen = torch.Generator(device=weights[0]["dense"].device).manual_seed(batch)
    widths = {w["nf4"].shape[1] for w in weights}
    xs = {k: torch.randn(batch, k, device=gen.device, dtype=torch.bfloat16, generator=gen) for k in sorted(widths)}
    step = step or (lambda xs: [fn(xs[w["nf4"].shape[1]], w) for w in weights])
    eager = step(xs)  # also the warm-up: Triton compiles, bnb allocates
    res = {"err_eager": errors(eager[:check], xs, weights, lora)}
    if not graph:  # --tiny: wall clock of eager calls (the interpreter: a smoke figure, not a speed)
        start = time.perf_counter()
        step(xs)
        return {**res, "ms": (time.perf_counter() - start) * 1e3}
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step(xs)
    g.replay()  # warm
    return {**res, "ms": timed_ms(g.replay, torch.device("cuda"), reps),
            "err_graph": errors(outs[:check], xs, weights, lora)}


def run(a, weights, res: dict, graph: bool) -> None:
    """Every method at its batches into res["steps"][batch][name], res written out after each (a crash keeps the
    rows before it). A config that fails to compile or run is a row with its error, not the end of the run."""
    t0, fns, path = time.time(), methods(CONFIGS), os.path.join(a.out, "nf4_decode.json")
    todo = [(b, name) for b in a.batches for name in ("bnb", "bf16")]
    todo += [(b, name) for b in a.batches if b in (8, 16) and a.lora_rank for name in LORA_ROWS]
    todo += [(b, name) for b in a.batches if b in (8, 16) for name in ("grouped", "grouped_pair", "grouped_pair2")]
    todo += [(b, name) for name, _, batches in CONFIGS for b in batches if b in a.batches]
    for b, name in todo:
        if name not in ("bnb", "bf16", *LORA_ROWS, *GROUPED) and time.time() - t0 > a.budget_s:
            res["skipped"].append(f"{name}@{b}")
            continue
        try:
            step = grouped_step(weights, *GROUPED[name]) if name in GROUPED else None
            row = measure(fns.get(name), weights, b, graph, lora=name in LORA_ROWS, step=step)
            row["ok"] = name == "bf16" or max(row["err_eager"], row.get("err_graph", 0.0)) < 0.02
            row["gb_per_s"] = res["int4_bytes"] / row["ms"] / 1e6  # NF4 bytes (+ absmax) over the step's time
            print(f"batch {b:>3} {name:<14} {row['ms']:9.3f} ms  err {row['err_eager']:.4f}"
                  f"{'' if row['ok'] else '  WRONG'}", flush=True)
        except Exception as e:  # noqa: BLE001 -- recorded, and the other configs still run
            row = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1000]}
            print(f"batch {b:>3} {name:<14} FAILED {row['error'][:200]}", flush=True)
        res["steps"].setdefault(str(b), {})[name] = row
        save(res, path, t0)
    save(res, path, t0)  # the skipped configs too


def int4_bytes(weights) -> int:
    """What a decode step reads of these 4-bit weights: the packed bytes and their absmax."""
    return sum(w["packed"].numel() + w["nf4"].absmax.nbytes for w in weights)


PER_PROJECTION = ("bf16", "auto", "auto+lora_epilogue")


def per_projection(a, weights, res: dict, graph: bool, batch: int = 8) -> None:
    """Each projection's linears alone (one per layer) in a graph, for PER_PROJECTION at `batch` rows: ms, us a call
    and GB/s of its 4-bit bytes. Where a call's time hardly follows its bytes (k and v read a quarter of q's), the
    fixed cost of a launch (ramp-up, the split reduction's tail) is what to cut, not the bandwidth of its loop."""
    fns, out = methods(CONFIGS), {}
    for method in PER_PROJECTION:
        out[method] = {}
        for proj in dict.fromkeys(w["name"] for w in weights):
            mine = [w for w in weights if w["name"] == proj]
            row = measure(fns[method], mine, batch, graph, lora=method in LORA_ROWS, check=1)
            nbytes = int4_bytes(mine)
            out[method][proj] = {"ms": row["ms"], "us_per_call": 1e3 * row["ms"] / len(mine),
                                 "gb_per_s_4bit": nbytes / row["ms"] / 1e6, "err": row["err_eager"]}
            print(f"batch {batch} {method:<20} {proj:<5} {out[method][proj]['us_per_call']:8.2f} us a call, "
                  f"{out[method][proj]['gb_per_s_4bit']:7.1f} GB/s of 4-bit bytes", flush=True)
    res["per_projection"] = {"batch": batch, **out}


def save(res: dict, path: str, t0: float) -> None:
    res["loop_s"] = time.time() - t0
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 64])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--lora-rank", type=int, default=16, help="rank of the LORA_ROWS' adapters (0: no such rows)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="no config starts after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="CPU, Triton's interpreter, toy shapes, one layer")
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.gettempdir(),
                    help="folder for nf4_decode.json (default $OUT, else the temp folder: never the working tree)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import (nf4 imports it on first use)
        a.layers = 1
    t0 = time.time()
    weights = build(a.layers, TINY if a.tiny else SHAPES, "cpu" if a.tiny else "cuda", max(a.lora_rank, 1))
    import triton
    res = {"gpu": "cpu (interpreter)" if a.tiny else torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "layers": a.layers, "tiny": a.tiny,
           "int4_bytes": int4_bytes(weights),
           "defaults": {"GEMV_MAX_M": nf4.GEMV_MAX_M, "DEFAULTS": nf4.DEFAULTS, "SPLIT_TARGET": nf4.SPLIT_TARGET},
           "configs": {name: {"kwargs": kwargs, "batches": list(batches)} for name, kwargs, batches in CONFIGS},
           "lora_rows": list(LORA_ROWS) if a.lora_rank else [], "lora_rank": a.lora_rank,
           "steps": {}, "skipped": []}
    run(a, weights, res, graph=not a.tiny)
    if 8 in a.batches:
        per_projection(a, weights, res, graph=not a.tiny)
        save(res, os.path.join(a.out, "nf4_decode.json"), t0)
    for b, row in res["steps"].items():
        right = sorted((v["ms"], k) for k, v in row.items() if k not in ("bnb", "bf16", *LORA_ROWS) and v["ok"])
        best = f"best fused {right[0][1]} {right[0][0]:.3f} ms" if right else "no fused config right"
        base = ", ".join(f"{k} {row[k]['ms']:.3f} ms" for k in ("bnb", "bf16") if "ms" in row.get(k, {}))
        lora = ", ".join(f"{k} {row[k]['ms']:.3f} ms" for k in LORA_ROWS if "ms" in row.get(k, {}))
        print(f"batch {b}: {base}, {best}" + (f"; with LoRA: {lora}" if lora else ""))
    print("skipped (budget):", res["skipped"] or "none", f"; wall {time.time() - t0:.0f} s;",
          os.path.join(a.out, "nf4_decode.json"))


if __name__ == "__main__":
    main()
