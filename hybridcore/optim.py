"""Optimiser and schedule: AdamW with linear warm-up and cosine decay."""
from __future__ import annotations

import math

import torch


def param_groups(model, weight_decay: float) -> list[dict]:
    """Only trainable parameters; norms and biases (1-D tensors) get no weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def adamw(model, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.95))


def warmup_cosine(optimizer, total_steps: int, warmup_ratio: float, min_lr_ratio: float = 0.1):
    warmup = int(total_steps * warmup_ratio)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def step(model, optimizer, scheduler, max_grad_norm: float) -> float:
    """Clip, step, advance the schedule, clear grads; returns the pre-clip gradient norm."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
