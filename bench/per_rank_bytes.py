"""Per-rank bytes of parameters, gradients and optimizer states, measured vs partition formulas, on CPU over gloo.

Why: issue 8 asks for the per-rank memory table against the formulas; the GPU machine has no DeepSpeed, so this
table is measured here, from the storages each rank's training engine holds (hybridcore/engine.py held_bytes), for
dp=2 (ZeRO-1/2), tp=2 (plain torch) and dp=2 x tp=2 (ZeRO-0/1/2), one AdamW step of a tiny fp32 Llama.
Formulas are the ones tests/hybridcore/test_parallel.py and test_tensor_parallel.py assert, written out again here
from the model's parameter sizes. Prints a Markdown table (CPU/gloo measured, not GPU); exits 1 if any row differs.

    OMP_NUM_THREADS=1 .venv/bin/python bench/per_rank_bytes.py        # ~1-2 min on 2 cores (two torchrun jobs)
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

F32 = 4
MICRO, BATCH, SEQ = 2, 8, 16
# (name, world, dp, tp, zero_stage): one torchrun job per world size runs all its layouts
LAYOUTS = [("dp=2", 2, 2, 1, 1), ("dp=2", 2, 2, 1, 2), ("tp=2", 2, 1, 2, 0),
           ("dp=2 x tp=2", 4, 2, 2, 0), ("dp=2 x tp=2", 4, 2, 2, 1), ("dp=2 x tp=2", 4, 2, 2, 2)]


def model(seed: int = 0):
    """A Llama with every Linear a multiple of 32 and 2 heads / 2 kv heads (tp=2 splits one head per rank)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False))


# ------------------------------------------------------------------------------------------- formulas
def formula(dp: int, tp: int, zero_stage: int, dp_rank: int) -> dict[str, int]:
    """Bytes one rank holds (fp32). Without ZeRO: its tp shard whole (params = grads), torch AdamW's exp_avg +
    exp_avg_sq and one `step` element per tensor. ZeRO-1/2 over dp: each optimizer group (>= 2-D decays, 1-D
    not) of the rank's tp shard flattened and padded to 2 x dp elements, 1/dp of it as fp32 master + two moments
    (+ one `step` per group); ZeRO-1 keeps every gradient whole, ZeRO-2 those overlapping its partition."""
    from hybridcore.tensor_parallel import ATTENTION, MLP
    local = [(p.numel() // tp if name.split(".")[-2] in (*ATTENTION, *MLP) else p.numel(), p.ndim)
             for name, p in model().named_parameters()]
    total = sum(n for n, _ in local)
    if zero_stage == 0:
        return {"params": F32 * total, "grads": F32 * total, "optimizer": F32 * (2 * total + len(local))}
    groups = [[n for n, nd in local if nd >= 2], [n for n, nd in local if nd < 2]]
    padded = [-(-sum(g) // (2 * dp)) * (2 * dp) for g in groups]
    part = [pg // dp for pg in padded]
    if zero_stage == 1:
        grads = total
    else:
        grads = 0
        for g, size in zip(groups, part):
            lo, hi, start = dp_rank * size, (dp_rank + 1) * size, 0
            for n in g:
                grads += n if (start < hi and start + n > lo) else 0
                start += n
    return {"params": F32 * sum(padded), "grads": F32 * grads, "optimizer": F32 * (3 * sum(part) + len(groups))}


# ------------------------------------------------------------------------------------------- one rank
def rank_main(out: Path) -> None:
    import torch

    from hybridcore import parallel, tensor_parallel
    from hybridcore.engine import make_engine
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    try:
        for i, (_, w, dp, tp, zero) in enumerate(LAYOUTS):
            if w != world:
                continue
            groups = parallel.init(parallel.Layout(dp=dp, tp=tp, zero_stage=zero), timeout_s=300)
            m = model()
            if tp > 1:
                tensor_parallel.split_model(m, groups.tp_group, tp, groups.tp_rank)
            engine = make_engine(m, lr=1e-3, total_steps=2, warmup_ratio=0.0, max_grad_norm=1.0, layout=groups.layout,
                                 groups=groups, micro_batch=MICRO, cpu_adam=False)
            ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
            per = BATCH // dp
            mine = ids[groups.dp_rank * per:(groups.dp_rank + 1) * per]  # tp peers take the same rows
            for s in range(0, per, MICRO):
                x = mine[s:s + MICRO]
                engine.backward(engine.model(input_ids=x, labels=x).loss * len(x) / BATCH)
            after_backward = engine.held_bytes()
            engine.step()
            after_step = engine.held_bytes()
            (out / f"{i}-rank-{groups.rank}.json").write_text(json.dumps(
                {"rank": groups.rank, "dp_rank": groups.dp_rank, "tp_rank": groups.tp_rank,
                 "params": after_step["params"], "grads": after_backward["grads"],
                 "optimizer": after_step["optimizer"]}))
            torch.distributed.barrier()
    finally:
        parallel.shutdown()


# ------------------------------------------------------------------------------------------- the table
def launch(world: int, out: Path, timeout: int = 600) -> None:
    from hybridcore.parallel import ENV_VARS, free_port
    from hybridcore.zero import DEFAULT_EXTENSIONS_DIR
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(DEFAULT_EXTENSIONS_DIR))}
    for name in ENV_VARS:
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), __file__, "--rank-out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    finally:  # the job's whole process group goes, whatever happened
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"torchrun over {world} ranks failed (exit {proc.returncode}):\n{text[-4000:]}")


def table(out: Path) -> tuple[list[str], bool]:
    lines = ["| layout | ZeRO | rank (dp, tp) | params B (formula) | grads B (formula) | optimizer B (formula) "
             "| match |", "|---|---|---|---|---|---|---|"]
    ok = True
    for i, (name, world, dp, tp, zero) in enumerate(LAYOUTS):
        for r in range(world):
            got = json.loads((out / f"{i}-rank-{r}.json").read_text())
            want = formula(dp, tp, zero, got["dp_rank"])
            same = all(got[k] == want[k] for k in want)
            ok &= same
            cells = " | ".join(f"{got[k]:,} ({want[k]:,})" for k in ("params", "grads", "optimizer"))
            lines.append(f"| {name} | {zero} | {r} ({got['dp_rank']}, {got['tp_rank']}) | {cells} | "
                         f"{'yes' if same else 'NO'} |")
    return lines, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank-out", type=Path, help=argparse.SUPPRESS)  # set when started by torchrun
    args = ap.parse_args()
    if args.rank_out is not None:
        rank_main(args.rank_out)
        return 0
    import torch
    n = sum(p.numel() for p in model().parameters())
    with tempfile.TemporaryDirectory(prefix="per-rank-bytes-") as tmp:
        for world in sorted({w for _, w, *_ in LAYOUTS}):
            launch(world, Path(tmp))
        lines, ok = table(Path(tmp))
    print(f"Per-rank bytes after one AdamW step, measured on CPU over gloo (not GPU), torch {torch.__version__}, "
          f"fp32 Llama of {n:,} parameters; formula in parentheses (bench/per_rank_bytes.py):\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
