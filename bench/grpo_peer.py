"""GRPO side by side on one GPU: TRL's GRPOTrainer (HF generate, bitsandbytes 4-bit + LoRA) against our PpoStep.

    python bench/grpo_peer.py --shape tiny --out DIR            # CPU, seconds: both sides end to end
    python bench/grpo_peer.py --shape llama3-8b --out DIR       # CUDA (carry .whl/peer: README.md)
    python bench/grpo_peer.py --side trl --shape tiny --out DIR # one side in this process (what the driver runs)

Both sides get the same workload and start from the same weights: bench/memory.py's build_4bit (random weights
straight into NF4 with double quantisation, bf16 compute, sdpa), LoRA r16 / alpha 32 / no dropout on the seven
decoder linears, activation checkpointing (non-reentrant), one prompt x --group 8 responses per step, 1024 random
prompt tokens, exactly 1024 response tokens (EOS suppressed on both sides), micro-batch 2 x gradient accumulation
4 = one optimizer step per rollout, one pass, sampling at temperature 1, the clipped surrogate (0.2) with the KL
to the reference (the base, adapters off) in the loss at --beta 0.04 (k3), token-mean loss, rewards scaled by
the group's std, the same python reward, AdamW at a constant 1e-6, gradients clipped at 1.0. Where the sides
differ by their own design (kept: that is what is measured): TRL generates with HF generate's dynamic cache, ours
with the native static cache and a CUDA graph; TRL casts the LoRA weights to bf16 and trains under bf16 autocast,
ours keeps them float32 (weights, gradients, AdamW states) and computes them under bf16 autocast in every forward
but the decode steps (hybridcore/adapters.py mixed_precision); with one pass TRL skips the old-policy log-prob
forward (the detached current log-probs stand in), ours computes it in PpoStep.experience.

Each side runs in its own process so that each peak is its own. Per step: seconds (on_step_begin -> on_step_end
of a TrainerCallback for TRL; the whole iteration for ours), torch.cuda.max_memory_allocated / reserved, and the
device's used memory sampled every 0.1 s (nvidia-smi's figure, less what the GPU used before the process
started: the CUDA context included). The first --warmup steps are reported but not averaged. JSON per side after
every step (grpo_peer-<side>.json), the two rows together in grpo_peer.json / grpo_peer.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

GIB = 2 ** 30
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SIDES = ("ours", "trl")  # ours first: the shorter run, so a TRL overrun cannot cost our row
SHARE = {"ours": 0.4, "trl": 1.0}  # of the budget left when the side starts


# ------------------------------------------------------------------------------------------------ the workload


def reward(text: str) -> float:
    """The share of even token ids in a response: cheap, and it differs between the responses to one prompt."""
    words = text.split()
    return sum(int(w[1:]) % 2 == 0 for w in words if w[1:].isdigit()) / max(1, len(words))


def tokenizer(vocab: int):
    """A word-level tokenizer over the model's whole vocabulary ("w<id>"), so that a prompt of N random ids is
    N tokens for TRL too: id 0 pads, id 1 is EOS, no special tokens added."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = {"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    t = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="</s>", padding_side="left")


def prompts(a, vocab: int) -> list[list[int]]:
    """The prompts of every step (--prompts-per-step each), the same on both sides."""
    g = torch.Generator().manual_seed(a.seed)
    n = a.steps * a.prompts_per_step
    return torch.randint(2, vocab, (n, a.prompt_len), generator=g).tolist()


def text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def build(a, device):
    """The random-weight 4-bit model of --shape (bench/memory.py's build, seed 1)."""
    from bench.memory import build_4bit
    return build_4bit(a.shape, False, device, seed=1)


# ------------------------------------------------------------------------------------------------ measuring


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class DeviceUsed:
    """The whole GPU's used memory (what nvidia-smi shows), sampled every 0.1 s on a thread; take() returns the
    most seen since the last take()."""

    def __init__(self):
        self.read = self._reader()
        self.most, self.stop = 0, threading.Event()
        self.idle = self.read()  # before this process made its CUDA context
        threading.Thread(target=self._loop, daemon=True).start()

    @staticmethod
    def _reader():
        try:
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]))
            return lambda: pynvml.nvmlDeviceGetMemoryInfo(h).used
        except Exception:  # noqa: BLE001 -- no NVML: the CUDA runtime's view of the same figure
            def used():
                free, total = torch.cuda.mem_get_info()
                return total - free
            return used

    def _loop(self) -> None:
        while not self.stop.wait(0.1):
            self.most = max(self.most, self.read())

    def take(self) -> int:
        most, self.most = max(self.most, self.read()), 0
        return most


class Recorder:
    """One side's result dict, its step records and its JSON file; the device's memory counters."""

    def __init__(self, a, side: str):
        self.a, self.side, self.t0 = a, side, time.perf_counter()
        self.device = torch.device("cuda" if a.shape != "tiny" else "cpu")
        self.deadline = self.t0 + a.budget_s
        self.used = DeviceUsed() if self.device.type == "cuda" else None
        self.res = {"side": side, "shape": a.shape, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "commit": a.commit, "command": " ".join(sys.argv), "versions": versions(),
                    "workload": workload(a), "steps": []}
        if self.device.type == "cuda":
            torch.zeros(1, device="cuda")
            sync(self.device)
            self.res["gpu"] = {"name": torch.cuda.get_device_name(0),
                               "total_gib": torch.cuda.get_device_properties(0).total_memory / GIB,
                               "used_before_gib": self.used.idle / GIB,
                               "context_gib": (self.used.read() - self.used.idle - torch.cuda.memory_reserved()) / GIB}
        self.save()  # a fresh file: no earlier run's steps survive in --out

    def built(self, seconds: float, model) -> None:
        self.res["build_s"] = seconds
        self.res["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if self.device.type == "cuda":
            self.res["allocated_after_build_gib"] = torch.cuda.memory_allocated() / GIB
        self.save()

    def begin(self) -> None:
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self.used.take()
        self.t_step = time.perf_counter()

    def peak_alloc_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated() / GIB if self.device.type == "cuda" else None

    def end(self, **extra) -> dict:
        sync(self.device)
        rec = {"step": len(self.res["steps"]), "seconds": time.perf_counter() - self.t_step,
               "warmup": len(self.res["steps"]) < self.a.warmup, **extra}
        if self.device.type == "cuda":
            rec.update(max_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                       max_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                       device_used_gib=(self.used.take() - self.used.idle) / GIB)
        else:
            rec["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
        self.res["steps"].append(rec)
        self.res["summary"] = summary(self.res["steps"], self.res["workload"]["tokens_per_step"])
        self.save()
        print(f"[{self.side}] step {rec['step']}: {json.dumps(rec, default=str)}", flush=True)
        return rec

    def time_left(self, last_s: float) -> bool:
        """Whether another step of about last_s seconds still fits the budget."""
        return time.perf_counter() + 1.2 * last_s < self.deadline

    def save(self) -> None:
        self.res["wall_s"] = time.perf_counter() - self.t0
        (self.a.out / f"grpo_peer-{self.side}.json").write_text(json.dumps(self.res, indent=1, default=str))


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "datasets"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 -- TRL and datasets are only needed on its side
            out[name] = None
    return out


def workload(a) -> dict:
    rows = a.prompts_per_step * a.group
    return {"prompts_per_step": a.prompts_per_step, "group": a.group, "sequences": rows, "prompt": a.prompt_len,
            "response": a.response_len, "micro_batch": a.micro, "grad_accum": rows // a.micro, "beta": a.beta,
            "lr": a.lr, "tokens_per_step": rows * (a.prompt_len + a.response_len),
            "lora": {"rank": 16, "alpha": 32, "dropout": 0.0, "targets": list(TARGETS)}}


def summary(steps: list[dict], tokens: int) -> dict:
    measured = [s for s in steps if not s["warmup"]] or steps
    s_per_step = sum(s["seconds"] for s in measured) / len(measured)
    out = {"measured_steps": len(measured), "from_warmup": measured is steps, "s_per_step": s_per_step,
           "tokens_per_s": tokens / s_per_step,
           "lengths_ok": all(s.get("lengths_ok", True) for s in steps)}
    for k in ("max_allocated_gib", "max_reserved_gib", "device_used_gib", "max_rss_gib", "rollout_s"):
        if all(k in s for s in measured):
            out[k] = max(s[k] for s in measured) if k != "rollout_s" else sum(s[k] for s in measured) / len(measured)
            if k != "rollout_s":
                out[k + "_all_steps"] = max(s[k] for s in steps)
    return out


# ------------------------------------------------------------------------------------------------ TRL's side


def trl(a) -> None:
    """TRL's GRPOTrainer: HF generate (use_vllm=False, dynamic cache), its own peft wrapping of the same 4-bit
    model (peft_config), the reference = that model with the adapter disabled (beta > 0)."""
    import datasets
    import trl as trl_lib
    from peft import LoraConfig
    from transformers import TrainerCallback

    rec, t0 = Recorder(a, "trl"), time.perf_counter()
    model = build(a, rec.device)
    vocab, rows = model.config.vocab_size, a.prompts_per_step * a.group
    tok, lengths, timing = tokenizer(vocab), [], {}
    data = datasets.Dataset.from_dict({"prompt": [text(p) for p in prompts(a, vocab)]})

    def even_ids(prompts, completions, completion_ids, **kw):
        lengths.extend(len(c) for c in completion_ids)
        return [reward(c) for c in completions]

    class Timed(trl_lib.GRPOTrainer):
        def _generate_single_turn(self, *args, **kw):  # HF generate: its seconds, and the step's peak so far
            sync(rec.device)
            t = time.perf_counter()
            out = super()._generate_single_turn(*args, **kw)
            sync(rec.device)
            timing["rollout_s"] = timing.get("rollout_s", 0.0) + time.perf_counter() - t
            timing["rollout_peak_gib"] = rec.peak_alloc_gib()
            return out

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            timing.clear()
            lengths.clear()
            rec.begin()

        def on_step_end(self, args, state, control, **kw):
            r = rec.end(lengths_ok=bool(lengths) and set(lengths) == {a.response_len},
                        response_lengths=sorted(set(lengths)), **timing)
            if state.global_step < state.max_steps and not rec.time_left(r["seconds"]):  # as ours: not after the last
                control.should_training_stop = True
                rec.res["stopped"] = "budget"

        def on_log(self, args, state, control, logs=None, **kw):
            rec.res.setdefault("trl_logs", []).append(logs)

    cfg = trl_lib.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo_peer_trl_"), per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=rows // a.micro, num_generations=a.group, num_iterations=1,
        max_completion_length=a.response_len, generation_kwargs={"min_new_tokens": a.response_len},
        temperature=1.0, top_p=1.0, top_k=0, beta=a.beta, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        learning_rate=a.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, bf16=True,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}, use_vllm=False,
        max_steps=a.steps, logging_steps=1, save_strategy="no", report_to="none", shuffle_dataset=False,
        seed=a.seed, dataloader_num_workers=0, disable_tqdm=True, use_cpu=rec.device.type == "cpu")
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(TARGETS), bias="none",
                      task_type="CAUSAL_LM")
    trainer = Timed(model=model, reward_funcs=even_ids, args=cfg, train_dataset=data, processing_class=tok,
                    peft_config=lora, callbacks=[Steps()])
    rec.res["trl_config"] = {k: getattr(cfg, k) for k in (
        "steps_per_generation", "generation_batch_size", "loss_type", "scale_rewards", "beta", "optim",
        "gradient_checkpointing", "bf16", "use_vllm", "cache_implementation")}
    rec.built(time.perf_counter() - t0, trainer.model)
    trainer.train()
    rec.save()


# ------------------------------------------------------------------------------------------------ OUR side


def ours(a) -> None:
    """OUR SIDE: stages/ppo.py's public step object, PpoStep, with ppo.estimator grpo on share_base-free roles:
    the actor = the 4-bit base + one LoRA adapter, the reference = the same base with the adapter off
    (ppo.ActorOnBase), no critic, no reward model (the same python reward through stages/rewards.py). Each step
    is what stages/ppo.py iteration() does: the hybrid actor's native rollout (static KV cache, CUDA graph),
    PpoStep.experience (actor and reference log-probs, rewards, group advantages), PpoStep.update."""
    from hybridcore.batch import pack
    from stages.ppo import with_rollout_logprobs
    from stages.rewards import Responses

    rec, t0 = Recorder(a, "ours"), time.perf_counter()
    base = build(a, rec.device)
    vocab = base.config.vocab_size
    m, step, hybrid_actor = our_step(a, base)
    actor = hybrid_actor({"compile": None if a.rollout_compile == "auto" else False} if rec.device.type == "cuda"
                         else {})
    rec.built(time.perf_counter() - t0, m.policy)
    tok, ps = tokenizer(vocab), prompts(a, vocab)
    for it in range(a.steps):
        group = [ps[it * a.prompts_per_step + k] for k in range(a.prompts_per_step) for _ in range(a.group)]
        torch.manual_seed(a.seed * 100_003 + it)
        rec.begin()
        try:
            responses, rollout_s, rollout_peak = rollout(rec, m, actor, group, a.response_len)
        except Exception as e:  # noqa: BLE001 -- as bench/memory.py: a failed graph capture, then without a graph
            if rec.device.type != "cuda" or it > 0 or "rollout_fallback" in rec.res:
                raise
            rec.res["rollout_fallback"] = f"{type(e).__name__}: {str(e)[:300]}"
            actor = hybrid_actor({"cuda_graph": False, "compile": False})
            responses, rollout_s, rollout_peak = rollout(rec, m, actor, group, a.response_len)
        t = time.perf_counter()
        batch = pack(group, responses, 0, rec.device)
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        exp = step.experience(batch, Responses(it, [text(p) for p in group], texts, [{} for _ in group]))
        with_rollout_logprobs(exp, actor)  # so metrics() logs rollout_logprob_gap, as a PPO run does
        sync(rec.device)
        t2 = time.perf_counter()
        stats = step.update(batch, exp, a.seed + it, it)
        sync(rec.device)
        lengths = [len(r) for r in responses]
        r = rec.end(lengths_ok=set(lengths) == {a.response_len}, response_lengths=sorted(set(lengths)),
                    rollout_s=rollout_s, rollout_peak_gib=rollout_peak, experience_s=t2 - t,
                    rollout_stats={k: v for k, v in actor.last_stats.items() if isinstance(v, (int, float, str))},
                    update_s=time.perf_counter() - t2, metrics={**step.metrics(exp, a.response_len), **stats})
        if it + 1 < a.steps and not rec.time_left(r["seconds"]):
            rec.res["stopped"] = "budget"
            break
    actor.close()
    rec.save()


def our_rewards(cfg):
    """The python reward through stages/rewards.py, no reward model (also bench/memory.py --estimator grpo's)."""
    from stages.rewards import Rewards
    return Rewards(cfg, False, lambda ps, rs, rows_: [reward(t) for t in rs], "bench/grpo_peer.py reward")


def our_step(a, base):
    """(the roles, the PpoStep, a maker of the hybrid actor) for GRPO on `base`, as stages/ppo.py builds them for
    engine.share_base with a critic-free estimator: one plain torch AdamW engine for the actor's adapter."""
    import stages.ppo as ppo
    from bench.memory import grpo_config, grpo_roles
    from hybridcore.actor import HybridActor
    from hybridcore.adapters import LoraSpec

    m, engine = grpo_roles(base, LoraSpec(16, 32.0, TARGETS), a.lr, a.steps, a.micro, a.host_optimizer_states)
    cfg = grpo_config(a.group, a.micro, a.response_len, prompts=a.prompts_per_step, iterations=a.steps, lr=a.lr,
                      beta=a.beta)
    no_eos = SimpleNamespace(pad_token_id=0, eos_token_id=None)  # no stop token: every response runs to full length

    def hybrid_actor(opts: dict) -> HybridActor:
        actor = HybridActor(m.policy, no_eos, activation_checkpointing=True, backend="native", backend_options=opts,
                            train_engine=engine, optimizer=engine.optimizer if a.rollout_offload_optimizer else None,
                            offload_optimizer=a.rollout_offload_optimizer, fused_4bit=a.fused_decode)
        m.train()
        return actor

    return m, ppo.PpoStep(cfg, m, [engine], our_rewards(cfg), a.micro), hybrid_actor  # no stop tokens, as the actor's


def rollout(rec: Recorder, m, actor, group: list[list[int]], n_new: int):
    """(responses, seconds, the step's peak allocated GiB so far) of one rollout, as stages/ppo.py rolls out."""
    t = time.perf_counter()
    with m.use("actor"), actor.rollout():
        responses = actor.generate(group, n_new, temperature=1.0, top_k=0, top_p=1.0)
    sync(rec.device)
    return responses, time.perf_counter() - t, rec.peak_alloc_gib()


# ------------------------------------------------------------------------------------------------ driver


def side_args(a, side: str, budget: float) -> list[str]:
    """This script's command line for one side in its own process."""
    keys = ("shape", "out", "steps", "warmup", "group", "prompts_per_step", "prompt_len", "response_len", "micro",
            "beta", "lr", "seed", "commit", "rollout_compile", "rollout_offload_optimizer", "host_optimizer_states",
            "fused_decode")
    flags = []
    for k in keys:
        v, flag = getattr(a, k), f"--{k.replace('_', '-')}"
        flags += [] if v is False else [flag] if v is True else [flag, str(v)]  # switches: present or absent
    return [sys.executable, "-u", str(Path(__file__).resolve()), "--side", side, "--budget-s", f"{budget:.0f}", *flags]


def run_side(a, side: str, budget: float) -> int:
    """One side as a subprocess, its output teed to grpo_peer-<side>.log; killed (its process group) 30 s past its
    budget (the side itself stops starting steps that would not fit)."""
    with open(a.out / f"grpo_peer-{side}.log", "w") as log:
        p = subprocess.Popen(side_args(a, side, budget), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)

        def tee():
            for line in p.stdout:
                log.write(line)
                log.flush()
                sys.stdout.write(line)
                sys.stdout.flush()
        reader = threading.Thread(target=tee, daemon=True)
        reader.start()
        try:
            rc = p.wait(timeout=budget + 30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            rc = p.wait()
            print(f"[driver] {side}: killed after {budget + 30:.0f} s", flush=True)
        reader.join(timeout=10)
    return rc


def driver(a) -> int:
    """Each side in turn in its own process, then the two rows together."""
    t0, res = time.perf_counter(), {"sides": {}}
    for side in a.sides:
        left = a.budget_s - (time.perf_counter() - t0)
        budget = left * (SHARE[side] if side != a.sides[-1] else 1.0)
        rc = run_side(a, side, budget)
        path = a.out / f"grpo_peer-{side}.json"
        res["sides"][side] = {**(json.loads(path.read_text()) if path.exists() else {}), "rc": rc}
        (a.out / "grpo_peer.json").write_text(json.dumps(res, indent=1, default=str))
    (a.out / "grpo_peer.md").write_text(markdown(res))
    print(markdown(res), flush=True)
    return int(any(s["rc"] != 0 or not s.get("steps") for s in res["sides"].values()))


def fmt(x, spec: str = ".2f") -> str:
    return "" if x is None else format(x, spec)


def markdown(res: dict) -> str:
    sides = res["sides"]
    first = next((s for s in sides.values() if "workload" in s), {})
    w, gpu = first.get("workload", {}), first.get("gpu", {})
    lines = [f"# GRPO step, {first.get('shape')} shape, {gpu.get('name', 'CPU')}: TRL GRPOTrainer vs ours", "",
             f"{w.get('prompts_per_step')} prompt x {w.get('group')} responses, {w.get('prompt')} prompt + "
             f"{w.get('response')} response tokens ({w.get('tokens_per_step')} tokens/step), micro-batch "
             f"{w.get('micro_batch')} x {w.get('grad_accum')}, beta {w.get('beta')}.", "",
             "| side | s/step | tokens/s | rollout s | peak allocated GiB | peak reserved GiB | device used GiB | "
             "build s | steps measured | full-length responses | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for side, s in sides.items():
        lines.append(row(side, s))
    return "\n".join(lines) + "\n"


def row(side: str, s: dict) -> str:
    """One side's markdown row: measured steps only (warm-up left out), peaks over those steps."""
    name = {"trl": f"TRL {s.get('versions', {}).get('trl')} GRPOTrainer (HF generate)",
            "ours": "ours (PpoStep, grpo, native rollout)"}[side]
    m = s.get("summary", {})
    note = s.get("error", "")[:120] or ("" if s.get("rc", 0) == 0 else f"exit {s.get('rc')}")
    if s.get("stopped"):
        note += f" stopped early ({s['stopped']})"
    if s.get("rollout_fallback"):
        note += " rollout without CUDA graph"
    switches = {"--rollout-offload-optimizer": "AdamW states on the CPU during the rollout",
                "--host-optimizer-states": "AdamW states on the CPU between steps",
                "--fused-decode": "fused NF4 decode"}
    if side == "ours":  # the driver passes its whole command line to both sides; these only change ours
        used = [text for flag, text in switches.items() if flag in s.get("command", "").split()]
        note = "; ".join(x for x in (note.strip(), *used) if x)
    peak = m.get("max_allocated_gib", m.get("max_rss_gib"))
    return (f"| {name} | {fmt(m.get('s_per_step'), '.1f')} | {fmt(m.get('tokens_per_s'), '.0f')} | "
            f"{fmt(m.get('rollout_s'), '.1f')} | {fmt(peak)}{'' if 'max_allocated_gib' in m or not m else ' (RSS)'} | "
            f"{fmt(m.get('max_reserved_gib'))} | {fmt(m.get('device_used_gib'))} | {fmt(s.get('build_s'), '.1f')} | "
            f"{m.get('measured_steps', 0)}{' (warm-up)' if m.get('from_warmup') else ''} | "
            f"{'yes' if m.get('lengths_ok') else 'NO' if m else ''} | {note.strip()} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", help="a shape of bench/memory.py's SHAPES (tiny: CPU)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--side", choices=SIDES, help="run one side in this process (default: both, one process each)")
    ap.add_argument("--sides", default=",".join(SIDES), help="the driver's sides, in order")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per side, warm-up included")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the means")
    ap.add_argument("--group", type=int, default=8, help="responses per prompt (num_generations, samples_per_prompt)")
    ap.add_argument("--prompts-per-step", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=None, help="default 1024 (tiny: 16)")
    ap.add_argument("--response-len", type=int, default=None, help="default 1024 (tiny: 16)")
    ap.add_argument("--micro", type=int, default=2, help="micro-batch; accumulation = sequences per step / micro")
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient (TRL's beta, our kl_coef in the loss)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default="")
    ap.add_argument("--rollout-offload-optimizer", action="store_true",
                    help="ours: the actor's AdamW states on the CPU while it rolls out (engine.rollout.offload_optimizer)")
    ap.add_argument("--host-optimizer-states", action="store_true",
                    help="ours: AdamW's moments in pinned CPU memory between steps (engine.optimizer_states: host)")
    ap.add_argument("--fused-decode", action="store_true",
                    help="ours: decode steps' 4-bit linears through the fused NF4 kernel (engine.rollout.decode_4bit: "
                         "fused; CUDA)")
    ap.add_argument("--rollout-compile", choices=("off", "auto"), default="off",
                    help="ours: torch.compile the native decode step (auto) or only capture a CUDA graph (off)")
    ap.add_argument("--budget-s", type=float, default=520.0, help="wall-clock budget of the whole run (or one side)")
    a = ap.parse_args()
    default_len = 16 if a.shape == "tiny" else 1024
    a.prompt_len, a.response_len = a.prompt_len or default_len, a.response_len or default_len
    a.sides = [s for s in a.sides.split(",") if s]
    rows = a.prompts_per_step * a.group
    if rows % a.micro or a.group < 2 or a.steps <= a.warmup:
        ap.error(f"expected --micro dividing {rows} sequences, --group >= 2 and --steps > --warmup")
    a.out.mkdir(parents=True, exist_ok=True)
    if a.side is None:
        return driver(a)
    try:
        (ours if a.side == "ours" else trl)(a)
    except Exception as e:  # noqa: BLE001 -- recorded in the side's JSON, then the exit code says so
        path = a.out / f"grpo_peer-{a.side}.json"
        res = json.loads(path.read_text()) if path.exists() else {"side": a.side}
        res.update(error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}",
                   traceback=traceback.format_exc()[-4000:])
        path.write_text(json.dumps(res, indent=1, default=str))
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
