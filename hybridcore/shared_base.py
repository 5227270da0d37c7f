"""share_base: actor and critic as two LoRA adapters on ONE frozen (possibly quantised) base, and the
reference policy as that same base with the adapters off, so no second or third copy of the weights exists.

The critic is the base's backbone run with the "critic" adapter, plus a small value head; `SharedCritic`
gives it the `.base_model` / `.score` shape of a sequence scorer, so forward.response_values works on it.
Which adapter runs is chosen by `use(role)`; forward AND backward of a role must happen inside it, since
activation checkpointing recomputes the forward during backward.
"""
from __future__ import annotations

from typing import Optional

import torch

from hybridcore.adapters import LoraSpec, activate, adapter_parameters, add_lora, use_adapter
from hybridcore.freezing import TrainableState

ADAPTER = {"actor": "actor", "critic": "critic", "reference": None}


class SharedCritic(torch.nn.Module):
    """The value model on a shared base: only the value head is its own parameter."""

    def __init__(self, policy: torch.nn.Module, head: torch.nn.Linear):
        super().__init__()
        self.score = head
        self._policy = [policy]  # in a list so that it is not registered: parameters() is the head alone

    @property
    def base_model(self):
        return self._policy[0].base_model


def value_head(hidden_size: int, dtype: torch.dtype, init_from: Optional[torch.nn.Linear], std: float,
               seed: int) -> torch.nn.Linear:
    """A one-output head, copied from a reward model's score head when given, else N(0, std) from `seed`."""
    head = torch.nn.Linear(hidden_size, 1, bias=False, dtype=dtype)
    with torch.no_grad():
        if init_from is not None:
            head.weight.copy_(init_from.weight.detach().to(dtype))
        else:
            head.weight.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
    return head


class SharedBase:
    def __init__(self, model, actor: LoraSpec, critic: LoraSpec, head: torch.nn.Linear, field: str = "engine.roles"):
        model.requires_grad_(False)
        self.peft = add_lora(model, actor, f"{field}.actor", "actor")
        add_lora(None, critic, f"{field}.critic", "critic", peft_model=self.peft)
        self.model = self.peft.get_base_model()
        self.head = head
        self.critic = SharedCritic(self.model, head)
        self.actor_params = TrainableState(adapter_parameters(self.model, "actor"))
        self.critic_params = TrainableState({**adapter_parameters(self.model, "critic"),
                                             **{f"value_head.{k}": v for k, v in head.named_parameters()}})
        # peft leaves only the last-activated adapter trainable; set exactly what the optimisers update
        self.model.requires_grad_(False)
        for p in (*self.actor_params.parameters(), *self.critic_params.parameters()):
            p.requires_grad_(True)
        activate(self.model, "actor")  # the default outside any `use` block

    def use(self, role: str):
        """Context in which the shared model computes as `role`: actor, critic or reference (adapters off)."""
        return use_adapter(self.model, ADAPTER[role])
