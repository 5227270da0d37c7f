"""Each kernel with its default tiles, compiled for an H100 (sm_90, down to its cubin) on this CPU machine, with the
arguments nf4.matmul launches it with at a decode batch the rollout sends it (bf16, double-quantised absmax, K split
serially, as on the GPU), plus dot's other absmax layout, x dtype and reductions. A compile takes ~3 s of CPU, so
the tile variants bench/nf4_decode.py times are left to the GPU, where one that fails to compile is a row with its
error. Triton's interpreter (test_nf4.py) runs the kernels as Python and accepts code the compiler refuses: on
2026-12-06 a helper with a return in a constexpr branch and another after it (typed uint8 against fp32) passed every
interpreter test and failed every kernel on the GPU. The compiler here is the venv's Triton, which can be newer than
the GPU machine's."""
import torch
import triton  # `make setup` installs it (CPU torch does not bring it)
from triton.backends.compiler import GPUTarget

from hybridcore import nf4
from tests.hybridcore.nf4_worker import weight

N, K = 96, 320  # K: 5 quantisation blocks, a partial last tile for block_k 128, 256 and 512
POINTER = {torch.uint8: "*u8", torch.int32: "*i32", torch.float32: "*fp32", torch.bfloat16: "*bf16",
           torch.float16: "*fp16"}


class Recorder:
    """Stands in for a kernel: `fn[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def compile_launch(fn, args, kwargs, reduce: int) -> None:
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages")}
    constexprs = {p.name for p in fn.params if p.is_constexpr}
    defaults = {p.name: p.default for p in fn.params if p.has_default}
    values = {**defaults, **dict(zip(fn.arg_names, args)), **{k: v for k, v in kwargs.items() if k not in constexprs}}
    kwargs = {k: v for k, v in {**defaults, **kwargs}.items() if k in constexprs}  # defaults: LORA, GROUP
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif values[name] is None:  # an optional pointer left out (nf4_lut_dot's LoRA operands): a constant
            signature[name], kwargs[name] = "constexpr", None
        elif isinstance(values[name], torch.Tensor):
            signature[name] = POINTER[values[name].dtype]
        else:
            signature[name] = "i32"
    # the buffers nf4.matmul allocates for a reduction (on a CPU it did not split, and passed y in their place)
    signature.update({1: {"y_ptr": "*fp32"}, 2: {"part_ptr": "*fp32", "count_ptr": "*i32"}}.get(reduce, {}))
    src = triton.compiler.ASTSource(fn, signature, {**kwargs, "REDUCE": reduce})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


# (kernel, batch, double-quantised absmax, x dtype, split-K reduction: 0 none, 1 atomic, 2 serial, LoRA rank or 0)
# (pair_dot with fp32 x looks up nibbles, with fp16 x builds its pair table in fp16; the LoRA epilogue: fp32 A and
# B as peft keeps them, rank 16 and 8 padded to 16)
LAUNCHES = [("gemv", 2, True, torch.bfloat16, 2, 0), ("dot", 8, True, torch.bfloat16, 2, 0),
            ("scaled_dot", 8, True, torch.bfloat16, 2, 0), ("dot", 16, False, torch.float32, 0, 0),
            ("dot", 64, True, torch.bfloat16, 1, 0), ("pair_dot", 8, True, torch.bfloat16, 2, 0),
            ("nibble_dot", 16, True, torch.bfloat16, 2, 0), ("pair_dot", 16, False, torch.float32, 0, 0),
            ("pair_dot", 8, True, torch.float16, 1, 0), ("nibble_dot", 8, True, torch.bfloat16, 2, 16),
            ("nibble_dot", 8, True, torch.bfloat16, 0, 8), ("pair_dot2", 8, True, torch.bfloat16, 2, 16),
            ("nibble_dot2", 16, True, torch.bfloat16, 2, 0)]


def failure(launch: str, e: Exception) -> str:
    """One line for a launch that did not compile: the compiler's own message (Triton's CompilationError wraps it)."""
    cause = e
    while cause.__cause__ is not None:
        cause = cause.__cause__
    return f"{launch}: {type(cause).__name__}: {str(cause).strip().splitlines()[-1][:300]}"


def test_every_kernel_compiles_for_sm90(monkeypatch):
    recorded, failures, kernel_of = [], [], nf4._kernel
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while unset; 1 is its (and 3.6's) default
    monkeypatch.setattr(nf4, "_kernel", lambda name: Recorder(kernel_of(name), recorded))
    for kernel, m, nested, dtype, reduce, rank in LAUNCHES:
        lora = (torch.zeros(m, rank), torch.zeros(N, rank), torch.ones(1)) if rank else None
        nf4.matmul(torch.zeros(m, K, dtype=dtype), weight(N, K, seed=0, nested=nested)[0], kernel=kernel, lora=lora)
        fn, args, kwargs = recorded.pop()
        kwargs.pop("REDUCE")  # a CPU has one "SM": split_k="auto" split nothing here; on a GPU it does
        try:
            compile_launch(fn, args, kwargs, reduce)
        except Exception as e:  # noqa: BLE001 -- every failing launch is reported, not just the first
            failures.append(failure(f"{kernel} batch {m}, nested {nested}, {dtype}, reduce {reduce}, rank {rank}", e))
    # group_matmul's one launch for three members (q/k/v), each with its LoRA delta
    w = weight(N, K, seed=0)[0]
    nf4.group_matmul(torch.zeros(8, K, dtype=torch.bfloat16), [w, w, w], kernel="nibble_dot",
                     loras=[(torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(N, 16, dtype=torch.bfloat16),
                             torch.ones(1))] * 3)
    fn, args, kwargs = recorded.pop()
    kwargs.pop("REDUCE")
    try:
        compile_launch(fn, args, kwargs, 2)
    except Exception as e:  # noqa: BLE001
        failures.append(failure("nibble_dot, three members, rank 16, ahead 2", e))
    assert {k for k, *_ in LAUNCHES} == set(nf4.KERNELS)
    assert not failures, "\n".join(failures)
