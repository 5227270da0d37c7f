"""Where a native decode step spends its time: kernel time by kind, kernels per step, and graph replay time.

Used by bench/rollout.py on the GPU before any figure is trusted: the sum of kernel times against the time of
a graph replay separates launch gaps from kernel work, and the kinds (matrix products, attention over the
cache, inductor's fused kernels, sampling, copies, other elementwise) say which lever is worth pulling.
On CPU (`--tiny`) the same code groups CPU operator time, so the path is exercised in seconds.

A training step (bench/memory.py's profile_step) asks for more: its phases, labelled with `record_function(PHASE +
name)`, each get their own kernel time by kind (a kernel belongs to the phase whose CPU interval its launch falls
in), and `ops` names the operators whose kernels take longest by input shapes and dtypes, so that an fp32 matrix
product in the kernel list is traced to the call that made it.
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


PHASE = "phase:"  # the record_function label of a profiled phase: `PHASE + name`
NAME_CHARS = 140  # kernel and operator names are cut here: the JSON stays small


def _is_phase(e) -> bool:
    return e.name.startswith(PHASE)


def _top_level(e) -> bool:
    """A CPU operator under nothing but phase labels: the unit of CPU time (its children are inside it)."""
    p = e.cpu_parent
    while p is not None and _is_phase(p):
        p = p.cpu_parent
    return p is None and not _is_phase(e)


def _kernels(prof, cuda: bool) -> list[tuple[str, float]]:
    """(name, microseconds) of every device kernel; on CPU, of every top-level operator (inclusive time). The
    phase labels are no kernels (on CUDA they also show as device-side ranges spanning the phase)."""
    events = prof.events()
    if not cuda:
        return [(e.name, e.cpu_time_total) for e in events if _top_level(e)]
    out = [(e.name, e.time_range.elapsed_us()) for e in events
           if e.device_type == torch.autograd.DeviceType.CUDA and not _is_phase(e)]
    if not out:  # older layouts attach kernels to the CPU operators only
        out = [(k.name, k.duration) for e in events for k in getattr(e, "kernels", [])]
    return out


def _launches(prof, cuda: bool) -> list[tuple[str, float, object]]:
    """(kernel name, microseconds, the CPU event that launched it): on CUDA the kernels the profiler linked to a
    CPU event (a runtime call such as cudaLaunchKernel, or the operator itself); on CPU the top-level operators."""
    events = prof.events()
    if not cuda:
        return [(e.name, e.cpu_time_total, e) for e in events if _top_level(e)]
    return [(k.name, k.duration, e) for e in events if e.device_type == torch.autograd.DeviceType.CPU
            for k in getattr(e, "kernels", []) if not k.name.startswith(PHASE)]


def _summary(kernels: list[tuple[str, float]], repeats: int, top: int) -> dict:
    """Per-unit time by kind, kernel counts by kind and the `top` largest kernels by (cut) name."""
    by_kind, by_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for name, us in kernels:
        by_kind[kind_of(name)] += us / repeats
        by_name[name[:NAME_CHARS]] += us / repeats
        count[kind_of(name)] += 1
    best = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"total_ms": sum(by_kind.values()) / 1e3, "kernels_per_unit": len(kernels) / repeats,
            "ms_by_kind": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "kernels_by_kind": {k: n / repeats for k, n in count.items()},
            "top_kernels_ms": [(n, us / 1e3) for n, us in best]}


def _phase_of(prof):
    """A function from a CPU event to the name of the labelled phase its start falls in ("(outside phases)" when
    none: the optimizer steps, say), or None when the profile holds no phase labels."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name[len(PHASE):]) for e in prof.events()
                   if _is_phase(e) and e.device_type == torch.autograd.DeviceType.CPU)
    if not spans:
        return None

    def phase(e) -> str:
        t = e.time_range.start
        return next((name for start, end, name in spans if start <= t <= end), "(outside phases)")
    return phase


def by_phase(prof, cuda: bool, repeats: int) -> dict | None:
    """Per labelled phase: kernel time and counts by kind (as breakdown's, without the kernel list). CUDA kernels
    the profiler linked to no CPU event cannot be placed: their milliseconds are `unlinked_ms`."""
    phase = _phase_of(prof)
    if phase is None:
        return None
    groups: dict[str, list] = defaultdict(list)
    for name, us, e in _launches(prof, cuda):
        groups[phase(e)].append((name, us))
    out = {k: {key: v for key, v in _summary(g, repeats, 0).items() if key != "top_kernels_ms"}
           for k, g in groups.items()}
    placed = sum(p["total_ms"] for p in out.values())
    return {"phases": out, "unlinked_ms": sum(us for _, us in _kernels(prof, cuda)) / repeats / 1e3 - placed}


_RUNTIME = re.compile(r"^cu[A-Z]|^cuda")  # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync: calls, not ops


def _operator(e):
    """The operator a kernel belongs to: the CPU event that launched it, past CUDA runtime calls."""
    while e.cpu_parent is not None and _RUNTIME.match(e.name):
        e = e.cpu_parent
    return e


def _dtypes_of(prof) -> dict:
    """CPU event id -> its inputs' dtypes, from the kineto events (for a torch whose FunctionEvent has no
    input_dtypes); empty when neither holds them."""
    try:
        return {k.correlation_id(): list(k.dtypes()) for k in prof.profiler.kineto_results.events()}
    except (AttributeError, RuntimeError):
        return {}


def _op_key(e, dtypes: dict) -> tuple[str, str, str]:
    """(name, input shapes, input dtypes) of an operator event, cut to NAME_CHARS; trailing non-tensor inputs'
    empty dtypes dropped."""
    d = getattr(e, "input_dtypes", None)
    d = list(d) if d is not None else dtypes.get(e.id, [])
    while d and not d[-1]:
        d.pop()
    return e.name[:NAME_CHARS], str(e.input_shapes or [])[:NAME_CHARS], ",".join(map(str, d))[:NAME_CHARS]


def top_ops(prof, cuda: bool, n: int, repeats: int) -> list[dict]:
    """The `n` operators (name, input shapes, input dtypes) that take longest: on CUDA by their kernels' time (each
    kernel under the operator that launched it), on CPU by self time. Shapes and dtypes need record_shapes; dtypes
    are part of the key, so an fp32 and a bf16 product of the same shapes stay apart. ms_by_phase: where the
    profile holds phase labels."""
    events, phase = prof.events(), _phase_of(prof)
    dtypes = {} if events and hasattr(events[0], "input_dtypes") else _dtypes_of(prof)
    if cuda:
        timed = [(_operator(e), us) for _, us, e in _launches(prof, cuda)]
    else:
        timed = [(e, e.self_cpu_time_total) for e in events if not _is_phase(e)]
    ms, calls, split = defaultdict(float), defaultdict(set), defaultdict(lambda: defaultdict(float))
    for op, us in timed:
        key = _op_key(op, dtypes)
        ms[key] += us / repeats / 1e3
        calls[key].add(id(op))
        if phase is not None:
            split[key][phase(op)] += us / repeats / 1e3
    out = []
    for key in sorted(ms, key=lambda k: -ms[k])[:n]:
        row = {"op": key[0], "shapes": key[1], "dtypes": key[2], "calls": len(calls[key]) / repeats, "ms": ms[key]}
        if phase is not None:
            row["ms_by_phase"] = dict(split[key])
        out.append(row)
    return out


def breakdown(fn, device, repeats: int, top: int = 12, ops: int = 0) -> dict:
    """Profile `fn` (which runs `repeats` units of work) and return per-unit kernel time by kind and the `top`
    largest kernels; where fn labels phases (PHASE), `by_phase` too; ops > 0: shapes are recorded and `top_ops`
    names the `ops` operators that take longest (top_ops)."""
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts, record_shapes=ops > 0) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    out = _summary(_kernels(prof, cuda), repeats, top)
    phases = by_phase(prof, cuda, repeats)
    if phases is not None:
        out["by_phase"] = phases
    if ops > 0:
        out["top_ops"] = top_ops(prof, cuda, ops, repeats)
    return out


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
