"""What the stages share: the base model a run starts from, loading each role as engine.roles says
(precision, quantisation, LoRA) and exporting it, and step-loop bookkeeping."""
from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from hybridcore.adapters import LoraSpec, add_lora, save_adapters, save_merged
from hybridcore.checkpoint import Checkpointer
from hybridcore.freezing import TrainableState, assert_frozen, freeze
from hybridcore.errors import InputError, TrainingFault
from hybridcore.interrupts import Interrupted, stop_requested
from hybridcore.models import (DTYPES, PRESETS, build_preset, check_vocab, load_causal_lm, load_sequence_scorer,
                               load_tokenizer, save_model, train_tokenizer)


def base_model(p):
    """(tokenizer, causal LM) the pipeline starts from: a local folder, or a preset built for this run;
    quantised as engine.roles.actor says (SFT trains the actor role)."""
    from stages import data  # on use: it needs datasets + pyarrow, absent where bench/memory.py runs
    prec, attn, quant = role_precision(p, "actor"), p.engine.attention, p.engine.roles.actor.quantization
    dev = device(p)
    if p.model.path is not None:
        tok = load_tokenizer(p.model.tokenizer or p.model.path, p.model.trust_remote_code,
                             "model.tokenizer" if p.model.tokenizer else "model.path")
        model = load_causal_lm(p.model.path, prec, attn, p.model.trust_remote_code, allow_pickle=p.model.allow_pickle,
                               quantization=quant, quant_field=quant_field("actor"), device=dev)
    else:
        tok = (load_tokenizer(p.model.tokenizer) if p.model.tokenizer
               else train_tokenizer(data.corpus(p), PRESETS[p.model.preset]["tokenizer_vocab"]))
        model = build_preset(p.model.preset, tok, p.pipeline.seed).to(DTYPES[prec])
        model.config._attn_implementation = attn
        if quant != "none":  # bitsandbytes quantises while loading: go through an HF folder
            with tempfile.TemporaryDirectory(prefix="preset-") as tmp:
                save_model(model, tok, Path(tmp))
                model = load_causal_lm(tmp, prec, attn, quantization=quant, quant_field=quant_field("actor"),
                                       device=dev)
            model.name_or_path = model.config._name_or_path = ""  # the temp folder is gone: adapters must not name it
        else:
            model = model.to(dev)
    check_vocab(model, tok, "model.tokenizer" if p.model.tokenizer else "model")
    from hybridcore.chat import attach
    attach(tok, p.data.chat_template)  # exported with every stage's tokenizer, so the artifacts chat as they trained
    return tok, model


def context_of(model) -> Optional[int]:
    """The model's positions (max_position_embeddings), None when its config does not say."""
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def device(p):
    """Where this run's stages put their models and batches (engine.device)."""
    from hybridcore.models import resolve_device
    return resolve_device(p.engine.device)


def role_precision(p, role: str) -> str:
    return getattr(p.engine.roles, role).precision or p.engine.precision


def check_prompt_room(model, texts: list[str], prompts: list[list[int]], new_tokens: int, field: str,
                      source: str) -> None:
    """Every prompt plus `new_tokens` fits the model's positions. The pre-flight check does this when the
    tokenizer is known up front; with a tokenizer trained by SFT it can only happen here."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is None:
        return
    for text, a in zip(texts, prompts):
        if len(a) + new_tokens > positions:
            raise InputError(f"{source}: the prompt starting {text[:40]!r} is {len(a)} tokens, and with {field}="
                             f"{new_tokens} that exceeds the model's {positions} positions; expected prompt + "
                             f"{field} <= {positions} (shorten the prompt or lower {field})")


def checkpointing(p, role: str) -> bool:
    """Whether a trained role recomputes its activations in backward (engine.roles.<role>, else engine's)."""
    own = getattr(p.engine.roles, role).activation_checkpointing
    return p.engine.activation_checkpointing if own is None else own


def quant_field(role: str) -> str:
    return f"engine.roles.{role}.quantization"


def lora_spec(p, role: str) -> Optional[LoraSpec]:
    lora = getattr(p.engine.roles, role).lora
    return None if lora is None else LoraSpec(lora.rank, lora.alpha, tuple(lora.targets))


def load_scorer(p, folder, role: str, pad_token_id: int):
    return load_sequence_scorer(str(folder), role_precision(p, role), p.engine.attention, p.model.trust_remote_code,
                                pad_token_id=pad_token_id, field=f"{role} model",
                                quantization=getattr(p.engine.roles, role).quantization, quant_field=quant_field(role),
                                device=device(p))


def load_policy(p, folder, role: str):
    return load_causal_lm(str(folder), role_precision(p, role), p.engine.attention, p.model.trust_remote_code,
                          field=f"{role} model", quantization=getattr(p.engine.roles, role).quantization,
                          quant_field=quant_field(role), device=device(p))


def with_lora(p, model, role: str, keep_trainable: tuple[str, ...] = ()):
    """(model, peft model or None): LoRA on `model` when engine.roles.<role>.lora asks for it, everything else
    frozen except the modules named in keep_trainable (a scorer's `score` head), which are trained in float32 as
    the adapters are: in bf16 an AdamW step of 1e-4 on a weight of 0.02 is less than one bf16 step (2**-13 there)
    and rounds away or to a whole one; the body runs under autocast either way (forward.token_scores), and an
    export casts every weight to the model's dtype (adapters.merged_state_dict)."""
    spec = lora_spec(p, role)
    if spec is None:
        return model, None
    peft = add_lora(model, spec, f"engine.roles.{role}", "default")
    model = peft.get_base_model()
    for name in keep_trainable:
        getattr(model, name).float().requires_grad_(True)
    return model, peft


def tp_split(p, model):
    """This rank's tensor-parallel shard of `model` when engine.layout.tp > 1 (every rank loaded the same weights;
    attention and MLP linears split Megatron-style over the tp group, the rest kept whole); else `model` itself."""
    tp = p.engine.layout.tp
    if tp == 1:
        return model
    from hybridcore import parallel
    from hybridcore.tensor_parallel import split_model
    g = parallel.current()
    if g.layout.tp != tp:
        raise RuntimeError(f"engine.layout.tp={tp} but this process runs in a layout of tp={g.layout.tp}: a "
                           f"tensor-parallel stage runs as a torchrun job (stages/launch.py)")
    return split_model(model, g.tp_group, tp, g.tp_rank)


def checkpointed(model, peft):
    """What a step checkpoint holds of a model: all of it, or with adapters only the trained parameters."""
    return model if peft is None else TrainableState.of(model)


def export(p, role: str, engine, model, peft, tok, out: Path, adapter: str = "default",
           extra: Optional[dict] = None) -> None:
    """model/ as a plain HF folder (adapters merged, quantisation not baked in); adapter/ when adapters exist.
    Call it on every rank: `engine` (the one training `model`) gathers the whole weights where its layout shards
    them (ZeRO-3 partitions, tp shards), and global rank 0 writes, so the artifact is one whole HF folder whatever
    the layout."""
    from hybridcore.parallel import current
    stop_at_end_of_turn(model, tok)
    if peft is not None:  # adapters are refused under ZeRO-3 and tp > 1; ZeRO-1/2 keep them whole on every rank
        if current().is_main:
            save_merged(model, tok, out / "model", adapter, DTYPES[role_precision(p, role)])
            save_adapters(peft, out / "adapter", extra)
        return
    if engine.module is not model:
        raise ValueError(f"export: the {role}'s engine trains another module than the one exported")
    state = engine.whole_state_dict(copy=False)
    if state is not None and current().is_main:
        save_model(model, tok, out / "model", state)


def stop_at_end_of_turn(model, tok) -> None:
    """A policy's generation_config.json names every stop token (EOS and the chat template's end of turn), so plain
    `generate` on the exported folder stops where our rollouts stop."""
    from hybridcore.chat import stop_ids
    config = getattr(model, "generation_config", None)
    stops = stop_ids(tok)
    if config is not None and stops:
        config.eos_token_id = stops[0] if len(stops) == 1 else stops
        config.pad_token_id = tok.pad_token_id


def total_steps(n_rows: int, batch_size: int, epochs: int, what: str) -> int:
    steps = (n_rows // batch_size) * epochs
    if steps == 0:
        raise InputError(f"{what}: {n_rows} training rows is fewer than one batch of {batch_size} "
                         f"(lower {what.split('.')[0]}.batch_size or add data)")
    return steps


class StepLog:
    """Progress bar, throughput and a loss history for one training loop."""

    def __init__(self, name: str, total: int, sink):
        from hybridcore.parallel import is_main
        self.bar = tqdm(total=total, desc=name, unit="step", dynamic_ncols=True, leave=True,
                        disable=not is_main())  # one bar per job: rank 0's
        self.sink, self.losses, self.t0, self.tokens = sink, [], time.perf_counter(), 0

    def step(self, step: int, loss: float, tokens: int, **extra: float) -> None:
        self.losses.append(loss)
        self.tokens += tokens
        elapsed = time.perf_counter() - self.t0
        metrics = {"loss": loss, "tokens_per_s": self.tokens / max(elapsed, 1e-9), **extra}
        self.sink.log(metrics, step)
        self.bar.set_postfix(loss=f"{loss:.4f}")
        self.bar.update(1)

    def state(self) -> dict:
        return {"losses": self.losses, "tokens": self.tokens}

    def restore(self, state: dict) -> None:
        """Continue a resumed loop: its earlier losses count toward the final metrics."""
        self.losses, self.tokens = list(state.get("losses", [])), int(state.get("tokens", 0))
        self.bar.update(len(self.losses))

    def close(self) -> dict:
        """Mean loss over the last tenth of the steps and over the tenth before (to see it flatten)."""
        self.bar.close()
        k = max(1, len(self.losses) // 10)
        last, prev = self.losses[-k:], self.losses[-2 * k:-k] or self.losses[-k:]
        return {"train_loss": sum(last) / len(last), "train_loss_prev": sum(prev) / len(prev),
                "tokens_per_s": self.tokens / max(time.perf_counter() - self.t0, 1e-9), "steps": len(self.losses)}


def seed_all(seed: int) -> None:
    import random

    import numpy as np
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


frozen = freeze


class NonFinite(TrainingFault):
    """A NaN or inf in a loss, reward or advantage, with the stage and step where it appeared."""


def finite(stage: str, step: int, policy: str, **values) -> bool:
    """True if every value is finite. Otherwise stop (policy 'stop': raise NonFinite naming the value and the
    step) or report and skip the batch (policy 'skip': False)."""
    bad = [k for k, v in values.items() if not math.isfinite(float(v))]
    if not bad:
        return True
    what = ", ".join(f"{k}={float(values[k])}" for k in bad)
    if policy == "skip":
        print(f"{stage} step {step}: {what}; skipping this batch ({stage}.on_nonfinite=skip)", flush=True)
        return False
    raise NonFinite(f"{stage} step {step}: {what}; stopped; a rerun resumes from the newest checkpoint (set {stage}.on_nonfinite: skip to "
                    "skip such batches)")


def trainer(p, model, *, lr: float, steps: int, warmup_ratio: float, min_lr_ratio: float, max_grad_norm: float,
            micro_batch: int, weight_decay: float = 0.0, layout=None):
    """`model`'s optimizer, schedule and step as engine.layout says (or `layout`, when the memory planner turned on
    offload): plain torch AdamW, or DeepSpeed ZeRO-1/2 (optimizer states optionally on the CPU), over this process's
    dp and tp groups (a tp-split `model` is clipped and checkpointed per tp shard)."""
    from hybridcore.engine import make_engine
    from hybridcore.parallel import Layout, current
    return make_engine(model, lr=lr, total_steps=steps, warmup_ratio=warmup_ratio, min_lr_ratio=min_lr_ratio,
                       max_grad_norm=max_grad_norm, weight_decay=weight_decay,
                       layout=Layout.of(layout if layout is not None else p.engine.layout), micro_batch=micro_batch,
                       groups=current(), host_states=p.engine.optimizer_states == "host")


def planned(p, stage: str, batch_size: int, configured: int, models, trained, probe, sink):
    """(micro-batch, layout, metrics): the memory planner's choice when engine.memory_budget_gib is set (measured
    with `probe(rows)`, logged in one line and to the sink at step 0), else the configured micro-batch and layout."""
    if p.engine.memory_budget_gib is None:
        return configured, p.engine.layout, {}
    from hybridcore.errors import say
    from hybridcore.planner import plan_stage
    plan, layout = plan_stage(stage, p.engine.memory_budget_gib, batch_size, configured, models, trained,
                              p.engine.layout, device(p), probe, say, host_states=p.engine.optimizer_states == "host")
    sink.log(plan.metrics(), 0)
    return plan.micro_batch, layout, plan.metrics()


def optim_engine(p, stage: str, model, steps: int, probe, sink):
    """(engine, micro-batch, planner metrics) for the one model SFT, the RM and DPO train, from the stage's Optim
    section: the planner's micro-batch and layout, then the optimizer and schedule, then the check that no parameter
    it leaves alone still tracks gradients (a freezing mistake stops here, not after a silently wrong run)."""
    cfg = getattr(p, stage)
    micro, layout, metrics = planned(p, stage, cfg.batch_size // p.engine.layout.dp, cfg.micro_batch_size, [model],
                                     [q for q in model.parameters() if q.requires_grad], probe, sink)
    engine = trainer(p, model, lr=cfg.lr, weight_decay=cfg.weight_decay, steps=steps, warmup_ratio=cfg.warmup_ratio,
                     min_lr_ratio=cfg.min_lr_ratio, max_grad_norm=cfg.max_grad_norm, micro_batch=micro, layout=layout)
    assert_frozen(stage, {"model": model}, [engine.trained])
    return engine, micro, metrics


def optimizer_metrics(engines: dict) -> dict[str, float]:
    """Optimizer-state MiB each engine keeps on the accelerator and on the CPU, and the trained weights' MiB this
    rank holds (its tensor-parallel shards plus what stays whole), measured from the tensors held."""
    out = {}
    for prefix, e in engines.items():
        held = e.optimizer_bytes()
        out[f"{prefix}optimizer_device_mib"] = held["device"] / 2**20
        out[f"{prefix}optimizer_cpu_mib"] = held["cpu"] / 2**20
        out[f"{prefix}params_mib"] = e.held_bytes()["params"] / 2**20  # ZeRO-3: its partitions
    return out


class Resumable:
    """A training loop's checkpoints: resume from the newest valid one, save every N steps, and stop
    cleanly (checkpoint, then Interrupted) when a stop was requested."""

    def __init__(self, stage: str, out, cfg, models: dict, stateful: dict, engines: dict, log: StepLog):
        """models, stateful, engines: as checkpoint_parts() gives them."""
        self.stage, self.models, self.stateful, self.engines, self.log = stage, models, stateful, engines, log
        self.ckpt = Checkpointer(out, stage, cfg.checkpoint_every, cfg.keep_checkpoints)

    def resume(self) -> tuple[int, dict]:
        """(first step to run, the loop state saved with it); (0, {}) for a fresh start."""
        folder = self.ckpt.latest()
        if folder is None:
            return 0, {}
        step, state = self.ckpt.load(folder, self.models, self.stateful, self.engines)
        self.log.restore(state.pop("log", {}))
        print(f"{self.stage}: resuming from {folder.name}", flush=True)
        return step, state

    def after_step(self, done: int, **state) -> None:
        from hybridcore.parallel import any_rank
        stop = any_rank(stop_requested())  # every rank stops after the same step (the checkpoint is collective)
        if self.ckpt.due(done) or stop:
            self.ckpt.save(done, self.models, self.stateful, {"log": self.log.state(), **state}, self.engines)
        if stop:
            raise Interrupted(f"{self.stage} stopped after step {done}, checkpoint written; run again to resume")
