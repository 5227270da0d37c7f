"""Forward passes shared by the stages, in micro-batches, on the `Batch` layout.

Response log-probs, entropies and token losses never hold a micro-batch's whole [B, R, vocab] float32
logits: the LM head runs over `chunk_tokens` response positions at a time (by default as many as make
CHUNK_BYTES of float32 logits: 261 positions at Llama-3's 128,256-token vocabulary), and under autograd (when
there is more than one chunk) each chunk is recomputed in backward, so only hidden states are kept between them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hybridcore.adapters import mixed_precision
from hybridcore.batch import Batch, micro_batches
from hybridcore.rl import entropy_from_logits, token_logprobs

CHUNK_BYTES = 128 * 2 ** 20  # float32 logits of one LM-head chunk; its backward holds a few times this


def chunk_tokens_for(vocab: int) -> int:
    """Response positions per LM-head chunk: CHUNK_BYTES of float32 logits (at least one position)."""
    return max(1, CHUNK_BYTES // (4 * max(1, vocab)))


def response_logits(model, batch: Batch) -> torch.Tensor:
    """Logits that predict each response token ([B, R, V]); prompt positions' logits are never computed.
    The whole micro-batch's logits at once: for callers that need them all (tests, small vocabularies)."""
    R = batch.response_mask.shape[1]
    with mixed_precision(model):
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                    logits_to_keep=R + 1, use_cache=False)
    return out.logits[:, :-1]


def _plain_head(model) -> bool:
    """True when logits are exactly lm_head(last hidden state): no soft-capping or scaling after the head."""
    c = model.config
    text = getattr(c, "text_config", None) or c
    return (getattr(text, "final_logit_softcapping", None) is None and getattr(text, "logit_scale", None) is None
            and model.get_output_embeddings() is not None)


def _head_over_chunks(model, batch: Batch, fn, chunk_tokens: int | None) -> tuple[torch.Tensor, ...]:
    """fn(logits[n, V], labels[n]) -> tuple of [n] tensors, over every response position in chunks; the
    results reshaped to [B, R]."""
    B, R = batch.response_mask.shape
    if chunk_tokens is None:
        head = model.get_output_embeddings()  # out_features: ZeRO-3 leaves the weight itself an empty partition
        chunk_tokens = chunk_tokens_for(getattr(head, "out_features", None) or head.weight.shape[0])
    labels = batch.responses.reshape(-1)
    if not _plain_head(model):  # the model's own forward applies what follows its head; not chunked
        logits = response_logits(model, batch)
        return tuple(t.view(B, R) for t in fn(logits.reshape(B * R, -1), labels))
    with mixed_precision(model):
        hidden = model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                  position_ids=batch.position_ids, use_cache=False).last_hidden_state
    hidden = hidden[:, batch.prompt_len - 1:-1].reshape(B * R, -1)
    head = model.get_output_embeddings()

    def chunk(h, y):
        return fn(head(h), y)

    parts = []
    recompute = torch.is_grad_enabled() and B * R > chunk_tokens  # one chunk holds no more than before
    for s in micro_batches(B * R, chunk_tokens):
        if recompute:
            parts.append(checkpoint(chunk, hidden[s], labels[s], use_reentrant=False))
        else:
            parts.append(chunk(hidden[s], labels[s]))
    return tuple(torch.cat(ts).view(B, R) for ts in zip(*parts))


def _logp(logits, labels):
    return (token_logprobs(logits.unsqueeze(0), labels.unsqueeze(0)).squeeze(0),)


def _logp_entropy(logits, labels):
    return _logp(logits, labels)[0], entropy_from_logits(logits)


def _logp_entropy_logged(logits, labels):
    """The entropy as a statistic only: no graph, so a chunk's backward keeps nothing of it."""
    with torch.no_grad():
        ent = entropy_from_logits(logits)
    return _logp(logits, labels)[0], ent


def _nll_hit(logits, labels):
    logits = logits.float()
    return F.cross_entropy(logits, labels, reduction="none"), (logits.argmax(-1) == labels)


def response_logprobs(model, batch: Batch, chunk_tokens: int | None = None) -> torch.Tensor:
    """log p(response token) under `model`, float32, [B, R]."""
    return _head_over_chunks(model, batch, _logp, chunk_tokens)[0]


def response_logprobs_entropy(model, batch: Batch, chunk_tokens: int | None = None, entropy_grad: bool = True):
    """(log p(response token), entropy of the next-token distribution), both float32 [B, R]. entropy_grad=False:
    the entropy is only logged (no entropy bonus), computed without autograd."""
    return _head_over_chunks(model, batch, _logp_entropy if entropy_grad else _logp_entropy_logged, chunk_tokens)


def response_nll(model, batch: Batch, chunk_tokens: int | None = None):
    """(cross-entropy of each response token, float32 [B, R]; whether argmax hit it, bool [B, R])."""
    return _head_over_chunks(model, batch, _nll_hit, chunk_tokens)


def token_scores(scorer, batch: Batch) -> torch.Tensor:
    """A sequence scorer's score head applied at every position ([B, L]): values for a critic. The body's autocast
    follows the body's own parameters: a trained score head in the base's dtype (a shared critic's value head, a
    LoRA critic's or reward model's `score`) beside float32 adapters once turned it off for the whole body, whose
    LoRA products then ran in float32 (cuBLAS' SIMT kernels, 0.25 s of the 8B step's training, H100, bench/
    RESULTS.md 2026-12-07 13:23)."""
    with mixed_precision(scorer.base_model):
        hidden = scorer.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                   position_ids=batch.position_ids, use_cache=False).last_hidden_state
    head = getattr(scorer.score, "weight", None)
    if head is not None and head.is_floating_point() and head.dtype != hidden.dtype:  # a float32 trained head
        hidden = hidden.to(head.dtype)
    return scorer.score(hidden).squeeze(-1).float()


def response_values(critic, batch: Batch) -> torch.Tensor:
    """V(state before each response token), [B, R]."""
    return token_scores(critic, batch)[:, batch.prompt_len - 1:-1]


def pooled_index(input_ids: torch.Tensor, pad_id) -> torch.Tensor:
    """Where AutoModelForSequenceClassification reads its score: each row's last token that is not the pad id
    (transformers' own rule, so a text that ends in the pad id, as when pad = EOS, pools where a plain call
    pools); the last column when no pad id is set."""
    if pad_id is None:
        return torch.full(input_ids.shape[:1], input_ids.shape[1] - 1, dtype=torch.long, device=input_ids.device)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (positions * (input_ids != pad_id)).argmax(-1)


def sequence_scores(scorer, batch: Batch) -> torch.Tensor:
    """The score of each row, [B], read where AutoModelForSequenceClassification pools (`pooled_index` with the
    scorer's config.pad_token_id). Rows are whole texts (stages/examples.py: `scored_ids`)."""
    scores = token_scores(scorer, batch)
    pad_id = getattr(scorer.config.get_text_config(), "pad_token_id", None)
    return scores.gather(1, pooled_index(batch.input_ids, pad_id).unsqueeze(1)).squeeze(1)


def sequences(rows: list[list[int]], pad_id: int, device=None) -> Batch:
    """A batch of whole sequences (left-padded, no response part): what a reward model scores."""
    from hybridcore.batch import pack
    return pack(rows, [[] for _ in rows], pad_id, device)


@torch.no_grad()
def batched(fn, model, batch: Batch, micro_batch_size: int) -> torch.Tensor:
    """Run fn(model, micro-batch) without autograd over the batch and concatenate."""
    return torch.cat([fn(model, batch.select(s)) for s in micro_batches(len(batch), micro_batch_size)])
