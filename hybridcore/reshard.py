"""Regrouping a tensor-parallel actor from its training tp into a smaller rollout tp, and back (verl's
3D-HybridEngine idea, on our ParallelLinear shards).

With training tp T and rollout tp R (R divides T, k = T / R), training tp ranks j*k .. j*k+k-1 form a *gather
group*: their k contiguous shards concatenated are exactly shard j of an R-way split, so each of them
all-gathers only those k shards -- 1/R of the split weights, never a full copy when R > 1. Ranks i, i+k,
i+2k, ... (one from each gather group) then form a *rollout group* of size R that runs the model R-way; the k
rollout groups of a training tp group each generate their share of the prompts, and the gather group (one
member of every rollout group) all-gathers the responses. On exit every parameter points at its training
tensor again (the very storage DeepSpeed's flat buffers own; nothing was copied out of it) and the regrouped
tensors are freed.

Peak per rank of the transition (`peak_bytes`, counted from the storages alive at each point of enter(), since
the CPU has no allocator statistics; asserted against this formula in tests/hybridcore/test_tensor_parallel.py):
replicated weights + the training shards (1/T of the split weights, kept: they are ZeRO's flat buffer) + the
rollout shards (1/R) + the k gathered parts of one row-parallel weight (split along its columns, so gathered
into parts and concatenated). Measured on the tests' fp32 models: tp 4 -> rollout tp 2, 1,182,208 bytes a rank
(the model whole: 1,444,352); tp 2 -> rollout tp 1, 2,034,176 (whole: 1,313,280; rollout tp 1 is a whole copy by
definition). verl also makes the training shard a view into the rollout shard, saving the 1/T: future work.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hybridcore.errors import InputError
from hybridcore.tensor_parallel import TPState, param_bytes, parallel_linears, tp_state


class Resharder:
    """Build once per actor (every rank, collectively: it creates process groups), then enter()/exit() per
    rollout."""

    def __init__(self, model, groups, rollout_tp: int, field: str = "engine.rollout.tp"):
        T = tp_state(model).size
        if isinstance(rollout_tp, bool) or not isinstance(rollout_tp, int) or rollout_tp < 1 or T % rollout_tp:
            raise InputError(f"{field}: found {rollout_tp!r}, expected a whole number >= 1 that divides "
                             f"engine.layout.tp={T}")
        self.model, self.groups, self.R, self.T = model, groups, rollout_tp, T
        self.k = k = T // rollout_tp
        t = groups.tp_rank
        self.gather_rank, self.rollout_rank = t % k, t // k  # place in the gather group / in the rollout group
        self.replica = t % k  # which rollout group of this tp group: its share of the prompts
        self.gather_group = self.rollout_group = None
        base = groups.dp_rank * T
        for d in range(groups.layout.dp):  # every rank creates every group, in the same order
            b = d * T
            for j in range(rollout_tp):
                ranks = [b + j * k + i for i in range(k)]
                g = dist.new_group(ranks) if k > 1 else None
                if b == base and j == self.rollout_rank:
                    self.gather_group = g
            for i in range(k):
                ranks = [b + i + j * k for j in range(rollout_tp)]
                g = dist.new_group(ranks) if rollout_tp > 1 else None
                if b == base and i == self.replica:
                    self.rollout_group = g
                    self.rollout_ranks = ranks
        self._saved: list = []
        self._train_state: TPState | None = None
        self.peak_bytes = 0

    @property
    def active(self) -> bool:
        return self._train_state is not None

    def enter(self) -> None:
        """Regroup every ParallelLinear's shards into the rollout layout (no-op regrouping when R == T)."""
        self._train_state = tp_state(self.model)
        held = param_bytes(self.model)
        base = held["split"] + held["replicated"]
        extra = peak_extra = 0
        for m in parallel_linears(self.model):
            self._saved.append((m, m.weight.data, None if m.bias is None else m.bias.data))
            for p in (m.weight, m.bias):
                if p is None or getattr(p, "tp_split_dim", None) is None:
                    continue
                merged, temp = self._gather(p.data, p.tp_split_dim)
                new = merged.nbytes if self.k > 1 else 0
                peak_extra = max(peak_extra, extra + new + temp)
                extra += new
                p.data = merged
            m.group, m.size, m.rank = self.rollout_group, self.R, self.rollout_rank
        self.model._hybrid_tp = TPState(self.R, self.rollout_rank, self.rollout_group)
        self.peak_bytes = base + max(peak_extra, extra)

    def _gather(self, shard: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
        """(this rank's rollout shard, bytes of a temporary gather buffer)."""
        if self.k == 1:
            return shard, 0
        if dim == 0:  # chunks along dim 0 of a contiguous tensor are contiguous: gather straight into place
            merged = torch.empty((shard.shape[0] * self.k, *shard.shape[1:]), dtype=shard.dtype,
                                 device=shard.device)
            dist.all_gather(list(merged.chunk(self.k, 0)), shard.contiguous(), group=self.gather_group)
            return merged, 0
        parts = [torch.empty_like(shard) for _ in range(self.k)]
        dist.all_gather(parts, shard.contiguous(), group=self.gather_group)
        merged = torch.cat(parts, dim)
        return merged, sum(p.nbytes for p in parts)

    def exit(self) -> None:
        """Point every parameter back at its training tensor and drop the rollout shards."""
        if self._train_state is None:
            return
        state = self._train_state
        for m, w, b in self._saved:
            m.weight.data = w
            if b is not None:
                m.bias.data = b
            m.group, m.size, m.rank = state.group, state.size, state.rank
        self._saved = []
        self.model._hybrid_tp = state
        self._train_state = None

    # ---------------------------------------------------------------------------------- the prompts
    def share(self, items: list) -> list:
        """This rollout group's contiguous share of `items` (the same on every rank of the group)."""
        n, k = len(items), self.k
        lo, hi = self.replica * n // k, (self.replica + 1) * n // k
        return items[lo:hi]

    def gather(self, mine: list) -> list:
        """Every rollout group's results, in prompt order (all-gathered over the gather group)."""
        if self.k == 1:
            return mine
        parts: list = [None] * self.k
        dist.all_gather_object(parts, mine, group=self.gather_group)
        return [x for part in parts for x in part]

    def same_seed(self) -> int | None:
        """A seed every rank of the rollout group shares (sampling must pick the same tokens on all of them)."""
        if self.R == 1:
            return None
        device = next(self.model.parameters()).device
        seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.long).to(device)
        dist.broadcast(seed, src=self.rollout_ranks[0], group=self.rollout_group)
        return int(seed)
