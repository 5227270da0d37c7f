"""Tensor parallelism over gloo: torchrun jobs of 2 (tp=2) and 4 (dp=2 x tp=2 with ZeRO-0/1/2; tp=4) ranks whose
two AdamW steps equal the single-process steps, whose greedy rollouts (also regrouped to a smaller rollout tp)
equal the single-process tokens, and whose per-rank bytes match formulas written here from the model's sizes.
The two launches (tests/hybridcore/tp_worker.py) take ~15 s and ~45 s on 2 idle cores; the file ~75 s."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaForCausalLM

from hybridcore import tensor_parallel
from hybridcore.actor import HybridActor
from hybridcore.errors import InputError, NotYetSupported
from hybridcore.parallel import Layout
from hybridcore.reshard import Resharder
from hybridcore.engine import make_engine
from tests.hybridcore.tp_worker import NEW_TOKENS, STEPS, TOKENIZER, other_model, prompts, tp_model
from bench.micro import BATCH, MICRO, STEP_KW, batch, token_loss
from tests.hybridcore.test_parallel import torchrun as run_ranks

WORKER = Path(__file__).with_name("tp_worker.py")
F32 = 4  # bytes per element: the models train in fp32
SPLIT = tuple(tensor_parallel.ATTENTION + tensor_parallel.MLP)


# ------------------------------------------------------------------------------------------- sizes
def sizes(kv_heads: int = 2) -> dict[str, int]:
    """Split and replicated element counts from the config, checked against the model's own parameters."""
    m = tp_model(kv_heads)
    c = m.config
    hd = c.hidden_size // c.num_attention_heads
    h, inter = c.hidden_size, c.intermediate_size
    per_layer = (h * c.num_attention_heads * hd + 2 * h * c.num_key_value_heads * hd + c.num_attention_heads * hd * h
                 + 3 * h * inter)
    split = c.num_hidden_layers * per_layer
    replicated = 2 * c.vocab_size * h + (2 * c.num_hidden_layers + 1) * h  # embed + lm_head, norms
    counted = {"split": 0, "replicated": 0}
    for name, p in m.named_parameters():
        counted["split" if name.split(".")[-2] in SPLIT else "replicated"] += p.numel()
    assert counted == {"split": split, "replicated": replicated}
    return {"split": split, "replicated": replicated, "down_proj": h * inter, "tensors": len(list(m.parameters()))}


def local_numels(tp: int) -> list[tuple[int, int]]:
    """(elements this tp rank holds, ndim) per parameter in the model's order: split ones 1/tp, others whole."""
    return [(p.numel() // tp if name.split(".")[-2] in SPLIT else p.numel(), p.ndim)
            for name, p in tp_model().named_parameters()]


def zero_formulas(zero_stage: int, dp: int, tp: int, dp_rank: int) -> dict[str, int]:
    """ZeRO-1/2 over dp of this tp rank's parameters (the partition rules of test_parallel.partition_formulas):
    each optimizer group (>= 2-D: decay; 1-D: none) flattened and padded to 2 x dp elements, 1/dp of it per rank
    for the fp32 master + exp_avg + exp_avg_sq (+ one `step` element per group); ZeRO-1 holds every gradient
    whole, ZeRO-2 the gradients of parameters overlapping its partition."""
    local = local_numels(tp)
    groups = [[n for n, nd in local if nd >= 2], [n for n, nd in local if nd < 2]]
    padded = [-(-sum(g) // (2 * dp)) * (2 * dp) for g in groups]
    part = [pg // dp for pg in padded]
    if zero_stage == 1:
        grads = sum(map(sum, groups))
    else:
        grads = 0
        for g, size in zip(groups, part):
            lo, hi, start = dp_rank * size, (dp_rank + 1) * size, 0
            for n in g:
                grads += n if (start < hi and start + n > lo) else 0
                start += n
    return {"params": F32 * sum(padded), "grads": F32 * grads, "optimizer": F32 * (3 * sum(part) + len(groups))}


# ------------------------------------------------------------------------------------------- torchrun
def torchrun(case: str, nproc: int, out: Path, timeout: int = 400) -> None:
    """`nproc` ranks of tp_worker.py; every process it started is gone when this returns."""
    run_ranks(["--case", case], out, timeout, worker=WORKER, nproc=nproc)


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp2")
    torchrun("world2", 2, out)
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dp2tp2")
    torchrun("world4", 4, out)
    return out


def ranks(folder: Path, n: int) -> list[dict]:
    return [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(n)]


# ------------------------------------------------------------------------------------------- references
@pytest.fixture(scope="module")
def reference_step():
    """STEPS single-process steps of the plain torch engine on the full batches: (norms, weights, a mask of the
    entries whose gradient was nonzero but below 1e-6 in some step, the sum of the steps' learning rates)."""
    model = tp_model()
    engine = make_engine(model, cpu_adam=False, **STEP_KW)
    norms, tiny, lrs = [], {k: torch.zeros_like(p, dtype=torch.bool) for k, p in model.named_parameters()}, 0.0
    for seed in range(1, STEPS + 1):
        ids = batch(seed)
        n = ids[:, 1:].numel()
        for s in range(0, BATCH, MICRO):
            engine.backward(token_loss(model, ids[s:s + MICRO]) / n)
        for k, p in model.named_parameters():
            tiny[k] |= (p.grad.abs() < 1e-6) & (p.grad != 0)
        lrs += engine.lr
        norms.append(engine.step())
    return norms, engine.whole_state_dict(), tiny, lrs


def reference_tokens(state: dict | None = None, kv_heads: int = 2) -> list[list[int]]:
    model = tp_model(kv_heads)
    if state is not None:
        model.load_state_dict(state)
    actor = HybridActor(model, TOKENIZER, backend="native")
    with actor.rollout():
        return actor.generate(prompts(), NEW_TOKENS, greedy=True)


def assert_step_equal(got: dict, reference_step) -> None:
    """Two AdamW steps (the first is blind to the clipping coefficient, the second is not) within 2e-4: the tp
    all-reduces sum in another order, and Adam's m / sqrt(v) amplifies that for small gradients (measured 7.4e-5
    on every layout; 1.6e-7 after one step). A clipping norm that counted replicated parameters twice, or never,
    moves weights by 5.5e-4 / 9.1e-4 here. Entries whose gradient was nonzero but below 1e-6 in a step (0.3 %)
    move by up to a whole Adam step on that noise (measured 1.3e-4): bounded by twice the learning rates' sum."""
    _, ref, tiny, lrs = reference_step
    assert set(got) == set(ref)
    for k in ref:
        diff = (got[k] - ref[k]).abs()
        assert float(torch.where(tiny[k], 0.0, diff).max()) < 2e-4, k
        assert float(torch.where(tiny[k], diff, 0.0).max()) <= 2 * lrs, k
    assert sum(int(t.sum()) for t in tiny.values()) < 1e-2 * sum(v.numel() for v in ref.values())


# ------------------------------------------------------------------------------------------- in-process checks
def test_tp_that_does_not_divide_heads_is_refused_in_one_line():
    with pytest.raises(InputError, match=r"engine.layout.tp=3: the model's num_attention_heads=4, "
                                         r"num_key_value_heads=2, intermediate_size=256 not divisible by 3; "
                                         r"expected a tp that divides") as e:
        tensor_parallel.split_model(tp_model(), None, 3, 0)
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match=r"num_key_value_heads=2 not divisible by 4"):
        tensor_parallel.check_divisible(tp_model().config, 4)


def test_lora_or_quantised_linears_are_not_yet_supported():
    model = tp_model()
    attn = model.model.layers[0].self_attn
    attn.q_proj = nn.Sequential(attn.q_proj)  # stands in for a peft/bitsandbytes wrapper: not a plain Linear
    with pytest.raises(NotYetSupported, match=r"tensor parallelism over a Sequential \(q_proj"):
        tensor_parallel.split_model(model, None, 2, 0)


def test_rollout_tp_must_divide_training_tp():
    model = tensor_parallel.split_model(tp_model(), None, 2, 0)  # shards only: no collective runs here
    with pytest.raises(InputError, match=r"engine.rollout.tp: found 3, expected a whole number >= 1 that divides "
                                         r"engine.layout.tp=2"):
        Resharder(model, None, 3)


def test_engine_refuses_an_unsplit_model_for_tp():
    with pytest.raises(ValueError, match=r"engine.layout.tp=2: split the model"):
        make_engine(tp_model(), layout=Layout(tp=2), cpu_adam=False, **STEP_KW)


# ------------------------------------------------------------------------------------------- tp = 2
def test_split_then_consolidated_state_dict_is_the_original(world2):
    got = load_file(str(world2 / "split" / "weights.safetensors"))
    ref = tp_model().state_dict()
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    exported = LlamaForCausalLM.from_pretrained(world2 / "split" / "hf").state_dict()  # save_pretrained(state_dict=)
    assert all(torch.equal(exported[k], ref[k]) for k in ref)
    s = sizes()
    for r in ranks(world2 / "split", 2):
        assert r["bytes"] == {"split": F32 * s["split"] // 2, "replicated": F32 * s["replicated"]}


def test_tp2_step_equals_single_process_and_bytes_match(world2, reference_step):
    assert_step_equal(load_file(str(world2 / "train" / "weights.safetensors")), reference_step)
    s = sizes()
    local = s["split"] // 2 + s["replicated"]
    for r in ranks(world2 / "train", 2):
        assert r["grad_norms"] == pytest.approx(reference_step[0], rel=1e-5)  # the tp-aware clipping norm
        assert r["numel"] == {"split": s["split"] // 2, "replicated": s["replicated"]}
        assert r["after_backward"]["params"] == r["after_backward"]["grads"] == F32 * local
        # torch AdamW: exp_avg + exp_avg_sq per element, one fp32 `step` per parameter tensor
        assert r["after_step"]["optimizer"] == F32 * (2 * local + s["tensors"])


def test_tp2_with_activation_checkpointing_trains_the_same(world2):
    """Recomputing a layer in backward replays its forward all-reduces on every tp rank, in the same order."""
    plain = load_file(str(world2 / "train" / "weights.safetensors"))
    recomputed = load_file(str(world2 / "train-recompute" / "weights.safetensors"))
    for k in plain:
        torch.testing.assert_close(recomputed[k], plain[k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
    for a, b in zip(ranks(world2 / "train", 2), ranks(world2 / "train-recompute", 2)):
        assert b["checkpointing"] and a["grad_norms"] == pytest.approx(b["grad_norms"], rel=1e-6)


def test_tp2_checkpoint_resumes_each_ranks_shards_and_optimizer(world2):
    for r in ranks(world2 / "resume", 2):
        assert r == {**r, "weights": True, "optimizer": True}
    assert sorted(p.name for p in (world2 / "ckpt").glob("engine-tp*.pt")) == ["engine-tp0.pt", "engine-tp1.pt"]


@pytest.mark.parametrize("kind", ["qwen2", "scorer"])
def test_qwen2_policy_and_llama_scorer_split_forward_and_consolidate(world2, kind):
    """Qwen2's q/k/v biases are split with their columns; a scorer's score head stays whole."""
    got = load_file(str(world2 / kind / "weights.safetensors"))
    model = other_model(kind)
    ref = model.state_dict()
    assert set(got) - {"__logits__"} == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    with torch.no_grad():
        torch.testing.assert_close(got["__logits__"], model(input_ids=batch()[:2]).logits, rtol=0, atol=1e-5)
    if kind == "qwen2":
        actor = HybridActor(model, TOKENIZER, backend="native")
        with actor.rollout():
            want = actor.generate(prompts(), NEW_TOKENS, greedy=True)
        for r in ranks(world2 / kind, 2):
            assert r["tokens"] == want and r["kv_heads"] == 1 and r["restored"]


@pytest.mark.parametrize("rollout_tp", [2, 1])
def test_tp2_greedy_rollout_equals_single_process(world2, rollout_tp):
    want = reference_tokens()
    s, k = sizes(), 2 // rollout_tp
    for r in ranks(world2 / f"rollout{rollout_tp}", 2):
        assert r["tokens"] == want
        assert r["restored"] and r["tp_after"] == 2  # training shards back, the very same storages
        assert r["kv_heads"] == 2 // rollout_tp     # the cache holds this rank's kv heads, not the config's
        # 2 layers x (K, V) x (6 / k prompts) x kv heads x capacity 64 x head_dim 32, fp32
        assert r["kv_cache_bytes"] == F32 * 2 * 2 * (6 // k) * (2 // rollout_tp) * 64 * 32
        # peak: replicated + training shards (1/2) + rollout shards (1/rollout_tp) + the k gathered parts of
        # the last regrouped linear (a down_proj, split along its input features)
        extra = s["split"] // rollout_tp + k * s["down_proj"] // 2 if k > 1 else 0
        assert r["peak"] == F32 * (s["replicated"] + s["split"] // 2 + extra)


# ------------------------------------------------------------------------------------------- dp = 2 x tp = 2
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_dp2_tp2_zero_step_equals_single_process_and_bytes_match(world4, reference_step, zero_stage):
    folder = world4 / f"zero{zero_stage}"
    assert_step_equal(load_file(str(folder / "weights.safetensors")), reference_step)
    rs = ranks(folder, 4)
    assert rs[0]["digest"] == rs[2]["digest"] and rs[1]["digest"] == rs[3]["digest"], "dp replicas differ"
    for r in rs:
        assert (r["dp_rank"], r["tp_rank"]) == divmod(r["rank"], 2)
        if zero_stage > 0:  # DeepSpeed's ZeRO-0 engine clips (tp-aware, through the mpu) but reports no norm
            assert r["grad_norms"] == pytest.approx(reference_step[0], rel=1e-5)
        want = zero_formulas(zero_stage, dp=2, tp=2, dp_rank=r["dp_rank"])
        if zero_stage == 0:  # DeepSpeed without ZeRO: every rank holds its tp shard whole, torch AdamW's states
            local, n = sum(n for n, _ in local_numels(2)), len(local_numels(2))
            want = {"params": F32 * local, "grads": F32 * local, "optimizer": F32 * (2 * local + n)}
        held = {"params": r["after_step"]["params"], "grads": r["after_backward"]["grads"],
                "optimizer": r["after_step"]["optimizer"]}
        assert held == want, f"rank {r['rank']}"
    s = sizes()  # ZeRO's optimizer states really are ~1/(dp x tp) of the split weights + 1/dp of the replicated
    if zero_stage > 0:
            assert rs[0]["after_step"]["optimizer"] == pytest.approx(3 * F32 * (s["split"] / 4 + s["replicated"] / 2),
                                                                 rel=1e-3)


def test_dp2_tp2_zero2_checkpoint_resumes(world4):
    for r in ranks(world4 / "zero2-resume", 4):
        assert r["weights"], f"rank {r['rank']} resumed other weights"
        assert r["continued"], f"rank {r['rank']}: the resumed engine's next steps differ (optimizer or schedule)"


def test_zero2_weights_regrouped_to_rollout_tp1_generate_the_same_tokens(world4):
    want = reference_tokens(load_file(str(world4 / "zero2" / "weights.safetensors")))
    for r in ranks(world4 / "zero2-rollout1", 4):
        assert r["tokens"] == want
        assert r["restored"], "a parameter no longer points into DeepSpeed's flat buffer after rollout"


def test_tp4_regrouped_to_rollout_tp2_never_holds_a_full_copy(world4):
    want = reference_tokens(kv_heads=4)
    s = sizes(kv_heads=4)
    full = F32 * (s["split"] + s["replicated"])
    for r in ranks(world4 / "tp4-rollout2", 4):
        assert r["tokens"] == want and r["restored"] and r["kv_heads"] == 2
        assert r["bytes"] == {"split": F32 * s["split"] // 4, "replicated": F32 * s["replicated"]}
        # replicated + training shard (1/4) + rollout shard (1/2) + the 2 gathered parts of the last down_proj
        assert r["peak"] == F32 * (s["replicated"] + s["split"] // 4 + s["split"] // 2 + 2 * s["down_proj"] // 4)
        assert r["peak"] < full
    sampled = [r["sampled"] for r in ranks(world4 / "tp4-rollout2", 4)]
    # each rank seeded differently: the ranks of a rollout group agree only because they share a seed
    assert sampled[0] == sampled[1] == sampled[2] == sampled[3] and sampled[0] != want
