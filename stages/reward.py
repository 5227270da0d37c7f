"""Reward model: the SFT model with a one-output score head, trained on preference pairs.

Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) over whole texts (prompt + response, or the rendered
conversation), the score read where AutoModelForSequenceClassification pools, so the exported folder scores a text
under plain transformers as it did here (stages/examples.py). Held-out pairwise accuracy is reported.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from hybridcore.batch import micro_batches, shuffled_batches
from hybridcore.forward import sequence_scores, sequences
from hybridcore.models import set_activation_checkpointing
from hybridcore.oom import OomBackoff
from hybridcore.parallel import dp_share, dp_sum
from stages import data
from stages.examples import PairExamples, pair_examples
from hybridcore.interrupts import fault_point
from hybridcore.models import load_tokenizer
from hybridcore.engine import checkpoint_parts
from stages.common import (Resumable, StepLog, checkpointed, checkpointing, context_of, export, finite,
                           load_scorer, optim_engine, optimizer_metrics, seed_all, total_steps, tp_split, with_lora)


def pair_scores(model, chosen, rejected, pad_id):
    """Scores of the chosen and the rejected sequences (whole RM inputs), both in one forward pass."""
    scores = sequence_scores(model, sequences(chosen + rejected, pad_id, model.device))
    n = len(chosen)
    return scores[:n], scores[n:]


@torch.no_grad()
def heldout_accuracy(model, pairs: PairExamples, pad_id, micro: int) -> dict:
    model.eval()
    wins, margins = [], []
    for s in micro_batches(len(pairs.chosen), micro):
        c, r = pair_scores(model, pairs.chosen[s], pairs.rejected[s], pad_id)
        wins.append((c > r).float())
        margins.append(c - r)
    model.train()
    return {"heldout_accuracy": float(torch.cat(wins).mean()), "heldout_margin": float(torch.cat(margins).mean())}


def probe(model, pairs: PairExamples, pad_id):
    """The memory planner's probe: one real micro-step of `rows` copies of the longest pair."""
    j = max(range(len(pairs.chosen)), key=lambda j: max(len(pairs.chosen[j]), len(pairs.rejected[j])))

    def micro_step(rows: int) -> None:
        try:
            c, r = pair_scores(model, [pairs.chosen[j]] * rows, [pairs.rejected[j]] * rows, pad_id)
            (-F.logsigmoid(c - r).mean()).backward()
        finally:  # also after an out-of-memory error: no gradient may reach the first real step
            model.zero_grad(set_to_none=True)
    return micro_step


def run(p, inputs: dict[str, Path], out: Path, sink) -> dict:
    cfg = p.reward
    seed_all(p.pipeline.seed)
    tok = load_tokenizer(str(inputs["sft"] / "model"))
    model = tp_split(p, load_scorer(p, inputs["sft"] / "model", "reward", tok.pad_token_id))  # score head whole
    model, peft = with_lora(p, model, "reward", keep_trainable=("score",))
    split = data.load("preferences", p)
    conv, positions = data.is_conversational(split.train, "preferences"), context_of(model)
    pairs = pair_examples(tok, split.train, conv, cfg.max_seq_len, data.source(p, "preferences"), positions)
    held = pair_examples(tok, split.heldout, conv, cfg.max_seq_len, data.source(p, "preferences"), positions)
    steps = total_steps(len(pairs.chosen), cfg.batch_size, cfg.epochs, "reward.batch_size")
    set_activation_checkpointing(model, checkpointing(p, "reward"))
    model.train()
    engine, micro, plan_metrics = optim_engine(p, "reward", model, steps, probe(model, pairs, tok.pad_token_id), sink)
    log = StepLog("reward", steps, sink)
    loop = Resumable("reward", out, cfg, *checkpoint_parts({"": engine}, {"model": checkpointed(model, peft)}), log)
    start, _ = loop.resume()
    backoff = OomBackoff("reward", micro)
    for i, idx in enumerate(shuffled_batches(len(pairs.chosen), cfg.batch_size, cfg.epochs, p.pipeline.seed)):
        if i < start:
            continue
        fault_point("reward", i)
        correct = [0.0]
        mine = dp_share(idx)  # this dp rank's pairs; the loss below is divided by the global pair count

        def micro_step(s: slice) -> float:
            if s.start == 0:  # a step redone at a smaller micro-batch counts its hits again from zero
                correct[0] = 0.0
            rows = mine[s]
            c, r = engine.forward(pair_scores, model, [pairs.chosen[j] for j in rows],
                                  [pairs.rejected[j] for j in rows], tok.pad_token_id)
            loss = -F.logsigmoid(c - r).sum() / len(idx)
            engine.backward(loss)
            correct[0] += float((c > r).sum())
            return loss.item()

        total, correct[0] = dp_sum([backoff.run(i, len(mine), micro_step, engine.zero_grad), correct[0]])
        if finite("reward", i, cfg.on_nonfinite, loss=total):
            norm = engine.step()
            n_tokens = sum(len(pairs.chosen[j]) + len(pairs.rejected[j]) for j in idx)
            log.step(i, total, n_tokens, accuracy=correct[0] / len(idx), lr=engine.lr, grad_norm=norm,
                     micro_batch=backoff.micro_batch)
        else:
            engine.zero_grad()
        loop.after_step(i + 1)
    metrics = {**log.close(), **optimizer_metrics({"": engine}),
               "longest_response_tokens": max(pairs.longest_reply, held.longest_reply)}  # PPO's max_new_tokens
    metrics.update(heldout_accuracy(model, held, tok.pad_token_id, micro), **plan_metrics)
    sink.log({k: v for k, v in metrics.items() if k.startswith("heldout")}, steps)
    set_activation_checkpointing(model, False)
    export(p, "reward", engine, model, peft, tok, out)  # every rank: tp shards are gathered, rank 0 writes
    return metrics
