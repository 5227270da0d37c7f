"""Forward passes shared by the stages, in micro-batches, on the `Batch` layout."""
from __future__ import annotations

import torch

from hybridcore.batch import Batch, micro_batches
from hybridcore.rl import token_logprobs


def response_logits(model, batch: Batch) -> torch.Tensor:
    """Logits that predict each response token ([B, R, V]); prompt positions' logits are never computed."""
    R = batch.response_mask.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                logits_to_keep=R + 1, use_cache=False)
    return out.logits[:, :-1]


def response_logprobs(model, batch: Batch) -> torch.Tensor:
    """log p(response token) under `model`, float32, [B, R]."""
    return token_logprobs(response_logits(model, batch), batch.responses)


def token_scores(scorer, batch: Batch) -> torch.Tensor:
    """A sequence scorer's score head applied at every position ([B, L]): values for a critic."""
    hidden = scorer.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               position_ids=batch.position_ids, use_cache=False).last_hidden_state
    return scorer.score(hidden).squeeze(-1).float()


def response_values(critic, batch: Batch) -> torch.Tensor:
    """V(state before each response token), [B, R]."""
    return token_scores(critic, batch)[:, batch.prompt_len - 1:-1]


def sequence_scores(scorer, batch: Batch) -> torch.Tensor:
    """The score at each row's last real token, [B]: what AutoModelForSequenceClassification pools."""
    scores = token_scores(scorer, batch)
    return scores.gather(1, batch.last_index.unsqueeze(1)).squeeze(1)


@torch.no_grad()
def batched(fn, model, batch: Batch, micro_batch_size: int) -> torch.Tensor:
    """Run fn(model, micro-batch) without autograd over the batch and concatenate."""
    return torch.cat([fn(model, batch.select(s)) for s in micro_batches(len(batch), micro_batch_size)])
