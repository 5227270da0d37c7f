"""The memory ledger: each phase's peak, and what the memory at its end is made of.

`with ledger.phase("rollout"): ...` records the phase's peak bytes (CUDA: the allocator's exact peak, reset when
the phase starts; CPU: the highest resident-memory sample in the phase) and, when it ends, the bytes held by
kind: weights, gradients, optimizer states and the KV cache, each storage counted once. `activations` is a
REMAINDER, peak minus those kinds, not a measurement: on CUDA it is what the phase allocated and freed itself
(activations, logits, temporaries; gradients freed by the optimizer step too), on CPU it also holds the whole
process's baseline (interpreter, libraries). Phases do not nest.

On CUDA the ledger resets torch.cuda's peak counter at each phase start, so that counter read at a step's end
(hybridcore/memwatch.py, for tracking) covers only the step's last phase; the exact step peak is the highest
`mem_<phase>_peak_mib`.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

MIB = 2 ** 20
KINDS = ("weights", "gradients", "optimizer", "kv_cache", "activations")


def quant_state_tensors(param) -> list[torch.Tensor]:
    """The tensors bitsandbytes keeps beside a quantised weight: 4-bit absmax/code (and the nested ones of
    double quantisation), 8-bit row scales. Empty for a plain parameter."""
    out = []
    qs = getattr(param, "quant_state", None)
    while qs is not None:
        out += [t for t in (getattr(qs, "absmax", None), getattr(qs, "code", None), getattr(qs, "offset", None))
                if isinstance(t, torch.Tensor)]
        qs = getattr(qs, "state2", None)
    scb = getattr(param, "SCB", None)
    if isinstance(scb, torch.Tensor):
        out.append(scb)
    return out


def storage_bytes(tensors: Iterable, device_type: str, seen: Optional[set] = None) -> int:
    """Bytes of the distinct storages among `tensors` on `device_type`; storages already in `seen` (which is
    updated) are skipped, so one buffer is counted under one kind only."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != device_type:
            continue
        s = t.untyped_storage()
        key = (t.device.type, t.device.index, s.data_ptr())
        if s.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


@dataclass
class PhaseRecord:
    peak: int = 0
    held: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    calls: int = 0

    def by_kind(self) -> dict[str, int]:
        """The held kinds plus activations = peak - their sum (never below zero)."""
        kinds = {k: self.held.get(k, 0) for k in KINDS[:-1]}
        return {**kinds, "activations": max(0, self.peak - sum(kinds.values()))}


class PhaseHandle:
    """What a `with ledger.phase(...)` block gets: `hold(kind, bytes)` reports memory the phase itself allocates
    and frees before it ends (the rollout's KV cache), which the ledger cannot see at the phase's end."""

    def __init__(self):
        self.held: dict[str, int] = {}

    def hold(self, kind: str, nbytes: int) -> None:
        if kind not in KINDS[:-1]:
            raise ValueError(f"memory kind must be one of {KINDS[:-1]}, got {kind!r}")
        self.held[kind] = max(self.held.get(kind, 0), int(nbytes))


class MemoryLedger:
    """Per-phase peaks and held bytes for one stage run on one device.

    models: modules whose parameters (and quantisation states) are weights and whose .grad are gradients;
    engines: hybridcore.engine.Engine objects (held_tensors()) for optimizer states and ZeRO's gradient
    partitions; kv_cache: a callable giving the KV-cache bytes held now (0 outside rollout). A phase entered
    again before `metrics()` (one actor pass per minibatch) keeps its highest peak and adds its seconds."""

    def __init__(self, device, models: Iterable[torch.nn.Module] = (), engines: Iterable = (),
                 kv_cache: Optional[Callable[[], int]] = None, sample_interval: float = 0.01):
        self.device = torch.device(device)
        self.models, self.engines, self.kv_cache = list(models), list(engines), kv_cache
        self.records: dict[str, PhaseRecord] = {}
        self.last: dict[str, PhaseRecord] = {}
        self._interval = sample_interval
        self._watch = None
        self._active: Optional[str] = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def held_now(self) -> dict[str, int]:
        """Bytes on this device by kind right now (weights, gradients, optimizer, kv_cache)."""
        dev, seen = self.device.type, set()
        params = [p for m in self.models for p in m.parameters()]
        weights = storage_bytes([t for p in params for t in (p, *quant_state_tensors(p))], dev, seen)
        held = [e.held_tensors() for e in self.engines]
        grads = storage_bytes([p.grad for p in params] + [t for h in held for t in h.get("grads", [])], dev, seen)
        optimizer = storage_bytes([t for h in held for t in h.get("optimizer", [])], dev, seen)
        kv = int(self.kv_cache()) if self.kv_cache is not None else 0
        return {"weights": weights, "gradients": grads, "optimizer": optimizer, "kv_cache": kv}

    @contextlib.contextmanager
    def phase(self, name: str):
        """Measure the block as phase `name`; yields a PhaseHandle (see its `hold`)."""
        if self._active is not None:
            raise RuntimeError(f"memory ledger: phase {name!r} started inside phase {self._active!r}; phases "
                               "do not nest")
        self._active = name
        handle = PhaseHandle()
        start = self._begin()
        try:
            yield handle
        finally:
            self._active = None
            peak, seconds = self._end(start)
            held = self.held_now()
            for k, v in handle.held.items():
                held[k] = max(held[k], v)
            rec = self.records.setdefault(name, PhaseRecord())
            rec.peak = max(rec.peak, peak, sum(held.values()))  # a sampled peak can miss what is held now
            rec.held = {k: max(rec.held.get(k, 0), v) for k, v in held.items()}
            rec.seconds += seconds
            rec.calls += 1

    def _begin(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            if self._watch is None:
                from hybridcore.memwatch import MemoryWatch
                self._watch = MemoryWatch(self._interval, reset_cuda=False)
            self._watch.sample()
        return time.perf_counter()

    def _end(self, start: float) -> tuple[int, float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device), time.perf_counter() - start
        self._watch.sample()
        end = time.perf_counter()
        return int((self._watch.window_peak(start, end) or 0.0) * MIB), end - start

    def metrics(self) -> dict[str, float]:
        """Flat MiB metrics of the phases since the last call (`mem_<phase>_peak_mib`, `mem_<phase>_<kind>_mib`),
        then starts a new step: the next entry of a phase replaces its record."""
        out = {}
        for name, rec in self.records.items():
            out[f"mem_{name}_peak_mib"] = rec.peak / MIB
            out.update({f"mem_{name}_{k}_mib": v / MIB for k, v in rec.by_kind().items()})
        if self.records:
            self.last = self.records
            self.records = {}
        return out

    def summary(self) -> dict[str, float]:
        """The last step's metrics (what `table()` prints), for a stage's summary."""
        last = self.records or self.last
        return {f"mem_{name}_{k}_mib": v / MIB for name, rec in last.items()
                for k, v in {"peak": rec.peak, **rec.by_kind()}.items()}

    def table(self) -> str:
        """A few printable lines: one per phase, peak and kinds (GiB, or MiB when every peak is under 1 GiB)."""
        last = self.records or self.last
        where = "CUDA allocator peak" if self.cuda else "process RSS peak (activations include the baseline)"
        unit, scale = ("GiB", 2 ** 30) if any(r.peak >= 2 ** 30 for r in last.values()) else ("MiB", MIB)
        head = f"{'phase':<14}{'peak':>9}" + "".join(f"{k:>12}" for k in KINDS) + f"{'seconds':>9}"
        rows = [f"memory ledger, {unit} ({where}):", head]
        for name, rec in last.items():
            kinds = rec.by_kind()
            rows.append(f"{name:<14}{rec.peak / scale:>9.2f}" + "".join(f"{kinds[k] / scale:>12.3f}" for k in KINDS)
                        + f"{rec.seconds:>9.2f}")
        return "\n".join(rows)

    def close(self) -> None:
        """Stop the CPU sampler thread, if one was started."""
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
