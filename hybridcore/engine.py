"""Training engines: one object per training layout, chosen once by `make_engine` from the layout.

`TorchEngine` steps plain torch AdamW in one process (tensor parallelism is an attribute: the model's ParallelLinear
layers hold the collectives, the engine clips over the tp group and checkpoints per tp rank); `DeepSpeedEngine`
(hybridcore/zero.py) runs ZeRO-1/2/3, data parallelism and CPU offload. Stages see only the protocol of `Engine`:
a training forward, backward per micro-batch, step at the boundary, zero_grad for a redone step, checkpoint parts,
`whole_state_dict()` (the one gather the export calls), `rollout_weights()` (what the hybrid actor enters so that
rollout reads whole weights) and the memory this rank holds. Both share optim.py's semantics: betas (0.9, 0.95),
decay only on >= 2-D parameters, clipping at max_grad_norm, a LambdaLR warm-up + cosine.

`limits(layout)` is the one table of what a layout cannot do yet; the pre-flight checks (stages/params.py), the
engines and the hybrid actor all read it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridcore import optim
from hybridcore.errors import SHARDING_ISSUE, NotYetSupported
from hybridcore.parallel import Groups, Layout, validate

# feature -> how a refusal names it; "{}" takes the value asked for
FEATURES = {"adapters": "LoRA, quantised roles or share_base", "rollout_backend": "engine.rollout.backend={}",
            "rollout_offload": "engine.rollout.offload_optimizer=true", "planner": "engine.memory_budget_gib"}
_ACROSS_RANKS = {"adapters": "", "rollout_backend": "", "rollout_offload": "", "planner": "the planner across ranks"}
_ZERO3 = {"adapters": "ZeRO-3 would partition the frozen base the adapters' forwards read whole",
          "rollout_backend": "only the native backend reads parameters gathered in place",
          "planner": "the planner's probe runs on whole parameters"}


def limits(layout) -> dict[str, tuple[str, str]]:
    """What `layout` cannot do yet: feature -> (the layout field that refuses it, why). Empty for one process
    without ZeRO-3. `layout` is anything with dp, tp and zero_stage (the params' section or parallel.Layout)."""
    out: dict[str, tuple[str, str]] = {}
    for name, on, table in ((f"engine.layout.tp={layout.tp}", layout.tp > 1, _ACROSS_RANKS),
                            (f"engine.layout.dp={layout.dp}", layout.dp > 1, _ACROSS_RANKS),
                            ("engine.layout.zero_stage=3", layout.zero_stage == 3, _ZERO3)):
        for feature, why in table.items() if on else ():
            out.setdefault(feature, (name, why))
    return out


def refuse_unsupported(layout, asked: dict[str, object]) -> None:
    """NotYetSupported, one line, for the first feature `asked` for (feature -> the value asked, or None/False when
    not asked) that `layout` cannot do."""
    table = limits(layout)
    for feature, value in asked.items():
        if value is None or value is False or feature not in table:
            continue
        name, why = table[feature]
        label = FEATURES[feature].format(value)
        raise NotYetSupported(f"{name} with {label}" + (f" ({why})" if why else ""), SHARDING_ISSUE)


def backend_for(layout: Layout) -> str:
    """Plain torch when nothing is ZeRO-sharded, offloaded or data-parallel (tensor parallelism alone runs on
    torch: its collectives live in the model's ParallelLinear layers); DeepSpeed otherwise."""
    plain = (layout.zero_stage == 0 and layout.dp == 1
             and not layout.offload_optimizer and not layout.offload_params)
    return "torch" if plain else "deepspeed"


def make_engine(model: torch.nn.Module, *, lr: float, total_steps: int, warmup_ratio: float, max_grad_norm: float,
                weight_decay: float = 0.0, min_lr_ratio: float = 0.1, layout: Layout | None = None,
                groups: Groups | None = None, micro_batch: int = 1, cpu_adam: bool = True,
                host_states: bool = False) -> "Engine":
    """The engine `layout` asks for (default: one process, plain torch). cpu_adam: with offload_optimizer, step
    with DeepSpeedCPUAdam (the fast, JIT-built op; what a GPU run wants) rather than torch's AdamW on the CPU
    partition (same maths, no build). host_states: the torch engine keeps AdamW's moments in host memory between
    steps (DeepSpeed's layouts offload with layout.offload_optimizer instead)."""
    layout = Layout.of(layout or Layout())
    validate(layout)
    if layout.tp > 1:
        from hybridcore.tensor_parallel import split_size
        if groups is None or groups.tp_group is None or split_size(model) != layout.tp:
            raise ValueError(f"engine.layout.tp={layout.tp}: split the model with tensor_parallel.split_model over "
                             f"groups.tp_group and pass groups= first")
    schedule = dict(lr=lr, total_steps=total_steps, warmup_ratio=warmup_ratio, min_lr_ratio=min_lr_ratio,
                    weight_decay=weight_decay)
    if backend_for(layout) == "torch":
        return TorchEngine(model, layout, groups, max_grad_norm, host_states=host_states, **schedule)
    if host_states:
        raise ValueError("host_states is the torch engine's; under DeepSpeed use layout.offload_optimizer")
    from hybridcore.zero import DeepSpeedEngine  # only when asked for: the GPU machine may not have deepspeed
    return DeepSpeedEngine(model, layout, groups, max_grad_norm, micro_batch=micro_batch, cpu_adam=cpu_adam,
                           **schedule)


class Engine:
    """The protocol every training backend keeps. `engine.model(...)` is what training forwards call (DeepSpeed's
    engine, or the module itself); `engine.module` the plain nn.Module (evaluation, export); `trained` the
    parameters the optimizer updates; `optimizer` what steps them (DeepSpeed's ZeRO optimizer under DeepSpeed;
    the hybrid actor offloads a plain one's states), `_client_optimizer` the torch optimizer holding the moments."""

    backend = "?"

    def __init__(self, model, layout: Layout, groups: Groups | None, max_grad_norm: float):
        self.layout, self.groups, self.max_grad_norm = layout, groups, max_grad_norm
        self.module = self.model = model

    # ------------------------------------------------------------------------------------------ training
    def forward(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) as a training forward (ZeRO-3 needs it run as DeepSpeed's own forward)."""
        return fn(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss` (the caller divides by the step's token or row count over all ranks)."""
        raise NotImplementedError

    def step(self) -> float:
        """Clip, update, advance the schedule, clear grads; returns the pre-clip global gradient norm."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Drop the gradients accumulated so far in this step (a skipped or redone step)."""
        raise NotImplementedError

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    # ------------------------------------------------------------------------------------------ state
    def optimizer_parts(self, prefix: str) -> dict:
        """Name -> stateful object for a Checkpointer when the models' weights are checkpointed beside it (an
        engine that `owns_weights` writes its own files per rank instead, weights included)."""
        return {f"{prefix}optimizer": self.optimizer, f"{prefix}schedule": self.scheduler}

    owns_weights = True  # save()/load() write this rank's files, weights included

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._save(folder)
        (folder / "engine.json").write_text(json.dumps({"backend": self.backend, "layout": vars(self.layout)}))

    def load(self, folder: Path) -> None:
        """Restore what save() wrote; the layout must be the one it was saved with."""
        folder = Path(folder)
        saved = json.loads((folder / "engine.json").read_text())
        if saved["layout"] != vars(self.layout):
            raise NotYetSupported(f"resuming a checkpoint saved with layout {saved['layout']} under layout "
                                  f"{vars(self.layout)} (resharding)", SHARDING_ISSUE)
        self._load(folder)

    def whole_state_dict(self, copy: bool = True) -> dict[str, torch.Tensor] | None:
        """Every weight whole, for export: CPU copies (copy=False: the model's own tensors where they already are
        whole, as export wants for a big model). A collective where the layout shards (all ranks call it); with
        tp > 1 the shards are gathered to global rank 0 and the other ranks get None."""
        if self.layout.tp > 1:
            from hybridcore.tensor_parallel import consolidated_state_dict
            return consolidated_state_dict(self.module, self.groups)
        state = self.module.state_dict()
        return {k: v.detach().cpu().clone() for k, v in state.items()} if copy else state

    def rollout_weights(self, rollout_tp: int | None = None):
        """The transition the hybrid actor enters so that rollout reads whole weights in place (hybridcore/
        transitions.py), or None when the training weights already are: here the tp regrouping."""
        from hybridcore.transitions import tp_regrouping
        return tp_regrouping(self.module, self.groups, rollout_tp)

    # ------------------------------------------------------------------------------------------ memory
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by kind: params, grads, optimizer (moments and any fp32 master partition),
        buffers (DeepSpeed's communication and offload staging buffers)."""
        params = list(self.module.parameters())
        return {"params": [p.data for p in params] + [getattr(p, "ds_tensor", None) for p in params],
                "grads": [p.grad for p in params], "buffers": [],
                "optimizer": list(flatten([dict(s) for s in self._client_optimizer.state.values()]))}

    def held_bytes(self) -> dict[str, int]:
        """Bytes of distinct storages this rank holds, by kind (a storage counts once, under its first kind)."""
        counted: set = set()
        result = {}
        for kind, tensors in self.held_tensors().items():
            stor = {k: v for k, v in storages(tensors).items() if k not in counted}
            counted |= stor.keys()
            result[kind] = sum(b for b, _ in stor.values())
        return result

    def optimizer_bytes(self) -> dict[str, int]:
        """Optimizer-state bytes (moments + any fp32 master partition) on the accelerator vs on the CPU."""
        stor = storages(self.held_tensors()["optimizer"])
        device = sum(b for b, kind in stor.values() if kind != "cpu")
        return {"device": device, "cpu": sum(b for b, kind in stor.values() if kind == "cpu")}


class TorchEngine(Engine):
    """Plain torch AdamW on this process's model (or its tensor-parallel shard: clipped over the tp group, one
    checkpoint file per tp rank)."""

    backend = "torch"

    def __init__(self, model, layout: Layout, groups: Groups | None, max_grad_norm: float, *, lr: float,
                 total_steps: int, warmup_ratio: float, min_lr_ratio: float, weight_decay: float,
                 host_states: bool = False):
        """host_states: AdamW's moments wait in host memory between optimizer steps (optim.HostStates)."""
        super().__init__(model, layout, groups, max_grad_norm)
        self.optimizer = self._client_optimizer = optim.adamw(model, lr, weight_decay)
        self.host_states = optim.HostStates(self.optimizer) if host_states else None
        self.scheduler = optim.warmup_cosine(self.optimizer, total_steps, warmup_ratio, min_lr_ratio)
        self.trained = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.owns_weights = layout.tp > 1  # each tp rank holds other shards: it writes its own file

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        if self.host_states is not None:
            self.host_states.to_device()
        try:
            return self._step()
        finally:
            if self.host_states is not None:
                self.host_states.to_host()

    def _step(self) -> float:
        if self.layout.tp == 1:
            return optim.step(self.module, self.optimizer, self.scheduler, self.max_grad_norm)
        from hybridcore.tensor_parallel import clip_grad_norm_
        norm = clip_grad_norm_(self.trained, self.max_grad_norm, self.groups.tp_group)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        """Optimizer and schedule state."""
        return {"optimizer": self.optimizer.state_dict(), "schedule": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["schedule"])

    def _file(self) -> str:
        """One weights_only torch file per tensor-parallel rank (each holds different shards); engine.pt without."""
        return "engine.pt" if self.layout.tp == 1 else f"engine-tp{self.groups.tp_rank}.pt"

    def _save(self, folder: Path) -> None:
        torch.save({"model": self.module.state_dict(), **self.state_dict()}, folder / self._file())

    def _load(self, folder: Path) -> None:
        blob = torch.load(folder / self._file(), weights_only=True)
        self.module.load_state_dict(blob.pop("model"))
        self.load_state_dict(blob)


def checkpoint_parts(engines: dict[str, Engine], models: dict) -> tuple[dict, dict, dict]:
    """(models, stateful, engines) for a Checkpointer from engines keyed by a name prefix: the models' weights and
    each optimizer and schedule; or, when the engines write their own files per rank (DeepSpeed, tp shards), the
    engines alone, weights included."""
    if not any(e.owns_weights for e in engines.values()):
        stateful: dict = {}
        for prefix, e in engines.items():
            stateful.update(e.optimizer_parts(prefix))
        return models, stateful, {}
    return {}, {}, {f"{prefix}engine": e for prefix, e in engines.items()}


def storages(tensors) -> dict[tuple, tuple[int, str]]:
    """Distinct storages among `tensors` (views of one buffer count once): key -> (bytes, device type)."""
    seen: dict[tuple, tuple[int, str]] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        if s.nbytes() == 0:
            continue
        seen[(t.device.type, t.device.index, s.data_ptr())] = (s.nbytes(), t.device.type)
    return seen


def flatten(obj):
    """Tensors inside nested lists/tuples/dicts (DeepSpeed keeps its buffers in all three)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from flatten(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from flatten(v)

