"""A fused NF4 dequantise-and-multiply for small batches (the decode step of a 4-bit rollout).

bitsandbytes' 4-bit path dequantises the whole weight to bf16 for every call and then multiplies, so a decode step
at batch 8 reads each weight three times (4-bit in, bf16 out, bf16 in again), and a decode step is bound by the
bytes it reads: these kernels read the packed weight once and multiply as they go. More than one kernel, because the
batch decides what runs out first: for a row or two the fp32 FMAs are few (`gemv`); beyond that they outgrow the
dequantisation and the tensor cores take them (`dot`, the weight as the MMA's wide operand; `scaled_dot`, the same
with one MMA per tile of K, the levels scaled before it; `pair_dot` and `nibble_dot`, hybridcore/nf4_lut.py, look
the levels up in shared memory, for fewer instructions per byte: nibble_dot is the fastest at 8-16 rows timed). K is
split among programs because a step's narrow linears (k/v: 1024 rows) would leave most SMs idle, and the splits are
added up inside the kernel because a zeroed buffer and a cast would be two more launches for each of a step's 224
linears.
The default tiles and NIBBLE_DOT_MAX_M were timed on an H100 (bench/nf4_decode.py, bench/RESULTS.md); GEMV_MAX_M is
still a guess (one-row steps stay on bitsandbytes, which is faster there). K must be whole quantisation blocks (true of the usual hidden sizes), so that a block's absmax is one row's.

Training keeps bitsandbytes' own path; this is for inference on weights that do not change inside a rollout.
`NF4Weight.from_bnb` reads a bitsandbytes Params4bit (double quantisation resolved once to fp32 absmax);
`dequantize` is the plain-torch reference the tests hold the kernels to. On a CPU the kernels run under Triton's
interpreter (TRITON_INTERPRET=1 set before triton is first imported: tests/hybridcore/nf4_worker.py runs in a
process of its own for that), which is how CI tests them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class NF4Weight:
    """An [N, K] weight in bitsandbytes' NF4 layout: `packed` uint8 [N*K/2] (row-major, two columns a byte), one
    absmax per `blocksize` consecutive elements of the flattened weight, `code` the 16 NF4 levels. The absmax is
    fp32, or, double-quantised as bitsandbytes keeps it, uint8 codes into `code2` scaled by `absmax2` (fp32, one per
    `blocksize2` absmax) plus `offset` (fp32 [1]): the kernels resolve those per block, so reading a layer this way
    holds no copy of anything (an fp32 absmax would add an eighth of the packed bytes)."""
    packed: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    shape: tuple[int, int]
    blocksize: int
    absmax2: torch.Tensor | None = None
    code2: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    blocksize2: int = 256

    @property
    def nested(self) -> bool:
        return self.absmax2 is not None

    @classmethod
    def from_bnb(cls, weight) -> "NF4Weight":
        """From a bitsandbytes Params4bit (or its packed data + quant_state), sharing its tensors (nothing copied
        but the two small second-level tables, in fp32)."""
        state = weight.quant_state
        if state.quant_type != "nf4":
            raise ValueError(f"NF4Weight: quant_type {state.quant_type!r}, expected 'nf4'")
        n, k = state.shape
        if k % 2:
            raise ValueError(f"NF4Weight: {k} input features, expected an even number (two columns a byte)")
        packed, code = weight.data.reshape(-1).view(torch.uint8), state.code.float().contiguous()
        if not state.nested:
            return cls(packed, state.absmax.float().contiguous(), code, (n, k), state.blocksize)
        s2 = state.state2
        return cls(packed, state.absmax.contiguous(), code, (n, k), state.blocksize, s2.absmax.float().contiguous(),
                   s2.code.float().contiguous(), state.offset.float().reshape(1), s2.blocksize)

    def scales(self) -> torch.Tensor:
        """The fp32 absmax of every block, as bitsandbytes resolves a double-quantised one (code2 x absmax2, then
        the offset: two roundings, as the kernels do)."""
        if not self.nested:
            return self.absmax
        blocks = self.absmax.numel()
        outer = self.absmax2.repeat_interleave(self.blocksize2)[:blocks]
        return self.code2[self.absmax.long()] * outer + self.offset

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The whole [N, K] weight, in plain torch (the reference)."""
        hi, lo = (self.packed >> 4).long(), (self.packed & 15).long()
        flat = torch.stack([self.code[hi], self.code[lo]], dim=-1).reshape(-1)
        scale = self.scales().repeat_interleave(self.blocksize)[: flat.numel()]
        return (flat * scale).reshape(self.shape).to(dtype)


GEMV_MAX_M = 2  # batches up to this many rows take `gemv` (a guess: see the module docstring)
NIBBLE_DOT_MAX_M = 16  # then up to this many `nibble_dot` (timed at 8 and 16 rows), larger ones `dot`
# The Llama-3-8B decoder's 224 linears in one CUDA graph, per decode step, H100 (bench/RESULTS.md 2026-12-07):
# nibble_dot 5.73 ms at batch 8 and 5.84 at 16 (bf16 dense 5.58 / 5.83, bitsandbytes 11.60 / 11.65), pair_dot 6.05 /
# 6.14, scaled_dot 7.36 / 7.46, dot 8.28 / 8.28, in the same run; the LUT kernels' defaults were the fastest of their
# configs timed (n64, k64, 2 stages, 256 rows with 8 warps all slower). scaled_dot's and dot's tiles: 2026-12-06.
DEFAULTS = {"gemv": dict(block_n=128, block_k=64, num_warps=4, num_stages=1),
            "dot": dict(block_n=64, block_k=256, num_warps=4, num_stages=1),
            "scaled_dot": dict(block_n=64, block_k=128, num_warps=4, num_stages=1),
            # 128 rows of W a program, one quantisation block a step; block_k only sizes the splits of K: 256
            # gives k and v 16 splits of 4 steps, not 64 of one
            "pair_dot": dict(block_n=128, block_k=256, num_warps=4, num_stages=1),
            "nibble_dot": dict(block_n=128, block_k=256, num_warps=4, num_stages=1),
            # two quantisation blocks a step, scaled before one MMA (nf4_lut._two_block_loop), untimed yet: 64 rows
            # keep pair_dot2 at 128 registers, 4 programs an SM (128 rows: 180, 2), sm_90 code by bench/nf4_ptx.py
            "pair_dot2": dict(block_n=64, block_k=256, num_warps=4, num_stages=1),
            "nibble_dot2": dict(block_n=64, block_k=256, num_warps=4, num_stages=1)}
KERNELS = ("gemv", "dot", "scaled_dot", "pair_dot", "nibble_dot", "pair_dot2", "nibble_dot2")
# hybridcore/nf4_lut.py's nf4_lut_dot, levels looked up in shared memory
LUT_KERNELS = ("pair_dot", "nibble_dot", "pair_dot2", "nibble_dot2")
SPLIT_TARGET = 4  # split_k="auto" splits K until there are this many programs per SM (or K runs out)
_COUNTERS: dict = {}  # device -> int32 counters of the in-kernel split reduction, zero between calls


def matmul(x: torch.Tensor, w: NF4Weight, kernel: str | None = None, block_n: int | None = None,
           block_k: int | None = None, block_m: int | None = None, vec: int | None = None,
           split_k: int | str = "auto", reduce: str = "serial", num_warps: int | None = None,
           num_stages: int | None = None, lookup: str = "table",
           lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype, fp32 accumulation, reading W's 4-bit bytes once.

    kernel: "gemv", "dot", "scaled_dot" (dot's tiles, one MMA per block_k with the levels scaled before it),
    "pair_dot" / "nibble_dot" (levels looked up in shared memory, a byte or a nibble at a time: nf4_lut.py),
    "pair_dot2" / "nibble_dot2" (the same two quantisation blocks a step, the levels scaled before one MMA), or None
    (by the batch: GEMV_MAX_M, NIBBLE_DOT_MAX_M); unset tiles, warps and stages come from DEFAULTS.
    block_m: batch rows a program takes (default the batch rounded up to a power of two, at most 8 for gemv, 16 to
    64 for dot); more rows than that take more programs, each reading W again. vec (gemv): bytes of a row a thread
    takes at a time, 16 (default up to 4 rows of x) or 8 (fewer registers for more rows). split_k: programs sharing
    a tile's K, or "auto". reduce: how the splits meet, "serial" (the last to finish adds them up, in the kernel)
    or "atomic" (fp32 atomic adds into a zeroed buffer, then a cast: two more launches). lookup: "table" (a load
    from the 16-entry code) or "select" (a tree of selects; pair_dot and nibble_dot have their own tables). dot
    rounds the levels to x's dtype for the MMA (fp32 x: full-precision FMAs, slow). Splitting keeps counters on the
    device, one per output tile: calls that split K must not run concurrently on two streams.
    lora: (u [..., R], lora_b [N, R], scale fp32 [1]) adds (u @ lora_b^T) * scale to the product, u being x @ lora_a^T
    (a LoRA adapter's first product, computed by the caller), in fp32 before the result is rounded to x's dtype:
    inside the kernel for pair_dot and nibble_dot (the first split of each tile adds it), in torch after the others."""
    return group_matmul(x, [w], kernel, block_n, block_k, block_m, vec, split_k, reduce, num_warps, num_stages, lookup,
                        None if lora is None else [lora])


def group_matmul(x: torch.Tensor, weights: list[NF4Weight], kernel: str | None = None, block_n: int | None = None,
                 block_k: int | None = None, block_m: int | None = None, vec: int | None = None,
                 split_k: int | str = "auto", reduce: str = "serial", num_warps: int | None = None,
                 num_stages: int | None = None, lookup: str = "table",
                 loras: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """x [..., K] @ [W_0; W_1; ...]^T -> [..., N_0 + N_1 + ...]: matmul of up to MAX_GROUP weights that take the
    same x (an attention's q/k/v, an MLP's gate/up), their outputs side by side, with one (u, lora_b, scale) `loras`
    entry each or none. One launch for all of them where the kernel is a LUT kernel and every member but the last
    has whole tiles of rows (block_n, unless given, is then the largest power of two up to its default, and at
    least 16, that divides those members' rows): a launch costs ~7 us beyond its bytes on an H100 (bench/RESULTS.md
    2026-12-07 13:23). Otherwise each member is a launch of its own, their outputs concatenated. One launch reads
    the first member's NF4 code for all (bitsandbytes has one; comparing them here would cost a sync a call:
    fused_decode.packable compares them once)."""
    import triton

    n, k = sum(w.shape[0] for w in weights), weights[0].shape[1]
    m = x.reshape(-1, x.shape[-1]).shape[0]
    kernel = kernel or ("gemv" if m <= GEMV_MAX_M else "nibble_dot" if m <= NIBBLE_DOT_MAX_M else "dot")
    given = dict(block_n=block_n or _group_rows(weights, kernel), block_k=block_k, num_warps=num_warps,
                 num_stages=num_stages)
    cfg = {**DEFAULTS.get(kernel, {}), **{key: v for key, v in given.items() if v is not None}}
    bm = block_m or (min(_pow2(m), 8) if kernel == "gemv" else min(max(_pow2(m), 16), 64))  # dots: 16 to 64
    cfg.update(block_m=bm, vec=vec or (16 if bm <= 4 else 8), split_k=split_k, reduce=reduce, lookup=lookup)
    loras = loras or [None] * len(weights)
    for w, lora in zip(weights, loras):
        _check(x, w, kernel, cfg)
        if lora is not None:
            _check_lora(x, w, *lora)
    if len(weights) > 1 and not _one_launch(weights, kernel, cfg["block_n"], loras):
        return torch.cat([matmul(x, w, kernel, block_n, block_k, block_m, vec, split_k, reduce, num_warps, num_stages,
                                 lookup, lora) for w, lora in zip(weights, loras)], dim=-1)
    lead, x2, bn, bk = x.shape[:-1], x.reshape(-1, k).contiguous(), cfg["block_n"], cfg["block_k"]
    if m == 0:
        return x.new_empty(*lead, n)
    tiles, chunks = triton.cdiv(n, bn) * triton.cdiv(m, bm), triton.cdiv(k, bk)
    split = triton.cdiv(SPLIT_TARGET * _sms(x.device), tiles) if split_k == "auto" else split_k
    per = triton.cdiv(chunks, max(1, min(split, chunks)))  # chunks of BLOCK_K a split walks; no split left empty
    split = triton.cdiv(chunks, per)
    mode = 0 if split == 1 else 1 if reduce == "atomic" else 2
    y = (torch.zeros if mode == 1 else torch.empty)((m, n), dtype=torch.float32 if mode == 1 else x.dtype,
                                                    device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if mode == 2 else y
    count = _counters(x.device, tiles) if mode == 2 else y
    fn, w = _kernel(kernel), weights[0]
    upcast = type(fn).__name__ == "InterpretedFunction"  # see nf4_dot's UPCAST
    extra = {"VEC": cfg["vec"]} if kernel == "gemv" else {
        "PRECISION": "ieee" if x.dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast}
    if kernel in LUT_KERNELS:  # a pair of levels fills an int32 only for 16-bit x: fp32 x looks up nibbles
        extra.update(PAIRS=kernel.startswith("pair_dot") and x.dtype != torch.float32,
                     STEP_BLOCKS=2 if kernel.endswith("2") else 1,
                     **_lora_arguments(loras[0]), **_member_arguments(weights, loras, bn))
    fn[(triton.cdiv(n, bn), triton.cdiv(m, bm), split)](
        x2, w.packed, w.absmax, *_outer(w), w.code, y, part, count, m, n, x2.stride(0), y.stride(0), k // 2,
        per * bk // 2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, QBLOCK=w.blocksize, NESTED=w.nested, BLOCK2=w.blocksize2,
        REDUCE=mode, SELECT=lookup == "select", num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra)
    if loras[0] is not None and kernel not in LUT_KERNELS:  # their epilogue has added it
        u, lora_b, scale = loras[0]
        y = y.float() + (u.reshape(m, -1).float() @ lora_b.float().T) * scale
    return y.to(x.dtype).reshape(*lead, n)


MAX_GROUP = 3  # members of one group_matmul launch (nf4_lut_dot's GROUP)


def _outer(w: NF4Weight) -> tuple:
    """The second level of a double-quantised absmax (absmax2, code2, offset); unread placeholders when plain."""
    return (w.absmax2, w.code2, w.offset) if w.nested else (w.absmax, w.code, w.absmax)


def _group_rows(weights: list[NF4Weight], kernel: str) -> int | None:
    """group_matmul's block_n for several weights: the largest power of two up to the kernel's default that divides
    the rows of every member but the last (None: the default; the launch is then split per member)."""
    if len(weights) == 1 or kernel not in LUT_KERNELS:
        return None
    bn = DEFAULTS[kernel]["block_n"]
    while bn > 16 and any(w.shape[0] % bn for w in weights[:-1]):
        bn //= 2
    return bn


def same_layout(weights: list[NF4Weight]) -> bool:
    """Whether the weights share K, the quantisation blocks, the absmax's layout and the code's dtype: what one
    group_matmul launch reads alike for every member (the code's values it takes from the first)."""
    w0 = weights[0]
    return all(w.shape[1] == w0.shape[1] and w.blocksize == w0.blocksize and w.nested == w0.nested
               and w.blocksize2 == w0.blocksize2 and w.code.dtype == w0.code.dtype for w in weights)


def _one_launch(weights: list[NF4Weight], kernel: str, block_n: int, loras: list) -> bool:
    """Whether group_matmul's members can share one nf4_lut_dot launch (see its docstring)."""
    ranks = {None if lora is None else (lora[0].shape[-1], lora[0].reshape(-1, lora[0].shape[-1]).stride(0),
                                         lora[0].dtype) for lora in loras}
    return (kernel in LUT_KERNELS and len(weights) <= MAX_GROUP and same_layout(weights) and len(ranks) == 1
            and all(w.shape[0] % block_n == 0 for w in weights[:-1]))


def _member_arguments(weights: list[NF4Weight], loras: list, block_n: int) -> dict:
    """nf4_lut_dot's GROUP arguments: the first tile of the second and third member (T1, T2; T2 past every tile for
    two members) and their tensors (suffix 1 and 2; the second member's again for a missing third)."""
    if len(weights) == 1:
        return {}
    t1 = weights[0].shape[0] // block_n
    t2 = t1 + weights[1].shape[0] // block_n if len(weights) == 3 else 2 ** 30
    out = dict(GROUP=len(weights), T1=t1, T2=t2)
    for i in (1, 2):
        w, lora = weights[min(i, len(weights) - 1)], loras[min(i, len(weights) - 1)]
        absmax2, code2, offset = _outer(w)
        out.update({f"w_ptr{i}": w.packed, f"absmax_ptr{i}": w.absmax, f"absmax2_ptr{i}": absmax2,
                    f"code2_ptr{i}": code2, f"offset_ptr{i}": offset})
        if lora is not None:
            lo = _lora_arguments(lora)
            out.update({f"{key}{i}": lo[key] for key in ("u_ptr", "lora_b_ptr", "scale_ptr")})
    return out


def _check(x, w, kernel, cfg) -> None:
    """The ValueErrors of matmul: everything the kernels assume about shapes, tiles and options."""
    n, k = w.shape
    pow2 = lambda v, low: isinstance(v, int) and v >= low and v & (v - 1) == 0  # noqa: E731
    least = 1 if kernel == "gemv" else 16  # tl.dot's smallest side
    problems = [
        (x.shape[-1] != k, f"x has {x.shape[-1]} features, the weight takes {k}"),
        (x.dtype not in (torch.float32, torch.bfloat16, torch.float16), f"x is {x.dtype}, expected a float dtype"),
        (kernel not in KERNELS, f"kernel {kernel!r}, expected {', '.join(map(repr, KERNELS))} or None"),
        (cfg["lookup"] not in ("select", "table"), f"lookup {cfg['lookup']!r}, expected 'select' or 'table'"),
        (kernel in LUT_KERNELS and cfg["lookup"] != "table", f"lookup {cfg['lookup']!r}: {kernel} has its own"),
        (cfg["reduce"] not in ("serial", "atomic"), f"reduce {cfg['reduce']!r}, expected 'serial' or 'atomic'"),
        (not pow2(w.blocksize, 32) or w.blocksize > 256,
         f"quantisation block {w.blocksize}, expected a power of two from 32 to 256"),
        (k % w.blocksize != 0, f"{k} input features are not whole quantisation blocks of {w.blocksize}"),
        (not isinstance(cfg.get("block_k"), int) or cfg["block_k"] <= 0 or cfg["block_k"] % w.blocksize != 0,
         f"block_k {cfg.get('block_k')} is not a multiple of the quantisation block {w.blocksize}"),
        (not pow2(cfg.get("block_n"), least), f"block_n {cfg.get('block_n')}, expected a power of two >= {least}"),
        (not pow2(cfg["block_m"], least), f"block_m {cfg['block_m']}, expected a power of two >= {least}"),
        (not pow2(cfg["vec"], 4) or cfg["vec"] > min(16, w.blocksize // 2),
         f"vec {cfg['vec']}, expected a power of two from 4 to 16 (at most half the quantisation block)"),
        (cfg["split_k"] != "auto" and not (isinstance(cfg["split_k"], int) and cfg["split_k"] >= 1),
         f"split_k {cfg['split_k']!r}, expected a positive int or 'auto'"),
        (n * k >= 2 ** 31, f"weight of {n * k} elements: 2**31 or more overflow the kernels' int32 offsets"),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(f"nf4.matmul: {message}")


def _lora_arguments(lora) -> dict:
    """nf4_lut_dot's LoRA epilogue arguments for matmul's `lora` (none without one)."""
    if lora is None:
        return {}
    u, lora_b, scale = lora[0].reshape(-1, lora[0].shape[-1]), lora[1].contiguous(), lora[2]
    u = u if u.stride(-1) == 1 else u.contiguous()
    return dict(u_ptr=u, lora_b_ptr=lora_b, scale_ptr=scale, R=u.shape[1], stride_um=u.stride(0), LORA=True,
                R_PAD=max(16, _pow2(u.shape[1])))


def _check_lora(x, w, u, lora_b, scale) -> None:
    """The ValueErrors of matmul's `lora`: u one row of R per row of x, lora_b [N, R], scale one fp32 number."""
    n, r = w.shape[0], u.shape[-1]
    problems = [
        (u.shape[:-1] != x.shape[:-1], f"lora u is {tuple(u.shape)}, expected x's rows {tuple(x.shape[:-1])} x rank"),
        (tuple(lora_b.shape) != (n, r), f"lora_b is {tuple(lora_b.shape)}, expected ({n}, {r}): output features x rank"),
        (not 1 <= r <= 256, f"LoRA rank {r}, expected 1 to 256"),
        (scale.numel() != 1 or scale.dtype != torch.float32, "lora scale: expected a one-element float32 tensor"),
        (u.dtype not in (torch.float32, torch.bfloat16, torch.float16) or lora_b.dtype != u.dtype,
         f"lora u is {u.dtype} and lora_b {lora_b.dtype}, expected one float dtype"),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(f"nf4.matmul: {message}")


def _pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


@functools.cache
def _sms(device: torch.device) -> int:
    """SMs of the device (split_k="auto"); 1 where there is no CUDA device (the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _counters(device: torch.device, size: int) -> torch.Tensor:
    """The in-kernel reduction's per-tile counters: zeroed once, left at zero by every kernel that uses them."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < size:
        if have is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("nf4.matmul: more split-K tiles than ever before while capturing a CUDA graph; "
                               "call it once outside the capture first")
        have = _COUNTERS[device] = torch.zeros(max(size, 1 << 14), dtype=torch.int32, device=device)
    return have


@functools.cache
def _kernel(name: str):
    """Imported on first use, so TRITON_INTERPRET can be set by then (and triton is imported only when needed)."""
    if name in LUT_KERNELS:
        from hybridcore import nf4_lut
        return nf4_lut.nf4_lut_dot
    from hybridcore import nf4_kernels
    return getattr(nf4_kernels, f"nf4_{name}")
