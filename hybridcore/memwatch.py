"""A background sampler of resident memory (and CUDA allocations): the peak inside any time window.

Used by the tracking side (flows/tracking.py: per-step and per-phase peaks, so stages need not know) and by
hybridcore.ledger (a phase's peak on CPU, where no allocator counter exists). A daemon thread samples every
`interval` seconds; a window's peak is the highest sample inside it. On GPU the step peak is
torch.cuda.max_memory_allocated, reset after each step; where a memory ledger also resets it at each phase start,
the step peak is the higher of that counter and the step's samples (exact per phase: the ledger's metrics).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from typing import Optional

MIB = 1024 * 1024


def rss_mib() -> float:
    """Resident memory of this process now (psutil when installed, else /proc/self/statm)."""
    try:
        import psutil
        return psutil.Process().memory_info().rss / MIB
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def _cuda():
    """torch.cuda, only if a stage already imported torch and initialised CUDA (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda


class MemoryWatch:
    """Samples (time, rss MiB, CUDA allocated MiB or None) in the background until `stop()`; `stage_peak`
    holds the highest of each since the start."""

    def __init__(self, interval: float = 0.05, keep: int = 20_000, reset_cuda: bool = True):
        self.interval = interval
        self.samples: deque[tuple[float, float, Optional[float]]] = deque(maxlen=keep)
        self.last_step = time.perf_counter()
        self.stage_peak = {"rss": 0.0, "gpu": 0.0}
        if reset_cuda and (cuda := _cuda()) is not None:  # peaks of earlier stages in this process are not this stage's
            cuda.reset_peak_memory_stats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-watch", daemon=True)
        self._thread.start()

    def sample(self) -> tuple[float, float, Optional[float]]:
        cuda = _cuda()
        s = (time.perf_counter(), rss_mib(), cuda.memory_allocated() / MIB if cuda else None)
        self.samples.append(s)
        self.stage_peak["rss"] = max(self.stage_peak["rss"], s[1])
        self.stage_peak["gpu"] = max(self.stage_peak["gpu"], s[2] or 0.0)
        return s

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def _peak(self, start: float, end: float, col: int) -> Optional[float]:
        """Highest sample in [start, end]; if the sampler was starved there, the first one after it."""
        samples = [s for s in list(self.samples) if s[col] is not None and s[0] >= start]
        inside = [s[col] for s in samples if s[0] <= end]
        return max(inside) if inside else samples[0][col] if samples else None

    def window_peak(self, start: float, end: float, kind: str = "rss") -> Optional[float]:
        """Highest sample (MiB) of `kind` (rss or gpu) between perf_counter times start and end."""
        return self._peak(start, end, 1 if kind == "rss" else 2)

    def step(self, phases: tuple[tuple[str, float], ...] = ()) -> dict[str, float]:
        """Metrics for the step that ends now: rss_mib, peak_rss_mib, and per phase peak_rss_<phase>_mib.

        `phases` are (name, seconds) in the order they ran, the last one ending now. A phase shorter than
        the sampling interval may hold no sample: it gets the first one after it."""
        now, rss, _ = self.sample()
        out = {"rss_mib": rss}
        end = now
        for name, seconds in reversed(phases):
            start = end - seconds
            for col, kind in ((1, "rss"), (2, "gpu")):
                if (peak := self._peak(start, end, col)) is not None:
                    out[f"peak_{kind}_{name}_mib"] = peak
            end = start
        out["peak_rss_mib"] = max([self._peak(self.last_step, now, 1) or rss] +
                                  [v for k, v in out.items() if k.startswith("peak_rss_")])
        cuda = _cuda()
        if cuda is not None:
            # a memory ledger resets the exact counter at each phase start: the samples cover the earlier phases
            out["peak_gpu_mib"] = max(cuda.max_memory_allocated() / MIB, self._peak(self.last_step, now, 2) or 0.0)
            cuda.reset_peak_memory_stats()
            self.stage_peak["gpu"] = max(self.stage_peak["gpu"], out["peak_gpu_mib"])
        self.last_step = now
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
