"""Out-of-memory back-off inside PPO's update: the actor pass and the critic pass each have their own back-off.

An injected OOM in step 0 is survived: the pass is redone at half the micro-batch (twice the accumulation, the
same minibatch), the rest of the stage keeps that size, the size in effect is logged, and the result equals a run
configured at the halved micro-batch from the start, within float rounding of summing the micro-batches in a
different grouping (fp32: 1e-5)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridcore.interrupts import FAULT_ENV
from stages.keys import stage_keys
from stages.params import load_params
from stages.runner import run_stage

ATOL = 1e-5


class ListSink:
    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))


def params(root: Path, micro: int):
    return load_params("test", {"pipeline": {"artifacts_dir": str(root)}, "ppo": {"micro_batch_size": micro}})


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """SFT and RM once (their keys do not depend on ppo.*), and the PPO run configured at micro-batch 2."""
    root = tmp_path_factory.mktemp("ppo-oom")
    p = params(root, 2)
    keys = stage_keys(p)
    for stage in ("sft", "reward"):
        run_stage(p, stage, keys)
    sink = ListSink()
    return root, run_stage(p, "ppo", keys, sink), sink


def weights(result) -> dict[str, torch.Tensor]:
    return load_file(str(Path(result.artifact) / "model" / "model.safetensors"))


@pytest.mark.parametrize("fault,pass_name", [("ppo:oom:0", "actor"), ("ppo:critic:oom:0", "critic")])
def test_injected_oom_in_ppo_update_is_survived_at_half_the_micro_batch(root, monkeypatch, capsys, fault, pass_name):
    base, halved, halved_sink = root
    monkeypatch.setenv(FAULT_ENV, fault)
    p = params(base, 4)
    sink = ListSink()
    result = run_stage(p, "ppo", stage_keys(p), sink, force=True)  # same key in both cases: run it anew
    out = capsys.readouterr().out
    # minibatch 8 at micro-batch 4 = 2 micro-batches; the fault fires in the second, the pass is redone at 2 x 4
    assert (f"ppo {pass_name}: out of memory at step 0 with micro-batch 4 x 2; redoing it with micro-batch 2 x 4 "
            "(same 8 rows per step)") in out
    assert out.count("out of memory") == 1  # once: the smaller size sticks, the other pass is untouched
    steps = [m for _, m in sink.rows if f"{pass_name}_micro_batch" in m]
    other = "critic" if pass_name == "actor" else "actor"
    assert [m[f"{pass_name}_micro_batch"] for m in steps] == [2.0, 2.0]
    assert [m[f"{other}_micro_batch"] for m in steps] == [4.0, 4.0]
    assert result.metrics["steps"] == halved.metrics["steps"] == 2
    got, ref = weights(result), weights(halved)
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=ATOL, msg=k)
    # and the statistics, token-weighted over each minibatch, do not depend on the micro-batch either
    ref_steps = [m for _, m in halved_sink.rows if "actor_micro_batch" in m]
    for name in ("policy_loss", "value_loss", "clipfrac", "entropy", "approx_kl"):
        assert [m[name] for m in steps] == pytest.approx([m[name] for m in ref_steps], rel=0, abs=ATOL), name


def test_values_from_the_critic_pass_equal_a_scoring_forward(root, monkeypatch):
    """ppo.values_from_update: with one minibatch a rollout (16 rows, one epoch) the critic's pass supplies the
    values, returns and advantages instead of a scoring forward (none runs: Gae.values is never called), and the
    weights after two iterations equal those of the scoring forward's run within float rounding; an OOM injected
    into the critic's pass redoes it at half the micro-batch, every row's values written again."""
    from stages import estimators
    base = root[0]
    calls = []
    scored = estimators.Gae.values
    monkeypatch.setattr(estimators.Gae, "values", lambda self, *a: calls.append(1) or scored(self, *a))
    results = {}
    for deferred in (True, False):
        if deferred:
            monkeypatch.setenv(FAULT_ENV, "ppo:critic:oom:0")
        else:
            monkeypatch.delenv(FAULT_ENV, raising=False)
        p = load_params("test", {"pipeline": {"artifacts_dir": str(base)},
                                 "ppo": {"minibatch_size": 16, "micro_batch_size": 4, "values_from_update": deferred}})
        sink = ListSink()
        results[deferred] = run_stage(p, "ppo", stage_keys(p), sink, force=True), sink
        assert len(calls) == (0 if deferred else 2), deferred  # a scoring forward of the critic each iteration
        calls.clear()
    (got, got_sink), (ref, ref_sink) = results[True], results[False]
    assert [m["critic_micro_batch"] for _, m in got_sink.rows if "critic_micro_batch" in m] == [2.0, 2.0]
    w, w_ref = weights(got), weights(ref)
    for k in w_ref:
        torch.testing.assert_close(w[k], w_ref[k], rtol=0, atol=ATOL, msg=k)
    steps, ref_steps = ([m for _, m in s.rows if "value_loss" in m] for s in (got_sink, ref_sink))
    for name in ("policy_loss", "value_loss", "explained_variance", "value_clipfrac", "reward"):
        assert [m[name] for m in steps] == pytest.approx([m[name] for m in ref_steps], rel=0, abs=ATOL), name
