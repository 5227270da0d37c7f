"""The one-pass sampler's Triton kernel (hybridcore/sampling.py; imported on first use, so that importing the
sampler imports no triton)."""
import triton
import triton.language as tl


@triton.jit
def _exponential(seed, idx):
    """Exp(1) draws for the columns idx of one row: -log(1 - u), u ~ U[0, 1) from Philox; below u = 1e-4 the series
    u + u^2 / 2 (1 - u would round away u's low bits), and u = 0 clamped to 2^-33."""
    u = tl.rand(seed, idx)
    e = tl.where(u < 1e-4, u + 0.5 * u * u, -tl.log(1.0 - u))
    return tl.maximum(e, 1.1641532182693481e-10)


@triton.jit(do_not_specialize=["seed"])
def sample_kernel(logits_ptr, stride, V, seed, inv_t, tokens_ptr, logp_ptr, GREEDY: tl.constexpr,
                  BLOCK: tl.constexpr):
    """One program a row: lane-wise running max m and sum s of exp(logit - m) (the raw logits' log-sum-exp), and
    the best score with its first column; score = logit (GREEDY) or logit * inv_t - log(E). Lanes meet at the end:
    the token is the lowest column holding the best score, its log-prob logit - m - log(s)."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    cols = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_col = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)  # a lane that has seen only -inf keeps s = 0
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = new_m
        if GREEDY:
            score = x
        else:
            score = x * inv_t - tl.log(_exponential(seed + row, idx))
            score = tl.where(idx < V, score, float("-inf"))
        better = score > best  # strict: a lane keeps its first column among equal scores
        best = tl.where(better, score, best)
        best_col = tl.where(better, idx, best_col)
    top = tl.max(m, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(s * tl.exp(m - shift), 0)
    winner = tl.max(best, 0)
    token = tl.min(tl.where(best == winner, best_col, V), 0)
    token = tl.where(token >= V, 0, token)  # every score -inf (no lane better than its start): column 0, as argmax
    x_tok = tl.load(base + token).to(tl.float32)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logp_ptr + row, x_tok - shift - tl.log(total))
