"""The one-pass sampler's Triton kernels (hybridcore/sampling.py; imported on first use, so that importing the
sampler imports no triton). `sample_partials` covers a (row, split of the vocabulary) and `sample_combine` meets a
row's splits: few rows (a decode batch of 8) would leave all but a few SMs idle, each program walking the whole
vocabulary one dependent load after another."""
import triton
import triton.language as tl


@triton.jit
def _exponential(u):
    """Exp(1) from u ~ U[0, 1): -log(1 - u); below u = 1e-4 the series u + u^2 / 2 (1 - u would round away u's low
    bits), and u = 0 clamped to 2^-33."""
    e = tl.where(u < 1e-4, u + 0.5 * u * u, -tl.log(1.0 - u))
    return tl.maximum(e, 1.1641532182693481e-10)


@triton.jit
def _visit(base, idx, end, u, inv_t, m, s, best, best_col, V, GREEDY: tl.constexpr):
    """The columns idx of a row (a quarter block; those from `end` on are none) into the lanes' state: the running
    max m and sum s of exp(logit - m), the best score and its first column (score = logit, or logit * inv_t -
    log(E))."""
    ok = idx < end
    x = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32)
    new_m = tl.maximum(m, x)
    shift = tl.where(new_m == float("-inf"), 0.0, new_m)  # a lane that has seen only -inf keeps s = 0
    s = s * tl.exp(m - shift) + tl.exp(x - shift)
    if GREEDY:
        score = x
    else:
        score = tl.where(ok, x * inv_t - tl.log(_exponential(u)), float("-inf"))
    better = (score > best) | ((best_col == V) & ok)  # strict: a lane's first column among equals, even at -inf
    return new_m, s, tl.where(better, score, best), tl.where(better, idx, best_col)


@triton.jit(do_not_specialize=["seed"])
def sample_partials(logits_ptr, stride, V, PER, seed, inv_t, m_ptr, s_ptr, best_ptr, col_ptr, SPLITS,
                    GREEDY: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, split) walks columns [split * PER, (split + 1) * PER) of the row in blocks of four quarters,
    keeping per lane a running max m and sum s of exp(logit - m) (the raw logits' log-sum-exp) and the best score
    with its first column; the lanes meet at the end and the split stores its (m, s, best, column) at [row, split].
    One Philox call (tl.rand4x) draws the four quarters' uniforms: the generator's rounds cost more than the rest of
    the work on an element. The draws depend on (seed + row, column) only, not on the splits."""
    Q: tl.constexpr = BLOCK // 4
    row, split = tl.program_id(0), tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride
    lanes = tl.arange(0, Q)
    m = tl.full((Q,), float("-inf"), tl.float32)
    s = tl.zeros((Q,), tl.float32)
    best = tl.full((Q,), float("-inf"), tl.float32)
    best_col = tl.zeros((Q,), tl.int32) + V
    end = tl.minimum(V, split * PER + PER)
    for start in range(split * PER, end, BLOCK):
        if GREEDY:  # no draws: the scores are the logits
            u0, u1, u2, u3 = lanes * 0.0, lanes * 0.0, lanes * 0.0, lanes * 0.0
        else:
            u0, u1, u2, u3 = tl.rand4x(seed + row, start // 4 + lanes)
        m, s, best, best_col = _visit(base, start + lanes, end, u0, inv_t, m, s, best, best_col, V, GREEDY)
        m, s, best, best_col = _visit(base, start + Q + lanes, end, u1, inv_t, m, s, best, best_col, V, GREEDY)
        m, s, best, best_col = _visit(base, start + 2 * Q + lanes, end, u2, inv_t, m, s, best, best_col, V, GREEDY)
        m, s, best, best_col = _visit(base, start + 3 * Q + lanes, end, u3, inv_t, m, s, best, best_col, V, GREEDY)
    top = tl.max(m, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    winner = tl.max(best, 0)
    out = row * SPLITS + split
    tl.store(m_ptr + out, top)
    tl.store(s_ptr + out, tl.sum(s * tl.exp(m - shift), 0))
    tl.store(best_ptr + out, winner)
    tl.store(col_ptr + out, tl.min(tl.where(best == winner, best_col, V), 0))


@triton.jit
def sample_combine(logits_ptr, stride, V, m_ptr, s_ptr, best_ptr, col_ptr, SPLITS, tokens_ptr, logp_ptr,
                   SPLITS_PAD: tl.constexpr):
    """One program a row: the token is the lowest column holding the best score over the splits, its log-prob
    logit - log-sum-exp (the splits' sums rescaled to their common max), in fp32."""
    row = tl.program_id(0)
    k = tl.arange(0, SPLITS_PAD)
    ok = k < SPLITS
    at = row * SPLITS + k
    m = tl.load(m_ptr + at, mask=ok, other=float("-inf"))
    s = tl.load(s_ptr + at, mask=ok, other=0.0)
    best = tl.load(best_ptr + at, mask=ok, other=float("-inf"))
    col = tl.load(col_ptr + at, mask=ok, other=V)
    top = tl.max(m, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.where(ok, s * tl.exp(m - shift), 0.0), 0)
    winner = tl.max(best, 0)
    token = tl.min(tl.where(ok & (best == winner), col, V), 0)
    x_tok = tl.load(logits_ptr + row.to(tl.int64) * stride + token).to(tl.float32)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logp_ptr + row, x_tok - shift - tl.log(total))
