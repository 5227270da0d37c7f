"""One rank of the data-parallel tests, started by torchrun from tests/hybridcore/test_parallel.py.

For each ZeRO stage in `--runs`, each rank trains one step on its share of a fixed batch, then writes what it
measured (per-rank bytes by kind, the gradient norm, a digest of its weights) to OUT/zeroS/rank-R.json and
rank 0 the weights to OUT/zeroS/weights.safetensors."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hybridcore import parallel  # noqa: E402
from hybridcore.engine import make_engine  # noqa: E402
from bench.micro import BATCH, STEP_KW, batch, micro_model, token_loss  # noqa: E402


def one_step(zero_stage: int, micro: int, groups, out: Path) -> None:
    layout = parallel.Layout(dp=groups.world, zero_stage=zero_stage)
    engine = make_engine(micro_model(), layout=layout, groups=groups, micro_batch=micro, cpu_adam=False, **STEP_KW)
    ids = batch()
    per_rank = BATCH // groups.world
    mine = ids[groups.dp_rank * per_rank:(groups.dp_rank + 1) * per_rank]
    n_tokens = ids[:, 1:].numel()  # the step's token count over every rank
    for s in range(0, per_rank, micro):
        engine.backward(token_loss(engine.model, mine[s:s + micro]) / n_tokens)
    after_backward = engine.held_bytes()
    norm = engine.step()
    after_step = engine.held_bytes()
    state = engine.whole_state_dict()
    digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
    out.mkdir(parents=True, exist_ok=True)
    if groups.rank == 0:
        save_file(state, str(out / "weights.safetensors"))
    (out / f"rank-{groups.rank}.json").write_text(json.dumps({
        "rank": groups.rank, "dp_rank": groups.dp_rank, "grad_norm": norm, "digest": digest,
        "after_backward": after_backward, "after_step": after_step, "optimizer_bytes": engine.optimizer_bytes()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", required=True, help="comma-separated ZERO_STAGE:MICRO_BATCH, e.g. 1:2,2:2,3:4")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    groups = parallel.init(parallel.Layout(dp=int(os.environ.get("WORLD_SIZE", "1"))), timeout_s=300)
    try:  # one launch for every configuration: process start-up is most of the cost on 2 cores
        for run in args.runs.split(","):
            stage, micro = (int(x) for x in run.split(":"))
            one_step(stage, micro, groups, args.out / f"zero{stage}")
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    main()
