"""Tensor parallelism: a loaded HF decoder's attention and MLP linears split over the tensor-parallel group.

Megatron's layout: q/k/v and gate/up are column-parallel (each rank owns whole heads, whole kv heads and a slice
of the MLP's width), o_proj and down_proj row-parallel (partial sums all-reduced), so a layer costs two
all-reduces forward and five backward (one per column-parallel input: q/k/v and gate/up are separate HF
modules; fusing them into one all-reduce each is future work). Embeddings, norms, lm_head and score heads stay
replicated: simplest, and about 13 % of Llama-3-8B (vocab-parallel embeddings and loss are future work).

Why our own few hundred lines and not torch DTensor (transformers' tp_plan) or DeepSpeed AutoTP:
- DeepSpeed ZeRO-1/2 over the dp group flattens each rank's parameters into flat buffers of plain tensors and
  re-points `param.data` into them, which DTensor parameters do not survive; tp_plan also wants a device mesh
  over the whole world.
  Here every shard is an ordinary Parameter marked `tensor_model_parallel`, the attribute DeepSpeed's ZeRO-1/2
  gradient-norm code reads (through the Megatron-style `Mpu` below) to count shards on every rank and
  replicated parameters once.
- DeepSpeed 0.19.8's AutoTP training shards inside `deepspeed.initialize`, in groups and a mesh it owns
  (deepspeed.utils.groups), and checks every forward's inputs across the tp group with a broadcast; tp would
  then need DeepSpeed, which the GPU machine lacks, even for the plain-torch engine. Our native rollout also
  needs the layout changed outside the engine (regrouped for rollout, reshard.py) and its static KV cache sized
  from the per-rank kv heads, which a module we own can state (`local_kv_heads`).
- Everything is torch.distributed all_reduce/all_gather, so it runs on gloo/CPU in the tests and NCCL on GPU,
  and needs no package beyond torch (the GPU machine has no DeepSpeed unless carried).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridcore.errors import SHARDING_ISSUE, InputError, NotYetSupported

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}


# ------------------------------------------------------------------------------------------- collectives
class _CopyToGroup(torch.autograd.Function):
    """Identity forward, all-reduce backward: the input of a column-parallel linear is replicated, and its
    gradient is the sum of every rank's partial gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce forward, identity backward: a row-parallel linear's output is the sum of partial products,
    and every rank's partial product gets the whole output gradient."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ------------------------------------------------------------------------------------------- the module
class ParallelLinear(nn.Module):
    """One shard of an nn.Linear. column: weight rows (output features) split, bias split; row: weight
    columns (input features) split, bias kept whole and added once after the all-reduce.

    `group`/`size`/`rank` are the group the forward reduces over; reshard.py repoints them for rollout."""

    def __init__(self, linear: nn.Linear, style: str, group, size: int, rank: int):
        super().__init__()
        self.style, self.group, self.size, self.rank = style, group, size, rank
        self.in_features, self.out_features = linear.in_features, linear.out_features  # the whole layer's
        dim = 0 if style == "column" else 1
        self.weight = nn.Parameter(linear.weight.detach().chunk(size, dim)[rank].clone(),
                                   requires_grad=linear.weight.requires_grad)
        _mark(self.weight, dim)
        self.bias = None
        if linear.bias is not None:
            b = linear.bias.detach()
            self.bias = nn.Parameter(b.chunk(size, 0)[rank].clone() if style == "column" else b.clone(),
                                     requires_grad=linear.bias.requires_grad)
            if style == "column":
                _mark(self.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "column":
            if self.size > 1 and torch.is_grad_enabled():
                x = _CopyToGroup.apply(x, self.group)
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight)
        if self.size > 1:
            y = _ReduceFromGroup.apply(y, self.group) if torch.is_grad_enabled() else _all_reduce(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.style}, in={self.in_features}, out={self.out_features}, shard {self.rank}/{self.size}"


def _all_reduce(x, group):
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _mark(p: nn.Parameter, dim: int) -> None:
    """DeepSpeed's is_model_parallel_parameter reads `tensor_model_parallel`; our own code reads tp_split_dim."""
    p.tensor_model_parallel = True
    p.partition_dim = dim
    p.tp_split_dim = dim


def is_split_param(p: torch.Tensor) -> bool:
    return getattr(p, "tp_split_dim", None) is not None


@dataclass
class TPState:
    """Which tensor-parallel size the model's linears are split over right now (training or rollout)."""
    size: int
    rank: int
    group: object


def tp_state(model) -> TPState:
    return getattr(model, "_hybrid_tp", None) or TPState(1, 0, None)


def head_shape(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a decoder's config (KV heads default to the query heads)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def local_kv_heads(model, config=None) -> int:
    """KV heads this rank's attention produces (a static cache is sized from this, not from the config)."""
    return head_shape(config if config is not None else model.config)[1] // tp_state(model).size


# ------------------------------------------------------------------------------------------- splitting
def check_divisible(config, tp: int, field: str = "engine.layout.tp") -> None:
    """One line naming the field and the model's sizes when tp does not divide heads, kv heads or the MLP."""
    heads, kv, _ = head_shape(config)
    inter = config.intermediate_size
    bad = [f"{name}={n}" for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv),
                                           ("intermediate_size", inter)) if n % tp]
    if bad:
        raise InputError(f"{field}={tp}: the model's {', '.join(bad)} not divisible by {tp}; expected a tp that "
                         f"divides num_attention_heads ({heads}), num_key_value_heads ({kv}) and "
                         f"intermediate_size ({inter})")


def _blocks(model):
    """(module, names) for every attention and MLP block: modules holding all four / all three linears."""
    for _, m in model.named_modules():
        for names in (ATTENTION, MLP):
            if all(hasattr(m, n) for n in names):
                yield m, names


def split_model(model: nn.Module, group, size: int, rank: int) -> nn.Module:
    """Replace every attention/MLP linear by this rank's ParallelLinear shard, in place; returns the model.

    Every rank must have loaded the same weights (from one folder, or one seed). Parameter names are kept
    (`...q_proj.weight`), so optimizer grouping and consolidated_state_dict see the HF names."""
    if size == 1:
        return model
    if tp_state(model).size != 1:
        raise RuntimeError("split_model: the model is already split")
    check_divisible(model.config, size)
    blocks = list(_blocks(model))
    if not blocks:
        raise NotYetSupported(f"tensor parallelism for {type(model).__name__} (no q/k/v/o_proj and "
                              f"gate/up/down_proj linears found)", SHARDING_ISSUE)
    for m, names in blocks:
        for n in names:
            lin = getattr(m, n)
            if type(lin) is not nn.Linear:
                raise NotYetSupported(f"tensor parallelism over a {type(lin).__name__} ({n}: LoRA or quantised "
                                      f"linears)", f"{SHARDING_ISSUE}: tp=1 for LoRA / 4-bit / 8-bit")
    for m, names in blocks:
        for n in names:
            setattr(m, n, ParallelLinear(getattr(m, n), "column" if n in COLUMN else "row", group, size, rank))
    model._hybrid_tp = TPState(size, rank, group)
    return model


def parallel_linears(model) -> list[ParallelLinear]:
    return [m for m in model.modules() if isinstance(m, ParallelLinear)]


def split_size(module) -> int:
    """The tp size `module`'s linears are split over (1 when none is): works on any wrapper around the model."""
    return max((m.size for m in parallel_linears(module)), default=1)


# ------------------------------------------------------------------------------------------- gathering
def consolidated_state_dict(model: nn.Module, groups) -> Optional[dict[str, torch.Tensor]]:
    """The whole HF state dict (CPU tensors) on global rank 0, None on other ranks: the one merged artifact
    whatever the layout. Only data-parallel replica 0's tensor-parallel group gathers (all its ranks must call)."""
    linears = parallel_linears(model)  # not tp_state(model): `model` may be a wrapper holding the split model
    size = split_size(model)
    if size == 1:
        if groups is None or groups.rank == 0:
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        return None
    if groups.dp_rank != 0:
        return None
    dst = 0  # tp rank 0 of data-parallel replica 0
    split = {id(p): p.tp_split_dim for p in model.parameters() if is_split_param(p)}
    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) not in split:
            if groups.rank == dst:
                out[k] = v.detach().cpu().clone()
            continue
        t = v.detach().contiguous()
        parts = [torch.empty_like(t) for _ in range(size)] if groups.rank == dst else None
        dist.gather(t, parts, dst=dst, group=linears[0].group)
        if groups.rank == dst:
            out[k] = torch.cat(parts, split[id(v)]).cpu()
    return out if groups.rank == 0 else None


# ------------------------------------------------------------------------------------------- norms, bytes
def grad_norm(params, group) -> torch.Tensor:
    """Global L2 norm of the gradients: split parameters' squares summed over the tp group, replicated ones
    counted once (their gradients are equal on every tp rank)."""
    params = [p for p in params if p.grad is not None]
    dev = params[0].grad.device if params else torch.device("cpu")
    split = torch.zeros((), dtype=torch.float64, device=dev)
    repl = torch.zeros((), dtype=torch.float64, device=dev)
    for p in params:
        sq = p.grad.detach().double().pow(2).sum()
        if is_split_param(p):
            split += sq
        else:
            repl += sq
    if group is not None:
        dist.all_reduce(split, group=group)
    return (split + repl).sqrt()


def clip_grad_norm_(params, max_norm: float, group) -> float:
    """torch.nn.utils.clip_grad_norm_ for a tp-split model: the same coefficient on every tp rank."""
    params = list(params)
    norm = grad_norm(params, group)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
    return float(norm)


def param_numel(model) -> dict[str, int]:
    """Elements this rank holds: split (its shards) and replicated (whole on every tp rank)."""
    out = {"split": 0, "replicated": 0}
    for p in model.parameters():
        out["split" if is_split_param(p) else "replicated"] += p.numel()
    return out


def param_bytes(model) -> dict[str, int]:
    """Bytes of the distinct storages behind this rank's parameters, split vs replicated (a shared storage,
    e.g. DeepSpeed's flat buffer, counts once, under the first kind that holds it)."""
    seen: set = set()
    out = {"split": 0, "replicated": 0}
    for p in model.parameters():
        s = p.data.untyped_storage()
        key = (p.device.type, p.device.index, s.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        out["split" if is_split_param(p) else "replicated"] += s.nbytes()
    return out


# ------------------------------------------------------------------------------------------- DeepSpeed
class Mpu:
    """The Megatron-style object DeepSpeed's `mpu=` argument takes: tensor-parallel group as its model-parallel
    group, our dp group as its data-parallel group. Groups that are None (a dimension of 1) are created here,
    collectively, so every rank must construct it at the same point."""

    def __init__(self, groups):
        dp, tp = groups.layout.dp, groups.layout.tp
        from hybridcore.parallel import rank_grid
        dp_groups, tp_groups = rank_grid(dp, tp)
        self._dp_ranks = next(r for r in dp_groups if groups.rank in r)
        self._tp_ranks = next(r for r in tp_groups if groups.rank in r)
        self.dp_group, self.tp_group = groups.dp_group, groups.tp_group
        if self.dp_group is None:
            for ranks in dp_groups:
                g = dist.new_group(ranks)
                if groups.rank in ranks:
                    self.dp_group = g
        if self.tp_group is None:
            for ranks in tp_groups:
                g = dist.new_group(ranks)
                if groups.rank in ranks:
                    self.tp_group = g
        self.dp, self.tp, self.dp_rank, self.tp_rank = dp, tp, groups.dp_rank, groups.tp_rank

    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_model_parallel_group(self):
        return self.tp_group

    def get_model_parallel_world_size(self):
        return self.tp

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self):
        return self._tp_ranks[0]

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_group_ranks(self):
        return list(self._dp_ranks)

    def get_pipeline_model_parallel_world_size(self):
        return 1
