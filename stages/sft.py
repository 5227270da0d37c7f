"""Supervised fine-tuning: causal-LM loss on response tokens only (the prompt is masked).

AdamW with warm-up and cosine decay, gradient accumulation over micro-batches; the loss is the mean
over every response token of the whole batch, whatever the micro-batching.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hybridcore.batch import encode, micro_batches, pack, shuffled_batches
from hybridcore.forward import response_nll
from hybridcore.freezing import assert_frozen
from hybridcore.models import set_activation_checkpointing
from hybridcore.optim import adamw, step, warmup_cosine
from stages import data
from hybridcore.interrupts import fault_active, fault_point
from stages.common import (Resumable, StepLog, base_model, checkpointed, export, finite, seed_all, total_steps,
                           with_lora)


def token_losses(model, batch):
    """Per-token cross-entropy [B, R] and whether argmax hit the label (the LM head runs in chunks)."""
    return response_nll(model, batch)


@torch.no_grad()
def evaluate(model, prompts, responses, pad_id, micro: int) -> dict:
    model.eval()
    loss_sum = hits = n = 0.0
    for s in micro_batches(len(prompts), micro):
        batch = pack(prompts[s], responses[s], pad_id)
        loss, hit = token_losses(model, batch)
        m = batch.response_mask
        loss_sum += float((loss * m).sum())
        hits += float((hit * m).sum())
        n += float(m.sum())
    model.train()
    return {"heldout_loss": loss_sum / n, "heldout_token_accuracy": hits / n}


def run(p, inputs: dict[str, Path], out: Path, sink) -> dict:
    cfg = p.sft
    seed_all(p.pipeline.seed)
    tok, model = base_model(p)
    model, peft = with_lora(p, model, "actor")
    split = data.load("sft", p)
    prompts, responses = encode(tok, split.train["prompt"], split.train["response"], cfg.max_seq_len, "data.sft")
    h_prompts, h_responses = encode(tok, split.heldout["prompt"], split.heldout["response"], cfg.max_seq_len,
                                    "data.sft (held out)")
    steps = total_steps(len(prompts), cfg.batch_size, cfg.epochs, "sft.batch_size")
    opt = adamw(model, cfg.lr, cfg.weight_decay)
    assert_frozen("sft", {"model": model}, [opt])
    sched = warmup_cosine(opt, steps, cfg.warmup_ratio, cfg.min_lr_ratio)
    set_activation_checkpointing(model, p.engine.activation_checkpointing)
    model.train()
    log = StepLog("sft", steps, sink)
    loop = Resumable("sft", out, cfg, {"model": checkpointed(model, peft)}, {"optimizer": opt, "schedule": sched},
                     log)
    start, _ = loop.resume()
    for i, idx in enumerate(shuffled_batches(len(prompts), cfg.batch_size, cfg.epochs, p.pipeline.seed)):
        if i < start:
            continue
        fault_point("sft", i)
        n_tokens = sum(len(responses[j]) for j in idx)
        total = 0.0
        for s in micro_batches(len(idx), cfg.micro_batch_size):
            rows = idx[s]
            batch = pack([prompts[j] for j in rows], [responses[j] for j in rows], tok.pad_token_id)
            loss, _ = token_losses(model, batch)
            loss = (loss * batch.response_mask).sum() / n_tokens
            if fault_active("sft", "nan", i):
                loss = loss * float("nan")
            loss.backward()
            total += loss.item()
        if finite("sft", i, cfg.on_nonfinite, loss=total):
            norm = step(model, opt, sched, cfg.max_grad_norm)
            log.step(i, total, n_tokens, lr=sched.get_last_lr()[0], grad_norm=norm)
        else:
            opt.zero_grad(set_to_none=True)
        loop.after_step(i + 1)
    metrics = log.close()
    metrics.update(evaluate(model, h_prompts, h_responses, tok.pad_token_id, cfg.micro_batch_size))
    sink.log({k: v for k, v in metrics.items() if k.startswith("heldout")}, steps)
    set_activation_checkpointing(model, False)
    export(p, "actor", model, peft, tok, out)
    return metrics
