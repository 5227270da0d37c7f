"""PPO memory on one card: an 8B / 14B-shaped model, 4-bit, inside 22 GiB, measured phase by phase.

    python bench/memory.py --shape tiny --out DIR          # CPU, seconds: the same code path on a tiny shape
    python bench/memory.py --shape llama3-8b --out DIR     # CUDA: the write-up's recipe, plus the ablation table
    python bench/memory.py --shape qwen2.5-14b --out DIR   # CUDA: the same recipe on a 14B shape
    python bench/memory.py --shape llama3-8b --estimator grpo --out DIR  # CUDA: critic-free GRPO, no RM

The models are random weights built straight into the quantised layout (never a bf16 copy of the whole model:
the process is capped at 22 GiB, what a 24 GB card leaves): decoder Linears become bitsandbytes NF4 (double
quantisation, bf16 compute) one at a time from random bf16 weights; embeddings, norms and heads stay bf16. From
there everything is the pipeline's own code: share_base (actor + critic LoRA adapters and a value head on one
frozen 4-bit base, reference = adapters off), a separate 4-bit reward model, activation checkpointing, the
chunked LM head, the native rollout through HybridActor, and stages/ppo.py's PpoStep (experience, update) with
the memory ledger's phases. Workload: 1024 prompt + 1024 response tokens, rollout batch 8, micro-batch 2,
gradient accumulation 4 (minibatch 8), one PPO epoch, sdpa. JSON and markdown go to --out after every row.

--estimator grpo: the same workload as 1 prompt x 8 samples (ppo.samples_per_prompt 8, rollout_batch_size 1) with
no critic and no reward model built: the actor is the LoRA adapter on the frozen 4-bit base (stages/ppo.py's
ActorOnBase, what share_base builds for a critic-free estimator), the reference that base with the adapter off,
the KL (k3) in the loss, the reward bench/grpo_peer.py's Python function; phases rollout, scoring, actor_update.
Its files are memory-<shape>-grpo.json / .md.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402

import stages.estimators as estimators  # noqa: E402
import stages.ppo as ppo  # noqa: E402
import stages.rewards as rewards  # noqa: E402
from stages.ppo import PpoStep  # noqa: E402
from stages.rewards import Responses, Rewards  # noqa: E402
from hybridcore import forward, optim, qlora_linear, rmsnorm  # noqa: E402
from hybridcore.actor import HybridActor  # noqa: E402
from hybridcore.adapters import LoraSpec  # noqa: E402
from hybridcore.batch import pack  # noqa: E402
from hybridcore.ledger import MemoryLedger, quant_state_tensors, storage_bytes  # noqa: E402
from hybridcore.quant import keep_one_4bit_layout  # noqa: E402
from hybridcore.shared_base import SharedBase, value_head  # noqa: E402
from hybridcore.engine import make_engine  # noqa: E402
from hybridcore.models import park, set_activation_checkpointing  # noqa: E402

GIB, MIB = 2 ** 30, 2 ** 20
CAP_GIB = 22.0
TARGET_GIB = {"llama3-8b": 18.0, "qwen2.5-14b": CAP_GIB}
SHAPES = {  # (family, config); the published models' shapes
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)),
    "qwen2.5-14b": ("qwen2", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                                  num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                  rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6)),
    "tiny": ("llama", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)),
}
LORA = LoraSpec(16, 32.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
PAD = 0


# ------------------------------------------------------------------------------------------------ models


def model_classes(family: str):
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
        return LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification
    return Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification


def build_4bit(shape: str, scorer: bool, device: torch.device, seed: int, park: torch.device | None = None):
    """A random-weight model of `shape` with NF4 decoder Linears, built layer by layer on `device` (no bf16 copy of
    the whole model ever exists). park: move each finished layer there (a model kept on the CPU)."""
    import bitsandbytes as bnb

    family, dims = SHAPES[shape]
    config_cls, lm_cls, scorer_cls = model_classes(family)
    config = config_cls(**dims, tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
                        num_labels=1, attn_implementation="sdpa")
    with torch.device("meta"):
        model = (scorer_cls if scorer else lm_cls)(config)
    torch.manual_seed(seed)
    bf16, std = torch.bfloat16, 0.02
    where = park or device
    for layer in model.model.layers:
        for name, lin in list(layer.named_modules()):
            if not isinstance(lin, torch.nn.Linear):
                continue
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=bf16,
                                  compress_statistics=True, quant_type="nf4", device="meta")
            w = torch.randn(lin.out_features, lin.in_features, dtype=bf16, device=device) * std
            q.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4",
                                         module=q)._quantize(device)
            del w
            if lin.bias is not None:
                q.bias = torch.nn.Parameter(torch.zeros(lin.out_features, dtype=bf16, device=device), False)
            parent, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, leaf, q)
        _materialize(layer, device, std)
        if park is not None:
            layer.to(park)
    _materialize(model, where, std)
    rotary = model.model.rotary_emb
    with torch.device(where):
        model.model.rotary_emb = type(rotary)(config=config)
    model.is_loaded_in_4bit = True  # what from_pretrained sets; peft picks its 4-bit LoRA layer by it
    keep_one_4bit_layout(model)
    rmsnorm.install(model)  # as hybridcore/models.py's loading does
    return model.requires_grad_(False).eval()


def _materialize(module, device, std: float) -> None:
    """Real tensors for the parameters still on `meta`: norms are ones, everything else N(0, std), bf16."""
    for m in module.modules():
        for k, p in list(m._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            t = torch.empty(p.shape, dtype=torch.bfloat16, device=device)
            t.fill_(1.0) if "norm" in type(m).__name__.lower() else t.normal_(0.0, std)
            m._parameters[k] = torch.nn.Parameter(t, requires_grad=False)


def adamw(params, lr: float, steps: int, micro: int, host_states: bool = False):
    """One plain torch AdamW engine (constant lr, gradients clipped at 1.0); host_states: engine.optimizer_states
    host (the moments in pinned CPU memory between steps)."""
    return make_engine(params, lr=lr, total_steps=steps, warmup_ratio=0.0, min_lr_ratio=1.0, max_grad_norm=1.0,
                       micro_batch=micro, host_states=host_states)


def grpo_roles(base, lora: LoraSpec, lr: float, steps: int, micro: int, host_states: bool = False):
    """(Models, the actor's engine) for a critic-free estimator on `base`, as stages/ppo.py shared_models builds them
    under engine.share_base: the actor's LoRA adapter on the frozen base (ActorOnBase), the reference = the adapter
    off, no critic, no reward model; activation checkpointing on, training mode."""
    roles = ppo.ActorOnBase(base, lora)
    m = ppo.Models(roles.model, roles.model, None, None, roles.actor_params, None, {"actor": roles.actor_params},
                   roles.peft, "actor", roles)
    engine = adamw(roles.actor_params, lr, steps, micro, host_states)
    m.frozen_check([engine.trained])
    m.train()
    set_activation_checkpointing(m.policy, True)
    return m, engine


def grpo_config(group: int, micro: int, new: int, prompts: int = 1, iterations: int = 1, lr: float = 1e-6,
                beta: float = 0.04):
    """ppo.estimator grpo: `prompts` x `group` responses per rollout, one optimizer step over them (micro-batch
    `micro`), one pass, KL (k3) to the reference in the loss at `beta`, token-mean loss, std-scaled rewards."""
    from stages.params import PPO
    return PPO(rollout_batch_size=prompts, samples_per_prompt=group, minibatch_size=prompts * group,
               micro_batch_size=micro, ppo_epochs=1, iterations=iterations, max_new_tokens=new, estimator="grpo",
               scale_rewards=True, kl_in_loss=beta > 0, kl_coef=beta, loss_agg="token_mean", clip_range=0.2,
               entropy_coef=0.0, temperature=1.0, top_k=0, top_p=1.0, actor_lr=lr, max_grad_norm=1.0)


def weight_bytes(model, device_type: str) -> int:
    return storage_bytes([t for p in model.parameters() for t in (p, *quant_state_tensors(p))], device_type)


# ------------------------------------------------------------------------------------------------ the run


class Bench:
    """The PPO roles, engines and ledger of one shape, and one PPO step under a row's switches."""

    def __init__(self, a, device):
        self.a, self.device = a, device
        tiny = a.shape == "tiny"
        self.prompt_len = self.new = 16 if tiny else 1024
        self.grpo = a.estimator == "grpo"
        t0 = time.perf_counter()
        base = build_4bit(a.shape, False, device, seed=1)
        self.rm_home = torch.device("cpu") if a.rm == "cpu" else device
        if self.grpo:  # no critic, no reward model: the actor's adapter on `base`, the reference = the adapter off
            self.m, engine = grpo_roles(base, LORA, 1e-5, 100, 2)
            self.engines = [engine]
        else:
            self.m, self.engines = self.gae_roles(base)
        self.rm = self.m.rm
        self.m.frozen_check([e.trained for e in self.engines])
        self.m.train()  # as stages/ppo.py run(): activation checkpointing applies in training mode only
        models = [x for x in (self.m.policy, self.m.critic, self.rm) if x is not None]
        self.ledger = MemoryLedger(device, models=models, engines=self.engines)
        self.build_s = time.perf_counter() - t0
        self.tok = SimpleNamespace(pad_token_id=PAD, eos_token_id=None)
        self.actors: dict[tuple, HybridActor] = {}  # (offload, fused, backend)
        g = torch.Generator().manual_seed(0)
        vocab = base.config.vocab_size
        n = 1 if self.grpo else 8  # grpo: one prompt, answered 8 times (the group)
        self.prompts = [p for p in torch.randint(1, vocab, (n, self.prompt_len), generator=g).tolist()
                        for _ in range(8 // n)]
        self.responses = None
        self.rollout_fallback = None
        # engine.rollout.decode_4bit: auto (stages/ppo.py's fused_decode): the fused NF4 kernel on a GPU, as every
        # model here is 4-bit; bitsandbytes' own path on a CPU
        self.fused_default = device.type == "cuda"
        self.values_from_update = True  # ppo.values_from_update, as the pipeline's default (a row turns it off)
        self.it = 0

    def gae_roles(self, base):
        """share_base: actor and critic adapters and a value head on `base`, a separate 4-bit reward model."""
        a, device = self.a, self.device
        rm = build_4bit(a.shape, True, device, seed=2, park=torch.device("cpu") if a.rm == "cpu" else None)
        if a.rm == "cpu":
            park(rm, torch.device("cpu"))  # pinned at build, as stages/ppo.py's load_models does
        head = value_head(base.config.hidden_size, torch.float32, rm.score, 0.02, 0).to(device)  # as stages/ppo.py
        sb = SharedBase(base, LORA, LORA, head)
        m = ppo.Models(sb.model, sb.model, sb.critic, rm, sb.actor_params, sb.critic_params, {}, sb.peft,
                       "actor", sb, {"reward": self.rm_home} if self.rm_home != device else {})
        return m, [adamw(params, 1e-5, 100, 2) for params in (sb.actor_params, sb.critic_params)]

    def cfg(self, micro: int):
        if self.grpo:
            return grpo_config(8, micro, self.new)
        from stages.params import PPO
        return PPO(rollout_batch_size=8, minibatch_size=8, micro_batch_size=micro, ppo_epochs=1, iterations=1,
                   max_new_tokens=self.new, values_from_update=self.values_from_update)

    def rewards(self, cfg) -> Rewards:
        """gae: the reward model's score; grpo: bench/grpo_peer.py's Python reward (no reward model)."""
        if not self.grpo:
            return Rewards(cfg, uses_rm=True)
        from bench.grpo_peer import our_rewards
        return our_rewards(cfg)

    def read(self, batch, responses: list[list[int]]) -> Responses:
        """What the reward sources read: the RM the same tokens as the policy (gae), the function their text (grpo)."""
        if not self.grpo:
            return Responses(self.it, [], [], [], scored=batch)
        from bench.grpo_peer import text
        return Responses(self.it, [text(p) for p in self.prompts], [text(r) for r in responses],
                         [{} for _ in responses])

    def actor(self, offload: bool, fused: bool, backend: str = "native") -> HybridActor:
        """The hybrid actor of a row: the native rollout (fused: its 4-bit decode through the fused kernel), or
        backend "hf", transformers' generate on the same weights (the peer's rollout)."""
        key = offload, fused, backend
        if key not in self.actors:
            opts = {} if self.device.type != "cuda" else {"compile": None if self.a.rollout_compile == "auto" else False}
            if self.rollout_fallback:
                opts = {"cuda_graph": False, "compile": False}
            self.actors[key] = HybridActor(self.m.policy, self.tok, activation_checkpointing=True,
                                           optimizer=self.engines[0].optimizer if offload else None,
                                           offload_optimizer=offload, backend=backend,
                                           backend_options=opts if backend == "native" else {}, fused_4bit=fused)
        return self.actors[key]

    def rollout(self, offload: bool, fused: bool, backend: str = "native") -> list[list[int]]:
        actor = self.actor(offload, fused, backend)
        if offload:
            actor.reserve_host_states()  # pinned once, outside the transition, as stages/ppo.py does
        with self.ledger.phase("rollout") as mem, self.m.use("actor"), actor.rollout():
            out = actor.generate(self.prompts, self.new, temperature=1.0)
            mem.hold("kv_cache", actor.backend.kv_cache_bytes)
        assert all(len(r) == self.new for r in out), "every response runs to max_new_tokens (no EOS)"
        return out

    def step(self, micro: int = 2, rollout: bool = True, offload: bool = False, frozen: bool = True,
             fused: bool = False, host_states: bool = False, backend: str = "native") -> dict:
        """One PPO step; returns the ledger's record of each phase and the update's statistics. host_states: the
        engines' AdamW moments in host memory between optimizer steps for this step (engine.optimizer_states)."""
        if not host_states:
            return self._step(micro, rollout, offload, frozen, fused, backend)
        for e in self.engines:
            e.host_states = optim.HostStates(e.optimizer)
            e.host_states.to_host()  # the states the earlier rows' steps created
        try:
            return self._step(micro, rollout, offload, frozen, fused, backend)
        finally:
            for e in self.engines:
                e.host_states.to_device()
                e.host_states = None

    def _step(self, micro: int, rollout: bool, offload: bool, frozen: bool, fused: bool, backend: str) -> dict:
        cfg = self.cfg(micro)
        self.it += 1
        t0 = time.perf_counter()
        responses = self.rollout(offload, fused, backend) if rollout else self.responses
        if rollout:
            self.responses = responses
        step = PpoStep(cfg, self.m, self.engines, self.rewards(cfg), micro, phase=self.ledger.phase)
        experience = step.experience if frozen else partial(PpoStep.experience.__wrapped__, step)
        with self.ledger.phase("scoring") as mem, torch.set_grad_enabled(not frozen):
            # --rm cpu: the step brings the RM in for its scoring (engine.roles.reward.offload's path)
            self.m.moved_in = lambda: mem.hold("weights", self.ledger.held_now()["weights"])
            batch = pack(self.prompts, responses, PAD, self.device)
            exp = experience(batch, self.read(batch, responses))
        exp = {k: v.detach() for k, v in exp.items()}  # unfrozen: the graphs lived through scoring, not beyond
        stats = step.update(batch, exp, 0, self.it)
        sync(self.device)
        total = time.perf_counter() - t0
        recs = self.ledger.last if self.ledger.metrics() else {}
        st = self.actor(offload, fused, backend).last_stats if rollout else {}
        decode = {"decode_ms_per_token": 1000 * st["decode_s"] / max(st["steps"] - 1, 1)} if "decode_s" in st else {}
        if rollout and not decode and "rollout" in recs:  # generate keeps no stats: the whole rollout per token
            decode = {"rollout_ms_per_token": 1000 * recs["rollout"].seconds / self.new}
        return {"phases": {k: record(r) for k, r in recs.items()}, "step_s": total, "stats": stats, **decode}

    def scorers(self) -> list:
        """The models whose forwards the step runs: the policy's base (every role on it), the RM when there is one."""
        return [x for x in (self.m.policy, self.rm) if x is not None]

    @contextmanager
    def unfrozen(self):
        """Freezing off: every frozen floating-point weight tracked by autograd, frozen roles' forwards with autograd."""
        trained = {id(p) for e in self.engines for p in e.trained}
        params = [p for mod in self.scorers() for p in mod.parameters()
                  if id(p) not in trained and p.is_floating_point()]
        users = (ppo, rewards, estimators)  # the modules whose forwards the step runs through batched()
        for mod in users:
            mod.batched = forward.batched.__wrapped__  # the grad-free wrapper off: what no freezing looks like
        for p in params:
            p.requires_grad_(True)
        try:
            yield
        finally:
            for mod in users:
                mod.batched = forward.batched
            for p in params:
                p.requires_grad_(False)
                p.grad = None

    @contextmanager
    def plain_forward(self, module):
        """`module`'s forwards from transformers and peft, not hybridcore's (the default): 4-bit LoRA layers through
        peft's forward (its clone, scaling multiply and add: hybridcore/qlora_linear.py), or RMSNorm through
        transformers' eight kernels (hybridcore/rmsnorm.py)."""
        models = self.scorers()
        for m in models:
            module.install(m, False)
        try:
            yield
        finally:
            for m in models:
                module.install(m)

    @contextmanager
    def scored_values(self):
        """The critic's values from a scoring forward before the updates (ppo.values_from_update false)."""
        self.values_from_update = False
        try:
            yield
        finally:
            self.values_from_update = True

    @contextmanager
    def attention(self, impl: str):
        models = self.scorers()
        saved = [m.config._attn_implementation for m in models]
        for m in models:
            m.config._attn_implementation = impl
        try:
            yield
        finally:
            for m, s in zip(models, saved):
                m.config._attn_implementation = s


def record(r) -> dict:
    return {"peak_gib": r.peak / GIB, "seconds": r.seconds, **{f"{k}_gib": v / GIB for k, v in r.by_kind().items()}}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def nvidia_smi_used_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                              os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        return float(out[0]) if out else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def cuda_setup(res: dict) -> None:
    """Cap the allocator at 22 GiB and count the CUDA context: nvidia-smi's used memory minus what torch holds."""
    before = nvidia_smi_used_mib()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_GIB * GIB / total)
    after = nvidia_smi_used_mib()
    res["gpu"] = {"name": torch.cuda.get_device_name(0), "total_mib": total / MIB, "cap_gib": CAP_GIB,
                  "smi_used_before_mib": before, "smi_used_after_init_mib": after,
                  "context_mib": None if after is None or before is None
                  else after - before - torch.cuda.memory_reserved() / MIB}


# ------------------------------------------------------------------------------------------------ rows


ABLATION = [("freezing off", {"rollout": False, "frozen": False}, "frozen weights tracked by autograd; scoring with autograd"),
            ("attention eager", {"rollout": False, "attention": "eager"}, "training and scoring forwards eager"),
            ("micro-batch 1", {"rollout": False, "micro": 1}, "gradient accumulation 8"),
            ("micro-batch 4", {"rollout": False, "micro": 4}, "gradient accumulation 2"),
            ("optimizer offload on", {"offload": True}, "actor's optimizer states on the CPU during rollout"),
            ("optimizer states on the host", {"host_states": True}, "every engine's AdamW moments in pinned CPU "
                                                                    "memory between steps (engine.optimizer_states)"),
            ("bitsandbytes 4-bit decode", {"fused": False}, "decode steps' 4-bit linears through bitsandbytes "
                                                           "(engine.rollout.decode_4bit: bitsandbytes), not the "
                                                           "fused NF4 kernel the default takes on a GPU"),
            ("peft LoRA forward", {"rollout": False, "plain": "qlora_linear"},
             "training and scoring through peft's own 4-bit LoRA forward (clone, scale, add), not "
             "hybridcore/qlora_linear.py's one function"),
            ("critic values scored first", {"rollout": False, "scored_values": True},
             "the critic's values from a scoring forward before the updates (ppo.values_from_update false), not "
             "from its update pass's own forward"),
            ("transformers RMSNorm", {"rollout": False, "plain": "rmsnorm"},
             "training and scoring through transformers' RMSNorm (eight kernels), not hybridcore/rmsnorm.py's one"),
            ("transformers generate (peer)", {"backend": "hf"}, "the rollout through transformers' generate (dynamic "
                                                                "cache) on the same 4-bit + LoRA model: a peft user's")]
GRPO_ROWS = ("micro-batch 4", "optimizer offload on", "optimizer states on the host", "bitsandbytes 4-bit decode")
PHASES = {"gae": ("rollout", "scoring", "critic_update", "actor_update"),  # the ablation table's columns
          "grpo": ("rollout", "scoring", "actor_update")}


def rows_for(shape: str, estimator: str = "gae") -> list[tuple[str, dict, str]]:
    """(name, step switches, what it changes) after the default row: gae's whole ablation for llama3-8b and tiny,
    the bitsandbytes decode alone for qwen2.5-14b; grpo's four rows for every shape (tiny, a CPU run: no decode row,
    its default already decodes through bitsandbytes; no RMSNorm row, its norms are transformers' there)."""
    rows = ([r for r in ABLATION if r[0] in GRPO_ROWS] if estimator == "grpo" else
            [r for r in ABLATION if r[0] == "bitsandbytes 4-bit decode"] if shape == "qwen2.5-14b" else ABLATION)
    # tiny runs on a CPU: its default already decodes through bitsandbytes and its norms are transformers' own
    return [r for r in rows if shape != "tiny" or not ("fused" in r[1] or r[1].get("plain") == "rmsnorm")]


def rollout_key(b: Bench, sw: dict) -> tuple[bool, bool, str]:
    """The actor a row's switches roll out with (Bench.actors' key): offload, fused, backend."""
    backend = sw.get("backend", "native")
    return sw.get("offload", False), sw.get("fused", b.fused_default and backend == "native"), backend


def new_rollout(b: Bench, sw: dict) -> bool:
    """Whether the row rolls out natively with an actor no earlier row built (its compile and capture still ahead)."""
    key = rollout_key(b, sw)
    return sw.get("rollout", True) and key[2] == "native" and key not in b.actors


def run_row(b: Bench, name: str, sw: dict, res: dict, warm_rollout: bool = False) -> dict:
    """One step with the row's switches. warm_rollout: a native rollout whose actor no earlier row built (another
    decode path, the optimizer offloaded) first rolls out once untimed (compile and graph capture, as the warm-up
    row did for the default's), so that its step is timed as the default's is; that warm-up's seconds are kept."""
    row = {"row": name, "switches": {k: v for k, v in sw.items()}}
    t0 = time.perf_counter()
    _, fused, backend = key = rollout_key(b, sw)  # the fused decode is the native backend's
    try:
        if warm_rollout and new_rollout(b, sw):
            b.rollout(*key)
            b.ledger.metrics()  # its phase record is not the row's
            row["rollout_warmup_s"] = time.perf_counter() - t0
        if not sw.get("frozen", True):
            ctx = b.unfrozen()
        elif "attention" in sw:
            ctx = b.attention(sw["attention"])
        elif "plain" in sw:
            ctx = b.plain_forward({"qlora_linear": qlora_linear, "rmsnorm": rmsnorm}[sw["plain"]])
        elif sw.get("scored_values"):
            ctx = b.scored_values()
        else:
            ctx = _null()
        with ctx:
            out = b.step(micro=sw.get("micro", 2), rollout=sw.get("rollout", True), offload=sw.get("offload", False),
                         frozen=sw.get("frozen", True), fused=fused,
                         host_states=sw.get("host_states", False), backend=backend)
        row.update(out)
        if not sw.get("rollout", True) and "rollout" in res.get("default", {}).get("phases", {}):
            row["phases"]["rollout"] = {**res["default"]["phases"]["rollout"], "reused": True}
        row["peak_gib"] = max(p["peak_gib"] for p in row["phases"].values())
        row["phase_s"] = sum(p["seconds"] for p in row["phases"].values())
        st = out["stats"]
        row["backed_off"] = {k: st[k] for k in ("actor_micro_batch", "critic_micro_batch")
                             if st.get(k) is not None and st[k] < sw.get("micro", 2)}
    except torch.OutOfMemoryError as e:
        row["oom"] = (str(e).splitlines() or ["OOM"])[0][:200]
        recs = b.ledger.records
        row["oom_phase"] = next(reversed(recs)) if recs else None
        row["phases"] = {k: record(r) for k, r in recs.items()}
        b.ledger.metrics()
    except Exception as e:  # noqa: BLE001 -- a row's failure is recorded; the others still run
        row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        row["traceback"] = traceback.format_exc()[-3000:]
        recs = b.ledger.records
        row["failed_phase"] = next(reversed(recs)) if recs else None
        row["phases"] = {k: record(r) for k, r in recs.items()}
        b.ledger.metrics()
    for e in b.engines:
        e.zero_grad()
    free(b.device)
    row["wall_s"] = time.perf_counter() - t0
    return row


def profile_decode(b: Bench, steps: int) -> dict:
    """The default row's rollout (its actor, inside its rollout transition): the decode step's kernel time by kind
    over `steps` eager steps and the time of a graph replay, and the prefill's kernels (bench/decode_profile.py)."""
    from bench.decode_profile import profile_decoder, profile_prefill
    actor = b.actor(False, b.fused_default)
    ids = torch.tensor(b.prompts, device=b.device)
    with b.m.use("actor"), actor.rollout():
        report = profile_decoder(actor.backend, ids, torch.ones_like(ids), PAD, b.new, steps)
        report["prefill"] = profile_prefill(actor.backend, ids, torch.ones_like(ids), PAD)
    return report


def profiles(b: Bench, res: dict, cuda: bool) -> None:
    """--profile: the default row's decode step and prefill, then one more step's scoring and updates, into res; a
    profile that fails is recorded (`profile_error`) and costs no measured row."""
    try:
        res["decode_profile"] = profile_decode(b, steps=8 if cuda else 2)
        res["step_profile"] = profile_step(b)
    except Exception:  # noqa: BLE001 -- the rows measured so far are kept
        res["profile_error"] = traceback.format_exc()[-4000:]
        print(res["profile_error"], flush=True)
    print(json.dumps({k: res[k] for k in ("decode_profile", "step_profile") if k in res}, indent=1), flush=True)


STEP_TOP_KERNELS, STEP_TOP_OPS = 30, 20  # profile_step's kernel list and operator list


def profile_step(b: Bench) -> dict:
    """The default row's scoring and update (one PPO step on its last rollout's responses): kernel time by kind
    beside the step's wall time, so launch gaps and host work show as the difference; the same by phase (scoring,
    actor_update, critic_update; the optimizer steps run between phases, "(outside phases)"), the largest kernels,
    and the operators whose kernels take longest with their input shapes and dtypes (a kernel's name alone does not
    say which call made an fp32 matrix product)."""
    from bench.decode_profile import PHASE, breakdown
    phase = b.ledger.phase

    @contextmanager
    def labelled(name: str):
        with torch.profiler.record_function(PHASE + name), phase(name) as handle:
            yield handle
    b.ledger.phase = labelled  # what PpoStep and Bench._step enter; the class's method again below
    out = {}
    t0 = time.perf_counter()
    try:
        report = {"kernels": breakdown(lambda: out.update(b.step(2, rollout=False, fused=b.fused_default)), b.device,
                                       1, top=STEP_TOP_KERNELS, ops=STEP_TOP_OPS)}
    finally:
        del b.ledger.phase
    report["profiled_wall_s"] = time.perf_counter() - t0
    report["phase_wall_s"] = {k: p["seconds"] for k, p in out.get("phases", {}).items()}  # beside by_phase's kernels
    return report


@contextmanager
def _null():
    yield


# ------------------------------------------------------------------------------------------------ report


def gib(x) -> str:
    return "" if x is None else f"{x:.2f}"


def markdown(res: dict) -> str:
    estimator = res.get("estimator", "gae")
    title = "GRPO (no critic, no reward model)" if estimator == "grpo" else "PPO"
    lines = [f"# {title} memory, {res['shape']} ({res.get('gpu', {}).get('name', 'CPU')})", ""]
    d = res.get("default")
    if d and "phases" in d and "step_s" in d:  # a row that failed mid-step has phases but no step time
        tok = res["workload"]["tokens_per_step"]
        lines += [f"Default row: peak **{gib(d.get('peak_gib'))} GiB** (target {res.get('target_gib')} GiB: "
                  f"{'met' if d.get('target_met') else 'NOT met'}), {d['step_s']:.1f} s/step, "
                  f"{tok / d['step_s']:.0f} tokens/s ({tok} tokens per step), decode "
                  f"{d.get('decode_ms_per_token', float('nan')):.1f} ms per token.", "",
                  "| phase | peak GiB | weights | gradients | optimizer | KV cache | activations (remainder) | s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, p in d["phases"].items():
            lines.append(f"| {name} | {gib(p['peak_gib'])} | {gib(p['weights_gib'])} | {gib(p['gradients_gib'])} | "
                         f"{gib(p['optimizer_gib'])} | {gib(p['kv_cache_gib'])} | {gib(p['activations_gib'])} | "
                         f"{p['seconds']:.2f} |")
        lines.append("")
    if res.get("ablation"):
        phases = PHASES[estimator]
        lines += ["| row (one switch off the default) | peak GiB | s/step | decode ms/token | "
                  + " | ".join(f"{k} GiB" for k in phases) + " | note |", "|---|---:|---:|---:|" + "---:|" * len(phases)
                  + "---|"]
        for r in res["ablation"]:
            ph = r.get("phases", {})
            note = ("OOM in " + str(r.get("oom_phase")) if "oom" in r else r.get("error", r.get("skipped", "")))
            if r.get("backed_off"):
                note += f" backed off to {r['backed_off']}"
            if ph.get("rollout", {}).get("reused"):
                note += " rollout reused from default"
            if "rollout_warmup_s" in r:
                note += f" (rollout warmed first: {r['rollout_warmup_s']:.0f} s)"
            peak = "OOM" if "oom" in r else gib(r.get("peak_gib"))
            s = "" if "oom" in r or "phase_s" not in r else f"{r['phase_s']:.1f}"
            cells = [gib(ph[k]["peak_gib"]) if k in ph else "" for k in phases]
            dec = (f"{r['decode_ms_per_token']:.1f}" if "decode_ms_per_token" in r else
                   f"({r['rollout_ms_per_token']:.1f})" if "rollout_ms_per_token" in r else "")
            lines.append(f"| {r['row']} | {peak} | {s} | {dec} | " + " | ".join(cells) + f" | {note.strip()} |")
    return "\n".join(lines) + "\n"


def save(res: dict, out: Path) -> None:
    stem = f"memory-{res['shape']}" + ("-grpo" if res.get("estimator") == "grpo" else "")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    (out / f"{stem}.md").write_text(markdown(res))


def workload(b: Bench) -> dict:
    """What one step does: 8 sequences of prompt + response tokens (grpo: one prompt's group of 8)."""
    out = {"prompt": b.prompt_len, "response": b.new, "rollout_batch": 8, "micro_batch": 2, "grad_accum": 4,
           "ppo_epochs": 1, "tokens_per_step": 8 * (b.prompt_len + b.new)}
    if b.grpo:
        cfg = b.cfg(2)
        out.update(prompts_per_rollout=cfg.rollout_batch_size, samples_per_prompt=cfg.samples_per_prompt,
                   kl_in_loss=cfg.kl_in_loss, kl_coef=cfg.kl_coef, critic=False, reward_model=False)
    return out


def built(b: Bench) -> dict:
    """The build's seconds, weights and trained parameters."""
    dt = b.device.type
    out = {"seconds": b.build_s, "policy_weights_gib": weight_bytes(b.m.policy, dt) / GIB,
           "trained_params": sum(p.numel() for e in b.engines for p in e.trained)}
    if b.rm is not None:
        out.update(reward_weights_gib=weight_bytes(b.rm, dt) / GIB,
                   reward_weights_cpu_gib=weight_bytes(b.rm, "cpu") / GIB)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--rm", choices=("gpu", "cpu"), default="gpu",
                    help="where the reward model lives between scoring phases (gpu: resident, the pipeline's way)")
    ap.add_argument("--rollout-compile", choices=("off", "auto"), default="off",
                    help="torch.compile the native decode step (auto: the backend's default); off keeps the CUDA graph")
    ap.add_argument("--estimator", choices=("gae", "grpo"), default="gae",
                    help="gae: actor, critic and reward model; grpo: the actor alone, 1 prompt x 8, a Python reward")
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--rows", nargs="+", metavar="ROW",
                    help="run only these rows after the default (names as in the table, e.g. 'bitsandbytes 4-bit "
                         "decode')")
    ap.add_argument("--profile", action="store_true",
                    help="after the default row: its decode step's and prefill's kernels by kind, a graph replay "
                         "(decode_profile.py), and the kernels of one more step's scoring and update: by kind, by "
                         "phase, the largest kernels, and the operators (input shapes, dtypes) that take longest")
    ap.add_argument("--trace", action="store_true",
                    help="CUDA: record the default row's allocations; what is alive at its peak, by site (mem_trace.py)")
    a = ap.parse_args()
    if a.estimator == "grpo" and a.rm == "cpu":
        ap.error("--rm cpu: --estimator grpo builds no reward model")
    known = [r[0] for r in rows_for(a.shape, a.estimator)]
    if a.rows and set(a.rows) - set(known):
        ap.error(f"--rows: no row {sorted(set(a.rows) - set(known))} for this shape and estimator; "
                 f"expected some of {known}")
    a.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    cuda = a.shape != "tiny"
    device = torch.device("cuda" if cuda else "cpu")
    import bitsandbytes
    res = {"shape": a.shape, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": a.commit,
           "command": " ".join(sys.argv), "versions": {"torch": torch.__version__, "transformers":
                                                      transformers.__version__, "bitsandbytes": bitsandbytes.__version__,
                                                      "python": platform.python_version()},
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "target_gib": TARGET_GIB.get(a.shape),
           "lora": {"rank": LORA.rank, "alpha": LORA.alpha, "targets": list(LORA.targets)}, "rm": a.rm,
           "rollout_compile": a.rollout_compile, "estimator": a.estimator}
    if a.estimator == "grpo":
        res["rm"] = "none (the reward: bench/grpo_peer.py's Python function)"
    if cuda:
        cuda_setup(res)
    b = Bench(a, device)
    res["workload"] = workload(b)
    res["build"] = built(b)
    if cuda:
        res["build"]["allocated_gib"] = torch.cuda.memory_allocated() / GIB
    print(json.dumps(res, default=str), flush=True)
    save(res, a.out)
    # warm-up: the first step allocates the KV cache, captures the decode graph, creates the optimizer states
    warm = run_row(b, "warm-up", {}, res)
    if "error" in warm and cuda and warm.get("failed_phase") == "rollout":  # e.g. a CUDA graph capture failed
        b.rollout_fallback = warm["error"]
        b.actors.clear()
        warm = run_row(b, "warm-up (rollout without CUDA graph)", {}, res)
    res["warmup"] = warm
    res["rollout_fallback"] = b.rollout_fallback
    save(res, a.out)
    print(f"warm-up: {warm.get('peak_gib')} GiB, {warm['wall_s']:.1f} s {warm.get('oom', '')}{warm.get('error', '')}",
          flush=True)
    if a.trace and cuda:
        from bench import mem_trace
        mem_trace.start()
    default = run_row(b, "default", {}, res)
    if a.trace and cuda:
        res["trace"] = mem_trace.at_peak(torch.cuda.memory._snapshot())
        mem_trace.stop()
        print(json.dumps(res["trace"], indent=1), flush=True)
    out_of_memory = "oom" in default or "out of memory" in default.get("error", "")
    if out_of_memory and a.rm == "gpu" and cuda and b.rm is not None:
        res["default_rm_resident"] = default  # the pipeline's layout does not fit: RM on the CPU between scorings
        park(b.rm, torch.device("cpu"))  # pinned here, as stages/ppo.py's load_models does, not in the row's scoring
        b.rm_home = torch.device("cpu")
        b.m.homes["reward"] = b.rm_home  # what engine.roles.reward.offload sets
        free(device)
        res["rm"] = "cpu (after the resident layout ran out of memory)"
        default = run_row(b, "default, RM on CPU between scoring phases", {}, res)
    if "peak_gib" in default:
        default["target_met"] = default["peak_gib"] <= TARGET_GIB.get(a.shape, CAP_GIB)
    res["default"] = default
    res["rollout_stats"] = {k: v for k, v in b.actor(False, b.fused_default).last_stats.items()}
    save(res, a.out)
    print(markdown(res), flush=True)
    res["ablation"] = []
    for name, sw, what in [r for r in rows_for(a.shape, a.estimator) if not a.rows or r[0] in a.rows]:
        left = a.budget_s - (time.perf_counter() - t_start)
        est = default.get("wall_s", 60) * (1.0 if sw.get("rollout", True) else 0.6)
        if new_rollout(b, sw):
            est += max(0.0, warm.get("wall_s", 0) - default.get("wall_s", 0))  # its rollout's compile + capture
        if left < est * 1.3:
            res["ablation"].append({"row": name, "what": what, "skipped": f"budget ({left:.0f} s left)"})
            continue
        row = run_row(b, name, sw, res, warm_rollout=True)
        row["what"] = what
        res["ablation"].append(row)
        save(res, a.out)
        print(f"{name}: {row.get('peak_gib')} GiB {row.get('oom', '')}{row.get('error', '')} {row['wall_s']:.1f} s",
              flush=True)
    if a.profile:  # after the baselines: the budget skipped one behind the profiles once (2026-12-07 13:30)
        profiles(b, res, cuda)
        save(res, a.out)
    if cuda:
        res["gpu"]["max_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        res["gpu"]["smi_used_end_mib"] = nvidia_smi_used_mib()
    res["wall_s"] = time.perf_counter() - t_start
    b.ledger.close()
    save(res, a.out)
    print(markdown(res), flush=True)
    failed = [r for r in [default] + res["ablation"] if "error" in r]
    return 1 if failed or "peak_gib" not in default else 0


if __name__ == "__main__":
    sys.exit(main())
