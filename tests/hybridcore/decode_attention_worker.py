"""Runs the decode attention kernels (hybridcore/decode_attention.py) under Triton's interpreter in a process of its
own (TRITON_INTERPRET must be set before anything imports triton, and in the test session torch.compile imports it
first); prints JSON for tests/hybridcore/test_decode_attention.py to judge. Importing this module (the test does, for
CASES) imports no triton and sets nothing: main() does."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

B, H, C = 3, 2, 96  # 3 chunks of SMALL's 32 columns
SMALL = dict(chunk=32, block_n=16)  # several chunks and tiles at a size the interpreter runs in about a second
# (query heads a KV head, head_dim, dtype, filled): filled 45 ends inside a chunk and inside a tile, 1 is the first
# column alone, 96 the whole cache
CASES = [(g, d, dtype, filled) for g, d, dtype, runs in [
    (1, 64, "float32", (1, 45, 96)), (4, 128, "bfloat16", (1, 45, 96)), (6, 64, "bfloat16", (45,)),
    (6, 128, "float32", (45, 96)), (4, 64, "float32", (45,))] for filled in runs]


def inputs(g: int, d: int, dtype: str, filled: int, capacity: int = C, seed: int = 0):
    """Random q, k, v; row 0 attends everywhere, row 1 is left-padded past its first chunk (chunk 0 all masked,
    chunk 1 half), row 2 has a 5-column hole; columns from `filled` on are NaN in k and v and True in the mask, so
    any read of them shows."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1000 * g + d + filled)
    q = torch.randn(B, H, g, d, generator=gen).to(getattr(torch, dtype))
    k, v = (torch.randn(B, H, capacity, d, generator=gen).to(q.dtype) for _ in range(2))
    k[:, :, filled:], v[:, :, filled:] = float("nan"), float("nan")
    mask = torch.ones(B, capacity, dtype=torch.bool)
    mask[1, :40], mask[2, 3:8] = False, False
    return q, k, v, mask, torch.tensor([filled])


def error(got, q, k, v, mask, filled) -> float:
    """Max |got - reference| relative to the max |reference|; -1 for a wrong shape or dtype or a NaN."""
    from hybridcore import decode_attention

    ref = decode_attention.reference(q, k, v, mask, filled, q.shape[-1] ** -0.5)
    if got.shape != q.shape or got.dtype != q.dtype or bool(got.isnan().any()):
        return -1.0
    return float((got.float() - ref).abs().max() / ref.abs().max())


def main() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from hybridcore import decode_attention

    out = {"err": {}}
    for g, d, dtype, filled in CASES:
        args = inputs(g, d, dtype, filled)
        out["err"][f"{g}-{d}-{dtype}-{filled}"] = error(decode_attention.launch(*args, d ** -0.5, **SMALL), *args)
    args = inputs(6, 128, "bfloat16", 150, capacity=160)  # default tiles: 2 chunks of 128, the second part-filled
    out["err"]["defaults"] = error(decode_attention.attend(*args, 128 ** -0.5), *args)
    q, k, v, mask, filled = inputs(4, 64, "float32", 45)
    got = decode_attention.launch(q, k, v, mask, filled, 0.125, **SMALL)
    scalar = decode_attention.launch(q, k, v, mask, filled.to(torch.int32).reshape(()), 0.125, **SMALL)
    out["int32_scalar_filled"] = float((scalar - got).abs().max())
    q, k, v, mask, filled = inputs(4, 64, "float32", 1)  # row 1's one column is masked
    out["masked_row"] = float(decode_attention.launch(q, k, v, mask, filled, 0.125, **SMALL)[1].abs().max())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
