"""NF4 kernels that look the levels up in shared memory (hybridcore/nf4.py's `pair_dot` and `nibble_dot`; imported on
first use, as nf4_kernels is). scaled_dot looks each nibble up with a global load (an L1 hit, 64-bit address
arithmetic, an fp32 result), scales it, and moves the levels through shared memory into the MMA's operand layout:
bench/nf4_ptx.py counts ~18.5 instructions and ~30 bytes of L1/shared-memory traffic per weight byte in its loop.
Here the table is a 1-D tl.gather, which Triton lowers to one shared-memory load per index with a 32-bit address,
and the levels stay unscaled up to the MMA, one per quantisation block, whose fp32 result is scaled by the block's
absmax: no per-element multiply. `pair_dot` looks up both levels of a byte at once, already in x's dtype, in a
256-entry table of 16-bit pairs built in the kernel from the code: ~8 instructions and ~15 L1/shared bytes per
weight byte (triton 3.6, sm_90), but a warp's 32 lookups land on ~3.2 distinct words a bank for uniform or
NF4-quantised Gaussian bytes (simulated), so those loads take ~3 shared-memory passes each. `nibble_dot` looks up
each nibble in the fp32 16-entry code (16 words, no conflicts) and rounds the levels to x's dtype (a conversion per
two): ~13 instructions and ~19 bytes. Timed (the 8B decoder's linears, batch 8, H100, bench/RESULTS.md
2026-12-07): nibble_dot 5.73 ms, pair_dot 6.05, scaled_dot 7.36, so nibble_dot is `auto`'s kernel for 3-16 rows;
the levels still go through shared memory once, into the MMA's layout, as in scaled_dot (Triton does that for a
gather's result)."""
import triton
import triton.language as tl

from hybridcore.nf4_kernels import _finish, _resolve_scales, _scale_loads


@triton.jit
def _pair_table(code_ptr, dtype: tl.constexpr):
    """For every byte b, the levels of its two nibbles rounded to dtype (16-bit), packed as int32: code[b >> 4] (the
    even column) in the low half, code[b & 15] in the high half, the order of two consecutive elements in a register."""
    b = tl.arange(0, 256)
    even = tl.load(code_ptr + (b >> 4)).to(dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    odd = tl.load(code_ptr + (b & 15)).to(dtype).to(tl.int16, bitcast=True).to(tl.int32)
    return even | (odd << 16)


@triton.jit
def _levels(byte, table, PAIRS: tl.constexpr, BLOCK_N: tl.constexpr, HB: tl.constexpr, dtype: tl.constexpr,
            scale=None, SCALED: tl.constexpr = False):
    """The unscaled levels [BLOCK_N, 2 * HB] in dtype of the bytes [BLOCK_N, HB], in column order (SCALED: times
    `scale`, fp32 [BLOCK_N, HB], one a byte, before the rounding to dtype). The gathers are 1-D: Triton lowers those
    through shared memory and leaves the index's layout alone (a 2-D tl.gather gets a layout of its own, warp
    shuffles, and costs conversions of the bytes and of the levels). The pair table in 4 or 32 copies, each lane
    reading its own (fewer or no bank conflicts), was no faster: 6.07 and 6.18 ms against 6.06 (bench/RESULTS.md
    2026-12-08), Triton storing a gather's table to shared memory at every step."""
    flat = tl.reshape(byte.to(tl.int32), (BLOCK_N * HB,))
    if PAIRS:
        pair = tl.reshape(tl.gather(table, flat, 0), (BLOCK_N, HB))
        even = pair.to(tl.int16).to(dtype, bitcast=True)
        odd = (pair >> 16).to(tl.int16).to(dtype, bitcast=True)
    else:
        even = tl.reshape(tl.gather(table, flat >> 4, 0), (BLOCK_N, HB))
        odd = tl.reshape(tl.gather(table, flat & 15, 0), (BLOCK_N, HB))
    if SCALED:
        even, odd = even.to(tl.float32) * scale, odd.to(tl.float32) * scale
    return tl.reshape(tl.join(even.to(dtype), odd.to(dtype)), (BLOCK_N, 2 * HB))


@triton.jit
def _step_operands(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, rn, rm, kb, end, M, N, stride_xm, ROW_BYTES,
                   HB: tl.constexpr, NESTED: tl.constexpr, BLOCK2: tl.constexpr):
    """The global loads of one step, the quantisation block at byte kb of rows rn (nothing past `end`: masked to
    zeros): its bytes [BLOCK_N, HB], the parts of its absmax [BLOCK_N] (nf4_kernels._scale_loads: none waits for
    another) and x's 2 * HB columns [BLOCK_M, 2 * HB]."""
    ok = rn < tl.where(kb < end, N, 0)
    byte = tl.load(w_ptr + rn[:, None] * ROW_BYTES + kb + tl.arange(0, HB)[None, :], mask=ok[:, None], other=0)
    q, outer = _scale_loads(absmax_ptr, absmax2_ptr, rn * (ROW_BYTES // HB) + kb // HB, ok, NESTED, BLOCK2)
    x_ok = rm[:, None] < tl.where(kb < end, M, 0)
    xv = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * kb + tl.arange(0, 2 * HB)[None, :], mask=x_ok, other=0.0)
    return byte, q, outer, xv


@triton.jit
def _one_block_loop(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, table, rn, rm, start, end, M, N,
                    stride_xm, ROW_BYTES, HB: tl.constexpr, NESTED: tl.constexpr, BLOCK2: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr, PAIRS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, dtype: tl.constexpr):
    """_lut_tile's loop one quantisation block a step: one MMA of the unscaled levels, its fp32 result scaled."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    byte, q, outer, xv = _step_operands(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, rn, rm, start, end, M, N, stride_xm,
                                        ROW_BYTES, HB, NESTED, BLOCK2)
    for kb in range(start, end, HB):
        byte2, q2, outer2, xv2 = _step_operands(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, rn, rm, kb + HB, end, M, N,
                                                stride_xm, ROW_BYTES, HB, NESTED, BLOCK2)
        scale = _resolve_scales(q, outer, code2_ptr, offset_ptr, rn < N, NESTED)  # kb < end here
        w = _levels(byte, table, PAIRS, BLOCK_N, HB, dtype)
        if UPCAST:  # see nf4_dot
            part = tl.dot(w.to(tl.float32), tl.trans(xv.to(tl.float32)), input_precision=PRECISION)
        else:
            part = tl.dot(w, tl.trans(xv), input_precision=PRECISION)
        acc += part * scale[:, None]
        byte, q, outer, xv = byte2, q2, outer2, xv2
    return acc


@triton.jit
def _pair_step_operands(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, rn, rm, kb, end, M, N, stride_xm, ROW_BYTES,
                        HB: tl.constexpr, NESTED: tl.constexpr, BLOCK2: tl.constexpr):
    """_step_operands for two quantisation blocks from byte kb: the bytes [BLOCK_N, 2 * HB], the absmax parts of
    each block (the second's masked where it starts at or past `end`) and x's 4 * HB columns; bytes and x columns
    at or past `end` read as zeros."""
    cols = kb + tl.arange(0, 2 * HB)
    ok = rn < tl.where(kb < end, N, 0)
    byte = tl.load(w_ptr + rn[:, None] * ROW_BYTES + cols[None, :], mask=ok[:, None] & (cols < end)[None, :],
                   other=0)
    block = rn * (ROW_BYTES // HB) + kb // HB
    q0, outer0 = _scale_loads(absmax_ptr, absmax2_ptr, block, ok, NESTED, BLOCK2)
    q1, outer1 = _scale_loads(absmax_ptr, absmax2_ptr, block + 1, rn < tl.where(kb + HB < end, N, 0), NESTED,
                              BLOCK2)
    xc = 2 * kb + tl.arange(0, 4 * HB)
    x_ok = (rm[:, None] < tl.where(kb < end, M, 0)) & (xc < 2 * end)[None, :]
    xv = tl.load(x_ptr + rm[:, None] * stride_xm + xc[None, :], mask=x_ok, other=0.0)
    return byte, q0, outer0, q1, outer1, xv


@triton.jit
def _two_block_loop(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, table, rn, rm, start, end, M, N,
                    stride_xm, ROW_BYTES, HB: tl.constexpr, NESTED: tl.constexpr, BLOCK2: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr, PAIRS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, dtype: tl.constexpr):
    """_lut_tile's loop two quantisation blocks a step (STEP_BLOCKS 2): the levels are scaled by their block's
    absmax in fp32 and rounded to x's dtype, as bitsandbytes dequantises, and the two blocks take one MMA of 2 x
    QBLOCK columns, so each step's fixed costs (the table's store, the layout conversions and their barriers) are
    paid once for twice the bytes; the per-element multiply is the price."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    byte, q0, outer0, q1, outer1, xv = _pair_step_operands(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, rn, rm, start, end,
                                                           M, N, stride_xm, ROW_BYTES, HB, NESTED, BLOCK2)
    first = tl.arange(0, 2 * HB)[None, :] < HB  # the byte columns of the step's first block
    for kb in range(start, end, 2 * HB):
        nxt = _pair_step_operands(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, rn, rm, kb + 2 * HB, end, M, N, stride_xm,
                                  ROW_BYTES, HB, NESTED, BLOCK2)
        s0 = _resolve_scales(q0, outer0, code2_ptr, offset_ptr, rn < N, NESTED)  # kb < end here
        s1 = _resolve_scales(q1, outer1, code2_ptr, offset_ptr, rn < tl.where(kb + HB < end, N, 0), NESTED)
        w = _levels(byte, table, PAIRS, BLOCK_N, 2 * HB, dtype, tl.where(first, s0[:, None], s1[:, None]), True)
        if UPCAST:  # see nf4_dot
            acc += tl.dot(w.to(tl.float32), tl.trans(xv.to(tl.float32)), input_precision=PRECISION)
        else:
            acc += tl.dot(w, tl.trans(xv), input_precision=PRECISION)
        byte, q0, outer0, q1, outer1, xv = nxt
    return acc


@triton.jit
def _lora_delta(u_ptr, lora_b_ptr, scale_ptr, rn, rm, M, N, R, stride_um, R_PAD: tl.constexpr):
    """(lora_b[rn] [BLOCK_N, R] @ u[rm]^T [R, BLOCK_M]) * scale in fp32, the rank padded to R_PAD (>= 16, a power
    of two: tl.dot's smallest side) with zeros. A few KB a program: plain fp32 FMAs, no tensor-core rounding."""
    rr = tl.arange(0, R_PAD)
    b = tl.load(lora_b_ptr + rn[:, None] * R + rr[None, :], mask=(rn[:, None] < N) & (rr[None, :] < R), other=0.0)
    u = tl.load(u_ptr + rm[None, :] * stride_um + rr[:, None], mask=(rr[:, None] < R) & (rm[None, :] < M), other=0.0)
    return tl.dot(b.to(tl.float32), u.to(tl.float32), input_precision="ieee") * tl.load(scale_ptr)


@triton.jit
def _lut_tile(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rn, rm, M, N, stride_xm,
              ROW_BYTES, PER_SPLIT, HB: tl.constexpr, NESTED: tl.constexpr, BLOCK2: tl.constexpr,
              PRECISION: tl.constexpr, UPCAST: tl.constexpr, PAIRS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, u_ptr, lora_b_ptr, scale_ptr, R, stride_um, LORA: tl.constexpr,
              R_PAD: tl.constexpr, STEP_BLOCKS: tl.constexpr):
    """nf4_lut_dot's product for weight rows rn (rows at or past N are none) and x rows rm over this program's split
    of K, plus the LoRA delta on the first split: the fp32 [BLOCK_N, BLOCK_M] before the splits meet. The next
    step's global loads are in flight while one is multiplied (two steps ahead was slower on an H100: 6.67 against
    5.68 ms for the 8B decoder's linears, bench/RESULTS.md 2026-12-07 22:45; the registers cost programs an SM).
    A double-quantised absmax is resolved (code2 read at the uint8 code) when its step is used, not when it is
    loaded, so that no load of the next step waits for another's value: on an H100, one machine, the rollout's
    launches (grouped, LoRA epilogue) 6.03 -> 5.93 ms a step and pair_dot 6.06 -> 5.83, but grouped without LoRA
    5.12 -> 5.27 (bench/RESULTS.md 2026-12-08); kept for the path the rollout runs."""
    start = tl.program_id(2) * PER_SPLIT
    end = tl.minimum(start + PER_SPLIT, ROW_BYTES)
    dtype = x_ptr.dtype.element_ty
    if PAIRS:
        table = _pair_table(code_ptr, dtype)
    else:
        table = tl.load(code_ptr + tl.arange(0, 16))
    if STEP_BLOCKS == 2:
        acc = _two_block_loop(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, table, rn, rm, start, end,
                              M, N, stride_xm, ROW_BYTES, HB, NESTED, BLOCK2, PRECISION, UPCAST, PAIRS, BLOCK_M,
                              BLOCK_N, dtype)
    else:
        acc = _one_block_loop(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, table, rn, rm, start, end,
                              M, N, stride_xm, ROW_BYTES, HB, NESTED, BLOCK2, PRECISION, UPCAST, PAIRS, BLOCK_M,
                              BLOCK_N, dtype)
    if LORA:
        if tl.program_id(2) == 0:
            acc += _lora_delta(u_ptr, lora_b_ptr, scale_ptr, rn, rm, M, N, R, stride_um, R_PAD)
    return acc


@triton.jit
def _pick(m, first, second, third):
    """The member-m one of three values of one type (a scalar branch: Triton yields the value out of the if)."""
    value = first
    if m == 1:
        value = second
    if m == 2:
        value = third
    return value


@triton.jit(do_not_specialize=["M"])
def nf4_lut_dot(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, y_ptr, part_ptr, count_ptr,
                M, N, stride_xm, stride_ym, ROW_BYTES, PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, QBLOCK: tl.constexpr, NESTED: tl.constexpr, BLOCK2: tl.constexpr,
                REDUCE: tl.constexpr, SELECT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                PAIRS: tl.constexpr, u_ptr=None, lora_b_ptr=None, scale_ptr=None, R=0, stride_um=0,
                LORA: tl.constexpr = False, R_PAD: tl.constexpr = 16, GROUP: tl.constexpr = 1, T1=0, T2=0,
                w_ptr1=None, absmax_ptr1=None, absmax2_ptr1=None, code2_ptr1=None, offset_ptr1=None, u_ptr1=None,
                lora_b_ptr1=None, scale_ptr1=None, w_ptr2=None, absmax_ptr2=None, absmax2_ptr2=None,
                code2_ptr2=None, offset_ptr2=None, u_ptr2=None, lora_b_ptr2=None, scale_ptr2=None,
                STEP_BLOCKS: tl.constexpr = 1):
    """y^T [BLOCK_N, BLOCK_M] += (levels [BLOCK_N, QBLOCK] @ x^T [QBLOCK, BLOCK_M]) * absmax, one quantisation block a
    step (BLOCK_K only sizes the splits of K; SELECT is unused: the tables are this kernel's lookup). The weight is
    the MMA's wide operand, as in nf4_dot. Each step's global loads are issued a step ahead (in registers), so
    that a program has the next block's bytes in flight while it looks up and multiplies this one. PAIRS: the
    256-entry pair table (16-bit x only; fp32 x takes the 16-entry one). LORA: the first split of each tile also
    adds a LoRA delta, (lora_b [N, R] @ u^T [R, M]) * scale, u = x @ lora_a^T computed by the caller, in fp32
    before the splits meet: the adapter's B product and its add are no launches of their own.
    GROUP (2 or 3): up to three weights that take the same x in one launch (q/k/v, gate/up), their outputs side by
    side in y (N their rows together): tiles from T1 (and T2) on are the second (third) member's, whose tensors are
    the arguments ending in 1 (2); every member but the last has whole tiles of rows, so a tile is one member's and
    y's columns are the tiles' own. The members share x, the NF4 code and LoRA's rank and u's row stride.
    STEP_BLOCKS 2 (pair_dot2, nibble_dot2): two quantisation blocks a step, their levels scaled before one MMA."""
    HB: tl.constexpr = QBLOCK // 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if GROUP > 1:  # the member's tensors; its weight rows are rn - first (rn itself indexes y's columns)
        m = (tl.program_id(0) >= T1).to(tl.int32) + (tl.program_id(0) >= T2).to(tl.int32)
        first = tl.where(m == 2, T2, tl.where(m == 1, T1, 0)) * BLOCK_N
        w_ptr, absmax_ptr = _pick(m, w_ptr, w_ptr1, w_ptr2), _pick(m, absmax_ptr, absmax_ptr1, absmax_ptr2)
        absmax2_ptr, code2_ptr = (_pick(m, absmax2_ptr, absmax2_ptr1, absmax2_ptr2),
                                  _pick(m, code2_ptr, code2_ptr1, code2_ptr2))
        offset_ptr = _pick(m, offset_ptr, offset_ptr1, offset_ptr2)
        if LORA:
            u_ptr, lora_b_ptr = _pick(m, u_ptr, u_ptr1, u_ptr2), _pick(m, lora_b_ptr, lora_b_ptr1, lora_b_ptr2)
            scale_ptr = _pick(m, scale_ptr, scale_ptr1, scale_ptr2)
    else:
        first = 0
    acc = _lut_tile(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rn - first, rm, M,
                    N - first, stride_xm, ROW_BYTES, PER_SPLIT, HB, NESTED, BLOCK2, PRECISION, UPCAST, PAIRS, BLOCK_M,
                    BLOCK_N, u_ptr, lora_b_ptr, scale_ptr, R, stride_um, LORA, R_PAD, STEP_BLOCKS)
    _finish(tl.trans(acc), y_ptr, part_ptr, count_ptr, M, N, stride_ym, BLOCK_M, BLOCK_N, REDUCE)
