"""The hybrid actor: one set of weights serves both training and rollout.

Entering rollout flips the module to eval mode, turns activation checkpointing off and autograd off,
and generates with the very parameters the optimizer updates; no second copy is ever made. Leaving
rollout restores the training mode. Later layers (ZeRO gathering, tensor-parallel regrouping, a static
KV cache) hook into the same two transitions.
"""
from __future__ import annotations

import contextlib
import time

import torch
from transformers import GenerationConfig

from hybridcore.batch import left_pad
from hybridcore.models import set_activation_checkpointing


class HybridActor:
    def __init__(self, model, tokenizer, activation_checkpointing: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.activation_checkpointing = activation_checkpointing
        set_activation_checkpointing(model, activation_checkpointing)
        self.in_rollout = False
        self.last_transition_s: dict[str, float] = {}

    @contextlib.contextmanager
    def rollout(self):
        """Serve generation from the training weights, then hand them back to training."""
        t0 = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        if self.activation_checkpointing:
            set_activation_checkpointing(self.model, False)
        self.in_rollout = True
        self.last_transition_s["enter"] = time.perf_counter() - t0
        try:
            with torch.no_grad():
                yield self
        finally:
            t1 = time.perf_counter()
            self.in_rollout = False
            if self.activation_checkpointing:
                set_activation_checkpointing(self.model, True)
            self.model.train(was_training)
            self.last_transition_s["exit"] = time.perf_counter() - t1

    def generate(self, prompts: list[list[int]], max_new_tokens: int, greedy: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[list[int]]:
        """Responses (token ids, ending with eos when the model stopped) for left-padded prompts."""
        if not self.in_rollout:
            raise RuntimeError("HybridActor.generate must run inside `with actor.rollout():`")
        tok = self.tokenizer
        ids, mask = left_pad(prompts, tok.pad_token_id)
        device = next(self.model.parameters()).device
        # top_k=0 explicitly: None would let generate() fill in its global default of 50, and rollouts would
        # then come from a truncated distribution while PPO scores them under the full softmax.
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=not greedy, temperature=temperature,
                               top_k=top_k, top_p=top_p, pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.eos_token_id, bos_token_id=None)
        if greedy:
            cfg.temperature, cfg.top_k, cfg.top_p = None, None, None
        out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=cfg)
        responses = []
        for row in out[:, ids.shape[1]:].tolist():
            if tok.eos_token_id in row:
                row = row[: row.index(tok.eos_token_id) + 1]
            responses.append(row)
        return responses
