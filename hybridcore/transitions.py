"""The hybrid actor's transitions: what changes, in place, when the training weights start serving rollout.

Each transition has a `name`, `enter()` and `exit()`; both return extra byte counts worth logging
({"kv_cache": ...}, {"reshard_peak": ...}), usually nothing. `HybridActor.rollout()` enters its list in order
through one ExitStack and leaves it in reverse, timing each one. The list, in order:

- TrainMode: eval mode, activation checkpointing off (autograd is off inside the block itself).
- OptimizerOffload: the optimizer's states copied to pinned CPU buffers reserved once, so the KV cache can
  use that memory; copied back on exit.
- the training backend's rollout weights (Engine.rollout_weights): the tensor-parallel regrouping below, the
  ZeRO-3 gather (hybridcore/zero.py's Zero3Gather) or nothing. Each leaves the model's parameters as the tensors
  the rollout backend reads, so no copy is kept.
- BackendCache: the rollout backend's own enter/exit (its KV cache, a vLLM engine's weight sync).
"""
from __future__ import annotations

import torch

from hybridcore.models import set_activation_checkpointing
from hybridcore.optim import host_buffer


class TrainMode:
    name = "mode"

    def __init__(self, model, checkpointing: bool):
        self.model, self.checkpointing, self.was_training = model, checkpointing, False

    def enter(self) -> dict[str, int]:
        self.was_training = self.model.training
        self.model.eval()
        if self.checkpointing:
            set_activation_checkpointing(self.model, False)
        return {}

    def exit(self) -> dict[str, int]:
        if self.checkpointing:
            set_activation_checkpointing(self.model, True)
        self.model.train(self.was_training)
        return {}


class OptimizerOffload:
    """Every optimizer state tensor copied into (pinned, reused) CPU memory, the device copy dropped; restored on
    exit. `reserve()` allocates the buffers outside any transition (pinning GiBs takes seconds once)."""

    name = "optimizer_offload"

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.host_states: dict[tuple[int, str], torch.Tensor] = {}
        self._offloaded: list[tuple[dict, str, torch.device]] = []

    def _tensors(self):
        for state in self.optimizer.state.values():
            for k, v in list(state.items()):
                if torch.is_tensor(v):
                    yield state, k, v

    def _host_buffer(self, state: dict, k: str, v: torch.Tensor) -> torch.Tensor:
        return host_buffer(self.host_states, (id(state), k), v)

    def reserve(self) -> int:
        """Allocate the buffers for the states that exist now (call after the first step); bytes reserved."""
        for state, k, v in self._tensors():
            self._host_buffer(state, k, v)
        return sum(t.nbytes for t in self.host_states.values())

    def enter(self) -> dict[str, int]:
        cuda = False
        for state, k, v in self._tensors():
            host = self._host_buffer(state, k, v)
            host.copy_(v, non_blocking=v.is_cuda)
            cuda |= v.is_cuda
            self._offloaded.append((state, k, v.device))
            state[k] = host
        if cuda:
            torch.cuda.synchronize()  # the host copies are complete before anyone reads them
        return {}

    def exit(self) -> dict[str, int]:
        for state, k, device in self._offloaded:
            host = state[k]
            state[k] = torch.empty(host.shape, dtype=host.dtype, device=device).copy_(host, non_blocking=True)
        self._offloaded = []
        return {}


class TpRegrouping:
    """A tensor-parallel model's training shards regrouped into the rollout's tp size (hybridcore/reshard.py);
    `resharder` also splits prompts among the rollout groups and gathers their responses."""

    name = "tp_regrouping"

    def __init__(self, resharder):
        self.resharder = resharder

    def enter(self) -> dict[str, int]:
        self.resharder.enter()
        return {"reshard_peak": self.resharder.peak_bytes}

    def exit(self) -> dict[str, int]:
        self.resharder.exit()
        return {}


def tp_regrouping(module, groups, rollout_tp: int | None) -> TpRegrouping | None:
    """The regrouping for a tensor-parallel `module` (None when it is not split); builds its process groups, so
    every rank calls it, in the same order."""
    from hybridcore.tensor_parallel import tp_state

    size = tp_state(module).size
    if size == 1:
        return None
    if groups is None:
        raise ValueError("a tensor-parallel model needs the process groups (groups=parallel.init(...))")
    from hybridcore.reshard import Resharder
    return TpRegrouping(Resharder(module, groups, rollout_tp or size))


class BackendCache:
    """The rollout backend's enter/exit; records the KV cache it held as "kv_cache"."""

    name = "rollout_backend"

    def __init__(self, backend):
        self.backend = backend

    def enter(self) -> dict[str, int]:
        self.backend.enter()
        return {}

    def exit(self) -> dict[str, int]:
        kv = self.backend.kv_cache_bytes
        self.backend.exit()
        return {"kv_cache": kv}
