"""The Triton kernel behind hybridcore/nf4.py (imported only when the kernel is first used: Triton reads
TRITON_INTERPRET when a kernel is defined)."""
import triton
import triton.language as tl


@triton.jit
def level(q, code_ptr):
    """The NF4 level of each nibble in q: a tree of selects over the 16 levels, bit 3 at the root."""
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

@triton.jit
def nf4_matmul(x_ptr, w_ptr, absmax_ptr, code_ptr, y_ptr, M, N, K, stride_xm, stride_ym, PER_SPLIT,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QBLOCK: tl.constexpr,
               ATOMIC: tl.constexpr, SELECT: tl.constexpr, PRECISION: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    k_start = tl.program_id(2) * PER_SPLIT
    half = tl.arange(0, BLOCK_K // 2)  # byte j of a chunk holds columns 2j (high nibble) and 2j+1 (low)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + PER_SPLIT, K), BLOCK_K):
        col = k0 + 2 * half  # the even column of each byte
        w_mask = (rn[:, None] < N) & (col[None, :] < K)
        flat = rn[:, None] * K + col[None, :]  # index into the flattened weight (< 2**31: checked)
        # K is even, so byte flat // 2 = n * K/2 + k0/2 + j: written so the compiler sees runs of contiguous bytes
        byte = tl.load(w_ptr + rn[:, None] * (K // 2) + (k0 // 2 + half)[None, :], mask=w_mask, other=0)
        byte = byte.to(tl.int32)
        scale = tl.load(absmax_ptr + flat // QBLOCK, mask=w_mask, other=0.0)  # both nibbles: one block
        if SELECT:  # the 16 scalar loads are hoisted and cached; the tree is registers only
            w_even = level(byte >> 4, code_ptr) * scale
            w_odd = level(byte & 15, code_ptr) * scale
        else:
            w_even = tl.load(code_ptr + (byte >> 4)) * scale
            w_odd = tl.load(code_ptr + (byte & 15)) * scale
        x_mask = (rm[:, None] < M) & (col[None, :] < K)
        x_row = x_ptr + rm[:, None] * stride_xm + col[None, :]
        x_even = tl.load(x_row, mask=x_mask, other=0.0)
        x_odd = tl.load(x_row + 1, mask=x_mask, other=0.0)
        acc += tl.dot(x_even, tl.trans(w_even.to(x_even.dtype)), input_precision=PRECISION)
        acc += tl.dot(x_odd, tl.trans(w_odd.to(x_odd.dtype)), input_precision=PRECISION)
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    y_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ATOMIC:
        tl.atomic_add(out, acc, mask=y_mask)
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
