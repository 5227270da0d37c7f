"""Runs the fused NF4 kernels' cases under Triton's interpreter in a process of its own (TRITON_INTERPRET must be set
before anything imports triton, and in the test session torch.compile imports it first); prints JSON for
tests/hybridcore/test_nf4.py to judge. Importing this module (the test does, for CASES) imports neither triton nor
bitsandbytes and sets nothing: main() does."""
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.nf4_decode import CONFIGS  # noqa: E402  (torch and hybridcore.nf4 only; triton on first kernel use)

N, K = 37, 192  # odd N: partial tiles of every block_n; K: 3 quantisation blocks, not a multiple of 128 or 256
BATCHES = (1, 3, 8, 16, 64)
SPEED_ONLY = ("num_warps", "num_stages")  # no effect under the interpreter
# (config, batch) run on an fp32 absmax too
PLAIN = (("auto", 1), ("auto", 8), ("gemv", 8), ("dot", 16), ("scaled_dot", 8), ("pair_dot", 8), ("nibble_dot", 16),
         ("pair_dot2", 8), ("nibble_dot2", 3))
# (kernel, rows, LoRA rank, x's dtype, split_k) with a LoRA delta: in the LUT kernels (a rank padded to 16, one of
# 16, split and not) and added after the others
LORA = (("nibble_dot", 8, 16, "float32", "auto"), ("nibble_dot", 3, 5, "bfloat16", 1),
        ("pair_dot", 16, 8, "bfloat16", 2), ("pair_dot", 8, 32, "float32", "auto"), ("scaled_dot", 8, 16, "float32", "auto"),
        ("gemv", 2, 8, "bfloat16", "auto"), ("nibble_dot2", 8, 16, "float32", 2), ("pair_dot2", 3, 8, "bfloat16", "auto"))


def _distinct() -> dict:
    """bench/nf4_decode.py's configs, one per distinct set of arguments the interpreter can tell apart: name ->
    (arguments, the largest batch the bench times it at)."""
    seen = {}
    for name, kwargs, batches in CONFIGS:
        key = tuple(sorted((k, v) for k, v in kwargs.items() if k not in SPEED_ONLY))
        seen.setdefault(key, (name, ({k: v for k, v in kwargs.items() if k not in SPEED_ONLY}, max(batches))))
    return dict(seen.values())


KERNEL_CONFIGS = {name: kwargs for name, (kwargs, _) in _distinct().items()}
# every config at every batch up to the largest it is timed at (gemv's 16 rows take two programs of 8); x's dtype
# alternates so that each config and each batch sees fp32 and bf16
CASES = [(name, m, "bfloat16" if (i + j) % 2 else "float32")
         for i, (name, (_, top)) in enumerate(_distinct().items()) for j, m in enumerate(BATCHES) if m <= top]


def weight(n: int, k: int, seed: int, nested: bool = True):
    """Random NF4 weight as bitsandbytes quantises it: (NF4Weight, bitsandbytes' own fp32 dequantisation)."""
    import bitsandbytes.functional as bnbf
    import torch
    from hybridcore import nf4

    class Packed:  # what NF4Weight.from_bnb reads of a Params4bit
        data, quant_state = bnbf.quantize_4bit(
            torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, blocksize=64, quant_type="nf4",
            compress_statistics=nested)
    return nf4.NF4Weight.from_bnb(Packed), bnbf.dequantize_4bit(Packed.data, Packed.quant_state)


def errors_of_bad_calls(nf4, torch) -> dict:
    """The ValueError message of each call matmul must refuse."""
    w, _ = weight(64, 128, seed=3)
    odd_k = dataclasses.replace(w, packed=w.packed[: 64 * 48], shape=(64, 96))
    x = torch.randn(2, 128)
    calls = {"features": lambda: nf4.matmul(torch.randn(2, 64), w),
             "whole_blocks": lambda: nf4.matmul(x[:, :96], odd_k),
             "block_k": lambda: nf4.matmul(x, w, block_k=96), "kernel": lambda: nf4.matmul(x, w, kernel="mma"),
             "dot_block_n": lambda: nf4.matmul(x, w, kernel="dot", block_n=8),
             "reduce": lambda: nf4.matmul(x, w, split_k=2, reduce="tree"),
             "lookup": lambda: nf4.matmul(x, w, lookup="gather"), "split_k": lambda: nf4.matmul(x, w, split_k=0),
             "dtype": lambda: nf4.matmul(x.to(torch.int32), w), "vec": lambda: nf4.matmul(x, w, kernel="gemv", vec=32),
             "lut_lookup": lambda: nf4.matmul(x, w, kernel="pair_dot", lookup="select"),
             "lora_b": lambda: nf4.matmul(x, w, lora=(torch.zeros(2, 8), torch.zeros(8, 64), torch.ones(1))),
             "lora_u": lambda: nf4.matmul(x, w, lora=(torch.zeros(3, 8), torch.zeros(64, 8), torch.ones(1))),
             "lora_scale": lambda: nf4.matmul(x, w, lora=(torch.zeros(2, 8), torch.zeros(64, 8), torch.ones(2)))}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = ""
        except ValueError as e:
            out[name] = str(e)
    return out


def lora_errors(nf4, torch, w, want) -> dict:
    """Relative error of matmul with `lora` against x @ W^T + (x @ A^T @ B^T) * scale in fp32, per LORA case."""
    out = {}
    for kernel, m, r, dtype, split in LORA:
        g = torch.Generator().manual_seed(300 + m + r)
        x = torch.randn(m, K, generator=g).to(getattr(torch, dtype))
        a, b = torch.randn(r, K, generator=g) * 0.1, torch.randn(N, r, generator=g)
        u, scale = x.float() @ a.T, torch.tensor([2.0 / r])
        ref = x.float() @ want.T + (u @ b.T) * scale
        got = nf4.matmul(x, w, kernel=kernel, split_k=split, lora=(u, b, scale))
        ok = got.shape == (m, N) and got.dtype == x.dtype
        out[f"{kernel}-{m}-r{r}-{dtype}-split{split}"] = (
            float((got.float() - ref).abs().max() / ref.abs().max()) if ok else -1.0)
    return out


def split_errors(nf4, torch) -> dict:
    """Relative error of every kernel with K (10 quantisation blocks) split 5 and 10 ways: more splits than one turn
    of the serial reduction's unrolled loads (4), the last turn not full."""
    w, want = weight(N, 10 * 64, seed=6)
    x = torch.randn(8, 10 * 64, generator=torch.Generator().manual_seed(7))
    ref = x @ want.T
    out = {}
    for kernel in ("gemv", "dot", "scaled_dot", "pair_dot", "nibble_dot", "pair_dot2", "nibble_dot2"):
        for split in (5, 10):
            got = nf4.matmul(x, w, block_k=64, split_k=split, kernel=kernel)
            out[f"{kernel}-split{split}"] = float((got - ref).abs().max() / ref.abs().max())
    return out


# (kernel, rows, each member's output rows, double-quantised absmax, LoRA rank or 0, x's dtype, split_k):
# group_matmul in one launch (three or two members; the last one's rows a partial tile; block_n shrunk to 32 to
# divide 64 and 32; K of 6 quantisation blocks, split in two where asked) or, where it cannot, one launch a member
# (a dot kernel; 37 rows: no whole tiles of 16)
GROUPS = (("nibble_dot", 8, (64, 32, 48), True, 8, "float32", "auto"), ("nibble_dot", 3, (64, 64, 64), True, 16,
          "bfloat16", 2), ("pair_dot", 16, (128, 96), False, 0, "float32", 2), ("nibble_dot", 8, (32, 40), False, 5,
          "float32", 1), ("dot", 32, (64, 32, 48), True, 8, "float32", "auto"), ("nibble_dot", 8, (37, 64), True, 8,
          "float32", "auto"), ("pair_dot2", 8, (64, 32, 48), True, 8, "bfloat16", 2))


def group_errors(nf4, torch) -> dict:
    """For each GROUPS case: (relative error of group_matmul against the members' dequantised weights and LoRA deltas
    side by side, kernel launches it made)."""
    launches, kernel_of = [], nf4._kernel

    def launch(self, grid):
        launches.append(grid)
        return self.fn[grid]
    # named as the interpreter's kernels are: matmul tells them by their type's name (UPCAST for bf16 dots)
    counted = type("InterpretedFunction", (), {"__init__": lambda self, fn: setattr(self, "fn", fn),
                                               "__getitem__": launch})
    nf4._kernel = lambda name: counted(kernel_of(name))
    out = {}
    try:
        for i, (kernel, m, rows, nested, r, dtype, split) in enumerate(GROUPS):
            g = torch.Generator().manual_seed(300 + i)
            members = [weight(n, 384, seed=40 + i * 3 + j, nested=nested) for j, n in enumerate(rows)]
            x = torch.randn(m, 384, generator=g).to(getattr(torch, dtype))
            ref = x.float() @ torch.cat([want for _, want in members]).T
            loras = None
            if r:
                u = torch.randn(m, r * len(rows), generator=g).to(x.dtype)  # one product for all, sliced
                loras = [(u[:, j * r:(j + 1) * r], torch.randn(n, r, generator=g).to(x.dtype),
                          torch.tensor([0.5 + j], dtype=torch.float32)) for j, n in enumerate(rows)]
                ref += torch.cat([(lu.float() @ b.float().T) * s for lu, b, s in loras], dim=1)
            launches.clear()
            got = nf4.group_matmul(x, [w for w, _ in members], kernel=kernel, split_k=split, loras=loras)
            ok = got.shape == (m, sum(rows)) and got.dtype == x.dtype
            out[str(i)] = (float((got.float() - ref).abs().max() / ref.abs().max()) if ok else -1, len(launches))
    finally:
        nf4._kernel = kernel_of
    return out


def main() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from hybridcore import nf4

    out = {"dequant_equal": {}, "matmul_err": {}, "plain_err": {}}
    for nested in (True, False):
        w, want = weight(96, 192, seed=0, nested=nested)
        out["dequant_equal"][str(nested)] = bool(torch.equal(w.dequantize(), want))
        key, kept = ("absmax_uint8", torch.uint8) if nested else ("absmax_float32", torch.float32)
        out[key] = w.absmax.dtype == kept
    w, want = weight(N, K, seed=1)
    out["dequant_equal"]["cases"] = bool(torch.equal(w.dequantize(), want))
    exact = w.dequantize()
    for name, m, dtype in CASES:
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(100 + m)).to(getattr(torch, dtype))
        got, ref = nf4.matmul(x, w, **KERNEL_CONFIGS[name]), x.float() @ exact.T
        ok = got.shape == (m, N) and got.dtype == x.dtype
        err = float((got.float() - ref).abs().max() / ref.abs().max())
        out["matmul_err"][f"{name}-{m}-{dtype}"] = err if ok else -1
    w, want = weight(N, K, seed=5, nested=False)  # an fp32 absmax (no double quantisation): the kernels' other path
    for name, m in PLAIN:
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(200 + m))
        out["plain_err"][f"{name}-{m}"] = float((nf4.matmul(x, w, **KERNEL_CONFIGS[name]) - x @ want.T).abs().max()
                                                / (x @ want.T).abs().max())
    out["lora_err"] = lora_errors(nf4, torch, w, want)
    out["split_err"] = split_errors(nf4, torch)
    out["group"] = group_errors(nf4, torch)
    out["counters_zero"] = all(int(c.abs().sum()) == 0 for c in nf4._COUNTERS.values()) and bool(nf4._COUNTERS)
    w, whole = weight(64, 128, seed=3)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(4))
    out["leading_err"] = float((nf4.matmul(x, w) - x @ whole.T).abs().max())
    out["bad_calls"] = errors_of_bad_calls(nf4, torch)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
