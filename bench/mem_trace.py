"""What is alive at the peak: torch.cuda.memory's allocation history replayed, the allocations live at the moment
the allocated total peaked, grouped by where they were made (CUDA only; bench/memory.py --trace).

    start(); step(); report = at_peak(torch.cuda.memory._snapshot()); stop()

Only allocations made while recording count (the weights loaded before are the baseline the peak sits on).
"""
from __future__ import annotations

import os

MIB = 2 ** 20
OURS = ("hybridcore", "stages", "bench")  # the frame that names a site: the innermost one in our code


def start(max_entries: int = 2_000_000) -> None:
    import torch
    # Python frames only: with the default (C++ frames too) the recorder made the 8B GRPO step's backward fail
    # with "SystemError: run_backward returned NULL without setting an exception" (H100, 2026-12-06)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")


def stop() -> None:
    import torch
    torch.cuda.memory._record_memory_history(enabled=None)


def site(frames: list[dict], depth: int = 3) -> str:
    """The allocation's innermost frames outside torch's own files, then the first one in our code."""
    outside = [f for f in frames if "/torch/" not in f.get("filename", "") and f.get("filename", "")[:1] == "/"]
    picked = outside[:depth]
    ours = next((f for f in frames if any(f"/{p}/" in f.get("filename", "") for p in OURS)), None)
    if ours is not None and ours not in picked:
        picked.append(ours)
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in picked) or "?"


def at_peak(snapshot: dict, device: int = 0, top: int = 25) -> dict:
    """{peak_mib (above the first traced event), events, sites: [{site, mib, count}] alive at that moment}."""
    events = [e for e in snapshot["device_traces"][device] if e["action"] in ("alloc", "free_completed")]
    current = peak = 0
    peak_at = -1
    for i, e in enumerate(events):
        current += e["size"] if e["action"] == "alloc" else -e["size"]
        if current > peak:
            peak, peak_at = current, i
    alive: dict[int, dict] = {}
    for e in events[: peak_at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        else:
            alive.pop(e["addr"], None)
    sites: dict[str, list] = {}
    for e in alive.values():
        s = sites.setdefault(site(e.get("frames", [])), [0, 0])
        s[0] += e["size"]
        s[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return {"peak_mib": peak / MIB, "events": len(events), "alive_mib": sum(e["size"] for e in alive.values()) / MIB,
            "sites": [{"site": k, "mib": v[0] / MIB, "count": v[1]} for k, v in ranked]}
