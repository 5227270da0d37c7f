"""The one-pass sampler's kernel (hybridcore/sampling_kernel.py) with its default block, compiled for an H100 (sm_90,
down to its cubin) on this CPU machine: greedy and sampled, bf16 / fp16 / fp32 logits, as `sampling._fused` launches
it. Triton's interpreter (test_sampling.py) runs it as Python and accepts code the compiler refuses (Philox, the
lane reductions), so it is compiled here too."""
import pytest
import torch

from hybridcore import sampling
from tests.hybridcore.test_decode_attention_compile import POINTER, compile_launch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("greedy", [True, False])
def test_sampler_compiles_for_sm90(monkeypatch, dtype, greedy):
    """Both kernels as `sampling._fused` launches them at the 1.5B rollout's vocabulary (151,936)."""
    from hybridcore.sampling_kernel import sample_combine, sample_partials

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while unset; 1 is its (and 3.6's) default
    assert dtype in POINTER
    logits, n = torch.zeros(4, 151936, dtype=dtype), 37
    parts, cols = torch.zeros(3, 4, n), torch.zeros(4, n, dtype=torch.int32)
    compile_launch(sample_partials, (logits, logits.stride(0), logits.shape[1], 4096, 12345, 1.0 / 0.7, parts[0],
                                     parts[1], parts[2], cols, n),
                   dict(GREEDY=greedy, BLOCK=sampling.DEFAULTS["block"], num_warps=sampling.DEFAULTS["num_warps"]))
    compile_launch(sample_combine, (logits, logits.stride(0), logits.shape[1], parts[0], parts[1], parts[2], cols, n,
                                    torch.zeros(4, dtype=torch.int64), torch.zeros(4)),
                   dict(SPLITS_PAD=64, num_warps=1))
