"""TrainEngine: one model + AdamW + warm-up/cosine schedule, stepped either by plain torch or by DeepSpeed ZeRO.

Stages keep their own micro-batch loop (the loss already divided by the step's token count) and call
backward() per micro-batch and step() at the boundary; DeepSpeed runs with managed_gradient_accumulation off
so that it never rescales the loss or decides the boundary itself. Both backends share optim.py's semantics:
betas (0.9, 0.95), decay only on >= 2-D parameters, clipping at max_grad_norm, a LambdaLR warm-up + cosine.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from hybridcore import optim
from hybridcore.errors import InputError, NotYetSupported
from hybridcore.parallel import Groups, Layout, ensure_process_group, validate

# A persistent folder for DeepSpeed's JIT-built ops (CPUAdam takes ~1-2 min to build once); .gitignore has it.
DEFAULT_EXTENSIONS_DIR = Path(__file__).resolve().parent.parent / ".torch_extensions"
TAG = "engine"


def backend_for(layout: Layout) -> str:
    """Plain torch when nothing is ZeRO-sharded, offloaded or data-parallel (tensor parallelism alone runs on
    torch: its collectives live in the model's ParallelLinear layers); DeepSpeed otherwise."""
    plain = (layout.zero_stage == 0 and layout.dp == 1
             and not layout.offload_optimizer and not layout.offload_params)
    return "torch" if plain else "deepspeed"


def ds_config(layout: Layout, bf16: bool, max_grad_norm: float, micro_batch: int, cpu_adam: bool,
              bucket_elements: int) -> dict:
    """The DeepSpeed config for `layout`. Accumulation stays with the caller (one DeepSpeed step per our step)."""
    zero: dict = {"stage": layout.zero_stage}
    if layout.zero_stage in (1, 2):
        # buckets sized to the model (DeepSpeed's 5e8-element default would allocate GiBs for a tiny model)
        zero.update(reduce_bucket_size=bucket_elements, allgather_bucket_size=bucket_elements)
    if layout.zero_stage == 3:
        zero.update(reduce_bucket_size=bucket_elements, stage3_prefetch_bucket_size=bucket_elements,
                    stage3_param_persistence_threshold=0)  # every parameter partitioned, none kept whole
    pin = torch.cuda.is_available()
    if layout.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if layout.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": cpu_adam,
        "steps_per_print": 2 ** 62,
        "wall_clock_breakdown": False,
    }


def _storages(tensors) -> dict[tuple, tuple[int, str]]:
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


def _flatten(obj):
    """Tensors inside nested lists/tuples/dicts (DeepSpeed keeps its buffers in all three)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _flatten(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flatten(v)


class TrainedOnly(torch.nn.Module):
    """The trained parameters of a model (or of a TrainableState), registered on a module of their own, so that
    DeepSpeed sees, flattens, shards and checkpoints only them and never touches the frozen base: its casts and
    flat buffers would not survive a 4-bit/8-bit base, and its checkpoints would hold the whole base. The
    parameters are the model's own objects, so the stage's forwards through the model train them."""

    def __init__(self, source):
        super().__init__()
        named = [(n, p) for n, p in source.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("TrainedOnly: nothing to train (no parameter requires grad)")
        for name, param in named:
            self.register_parameter(name.replace(".", "__"), param)

    def forward(self, *args, **kwargs):
        raise RuntimeError("TrainedOnly holds parameters only: run forwards through the model itself")


class TrainEngine:
    """model + optimizer + schedule; `backward(loss)` per micro-batch, `step()` at the boundary.

    Call `engine.model(...)` for training forwards (the DeepSpeed engine, or the module itself); `engine.module`
    is the plain nn.Module (its attributes, evaluation, export through full_state_dict()); under DeepSpeed with
    frozen parameters (LoRA over a frozen or quantised base) it is the TrainedOnly holder of the trained ones."""

    def __init__(self, model: torch.nn.Module, *, lr: float, total_steps: int, warmup_ratio: float,
                 max_grad_norm: float, weight_decay: float = 0.0, min_lr_ratio: float = 0.1,
                 layout: Layout | None = None, groups: Groups | None = None, micro_batch: int = 1,
                 cpu_adam: bool = True):
        """cpu_adam: with offload_optimizer, step with DeepSpeedCPUAdam (the fast, JIT-built op; what a GPU run
        wants) rather than torch's AdamW on the CPU partition (same maths, no build)."""
        self.layout = Layout.of(layout or Layout())
        validate(self.layout)
        self.backend = backend_for(self.layout)
        self.max_grad_norm = max_grad_norm
        self.groups = groups
        if self.layout.tp > 1:
            from hybridcore.tensor_parallel import split_size
            if groups is None or groups.tp_group is None or split_size(model) != self.layout.tp:
                raise ValueError(f"engine.layout.tp={self.layout.tp}: split the model with "
                                 f"tensor_parallel.split_model over groups.tp_group and pass groups= first")
        if self.backend == "torch":
            self.module = self.model = model
            self.optimizer = optim.adamw(model, lr, weight_decay)
            self.scheduler = optim.warmup_cosine(self.optimizer, total_steps, warmup_ratio, min_lr_ratio)
            self.ds = None
            self.trained = [p for g in self.optimizer.param_groups for p in g["params"]]
            return
        if groups is not None and groups.world != self.layout.world:
            raise ValueError(f"groups are for world {groups.world}, layout for {self.layout.world}")
        import deepspeed  # only when asked for: the GPU machine may not have it

        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEFAULT_EXTENSIONS_DIR))
        ensure_process_group()
        world = torch.distributed.get_world_size()
        if world != self.layout.world:
            raise InputError(f"engine.layout: dp={self.layout.dp} x tp={self.layout.tp} = {self.layout.world} "
                             f"processes, but this run has {world}; start it with torchrun --nproc-per-node "
                             f"{self.layout.world}")
        if not isinstance(model, torch.nn.Module) or any(not p.requires_grad for p in model.parameters()):
            if self.layout.zero_stage == 3 or self.layout.tp > 1:
                raise NotYetSupported("DeepSpeed ZeRO-3 or tp > 1 over LoRA adapters / a frozen base (ZeRO-3 would "
                                      "partition parameters the model's own forwards read whole)",
                                      "the 3D sharding issue (#8)")
            model = TrainedOnly(model)  # adapters (+ a value head) over a frozen, possibly quantised base
        dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        if dtypes - {torch.float32, torch.bfloat16} or len(dtypes) != 1:
            raise NotYetSupported(f"DeepSpeed training of parameters in {sorted(map(str, dtypes))}",
                                  "the memory issue (#5): fp32 or bf16 only")
        bf16 = dtypes == {torch.bfloat16}
        n = sum(p.numel() for p in model.parameters() if p.requires_grad)
        bucket = max(2 ** 20, -(-n // 32) * 32)
        offload_adam = self.layout.offload_optimizer and cpu_adam
        # no empty group: DeepSpeed drops those, and the schedule would then have more groups than the optimizer
        # (LoRA adapters are all 2-D: nothing in the no-decay group)
        groups_ = [g for g in optim.param_groups(model, weight_decay) if g["params"]]
        self.trained = [p for g in groups_ for p in g["params"]]  # before ZeRO swaps the groups for flat partitions
        if offload_adam:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            opt = DeepSpeedCPUAdam(groups_, lr=lr, betas=(0.9, 0.95), adamw_mode=True)
        else:
            opt = torch.optim.AdamW(groups_, lr=lr, betas=(0.9, 0.95))
        sched = optim.warmup_cosine(opt, total_steps, warmup_ratio, min_lr_ratio)
        config = ds_config(self.layout, bf16, max_grad_norm, micro_batch, cpu_adam=offload_adam,
                           bucket_elements=bucket)
        # tp > 1: DeepSpeed's data-parallel group is our dp group, and its ZeRO-1/2 gradient norm counts the
        # `tensor_model_parallel` shards on every tp rank and replicated parameters once (through the mpu)
        mpu = None
        if self.layout.tp > 1:
            from hybridcore.tensor_parallel import Mpu
            mpu = Mpu(groups)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=sched, config=config, dist_init_required=False, mpu=mpu)
        self.module = self.ds.module
        # training forwards go through the DeepSpeed engine: its forward() advances ZeRO's micro-step count,
        # without which ZeRO-3 overwrites (instead of adds) each micro-batch's gradient partition
        self.model = self.ds
        self._client_optimizer = opt

    # ------------------------------------------------------------------------------------------ training
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss`: the caller divides by the step's token (or row) count over ALL
        ranks, so the gradients sum across ranks; DeepSpeed averages over dp, hence the factor dp."""
        if self.ds is None:
            loss.backward()
        else:
            self.ds.backward(loss * self.layout.dp if self.layout.dp > 1 else loss, scale_wrt_gas=False)

    def step(self) -> float:
        """Clip, update, advance the schedule, clear grads; returns the pre-clip global gradient norm."""
        if self.ds is None and self.layout.tp > 1:
            from hybridcore.tensor_parallel import clip_grad_norm_
            norm = clip_grad_norm_([p for p in self.module.parameters() if p.requires_grad], self.max_grad_norm,
                                   self.groups.tp_group)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            return norm
        if self.ds is None:
            return optim.step(self.module, self.optimizer, self.scheduler, self.max_grad_norm)
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        self.ds.zero_grad()
        return float(norm) if norm is not None else float("nan")

    def forward(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) as a training forward: under ZeRO-3 run as the DeepSpeed engine's own forward (the
        stages' helpers call the model's parts, base_model and the LM head in chunks, not its root forward), so
        that ZeRO-3 counts the micro-step (else each micro-batch's gradient partition overwrites the last), resets
        its fetch trace and runs its backward prologue. Elsewhere it is just the call."""
        if self.ds is None or self.layout.zero_stage != 3:
            return fn(*args, **kwargs)
        module = self.ds.module
        module.forward = lambda: fn(*args, **kwargs)  # an instance attribute shadows the class's forward
        try:
            return self.ds()
        finally:
            del module.forward

    @contextlib.contextmanager
    def gathered(self):
        """ZeRO-3: every parameter whole on this rank's device inside the block (with offload_params, fetched from
        the CPU), with ZeRO-3's module hooks off so forwards read them as they are rather than gathering and
        releasing per layer; re-partitioned after, freeing the gathered memory. Yields the bytes gathered (0 when
        nothing is partitioned). All dp ranks must enter it together (an all-gather)."""
        if self.ds is None or self.layout.zero_stage != 3:
            yield 0
            return
        import deepspeed

        params = list(self.module.parameters())
        nbytes = sum(p.ds_numel * p.element_size() for p in params)
        offload = self.ds.optimizer.parameter_offload
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            for hook in offload.forward_hooks + offload.backward_hooks:  # as deepspeed's unwrap_model_for_generation
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield nbytes
            finally:
                offload._register_deepspeed_module(offload.module)

    def zero_grad(self) -> None:
        """Drop the gradients accumulated so far in this step (a skipped or redone step)."""
        if self.ds is None:
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.ds.zero_grad()
        opt = self.ds.optimizer
        if hasattr(opt, "zero_grad"):
            opt.zero_grad(set_to_none=True)
        _reset_partitioned_grads(opt)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight whole, as CPU copies (ZeRO-3 gathers its shards; all ranks must call it), for export.
        With tp > 1 the tp shards are gathered to global rank 0, and the other ranks get None."""
        if self.layout.tp > 1:
            from hybridcore.tensor_parallel import consolidated_state_dict
            return consolidated_state_dict(self.module, self.groups)
        if self.layout.zero_stage != 3:
            return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
        return zero3_state_dict(self.module)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Optimizer and schedule state (torch backend): drops into Checkpointer's `stateful`."""
        if self.ds is not None:
            raise NotYetSupported("TrainEngine.state_dict() under DeepSpeed (each rank holds a shard; use "
                                  "save(folder)/load(folder))", "the 3D sharding issue (#8)")
        return {"optimizer": self.optimizer.state_dict(), "schedule": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.ds is not None:
            raise NotYetSupported("TrainEngine.load_state_dict() under DeepSpeed (use load(folder))",
                                  "the 3D sharding issue (#8)")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["schedule"])

    def save(self, folder: Path) -> None:
        """Every rank writes its own shard into `folder` (DeepSpeed's format under DeepSpeed; a weights_only
        torch file otherwise). Model weights are included so that ZeRO-3 shards restore too."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.ds is None:
            torch.save({"model": self.module.state_dict(), **self.state_dict()}, folder / self._torch_file())
        else:
            self.ds.save_checkpoint(str(folder), tag=TAG, save_latest=False)
        (folder / "engine.json").write_text(json.dumps({"backend": self.backend, "layout": vars(self.layout)}))

    def _torch_file(self) -> str:
        """One file per tensor-parallel rank (each holds different shards); engine.pt without tp."""
        return "engine.pt" if self.layout.tp == 1 else f"engine-tp{self.groups.tp_rank}.pt"

    def load(self, folder: Path) -> None:
        """Restore what save() wrote; the layout must be the one it was saved with."""
        folder = Path(folder)
        saved = json.loads((folder / "engine.json").read_text())
        if saved["layout"] != vars(self.layout):
            raise NotYetSupported(f"resuming a checkpoint saved with layout {saved['layout']} under layout "
                                  f"{vars(self.layout)} (resharding)", "the 3D sharding issue (#8)")
        if self.ds is None:
            blob = torch.load(folder / self._torch_file(), weights_only=True)
            self.module.load_state_dict(blob.pop("model"))
            self.load_state_dict(blob)
        else:
            path, _ = self.ds.load_checkpoint(str(folder), tag=TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
            if path is None:
                raise FileNotFoundError(f"{folder}: no DeepSpeed checkpoint tagged {TAG!r}")

    # ------------------------------------------------------------------------------------------ memory
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by kind: params, grads, optimizer (fp32 master partition + moments),
        buffers (DeepSpeed's communication and offload staging buffers)."""
        params = [p for p in self.module.parameters()]
        out = {"params": [p.data for p in params] + [getattr(p, "ds_tensor", None) for p in params],
               "grads": [p.grad for p in params], "optimizer": [], "buffers": []}
        inner = self._client_optimizer if self.ds is not None else self.optimizer
        out["optimizer"] += list(_flatten([dict(s) for s in inner.state.values()]))
        if self.ds is None:
            return out
        zo = self.ds.optimizer
        out["optimizer"] += list(_flatten(getattr(zo, "single_partition_of_fp32_groups", [])))
        out["optimizer"] += list(_flatten(getattr(zo, "fp32_partitioned_groups_flat", [])))
        for name in ("grads_in_partition", "averaged_gradients", "all_grad_tensors", "accumulated_grads_in_cpu",
                     "grad_partitions_flat_buffer", "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"):
            out["grads"] += list(_flatten(getattr(zo, name, None)))
        out["grads"] += [t.grad for t in _flatten(getattr(zo, "single_partition_of_fp32_groups", []))]
        out["grads"] += [t.grad for t in _flatten(getattr(zo, "fp32_partitioned_groups_flat", []))]
        for name in ("param_buffer_of_bit16_for_cpu_offload_groups",):
            out["buffers"] += list(_flatten(getattr(zo, name, [])))
        for bucket in getattr(zo, "ipg_buckets", {}).values():
            out["buffers"] += list(_flatten(getattr(bucket, "buffer", [])))
        return out

    def held_bytes(self) -> dict[str, int]:
        """Bytes of distinct storages this rank holds, by kind (a storage counts once, under its first kind)."""
        counted: set = set()
        result = {}
        for kind, tensors in self.held_tensors().items():
            stor = {k: v for k, v in _storages(tensors).items() if k not in counted}
            counted |= stor.keys()
            result[kind] = sum(b for b, _ in stor.values())
        return result

    def optimizer_bytes(self) -> dict[str, int]:
        """Optimizer-state bytes (moments + any fp32 master partition) on the accelerator vs on the CPU."""
        stor = _storages(self.held_tensors()["optimizer"])
        device = sum(b for b, kind in stor.values() if kind != "cpu")
        return {"device": device, "cpu": sum(b for b, kind in stor.values() if kind == "cpu")}


def is_partitioned(module: torch.nn.Module) -> bool:
    """True when ZeRO-3 partitioned `module`'s parameters (each then carries DeepSpeed's ds_id)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def zero3_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of a ZeRO-3 module whole, as CPU copies; a collective (every dp rank calls it), re-partitioned
    after. What export writes and TrainEngine.full_state_dict returns."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _reset_partitioned_grads(zo) -> None:
    """ZeRO-2/3 reduce gradients into partitions during backward; a redone step must start from zero there too."""
    for name in ("grads_in_partition", "grad_partitions_flat_buffer"):
        buf = getattr(zo, name, None)
        if isinstance(buf, torch.Tensor):
            buf.zero_()
    for name in ("all_grad_tensors", "accumulated_grads_in_cpu", "averaged_gradients"):
        for t in _flatten(getattr(zo, name, None)):
            t.zero_()
