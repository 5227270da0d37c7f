"""Memory planner: the largest micro-batch whose MEASURED training step fits `engine.memory_budget_gib`.

A stage hands in a probe (its real forward + backward at its longest sequence, for a given number of rows) and
what it holds outside the step (weights, optimizer states). The planner starts from the write-up's rule of thumb
(micro ~= budget_GB x 0.6 / (params_B x 2 x 3)), measures, and moves in powers of two (never above the batch) to the
largest size that fits with a safety margin. Where weights + gradients + optimizer states alone exceed the budget it
moves the optimizer states to the CPU (ZeRO-2 offload) when it can, and otherwise says what does not fit.
PPO's rollout is planned the same way (plan_rollout): a probe rollout (the KV cache at full length, the prefill, a
few decode steps) picks the largest chunk of the rollout batch generated at once, and whether the actor's optimizer
states leave the device meanwhile.

Measuring: on CUDA, torch.cuda.max_memory_allocated over the probe. On the CPU, torch.profiler's memory events:
every allocation and free of torch's CPU allocator during the probe, summed in time order, whose running maximum is
the probe's peak of tensor memory above what was held when it started (Python objects, libraries and the
allocator's own caching are not counted: tensors only, the same quantity the CUDA figure counts).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from hybridcore.errors import InputError
from hybridcore.tensor_parallel import head_shape

GIB, MIB = 2 ** 30, 2 ** 20
MARGIN = 0.10  # of the budget kept free: allocator fragmentation, and buffers the probe does not exercise


def rule_of_thumb(budget_gib: float, n_params: int) -> int:
    """The write-up's starting point: micro_batch ~= budget_GB x 0.6 / (params_B x 2 x 3), at least 1."""
    params_b = max(n_params, 1) / 1e9
    return max(1, int(budget_gib * 0.6 / (params_b * 2 * 3)))


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def measure_peak(fn: Callable[[], None], device: torch.device) -> int:
    """Peak bytes of tensor memory `fn` allocates on `device` above what was allocated when it started."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    if device.type != "cpu":
        raise InputError(f"engine.memory_budget_gib: the planner measures on cpu or cuda, not {device.type}; "
                         "expected engine.device cpu or cuda")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()  # negative for a free
        peak = max(peak, current)
    return peak


def probed(probe: Callable[[int], None], rows: int, device, budget: int) -> int:
    """measure_peak of probe(rows), without moving the run's random streams; the whole budget when it ran out of
    memory (the probe let go of what it made; the allocator's cache is emptied)."""
    try:
        with torch.random.fork_rng(devices=[]):
            return measure_peak(lambda: probe(rows), device)
    except torch.OutOfMemoryError:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return budget


def held_bytes(modules: Iterable[torch.nn.Module]) -> int:
    """Bytes of the distinct storages behind the modules' parameters and buffers (a shared base counts once)."""
    seen: dict[tuple, int] = {}
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            s = t.untyped_storage()
            seen[(t.device.type, t.device.index, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(trained: Iterable[torch.Tensor], zero_stage: int, offload: bool) -> int:
    """AdamW's states kept on the device: torch keeps two moments in the parameters' dtype; ZeRO keeps two fp32
    moments and an fp32 master copy (one process: the whole of them); offloaded, none stay on the device."""
    if offload:
        return 0
    params = list(trained)
    if zero_stage == 0:
        return sum(2 * p.numel() * p.element_size() for p in params)
    return sum(12 * p.numel() for p in params)


@dataclass
class Plan:
    """What the planner chose and what it measured (total = held + the probe's peak, in bytes, per size tried)."""
    micro_batch: int
    probe_peak_bytes: int
    held_bytes: int
    budget_bytes: int
    offload_optimizer: bool = False
    tried: dict[int, int] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        return {"planned_micro_batch": float(self.micro_batch), "planned_probe_peak_mib": self.probe_peak_bytes / MIB,
                "planned_offload_optimizer": float(self.offload_optimizer)}

    def line(self, stage: str, configured: int) -> str:
        tried = ", ".join(f"{k}: {v / MIB:.1f}" for k, v in sorted(self.tried.items()))
        return (f"{stage}: memory planner chose micro-batch {self.micro_batch} (configured {configured}) for a budget "
                f"of {self.budget_bytes / GIB:.3g} GiB: held {self.held_bytes / MIB:.1f} MiB + step peak "
                f"{self.probe_peak_bytes / MIB:.1f} MiB measured (MiB in total per size tried: {tried}; "
                f"{MARGIN:.0%} kept free)" + ("; optimizer states offloaded to the CPU" if self.offload_optimizer
                                                else ""))


def choose_offload(stage: str, budget_gib: float, weights: int, grads: int, optimizer: int, zero_capable: bool,
                   device_type: str) -> bool:
    """Whether the optimizer states must leave the device (True), or nothing needs to (False); an InputError naming
    what does not fit, and by how much, when neither works."""
    usable = budget_gib * GIB * (1 - MARGIN)
    field_ = f"engine.memory_budget_gib={budget_gib:g}"
    if weights > usable:
        raise InputError(f"{field_}: the {stage} stage's weights alone take {weights / GIB:.3g} GiB, "
                         f"{(weights - usable) / GIB:.3g} GiB more than the {usable / GIB:.3g} GiB usable "
                         f"({MARGIN:.0%} kept free); expected a budget of at least "
                         f"{weights / (1 - MARGIN) / GIB:.3g} GiB, or quantised roles")
    if weights + grads + optimizer <= usable:
        return False
    short = (weights + grads + optimizer - usable) / GIB
    what = (f"{field_}: the {stage} stage's weights + gradients + optimizer states take "
            f"{(weights + grads + optimizer) / GIB:.3g} GiB, {short:.3g} GiB over the {usable / GIB:.3g} GiB usable")
    if weights + grads > usable:
        raise InputError(f"{what}, and without the optimizer states still {(weights + grads - usable) / GIB:.3g} "
                         f"GiB over; expected a larger budget, LoRA or quantised roles")
    if device_type == "cpu":
        raise InputError(f"{what}; offloading the optimizer states to the CPU frees nothing when the device is "
                         f"the CPU; expected a larger budget or LoRA")
    if not zero_capable:
        raise InputError(f"{what}; the optimizer states would fit on the CPU, but that needs DeepSpeed ZeRO in one "
                         f"process (deepspeed installed, engine.layout dp=1 tp=1); expected that, "
                         f"engine.optimizer_states: host, or a larger budget")
    return True


def plan_micro_batch(stage: str, budget_gib: float, batch_size: int, n_params: int, held: int,
                     probe: Callable[[int], None], device, offload_optimizer: bool = False) -> Plan:
    """The largest power-of-two micro-batch (at most batch_size) whose measured step, on top of `held` bytes,
    fits the budget less the margin. probe(rows) runs one real micro-step and leaves no gradients behind."""
    budget = int(budget_gib * GIB)
    usable = budget * (1 - MARGIN)
    cap = _pow2_floor(batch_size)
    plan = Plan(0, 0, held, budget, offload_optimizer)

    def fits(size: int) -> bool:
        peak = probed(probe, size, device, budget)
        plan.tried[size] = held + peak
        if held + peak <= usable:
            plan.micro_batch, plan.probe_peak_bytes = size, peak
            return True
        return False

    size = min(cap, _pow2_floor(rule_of_thumb(budget_gib, n_params)))
    if fits(size):
        while size * 2 <= cap and fits(size * 2):
            size *= 2
        return plan
    while size > 1:
        size //= 2
        if fits(size):
            return plan
    raise InputError(f"engine.memory_budget_gib={budget_gib:g}: one row of the {stage} stage's step needs "
                     f"{plan.tried[1] / GIB:.3g} GiB measured (held {held / GIB:.3g} GiB + step "
                     f"{(plan.tried[1] - held) / GIB:.3g} GiB), more than the {usable / GIB:.3g} GiB usable; "
                     f"expected a budget of at least {plan.tried[1] / (1 - MARGIN) / GIB:.3g} GiB, a shorter "
                     f"max_seq_len or activation checkpointing")


def kv_cache_bytes(config, rows: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of a static KV cache for `rows` sequences of `length` tokens (hybridcore/rollout.py StaticKVCache)."""
    _, kv_heads, head_dim = head_shape(config)
    return 2 * config.num_hidden_layers * rows * kv_heads * length * head_dim * dtype.itemsize


@dataclass
class RolloutPlan:
    """PPO's rollout under the budget: `chunk` sequences generated at once (the KV cache's rows), and whether the
    actor's optimizer states leave the device while it rolls out. tried: rows -> held + measured peak, in bytes."""
    chunk: int
    offload_optimizer: bool
    peak_bytes: int
    held_bytes: int
    budget_bytes: int
    tried: dict[int, int] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        return {"planned_rollout_chunk": float(self.chunk), "planned_rollout_offload": float(self.offload_optimizer),
                "planned_rollout_peak_mib": self.peak_bytes / MIB}

    def line(self, rows: int) -> str:
        tried = ", ".join(f"{k}: {v / MIB:.1f}" for k, v in sorted(self.tried.items(), reverse=True))
        return (f"ppo: memory planner rolls out {self.chunk} of {rows} sequences at a time for a budget of "
                f"{self.budget_bytes / GIB:.3g} GiB: held {self.held_bytes / MIB:.1f} MiB + rollout peak "
                f"{self.peak_bytes / MIB:.1f} MiB measured (MiB in total per chunk tried: {tried}; {MARGIN:.0%} "
                f"kept free)" + ("; the actor's optimizer states go to the CPU while it rolls out"
                                 if self.offload_optimizer else ""))


def plan_rollout(budget_gib: float, rows: int, cap: int, held: int, actor_optimizer: int, can_offload: bool,
                 kv_cache: Callable[[int], int], probe: Callable[[int], None], device) -> RolloutPlan:
    """The largest chunk of the rollout's `rows` sequences (at most `cap`; then halving) whose MEASURED rollout
    (probe(chunk): the weights' rollout transitions, a KV cache of the full length, the prefill and a few decode
    steps) fits the budget on top of `held` (weights + every optimizer state on the device). At each size the
    actor's optimizer states stay on the device if they can, else they leave it (when `can_offload`). A size
    whose KV cache alone (kv_cache(chunk), exact for the static cache) cannot fit is not probed."""
    budget = int(budget_gib * GIB)
    usable = budget * (1 - MARGIN)
    floor = held - (actor_optimizer if can_offload else 0)  # the least the rollout can hold beside its own memory
    plan = RolloutPlan(0, False, 0, held, budget)
    size = min(rows, cap)
    while True:
        if floor + kv_cache(size) <= usable:
            peak = probed(probe, size, device, budget)
            plan.tried[size] = held + peak
            for offload in (False, True) if can_offload else (False,):
                if held - (actor_optimizer if offload else 0) + peak <= usable:
                    plan.chunk, plan.offload_optimizer, plan.peak_bytes = size, offload, peak
                    plan.held_bytes = held - (actor_optimizer if offload else 0)
                    return plan
        if size == 1:
            break
        size = -(-size // 2)
    one = plan.tried[1] - (held - floor) if 1 in plan.tried else floor + kv_cache(1)
    raise InputError(f"engine.memory_budget_gib={budget_gib:g}: one sequence of PPO's rollout needs "
                     f"{one / GIB:.3g} GiB ({floor / GIB:.3g} GiB of weights and optimizer states that stay on the "
                     f"device, then its KV cache, prefill and decode), more than the {usable / GIB:.3g} GiB usable; "
                     f"expected a larger budget, a smaller ppo.max_new_tokens or shorter prompts")


def zero_capable(layout) -> bool:
    """DeepSpeed can take the optimizer states to the CPU here: installed, and one process."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return layout.dp * layout.tp == 1


def plan_stage(stage: str, budget_gib: float, batch_size: int, configured: int, models: Iterable[torch.nn.Module],
               trained: Iterable[torch.Tensor], layout, device, probe: Callable[[int], None],
               say: Callable[[str], None], host_states: bool = False):
    """(Plan, layout to train with) for one stage: offload if needed, then the measured micro-batch; one line said.
    host_states: the torch engine keeps the optimizer's moments on the host between steps (none held here)."""
    from dataclasses import replace

    from hybridcore.parallel import Layout

    layout, models, trained = Layout.of(layout), list(models), list(trained)
    weights = held_bytes(models)
    grads = sum(p.numel() * p.element_size() for p in trained)
    optimizer = optimizer_state_bytes(trained, layout.zero_stage, layout.offload_optimizer or host_states)
    if choose_offload(stage, budget_gib, weights, grads, optimizer, zero_capable(layout), torch.device(device).type):
        layout = replace(layout, zero_stage=max(layout.zero_stage, 2), offload_optimizer=True)
        optimizer = 0
    n_params = sum(p.numel() for p in {id(q): q for m in models for q in m.parameters()}.values())
    plan = plan_micro_batch(stage, budget_gib, batch_size, n_params, weights + optimizer, probe, device,
                            layout.offload_optimizer or host_states)
    say(plan.line(stage, configured))
    return plan, layout
