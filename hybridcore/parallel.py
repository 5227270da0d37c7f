"""The process layout: which rank this process is, and its data- and tensor-parallel groups.

A stage started by torchrun reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from the environment;
world = dp x tp with tp varying fastest (ranks 0,1 share a tensor-parallel group when tp=2), the Megatron order
that keeps a tensor-parallel group inside one node. Without those variables a stage is one process and nothing
is initialised.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from hybridcore.errors import InputError

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Layout:
    """engine.layout of the params, as plain data (hybridcore does not import the pydantic schema)."""
    dp: int = 1
    tp: int = 1
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False

    @classmethod
    def of(cls, obj) -> "Layout":
        """From the params' `engine.layout` (or anything with these attributes, or a dict)."""
        if isinstance(obj, Layout):
            return obj
        get = obj.get if isinstance(obj, dict) else (lambda k, d: getattr(obj, k, d))
        return cls(**{k: get(k, getattr(cls, k)) for k in cls.__dataclass_fields__})

    @property
    def world(self) -> int:
        return self.dp * self.tp


def validate(layout: Layout, field: str = "engine.layout") -> None:
    """Refuse combinations that cannot work, in one line naming the field, what was found and what would work."""
    for k in ("dp", "tp"):
        v = getattr(layout, k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{field}.{k}: found {v!r}, expected a whole number >= 1")
    if layout.zero_stage not in (0, 1, 2, 3) or isinstance(layout.zero_stage, bool):
        raise InputError(f"{field}.zero_stage: found {layout.zero_stage!r}, expected 0, 1, 2 or 3")
    if layout.offload_params and layout.zero_stage != 3:
        raise InputError(f"{field}.offload_params: true needs zero_stage=3 (only ZeRO-3 partitions parameters), "
                         f"found zero_stage={layout.zero_stage}")
    if layout.offload_optimizer and layout.zero_stage == 0:
        raise InputError(f"{field}.offload_optimizer: true needs zero_stage 1, 2 or 3 (DeepSpeed offloads the "
                         f"optimizer of a ZeRO partition), found zero_stage=0")
    if layout.zero_stage == 3 and layout.tp > 1:
        raise InputError(f"{field}: zero_stage=3 with tp={layout.tp} is not a supported combination; use ZeRO-3 "
                         f"with tp=1, or zero_stage 0-2 with tensor parallelism")


def rank_grid(dp: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(dp groups, tp groups) as rank lists for world = dp x tp, tp fastest-varying: rank = dp_rank * tp + tp_rank."""
    tp_groups = [[d * tp + t for t in range(tp)] for d in range(dp)]
    dp_groups = [[d * tp + t for d in range(dp)] for t in range(tp)]
    return dp_groups, tp_groups


def _env_int(name: str) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise InputError(f"environment variable {name}: found {raw!r}, expected a whole number "
                         f"(set by torchrun)") from None
    if value < 0:
        raise InputError(f"environment variable {name}: found {value}, expected >= 0")
    return value


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) when it is absent."""
    world, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    if world is None and rank is None:
        return 0, 1, 0
    if world is None or rank is None:
        missing = "WORLD_SIZE" if world is None else "RANK"
        raise InputError(f"environment variable {missing} is not set but "
                         f"{'RANK' if world is None else 'WORLD_SIZE'} is; expected both (torchrun sets them)")
    if world < 1 or rank >= world:
        raise InputError(f"environment: RANK={rank} with WORLD_SIZE={world}, expected 0 <= RANK < WORLD_SIZE")
    local = _env_int("LOCAL_RANK")
    return rank, world, rank if local is None else local


@dataclass
class Groups:
    """This process's place in the layout. dp_group/tp_group are None when that dimension is 1 or the run
    is one process (torch.distributed collectives then take the default group)."""
    layout: Layout
    rank: int
    world: int
    local_rank: int
    backend: Optional[str]
    device: torch.device
    dp_group: Optional[object] = None
    tp_group: Optional[object] = None

    @property
    def dp_rank(self) -> int:
        return self.rank // self.layout.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.layout.tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init(layout, timeout_s: float = 600.0) -> Groups:
    """Initialise torch.distributed for `layout` (from torchrun's env), or return the one-process layout.

    A world size that does not equal dp x tp is a user's error naming both."""
    layout = Layout.of(layout)
    validate(layout)
    rank, world, local = env_world()
    if world != layout.world:
        raise InputError(f"engine.layout: dp={layout.dp} x tp={layout.tp} = {layout.world} processes, but this run "
                         f"has WORLD_SIZE={world}; start it with torchrun --nproc-per-node {layout.world}")
    backend = default_backend()
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if world == 1:
        return Groups(layout, 0, 1, 0, None, device)
    if backend == "nccl":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise InputError(f"environment variable {name} is not set (WORLD_SIZE={world}); expected torchrun "
                                 f"to set it")
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    dp_groups, tp_groups = rank_grid(layout.dp, layout.tp)
    groups = Groups(layout, rank, world, local, backend, device)
    for ranks in dp_groups:  # every rank creates every group, in the same order, as new_group requires
        g = dist.new_group(ranks) if layout.dp > 1 else None
        if rank in ranks:
            groups.dp_group = g
    for ranks in tp_groups:
        g = dist.new_group(ranks) if layout.tp > 1 else None
        if rank in ranks:
            groups.tp_group = g
    global _current
    _current = groups
    return groups


# The layout this process runs in, set by init() for world > 1; stages read it through current().
_current: Optional[Groups] = None


def current() -> Groups:
    """This process's Groups (one process, rank 0, when init() never ran for a world above 1)."""
    return _current or Groups(Layout(), 0, 1, 0, None, torch.device("cpu"))


def is_main() -> bool:
    return current().is_main


def dp_share(items, groups: Optional[Groups] = None):
    """This dp rank's contiguous share of a global batch (`items` sliceable, its length a multiple of dp), so
    that the ranks' shares, concatenated, are the dp=1 batch in its order."""
    g = groups or current()
    n = len(items)
    if n % g.layout.dp:
        raise ValueError(f"a batch of {n} rows does not split over dp={g.layout.dp} ranks")
    k = n // g.layout.dp
    return items[g.dp_rank * k:(g.dp_rank + 1) * k]


def dp_sum(values):
    """Sum over the dp ranks of a float, a tensor, or a dict/list of floats (one all-reduce); as given at dp=1."""
    g = current()
    if g.layout.dp == 1:
        return values
    if isinstance(values, torch.Tensor):  # on the group's device: NCCL reduces GPU tensors only
        out = values.detach().to(g.device, torch.float64, copy=True)
        dist.all_reduce(out, group=g.dp_group)
        return out.to(values.device, values.dtype)
    keys = list(values) if isinstance(values, dict) else None
    flat = [values[k] for k in keys] if keys is not None else ([values] if isinstance(values, (int, float))
                                                              else list(values))
    t = torch.tensor([float(v) for v in flat], dtype=torch.float64, device=g.device)
    dist.all_reduce(t, group=g.dp_group)
    out = t.tolist()
    if keys is not None:
        return dict(zip(keys, out))
    return out[0] if isinstance(values, (int, float)) else out


def dp_mean(values):
    """Mean over the dp ranks (equal shares: the global mean of per-row figures); as given at dp=1."""
    dp = current().layout.dp
    if dp == 1:
        return values
    total = dp_sum(values)
    if isinstance(total, dict):
        return {k: v / dp for k, v in total.items()}
    return total / dp if not isinstance(total, list) else [v / dp for v in total]


def any_rank(flag: bool) -> bool:
    """True on every rank of the job if it is true on any: over the whole world, not only the dp group, since a
    rank's tp peers must stop (and checkpoint, collectively) after the same step too."""
    g = current()
    if g.world == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=g.device)
    dist.all_reduce(t)
    return bool(t.item() > 0)


def barrier() -> None:
    if current().world > 1:
        dist.barrier()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group() -> None:
    """DeepSpeed needs torch.distributed even for one process: a world-1 group on a free loopback port."""
    if dist.is_initialized():
        return
    rank, world, _ = env_world()
    if world != 1:
        raise RuntimeError(f"WORLD_SIZE={world} but torch.distributed is not initialised; call parallel.init first")
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)  # DeepSpeed reads LOCAL_RANK from the environment
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group(default_backend(), store=store, rank=0, world_size=1)


def shutdown() -> None:
    """Destroy the process group (if any), so a test or a second stage in the same process starts clean."""
    global _current
    _current = None
    if dist.is_initialized():
        dist.destroy_process_group()
