"""A tiny 4-bit + LoRA model's greedy rollout with bitsandbytes' decode and with the fused NF4 kernel
(hybridcore/fused_decode.py), under Triton's interpreter in a process of its own (TRITON_INTERPRET must be set
before triton is first imported); prints JSON for tests/hybridcore/test_nf4_rollout.py to judge."""
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from hybridcore import fused_decode, nf4  # noqa: E402
from hybridcore.actor import HybridActor  # noqa: E402
from hybridcore.adapters import LoraSpec, add_lora, adapter_parameters, linear4bit_layers  # noqa: E402
from hybridcore.fused_decode import FusedNf4Decode  # noqa: E402
from hybridcore.models import build_preset, load_causal_lm, save_model, train_tokenizer  # noqa: E402
from hybridcore.rollout import StaticKVCache, decode_step  # noqa: E402

TEXTS = [f"item {i} costs {i * 7 % 50} coins and weighs {i * 3 % 20} grams" for i in range(60)]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_and_tokenizer(bias: bool = False):
    """The micro model in 4-bit with a LoRA adapter on every linear; bias: q/k/v/o with random biases (as Qwen2's
    q/k/v have: a grouped launch's members each add their own)."""
    tok = train_tokenizer(TEXTS, 384)
    plain = build_preset("micro", tok, seed=0)
    if bias:
        plain = type(plain)(type(plain.config)(**{**plain.config.to_dict(), "attention_bias": True}))
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for m in plain.modules():
                if isinstance(m, torch.nn.Linear) and m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.5)
    with tempfile.TemporaryDirectory() as d:
        save_model(plain, tok, Path(d))
        model = load_causal_lm(d, quantization="4bit")
    peft = add_lora(model, LoraSpec(8, 16.0, LINEARS), "engine.roles.actor", "actor")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B = 0 would make the adapters a no-op
        for name, p in adapter_parameters(peft.get_base_model(), "actor").items():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return peft.get_base_model().eval(), tok


def compiled_step(model) -> dict:
    """The fused decode step (3 rows) under torch.compile: how many graphs dynamo makes of it (explain), and its
    logits through aot_eager (the custom op's fake, functionalisation) against the plain step's, over 3 steps."""
    def state():
        cache = StaticKVCache.allocate(model.config, 3, 8, torch.float32, torch.device("cpu"))
        tokens = torch.tensor([[5], [9], [17]])
        return (model, tokens, torch.zeros(3, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                torch.zeros(3, 8, dtype=torch.bool), cache.keys, cache.values)
    fused = FusedNf4Decode(model)
    fused.enter()
    try:
        with torch.no_grad():
            explained = torch._dynamo.explain(decode_step)(*state())
            compiled = torch.compile(decode_step, backend="aot_eager", dynamic=False)
            plain_args, compiled_args = state(), state()
            diff = max(float((decode_step(*plain_args) - compiled(*compiled_args)).abs().max()) for _ in range(3))
    finally:
        fused.exit()
    return {"graphs": explained.graph_count, "breaks": explained.graph_break_count, "max_diff": diff}


def compiles_across_rollouts(model) -> int:
    """How many graphs dynamo compiles of the fused decode step over two rollouts (the transition entered, two steps,
    left, twice): each entry builds new forwards, adapter copies and input groups; one compile means none of that
    is guarded on (a recompile of the 8B step costs ~60 s a PPO iteration)."""
    torch._dynamo.reset()
    count = {"graphs": 0}

    def backend(gm, _inputs):
        count["graphs"] += 1
        return gm.forward
    compiled = torch.compile(decode_step, backend=backend, dynamic=False)
    fused = FusedNf4Decode(model)
    for _ in range(2):
        fused.enter()
        try:
            with torch.no_grad():
                for _ in range(2):
                    cache = StaticKVCache.allocate(model.config, 3, 8, torch.float32, torch.device("cpu"))
                    compiled(model, torch.tensor([[5], [9], [17]]), torch.zeros(3, 1, dtype=torch.long),
                             torch.zeros(1, dtype=torch.long), torch.zeros(3, 8, dtype=torch.bool), cache.keys,
                             cache.values)
        finally:
            fused.exit()
    return count["graphs"]


def main() -> None:
    model, tok = model_and_tokenizer()
    across = compiles_across_rollouts(model)  # before the counting wrappers below: dynamo guards on their counters
    prompts = [tok(t, add_special_tokens=False)["input_ids"][: 4 + i] for i, t in enumerate(TEXTS[:3])]
    calls = {"rows": [], "members": [], "lora": 0}
    plain_matmul = nf4.group_matmul

    def counted(x, weights, *args, **kwargs):
        calls["rows"].append(x.numel() // x.shape[-1])
        calls["members"].append(len(weights))
        calls["lora"] += len(kwargs.get("loras") or [])
        return plain_matmul(x, weights, *args, **kwargs)
    nf4.group_matmul = counted
    shared = {"calls": 0, "products": 0}  # the grouped LoRA A products (fused_decode.SharedInput)
    plain_product = fused_decode.SharedInput.product

    def counted_product(self, x):
        shared["calls"] += 1
        shared["products"] += self.x is not x
        return plain_product(self, x)
    fused_decode.SharedInput.product = counted_product
    out = {"compiles_across_rollouts": across}
    for fused in (False, True):
        actor = HybridActor(model, tok, fused_4bit=fused)
        with actor.rollout():
            out[str(fused)] = actor.generate(prompts, 6, greedy=True)
            out[f"logp_{fused}"] = actor.last_logprobs
        out["restored"] = not any("forward" in vars(m) or m._forward_pre_hooks for m in model.modules())
    out["fused_calls"], out["fused_linears"], out["lora_calls"] = len(calls["rows"]), sum(calls["members"]), \
        calls["lora"]
    out["members"] = sorted(set(calls["members"]))
    out["shared_calls"], out["shared_products"] = shared["calls"], shared["products"]
    out["fused_rows"] = sorted(set(calls["rows"]))
    for fused in (False, True):  # one prompt: its decode steps are one row, which bitsandbytes' gemv takes
        actor = HybridActor(model, tok, fused_4bit=fused)
        with actor.rollout():
            out[f"one_{fused}"] = actor.generate(prompts[:1], 6, greedy=True)
    out["one_row_fused_calls"] = calls["rows"][out["fused_calls"]:].count(1)
    out["linear4bit"] = len(linear4bit_layers(model))
    biased, _ = model_and_tokenizer(bias=True)
    out["biases"] = sum(m.bias is not None for m in linear4bit_layers(biased))
    for fused in (False, True):
        actor = HybridActor(biased, tok, fused_4bit=fused)
        with actor.rollout():
            out[f"bias_{fused}"] = actor.generate(prompts, 6, greedy=True)
    out["compiled_step"] = compiled_step(model)
    try:
        HybridActor(build_preset("micro", tok, seed=0), tok, fused_4bit=True)
        out["plain_model"] = ""
    except ValueError as e:
        out["plain_model"] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
