"""The fused NF4 kernels (hybridcore/nf4.py) under Triton's interpreter, against NF4Weight.dequantize (itself held
equal to bitsandbytes' dequantisation) followed by a plain fp32 matmul, on random NF4 weights: every configuration
bench/nf4_decode.py times, at batches 1 to 64. The kernels run in a process of their own (nf4_worker.py):
TRITON_INTERPRET only takes effect when set before triton is first imported."""
from pathlib import Path

import pytest

from tests.hybridcore.interpreted import run_interpreted

from tests.hybridcore.nf4_worker import CASES, GROUPS, KERNEL_CONFIGS, LORA, PLAIN

WORKER = Path(__file__).with_name("nf4_worker.py")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(WORKER)


@pytest.mark.parametrize("which", ["True", "False", "cases"])
def test_reference_dequantisation_equals_bitsandbytes(results, which):
    """The nibble order (even column = high nibble), the code and the absmax blocks as bitsandbytes has them, with
    and without double quantisation, and for the weight of the kernel cases."""
    assert results["dequant_equal"][which] is True


@pytest.mark.parametrize("name, m, dtype", CASES)
def test_fused_matmul_equals_dequantise_then_matmul(results, name, m, dtype):
    """Odd N (partial tiles), K of 3 quantisation blocks (a part-empty last step for block_k 128 and 256; split-K with
    every reduction), batches inside, at and past a program's rows. Max |error| relative to the max |reference|:
    fp32 x is summed in another order only; bf16 x adds the output's rounding (the interpreter truncates: up to an
    ulp, 2**-7) and, in dot, the levels rounded to bf16. -1: wrong shape or dtype."""
    err = results["matmul_err"][f"{name}-{m}-{dtype}"]
    assert 0 <= err <= (1e-5 if dtype == "float32" else 2e-2), (KERNEL_CONFIGS[name], err)


def test_double_quantised_absmax_is_read_in_place(results):
    """from_bnb keeps bitsandbytes' uint8 absmax codes (the kernels resolve them per block: no fp32 copy held) and an
    fp32 absmax where there is no double quantisation."""
    assert results["absmax_uint8"] is True and results["absmax_float32"] is True


@pytest.mark.parametrize("case", [f"{name}-{m}" for name, m in PLAIN])
def test_fused_matmul_with_a_plain_absmax(results, case):
    """The kernels' path for an fp32 absmax (a weight quantised without double quantisation), fp32 x."""
    assert 0 <= results["plain_err"][case] <= 1e-5


@pytest.mark.parametrize("kernel, m, r, dtype, split", LORA)
def test_fused_matmul_adds_a_lora_delta(results, kernel, m, r, dtype, split):
    """matmul(lora=(x @ A^T, B, scale)) equals x @ W^T + (x @ A^T @ B^T) * scale: in pair_dot's and nibble_dot's
    epilogue (ranks below 16 padded, split K adding the delta once), after the other kernels."""
    err = results["lora_err"][f"{kernel}-{m}-r{r}-{dtype}-split{split}"]
    assert 0 <= err <= (1e-5 if dtype == "float32" else 2e-2), err


@pytest.mark.parametrize("kernel", ["gemv", "dot", "scaled_dot", "pair_dot", "nibble_dot", "pair_dot2", "nibble_dot2"])
@pytest.mark.parametrize("split", [5, 10])
def test_many_splits_meet_in_the_kernel(results, kernel, split):
    """K split 5 and 10 ways: the last split's program adds every partial (its loads unrolled four a turn). fp32 x:
    the sum's order only."""
    assert 0 <= results["split_err"][f"{kernel}-split{split}"] <= 1e-5


@pytest.mark.parametrize("case", range(len(GROUPS)), ids=[f"{g[0]}-{g[1]}-{g[2]}" for g in GROUPS])
def test_weights_sharing_an_input_in_one_launch(results, case):
    """group_matmul equals each member's x @ W^T (+ its LoRA delta, u sliced out of one product) side by side: in one
    launch for the LUT kernels (three members or two, a partial last tile, block_n shrunk to divide the members'
    rows, K split or not, plain or double-quantised absmax), one launch a member where a tile would straddle two
    members (37 rows) or the kernel has no groups (dot)."""
    kernel, _, rows, *_, dtype, _ = GROUPS[case]
    err, launches = results["group"][str(case)]
    one = kernel != "dot" and rows[0] % 16 == 0
    assert launches == (1 if one else len(rows))
    assert 0 <= err <= (1e-5 if dtype == "float32" else 2e-2), err


def test_split_counters_left_at_zero(results):
    """The in-kernel split reduction's counters are zero again after every call that used them."""
    assert results["counters_zero"] is True


def test_leading_dimensions(results):
    assert 0 <= results["leading_err"] <= 1e-5


@pytest.mark.parametrize("call, message", [
    ("features", "takes 128"), ("whole_blocks", "not whole quantisation blocks"), ("block_k", "not a multiple"),
    ("kernel", "expected 'gemv', 'dot'"), ("dot_block_n", "block_n 8, expected a power of two >= 16"),
    ("reduce", "reduce 'tree'"),
    ("lookup", "lookup 'gather'"), ("split_k", "split_k 0"), ("dtype", "expected a float dtype"),
    ("vec", "vec 32, expected a power of two from 4 to 16"), ("lut_lookup", "lookup 'select': pair_dot has its own"),
    ("lora_b", "lora_b is (8, 64), expected (64, 8)"), ("lora_u", "expected x's rows (2,)"),
    ("lora_scale", "one-element float32")])
def test_bad_calls_are_refused(results, call, message):
    assert message in results["bad_calls"][call]
