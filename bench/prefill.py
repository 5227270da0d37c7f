"""The native rollout's prefill, compiled against eager, in one run (issue 16: "fuse the prefill").

    python bench/prefill.py --out DIR            # CUDA: Qwen2.5-1.5B shape, bf16, batch 256 x 256 prompt tokens
    python bench/prefill.py --tiny --out DIR     # CPU, seconds: the same code path

Each row is a NativeRollout (its default chunks: one shape per batch size and capacity) whose generate decodes two
steps of a cache sized for 256 new tokens (bench/rollout.py's workload), so the prefill is the call's work; the
first call compiles, the median of the next `--repeats` calls' prefill_s (CUDA events) is the figure. Rows: eager
(compile=False: the prefill as every release before this one ran it) and compiled (compile=None: the default
under a CUDA graph). The first greedy token of each row is compared with the eager row's, and so is its
log-probability (the model's own softmax): random bf16 weights give near-flat logits, where rounding alone can swap
the top two tokens, so `first_token_agreement` below 1 with `first_logprob_max_diff` at bf16's noise (hundredths of
a nat) is two near-ties, while a prefill that saw the wrong keys would move the log-probabilities of every row.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402

from bench.rollout import PAD, build, prompts  # noqa: E402
from hybridcore.rollout import NativeRollout  # noqa: E402


def run_row(model, ids, mask, new: int, repeats: int, compile: bool | None) -> tuple[dict, tuple[torch.Tensor, ...]]:
    backend = NativeRollout(model, compile=compile)
    backend.enter()
    try:
        t0 = time.perf_counter()
        first = backend.generate(ids, mask, new, eos_id=None, pad_id=PAD, greedy=True, steps=2)
        first_lp = backend.last_logprobs[:, 0].float().cpu()
        first_s = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            backend.generate(ids, mask, new, eos_id=None, pad_id=PAD, greedy=True, steps=2)
            times.append(backend.last_stats["prefill_s"])
        st = backend.last_stats
        row = {"compile": compile, "prefill_compiled": st["prefill_compiled"], "compiled_step": st["compiled"],
               "compile_error": st["compile_error"], "chunks": st["prefill_chunks"], "first_call_s": first_s,
               "prefill_s": statistics.median(times), "prefill_s_all": times}
        return row, (first[:, 0].cpu(), first_lp)
    finally:
        backend.exit()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--commit", default="")
    a = ap.parse_args()
    device = torch.device("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    shape, dtype = ("tiny", torch.float32) if a.tiny else ("qwen2.5-1.5b", torch.bfloat16)
    prompt, new = (16, 16) if a.tiny else (256, 256)
    batch = 4 if a.tiny else a.batch
    model = build(shape, dtype, device)
    ids, mask = prompts(batch, prompt, model.config.vocab_size, device, seed=1)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": a.commit, "command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "shape": shape, "batch": batch, "prompt": prompt,
           "new_tokens_cache": new, "rows": {}}
    tokens = {}
    for name, compile in (("eager", False), ("compiled", None if device.type == "cuda" else True)):
        res["rows"][name], tokens[name] = run_row(model, ids, mask, new, a.repeats, compile)
        (tok, lp), (tok0, lp0) = tokens[name], tokens["eager"]
        res["rows"][name]["first_token_agreement"] = float((tok == tok0).float().mean())
        res["rows"][name]["first_logprob_max_diff"] = float((lp - lp0).abs().max())
        print(name, json.dumps(res["rows"][name]), flush=True)
    res["speedup"] = res["rows"]["eager"]["prefill_s"] / res["rows"]["compiled"]["prefill_s"]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "prefill.json").write_text(json.dumps(res, indent=1))
    print(f"prefill eager {res['rows']['eager']['prefill_s'] * 1e3:.1f} ms, compiled "
          f"{res['rows']['compiled']['prefill_s'] * 1e3:.1f} ms ({res['speedup']:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
