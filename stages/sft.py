"""Supervised fine-tuning: causal-LM loss on response tokens only (the prompt is masked; in a conversation, every
assistant turn and nothing else: stages/examples.py).

AdamW with warm-up and cosine decay (plain torch, or DeepSpeed ZeRO as engine.layout says), gradient
accumulation over micro-batches; the loss is the mean over every response token of the whole batch, whatever
the micro-batching, so an out-of-memory back-off that halves the micro-batch leaves the step unchanged.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hybridcore.batch import micro_batches, pack, right_pad, shuffled_batches
from hybridcore.forward import response_nll
from hybridcore.models import set_activation_checkpointing
from hybridcore.oom import OomBackoff
from hybridcore.parallel import dp_share, dp_sum
from stages import data
from stages.examples import SftExamples, sft_examples
from hybridcore.interrupts import fault_active, fault_point
from hybridcore.engine import checkpoint_parts
from stages.common import (Resumable, StepLog, base_model, checkpointed, checkpointing, context_of, export,
                           finite, optim_engine, optimizer_metrics, seed_all, total_steps, tp_split, with_lora)


def token_losses(model, batch):
    """Per-token cross-entropy [B, R] and whether argmax hit the label (the LM head runs in chunks)."""
    return response_nll(model, batch)


def loss_mask(ex: SftExamples, rows: list[int], batch) -> torch.Tensor:
    """1 on the tokens that carry loss ([B, R], on the batch's device): a standard response whole, a conversation's
    assistant turns only."""
    return right_pad([ex.masks[j] for j in rows], 0, batch.response_mask.shape[1])[0].to(batch.input_ids.device)


def rows_batch(ex: SftExamples, rows: list[int], pad_id: int, device):
    batch = pack([ex.prompts[j] for j in rows], [ex.responses[j] for j in rows], pad_id, device)
    return batch, loss_mask(ex, rows, batch)


@torch.no_grad()
def evaluate(model, ex: SftExamples, pad_id, micro: int) -> dict:
    model.eval()
    loss_sum = hits = n = 0.0
    for s in micro_batches(len(ex.prompts), micro):
        batch, m = rows_batch(ex, list(range(s.start, s.stop)), pad_id, model.device)
        loss, hit = token_losses(model, batch)
        loss_sum += float((loss * m).sum())
        hits += float((hit * m).sum())
        n += float(m.sum())
    model.train()
    return {"heldout_loss": loss_sum / n, "heldout_token_accuracy": hits / n}


def probe(model, ex: SftExamples, pad_id):
    """The memory planner's probe: one real micro-step (forward + backward) of `rows` copies of the longest row."""
    j = max(range(len(ex.prompts)), key=lambda j: len(ex.prompts[j]) + len(ex.responses[j]))

    def micro_step(rows: int) -> None:
        try:
            batch, mask = rows_batch(ex, [j] * rows, pad_id, model.device)
            loss, _ = token_losses(model, batch)
            ((loss * mask).sum() / mask.sum()).backward()
        finally:  # also after an out-of-memory error: no gradient may reach the first real step
            model.zero_grad(set_to_none=True)
    return micro_step


def run(p, inputs: dict[str, Path], out: Path, sink) -> dict:
    cfg = p.sft
    seed_all(p.pipeline.seed)
    tok, model = base_model(p)
    model, peft = with_lora(p, tp_split(p, model), "actor")
    split = data.load("sft", p)
    conv, positions = data.is_conversational(split.train, "sft"), context_of(model)
    ex = sft_examples(tok, split.train, conv, cfg.max_seq_len, data.source(p, "sft"), positions)
    held = sft_examples(tok, split.heldout, conv, cfg.max_seq_len, data.source(p, "sft"), positions)
    steps = total_steps(len(ex.prompts), cfg.batch_size, cfg.epochs, "sft.batch_size")
    set_activation_checkpointing(model, checkpointing(p, "actor"))
    model.train()
    engine, micro, plan_metrics = optim_engine(p, "sft", model, steps, probe(model, ex, tok.pad_token_id), sink)
    log = StepLog("sft", steps, sink)
    loop = Resumable("sft", out, cfg, *checkpoint_parts({"": engine}, {"model": checkpointed(model, peft)}), log)
    start, _ = loop.resume()
    backoff = OomBackoff("sft", micro)
    for i, idx in enumerate(shuffled_batches(len(ex.prompts), cfg.batch_size, cfg.epochs, p.pipeline.seed)):
        if i < start:
            continue
        fault_point("sft", i)
        n_tokens = sum(sum(ex.masks[j]) for j in idx)  # over the global batch: the ranks' gradients sum to dp=1's
        mine = dp_share(idx)  # this dp rank's rows of it

        def micro_step(s: slice) -> float:
            batch, mask = rows_batch(ex, mine[s], tok.pad_token_id, model.device)
            loss, _ = engine.forward(token_losses, model, batch)  # ZeRO-3 counts its micro-step there
            loss = (loss * mask).sum() / n_tokens
            if fault_active("sft", "nan", i):
                loss = loss * float("nan")
            engine.backward(loss)
            return loss.item()

        total = dp_sum(backoff.run(i, len(mine), micro_step, engine.zero_grad))
        if finite("sft", i, cfg.on_nonfinite, loss=total):
            norm = engine.step()
            log.step(i, total, n_tokens, lr=engine.lr, grad_norm=norm, micro_batch=backoff.micro_batch)
        else:
            engine.zero_grad()
        loop.after_step(i + 1)
    metrics = {**log.close(), **optimizer_metrics({"": engine}), **plan_metrics,
               "longest_response_tokens": max(ex.longest_reply, held.longest_reply)}  # PPO's max_new_tokens reads it
    metrics.update(evaluate(model, held, tok.pad_token_id, micro))
    sink.log({k: v for k, v in metrics.items() if k.startswith("heldout")}, steps)
    set_activation_checkpointing(model, False)
    export(p, "actor", engine, model, peft, tok, out)  # every rank: tp shards are gathered, rank 0 writes
    return metrics
