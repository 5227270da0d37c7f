"""bench/mem_trace.py on a hand-made allocation history: the peak moment, what is alive then, grouped by site."""
from bench.mem_trace import MIB, at_peak, site

HERE = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
        {"filename": "/x/site-packages/transformers/llama.py", "line": 7, "name": "forward"},
        {"filename": "/repo/hybridcore/forward.py", "line": 9, "name": "chunk"}]
THERE = [{"filename": "/repo/hybridcore/rollout.py", "line": 3, "name": "allocate"}]


def ev(action, addr, mib, frames):
    return {"action": action, "addr": addr, "size": mib * MIB, "frames": frames}


def test_alive_at_the_peak_by_site():
    trace = [ev("alloc", 1, 4, HERE), ev("alloc", 2, 2, THERE), ev("free_completed", 1, 4, HERE),
             ev("alloc", 3, 3, HERE), ev("alloc", 4, 1, HERE), ev("free_requested", 4, 1, HERE),
             ev("free_completed", 4, 1, HERE), ev("alloc", 5, 1, THERE)]
    r = at_peak({"device_traces": [trace]})
    assert r["peak_mib"] == 6 and r["alive_mib"] == 6  # 4+2, and 2+3+1 later: the first moment counts
    assert [(s["mib"], s["count"]) for s in r["sites"]] == [(4, 1), (2, 1)]
    assert r["sites"][0]["site"] == "llama.py:7 forward < forward.py:9 chunk"
    assert site(THERE) == "rollout.py:3 allocate"
