"""The decode attention's two kernels (hybridcore/decode_attention.py) with their default tiles, compiled for an H100
(sm_90, down to its cubin) on this CPU machine, with the arguments `launch` gives them at the rollout's decode shapes:
bf16 with 6 query heads a KV head (Qwen2.5-1.5B), fp32 with one (the exact products), fp16 with 20 (G padded to
32) at head_dim 256. Triton's interpreter (test_decode_attention.py) runs the kernels as Python and accepts code the
compiler refuses (see test_nf4_compile.py), so each kernel is compiled here too; the venv's Triton can be newer
than the GPU machine's."""
import torch
import triton  # `make setup` installs it (CPU torch does not bring it)
from triton.backends.compiler import GPUTarget

from hybridcore import decode_attention
from tests.hybridcore.test_nf4_compile import POINTER, Recorder, failure

POINTER = {**POINTER, torch.int64: "*i64"}
# (batch, KV heads, query heads a KV head, head_dim, capacity, dtype)
LAUNCHES = [(4, 2, 6, 128, 512, torch.bfloat16), (2, 4, 1, 64, 256, torch.float32),
            (2, 1, 20, 256, 128, torch.float16)]


def compile_launch(fn, args, kwargs) -> None:
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    constexprs = {p.name for p in fn.params if p.is_constexpr}
    signature, values = {}, dict(zip(fn.arg_names, args))
    for name in fn.arg_names:
        value = values.get(name)
        signature[name] = ("constexpr" if name in constexprs else POINTER[value.dtype]
                           if isinstance(value, torch.Tensor) else "fp32" if isinstance(value, float) else "i32")
    triton.compile(triton.compiler.ASTSource(fn, signature, kwargs), target=GPUTarget("cuda", 90, 32),
                   options=options)


def test_both_kernels_compile_for_sm90(monkeypatch):
    from hybridcore import decode_attention_kernels

    recorded, failures = [], []
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while unset; 1 is its (and 3.6's) default
    monkeypatch.setattr(decode_attention, "_kernel",
                        lambda name: Recorder(getattr(decode_attention_kernels, name), recorded))
    for B, H, G, D, C, dtype in LAUNCHES:
        q, k = torch.zeros(B, H, G, D, dtype=dtype), torch.zeros(B, H, C, D, dtype=dtype)
        decode_attention.attend(q, k, k, torch.ones(B, C, dtype=torch.bool), torch.tensor([C // 2]), D ** -0.5)
        assert [fn.fn.__name__ for fn, *_ in recorded] == ["attention_partials", "attention_combine"]
        for fn, args, kwargs in recorded:
            try:
                compile_launch(fn, args, kwargs)
            except Exception as e:  # noqa: BLE001 -- every failing launch is reported, not just the first
                failures.append(failure(f"{fn.fn.__name__} G {G}, D {D}, {dtype}", e))
        recorded.clear()
    assert not failures, "\n".join(failures)
