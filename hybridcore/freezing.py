"""Freezing done right: what is not trained carries no autograd state, and a check that says where it does.

A frozen weight left with requires_grad=True costs a gradient buffer and the activations autograd keeps
for it, silently; on an 8B base that is gigabytes. Stages call `assert_frozen` once after setup.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch


class FreezingError(RuntimeError):
    """A parameter that no optimiser updates is still tracked by autograd (a bug in a stage's setup)."""


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Not trained: no autograd tracking, eval mode."""
    model.requires_grad_(False)
    return model.eval()


def tracked_frozen(models: Mapping[str, torch.nn.Module], trained: Iterable[torch.Tensor]) -> list[str]:
    """Names (`<model>.<param>`) of parameters outside `trained` that autograd still tracks: requires_grad
    on, or a .grad held. A parameter shared by several models is reported once."""
    trained_ids = {id(t) for t in trained}
    seen: set[int] = set()
    found = []
    for label, model in models.items():
        for name, param in model.named_parameters(remove_duplicate=True):
            if id(param) in trained_ids or id(param) in seen:
                continue
            seen.add(id(param))
            if param.requires_grad or param.grad is not None:
                found.append(f"{label}.{name}")
    return found


def assert_frozen(stage: str, models: Mapping[str, torch.nn.Module], optimizers: Iterable) -> None:
    """Fail loudly if any parameter that none of `optimizers` updates is still tracked by autograd (an entry may
    also be the list of parameters an engine trains)."""
    trained = [p for opt in optimizers
               for p in ([q for group in opt.param_groups for q in group["params"]]
                         if hasattr(opt, "param_groups") else opt)]
    found = tracked_frozen(models, trained)
    if found:
        more = f" and {len(found) - 5} more" if len(found) > 5 else ""
        raise FreezingError(f"{stage}: {len(found)} parameter(s) no optimiser updates are still tracked by "
                            f"autograd: {', '.join(found[:5])}{more}")


class TrainableState:
    """The trained parameters of one or more modules (adapters, a value head) under stable names, with the
    state_dict()/load_state_dict() pair that checkpoints use: a LoRA run's step checkpoint holds only these,
    never the frozen (possibly quantised) base."""

    def __init__(self, named: Mapping[str, torch.nn.Parameter]):
        if not named:
            raise ValueError("TrainableState needs at least one parameter")
        self.named = dict(named)

    @classmethod
    def of(cls, model: torch.nn.Module, prefix: str = "") -> "TrainableState":
        return cls({prefix + n: p for n, p in model.named_parameters() if p.requires_grad})

    def parameters(self):
        return iter(self.named.values())

    def named_parameters(self):
        return iter(self.named.items())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.named.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True):
        missing = [n for n in self.named if n not in state]
        unexpected = [n for n in state if n not in self.named]
        if strict and (missing or unexpected):
            raise KeyError(f"checkpoint does not match the trained parameters: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
        with torch.no_grad():
            for n, p in self.named.items():
                if n in state:
                    p.copy_(state[n])
        return missing, unexpected
