"""CPU: what the main K loop of a fused NF4 kernel (hybridcore/nf4.py) costs per byte of 4-bit weight, read from the
sm_90 code Triton makes of it, so that a GPU call is spent on variants whose counts promise something.

The launch is nf4.matmul's own for a Llama-3-8B linear (bench/nf4_decode.py's shapes), recorded instead of run (as
tests/hybridcore/test_nf4_compile.py records it), with split-K sized for an H100's 132 SMs, and compiled with
triton.compile for GPUTarget("cuda", 90, 32) as that test does, except that the arguments are specialised as
Triton's JIT specialises them on a GPU (pointers and ints divisible by 16 marked so, ints equal to 1 made
constants): vector widths depend on it. The loop is the longest backward branch of the PTX and of the SASS (the
wheel's nvdisasm); counts are per thread and iteration, "per byte" divides by the weight bytes a thread covers in
one iteration (BLOCK_N x BLOCK_K / 2, or x QBLOCK x STEP_BLOCKS / 2 for nf4_lut's, over 32 x num_warps threads).
Two ceilings come
of the SASS counts, each as if nothing else bounded the loop: issue (an SM issues 4 warp-instructions a clock) and
mio (an SM's L1 / shared memory moves 128 bytes a clock: global, shared-memory and ldmatrix loads and stores,
shuffles, at least 4 bytes a thread each; bank conflicts are not seen, nor the bytes a wgmma reads from shared
memory itself). Against 2026-12-06's H100 timings at batch 8 (bench/RESULTS.md, triton 3.6), gemv ran at ~65 % of
its issue ceiling, dot at ~45 % and scaled_dot at ~49 % of their mio ceiling. Registers and local memory (spills)
come from cuobjdump, shared memory from the kernel's metadata.
    python bench/nf4_ptx.py [--kernels gemv dot scaled_dot] [--batches 8 16] [--linears q k gate down] [--json]
    python bench/nf4_ptx.py --kernels scaled_dot --batches 8 --set block_k=256 num_warps=8 --dump /tmp/sd
The compiler is whichever triton is imported (the GPU machine's can be older than the venv's: PYTHONPATH can put
another first). Static counts say what a thread issues, not what it waits for (latency, bandwidth, occupancy).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.nf4_decode import SHAPES  # noqa: E402  (torch and nf4 only, until its GPU code runs)
from hybridcore import nf4  # noqa: E402

SMS = 132  # H100 SXM: split_k="auto" is sized for it
ISSUE_GHZ = 1.755  # an H100 SXM's clock under load (assumed): the issue ceiling below is 4 warp-instructions/clk/SM
# SASS opcode (before its first ".") -> category; the rest are "other" (integer and address arithmetic mostly)
SASS = {"LDG": "ldg", "LDS": "lds", "STS": "sts", "LDSM": "ldsm", "STSM": "sts", "HMMA": "mma", "HGMMA": "mma",
        "F2F": "cvt", "F2FP": "cvt", "I2F": "cvt", "F2I": "cvt", "I2FP": "cvt", "SEL": "sel", "FSEL": "sel",
        "PRMT": "prmt", "BAR": "bar", "SHFL": "shfl", "FMUL": "fp", "FFMA": "fp", "FADD": "fp", "HMUL2": "fp",
        "HFMA2": "fp", "HADD2": "fp", "LEA": "int", "IMAD": "int", "IADD3": "int", "LOP3": "int", "SHF": "int",
        "VIADD": "int", "ISETP": "int", "SGXT": "int", "BMSK": "int", "IABS": "int"}
PTX = [("ld.global", "ldg"), ("ld.shared", "lds"), ("st.shared", "sts"), ("ldmatrix", "ldsm"), ("stmatrix", "sts"),
       ("wgmma.mma_async", "mma"), ("mma", "mma"), ("cvt", "cvt"), ("selp", "sel"), ("prmt", "prmt"),
       ("bar", "bar"), ("shfl", "shfl")]  # first prefix that matches
WIDTH = {".128": 16, ".64": 8, ".U8": 1, ".S8": 1, ".U16": 2, ".S16": 2}  # bytes a thread moves; none of these: 4
MIO = ("LDG", "LDS", "STS", "LDSM", "STSM", "SHFL")  # through an SM's 128-byte/clk L1 / shared memory


class _Recorder:
    """Stands in for a kernel: `fn[grid](*args, **kwargs)` is recorded instead of run."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, grid, args, kwargs))


def record(kernel: str, m: int, n: int, k: int, **given):
    """nf4.matmul's launch of `kernel` for a bf16 [m, k] x and a double-quantised [n, k] weight (empty tensors):
    (fn, grid, args, kwargs)."""
    blocks = n * k // 64
    w = nf4.NF4Weight(torch.empty(n * k // 2, dtype=torch.uint8), torch.empty(blocks, dtype=torch.uint8),
                      torch.empty(16), (n, k), 64, torch.empty(blocks // 256 + 1), torch.empty(256), torch.empty(1))
    launches, saved = [], (nf4._kernel, nf4._sms)
    nf4._kernel = lambda name: _Recorder(saved[0](name), launches)
    nf4._sms = lambda device: SMS
    try:
        nf4.matmul(torch.empty(m, k, dtype=torch.bfloat16), w, kernel=kernel, **given)
    finally:
        nf4._kernel, nf4._sms = saved
    return launches.pop()


def compile_launch(fn, args, kwargs):
    """triton.compile of a recorded launch for sm_90, its arguments specialised as the JIT does on a GPU."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget

    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages")}
    signature, constants, attrs = {}, dict(kwargs), {}
    for i, param in enumerate(fn.params):
        if param.is_constexpr:
            constants.setdefault(param.name, param.default)
            continue
        value = args[i] if i < len(args) else constants.pop(param.name, param.default)  # unpassed: the default
        kind, attr = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize, True)
        if kind == "constexpr":
            constants[param.name] = attr
        attrs[(i,)] = [] if kind == "constexpr" else BaseBackend.parse_attr(attr or "")
        signature[param.name] = kind
    signature.update({p.name: "constexpr" for p in fn.params if p.is_constexpr})
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while unset; 1 is its default
    src = triton.compiler.ASTSource(fn, signature, constants, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _tool(name: str) -> str | None:
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.access(path, os.X_OK) else None


def longest_loop(lines: list, label: str, branch: str) -> list:
    """The lines of the longest backward branch: from the label a branch jumps back to, to the branch."""
    at, best = {}, []
    for i, line in enumerate(lines):
        if m := re.match(label, line):
            at[m.group(1)] = i
        elif (m := re.search(branch, line)) and m.group(1) in at and i - at[m.group(1)] > len(best):
            best = lines[at[m.group(1)]:i + 1]
    return best


def ptx_mix(ptx: str) -> Counter:
    """Per-thread counts of the PTX loop's instructions by category, global loads also by width (ldg.16 = bytes)."""
    body = longest_loop(ptx.splitlines(), r"^(\$L__BB\d+_\d+):", r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
    mix = Counter()
    for line in body:
        op = re.sub(r"^@!?%p\d+\s+", "", line.strip()).split(" ")[0].split("\t")[0]
        if not op or op[0] in "./{}$" or op.startswith("//") or op.endswith(":"):
            continue
        mix["all"] += 1
        cat = next((c for prefix, c in PTX if op.startswith(prefix)), None)
        if cat:
            mix[cat] += 1
        if op.startswith("ld.global"):
            vec = re.search(r"\.v(\d)", op)
            bits = re.search(r"\.[bufs](\d+)$", op)
            mix[f"ldg.{(int(vec.group(1)) if vec else 1) * int(bits.group(1)) // 8 if bits else 0}"] += 1
    return mix


def _width(op: str, suffix: str) -> int:
    """Bytes one thread moves in a SASS memory instruction (LDSM/STSM .4/.2: four/two 8x8 b16 matrices)."""
    if op in ("LDSM", "STSM"):
        return {".4": 16, ".2": 8}.get(suffix[-2:], 4)
    return next((b for s, b in WIDTH.items() if s + "." in suffix + "."), 4)


def sass_mix(cubin: bytes) -> tuple[Counter, dict]:
    """Per-thread counts of the SASS loop's instructions by category (LDG also by width), and cuobjdump's resources
    (REG, LOCAL: bytes of local memory, which a Triton kernel uses only for spills); empty without the tools."""
    nvdisasm, cuobjdump = _tool("nvdisasm"), _tool("cuobjdump")
    if not (nvdisasm and cuobjdump):
        return Counter(), {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    resources = {k: int(v) for k, v in re.findall(r"\b(REG|LOCAL|STACK|SHARED):(\d+)", usage)}
    body = longest_loop(sass.splitlines(), r"^(\.L_x_\d+):", r"\bBRA\s+`\((\.L_x_\d+)\)")
    mix = Counter()
    for line in body:
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T\d]\s+)?([A-Z][A-Z0-9]*)(\S*)", line)
        if not m:
            continue
        op, suffix = m.groups()
        mix["all"] += 1
        mix[SASS.get(op, "other")] += 1
        if op in MIO:
            width = _width(op, suffix)
            mix["mio"] += max(width, 4)  # a warp's access takes at least one 128-byte wavefront
            if op == "LDG":
                mix[f"ldg.{width}"] += 1
    return mix, resources


def programs_per_sm(regs: int, smem: int, warps: int) -> int:
    """Programs an H100 SM holds at once: 64K registers (256 a warp at a time), 228 KB of shared memory (1 KB of
    it reserved a program), 64 warps, 32 programs."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    return min(65536 // per_warp // warps, 233472 // (smem + 1024), 64 // warps, 32)


def _dump(compiled, stem: str) -> None:
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    for ext in ("ttgir", "ptx"):
        with open(f"{stem}.{ext}", "w") as f:
            f.write(compiled.asm[ext])
    with open(f"{stem}.cubin", "wb") as f:
        f.write(compiled.asm["cubin"])


def analyse(kernel: str, m: int, linear: str, given: dict, dump: str | None = None) -> dict:
    """One row: the launch for [m, K] x the Llama-3-8B linear's [N, K] weight, its loop's PTX and SASS mixes, raw
    and per weight byte. The loop's code is the same for every linear (their N and K are multiples of 16); the
    grid (programs, splits of K, iterations a program) is the linear's."""
    n, k = SHAPES[linear]
    fn, grid, args, kwargs = record(kernel, m, n, k, **given)
    compiled = compile_launch(fn, args, kwargs)
    sass, res = sass_mix(compiled.asm["cubin"])
    ptx = ptx_mix(compiled.asm["ptx"])
    bn, bk, warps = kwargs["BLOCK_N"], kwargs["BLOCK_K"], kwargs["num_warps"]
    values = dict(zip(fn.arg_names, args))
    # nf4_lut's kernels step one quantisation block at a time, or STEP_BLOCKS (their BLOCK_K sizes the splits only)
    lut = kwargs["QBLOCK"] * kwargs.get("STEP_BLOCKS", 1)
    step, per_split = (lut if kernel in nf4.LUT_KERNELS else bk) // 2, values["PER_SPLIT"]
    thread_bytes = bn * step / (32 * warps)  # weight bytes a thread covers in one iteration
    smem = compiled.metadata.shared
    row = {"kernel": kernel, "batch": m, "linear": linear, "k": k, "n": n, "given": given,
           "tile": f"{kwargs['BLOCK_M']}x{bn}x{bk} w{warps} s{kwargs['num_stages']}",
           "programs": grid[0] * grid[1] * grid[2], "splits": grid[2], "iters": -(-per_split // step),
           "regs": res.get("REG"), "local": res.get("LOCAL"), "smem": smem,
           "per_sm": programs_per_sm(res.get("REG", 0), smem, warps) if res else None,
           "iter_bytes": bn * step, "ptx": dict(ptx), "sass": dict(sass),
           "ptx_per_byte": {c: v / thread_bytes for c, v in ptx.items()},
           "sass_per_byte": {c: v / thread_bytes for c, v in sass.items()}}
    mix = row["sass_per_byte"] or row["ptx_per_byte"]
    # 4 warp-instructions a clock an SM, 32 threads' bytes each: GB/s if issuing were all that bounded the loop
    row["issue_gbps"] = SMS * 4 * ISSUE_GHZ * 32 / mix["all"] if mix.get("all") else None
    # 128 bytes a clock an SM through L1 / shared memory (no bank conflicts, a lookup's lanes on one line; the bytes
    # an MMA reads from shared memory itself are not counted)
    row["mio_gbps"] = SMS * 128 * ISSUE_GHZ / mix["mio"] if mix.get("mio") else None
    if dump:
        _dump(compiled, os.path.join(dump, f"{kernel}-m{m}-{linear}"))
    return row


COLUMNS = [("all", "instr"), ("ldg", "ldg"), ("lds", "lds"), ("sts", "sts"), ("ldsm", "ldsm"), ("bar", "bar"),
           ("mma", "mma"), ("cvt", "cvt"), ("sel", "sel"), ("prmt", "prmt"), ("shfl", "shfl"), ("fp", "fp"),
           ("int", "int"), ("mio", "mioB")]


def table(rows: list) -> str:
    """Per weight byte, per thread: the SASS loop's mix (PTX's where there is no SASS) and the two ceilings, then the
    global loads of an iteration as count x bytes; registers, local (spill) bytes, shared bytes, programs an SM
    holds."""
    head = (f"{'kernel':<16}{'m':>3}{'lin':>5} {'tile':<17}{'progs':>6}{'it':>4}{'reg':>5}{'spill':>6}{'smem':>7}"
            f"{'/SM':>4} " + "".join(f"{t:>6}" for _, t in COLUMNS) + f"{'issue':>7}{'mio':>6}  global loads")
    out = [head]
    for r in rows:
        mix, raw = r["sass_per_byte"] or r["ptx_per_byte"], r["sass"] or r["ptx"]
        ldg = sorted((c for c in raw if c.startswith("ldg.")), key=lambda c: -int(c[4:]))
        out.append(f"{r['kernel']:<16}{r['batch']:>3}{r['linear']:>5} {r['tile']:<17}{r['programs']:>6}{r['iters']:>4}"
                   f"{r['regs'] or '-':>5}{r['local'] if r['local'] is not None else '-':>6}{r['smem']:>7}"
                   f"{r['per_sm'] or '-':>4} " + "".join(f"{mix.get(c, 0):>6.2f}" for c, _ in COLUMNS)
                   + f"{r['issue_gbps'] or 0:>7.0f}{r['mio_gbps'] or 0:>6.0f}  "
                   + " ".join(f"{raw[c]}x{c[4:]}" for c in ldg))
    return "\n".join(out)


def _value(text: str):
    return int(text) if text.lstrip("-").isdigit() else text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", nargs="+", default=list(nf4.KERNELS))
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--linears", nargs="+", default=["q"], choices=sorted(SHAPES),
                    help="whose grid to report (the loop is the same for all)")
    ap.add_argument("--set", nargs="*", default=[], metavar="ARG=VALUE",
                    help="nf4.matmul arguments over DEFAULTS, for every kernel (block_n=128 num_warps=8 ...)")
    ap.add_argument("--json", action="store_true", help="the rows as JSON instead of the table")
    ap.add_argument("--dump", help="a folder for each launch's TTGIR, PTX and cubin")
    a = ap.parse_args()
    given = {key: _value(v) for key, v in (s.split("=", 1) for s in a.set)}
    rows = [analyse(kernel, m, lin, given, a.dump) for kernel in a.kernels for m in a.batches for lin in a.linears]
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(table(rows))
    print(f"Per weight byte a thread covers in one iteration of the main K loop (SASS if nvdisasm was found, else "
          f"PTX). mioB: bytes through L1/shared memory (LDG, LDS, STS, LDSM, SHFL). Ceilings in GB/s of weight, "
          f"{SMS} SMs at {ISSUE_GHZ} GHz: issue (4 warp-instructions a clock) and mio (128 bytes a clock, no bank "
          f"conflicts), each as if nothing else bounded the loop.")

if __name__ == "__main__":
    main()
