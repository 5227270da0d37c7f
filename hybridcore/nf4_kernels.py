"""The Triton kernels behind hybridcore/nf4.py (imported on first use: Triton reads TRITON_INTERPRET when a kernel is
defined). Both read the packed weight as [BLOCK_N, width] tiles of contiguous bytes inside one quantisation block
(16-byte vector loads where a row's K/2 bytes are a multiple of 16, which Triton sees when it specialises that
argument), one absmax per row and block instead of one per element, and x's columns contiguously, split into the
even (high-nibble) and odd ones in registers: no strided load anywhere."""
import triton
import triton.language as tl


@triton.jit
def _level(q, code_ptr, SELECT: tl.constexpr):
    """The NF4 level of each nibble in q: a load from the 16-entry code (one 64-byte line, L1-resident), or a tree of
    selects over the 16 levels (registers only, ~20 instructions an element)."""
    if SELECT:
        b0, b1, b2, b3 = (q & 1) != 0, (q & 2) != 0, (q & 4) != 0, (q & 8) != 0
        lo = tl.where(b2, tl.where(b1, tl.where(b0, tl.load(code_ptr + 7), tl.load(code_ptr + 6)),
                                   tl.where(b0, tl.load(code_ptr + 5), tl.load(code_ptr + 4))),
                      tl.where(b1, tl.where(b0, tl.load(code_ptr + 3), tl.load(code_ptr + 2)),
                               tl.where(b0, tl.load(code_ptr + 1), tl.load(code_ptr + 0))))
        hi = tl.where(b2, tl.where(b1, tl.where(b0, tl.load(code_ptr + 15), tl.load(code_ptr + 14)),
                                   tl.where(b0, tl.load(code_ptr + 13), tl.load(code_ptr + 12))),
                      tl.where(b1, tl.where(b0, tl.load(code_ptr + 11), tl.load(code_ptr + 10)),
                               tl.where(b0, tl.load(code_ptr + 9), tl.load(code_ptr + 8))))
        return tl.where(b3, hi, lo)
    else:
        return tl.load(code_ptr + q)


@triton.jit
def _weight_block(w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rn, kb, N, ROW_BYTES,
                  WIDTH: tl.constexpr, HB: tl.constexpr, NESTED: tl.constexpr, BLOCK2: tl.constexpr,
                  SELECT: tl.constexpr):
    """WIDTH bytes from byte kb of rows rn (inside one quantisation block of HB bytes): the levels of their even and
    odd columns [BLOCK_N, WIDTH] (fp32, not yet scaled) and the rows' absmax [BLOCK_N] (_weight_bytes)."""
    byte, scale = _weight_bytes(w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, rn, kb, ROW_BYTES, N,
                                ROW_BYTES, WIDTH, HB, NESTED, BLOCK2)
    byte = byte.to(tl.int32)
    return _level(byte >> 4, code_ptr, SELECT), _level(byte & 15, code_ptr, SELECT), scale


@triton.jit
def _weight_bytes(w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, rn, kb, end, N, ROW_BYTES,
                  WIDTH: tl.constexpr, HB: tl.constexpr, NESTED: tl.constexpr, BLOCK2: tl.constexpr):
    """The packed bytes [BLOCK_N, WIDTH] from byte kb of rows rn (inside one quantisation block of HB bytes) and the
    rows' absmax [BLOCK_N] (_scales). Rows past N and a kb at or past `end` read as zeros and scale by 0 (K is whole
    blocks, so a block is all in or all out)."""
    ok = rn < tl.where(kb < end, N, 0)  # not (rn < N) & (kb < end): the interpreter makes that int32
    byte = tl.load(w_ptr + rn[:, None] * ROW_BYTES + kb + tl.arange(0, WIDTH)[None, :], mask=ok[:, None], other=0)
    scale = _scales(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, rn * (ROW_BYTES // HB) + kb // HB, ok, NESTED,
                    BLOCK2)
    return byte, scale


@triton.jit
def _scales(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, block, ok, NESTED: tl.constexpr, BLOCK2: tl.constexpr):
    """The fp32 absmax of quantisation blocks `block` (any shape; 0 where not ok). NESTED: a uint8 code into code2,
    times the absmax2 of its BLOCK2 absmax, plus *offset_ptr, as bitsandbytes resolves it."""
    q, outer = _scale_loads(absmax_ptr, absmax2_ptr, block, ok, NESTED, BLOCK2)
    return _resolve_scales(q, outer, code2_ptr, offset_ptr, ok, NESTED)


@triton.jit
def _scale_loads(absmax_ptr, absmax2_ptr, block, ok, NESTED: tl.constexpr, BLOCK2: tl.constexpr):
    """_scales' global loads, none depending on another: (the uint8 code as int32, its absmax2) when NESTED, else
    (the fp32 absmax, a placeholder). nf4_lut issues them a step before _resolve_scales reads code2 at the code, so
    that no load waits for another's value inside a step."""
    if NESTED:  # one return after the if: Triton types every return of a function, constexpr branches included
        q = tl.load(absmax_ptr + block, mask=ok, other=0).to(tl.int32)
        outer = tl.load(absmax2_ptr + block // BLOCK2, mask=ok, other=0.0)
    else:
        q = tl.load(absmax_ptr + block, mask=ok, other=0.0)
        outer = q
    return q, outer


@triton.jit
def _resolve_scales(q, outer, code2_ptr, offset_ptr, ok, NESTED: tl.constexpr):
    """The fp32 absmax of _scale_loads' values (0 where not ok)."""
    if NESTED:
        scale = tl.load(code2_ptr + q) * outer
        scale += tl.load(offset_ptr)  # a tensor, not a float argument: torch.compile passes those as fp64
        scale = tl.where(ok, scale, 0.0)
    else:
        scale = q
    return scale


@triton.jit
def _x_block(x_ptr, rm, M, stride_xm, kb, ROW_BYTES, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """x's 2*WIDTH columns from column 2*kb for rows rm, loaded contiguously, split into even and odd columns."""
    ok = rm < tl.where(kb < ROW_BYTES, M, 0)
    xv = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * kb + tl.arange(0, 2 * WIDTH)[None, :], mask=ok[:, None],
                 other=0.0)
    return tl.split(tl.reshape(xv, (BLOCK_M, WIDTH, 2)))


@triton.jit
def _finish(acc, y_ptr, part_ptr, count_ptr, M, N, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            REDUCE: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 into y. REDUCE 0: a plain store (no split). 1: fp32 atomic adds into a zeroed y.
    2: each split stores its partial sums, and the last of a tile's splits to arrive (a counter per tile, reset by
    it) adds them in split order and stores y in its dtype: no zeroing or casting launches, same bits every run."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if REDUCE == 0:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    elif REDUCE == 1:
        tl.atomic_add(out, acc, mask=mask)
    else:
        splits = tl.num_programs(2)
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        part = part_ptr + rm[:, None] * N + rn[None, :]
        tl.store(part + tl.program_id(2) * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the counter's release (acq_rel, gpu scope)
        if tl.atomic_add(count_ptr + tile, 1) == splits - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            # .cg: from L2, where the other programs' stores are. Four loads unrolled a turn, so that they are in
            # flight together: this tail is the kernel's last work, and a load at a time costs an L2 round trip a
            # split (16 splits for the 8B shape's q/k/v/o; not timed yet)
            for s0 in range(0, splits, 4):
                for j in tl.static_range(4):  # past the last split: no row (a scalar condition, as _step_operands)
                    ok = (rm[:, None] < tl.where(s0 + j < splits, M, 0)) & (rn[None, :] < N)
                    total += tl.load(part + (s0 + j) * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit(do_not_specialize=["M"])  # the batch only bounds masks: one compile for all batches of a BLOCK_M
def nf4_gemv(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, y_ptr, part_ptr, count_ptr, M, N,
             stride_xm, stride_ym, ROW_BYTES, PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, QBLOCK: tl.constexpr, NESTED: tl.constexpr, BLOCK2: tl.constexpr,
             VEC: tl.constexpr, REDUCE: tl.constexpr, SELECT: tl.constexpr):
    """Small batches, no tensor cores. Each program owns BLOCK_N rows of W (and BLOCK_M rows of x) over one split of
    K and takes VEC bytes of every row at a time: a [BLOCK_N, VEC] tile is one vector load of one row per thread,
    so the [BLOCK_M, VEC, BLOCK_N] product can sum its columns inside each thread (no shuffles) while every thread
    reads the same x. BLOCK_N beyond 32 x num_warps gives a thread more rows for each x it converts."""
    HB: tl.constexpr = QBLOCK // 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    start = tl.program_id(2) * PER_SPLIT  # in bytes of a row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(start, tl.minimum(start + PER_SPLIT, ROW_BYTES), BLOCK_K // 2):
        for r in tl.static_range(BLOCK_K // (2 * VEC)):
            kr = tl.multiple_of(kb + r * VEC, VEC)  # so are PER_SPLIT and the step
            w_even, w_odd, scale = _weight_block(w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rn,
                                                 kr, N, ROW_BYTES, VEC, HB, NESTED, BLOCK2, SELECT)
            x_even, x_odd = _x_block(x_ptr, rm, M, stride_xm, kr, ROW_BYTES, BLOCK_M, VEC)
            prod = x_even.to(tl.float32)[:, :, None] * tl.trans(w_even)[None, :, :]
            prod += x_odd.to(tl.float32)[:, :, None] * tl.trans(w_odd)[None, :, :]
            acc += tl.sum(prod, axis=1) * scale[None, :]
    _finish(acc, y_ptr, part_ptr, count_ptr, M, N, stride_ym, BLOCK_M, BLOCK_N, REDUCE)


@triton.jit(do_not_specialize=["M"])
def nf4_dot(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, y_ptr, part_ptr, count_ptr, M, N,
            stride_xm, stride_ym, ROW_BYTES, PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, QBLOCK: tl.constexpr, NESTED: tl.constexpr, BLOCK2: tl.constexpr,
            REDUCE: tl.constexpr, SELECT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Tensor cores, weights as the wide operand: y^T [BLOCK_N, BLOCK_M] += levels [BLOCK_N, HB] @ x^T [HB, BLOCK_M]
    per block and nibble (BLOCK_N fills the MMA's 16/64-row side, the batch only its narrow one), scaled by the
    block's absmax in fp32 after the two dots; the levels are cast to x's dtype for the MMA. UPCAST: both operands
    (already in x's dtype) to fp32 for the dot, same products: Triton's interpreter multiplies bf16 as raw integers."""
    HB: tl.constexpr = QBLOCK // 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    start = tl.program_id(2) * PER_SPLIT
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(start, tl.minimum(start + PER_SPLIT, ROW_BYTES), BLOCK_K // 2):
        for r in tl.static_range(BLOCK_K // QBLOCK):
            kr = tl.multiple_of(kb + r * HB, HB)  # a block's first byte (so are PER_SPLIT and the step)
            w_even, w_odd, scale = _weight_block(w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, rn,
                                                 kr, N, ROW_BYTES, HB, HB, NESTED, BLOCK2, SELECT)
            x_even, x_odd = _x_block(x_ptr, rm, M, stride_xm, kr, ROW_BYTES, BLOCK_M, HB)
            w_even, w_odd = w_even.to(x_even.dtype), w_odd.to(x_odd.dtype)
            if UPCAST:
                w_even, w_odd, x_even, x_odd = (w_even.to(tl.float32), w_odd.to(tl.float32), x_even.to(tl.float32),
                                                x_odd.to(tl.float32))
            part = tl.dot(w_even, tl.trans(x_even), input_precision=PRECISION)
            part = tl.dot(w_odd, tl.trans(x_odd), part, input_precision=PRECISION)
            acc += part * scale[:, None]
    _finish(tl.trans(acc), y_ptr, part_ptr, count_ptr, M, N, stride_ym, BLOCK_M, BLOCK_N, REDUCE)


@triton.jit(do_not_specialize=["M"])
def nf4_scaled_dot(x_ptr, w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, y_ptr, part_ptr, count_ptr,
                   M, N, stride_xm, stride_ym, ROW_BYTES, PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, QBLOCK: tl.constexpr, NESTED: tl.constexpr, BLOCK2: tl.constexpr,
                   REDUCE: tl.constexpr, SELECT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """nf4_dot with one MMA per BLOCK_K columns instead of two per quantisation block: the levels are scaled by their
    block's absmax in registers and interleaved back into column order ([BLOCK_N, BLOCK_K], rounded to x's dtype,
    as bitsandbytes' dequantise-then-matmul rounds them), and x is loaded as it lies (no even/odd split). Columns
    past the row's end (K not a multiple of BLOCK_K) are masked to zero on both sides."""
    HB: tl.constexpr = QBLOCK // 2
    BYTES: tl.constexpr = BLOCK_K // 2
    NB: tl.constexpr = BLOCK_K // QBLOCK
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    start = tl.program_id(2) * PER_SPLIT
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(start, tl.minimum(start + PER_SPLIT, ROW_BYTES), BYTES):
        kb = tl.multiple_of(kb, HB)  # so are PER_SPLIT and the step
        cols = kb + tl.arange(0, BYTES)
        ok = rn[:, None] < tl.where(cols[None, :] < ROW_BYTES, N, 0)  # where(): see _weight_block
        byte = tl.load(w_ptr + rn[:, None] * ROW_BYTES + cols[None, :], mask=ok, other=0).to(tl.int32)
        first = kb + tl.arange(0, NB) * HB  # each quantisation block's first byte
        block_ok = rn[:, None] < tl.where(first[None, :] < ROW_BYTES, N, 0)
        scale = _scales(absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                        rn[:, None] * (ROW_BYTES // HB) + first[None, :] // HB, block_ok, NESTED, BLOCK2)[:, :, None]
        even = tl.reshape(tl.reshape(_level(byte >> 4, code_ptr, SELECT), (BLOCK_N, NB, HB)) * scale, (BLOCK_N, BYTES))
        odd = tl.reshape(tl.reshape(_level(byte & 15, code_ptr, SELECT), (BLOCK_N, NB, HB)) * scale, (BLOCK_N, BYTES))
        x_ok = rm[:, None] < tl.where(2 * kb + tl.arange(0, BLOCK_K)[None, :] < 2 * ROW_BYTES, M, 0)
        xv = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * kb + tl.arange(0, BLOCK_K)[None, :], mask=x_ok, other=0.0)
        w = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K)).to(xv.dtype)
        if UPCAST:  # see nf4_dot
            w, xv = w.to(tl.float32), xv.to(tl.float32)
        acc = tl.dot(w, tl.trans(xv), acc, input_precision=PRECISION)
    _finish(tl.trans(acc), y_ptr, part_ptr, count_ptr, M, N, stride_ym, BLOCK_M, BLOCK_N, REDUCE)
