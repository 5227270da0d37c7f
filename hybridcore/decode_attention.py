"""Flash-decoding attention over the native rollout's static KV cache: a decode step reads only the filled columns.

The cache is [B, kv_heads, capacity, head_dim], allocated for the prompt and every new token, and SDPA with a mask
reads all `capacity` columns at every step, written or not; a decode step is bound by the bytes it reads, so early
in a rollout most of its attention time goes to empty columns. `attend` splits the columns into fixed chunks, one
Triton program per (row, KV head, chunk) taking all the query heads that share the KV head (each K/V tile read once
for the group); a chunk at or past `filled` (a device tensor) returns at once, so the work follows the filled
length, and a second kernel merges each head's chunks (max, sum, accumulator: fp32). The grid follows the shapes,
never `filled`, and nothing waits on the host, so a CUDA graph captured once replays it while `filled` advances.

torch.compile sees it as one custom op (`torch.ops.hybridcore.decode_attention`), as fused_decode.py does the NF4
kernel: traced into, the launcher's Python would break the compiled decode step. DEFAULTS were timed by
bench/decode_attention.py on an H100. `reference` is the plain-torch attention the tests hold the kernels to, and
`self_check` what the rollout runs before it decodes through them (it falls back to SDPA where that fails). On a
CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1 set before triton is first imported:
tests/hybridcore/decode_attention_worker.py runs in a process of its own for that), which is how CI tests them.
"""
from __future__ import annotations

import functools

import torch

# partials: 128 columns a program in tiles of 64 (at the Llama-3-8B decode shape, 8 rows x 8 KV heads, a cache
# filled to 1,536 columns keeps 768 programs at work, ~6 an H100 SM); combine: 16 chunks a step (one step up to
# 2,048 columns). Within 5 % of the best of bench/decode_attention.py's 14 configs on an H100 at the 1.5B and 8B
# decode shapes (bench/RESULTS.md 2026-12-06 21:52)
DEFAULTS = {"partials": dict(chunk=128, block_n=64, num_warps=4, num_stages=2),
            "combine": dict(block_c=16, num_warps=2)}
HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two: tl.arange over D; 16 is tl.dot's smallest side
MAX_GROUP = 64  # query heads per KV head, padded to a power of two >= 16 (tl.dot's rows)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def unsupported(head_dim: int, group: int) -> str | None:
    """Why the kernels cannot take heads of `head_dim` with `group` query heads per KV head, or None if they can."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim}, expected a power of two from 16 to 256"
    if not 1 <= group <= MAX_GROUP:
        return f"{group} query heads per KV head, expected 1 to {MAX_GROUP}"
    return None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, filled: torch.Tensor,
           scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v over the columns c < filled with mask[b, c] True, fp32 accumulation, default tiles.

    q [B, Hkv, G, D]: the G query heads sharing each KV head (one decode token); k, v [B, Hkv, C, D]: the static
    cache; mask [B, C] bool; filled: an int tensor of one element on the device, the columns written so far
    (columns past it are never read); returns [B, Hkv, G, D] in q's dtype (0 for a row with no column to attend).
    One node to torch.compile."""
    return decode_attention_op(q, k, v, mask, filled, float(scale))


def launch(q, k, v, mask, filled, scale: float, chunk: int | None = None, block_n: int | None = None,
           num_warps: int | None = None, num_stages: int | None = None, block_c: int | None = None,
           combine_warps: int | None = None) -> torch.Tensor:
    """attend with explicit tiles (unset ones from DEFAULTS): `chunk` columns a program in tiles of `block_n`, the
    combine taking `block_c` chunks at a time. Two launches on partial buffers whose shapes follow C, not filled."""
    import triton

    cfg = _config(chunk=chunk, block_n=block_n, num_warps=num_warps, num_stages=num_stages, block_c=block_c,
                  combine_warps=combine_warps)
    _check(q, k, v, mask, filled, cfg)
    q = q if q.stride(-1) == 1 else q.contiguous()
    mask = (mask if mask.stride(-1) == 1 else mask.contiguous()).view(torch.uint8)
    (B, H, G, D), C = q.shape, k.shape[2]
    chunks = triton.cdiv(C, cfg["chunk"])
    m = torch.empty((B * H, chunks, G), dtype=torch.float32, device=q.device)
    l_ = torch.empty_like(m)
    acc = torch.empty((B * H, chunks, G, D), dtype=torch.float32, device=q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    partials, combine = _kernel("attention_partials"), _kernel("attention_combine")
    upcast = type(partials).__name__ == "InterpretedFunction"  # see attention_partials' UPCAST
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"  # fp32 q: full-precision products
    partials[(B * H, chunks)](
        q, k, v, mask, filled, m, l_, acc, scale, G, H, C, chunks, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        mask.stride(0), D=D, G_PAD=max(16, triton.next_power_of_2(G)), CHUNK=cfg["chunk"], BLOCK_N=cfg["block_n"],
        PRECISION=precision, UPCAST=upcast, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    combine[(B * H * G,)](m, l_, acc, filled, out, G, H, C, chunks, *out.stride()[:3], D=D, CHUNK=cfg["chunk"],
                          BLOCK_C=min(cfg["block_c"], triton.next_power_of_2(chunks)), num_warps=cfg["combine_warps"])
    return out


@torch.library.custom_op("hybridcore::decode_attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor filled, float scale) -> Tensor")
def decode_attention_op(q, k, v, mask, filled, scale):
    """launch with its default tiles (what a custom op can take)."""
    return launch(q, k, v, mask, filled, scale)


@decode_attention_op.register_fake
def _(q, k, v, mask, filled, scale):
    _check(q, k, v, mask, filled, _config())  # a bad shape is refused while compiling, by the same message
    return q.new_empty(q.shape)


@functools.cache
def self_check(head_dim: int, group: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """None if the kernels run and match `reference` on a small random input of these heads on `device` (two
    chunks, the second part-filled, a masked hole), else what went wrong, in one line. Once per process and shape:
    the rollout checks before it decodes through them, so a Triton that builds them differently on some GPU costs
    a warning and SDPA's speed, not a failed or silently wrong run."""
    chunk = DEFAULTS["partials"]["chunk"]
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(2, 1, group, head_dim, device=device, generator=gen).to(dtype)
        k, v = (torch.randn(2, 1, 2 * chunk, head_dim, device=device, generator=gen).to(dtype) for _ in range(2))
        mask = torch.ones(2, 2 * chunk, dtype=torch.bool, device=device)
        mask[1, :5] = False
        filled = torch.tensor([chunk + 3], device=device)
        ref = reference(q, k, v, mask, filled, head_dim ** -0.5)
        err = float((attend(q, k, v, mask, filled, head_dim ** -0.5).float() - ref).abs().max() / ref.abs().max())
    except Exception as e:  # noqa: BLE001 -- any failure to build or run the kernels is the answer
        first = str(e).strip().splitlines()
        return f"{type(e).__name__}: {first[-1][:300] if first else ''}"
    return None if err < 2e-2 else f"its output is {err:.3g} off the reference (relative), expected < 0.02"


def reference(q, k, v, mask, filled, scale: float) -> torch.Tensor:
    """The same attention in plain torch and fp32 (reads `filled` on the host): what the kernels are held to."""
    n = int(filled.reshape(-1)[0])
    s = torch.einsum("bhgd,bhcd->bhgc", q.float(), k[:, :, :n].float()) * scale
    s = s.masked_fill(~mask[:, None, None, :n], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row with every column masked: 0, as the kernels give
    return torch.einsum("bhgc,bhcd->bhgd", p, v[:, :, :n].float())


def _config(**given) -> dict:
    p, c = DEFAULTS["partials"], DEFAULTS["combine"]
    cfg = {**p, "block_c": c["block_c"], "combine_warps": c["num_warps"]}
    return {**cfg, **{key: v for key, v in given.items() if v is not None}}


def _check(q, k, v, mask, filled, cfg) -> None:
    """The ValueErrors of attend: everything the kernels assume about shapes, dtypes and tiles."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"decode_attention.attend: q, k, v have {q.dim()}, {k.dim()}, {v.dim()} dimensions, "
                         "expected 4: q [B, Hkv, G, D], k and v [B, Hkv, C, D]")
    B, H, G, D = q.shape
    C = k.shape[2]
    pow2 = lambda x, low: isinstance(x, int) and x >= low and x & (x - 1) == 0  # noqa: E731
    problems = [
        (k.shape != v.shape or k.shape[:2] != (B, H) or k.shape[3] != D,
         f"k {tuple(k.shape)} and v {tuple(v.shape)} for q {tuple(q.shape)}, expected both [{B}, {H}, C, {D}]"),
        (unsupported(D, G) is not None, unsupported(D, G)),
        (q.dtype not in FLOATS or k.dtype != q.dtype or v.dtype != q.dtype,
         f"q, k, v are {q.dtype}, {k.dtype}, {v.dtype}; expected one of float32, bfloat16, float16 for all three"),
        (k.stride(-1) != 1 or v.stride(-1) != 1, "k or v is strided along head_dim, expected contiguous rows"),
        (mask.dtype != torch.bool or tuple(mask.shape) != (B, C),
         f"mask is {mask.dtype} {tuple(mask.shape)}, expected torch.bool ({B}, {C})"),
        (filled.numel() != 1 or filled.dtype not in (torch.int32, torch.int64),
         f"filled is {filled.dtype} of {filled.numel()} elements, expected one int32 or int64"),
        (len({t.device for t in (q, k, v, mask, filled)}) > 1, "the tensors are on several devices, expected one"),
        (not pow2(cfg["block_n"], 16), f"block_n {cfg['block_n']}, expected a power of two >= 16"),
        (not isinstance(cfg["chunk"], int) or cfg["chunk"] <= 0
         or pow2(cfg["block_n"], 16) and cfg["chunk"] % cfg["block_n"] != 0,
         f"chunk {cfg['chunk']}, expected a positive multiple of block_n {cfg['block_n']}"),
        (not pow2(cfg["block_c"], 1), f"block_c {cfg['block_c']}, expected a power of two"),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(f"decode_attention.attend: {message}")


@functools.cache
def _kernel(name: str):
    """Imported on first use, so TRITON_INTERPRET can be set by then (and triton is imported only when needed)."""
    from hybridcore import decode_attention_kernels
    return getattr(decode_attention_kernels, name)
