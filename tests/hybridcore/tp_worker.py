"""One rank of the tensor-parallel tests, started by torchrun from tests/hybridcore/test_tensor_parallel.py.

World 2 (`--case world2`): tp=2 -- the split's consolidated weights; two torch-backend AdamW steps, with and
without activation checkpointing; save/load; a Qwen2 policy and a Llama scorer; greedy rollout at rollout tp 2
and 1. World 4 (`--case world4`): dp=2 x tp=2 -- two DeepSpeed steps each at ZeRO 0, 1 and 2, a rollout
regrouped to tp 1 from the ZeRO-2 engine's weights, its save/load; then tp=4 -> rollout tp 2, greedy and sampled.
Each rank writes what it measured to OUT/<case>/rank-R.json and rank 0 the consolidated weights to
OUT/<case>/weights.safetensors."""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hybridcore import parallel, tensor_parallel  # noqa: E402
from hybridcore.actor import HybridActor  # noqa: E402
from hybridcore.models import set_activation_checkpointing  # noqa: E402
from hybridcore.engine import make_engine  # noqa: E402
from bench.micro import BATCH, MICRO, STEP_KW, VOCAB, batch, token_loss  # noqa: E402

TOKENIZER = SimpleNamespace(pad_token_id=0, eos_token_id=None)
NEW_TOKENS = 8
STEPS = 2


def tp_model(kv_heads: int = 2, seed: int = 0) -> LlamaForCausalLM:
    """4 heads of 32, `kv_heads` kv heads, every Linear a multiple of 32; fp32."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def other_model(kind: str, seed: int = 0):
    """The other shapes the stages split: a Qwen2 policy (biased q/k/v, split with their columns) and a Llama
    scorer (its score head replicated)."""
    torch.manual_seed(seed)
    sizes = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**sizes))
    return LlamaForSequenceClassification(LlamaConfig(num_labels=1, pad_token_id=0, **sizes))


def prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, VOCAB, (3 + i,), generator=g).tolist() for i in range(n)]


def digest(model) -> str:
    return hashlib.sha256(b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters()))\
        .hexdigest()


def rollout(model, groups, rollout_tp: int) -> dict:
    """Greedy tokens at `rollout_tp`; checks that leaving rollout points every parameter at its training tensor."""
    ptrs = [p.data.data_ptr() for p in model.parameters()]
    before = digest(model)
    actor = HybridActor(model, TOKENIZER, backend="native", groups=groups, rollout_tp=rollout_tp)
    with actor.rollout():
        kv = tensor_parallel.local_kv_heads(model)
        tokens = actor.generate(prompts(), NEW_TOKENS, greedy=True)
        kv_bytes = actor.backend.kv_cache_bytes
    return {"tokens": tokens, "kv_heads": kv, "kv_cache_bytes": kv_bytes,
            "peak": actor.last_transition_bytes["reshard_peak"],
            "restored": [p.data.data_ptr() for p in model.parameters()] == ptrs and digest(model) == before,
            "tp_after": tensor_parallel.tp_state(model).size}


def write(out: Path, groups, record: dict, state: dict | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if state is not None:
        save_file(state, str(out / "weights.safetensors"))
    (out / f"rank-{groups.rank}.json").write_text(json.dumps({"rank": groups.rank, "dp_rank": groups.dp_rank,
                                                              "tp_rank": groups.tp_rank, **record}))


def train_step(engine, groups) -> dict:
    """STEPS steps, each on this dp rank's share of a batch (tp peers see the same rows). Two, because AdamW's
    first step is invariant to the clipping coefficient; the second is not."""
    norms = []
    for seed in range(1, STEPS + 1):
        ids = batch(seed)
        per_rank = BATCH // groups.layout.dp
        mine = ids[groups.dp_rank * per_rank:(groups.dp_rank + 1) * per_rank]
        n_tokens = ids[:, 1:].numel()
        for s in range(0, per_rank, MICRO):
            engine.backward(token_loss(engine.model, mine[s:s + MICRO]) / n_tokens)
        if seed == 1:
            after_backward = engine.held_bytes()
        norms.append(engine.step())
    return {"grad_norms": norms, "after_backward": after_backward, "after_step": engine.held_bytes(),
            "numel": tensor_parallel.param_numel(engine.module), "digest": digest(engine.module)}


def world2(out: Path) -> None:
    groups = parallel.init(parallel.Layout(tp=2), timeout_s=300)
    split = tensor_parallel.split_model(tp_model(), groups.tp_group, 2, groups.tp_rank)
    state = tensor_parallel.consolidated_state_dict(split, groups)
    if state is not None:  # the export recipe for the stages: the split model's config, the gathered weights
        split.save_pretrained(out / "split" / "hf", state_dict=dict(state))  # transformers 5 empties the dict
    write(out / "split", groups, {"bytes": tensor_parallel.param_bytes(split)}, state)
    engine = make_engine(tensor_parallel.split_model(tp_model(), groups.tp_group, 2, groups.tp_rank),
                         layout=groups.layout, groups=groups, micro_batch=MICRO, cpu_adam=False, **STEP_KW)
    record = train_step(engine, groups)
    write(out / "train", groups, record, engine.whole_state_dict())
    ckpt_model = tensor_parallel.split_model(tp_model(), groups.tp_group, 2, groups.tp_rank)
    set_activation_checkpointing(ckpt_model, True)  # recomputation replays the forward's all-reduces
    recomputed = make_engine(ckpt_model, layout=groups.layout, groups=groups, micro_batch=MICRO, cpu_adam=False,
                             **STEP_KW)
    write(out / "train-recompute", groups, {**train_step(recomputed, groups),
                                            "checkpointing": ckpt_model.is_gradient_checkpointing},
          recomputed.whole_state_dict())
    engine.save(out / "ckpt")
    torch.distributed.barrier()
    again = make_engine(tensor_parallel.split_model(tp_model(seed=1), groups.tp_group, 2, groups.tp_rank),
                        layout=groups.layout, groups=groups, micro_batch=MICRO, cpu_adam=False, **STEP_KW)
    again.load(out / "ckpt")
    states = [engine.optimizer.state[p] for p in engine.module.parameters()]
    loaded = [again.optimizer.state[p] for p in again.module.parameters()]
    write(out / "resume", groups, {"weights": digest(again.module) == digest(engine.module),
                                   "optimizer": all(torch.equal(a[k], b[k]) for a, b in zip(states, loaded)
                                                    for k in a)}, None)
    for kind in ("qwen2", "scorer"):
        model = tensor_parallel.split_model(other_model(kind), groups.tp_group, 2, groups.tp_rank)
        with torch.no_grad():
            logits = model(input_ids=batch()[:2]).logits
        record = rollout(model, groups, 2) if kind == "qwen2" else {}
        state = tensor_parallel.consolidated_state_dict(model, groups)
        if state is not None:
            state["__logits__"] = logits.contiguous()
        write(out / kind, groups, record, state)
    write(out / "rollout2", groups, rollout(split, groups, 2), None)
    write(out / "rollout1", groups, rollout(split, groups, 1), None)


def world4(out: Path) -> None:
    groups = parallel.init(parallel.Layout(dp=2, tp=2), timeout_s=300)
    for zero in (0, 1, 2):
        layout = parallel.Layout(dp=2, tp=2, zero_stage=zero)
        model = tensor_parallel.split_model(tp_model(), groups.tp_group, 2, groups.tp_rank)
        engine = make_engine(model, layout=layout, groups=groups, micro_batch=MICRO, cpu_adam=False, **STEP_KW)
        record = train_step(engine, groups)
        write(out / f"zero{zero}", groups, record, engine.whole_state_dict())
    # the rollout regroups the ZeRO-2 engine's weights (views into DeepSpeed's flat buffer) and gives them back
    write(out / "zero2-rollout1", groups, rollout(engine.module, groups, 1), None)
    engine.save(out / "zero2-ckpt")  # DeepSpeed's files, one model-parallel rank per tp rank
    torch.distributed.barrier()
    again = make_engine(tensor_parallel.split_model(tp_model(seed=1), groups.tp_group, 2, groups.tp_rank),
                        layout=layout, groups=groups, micro_batch=MICRO, cpu_adam=False, **STEP_KW)
    again.load(out / "zero2-ckpt")
    loaded = digest(again.module) == digest(engine.module)
    train_step(engine, groups)  # two more steps on both: equal only if the optimizer states and schedule resumed
    train_step(again, groups)
    write(out / "zero2-resume", groups, {"weights": loaded, "continued": digest(again.module) == digest(engine.module)},
          None)
    g4 = parallel.init(parallel.Layout(tp=4), timeout_s=300)  # same processes, a second layout's groups
    model = tensor_parallel.split_model(tp_model(kv_heads=4), g4.tp_group, 4, g4.tp_rank)
    record = {"bytes": tensor_parallel.param_bytes(model), **rollout(model, g4, 2)}
    actor = HybridActor(model, TOKENIZER, backend="native", groups=g4, rollout_tp=2)
    torch.manual_seed(100 + g4.rank)  # every rank draws differently unless the rollout group shares a seed
    with actor.rollout():
        record["sampled"] = actor.generate(prompts(), NEW_TOKENS, temperature=1.0)
    write(out / "tp4-rollout2", g4, record, None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=["world2", "world4"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    try:
        (world2 if args.case == "world2" else world4)(args.out)
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    main()
