"""The Triton kernels behind hybridcore/decode_attention.py (imported on first use: Triton reads TRITON_INTERPRET when
a kernel is defined). `attention_partials` walks one chunk of one (row, KV head)'s cache columns with an online
softmax, all the query heads of the group at once (one MMA row each, padded to G_PAD); `attention_combine` merges a
(row, query head)'s chunks. Both read `filled` from the device, so a graph replays them as it advances."""
import triton
import triton.language as tl


@triton.jit
def _weight(m, top):
    """exp(m - top) with -inf - -inf read as 0 (a chunk or tile whose columns are all masked), not NaN."""
    return tl.exp(m - tl.where(top == float("-inf"), 0.0, top))


@triton.jit
def attention_partials(q_ptr, k_ptr, v_ptr, mask_ptr, filled_ptr, m_ptr, l_ptr, acc_ptr, scale, G, HKV, C, CHUNKS,
                       stride_qb, stride_qh, stride_qg, stride_kb, stride_kh, stride_kc, stride_vb, stride_vh,
                       stride_vc, stride_mask, D: tl.constexpr, G_PAD: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Program (b * HKV + h, chunk): columns [chunk * CHUNK, min(+CHUNK, filled)) of row b, KV head h, in tiles of
    BLOCK_N. Stores the chunk's running max m, sum l and unnormalised acc = sum p v for each of the G query heads
    (fp32); a chunk at or past `filled` returns at once, storing nothing (the combine reads only the chunks before
    it). UPCAST: q, k, v and p (already rounded to v's dtype) to fp32 for the dots: Triton's interpreter
    multiplies bf16 as raw integers."""
    bh, chunk = tl.program_id(0), tl.program_id(1)  # a chunk's programs first: those past `filled` come last
    start = chunk * CHUNK
    filled = tl.minimum(tl.load(filled_ptr), C)  # never past the cache, whatever the tensor says
    if start >= filled:
        return
    b, h = (bh // HKV).to(tl.int64), bh % HKV  # int64: a cache past 2**31 elements
    rg, rd = tl.arange(0, G_PAD), tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rg[:, None] * stride_qg + rd[None, :], mask=rg[:, None] < G,
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_row, v_row = k_ptr + b * stride_kb + h * stride_kh, v_ptr + b * stride_vb + h * stride_vh
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    end = tl.minimum(start + CHUNK, filled)
    for n in range(start, end, BLOCK_N):
        cols = n + tl.arange(0, BLOCK_N)
        ok = cols < end
        keep = tl.load(mask_ptr + b * stride_mask + cols, mask=ok, other=0) != 0
        k = tl.load(k_row + cols[:, None] * stride_kc + rd[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_row + cols[:, None] * stride_vc + rd[None, :], mask=ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(keep[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = _weight(s, m_new[:, None])
        alpha = _weight(m_i, m_new)
        p_v = p.to(v_ptr.dtype.element_ty)
        if UPCAST:
            p_v, v = p_v.to(tl.float32), v.to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=PRECISION)
        m_i = m_new
    row = (bh.to(tl.int64) * CHUNKS + chunk) * G + rg  # partials [B * HKV, CHUNKS, G(, D)]
    tl.store(m_ptr + row, m_i, mask=rg < G)
    tl.store(l_ptr + row, l_i, mask=rg < G)
    tl.store(acc_ptr + row[:, None] * D + rd[None, :], acc, mask=rg[:, None] < G)


@triton.jit
def attention_combine(m_ptr, l_ptr, acc_ptr, filled_ptr, out_ptr, G, HKV, C, CHUNKS, stride_ob, stride_oh, stride_og,
                      D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program b * HKV * G + h * G + g: the softmax over the chunks attention_partials wrote (those before
    `filled`), BLOCK_C chunks at a time: their max first, then sum(l e^(m - max)) and sum(acc e^(m - max)), their
    quotient stored in out's dtype. A row whose every column is masked has l = 0 everywhere: its output is 0."""
    row = tl.program_id(0)
    bh, g = row // G, row % G
    b, h = (bh // HKV).to(tl.int64), bh % HKV
    chunks = tl.cdiv(tl.minimum(tl.load(filled_ptr), C), CHUNK)
    rc, rd = tl.arange(0, BLOCK_C), tl.arange(0, D)
    first = bh.to(tl.int64) * CHUNKS * G + g  # chunk c of this (row, head) at first + c * G
    top = tl.full((BLOCK_C,), float("-inf"), tl.float32)
    for c in range(0, chunks, BLOCK_C):
        top = tl.maximum(top, tl.load(m_ptr + first + (c + rc) * G, mask=c + rc < chunks, other=float("-inf")))
    top_all = tl.max(top, 0)
    total = tl.zeros((BLOCK_C,), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for c in range(0, chunks, BLOCK_C):
        ok = c + rc < chunks
        w = _weight(tl.load(m_ptr + first + (c + rc) * G, mask=ok, other=float("-inf")), top_all)
        total += tl.load(l_ptr + first + (c + rc) * G, mask=ok, other=0.0) * w
        part = tl.load(acc_ptr + (first + (c + rc) * G)[:, None] * D + rd[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(part * w[:, None], 0)
    denom = tl.sum(total, 0)
    out = acc / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + g * stride_og + rd, out.to(out_ptr.dtype.element_ty))
