"""A decode step's token and its log-probability in one pass over the logits (the native rollout's sampler).

The plain torch sampler reads a step's logits [B, V] many times: a cast to fp32, the temperature, a softmax,
torch.multinomial, then a log-softmax of the fp32 copy for the sampled token's log-probability (what PPO compares
with training's). At the Qwen2.5-1.5B shape, batch 256 x 151,936 logits (78 MB in bf16), a decode step took 4.5 ms in
the rollout against 3.85 ms of graph replay (bench/RESULTS.md 2026-12-07 03:41), most of the gap this work; through
`draw` 4.15 ms greedy and 4.29 sampled at T = 1, against torch's 4.50 and 5.30 in the same run (07:36). `draw` does it
in two Triton kernels: programs over (row, split of the vocabulary) read each logit once and keep, per lane, a
running max and sum (the log-sum-exp of the raw logits) and the best score so far; one program a row meets its
splits:

- sampling is the exponential race (equivalently Gumbel-max): token = argmax(logit / T - log E), E ~ Exp(1) drawn
  per logit from Philox (tl.rand4x: four a call), an exact draw from softmax(logit / T), which is what
  torch.multinomial samples; E = -log(1 - u) is formed so that small u keeps its precision (u < 1e-4: u + u^2 / 2),
  so only u = 0 (odds 2^-31 a logit) is clamped, to E = 2^-33;
- greedy (or temperature 0) is the first index of the largest logit, as torch.argmax;
- the log-probability is the token's raw logit minus the log-sum-exp, in fp32: the model's own softmax, before
  temperature, as training computes it.

The draws come from torch's default CPU generator (one int a call), so torch.manual_seed makes a rollout repeat;
the stream differs from torch.multinomial's, the law does not. top-k / top-p need a sort: those calls, and devices
the kernel cannot run on, take the torch path (`sample` + log_softmax), which is also the tests' reference. On a
CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1 before triton is first imported:
tests/hybridcore/sampling_worker.py runs in a process of its own for that).
"""
from __future__ import annotations

import functools
import warnings

import torch

from hybridcore.triton_device import runs_on

# 1,024 logits a step of a program, 4 programs an SM at least: the figures above; block and split not tuned
DEFAULTS = dict(block=1024, num_warps=4, programs_per_sm=4)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_BROKEN: str | None = None  # why the kernel failed in this process, once it has (then every call takes torch's path)


def fused_applies(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> bool:
    """Whether `draw` takes the one-pass kernel for these logits and truncation (else the torch path)."""
    return (logits.dim() == 2 and logits.dtype in FLOATS and runs_on(logits.device)
            and not 0 < top_k < logits.shape[-1] and top_p >= 1.0)


def draw(logits: torch.Tensor, greedy: bool = False, temperature: float = 1.0, top_k: int = 0,
         top_p: float = 1.0, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], their log-probabilities fp32 [B]) for logits [B, V]. fused: None takes the kernel where
    `fused_applies` (and, should it fail to build, warns once and takes torch's path from then on), True requires
    it (an error naming why not), False is the torch path."""
    global _BROKEN
    auto = fused is None
    if auto:
        fused = _BROKEN is None and fused_applies(logits, top_k, top_p)
    elif fused and not fused_applies(logits, top_k, top_p):
        raise ValueError(f"sampling: the fused sampler takes 2-D float logits on CUDA (or under Triton's "
                         f"interpreter) without top-k / top-p; got {tuple(logits.shape)} {logits.dtype} on "
                         f"{logits.device}, top_k={top_k}, top_p={top_p}")
    if fused:
        try:
            return _fused(logits, greedy or temperature == 0, temperature)
        except Exception as e:  # noqa: BLE001 -- a Triton that cannot build the kernel here: the torch path
            if not auto:
                raise
            first = str(e).strip().splitlines()
            _BROKEN = f"{type(e).__name__}: {first[0] if first else ''}"
            warnings.warn(f"sampling: the fused sampler failed ({_BROKEN}); sampling with torch from now on",
                          RuntimeWarning, stacklevel=2)
    tokens = sample(logits, greedy, temperature, top_k, top_p)
    return tokens, torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None]).squeeze(1)


def truncate(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """The candidates a sampler draws from, in transformers' order: temperature, top-k, top-p.

    Returns (logits, idx): the scaled logits of the candidates, -inf where top-p dropped one, and their
    vocabulary ids (None when the candidates are the whole vocabulary in order). top_k=0 and top_p=1 are
    off. With top-k on, top-p works on the k candidates only, so a full-vocabulary sort happens only for
    top-p alone.
    """
    if temperature != 1.0:
        logits = logits / temperature
    idx = None
    if 0 < top_k < logits.shape[-1]:
        logits, idx = logits.topk(top_k, dim=-1)  # sorted, largest first
    elif top_p < 1.0:
        logits, idx = logits.sort(dim=-1, descending=True)
    if top_p < 1.0:
        probs = logits.softmax(-1)
        above = probs.cumsum(-1) - probs  # mass of the more probable candidates
        logits = logits.masked_fill(above >= top_p, float("-inf"))  # the top candidate always stays
    return logits, idx


def sample(logits: torch.Tensor, greedy: bool = False, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0) -> torch.Tensor:
    """One token per row of logits [B, V] (drawn in float32); temperature 0 or greedy is argmax."""
    if greedy or temperature == 0:
        return logits.argmax(-1)
    logits, idx = truncate(logits.float(), temperature, top_k, top_p)
    choice = torch.multinomial(logits.softmax(-1), 1)
    return (choice if idx is None else idx.gather(1, choice)).squeeze(1)


def splits(rows: int, vocab: int, device: torch.device) -> int:
    """Programs a row's vocabulary is split among: enough for PROGRAMS_PER_SM programs on every SM (a decode batch
    of 8 rows would otherwise keep 8 SMs busy), at least a block of columns each."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    blocks = -(-vocab // DEFAULTS["block"])
    return max(1, min(blocks, -(-DEFAULTS["programs_per_sm"] * sms // max(rows, 1))))


@functools.cache
def _sm_count(index: int) -> int:
    """The device's SMs, asked once (splits runs every decode step)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _fused(logits: torch.Tensor, greedy: bool, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    from hybridcore.sampling_kernel import sample_combine, sample_partials

    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, logp
    seed = 0 if greedy else int(torch.randint(0, 2**31 - 1 - rows, (1,)).item())
    block, n = DEFAULTS["block"], splits(rows, vocab, logits.device)
    per = -(-vocab // (n * block)) * block  # columns a split: whole blocks
    n = -(-vocab // per)  # every split holds at least one column
    parts = torch.empty(3, rows, n, dtype=torch.float32, device=logits.device)
    cols = torch.empty(rows, n, dtype=torch.int32, device=logits.device)
    sample_partials[(rows, n)](logits, logits.stride(0), vocab, per, seed, 1.0 / (temperature or 1.0), parts[0],
                               parts[1], parts[2], cols, n, GREEDY=greedy, BLOCK=block,
                               num_warps=DEFAULTS["num_warps"])
    sample_combine[(rows,)](logits, logits.stride(0), vocab, parts[0], parts[1], parts[2], cols, n, tokens, logp,
                            SPLITS_PAD=max(16, 1 << (n - 1).bit_length()), num_warps=1)
    return tokens, logp
