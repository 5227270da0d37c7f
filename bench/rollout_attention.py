"""The native rollout end to end with each decode attention (engine.rollout.attention), one GPU, one process.

    python bench/rollout_attention.py --out DIR            # CUDA: Qwen2.5-1.5B shape, bf16, batch 256, 256 + 256
    python bench/rollout_attention.py --out DIR --tiny     # CPU: the tiny shape, sdpa only (the kernel needs CUDA)

bench/rollout.py's model and prompts; for each attention the backend's defaults otherwise (compiled step in a CUDA
graph): a first call (compile + capture), then timed greedy calls; tokens/s, prefill and decode-step time, and how
many rows equal the sdpa rows (bf16 noise flips near-ties of random weights). Writes rollout_attention.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.rollout import PAD, agreement, build, prompts, row, timed  # noqa: E402
from hybridcore.actor import HybridActor  # noqa: E402
from hybridcore.rollout import NativeRollout  # noqa: E402


def run(model, attention: str, ids, mask, new: int, repeats: int, device) -> tuple[dict, torch.Tensor]:
    actor = HybridActor(model, SimpleNamespace(pad_token_id=PAD, eos_token_id=None))
    actor.backend = NativeRollout(model, attention=attention)
    with actor.rollout():
        gen = lambda: actor.backend.generate(ids, mask, new, eos_id=None, pad_id=PAD, greedy=True)  # noqa: E731
        _, (first,) = timed(gen, device, 1)
        out, times = timed(gen, device, repeats)
        st = actor.backend.last_stats
    extra = {"attention_asked": attention, "attention": st["attention"], "prefill_s": st["prefill_s"],
             "decode_step_ms": 1e3 * st["decode_s"] / max(st["steps"] - 1, 1), "compiled": st["compiled"],
             "cuda_graph": st["cuda_graph"], "compile_error": st["compile_error"]}
    return row(f"native-{attention}", ids.shape[0], new, first, times, out, extra), out.cpu()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--commit", default="")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if a.tiny else "cuda")
    shape, batch, length, repeats = ("tiny", 4, 16, 1) if a.tiny else ("qwen2.5-1.5b", 256, 256, 3)
    model = build(shape, torch.float32 if a.tiny else torch.bfloat16, device)
    ids, mask = prompts(batch, length, model.config.vocab_size, device, seed=batch)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": a.commit,
           "command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None, "torch": torch.__version__,
           "shape": shape, "batch": batch, "prompt": length, "new": length, "rows": []}
    ref = None
    for attention in ("sdpa",) if a.tiny else ("sdpa", "filled"):
        r, out = run(model, attention, ids, mask, length, repeats, device)
        if ref is None:
            ref = out
        else:
            r["rows_equal_to_sdpa"] = agreement(out, ref)
        res["rows"].append(r)
        print(f"{r['backend']}: {r['tok_per_s']:.0f} tok/s, prefill {r['prefill_s']:.3f} s, decode step "
              f"{r['decode_step_ms']:.2f} ms {r.get('rows_equal_to_sdpa', '')}", flush=True)
        (a.out / "rollout_attention.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
