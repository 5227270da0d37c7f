"""Reward model: the SFT model with a one-output score head, trained on preference pairs.

Bradley-Terry loss -log sigmoid(r_chosen - r_rejected); the score is read at each sequence's last
real token, as AutoModelForSequenceClassification pools it. Held-out pairwise accuracy is reported.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from hybridcore.batch import encode, micro_batches, pack, shuffled_batches
from hybridcore.forward import sequence_scores
from hybridcore.freezing import assert_frozen
from hybridcore.models import set_activation_checkpointing
from hybridcore.optim import adamw, step, warmup_cosine
from stages import data
from hybridcore.interrupts import fault_point
from hybridcore.models import load_tokenizer
from stages.common import (Resumable, StepLog, checkpointed, export, finite, load_scorer, seed_all, total_steps,
                           with_lora)


def pair_scores(model, prompts, chosen, rejected, pad_id):
    """Scores of chosen and rejected responses, both in one forward pass."""
    batch = pack(prompts + prompts, chosen + rejected, pad_id)
    scores = sequence_scores(model, batch)
    n = len(prompts)
    return scores[:n], scores[n:]


@torch.no_grad()
def heldout_accuracy(model, prompts, chosen, rejected, pad_id, micro: int) -> dict:
    model.eval()
    wins, margins = [], []
    for s in micro_batches(len(prompts), micro):
        c, r = pair_scores(model, prompts[s], chosen[s], rejected[s], pad_id)
        wins.append((c > r).float())
        margins.append(c - r)
    model.train()
    return {"heldout_accuracy": float(torch.cat(wins).mean()), "heldout_margin": float(torch.cat(margins).mean())}


def encode_pairs(tok, ds, max_len, what):
    prompts, chosen = encode(tok, ds["prompt"], ds["chosen"], max_len, what)
    _, rejected = encode(tok, ds["prompt"], ds["rejected"], max_len, what)
    return prompts, chosen, rejected


def run(p, inputs: dict[str, Path], out: Path, sink) -> dict:
    cfg = p.reward
    seed_all(p.pipeline.seed)
    tok = load_tokenizer(str(inputs["sft"] / "model"))
    model = load_scorer(p, inputs["sft"] / "model", "reward", tok.pad_token_id)
    model, peft = with_lora(p, model, "reward", keep_trainable=("score",))
    split = data.load("preferences", p)
    prompts, chosen, rejected = encode_pairs(tok, split.train, cfg.max_seq_len, "data.preferences")
    held = encode_pairs(tok, split.heldout, cfg.max_seq_len, "data.preferences (held out)")
    steps = total_steps(len(prompts), cfg.batch_size, cfg.epochs, "reward.batch_size")
    opt = adamw(model, cfg.lr, cfg.weight_decay)
    assert_frozen("reward", {"model": model}, [opt])
    sched = warmup_cosine(opt, steps, cfg.warmup_ratio, cfg.min_lr_ratio)
    set_activation_checkpointing(model, p.engine.activation_checkpointing)
    model.train()
    log = StepLog("reward", steps, sink)
    loop = Resumable("reward", out, cfg, {"model": checkpointed(model, peft)}, {"optimizer": opt, "schedule": sched},
                     log)
    start, _ = loop.resume()
    for i, idx in enumerate(shuffled_batches(len(prompts), cfg.batch_size, cfg.epochs, p.pipeline.seed)):
        if i < start:
            continue
        fault_point("reward", i)
        total, correct = 0.0, 0.0
        for s in micro_batches(len(idx), cfg.micro_batch_size):
            rows = idx[s]
            c, r = pair_scores(model, [prompts[j] for j in rows], [chosen[j] for j in rows],
                               [rejected[j] for j in rows], tok.pad_token_id)
            loss = -F.logsigmoid(c - r).sum() / len(idx)
            loss.backward()
            total += loss.item()
            correct += float((c > r).sum())
        if finite("reward", i, cfg.on_nonfinite, loss=total):
            norm = step(model, opt, sched, cfg.max_grad_norm)
            n_tokens = sum(len(prompts[j]) * 2 + len(chosen[j]) + len(rejected[j]) for j in idx)
            log.step(i, total, n_tokens, accuracy=correct / len(idx), lr=sched.get_last_lr()[0], grad_norm=norm)
        else:
            opt.zero_grad(set_to_none=True)
        loop.after_step(i + 1)
    metrics = log.close()
    metrics.update(heldout_accuracy(model, *held, tok.pad_token_id, cfg.micro_batch_size))
    sink.log({k: v for k, v in metrics.items() if k.startswith("heldout")}, steps)
    set_activation_checkpointing(model, False)
    export(p, "reward", model, peft, tok, out)
    return metrics
