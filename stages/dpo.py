"""DPO: the SFT policy learns from preference pairs directly, with no reward model and no rollouts: each pair pulls
its chosen response's summed log-prob up and its rejected one's down, relative to the frozen SFT model.

The reference's log-probs (with LoRA: the policy's base with the adapters off, no second copy) are computed once
and cached beside the step checkpoints, so a resumed run reads them instead of loading the reference again.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybridcore.adapters import use_adapter
from hybridcore.batch import micro_batches, pack, right_pad, shuffled_batches
from hybridcore.engine import checkpoint_parts
from hybridcore.errors import say
from hybridcore.forward import response_logprobs
from hybridcore.interrupts import fault_active, fault_point
from hybridcore.models import load_tokenizer, set_activation_checkpointing
from hybridcore.oom import OomBackoff
from hybridcore.parallel import dp_share, dp_sum, is_main
from hybridcore.rl import dpo_loss
from stages import data
from stages.params import check_dpo_layout
from stages.common import (Resumable, StepLog, checkpointed, checkpointing, context_of, export, finite, frozen,
                           load_policy, optim_engine, optimizer_metrics, seed_all, total_steps, tp_split, with_lora)
from stages.examples import PolicyPairs, policy_pairs

REFERENCE = "checkpoints/reference-logprobs.safetensors"  # in the staging folder: kept across a resume, dropped
SIDES = ("chosen", "rejected")                             # (with the step checkpoints) when the artifact publishes
CHUNK_PAIRS = 256  # pairs per unit of the no-grad passes' out-of-memory back-off


def pair_logps(model, pairs: PolicyPairs, rows: list[int], pad_id: int):
    """Summed response log-probs ([n] float32 each) of the chosen and the rejected side of `rows`, in one forward."""
    sides = (pairs.chosen, pairs.rejected)
    batch = pack([s.prompts[j] for s in sides for j in rows], [s.responses[j] for s in sides for j in rows], pad_id,
                 model.device)
    mask = right_pad([s.masks[j] for s in sides for j in rows], 0, batch.response_mask.shape[1])[0]
    logp = (response_logprobs(model, batch) * mask.to(batch.input_ids.device)).sum(1)
    return logp[:len(rows)], logp[len(rows):]


@torch.no_grad()
def all_logps(model, sets: dict[str, PolicyPairs], pad_id: int, micro: int, what: str) -> dict:
    """{set: {"chosen": [N], "rejected": [N]}} for every pair, float32 on the CPU, without autograd, `micro` pairs per
    forward: halved on an out-of-memory error for the rest of the pass (fault hook `dpo:<what>:oom:<chunk>`)."""
    was_training, out, k = model.training, {}, 0
    model.eval()
    backoff = OomBackoff(f"dpo {what}", micro, fault=f"dpo:{what}")
    for name, pairs in sets.items():
        got = {s: [] for s in SIDES}
        for chunk in micro_batches(len(pairs), CHUNK_PAIRS):
            parts: list = []

            def micro_step(s: slice) -> float:
                if s.start == 0:  # a chunk redone at a smaller micro-batch starts again
                    parts.clear()
                rows = list(range(chunk.start + s.start, chunk.start + s.stop))
                parts.append(pair_logps(model, pairs, rows, pad_id))
                return 0.0
            backoff.run(k, chunk.stop - chunk.start, micro_step, lambda: None)
            k += 1
            for i, side in enumerate(SIDES):
                got[side] += [part[i].float().cpu() for part in parts]
        out[name] = {side: torch.cat(v) for side, v in got.items()}
    model.train(was_training)
    return out


def fingerprint(sets: dict[str, PolicyPairs]) -> str:
    """What the cached reference log-probs were computed over: every pair's ids, so a stale file is never used."""
    h = hashlib.sha256()
    for name, pairs in sets.items():
        for side in (pairs.chosen, pairs.rejected):
            h.update(json.dumps([name, side.prompts, side.responses, side.masks]).encode())
    return h.hexdigest()


def read_reference(path: Path, digest: str, sets: dict[str, PolicyPairs]) -> dict | None:
    """The cached reference log-probs when `path` holds them for exactly these pairs; None otherwise."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("fingerprint") != digest:
                raise ValueError("computed over other pairs")
            got = {k: f.get_tensor(k) for k in f.keys()}
        for name, pairs in sets.items():
            for side in SIDES:
                if got[f"{name}.{side}"].shape != (len(pairs),):
                    raise ValueError(f"{name}.{side} has the wrong length")
    except Exception as e:  # noqa: BLE001 -- a truncated or foreign file is recomputed, not trusted
        say(f"dpo: cached reference log-probs {path} unusable ({e}); computing them again")
        return None
    return {name: {side: got[f"{name}.{side}"] for side in SIDES} for name in sets}


def write_reference(path: Path, logps: dict, digest: str) -> None:
    if not is_main():  # every rank computed the same values; one writes them
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({f"{name}.{side}": t.contiguous() for name, by in logps.items() for side, t in by.items()}, str(tmp),
              metadata={"fingerprint": digest})
    os.replace(tmp, path)


def reference_logps(p, sft: Path, out: Path, model, peft, sets: dict[str, PolicyPairs], pad_id: int) -> dict:
    """{set: {"chosen": [N], "rejected": [N]}} of the reference policy: read from the staging folder when an earlier
    attempt of this stage computed them, else computed (adapters off, or a frozen SFT copy loaded only for this and
    freed after) and written there."""
    path, digest = out / REFERENCE, fingerprint(sets)
    cached = read_reference(path, digest, sets)
    if cached is not None:
        say(f"dpo: reference log-probs read from {path} (an earlier attempt computed them)")
        return cached
    if peft is not None:  # the SFT weights are the policy's frozen base: switch the adapters off
        with use_adapter(model, None):
            logps = all_logps(model, sets, pad_id, p.dpo.micro_batch_size, "reference")
    else:
        ref = frozen(load_policy(p, sft, "reference"))
        logps = all_logps(ref, sets, pad_id, p.dpo.micro_batch_size, "reference")
        del ref
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_reference(path, logps, digest)
    say(f"dpo: reference log-probs of {sum(map(len, sets.values()))} pairs computed once, kept in {path}")
    return logps


def probe(model, pairs: PolicyPairs, pad_id: int, cfg):
    """The memory planner's probe: one real micro-step (forward + backward) of `rows` copies of the longest pair."""
    def length(j: int) -> int:
        return max(len(s.prompts[j]) + len(s.responses[j]) for s in (pairs.chosen, pairs.rejected))
    j = max(range(len(pairs)), key=length)

    def micro_step(rows: int) -> None:
        try:
            c, r = pair_logps(model, pairs, [j] * rows, pad_id)
            dpo_loss(c, r, c.detach(), r.detach(), cfg.beta, cfg.loss)[0].backward()
        finally:  # also after an out-of-memory error: no gradient may reach the first real step
            model.zero_grad(set_to_none=True)
    return micro_step


def heldout(model, held: PolicyPairs, ref: dict, pad_id: int, micro: int, cfg) -> dict:
    """Held-out pairs under the trained policy: how often its implicit reward beta (log pi - log ref) prefers the
    chosen response (heldout_accuracy), by how much on average (heldout_margin), and the DPO loss."""
    got = all_logps(model, {"heldout": held}, pad_id, micro, "heldout")["heldout"]
    loss, c, r, _ = dpo_loss(got["chosen"], got["rejected"], ref["chosen"], ref["rejected"], cfg.beta, cfg.loss)
    return {"heldout_accuracy": float((c > r).float().mean()), "heldout_margin": float((c - r).mean()),
            "heldout_loss": float(loss)}


def step(cfg, engine, model, pairs: PolicyPairs, ref: dict, idx: list[int], i: int, backoff: OomBackoff,
         pad_id: int) -> dict:
    """Forward + backward of one batch of pairs (this rank's share, in micro-batches); the sums over every rank of
    the loss (already the batch mean), rewards, log-probs and wins, divided by the batch's pair count."""
    mine, sums = dp_share(idx), [0.0] * 5

    def micro_step(s: slice) -> float:
        if s.start == 0:  # a step redone at a smaller micro-batch sums again from zero
            sums[:] = [0.0] * 5
        rows = mine[s]
        c, r = engine.forward(pair_logps, model, pairs, rows, pad_id)
        at = torch.tensor(rows)
        loss, cr, rr, _ = dpo_loss(c, r, ref["chosen"][at].to(c.device), ref["rejected"][at].to(c.device), cfg.beta,
                                   cfg.loss)
        loss = loss * (len(rows) / len(idx))  # the batch mean, whatever the micro-batching and the ranks
        if fault_active("dpo", "nan", i):
            loss = loss * float("nan")
        engine.backward(loss)
        for k, v in enumerate((cr.sum(), rr.sum(), c.detach().sum(), r.detach().sum(), (cr > rr).sum())):
            sums[k] += float(v)
        return loss.item()

    total = backoff.run(i, len(mine), micro_step, engine.zero_grad)
    total, *sums = dp_sum([total, *sums])
    n = len(idx)
    return {"loss": total, "chosen_reward": sums[0] / n, "rejected_reward": sums[1] / n,
            "reward_margin": (sums[0] - sums[1]) / n, "chosen_logp": sums[2] / n, "rejected_logp": sums[3] / n,
            "accuracy": sums[4] / n}


def load_pairs(p, tok, model) -> tuple[PolicyPairs, PolicyPairs]:
    """(train, held-out) preference pairs, split into prompt and response as the policy reads them."""
    split = data.load("preferences", p)
    conv, where = data.is_conversational(split.train, "preferences"), data.source(p, "preferences")
    return tuple(policy_pairs(tok, ds, conv, p.dpo.max_seq_len, where, context_of(model))
                 for ds in (split.train, split.heldout))


def run(p, inputs: dict[str, Path], out: Path, sink) -> dict:
    cfg, sft = p.dpo, inputs["sft"] / "model"
    check_dpo_layout(p)  # load_params refused it already; a Params built another way is refused here
    seed_all(p.pipeline.seed)
    tok = load_tokenizer(str(sft))
    model, peft = with_lora(p, tp_split(p, load_policy(p, sft, "actor")), "actor")
    pairs, held = load_pairs(p, tok, model)
    ref = reference_logps(p, sft, out, model, peft, {"train": pairs, "heldout": held}, tok.pad_token_id)
    steps = total_steps(len(pairs), cfg.batch_size, cfg.epochs, "dpo.batch_size")
    set_activation_checkpointing(model, checkpointing(p, "actor"))
    model.train()
    engine, micro, plan_metrics = optim_engine(p, "dpo", model, steps, probe(model, pairs, tok.pad_token_id, cfg), sink)
    log = StepLog("dpo", steps, sink)
    loop = Resumable("dpo", out, cfg, *checkpoint_parts({"": engine}, {"model": checkpointed(model, peft)}), log)
    start, _ = loop.resume()
    backoff = OomBackoff("dpo", micro)
    for i, idx in enumerate(shuffled_batches(len(pairs), cfg.batch_size, cfg.epochs, p.pipeline.seed)):
        if i < start:
            continue
        fault_point("dpo", i)
        stats = step(cfg, engine, model, pairs, ref["train"], idx, i, backoff, tok.pad_token_id)
        if finite("dpo", i, cfg.on_nonfinite, loss=stats["loss"]):
            norm = engine.step()
            n_tokens = sum(sum(s.masks[j]) for s in (pairs.chosen, pairs.rejected) for j in idx)
            log.step(i, stats.pop("loss"), n_tokens, lr=engine.lr, grad_norm=norm, micro_batch=backoff.micro_batch,
                     **stats)
        else:
            engine.zero_grad()
        loop.after_step(i + 1)
    metrics = {**log.close(), **optimizer_metrics({"": engine}), **plan_metrics,
               "longest_response_tokens": max(pairs.longest_reply, held.longest_reply)}  # evaluation's max_new_tokens
    metrics.update(heldout(model, held, ref["heldout"], tok.pad_token_id, micro, cfg))
    sink.log({k: v for k, v in metrics.items() if k.startswith("heldout")}, steps)
    set_activation_checkpointing(model, False)
    export(p, "actor", engine, model, peft, tok, out)  # every rank: tp shards are gathered, rank 0 writes
    return metrics
