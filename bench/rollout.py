"""Rollout at hardware speed: the `native` backend against transformers' generate, on one GPU.

    python bench/rollout.py --out DIR            # CUDA: Qwen2.5-1.5B shape, bf16, 256 prompt + 256 new tokens
    python bench/rollout.py --out DIR --tiny     # CPU, seconds: the same code paths on a tiny shape
    python bench/rollout.py --out DIR --tiny --compile   # ... also the compiled step on CPU

One call measures, in this order (each section and variant guarded, results written after each one, so a
failure costs only what it touches, and a kill keeps what was measured): `native` tokens/s as the backend
runs by default (on CUDA: torch.compile'd step captured in a CUDA graph), greedy and sampled; a profile of
the decode step and the prefill (kernel time by kind, kernels per step, graph replay time; compiled and
not); greedy correctness against generate in fp32 (share of positions that agree, per variant); the train
<-> rollout transition with and without optimizer offload; the baselines, generate with
cache_implementation="static" at the largest batch (transformers compiles that one on CUDA, so it runs only while
the budget lasts), with the dynamic cache, and static at the other batches; last, while the budget lasts, the other native variants (graph without compile; eager).
Every run is forced to exactly 256 new tokens (no EOS), so tokens/s compare like with like. Needs only
torch + transformers. `--sections native hf --batches 256` is issue 16's figure and its static-cache baseline alone
(~4 minutes on an H100: each batch size compiles the step once, ~75 s).
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
import traceback
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from bench.decode_profile import profile_decoder, profile_prefill  # noqa: E402
from hybridcore import sampling  # noqa: E402
from hybridcore.actor import HybridActor  # noqa: E402
from hybridcore.rollout import HFGenerate, NativeRollout  # noqa: E402

SHAPES = {
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}
PAD = 0


def build(shape: str, dtype, device):
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, pad_token_id=PAD, bos_token_id=None,
                      eos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model.to(dtype).eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return out, times


def prompts(batch: int, length: int, vocab: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    return ids.to(device), torch.ones_like(ids).to(device)


def row(name, batch, new, first_s, times, out, extra=None):
    assert out.shape == (batch, new), f"{name}: expected {new} new tokens per row, got {tuple(out.shape)}"
    med = statistics.median(times)
    return {"backend": name, "batch": batch, "new_tokens": new, "first_call_s": first_s, "times_s": times,
            "median_s": med, "tok_per_s": batch * new / med, **(extra or {})}


# ------------------------------------------------------------------------------------------------ sections


def variants(device, compiled: bool) -> list[tuple[str, bool | None, bool | None]]:
    """(name, CUDA graph, torch.compile) of the native runs; "native" (the backend's defaults) first, the others
    are compared to it. None = the backend decides (on CUDA: graph and compile)."""
    if device.type == "cuda":
        return [("native", None, None), ("native-graph-uncompiled", True, False), ("native-eager", False, False)]
    return [("native", None, None)] + ([("native-compiled", False, True)] if compiled else [])


def agreement(out, ref) -> str:
    """Greedy rows identical to `ref`, and the mean common prefix (bf16 noise flips near-ties of random weights)."""
    out, ref = out.cpu(), ref.cpu()
    same = out == ref
    prefix = torch.where(same.all(1), same.shape[1], (~same).float().argmax(1)).float().mean()
    return f"{int(same.all(1).sum())}/{len(out)} rows, mean common prefix {prefix:.1f}"


def native_speed(model, a, res, device, which, outputs, t_start=None):
    """Native loop inside the actor's rollout: the first call allocates the cache, compiles (once per process and
    shape) and captures the graph. `which` selects variants by index; later variants stop when the budget ends."""
    tok = SimpleNamespace(pad_token_id=PAD, eos_token_id=None)
    rows = res.setdefault("native", [])
    for name, graph, compiled in [variants(device, a.compile)[i] for i in which
                                  if i < len(variants(device, a.compile))]:
        for batch in a.batches:
            if t_start is not None and a.budget_s - (time.perf_counter() - t_start) < a.extra_reserve_s:
                rows.append({"backend": name, "batch": batch, "skipped": "budget"})
                continue
            try:
                native_run(model, a, device, tok, rows, outputs, name, graph, compiled, batch)
            except Exception:  # one variant failing must not cost the others
                res["errors"][f"native:{name}:{batch}"] = traceback.format_exc()
                traceback.print_exc()
            a.flush(res)


def native_run(model, a, device, tok, rows, outputs, name, graph, compiled, batch):
    """One variant at one batch size: a first call (allocation, compile, capture), then timed calls."""
    ids, mask = prompts(batch, a.prompt, model.config.vocab_size, device, seed=batch)
    actor = HybridActor(model, tok)
    actor.backend = NativeRollout(model, cuda_graph=graph, compile=compiled)
    with actor.rollout():
        gen = lambda **kw: actor.backend.generate(ids, mask, a.new, eos_id=None, pad_id=PAD, **kw)  # noqa
        out, (first,) = timed(lambda: gen(greedy=True), device, 1)
        st = actor.backend.last_stats
        fast = st["cuda_graph"] or st["compiled"]
        out, times = timed(lambda: gen(greedy=True), device, a.repeats if fast else 1)
        st = actor.backend.last_stats
        step_s = st["decode_s"] / max(st["steps"] - 1, 1)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        extra = {"prefill_s": st["prefill_s"], "decode_step_ms": 1e3 * step_s, "cuda_graph": st["cuda_graph"],
                 "compiled": st["compiled"], "compile_error": st["compile_error"],
                 "kv_cache_bytes": st["kv_cache_bytes"],
                 "decode_GBps_weights_plus_kv": (weights + st["kv_cache_bytes"]) / step_s / 1e9}
        if name != "native" and batch in outputs:
            extra["rows_equal_to_native"] = agreement(out, outputs[batch])
        rows.append(row(name, batch, a.new, first, times, out, extra))
        if name == "native":
            outputs[batch] = out.cpu()
        if batch == max(a.batches) and name == "native":
            # the one-pass sampler (hybridcore/sampling.py) is the default where it applies; "-torch-sampler": the
            # same call through torch's sampler and log-softmax, the baseline of the same run
            for label, kw in (("native-sample-T1", dict(temperature=1.0)),
                              ("native-sample-T1-torch-sampler", dict(temperature=1.0)),
                              ("native-greedy-torch-sampler", dict(greedy=True)),
                              ("native-sample-top_p0.9", dict(temperature=1.0, top_p=0.9)),
                              ("native-sample-top_k50", dict(temperature=1.0, top_k=50))):
                with torch_sampler(label.endswith("-torch-sampler")):
                    gen(**kw)  # untimed: the first sampled call builds the sampler's sampling variant (Triton JIT)
                    torch.manual_seed(0)
                    out, times = timed(lambda: gen(**kw), device, 2)
                st = actor.backend.last_stats
                rows.append(row(label, batch, a.new, None, times, out,
                                {"step_ms": 1e3 * st["decode_s"] / max(st["steps"] - 1, 1),
                                 "sampler_prefill_s": st["prefill_s"]}))


@contextmanager
def torch_sampler(on: bool):
    """Inside: the rollout samples through torch (sampling.fused_applies answers False), as before the kernel."""
    if not on:
        yield
        return
    saved = sampling.fused_applies
    sampling.fused_applies = lambda *a, **k: False
    try:
        yield
    finally:
        sampling.fused_applies = saved


def profile_section(model, a, res, device):
    """Kernel breakdown of the decode step at the largest batch (uncompiled and compiled) and of the prefill."""
    batch = max(a.batches)
    ids, mask = prompts(batch, a.prompt, model.config.vocab_size, device, seed=batch)
    report = res.setdefault("profile", {"batch": batch, "steps": a.profile_steps})
    for label, compiled in (("decode_uncompiled", False), ("decode_compiled", True)):
        if compiled and not (device.type == "cuda" or a.compile):
            continue
        r = NativeRollout(model, cuda_graph=False, compile=compiled)
        r.enter()
        try:
            report[label] = profile_decoder(r, ids, mask, PAD, a.new, a.profile_steps)
            if label == "decode_uncompiled":
                report["prefill"] = profile_prefill(r, ids, mask, PAD)
        except Exception:
            res["errors"][f"profile:{label}"] = traceback.format_exc()
            traceback.print_exc()
        finally:
            r.exit()
        a.flush(res)


def positions_agree(out: list[list[int]], ref: list[list[int]]) -> float:
    """Share of response positions (over the longer of each pair of rows) where the tokens are equal."""
    total = same = 0
    for x, y in zip(out, ref):
        total += max(len(x), len(y))
        same += sum(int(p == q) for p, q in zip(x, y))
    return same / max(total, 1)


def correctness(model, a, res, device):
    """fp32 greedy tokens of every native variant vs generate, on left-padded prompts of mixed lengths, first
    forced to full length, then with an EOS made from the most frequent greedy token (rows stop early).
    Passes when every variant agrees with generate on >= 99 % of positions in both cases."""
    ref = copy.deepcopy(model).float()
    tok = SimpleNamespace(pad_token_id=PAD, eos_token_id=None)
    g = torch.Generator().manual_seed(7)
    lengths = [a.prompt, 3, a.prompt // 2, 1, 17, a.prompt - 5][: a.check_batch]
    ps = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    report = {"batch": len(ps), "prompt_lengths": lengths, "new_tokens": a.check_new, "dtype": "float32"}
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for case in ("forced_length", "with_eos"):
            outs = {}
            for name, graph, compiled in [("hf", None, None)] + variants(device, a.compile):
                actor = HybridActor(ref, tok, backend="hf" if name == "hf" else "native")
                if name != "hf":
                    actor.backend = NativeRollout(ref, cuda_graph=graph, compile=compiled)
                try:
                    with actor.rollout():
                        outs[name] = actor.generate(ps, a.check_new, greedy=True)
                        if name != "hf":
                            st = actor.backend.last_stats
                            report.setdefault("variants", {})[name] = {
                                k: st[k] for k in ("cuda_graph", "compiled", "compile_error")}
                except Exception:
                    if name == "hf":
                        raise
                    res["errors"][f"correctness:{name}:{case}"] = traceback.format_exc()
                    outs[name] = []
            if case == "forced_length":
                tok.eos_token_id = Counter(t for r in outs["hf"] for t in r).most_common(1)[0][0]
            report[case] = {"equal": all(outs[n] == outs["hf"] for n in outs),
                            "agreement": {n: positions_agree(outs[n], outs["hf"]) for n in outs if n != "hf"},
                            "response_lengths": [len(r) for r in outs["hf"]], **outs}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
        del ref
    report["equal"] = report["forced_length"]["equal"] and report["with_eos"]["equal"]
    report["min_agreement"] = min(v for c in ("forced_length", "with_eos") for v in report[c]["agreement"].values())
    report["passed"] = report["min_agreement"] >= 0.99
    res["correctness"] = report
    a.flush(res)


def transitions(model, a, res, device):
    """One real training step (AdamW state exists), then rollouts with and without optimizer offload. A rollout's
    first generate also allocates the KV cache and captures the graph (the compile is cached per process):
    its time is recorded as generate_s beside the rollout's decode time."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids, _ = prompts(a.train_batch, a.prompt + a.new, model.config.vocab_size, device, seed=99)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                      if torch.is_tensor(v) and v.device.type == device.type)
    batch = min(a.batches)
    ps = prompts(batch, a.prompt, model.config.vocab_size, device, seed=5)[0].tolist()
    tok = SimpleNamespace(pad_token_id=PAD, eos_token_id=None)
    rows = []
    for offload in (False, True):
        actor = HybridActor(model, tok, optimizer=opt, offload_optimizer=offload)
        reserve_s = timed(actor.reserve_host_states, device, 1)[1][0]  # as PPO does after its first update
        for rep in range(2):
            before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            with actor.rollout():
                inside = torch.cuda.memory_allocated() if device.type == "cuda" else 0
                _, (gen_s,) = timed(lambda: actor.generate(ps, a.new, greedy=True), device, 1)
                st = actor.backend.last_stats
                during = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            rows.append({"offload_optimizer": offload, "rep": rep, "batch": batch, "new_tokens": a.new,
                         "enter_s": actor.last_transition_s["enter"], "exit_s": actor.last_transition_s["exit"],
                         "enter_bytes": actor.last_transition_bytes["enter"],
                         "exit_bytes": actor.last_transition_bytes["exit"],
                         "kv_cache_bytes": actor.last_transition_bytes["kv_cache"],
                         "allocated_before": before, "allocated_after_enter": inside,
                         "allocated_after_generate": during, "generate_s": gen_s,
                         "generate_build_prefill_decode_s": st["build_s"] + st["prefill_s"] + st["decode_s"],
                         "compiled": st["compiled"], "cuda_graph": st["cuda_graph"], "reserve_host_s": reserve_s})
        res["transitions"] = {"optimizer_state_bytes": state_bytes, "rows": rows}
        a.flush(res)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()  # training still works after offload round trips
    opt.step()
    del opt
    model.zero_grad(set_to_none=True)
    model.eval()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def baselines(model, a, res, device, native_out, t_start):
    rows, dynamic_out = res.setdefault("hf", []), {}
    # the static cache at the largest batch first (issue 16's same-run baseline; the budget skipped it behind the
    # dynamic rows once, 2026-12-07), then the dynamic cache, then the static one at the other batches
    big, *rest = sorted(a.batches, reverse=True)
    for cache, batches in (("static", [big]), (None, a.batches), ("static", rest)):
        for batch in batches:
            left = a.budget_s - (time.perf_counter() - t_start)
            need = a.static_reserve_s if cache else 0
            if left < need:
                rows.append({"backend": f"hf-{cache}", "batch": batch, "skipped": f"{left:.0f}s left of budget"})
                continue
            ids, mask = prompts(batch, a.prompt, model.config.vocab_size, device, seed=batch)
            hf = HFGenerate(model, cache_implementation=cache)
            gen = lambda n: hf.generate(ids, mask, n, eos_id=None, pad_id=PAD, greedy=True)  # noqa: E731
            # dynamic: a short warm-up; static: a full one, since the first call compiles and records graphs
            _, (first,) = timed(lambda: gen(a.new if cache else 8), device, 1)
            out, times = timed(lambda: gen(a.new), device, 1)
            name = "hf-dynamic" if cache is None else "hf-static"
            extra = {}
            if batch in native_out:
                extra["rows_equal_to_native"] = agreement(out, native_out[batch])
            if cache is None:
                dynamic_out[batch] = out.cpu()
            elif batch in dynamic_out:
                extra["rows_equal_to_hf_dynamic"] = agreement(out, dynamic_out[batch])
            rows.append(row(name, batch, a.new, first, times, out, extra))
            a.flush(res)


# ------------------------------------------------------------------------------------------------ report


def table(res) -> str:
    lines = ["| backend | batch | new tokens | tok/s | median s | first call s | notes |", "|---|---|---|---|---|---|---|"]
    for r in res.get("native", []) + res.get("hf", []):
        if "skipped" in r:
            lines.append(f"| {r['backend']} | {r['batch']} | | skipped | | | {r['skipped']} |")
            continue
        notes = []
        if "decode_step_ms" in r:
            how = "+".join(k for k in ("compiled", "cuda_graph") if r[k]) or "eager"
            notes.append(f"{how}: prefill {r['prefill_s']:.3f}s, step {r['decode_step_ms']:.2f}ms, "
                         f"~{r['decode_GBps_weights_plus_kv']:.0f} GB/s (weights+KV)")
            if r.get("compile_error"):
                notes.append(f"compile FAILED, fell back: {r['compile_error']}")
        elif "step_ms" in r:  # the sampler rows: decode time a step, sampling included
            notes.append(f"step {r['step_ms']:.2f}ms (sampling included)")
        for key in ("rows_equal_to_native", "rows_equal_to_hf_dynamic"):
            if key in r:
                notes.append(f"greedy vs {key[len('rows_equal_to_'):]}: {r[key]}")
        first = "" if r["first_call_s"] is None else f"{r['first_call_s']:.2f}"
        lines.append(f"| {r['backend']} | {r['batch']} | {r['new_tokens']} | {r['tok_per_s']:,.0f} | "
                     f"{r['median_s']:.3f} | {first} | {'; '.join(notes)} |")
    t = res.get("transitions")
    if t:
        lines += ["", f"Transitions (AdamW state {t['optimizer_state_bytes'] / 2**30:.2f} GiB):", "",
                  "| offload optimizer | rep | enter s | exit s | first generate s (build+prefill+decode s) | "
                  "enter MiB | exit MiB | KV cache MiB | allocated before MiB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in t["rows"]:
            lines.append(f"| {r['offload_optimizer']} | {r['rep']} | {r['enter_s']:.3f} | {r['exit_s']:.3f} | "
                         f"{r['generate_s']:.3f} ({r['generate_build_prefill_decode_s']:.3f}) | "
                         f"{r['enter_bytes'] / 2**20:,.0f} | {r['exit_bytes'] / 2**20:,.0f} | "
                         f"{r['kv_cache_bytes'] / 2**20:,.0f} | {r['allocated_before'] / 2**20:,.1f} |")
    c = res.get("correctness")
    if c:
        agree = {case: ", ".join(f"{n} {v:.1%}" for n, v in c[case]["agreement"].items())
                 for case in ("forced_length", "with_eos")}
        lines += ["", f"Correctness (fp32 greedy, batch {c['batch']}, prompt lengths {c['prompt_lengths']}, "
                      f"{c['new_tokens']} new): passed (>= 99 % of positions): {c['passed']}; token for token: "
                      f"{c['equal']}. Positions agreeing with generate, forced length: {agree['forced_length']}; "
                      f"with eos (lengths {c['with_eos']['response_lengths']}): {agree['with_eos']}"]
    lines += profile_table(res.get("profile"))
    for k, v in res.get("errors", {}).items():
        lines.append(f"\nERROR in {k}: {v.strip().splitlines()[-1]}")
    return "\n".join(lines)


def profile_table(p) -> list[str]:
    if not p:
        return []
    lines = ["", f"Profile at batch {p['batch']} ({p['steps']} decode steps; ms per step or per prefill):", "",
             "| what | kernels | kernel ms | wall ms | by kind (ms) |", "|---|---|---|---|---|"]
    for label in ("decode_uncompiled", "decode_compiled", "prefill"):
        if label not in p:
            continue
        r, k = p[label], p[label]["kernels"]
        wall = f"{r['wall_ms']:.2f}" if "wall_ms" in r else f"eager {r['eager_step_ms']:.2f}" + (
            f", graph {r['graph_step_ms']:.2f}" if "graph_step_ms" in r else "")
        kinds = ", ".join(f"{n} {v:.3f}" for n, v in k["ms_by_kind"].items())
        lines.append(f"| {label} | {k['kernels_per_unit']:.0f} | {k['total_ms']:.3f} | {wall} | {kinds} |")
    return lines


SECTIONS = ("native", "profile", "correctness", "transitions", "hf", "native-variants")  # main's order


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny shape on CPU, fp32: a smoke test in seconds")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="seconds after which no static-cache baseline or extra native variant is started")
    ap.add_argument("--commit", default="")
    ap.add_argument("--compile", action="store_true",
                    help="CPU only: also run native with a compiled step (on CUDA the default native run compiles)")
    ap.add_argument("--batches", type=int, nargs="+", metavar="B", help="batch sizes (default 64 256; tiny: 2 4)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="S",
                    help=f"the sections to run, in the fixed order ({', '.join(SECTIONS)}; default all)")
    a = ap.parse_args()
    tiny = a.tiny
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    a.shape = "tiny" if tiny else "qwen2.5-1.5b"
    batches, a.prompt, a.new = ([2, 4], 16, 16) if tiny else ([64, 256], 256, 256)
    a.batches = sorted(a.batches or batches)
    a.repeats, a.train_batch = (1, 2) if tiny else (3, 4)
    a.check_batch, a.check_new = (6, 12) if tiny else (6, 48)
    a.static_reserve_s, a.extra_reserve_s = (0, 0) if tiny else (100, 40)
    a.profile_steps = 4 if tiny else 8
    dtype = torch.float32 if tiny else torch.bfloat16
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"env": {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": a.commit, "command": " ".join(sys.argv),
                   "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                   "torch": torch.__version__, "transformers": transformers.__version__,
                   "python": platform.python_version(), "shape": a.shape, "dtype": str(dtype),
                   "prompt_tokens": a.prompt, "new_tokens": a.new, "batches": a.batches},
           "errors": {}}

    def flush(r):
        (out_dir / "rollout.json").write_text(json.dumps(r, indent=1, default=str))
        (out_dir / "rollout.md").write_text(table(r) + "\n")
    a.flush = flush

    t_start = time.perf_counter()
    model = build(a.shape, dtype, device)
    res["env"]["params"] = sum(p.numel() for p in model.parameters())
    native_out = {}
    for name, fn in (("native", lambda: native_speed(model, a, res, device, [0], native_out)),
                     ("profile", lambda: profile_section(model, a, res, device)),
                     ("correctness", lambda: correctness(model, a, res, device)),
                     ("transitions", lambda: transitions(model, a, res, device)),
                     ("hf", lambda: baselines(model, a, res, device, native_out, t_start)),
                     ("native-variants", lambda: native_speed(model, a, res, device, [1, 2], native_out, t_start))):
        if name not in a.sections:
            continue
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:  # keep going: one broken section must not cost the others' numbers
            res["errors"][name] = traceback.format_exc()
            traceback.print_exc()
        res.setdefault("section_s", {})[name] = time.perf_counter() - t0
        print(f"[{time.perf_counter() - t_start:6.1f}s] {name} done", flush=True)
        flush(res)
    print(table(res))
    checked = "correctness" not in a.sections or res.get("correctness", {}).get("passed")
    return 1 if res["errors"] or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
