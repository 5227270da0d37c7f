"""The LoRA A products of one 8B decode step (u = x @ A^T, batch 8, rank 16) in one CUDA graph: fp32 (peft's dtype)
against bf16, one product a projection (224) against products grouped by shared input (q/k/v as one [48, K], gate/up
as one [32, K]: 128). Torch only.

    python3 bench/lora_a.py            # CUDA; prints milliseconds per step for the four variants

The figures of bench/RESULTS.md 2026-12-07 07:40 came from this code run inline (`python3 -` in the device call).
"""
import torch
import torch.nn.functional as F

LAYERS, ROWS, RANK, HIDDEN, FFN = 32, 8, 16, 4096, 14336
PER_PROJECTION = [(RANK, HIDDEN)] * 6 + [(RANK, FFN)]  # q k v o gate up down
GROUPED = [(3 * RANK, HIDDEN), (RANK, HIDDEN), (2 * RANK, HIDDEN), (RANK, FFN)]  # qkv, o, gate+up, down


def graph_ms(ops, reps: int = 20) -> float:
    """Milliseconds per replay of one CUDA graph of `ops`, after two warm-up calls on a side stream."""
    g, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            [f() for f in ops]
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        [f() for f in ops]
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def products(shapes, dtype) -> list:
    xs = {k: torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, FFN)}
    ops = []
    for _ in range(LAYERS):
        for r, k in shapes:
            a = torch.randn(r, k, device="cuda", dtype=dtype)
            ops.append(lambda a=a, x=xs[k]: F.linear(x.to(a.dtype), a))
    return ops


def main() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for name, shapes in (("per projection", PER_PROJECTION), ("grouped", GROUPED)):
            print(f"{name:15s} {str(dtype):15s} {graph_ms(products(shapes, dtype)):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
