"""The fused NF4 kernel (hybridcore/nf4.py) under Triton's interpreter, against bitsandbytes' own dequantisation
followed by a plain matmul, on random NF4 weights."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is built: run it on the CPU

import bitsandbytes.functional as bnbf  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from hybridcore import nf4  # noqa: E402


class Packed:
    """What NF4Weight.from_bnb reads of a Params4bit: the packed bytes and their quant_state."""

    def __init__(self, w: torch.Tensor, nested: bool):
        self.data, self.quant_state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                                         compress_statistics=nested)


def weight(n: int, k: int, seed: int, nested: bool = True):
    g = torch.Generator().manual_seed(seed)
    packed = Packed(torch.randn(n, k, generator=g) * 0.05, nested)
    return nf4.NF4Weight.from_bnb(packed), bnbf.dequantize_4bit(packed.data, packed.quant_state)


@pytest.mark.parametrize("nested", [True, False])
def test_reference_dequantisation_equals_bitsandbytes(nested):
    """The nibble order (even column = high nibble), the code and the absmax blocks as bitsandbytes has them."""
    w, want = weight(96, 192, seed=0, nested=nested)
    assert torch.equal(w.dequantize(), want)


@pytest.mark.parametrize("lookup", ["select", "table"])
@pytest.mark.parametrize("m, n, k, split_k", [(1, 64, 256, 1), (5, 80, 192, 1), (17, 96, 320, 1),
                                             (3, 64, 448, 2), (2, 48, 576, 3)])
def test_fused_matmul_equals_dequantise_then_matmul(m, n, k, split_k, lookup):
    """Batches across the 16-row tile, N past a 32-wide block, K past a 128-wide chunk (masks on every edge), K
    split among programs that add into one output."""
    w, whole = weight(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m))
    got = nf4.matmul(x, w, split_k=split_k, lookup=lookup)
    torch.testing.assert_close(got, x @ whole.T, rtol=0, atol=1e-5)
    assert got.shape == (m, n) and got.dtype == x.dtype


def test_leading_dimensions_and_bad_shapes():
    w, whole = weight(64, 128, seed=3)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(nf4.matmul(x, w), x @ whole.T, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="takes 128"):
        nf4.matmul(torch.randn(2, 64), w)
