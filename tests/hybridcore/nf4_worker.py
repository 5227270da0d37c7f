"""Runs the fused NF4 kernel's cases under Triton's interpreter in a process of its own (TRITON_INTERPRET must be
set before anything imports triton, and in the test session torch.compile imports it first); prints JSON for
tests/hybridcore/test_nf4.py to judge."""
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import bitsandbytes.functional as bnbf  # noqa: E402
import torch  # noqa: E402

from hybridcore import nf4  # noqa: E402

MATMULS = [(1, 64, 256, 1), (5, 80, 192, 1), (17, 96, 320, 1), (3, 64, 448, 2), (2, 48, 576, 3)]


class Packed:
    """What NF4Weight.from_bnb reads of a Params4bit: the packed bytes and their quant_state."""

    def __init__(self, w: torch.Tensor, nested: bool):
        self.data, self.quant_state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                                         compress_statistics=nested)


def weight(n: int, k: int, seed: int, nested: bool = True):
    g = torch.Generator().manual_seed(seed)
    packed = Packed(torch.randn(n, k, generator=g) * 0.05, nested)
    return nf4.NF4Weight.from_bnb(packed), bnbf.dequantize_4bit(packed.data, packed.quant_state)


def main() -> None:
    out = {"dequant_equal": {}, "matmul_err": {}}
    for nested in (True, False):
        w, want = weight(96, 192, seed=0, nested=nested)
        out["dequant_equal"][str(nested)] = bool(torch.equal(w.dequantize(), want))
    for m, n, k, split in MATMULS:
        w, whole = weight(n, k, seed=m)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m))
        for lookup in ("select", "table"):
            got = nf4.matmul(x, w, split_k=split, lookup=lookup)
            ok = got.shape == (m, n) and got.dtype == x.dtype
            out["matmul_err"][f"{m}-{n}-{k}-{split}-{lookup}"] = float((got - x @ whole.T).abs().max()) if ok else -1
    w, whole = weight(64, 128, seed=3)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(4))
    out["leading_err"] = float((nf4.matmul(x, w) - x @ whole.T).abs().max())
    try:
        nf4.matmul(torch.randn(2, 64), w)
        out["bad_shape"] = ""
    except ValueError as e:
        out["bad_shape"] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
