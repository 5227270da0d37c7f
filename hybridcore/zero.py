"""DeepSpeedEngine: the training backend for ZeRO-1/2/3, data parallelism and CPU offload (hybridcore/engine.py
has the protocol, the factory and the plain-torch backend).

Stages keep their own micro-batch loop (the loss already divided by the step's token count) and call
backward() per micro-batch and step() at the boundary; DeepSpeed runs with managed_gradient_accumulation off
so that it never rescales the loss or decides the boundary itself.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import torch

from hybridcore import optim
from hybridcore.engine import Engine, flatten, refuse_unsupported
from hybridcore.errors import InputError, NotYetSupported
from hybridcore.parallel import Groups, Layout, ensure_process_group

# A persistent folder for DeepSpeed's JIT-built ops (CPUAdam takes ~1-2 min to build once); .gitignore has it.
DEFAULT_EXTENSIONS_DIR = Path(__file__).resolve().parent.parent / ".torch_extensions"
TAG = "engine"
STALE_BUILD_S = 900  # an op builds here in 1.5-2.5 min; a build lock this old was left by a build that was killed


def clear_stale_build_locks(root: Path, older_than_s: float = STALE_BUILD_S) -> list[Path]:
    """torch's JIT build holds ROOT/OP/lock while it compiles, and a second process waits for that file to go,
    forever: a build killed mid-way (Ctrl-C, a timeout) leaves it behind and every later DeepSpeed run would hang
    without a word. Locks older than `older_than_s` are removed, each named on stderr."""
    removed = []
    for lock in sorted(root.glob("*/lock")):
        with contextlib.suppress(FileNotFoundError):  # another rank may remove it first
            age = time.time() - lock.stat().st_mtime
            if age > older_than_s:
                lock.unlink()
                removed.append(lock)
                print(f"removed {lock}: a DeepSpeed op build's lock left {age / 60:.0f} min ago by a build that "
                      f"did not finish; the op builds again", file=sys.stderr)
    return removed


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


class DeepSpeedEngine(Engine):
    """The model under DeepSpeed: `model` is DeepSpeed's engine (training forwards go through it: its forward()
    advances ZeRO's micro-step count, without which ZeRO-3 overwrites instead of adding each micro-batch's gradient
    partition); `module` the plain module, or, with frozen parameters (LoRA over a frozen or quantised base), the
    TrainedOnly holder of the trained ones."""

    backend = "deepspeed"

    def __init__(self, model, layout: Layout, groups: Groups | None, max_grad_norm: float, *, micro_batch: int,
                 cpu_adam: bool, lr: float, total_steps: int, warmup_ratio: float, min_lr_ratio: float,
                 weight_decay: float):
        super().__init__(model, layout, groups, max_grad_norm)
        self._check_world()
        import deepspeed  # only when asked for: the GPU machine may not have it

        model = self._trained_module(model)
        # no empty group: DeepSpeed drops those, and the schedule would then have more groups than the optimizer
        # (LoRA adapters are all 2-D: nothing in the no-decay group)
        param_groups = [g for g in optim.param_groups(model, weight_decay) if g["params"]]
        self.trained = [p for g in param_groups for p in g["params"]]  # before ZeRO swaps them for partitions
        offload_adam = layout.offload_optimizer and cpu_adam
        self._client_optimizer = _adamw(param_groups, lr, offload_adam)
        sched = optim.warmup_cosine(self._client_optimizer, total_steps, warmup_ratio, min_lr_ratio)
        n = sum(p.numel() for p in self.trained)
        config = ds_config(layout, self.trained[0].dtype == torch.bfloat16, max_grad_norm, micro_batch,
                           cpu_adam=offload_adam, bucket_elements=max(2 ** 20, -(-n // 32) * 32))
        # tp > 1: DeepSpeed's data-parallel group is our dp group, and its ZeRO-1/2 gradient norm counts the
        # `tensor_model_parallel` shards on every tp rank and replicated parameters once (through the mpu)
        mpu = None
        if layout.tp > 1:
            from hybridcore.tensor_parallel import Mpu
            mpu = Mpu(groups)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=self._client_optimizer, lr_scheduler=sched, config=config,
            dist_init_required=False, mpu=mpu)
        self.module, self.model = self.ds.module, self.ds

    def _check_world(self) -> None:
        if self.groups is not None and self.groups.world != self.layout.world:
            raise ValueError(f"groups are for world {self.groups.world}, layout for {self.layout.world}")
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEFAULT_EXTENSIONS_DIR))
        clear_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))
        ensure_process_group()
        world = torch.distributed.get_world_size()
        if world != self.layout.world:
            raise InputError(f"engine.layout: dp={self.layout.dp} x tp={self.layout.tp} = {self.layout.world} "
                             f"processes, but this run has {world}; start it with torchrun --nproc-per-node "
                             f"{self.layout.world}")

    def _trained_module(self, model) -> torch.nn.Module:
        """What DeepSpeed is given: the model, or TrainedOnly over it when part of it is frozen."""
        if not isinstance(model, torch.nn.Module) or any(not p.requires_grad for p in model.parameters()):
            refuse_unsupported(self.layout, {"adapters": True})
            model = TrainedOnly(model)  # adapters (+ a value head) over a frozen, possibly quantised base
        dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        if dtypes - {torch.float32, torch.bfloat16} or len(dtypes) != 1:
            raise NotYetSupported(f"DeepSpeed training of parameters in {sorted(map(str, dtypes))}",
                                  "the memory issue (#5): fp32 or bf16 only")
        return model

    # ------------------------------------------------------------------------------------------ training
    def backward(self, loss: torch.Tensor) -> None:
        """The caller divides by the step's token (or row) count over ALL ranks, so the gradients sum across
        ranks; DeepSpeed averages over dp, hence the factor dp."""
        self.ds.backward(loss * self.layout.dp if self.layout.dp > 1 else loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        self.ds.zero_grad()
        return float(norm) if norm is not None else float("nan")

    def zero_grad(self) -> None:
        self.ds.zero_grad()
        opt = self.ds.optimizer
        if hasattr(opt, "zero_grad"):
            opt.zero_grad(set_to_none=True)
        _reset_partitioned_grads(opt)

    def forward(self, fn, *args, **kwargs):
        """Under ZeRO-3, fn(*args, **kwargs) runs as the DeepSpeed engine's own forward (the stages' helpers call
        the model's parts, base_model and the LM head in chunks, not its root forward), so that ZeRO-3 counts the
        micro-step (else each micro-batch's gradient partition overwrites the last), resets its fetch trace and
        runs its backward prologue. Elsewhere it is just the call."""
        if self.layout.zero_stage != 3:
            return fn(*args, **kwargs)
        module = self.ds.module
        module.forward = lambda: fn(*args, **kwargs)  # an instance attribute shadows the class's forward
        try:
            return self.ds()
        finally:
            del module.forward

    # ------------------------------------------------------------------------------------------ state
    def _save(self, folder: Path) -> None:
        """Every rank writes its own shard (DeepSpeed's format), model weights included so ZeRO-3 shards restore."""
        self.ds.save_checkpoint(str(folder), tag=TAG, save_latest=False)

    def _load(self, folder: Path) -> None:
        path, _ = self.ds.load_checkpoint(str(folder), tag=TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"{folder}: no DeepSpeed checkpoint tagged {TAG!r}")

    def whole_state_dict(self, copy: bool = True) -> dict[str, torch.Tensor] | None:
        if self.layout.zero_stage == 3:
            return zero3_state_dict(self.module)  # always copies: the gathered tensors are freed after
        return super().whole_state_dict(copy)

    def rollout_weights(self, rollout_tp: int | None = None):
        """ZeRO-3: every parameter gathered in place for the rollout, re-partitioned after."""
        if self.layout.zero_stage == 3:
            return Zero3Gather(self)
        return super().rollout_weights(rollout_tp)

    @contextlib.contextmanager
    def gathered(self):
        """ZeRO-3: every parameter whole on this rank's device inside the block (with offload_params, fetched from
        the CPU), with ZeRO-3's module hooks off so forwards read them as they are rather than gathering and
        releasing per layer; re-partitioned after, freeing the gathered memory. Yields the bytes gathered (0 when
        nothing is partitioned). All dp ranks must enter it together (an all-gather)."""
        if self.layout.zero_stage != 3:
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

    # ------------------------------------------------------------------------------------------ memory
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Engine's (which reads the client optimizer's states: `_client_optimizer`), with ZeRO's fp32 partitions,
        gradient partitions and communication / offload staging buffers."""
        out = super().held_tensors()
        zo = self.ds.optimizer
        fp32 = [*flatten(getattr(zo, "single_partition_of_fp32_groups", [])),
                *flatten(getattr(zo, "fp32_partitioned_groups_flat", []))]
        out["optimizer"] += fp32
        for name in ("grads_in_partition", "averaged_gradients", "all_grad_tensors", "accumulated_grads_in_cpu",
                     "grad_partitions_flat_buffer", "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"):
            out["grads"] += list(flatten(getattr(zo, name, None)))
        out["grads"] += [t.grad for t in fp32]
        out["buffers"] += list(flatten(getattr(zo, "param_buffer_of_bit16_for_cpu_offload_groups", [])))
        for bucket in getattr(zo, "ipg_buckets", {}).values():
            out["buffers"] += list(flatten(getattr(bucket, "buffer", [])))
        return out


class Zero3Gather:
    """The hybrid actor's weights transition under ZeRO-3 (hybridcore/transitions.py's protocol): every parameter
    gathered in place on entry, re-partitioned on exit; records the bytes gathered as "zero3_gathered"."""

    name = "zero3_gather"

    def __init__(self, engine: DeepSpeedEngine):
        self.engine, self._stack = engine, None

    def enter(self) -> dict[str, int]:
        self._stack = contextlib.ExitStack()
        return {"zero3_gathered": self._stack.enter_context(self.engine.gathered())}

    def exit(self) -> dict[str, int]:
        self._stack, stack = None, self._stack
        stack.close()  # re-partitions: each rank keeps only its shard again
        return {}


def _adamw(param_groups: list[dict], lr: float, cpu_adam: bool) -> torch.optim.Optimizer:
    """optim.py's AdamW (betas 0.9, 0.95), or DeepSpeedCPUAdam (same maths, the JIT-built op) on an offloaded
    partition."""
    if cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(param_groups, lr=lr, betas=(0.9, 0.95), adamw_mode=True)
    return torch.optim.AdamW(param_groups, lr=lr, betas=(0.9, 0.95))


def zero3_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of a ZeRO-3 module whole, as CPU copies; a collective (every dp rank calls it), re-partitioned
    after. What DeepSpeedEngine.whole_state_dict returns."""
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
        for t in flatten(getattr(zo, name, None)):
            t.zero_()
