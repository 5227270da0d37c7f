"""The memory planner: micro-batch chosen from a measured probe (CPU: torch.profiler's allocator events), monotone
in the budget, the chosen size fits when measured again, budgets that cannot work are one clear line, and the SFT
stage runs with a budget, logs its choice, and trains exactly as configured when the planner picks that size."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridcore.errors import InputError
from hybridcore.planner import GIB, MARGIN, choose_offload, measure_peak, plan_micro_batch, plan_stage
from stages.keys import stage_keys
from stages.params import load_params
from stages.runner import run_stage
from bench.micro import SEQ, VOCAB, micro_model, token_loss

SIZES = (1, 2, 4, 8, 16)


@pytest.fixture(scope="module")
def setup():
    model = micro_model()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))

    def probe(rows: int) -> None:
        token_loss(model, ids.expand(rows, SEQ)).backward()
        model.zero_grad(set_to_none=True)

    held = sum(p.numel() * p.element_size() for p in model.parameters())
    totals = {s: held + measure_peak(lambda: probe(s), "cpu") for s in SIZES}
    return model, probe, held, totals


def test_measured_peak_is_the_tensors_allocated():
    """A probe that allocates 8 MiB at once, and frees it, peaks at (at least) 8 MiB and at most a little more."""
    def alloc():
        x = torch.ones(2 * 2 ** 20)  # 8 MiB of float32
        del x
    peak = measure_peak(alloc, "cpu")
    assert 8 * 2 ** 20 <= peak < 9 * 2 ** 20


def test_planner_picks_smaller_micro_batches_for_smaller_budgets_and_they_fit(setup):
    model, probe, held, totals = setup
    assert all(totals[a] < totals[b] for a, b in zip(SIZES, SIZES[1:])), totals  # more rows, more memory
    # the rule of thumb starts at 1 row for a "1B" model (then grows) and at the batch for a 1,000-parameter one
    # (then shrinks): both searches end at the same sizes
    for n_params, first in ((10 ** 9, 1), (1000, 16)):
        chosen = []
        for s, nxt in zip(SIZES, SIZES[1:] + (None,)):
            # a budget whose usable part lies between the totals at s and at the next size up
            usable = totals[s] + ((totals[nxt] - totals[s]) / 2 if nxt else 2 ** 20)
            plan = plan_micro_batch("sft", usable / (1 - MARGIN) / GIB, 16, n_params, held, probe, "cpu")
            chosen.append(plan.micro_batch)
            assert first in plan.tried
            # measured again at the chosen size, it fits the budget less the margin
            assert held + measure_peak(lambda: probe(plan.micro_batch), "cpu") <= usable
            assert plan.probe_peak_bytes + held == plan.tried[plan.micro_batch]
        assert chosen == list(SIZES)  # monotone: each smaller budget picked a smaller micro-batch
    big = plan_micro_batch("sft", 10.0, 12, 10 ** 6, held, probe, "cpu")
    assert big.micro_batch == 8  # never above the batch size (12 rows: the largest power of two is 8)


def test_budget_below_one_row_and_below_the_weights_are_one_clear_line(setup):
    model, probe, held, totals = setup
    with pytest.raises(InputError) as e:
        plan_micro_batch("sft", totals[1] * 0.5 / GIB, 16, 10 ** 6, held, probe, "cpu")
    assert "engine.memory_budget_gib=" in str(e.value) and "one row of the sft stage's step needs" in str(e.value)
    with pytest.raises(InputError) as e:
        plan_stage("sft", held * 0.5 / GIB, 16, 8, [model], list(model.parameters()), {}, "cpu", probe,
                   lambda _: None)
    msg = str(e.value)
    assert "\n" not in msg and "the sft stage's weights alone take" in msg and "expected a budget of at least" in msg


def test_offload_decision():
    """Weights + grads fit but the optimizer states do not: offload on a GPU with ZeRO at hand, else say why not."""
    w, g, o = 4 * GIB, 4 * GIB, 8 * GIB
    assert choose_offload("sft", 20, w, g, o, True, "cuda") is False          # 16 GiB fits in 18 usable
    assert choose_offload("sft", 12, w, g, o, True, "cuda") is True           # 8 fits in 10.8, 16 does not
    with pytest.raises(InputError, match="needs DeepSpeed ZeRO in one process"):
        choose_offload("sft", 12, w, g, o, False, "cuda")
    with pytest.raises(InputError, match="frees nothing when the device is the CPU"):
        choose_offload("sft", 12, w, g, o, True, "cpu")
    with pytest.raises(InputError, match="without the optimizer states still"):
        choose_offload("sft", 8, w, g, o, True, "cuda")


def test_budget_must_be_positive():
    with pytest.raises(InputError, match="engine.memory_budget_gib"):
        load_params("test", {"engine": {"memory_budget_gib": 0}})


def test_sft_runs_with_a_budget_logs_the_choice_and_matches_the_configured_run(tmp_path, capsys):
    """With room for the whole batch, the planner picks 16 rows; configured at 16, it changes nothing at all."""
    class Sink:
        def __init__(self):
            self.rows = []

        def log(self, metrics, step):
            self.rows.append((step, dict(metrics)))

    over = {"pipeline": {"artifacts_dir": str(tmp_path)}, "sft": {"micro_batch_size": 16}}
    plain = load_params("test", over)
    budget = load_params("test", {**over, "engine": {"memory_budget_gib": 1.0}})
    sink = Sink()
    got = run_stage(budget, "sft", stage_keys(budget), sink)
    err = capsys.readouterr().err
    assert "sft: memory planner chose micro-batch 16 (configured 16) for a budget of 1 GiB" in err
    assert got.metrics["planned_micro_batch"] == 16 and got.metrics["planned_probe_peak_mib"] > 0
    assert (0, {"planned_micro_batch": 16.0, "planned_probe_peak_mib": got.metrics["planned_probe_peak_mib"],
                "planned_offload_optimizer": 0.0}) in sink.rows
    ref = run_stage(plain, "sft", stage_keys(plain))
    a, b = (load_file(str(Path(r.artifact) / "model" / "model.safetensors")) for r in (got, ref))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert got.metrics["train_loss"] == ref.metrics["train_loss"]


def test_kv_cache_estimate_is_the_static_cache():
    from hybridcore.planner import kv_cache_bytes
    from hybridcore.rollout import StaticKVCache
    cfg = micro_model().config
    cache = StaticKVCache.allocate(cfg, 3, 20, torch.float32, "cpu")
    assert kv_cache_bytes(cfg, 3, 20, torch.float32) == cache.nbytes


MIB = 2 ** 20


@pytest.mark.parametrize("usable_mib, chunk, offload", [(50, 8, False), (40, 8, True), (30, 4, False),
                                                        (11, 1, True)])
def test_rollout_plan_takes_the_largest_chunk_then_offload(usable_mib, chunk, offload):
    """A probe that allocates 4 MiB per sequence, 10 MiB held of which 6 MiB are the actor's optimizer states:
    the whole batch if it fits, then the whole batch with the states offloaded, then halved chunks (each with the
    states kept if they fit); a chunk whose KV cache alone cannot fit is never probed."""
    from hybridcore.planner import plan_rollout
    probed = []

    def probe(rows):
        probed.append(rows)
        x = torch.empty(rows * MIB, dtype=torch.int32)  # 4 MiB a row
        del x
    budget = usable_mib * MIB / (1 - MARGIN) / GIB
    plan = plan_rollout(budget, 8, 8, 10 * MIB, 6 * MIB, True, lambda c: 4 * c * MIB, probe, "cpu")
    assert (plan.chunk, plan.offload_optimizer) == (chunk, offload)
    assert 4 * chunk * MIB <= plan.peak_bytes < 4 * chunk * MIB + MIB
    assert all(4 + 4 * c <= usable_mib for c in probed)  # floor 4 MiB + KV cache: the others were skipped
    assert plan.metrics()["planned_rollout_chunk"] == chunk
    assert f"rolls out {chunk} of 8 sequences at a time" in plan.line(8)


def test_rollout_plan_that_cannot_fit_is_one_line():
    from hybridcore.planner import plan_rollout
    with pytest.raises(InputError, match=r"one sequence of PPO's rollout needs .* smaller ppo.max_new_tokens"):
        plan_rollout(7 * MIB / GIB, 8, 8, 10 * MIB, 6 * MIB, True, lambda c: 4 * c * MIB, lambda c: None, "cpu")
    with pytest.raises(InputError, match="one sequence"):  # without offload the states stay: 10 + 4 > 12.6
        plan_rollout(14 * MIB / GIB, 8, 8, 10 * MIB, 6 * MIB, False, lambda c: 4 * c * MIB, lambda c: None, "cpu")


def test_rollout_probe_of_a_real_actor_picks_a_smaller_chunk_under_a_smaller_budget():
    """HybridActor.probe measured by the planner: a budget that fits the measured 16-row rollout keeps it whole; one
    that fits about half of it picks a smaller chunk, whose measured rollout fits that budget."""
    from hybridcore.actor import HybridActor
    from hybridcore.models import build_preset, train_tokenizer
    from hybridcore.planner import kv_cache_bytes, plan_rollout
    tok = train_tokenizer(["the cat sat on the mat and 0123456789"] * 20, 384)
    model = build_preset("micro", tok, seed=0).float()
    actor = HybridActor(model, tok)
    prompt, n_new, rows = tok("the cat sat on the mat")["input_ids"] * 4, 200, 16
    cap = -(-(len(prompt) + n_new) // 64) * 64

    def probe(c):
        actor.probe(prompt, c, n_new)

    def kv(c):
        return kv_cache_bytes(model.config, c, cap, torch.float32)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    whole = measure_peak(lambda: probe(rows), "cpu")
    assert whole >= kv(rows)  # the KV cache is in what the probe measured
    big = plan_rollout((held + whole) / (1 - MARGIN) / GIB * 1.01, rows, rows, held, 0, False, kv, probe, "cpu")
    assert big.chunk == rows
    small_budget = (held + whole / 2) / (1 - MARGIN) / GIB
    small = plan_rollout(small_budget, rows, rows, held, 0, False, kv, probe, "cpu")
    assert 1 <= small.chunk < rows
    assert held + measure_peak(lambda: probe(small.chunk), "cpu") <= small_budget * GIB * (1 - MARGIN)


def test_every_stage_runs_with_a_budget(tmp_path, capsys):
    """SFT, RM and PPO plan with a generous budget: the largest size, the batch (PPO: the minibatch)."""
    p = load_params("test", {"pipeline": {"artifacts_dir": str(tmp_path)}, "engine": {"memory_budget_gib": 1.0}})
    keys = stage_keys(p)
    results = {s: run_stage(p, s, keys) for s in ("sft", "reward", "ppo")}
    err = capsys.readouterr().err
    for stage, size, configured in (("sft", 16, 8), ("reward", 16, 8), ("ppo", 8, 4)):
        assert results[stage].metrics["planned_micro_batch"] == size
        assert f"{stage}: memory planner chose micro-batch {size} (configured {configured})" in err
    assert results["ppo"].metrics["planned_rollout_offload"] == 0
    assert results["ppo"].metrics["planned_rollout_chunk"] == 16  # the whole rollout batch fits
    assert "ppo: memory planner rolls out 16 of 16 sequences at a time" in err
    # the rollout sampled from the weights the update then scored: the same log-probs, to fp32 rounding
    assert 0 <= results["ppo"].metrics["rollout_logprob_gap_last"] < 1e-4


def test_ppo_rolls_out_in_configured_chunks(tmp_path):
    """engine.rollout.chunk_size 4: the 16-sequence rollout goes as 4 chunks of 4 rows, every iteration."""
    class Sink:
        def __init__(self):
            self.rows = []

        def log(self, metrics, step):
            self.rows.append((step, dict(metrics)))

    p = load_params("test", {"pipeline": {"artifacts_dir": str(tmp_path)}, "engine": {"rollout": {"chunk_size": 4}}})
    keys = stage_keys(p)
    for stage in ("sft", "reward"):
        run_stage(p, stage, keys)
    sink = Sink()
    run_stage(p, "ppo", keys, sink)
    steps = [m for _, m in sink.rows if "rollout_chunks" in m]
    assert len(steps) == p.ppo.iterations
    assert all(m["rollout_chunks"] == 4 and m["rollout_chunk_rows"] == 4 for m in steps)
