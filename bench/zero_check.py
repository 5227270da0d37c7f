"""GPU check of the training engines (hybridcore/engine.py, zero.py): where each layout keeps optimizer states,
gradients and parameters, measured from the storages it holds, and that every layout's step lands on plain AdamW's weights.

One process, the micro model of bench/micro.py, one step of 4 micro-batches. Needs torch,
transformers and the deepspeed wheel (carried; see bench/README.md). Writes $OUT/zero_check.json.
    python bench/zero_check.py
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hybridcore.parallel import Layout  # noqa: E402
from hybridcore.engine import make_engine, storages  # noqa: E402
from bench.micro import BATCH, MICRO, STEP_KW, batch, micro_model, token_loss  # noqa: E402

LAYOUTS = {"torch": Layout(), "zero2": Layout(zero_stage=2),
           "zero2-offload": Layout(zero_stage=2, offload_optimizer=True),
           "zero3-offload": Layout(zero_stage=3, offload_optimizer=True, offload_params=True)}


def main() -> None:
    dev = torch.device("cuda")
    res, ref = {"n_params": sum(p.numel() for p in micro_model().parameters()), "gpu": torch.cuda.get_device_name()}, None
    for name, layout in LAYOUTS.items():
        e = make_engine(micro_model().to(dev), layout=layout, micro_batch=MICRO, cpu_adam=False, **STEP_KW)
        ids = batch().to(dev)
        n = ids[:, 1:].numel()
        for s in range(0, BATCH, MICRO):
            e.backward(token_loss(e.model, ids[s:s + MICRO]) / n)
        norm = e.step()
        by = {}
        for kind, ts in e.held_tensors().items():
            st = storages(ts)
            by[kind] = {d: sum(b for b, k in st.values() if k == d) for d in ("cuda", "cpu")}
        w = {k: v.float().cpu() for k, v in e.whole_state_dict().items()}
        ref = ref or w
        res[name] = {"grad_norm": norm, "optimizer_bytes": e.optimizer_bytes(), "by_device": by,
                     "max_abs_diff_vs_torch": max((w[k] - ref[k]).abs().max().item() for k in ref)}
        print(name, json.dumps(res[name]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "zero_check.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
