"""PPO with `engine.rollout.backend: vllm` through the real stage (runs in the vllm venv: `make test-vllm`).

With top_k=1 both backends roll out the argmax token, and every update is computed by the same transformers
forward from those tokens; so if vLLM received the current weights before each rollout, PPO's result equals
the native backend's. A stale engine (a missed sync) would roll out different tokens after the first update."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages.keys import stage_keys
from stages.params import load_params
from stages.runner import run_stage

pytestmark = pytest.mark.vllm


class Recorder:
    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, metrics: dict, step: int) -> None:
        self.rows.append((step, dict(metrics)))


def test_ppo_with_vllm_equals_native_under_argmax_sampling(tmp_path):
    results = {}
    for backend in ("native", "vllm"):
        p = load_params("test", {"pipeline": {"artifacts_dir": str(tmp_path)},
                                 "ppo": {"iterations": 3, "top_k": 1},
                                 "engine": {"rollout": {"backend": backend}}})
        keys = stage_keys(p)
        for stage in ("sft", "reward"):
            run_stage(p, stage, keys)
        sink = Recorder()
        results[backend] = (run_stage(p, "ppo", keys, sink=sink), sink)
    (native, _), (vllm, sink) = results["native"], results["vllm"]
    assert native.key != vllm.key  # the backend is part of the engine section, so of the key
    synced = [m["rollout_weight_sync_bytes"] for _, m in sink.rows if "rollout_weight_sync_bytes" in m]
    assert len(synced) == 3 and all(b > 0 for b in synced)
    a = load_file(str(Path(native.artifact) / "model" / "model.safetensors"))
    b = load_file(str(Path(vllm.artifact) / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    assert native.metrics["reward_last"] == pytest.approx(vllm.metrics["reward_last"], abs=1e-5)
