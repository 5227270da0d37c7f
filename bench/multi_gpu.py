"""PPO on several GPUs (issue 9): one torchrun job per 3D layout, each timed and measured the same way.

    python bench/multi_gpu.py --shape llama3-8b --gpus 8 --out DIR    # CUDA/NCCL: an 8B-shaped actor, bf16
    python bench/multi_gpu.py --shape tiny --gpus 2 --out DIR         # CPU/gloo: the same code path in a minute

Layouts (world = dp x tp, tp fastest): one GPU (the baseline of scaling efficiency), dp-only (ZeRO-2), tp-only,
dp x tp (ZeRO-2, N >= 4) and rollout tp smaller than training tp. Every layout runs the pipeline's own code:
parallel.init's groups, tensor_parallel.split_model, engine.make_engine, HybridActor (rollout_tp=) and
stages/ppo.py's PpoStep (experience, update), on random weights, greedy (fp32 layouts must produce the same tokens,
checked; bf16 ones report their share of equal tokens). JSON and a markdown table go to --out after every layout,
so a timeout keeps what ran.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2 ** 30
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
                 rms_norm_eps=1e-5)
LLAMA32_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
                  rms_norm_eps=1e-5)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=512, max_position_embeddings=128,
            initializer_range=0.2)  # sharper logits than 0.02: varied greedy tokens, not one repeated id
# shape -> actor (= reference) dims, critic (= reward model) dims, what the critic is, workload, first estimate (s).
# An 8B actor trained in full (bf16 weights + grads + AdamW states, 64 GB) plus a reference (16 GB) leaves no
# room for a same-shape trained critic (another 64 GB) on the one-GPU baseline, so its critic is 1B-shaped.
SHAPES = {
    "llama3-8b": SimpleNamespace(actor=LLAMA3_8B, critic=LLAMA32_1B, dtype="bf16", prompt=256, new=256, batch=16,
                                 micro=2, estimate_s=150.0,
                                 critic_note="critic and reward model: Llama-3.2-1B shape (full fine-tune); a "
                                             "same-shape 8B critic does not fit the one-GPU baseline"),
    "tiny": SimpleNamespace(actor=TINY, critic=TINY, dtype="fp32", prompt=8, new=8, batch=8, micro=2, estimate_s=60.0,
                            critic_note="critic and reward model: the actor's shape (full fine-tune)"),
}
PAD = 0


def layouts(gpus: int) -> list[dict]:
    """The layouts that fit `gpus` ranks: name, dp, tp, zero_stage, rollout_tp."""
    out = [dict(name="one GPU", dp=1, tp=1, zero_stage=0, rollout_tp=1)]
    if gpus < 2:
        return out
    out += [dict(name=f"dp={gpus} ZeRO-2", dp=gpus, tp=1, zero_stage=2, rollout_tp=1),
            dict(name=f"tp={gpus}", dp=1, tp=gpus, zero_stage=0, rollout_tp=gpus)]
    if gpus >= 4:
        tp = gpus // 2
        out.append(dict(name=f"dp=2 x tp={tp} ZeRO-2", dp=2, tp=tp, zero_stage=2, rollout_tp=tp))
    out.append(dict(name=f"tp={gpus} -> rollout tp={gpus // 2}", dp=1, tp=gpus, zero_stage=0, rollout_tp=gpus // 2))
    return out


# ------------------------------------------------------------------------------------------------ one rank


def build(cls, dims: dict, dtype, device, seed: int, **extra):
    """Random weights straight on `device` in `dtype`; the same seed on every rank gives the same weights."""
    import torch
    from transformers import LlamaConfig
    config = LlamaConfig(**dims, tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
                         attn_implementation="sdpa", **extra)
    torch.manual_seed(seed)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config)
    finally:
        torch.set_default_dtype(saved)


def peak_bytes(device) -> tuple[int, str]:
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cpu_max_rss"


def worker(a) -> None:
    """One rank: build the roles in the layout, run --steps PPO steps, rank 0 writes the gathered figures."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    import stages.ppo as ppo
    from stages.rewards import Responses, Rewards
    from hybridcore import parallel
    from hybridcore.actor import HybridActor
    from hybridcore.batch import pack
    from hybridcore.models import set_activation_checkpointing
    from hybridcore.parallel import Layout, dp_share
    from hybridcore.tensor_parallel import split_model
    from hybridcore.engine import make_engine
    from stages.params import PPO

    lay = json.loads(a.worker)
    s = SHAPES[a.shape]
    layout = Layout(dp=lay["dp"], tp=lay["tp"], zero_stage=lay["zero_stage"])
    t0 = time.perf_counter()
    g = parallel.init(layout)
    dev = g.device
    dtype = torch.bfloat16 if s.dtype == "bf16" else torch.float32

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def split(model):
        return split_model(model, g.tp_group, layout.tp, g.tp_rank) if layout.tp > 1 else model

    policy = split(build(LlamaForCausalLM, s.actor, dtype, dev, seed=1))
    ref = build(LlamaForCausalLM, s.actor, dtype, dev, seed=1).requires_grad_(False).eval()  # whole, as the stage
    critic = split(build(LlamaForSequenceClassification, s.critic, dtype, dev, seed=2, num_labels=1))
    rm = build(LlamaForSequenceClassification, s.critic, dtype, dev, seed=2, num_labels=1).requires_grad_(False).eval()
    m = ppo.Models(policy, ref, critic, rm, policy, critic, {})
    engines = [make_engine(model, lr=1e-6, total_steps=100, warmup_ratio=0.0, min_lr_ratio=1.0, max_grad_norm=1.0,
                           layout=layout, groups=g, micro_batch=s.micro) for model in (policy, critic)]
    m.frozen_check([e.trained for e in engines])
    for model in (policy, critic):
        set_activation_checkpointing(model, True)
        model.train()
    tok = SimpleNamespace(pad_token_id=PAD, eos_token_id=None)  # no EOS: every response runs to full length
    opts = {"compile": None if a.rollout_compile == "auto" else False} if dev.type == "cuda" else {}
    actor = HybridActor(policy, tok, activation_checkpointing=True, backend="native", backend_options=opts,
                        groups=g, rollout_tp=lay["rollout_tp"], train_engine=engines[0])
    cfg = PPO(rollout_batch_size=s.batch, minibatch_size=s.batch, micro_batch_size=s.micro, ppo_epochs=1,
              iterations=a.steps, max_new_tokens=s.new)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, s.actor["vocab_size"], (s.batch, s.prompt), generator=gen).tolist()
    mine = dp_share(prompts, g)
    step = ppo.PpoStep(cfg, m, engines, Rewards(cfg, uses_rm=True), s.micro)
    sync()
    build_s = time.perf_counter() - t0
    steps, first_tokens = [], None
    for it in range(a.steps):
        torch.manual_seed(1000 + it)
        t = [time.perf_counter()]
        with actor.rollout():
            responses = actor.generate(mine, s.new, greedy=True)
        sync()
        t.append(time.perf_counter())
        batch = pack(mine, responses, PAD, dev)
        exp = step.experience(batch, Responses(it, [], [], [], scored=batch))  # the RM reads the same tokens
        sync()
        t.append(time.perf_counter())
        stats = step.update(batch, exp, it, it)
        sync()
        t.append(time.perf_counter())
        if it == 0:
            first_tokens = responses
        steps.append({"rollout_s": t[1] - t[0], "scoring_s": t[2] - t[1], "update_s": t[3] - t[2],
                      "step_s": t[3] - t[0], "transition_s": dict(actor.last_transition_s),
                      "transition_bytes": dict(actor.last_transition_bytes),
                      "policy_loss": stats["policy_loss"], "value_loss": stats["value_loss"]})
    peak, kind = peak_bytes(dev)
    mine_out = {"rank": g.rank, "dp_rank": g.dp_rank, "tp_rank": g.tp_rank, "peak_bytes": peak, "steps": steps,
                "tokens": first_tokens}
    if g.world > 1:
        every = [None] * g.world
        dist.all_gather_object(every, mine_out)
    else:
        every = [mine_out]
    if g.rank == 0:
        tokens = [row for d in range(layout.dp) for row in every[d * layout.tp]["tokens"]]  # dp shares, in order
        res = {"build_s": build_s, "peak_kind": kind, "world": g.world, "device": str(dev),
               "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
               "peak_gib_per_rank": [r["peak_bytes"] / GIB for r in every],
               "per_rank_steps": [r["steps"] for r in every], "tokens": tokens}
        Path(a.result).write_text(json.dumps(res))
    # every rank past its last collective (and rank 0's write) before any tears the group down, as stages/rank.py
    # does. Without it a dp=2 ZeRO-2 rank aborted at exit ("terminate called without an active exception"), after
    # the result was written, in 2 of 4 fresh CI runs (2026-12-06); not reproduced outside CI, so a likely cause
    parallel.barrier()
    actor.close()
    parallel.shutdown()


# ------------------------------------------------------------------------------------------------ the driver


def summarize(lay: dict, raw: dict, s, steps: int) -> dict:
    """Per phase the slowest rank's seconds, averaged over the steps after the first (the warm-up) when there
    are several; tokens/s counts every sequence token (prompt + response) of the global rollout batch."""
    timed = slice(1, None) if steps > 1 else slice(0, None)
    out = {}
    for k in ("rollout_s", "scoring_s", "update_s", "step_s"):
        per_step = [max(rank[i][k] for rank in raw["per_rank_steps"]) for i in range(steps)][timed]
        out[k] = sum(per_step) / len(per_step)
    r0 = raw["per_rank_steps"][0][-1]
    tokens = s.batch * (s.prompt + s.new)
    out.update(tokens_per_step=tokens, tokens_per_s=tokens / out["step_s"],
               rollout_tokens_per_s=s.batch * s.new / out["rollout_s"],
               transition_enter_s=r0["transition_s"].get("enter", 0.0),
               transition_exit_s=r0["transition_s"].get("exit", 0.0),
               transition_bytes=r0["transition_bytes"],
               peak_gib_per_rank=raw["peak_gib_per_rank"], peak_gib_max=max(raw["peak_gib_per_rank"]),
               peak_kind=raw["peak_kind"], build_s=raw["build_s"], device=raw["device"], gpu=raw["gpu"],
               warmup_step_s=max(rank[0]["step_s"] for rank in raw["per_rank_steps"]),
               policy_loss=r0["policy_loss"], value_loss=r0["value_loss"], tokens=raw["tokens"])
    return out


def markdown(res: dict) -> str:
    match = ", ".join(f"{r['name']} {r['tokens_match_first']:.3f}" for r in res["layouts"] if "tokens_match_first" in r)
    lines = [f"# PPO across layouts, {res['shape']} on {res['gpus']} {res['device_kind']}", "",
             f"{res['critic']}. Actor {res['dtype']}, full fine-tune, rollout batch {res['workload']['batch']} x "
             f"({res['workload']['prompt']} prompt + {res['workload']['new']} new tokens), greedy, micro-batch "
             f"{res['workload']['micro']}, {res['steps']} steps (the first a warm-up when more than one). "
             f"Rollout tokens equal across layouts: **{res.get('tokens_equal')}** (share of token positions equal "
             f"to the first layout's: {match}).", "",
             "| layout | world | s/step | rollout s | scoring s | update s | tokens/s | scaling eff. | "
             "enter s | exit s | peak GiB/rank (max) | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["layouts"]:
        if "step_s" not in r:
            note = r.get("skipped") or r.get("error", "")
            lines.append(f"| {r['name']} | {r['world']} |" + "  |" * 9 + f" {note} |")
            continue
        eff = "" if r.get("scaling_efficiency") is None else f"{r['scaling_efficiency']:.2f}"
        lines.append(f"| {r['name']} | {r['world']} | {r['step_s']:.3f} | {r['rollout_s']:.3f} | "
                     f"{r['scoring_s']:.3f} | {r['update_s']:.3f} | {r['tokens_per_s']:.0f} | {eff} | "
                     f"{r['transition_enter_s']:.3f} | {r['transition_exit_s']:.3f} | {r['peak_gib_max']:.2f} | "
                     f"{r['wall_s']:.0f} s wall, peak = {r['peak_kind']} |")
    return "\n".join(lines) + "\n"


def save(res: dict, out: Path) -> None:
    (out / "multi_gpu.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "multi_gpu.md").write_text(markdown(res))


def launch(a, lay: dict, result: Path, timeout_s: float) -> tuple[int, str]:
    """One torchrun job; it and every rank it started (each in a session of its own) are killed when it fails,
    runs past `timeout_s`, or the driver gets SIGTERM -- stages/launch.py's job_processes / kill_job."""
    from hybridcore.parallel import free_port
    from stages.launch import job_processes, kill_job
    world = lay["dp"] * lay["tp"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(Path(__file__).resolve()),
           "--shape", a.shape, "--out", str(a.out), "--steps", str(a.steps), "--rollout-compile", a.rollout_compile,
           "--worker", json.dumps(lay), "--result", str(result)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    log = result.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    _running[:] = [(proc.pid, frozenset())]
    deadline, rc = time.monotonic() + max(1.0, timeout_s), None
    try:
        while (rc := proc.poll()) is None and time.monotonic() < deadline:
            _running[:] = [(proc.pid, _running[0][1] | job_processes(proc.pid))]  # remembered if torchrun dies
            time.sleep(0.5)
    finally:
        kill_job(proc.pid, _running[0][1])
        _running.clear()
        proc.wait()
    text = log.read_text(errors="replace")
    if rc is None:
        return -9, f"{text}\ntimed out after {timeout_s:.0f} s (--budget-s); the job was killed"
    return rc, text


_running: list = []  # (torchrun pid, its processes seen so far) of the job now running


def _on_term(signum, frame) -> None:
    """SIGTERM/SIGINT to the driver: the running job's ranks go too."""
    from stages.launch import kill_job
    for pid, seen in list(_running):
        kill_job(pid, seen)
    sys.exit(128 + signum)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--gpus", type=int, default=2, help="N: the world of the multi-rank layouts")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=2, help="PPO steps per layout; the first is a warm-up when > 1")
    ap.add_argument("--budget-s", type=float, default=540.0, help="skip layouts that would not finish within this")
    ap.add_argument("--only", default="", help="comma-separated layout names (default: every layout that fits)")
    ap.add_argument("--rollout-compile", choices=("off", "auto"), default="off",
                    help="CUDA: torch.compile the native decode step (auto) or not (off, fits the budget)")
    ap.add_argument("--commit", default="")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0
    signal.signal(signal.SIGTERM, _on_term)  # before anything slow: a cancelled call leaves no rank behind
    signal.signal(signal.SIGINT, _on_term)
    if a.gpus < 1 or a.steps < 1:
        print(f"--gpus and --steps: found {a.gpus} and {a.steps}, expected whole numbers >= 1", file=sys.stderr)
        return 2
    import torch
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < a.gpus:
        print(f"--gpus: found {a.gpus}, but this machine has {torch.cuda.device_count()} GPUs", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    s = SHAPES[a.shape]
    todo = layouts(a.gpus)
    if a.only:
        names = [n.strip() for n in a.only.split(",")]
        unknown = [n for n in names if n not in {x["name"] for x in todo}]
        if unknown:
            print(f"--only: found {unknown}, expected names among {[x['name'] for x in todo]}", file=sys.stderr)
            return 2
        todo = [x for x in todo if x["name"] in names]
    res = {"shape": a.shape, "gpus": a.gpus, "device_kind": "GPUs (NCCL)" if cuda else "CPU ranks (gloo)",
           "commit": a.commit, "torch": torch.__version__, "dtype": s.dtype, "critic": s.critic_note,
           "workload": {"batch": s.batch, "prompt": s.prompt, "new": s.new, "micro": s.micro},
           "steps": a.steps, "budget_s": a.budget_s, "layouts": []}
    has_ds = importlib.util.find_spec("deepspeed") is not None
    start, failed = time.perf_counter(), False
    for lay in todo:
        row = {**lay, "world": lay["dp"] * lay["tp"]}
        res["layouts"].append(row)
        walls = [r["wall_s"] for r in res["layouts"] if "wall_s" in r]
        estimate = 1.2 * max(walls) if walls else s.estimate_s
        left = a.budget_s - (time.perf_counter() - start)
        if lay["zero_stage"] and not has_ds:
            row["skipped"] = (f"deepspeed is not importable: layout '{lay['name']}' needs "
                              f"ZeRO-{lay['zero_stage']}; carry .whl/briefD, pip install --no-deps --target /tmp/site "
                              f".whl/briefD/*.whl and set PYTHONPATH=/tmp/site")
        elif estimate > left:
            row["skipped"] = f"skipped: estimated {estimate:.0f} s, {left:.0f} s of --budget-s left"
        if "skipped" in row:
            print(row["skipped"], flush=True)
            save(res, a.out)
            continue
        print(f"layout {lay['name']} (world {row['world']}) ...", flush=True)
        result = a.out / f"raw-{row['world']}-{lay['dp']}x{lay['tp']}-r{lay['rollout_tp']}.json"
        result.unlink(missing_ok=True)
        t0 = time.perf_counter()
        rc, text = launch(a, lay, result, left)
        row["wall_s"] = time.perf_counter() - t0
        if rc != 0 or not result.exists():
            failed = True
            row["error"] = f"rc {rc}: " + (text.strip().splitlines() or [""])[-1][:300]
            row["log_tail"] = text[-4000:]
            print(text[-3000:], flush=True)
        else:
            try:
                row.update(summarize(lay, json.loads(result.read_text()), s, a.steps))
            except Exception:  # noqa: BLE001 -- a bad result is recorded, the next layout still runs
                failed = True
                row["error"] = traceback.format_exc()[-2000:]
        base = next((r for r in res["layouts"] if r["world"] == 1 and "tokens_per_s" in r), None)
        for r in res["layouts"]:
            if "tokens_per_s" in r and base is not None:
                r["scaling_efficiency"] = r["tokens_per_s"] / (r["world"] * base["tokens_per_s"])
        ran = [r for r in res["layouts"] if "tokens" in r]
        for r in ran:  # share of greedy token positions equal to the first layout's
            pairs = [(x, y) for ra, rb in zip(r["tokens"], ran[0]["tokens"]) for x, y in zip(ra, rb)]
            r["tokens_match_first"] = sum(x == y for x, y in pairs) / max(1, len(pairs))
        res["tokens_equal"] = all(r["tokens"] == ran[0]["tokens"] for r in ran) if len(ran) > 1 else None
        save(res, a.out)
    print(markdown(res))
    # fp32 greedy must agree exactly across layouts; in bf16 the tp all-reduce order may flip near-ties (reported)
    return 1 if failed or (res.get("tokens_equal") is False and s.dtype == "fp32") else 0


if __name__ == "__main__":
    sys.exit(main())
