"""Where a native decode step spends its time: kernel time by kind, kernels per step, and graph replay time.

Used by bench/rollout.py on the GPU before any figure is trusted: the sum of kernel times against the time of
a graph replay separates launch gaps from kernel work, and the kinds (matrix products, attention over the
cache, inductor's fused kernels, sampling, copies, other elementwise) say which lever is worth pulling.
On CPU (`--tiny`) the same code groups CPU operator time, so the path is exercised in seconds.
"""
from __future__ import annotations

import re
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

KINDS = [  # first match wins
    ("sampling", r"argmax|multinomial|topk|sort|cumsum|softmax|exponential"),
    ("nf4 (fused decode)", r"^nf4_"),
    ("dequantize (bitsandbytes)", r"kDequantize|dequantize"),
    ("attention", r"fmha|attention|flash|efficient|scaled_dot"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|cublas|splitk|aten::mm|aten::addmm|aten::bmm|aten::linear"),
    ("inductor fused (triton)", r"^triton_|cpp_fused"),
    ("copy/index", r"copy|index|scatter|gather|fill|cat"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other elementwise"


def _kernels(prof, cuda: bool) -> list[tuple[str, float]]:
    """(name, microseconds) of every device kernel; on CPU, of every top-level operator (inclusive time)."""
    events = prof.events()
    if not cuda:
        return [(e.name, e.cpu_time_total) for e in events if e.cpu_parent is None]
    out = [(e.name, e.time_range.elapsed_us()) for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    if not out:  # older layouts attach kernels to the CPU operators only
        out = [(k.name, k.duration) for e in events for k in getattr(e, "kernels", [])]
    return out


def breakdown(fn, device, repeats: int) -> dict:
    """Profile `fn` (which runs `repeats` units of work) and return per-unit kernel time by kind."""
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    kernels = _kernels(prof, cuda)
    by_kind, by_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for name, us in kernels:
        by_kind[kind_of(name)] += us / repeats
        by_name[name[:140]] += us / repeats
        count[kind_of(name)] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {"total_ms": sum(by_kind.values()) / 1e3, "kernels_per_unit": len(kernels) / repeats,
            "ms_by_kind": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "kernels_by_kind": {k: n / repeats for k, n in count.items()},
            "top_kernels_ms": [(n, us / 1e3) for n, us in top]}


def timed_ms(fn, device, repeats: int) -> float:
    """Milliseconds per call of fn over `repeats` calls: CUDA events on a GPU, perf_counter on CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) * 1e3 / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def profile_decoder(rollout, ids, mask, pad_id: int, new_tokens: int, steps: int) -> dict:
    """One decoder (the rollout's, after a generate of the benchmark's length, so its capacity and hence its
    compiled step are the benchmark's own): the kernels of `steps` eager steps from just after the prefill,
    their wall time, and, on CUDA, the time of a replay of the same step as a graph."""
    device, P = ids.device, ids.shape[1]
    rollout.generate(ids, mask, new_tokens, eos_id=None, pad_id=pad_id, greedy=True)
    d = rollout._decoder

    def after_prefill():
        d.reset()
        d.mask[:, :P] = mask.bool()
        d.column.fill_(P)
        d.positions.copy_(mask.sum(1, keepdim=True))

    def steps_fn():
        for _ in range(steps):
            d.step()
    after_prefill()
    report = {"compiled": d.compiled, "compile_error": d.compile_error, "capacity": d.capacity,
              "kernels": breakdown(steps_fn, device, steps)}
    after_prefill()
    report["eager_step_ms"] = timed_ms(d.step, device, steps)
    if device.type == "cuda":
        d._capture()
        after_prefill()
        report["graph_step_ms"] = timed_ms(d.step, device, 2 * steps)
    return report


def profile_prefill(rollout, ids, mask, pad_id: int) -> dict:
    """Kernels of the prefill (a generate of one token: prefill and one argmax), after a warm-up call."""
    gen = lambda: rollout.generate(ids, mask, 1, eos_id=None, pad_id=pad_id, greedy=True)  # noqa: E731
    gen()
    return {"kernels": breakdown(gen, ids.device, 1), "wall_ms": timed_ms(gen, ids.device, 2)}
