"""One batch layout for every stage: [left-padded prompt | right-padded response].

Prompts end at the same column P, so the response always starts at P whatever its prompt's length:
SFT masks the prompt with it, the reward model reads the last real token, PPO slices its response
tokens, and generation continues a left-padded batch without any reshuffling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    input_ids: torch.Tensor        # [B, P + R]
    attention_mask: torch.Tensor   # [B, P + R], 1 on real tokens
    position_ids: torch.Tensor     # [B, P + R], counted from each row's first real token
    response_mask: torch.Tensor    # [B, R], 1 on real response tokens
    prompt_len: int                # P

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len:]

    @property
    def last_index(self) -> torch.Tensor:
        """Column of each row's last real token (the response's, or the prompt's if the response is empty)."""
        return self.prompt_len + self.response_mask.sum(1).long() - 1

    def to(self, device) -> "Batch":
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.position_ids.to(device),
                     self.response_mask.to(device), self.prompt_len)

    def select(self, idx) -> "Batch":
        return Batch(self.input_ids[idx], self.attention_mask[idx], self.position_ids[idx], self.response_mask[idx],
                     self.prompt_len)

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def left_pad(seqs: list[list[int]], pad_id: int, width: int | None = None):
    """Right-aligned rows: (ids, mask)."""
    width = max(map(len, seqs)) if width is None else width
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int, width: int | None = None):
    width = max(max(map(len, seqs)), 1) if width is None else width
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def pack(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device=None) -> Batch:
    """The batch of these rows, on `device` (where the model that reads it lives; None = the CPU)."""
    p_ids, p_mask = left_pad(prompts, pad_id)
    r_ids, r_mask = right_pad(responses, pad_id)
    mask = torch.cat([p_mask, r_mask], 1)
    batch = Batch(torch.cat([p_ids, r_ids], 1), mask, position_ids(mask), r_mask, p_ids.shape[1])
    return batch if device is None else batch.to(device)


def micro_batches(n: int, size: int):
    """Index slices of at most `size` rows covering range(n)."""
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def shuffled_batches(n: int, batch_size: int, epochs: int, seed: int):
    """Index lists of full batches, reshuffled every epoch from one seeded generator (the tail is dropped)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g).tolist()
        for start in range(0, n - batch_size + 1, batch_size):
            yield perm[start:start + batch_size]
