"""The micro model, batch and step settings shared by bench/zero_check.py and the ZeRO, data-parallel, tp, OOM
and planner tests (and their torchrun workers), so every comparison trains the same thing."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

BATCH, MICRO, SEQ, VOCAB = 8, 2, 16, 128
STEP_KW = dict(lr=1e-2, total_steps=10, warmup_ratio=0.2, min_lr_ratio=0.1, max_grad_norm=1.0, weight_decay=0.1)


def micro_model(seed: int = 0) -> LlamaForCausalLM:
    """head_dim 32, every Linear a multiple of 32; fp32."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def batch(seed: int = 1, rows: int = BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, SEQ), generator=g)


def token_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy; the caller divides by the step's token count."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
