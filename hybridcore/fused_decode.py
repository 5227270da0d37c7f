"""The 4-bit rollout's decode linears through the fused NF4 kernel (hybridcore/nf4.py) instead of bitsandbytes.

A rollout transition (hybridcore/transitions.py's protocol): on entry every bitsandbytes Linear4bit of the model
gets a forward that sends small batches (2 to `max_rows` rows: the decode steps) through `nf4.matmul`, which reads
each packed weight once, and everything else (a longer prefill, a lone row) through bitsandbytes' own forward; on
exit the layers' own forwards come back, so training never sees it. peft's LoRA layers wrap the base layer; where
one adapter is active (plain LoRA: no DoRA or other variant, no dropout at work) the wrapper's forward computes
u = x @ A^T (in the layer's compute dtype; adapters of one module that read the same input, q/k/v or gate/up, in
one product: `SharedInput`) and the kernel adds (u @ B^T) * scaling inside its epilogue (nf4.matmul's `lora`), so an
adapter costs at most one small product a projection instead of two products and an add; q/k/v and gate/up
(`PACKED`) are also one kernel launch each, nf4.group_matmul, their outputs side by side and sliced; any other
wrapper adds its deltas around whichever forward its base layer has. The weights are frozen (QLoRA trains only
adapters; the adapters do not change inside a rollout either). The kernels read bitsandbytes' own tensors, the
double-quantised absmax included (resolved per block inside the kernel), so the rollout holds no copy of them; only
the second level's small tables are made fp32 where they are not (an fp32 absmax resolved on entry, as this first
did, cost an eighth of the packed bytes: 0.41 GiB at the Llama-3-8B shape, bench/RESULTS.md 2026-12-06).

The kernel is called through a custom op (`torch.ops.hybridcore.nf4_matmul`), which torch.compile keeps as one
opaque node: traced into, the launcher's Python broke the compiled decode step inside every attention, and each
decoder layer's `layer_idx` then forced a recompile of the rest, past dynamo's limit of 8 (2026-12-06, H100).
"""
from __future__ import annotations

import itertools

import torch

from hybridcore import nf4
from hybridcore.adapters import linear4bit_layers, lora_adapter, lora_wrappers
from hybridcore.triton_device import runs_on

# the decode batches, in rows, sent through the fused kernel (bench/nf4_decode.py, H100: the 8B decoder's 224
# linears take 5.7 ms at 8 and 16 rows against bitsandbytes' 11.6, which dequantises the whole weight for more than
# one row, 2026-12-07; for one row bitsandbytes' own gemv kernel was faster, 4.0 ms against 5.4, 2026-12-06)
MIN_ROWS, MAX_ROWS = 2, 16


@torch.library.custom_op("hybridcore::nf4_matmul", mutates_args=(),
                         schema="(Tensor x, Tensor[] packed, Tensor[] absmax, Tensor code, Tensor[] absmax2, "
                                "Tensor[] code2, Tensor[] offset, int[] n, int k, int blocksize, int blocksize2, "
                                "Tensor[] u, Tensor[] lora_b, Tensor[] scale) -> Tensor")
def nf4_matmul(x, packed, absmax, code, absmax2, code2, offset, n, k, blocksize, blocksize2, u, lora_b, scale):
    """nf4.group_matmul with its default tiles on NF4Weights given as their tensors (what a custom op can take; one
    entry a weight, absmax2/code2/offset empty where not double-quantised), and their `loras` deltas where u,
    lora_b and scale are not empty: the outputs side by side, [..., sum(n)]."""
    second = zip(absmax2, code2, offset) if absmax2 else [(None, None, None)] * len(packed)
    weights = [nf4.NF4Weight(p, a, code, (rows, k), blocksize, a2, c2, o, blocksize2)
               for p, a, (a2, c2, o), rows in zip(packed, absmax, second, n)]
    return nf4.group_matmul(x, weights, loras=list(zip(u, lora_b, scale)) or None)


@nf4_matmul.register_fake
def _(x, packed, absmax, code, absmax2, code2, offset, n, k, blocksize, blocksize2, u, lora_b, scale):
    return x.new_empty(*x.shape[:-1], sum(n))


def op_arguments(weights: list[nf4.NF4Weight]) -> tuple:
    """nf4_matmul's arguments after x for `weights` (sharing one NF4 code, one K and one layout), fixed for the
    rollout."""
    w = weights[0]
    second = [[getattr(v, name) for v in weights] for name in ("absmax2", "code2", "offset")] if w.nested else [[]] * 3
    return ([v.packed for v in weights], [v.absmax for v in weights], w.code, *second, [v.shape[0] for v in weights],
            w.shape[1], w.blocksize, w.blocksize2)


def base_product(layer, args: tuple, x: torch.Tensor, *lora: list[torch.Tensor]) -> torch.Tensor:
    """A Linear4bit's forward through the op, in its compute dtype, plus its bias; lora: [u], [lora_b], [scale]."""
    dtype = getattr(layer, "compute_dtype", None) or x.dtype
    return with_bias(layer, nf4_matmul(x.to(dtype), *args, *(lora or ([], [], []))), x)


def with_bias(layer, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The layer's bias added to its product y (in y's dtype), the result in x's dtype."""
    if layer.bias is not None:
        y = y + layer.bias.to(y.dtype)
    return y.to(x.dtype)


def fused_forward(layer, weight: nf4.NF4Weight, max_rows: int, min_rows: int = MIN_ROWS):
    own, args = type(layer).forward, op_arguments([weight])

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not min_rows <= x.numel() // x.shape[-1] <= max_rows:
            return own(layer, x)
        return base_product(layer, args, x)
    return forward


class SharedInput:
    """The LoRA wrappers of one module that take the same input (a Llama attention's q/k/v, its MLP's gate/up):
    their A matrices stacked [sum of ranks, K] in the compute dtype, so the first of them to see an input computes
    every member's u in one product and the others slice theirs (on an H100, 224 separate products of 8 rows took
    1.41 ms a step in bf16, grouped by input 0.82: bench/RESULTS.md 2026-12-07). With `fused` (PACKED members: the
    op's arguments for their weights, their B in the compute dtype and scales) the first also computes every
    member's whole output in one kernel launch (`output`; ~7 us a launch saved a member, bench/RESULTS.md
    2026-12-07 13:23) and the others take their columns. The parent module's forward pre-hook forgets the last
    input, so a memo never outlives the module call that made it (nor reaches into a compiled step from outside
    it); a member called with another input (o_proj) computes the stack for that one."""

    def __init__(self, a: torch.Tensor, ranks: list[slice], fused: tuple | None = None):
        self.a, self.ranks, self.fused = a, ranks, fused
        self.x = self.u = self.y = None

    def forget(self, *_) -> None:
        self.x = self.u = self.y = None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's u for input x (the tensor the module passed, before any cast: its identity is the key)."""
        if self.x is not x:
            self.x, self.u, self.y = x, torch.nn.functional.linear(x.to(self.a.dtype), self.a), None
        return self.u

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's base + (u @ B^T) * scaling for input x, side by side (in the compute dtype, no bias)."""
        u = self.product(x)
        if self.y is None:
            args, lora_b, scale = self.fused
            self.y = nf4_matmul(x.to(self.a.dtype), *args, [u[..., r] for r in self.ranks], lora_b, scale)
        return self.y


def lora_weight(wrapper, adapter: str, which: str, dtype: torch.dtype) -> torch.Tensor:
    """The adapter's A or B (`which`) copied to `dtype` (peft keeps them in fp32 for training; an fp32 product of 8
    rows took twice a bf16 one's time on an H100, bench/RESULTS.md 2026-12-07); once a rollout."""
    return getattr(wrapper, f"lora_{which}")[adapter].weight.detach().to(dtype)


def fused_lora_forward(wrapper, adapter: str, weight: nf4.NF4Weight, max_rows: int, min_rows: int = MIN_ROWS,
                       shared: tuple[SharedInput, slice, slice | None] | None = None):
    """A peft LoRA wrapper's forward for decode rows: u = x @ A^T in the base layer's compute dtype (`lora_weight`;
    with `shared`, its rows of the group's product, whose stack holds its A), then base + (u @ B^T) * scaling in
    the kernel, in fp32 accumulation; where the group computes its members' outputs together (shared's third
    entry: this member's columns of them), those columns. Everything else (other row counts, extra arguments,
    autocast, a dropout at work) takes the wrapper's own forward."""
    own, base = type(wrapper).forward, wrapper.get_base_layer()
    dropout = wrapper.lora_dropout[adapter]
    scale = lora_scale(wrapper, adapter, weight.packed.device)
    args = op_arguments([weight])
    dtype = compute_dtype(wrapper, adapter)
    a = lora_weight(wrapper, adapter, "A", dtype) if shared is None else None
    b = lora_weight(wrapper, adapter, "B", dtype) if shared is None or shared[2] is None else None

    def forward(x: torch.Tensor, *rest, **kwargs) -> torch.Tensor:
        idle_dropout = isinstance(dropout, torch.nn.Identity) or not dropout.training or dropout.p == 0
        if (rest or kwargs or not idle_dropout or torch.is_autocast_enabled()
                or not min_rows <= x.numel() // x.shape[-1] <= max_rows):
            return own(wrapper, x, *rest, **kwargs)
        if shared is None:
            u = torch.nn.functional.linear(x.to(a.dtype), a)
        elif shared[2] is None:
            u = shared[0].product(x)[..., shared[1]]
        else:
            return with_bias(base, shared[0].output(x)[..., shared[2]], x)
        return base_product(base, args, x, [u], [b], [scale])
    return forward


def lora_scale(wrapper, adapter: str, device) -> torch.Tensor:
    """The adapter's scaling as the kernel takes it: a one-element fp32 tensor."""
    return torch.tensor([float(wrapper.scaling[adapter])], dtype=torch.float32, device=device)


def compute_dtype(wrapper, adapter: str) -> torch.dtype:
    return getattr(wrapper.get_base_layer(), "compute_dtype", None) or wrapper.lora_A[adapter].weight.dtype


# Modules of one parent that take the same input, by name (vLLM's packed_modules_mapping: qkv_proj, gate_up_proj):
# their base products are one kernel launch (SharedInput.output); other wrappers of a parent that share an input
# width share only their A product (o_proj's input is not q_proj's, so a wrong guess would cost work, not tokens)
PACKED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def shared_inputs(model, wrappers: dict, weights: dict) -> tuple[dict, list]:
    """{id(wrapper): (SharedInput, its rows of the stacked A, its columns of the group's output or None)} for the
    wrappers (id -> adapter) that share a parent module, input width and compute dtype with another (PACKED
    members with compatible 4-bit weights, `weights` by id of the base layer, also their base products), and the
    handles of the parents' forward pre-hooks that forget their groups' inputs (removed when the rollout ends)."""
    out, hooks = {}, []
    for parent in model.modules():
        named = {name: child for name, child in parent.named_children() if id(child) in wrappers}
        groups: list = []
        for names in PACKED:
            members = [named[n] for n in names if n in named]
            if len(members) == len(names) and packable(members, wrappers, weights):
                groups.append((members, True))
                named = {n: c for n, c in named.items() if n not in names}
        by_key: dict = {}
        for child in named.values():
            key = (child.get_base_layer().in_features, compute_dtype(child, wrappers[id(child)]))
            by_key.setdefault(key, []).append(child)
        groups += [(members, False) for members in by_key.values() if len(members) > 1]
        for members, fused in groups:
            entries, group = group_of(members, wrappers, weights if fused else None)
            out.update(entries)
            hooks.append(parent.register_forward_pre_hook(group.forget))
    return out, hooks


def packable(members: list, wrappers: dict, weights: dict) -> bool:
    """Whether PACKED members can share one launch: one input width and compute dtype, one LoRA rank, 4-bit
    weights of one K, block layout and NF4 code (nf4.same_layout, and the code's values, which one launch takes from
    the first member: compared here once, on entry)."""
    keys = {(m.get_base_layer().in_features, compute_dtype(m, wrappers[id(m)]),
             m.lora_A[wrappers[id(m)]].weight.shape[0]) for m in members}
    ws = [weights[id(m.get_base_layer())] for m in members]
    return (len(keys) == 1 and len(members) <= nf4.MAX_GROUP and nf4.same_layout(ws)
            and all(torch.equal(w.code, ws[0].code) for w in ws))


def group_of(members: list, wrappers: dict, weights: dict | None) -> tuple[dict, SharedInput]:
    """The SharedInput of `members` and each member's entry for shared_inputs; weights: fuse their products too."""
    adapters = [wrappers[id(m)] for m in members]
    dtype = compute_dtype(members[0], adapters[0])
    a = [lora_weight(m, adapter, "A", dtype) for m, adapter in zip(members, adapters)]
    starts = [0, *itertools.accumulate(t.shape[0] for t in a)]
    ranks = [slice(s, e) for s, e in zip(starts, starts[1:])]
    fused, columns = None, [None] * len(members)
    if weights is not None:
        ws = [weights[id(m.get_base_layer())] for m in members]
        fused = (op_arguments(ws), [lora_weight(m, adapter, "B", dtype) for m, adapter in zip(members, adapters)],
                 [lora_scale(m, adapter, ws[0].packed.device) for m, adapter in zip(members, adapters)])
        ends = list(itertools.accumulate(w.shape[0] for w in ws))
        columns = [slice(e - w.shape[0], e) for w, e in zip(ws, ends)]
    group = SharedInput(torch.cat(a), ranks, fused)
    return {id(m): (group, r, c) for m, r, c in zip(members, ranks, columns)}, group


class FusedNf4Decode:
    """The model's Linear4bit layers decode through the fused kernel while the rollout lasts."""

    name = "fused_nf4_decode"

    def __init__(self, model, max_rows: int = MAX_ROWS):
        self.model, self.layers, self.wrappers, self.hooks = model, linear4bit_layers(model), [], []
        if not self.layers:
            raise ValueError("fused 4-bit decode: the model has no bitsandbytes Linear4bit layer")
        self.max_rows = max_rows

    def enter(self) -> dict[str, int]:
        device = self.layers[0].weight.device
        if not runs_on(device):
            raise RuntimeError("engine.rollout.decode_4bit=fused runs its Triton kernel on CUDA (on a CPU only under "
                               "Triton's interpreter, TRITON_INTERPRET=1: tests); expected a GPU, or bitsandbytes")
        weights = {id(layer): nf4.NF4Weight.from_bnb(layer.weight) for layer in self.layers}
        for layer in self.layers:
            layer.forward = fused_forward(layer, weights[id(layer)], self.max_rows)
        plain = {id(w): (w, a) for w in lora_wrappers(self.model) for a in [lora_adapter(w)] if a is not None}
        shared, self.hooks = shared_inputs(self.model, {key: a for key, (_, a) in plain.items()}, weights)
        self.wrappers = []
        for key, (wrapper, adapter) in plain.items():
            weight = weights[id(wrapper.get_base_layer())]
            wrapper.forward = fused_lora_forward(wrapper, adapter, weight, self.max_rows, shared=shared.get(key))
            self.wrappers.append(wrapper)
        return {}

    def exit(self) -> dict[str, int]:
        for layer in self.layers + self.wrappers:
            layer.__dict__.pop("forward", None)
        for hook in self.hooks:
            hook.remove()
        self.wrappers, self.hooks = [], []
        return {}
