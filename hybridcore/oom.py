"""Out-of-memory back-off: a step whose micro-batch does not fit is redone at half the micro-batch.

Halving the micro-batch doubles the accumulation, so the step still covers the same rows and, since the
caller divides each micro-batch's loss by the whole step's token count, computes the same update. The new
size sticks for the rest of the stage: the step that ran out will run out again.
"""
from __future__ import annotations

import gc
from typing import Callable

import torch
import torch.distributed as dist

from hybridcore.batch import micro_batches
from hybridcore.errors import SHARDING_ISSUE, TrainingFault
from hybridcore.interrupts import oom_point


class OomBackoff:
    """Runs one step's micro-batches: `micro_step(rows)` per slice, `zero_grad()` before a redo."""

    def __init__(self, stage: str, micro_batch: int, say: Callable[[str], None] | None = None,
                 fault: str | None = None):
        """fault: the name in the `<fault>:oom:<step>` test hook (default: stage); it fires once per step, however
        many times run() is called in that step (PPO runs one per minibatch and pass)."""
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        self.stage, self.micro_batch = stage, micro_batch
        self.say = say or (lambda line: print(line, flush=True))
        self.fault = fault or stage
        self.backoffs = 0
        self._fired: set[int] = set()

    def accumulation(self, rows: int) -> int:
        """Micro-batches per step of `rows` rows at the current micro-batch size."""
        return -(-rows // self.micro_batch)

    def run(self, step: int, rows: int, micro_step: Callable[[slice], float], zero_grad: Callable[[], None]) -> float:
        """Forward+backward over `rows` rows; returns the sum of what micro_step returned (the step's loss)."""
        while True:
            try:
                total = 0.0
                for k, rows_slice in enumerate(micro_batches(rows, self.micro_batch)):
                    # after one micro-batch when there are several, so partial gradients exist to be dropped;
                    # an injected fault fires once per step, on the first attempt
                    if step not in self._fired and k == min(1, self.accumulation(rows) - 1):
                        self._fired.add(step)
                        oom_point(self.fault, step)
                    total += micro_step(rows_slice)
                return total
            except torch.OutOfMemoryError as e:
                zero_grad()
                self._free()
                self._back_off(step, rows, e)

    def _back_off(self, step: int, rows: int, error: Exception) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise TrainingFault(f"{self.stage}: out of memory at step {step} with micro-batch {self.micro_batch} "
                                f"on rank {dist.get_rank()} of {dist.get_world_size()}; backing off across ranks is "
                                f"not supported yet ({SHARDING_ISSUE}): lower the micro-batch size") from error
        if self.micro_batch == 1:
            raise TrainingFault(f"{self.stage}: out of memory at step {step} even with micro-batch 1; lower "
                                f"max_seq_len, or turn on activation checkpointing, ZeRO or offload") from error
        old, old_acc = self.micro_batch, self.accumulation(rows)
        self.micro_batch = max(1, old // 2)
        self.backoffs += 1
        line = (f"{self.stage}: out of memory at step {step} with micro-batch {old} x {old_acc}; redoing it with "
                f"micro-batch {self.micro_batch} x {self.accumulation(rows)} (same {rows} rows per step)")
        self.say(line)

    @staticmethod
    def _free() -> None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
