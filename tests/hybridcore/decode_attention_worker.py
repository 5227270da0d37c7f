"""Runs the decode attention kernels (hybridcore/decode_attention.py) under Triton's interpreter in a process of its
own (TRITON_INTERPRET must be set before anything imports triton, and in the test session torch.compile imports it
first): the kernels on random inputs, then a tiny grouped-query model's greedy native rollout through them and
through SDPA (one process: its imports cost more CPU than the kernels); prints JSON for
tests/hybridcore/test_decode_attention.py to judge. Importing this module (the test does, for CASES and the sizes)
imports no triton and sets nothing: main() does."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

B, H, C = 3, 2, 96  # 3 chunks of SMALL's 32 columns
SMALL = dict(chunk=32, block_n=16)  # several chunks and tiles at a size the interpreter runs in about a second
# (query heads a KV head, head_dim, dtype, filled): filled 45 ends inside a chunk and inside a tile, 1 is the first
# column alone, 96 the whole cache
CASES = [(g, d, dtype, filled) for g, d, dtype, runs in [
    (1, 64, "float32", (1, 45, 96)), (4, 128, "bfloat16", (1, 45, 96)), (6, 64, "bfloat16", (45,)),
    (6, 128, "float32", (45, 96)), (4, 64, "float32", (45,))] for filled in runs]
PROMPTS, NEW_TOKENS = 4, 20  # the rollout: prompts of 5, 12, 1 and 20 tokens, decode steps write columns 20 to 38
ROLLOUT_TILES = dict(chunk=32, block_n=32)  # of 64, so they cross from the first chunk into the second


def inputs(g: int, d: int, dtype: str, filled: int, capacity: int = C, seed: int = 0):
    """Random q, k, v; row 0 attends everywhere, row 1 is left-padded past its first chunk (chunk 0 all masked,
    chunk 1 half), row 2 has a 5-column hole; columns from `filled` on are NaN in k and v and True in the mask, so
    any read of them shows."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1000 * g + d + filled)
    q = torch.randn(B, H, g, d, generator=gen).to(getattr(torch, dtype))
    k, v = (torch.randn(B, H, capacity, d, generator=gen).to(q.dtype) for _ in range(2))
    k[:, :, filled:], v[:, :, filled:] = float("nan"), float("nan")
    mask = torch.ones(B, capacity, dtype=torch.bool)
    mask[1, :40], mask[2, 3:8] = False, False
    return q, k, v, mask, torch.tensor([filled])


def error(got, q, k, v, mask, filled) -> float:
    """Max |got - reference| relative to the max |reference|; -1 for a wrong shape or dtype or a NaN."""
    from hybridcore import decode_attention

    ref = decode_attention.reference(q, k, v, mask, filled, q.shape[-1] ** -0.5)
    if got.shape != q.shape or got.dtype != q.dtype or bool(got.isnan().any()):
        return -1.0
    return float((got.float() - ref).abs().max() / ref.abs().max())


def rollout(model, tok, prompts, attention: str) -> dict:
    """One greedy rollout with `attention`, recording the (batch, query rows) of every launch of the kernels."""
    from hybridcore import decode_attention
    from hybridcore.actor import HybridActor

    calls = []
    launch = decode_attention.launch

    def counted(q, *args, **kwargs):
        calls.append(list(q.shape[::2]))
        return launch(q, *args, **kwargs)
    decode_attention.launch = counted
    try:
        actor = HybridActor(model, tok, backend_options={"attention": attention})
        with actor.rollout():
            tokens = actor.generate(prompts, NEW_TOKENS, greedy=True)
            logps = actor.last_logprobs
    finally:
        decode_attention.launch = launch
    return {"tokens": tokens, "logps": logps, "calls": calls, "attention": actor.backend.last_stats["attention"]}


def compiled_step(model) -> dict:
    """The decode step (3 rows, attention filled) under torch.compile: how many graphs dynamo makes of it
    (explain), and its logits through aot_eager (the custom op's fake, functionalisation) against the plain step's
    and SDPA's over 3 steps."""
    import torch
    from hybridcore.rollout import NativeRollout, StaticKVCache, decode_step

    def state():
        cache = StaticKVCache.allocate(model.config, 3, 8, torch.float32, torch.device("cpu"))
        return (model, torch.tensor([[5], [9], [17]]), torch.zeros(3, 1, dtype=torch.long),
                torch.zeros(1, dtype=torch.long), torch.zeros(3, 8, dtype=torch.bool), cache.keys, cache.values)
    backend = NativeRollout(model)
    backend.enter()  # the model's attention: grouped_attention
    try:
        with torch.no_grad():
            explained = torch._dynamo.explain(decode_step)(*state(), "filled")
            compiled = torch.compile(decode_step, backend="aot_eager", dynamic=False)
            plain, graph, sdpa = state(), state(), state()
            diff = sdpa_diff = 0.0
            for _ in range(3):
                want = decode_step(*plain, "filled")
                diff = max(diff, float((compiled(*graph, "filled") - want).abs().max()))
                sdpa_diff = max(sdpa_diff, float((decode_step(*sdpa, "sdpa") - want).abs().max()))
    finally:
        backend.exit()
    return {"graphs": explained.graph_count, "breaks": explained.graph_break_count, "max_diff": diff,
            "sdpa_diff": sdpa_diff}


def kernels() -> dict:
    """The kernels against `reference` on CASES and a few special inputs."""
    import torch
    from hybridcore import decode_attention

    out = {"err": {}}
    for g, d, dtype, filled in CASES:
        args = inputs(g, d, dtype, filled)
        out["err"][f"{g}-{d}-{dtype}-{filled}"] = error(decode_attention.launch(*args, d ** -0.5, **SMALL), *args)
    args = inputs(6, 128, "bfloat16", 150, capacity=160)  # default tiles: 2 chunks of 128, the second part-filled
    out["err"]["defaults"] = error(decode_attention.attend(*args, 128 ** -0.5), *args)
    q, k, v, mask, filled = inputs(4, 64, "float32", 45)
    got = decode_attention.launch(q, k, v, mask, filled, 0.125, **SMALL)
    scalar = decode_attention.launch(q, k, v, mask, filled.to(torch.int32).reshape(()), 0.125, **SMALL)
    out["int32_scalar_filled"] = float((scalar - got).abs().max())
    q, k, v, mask, filled = inputs(4, 64, "float32", C)
    past, whole = (decode_attention.launch(q, k, v, mask, f, 0.125, **SMALL) for f in (torch.tensor([C + 50]), filled))
    out["filled_past_capacity"] = float((past - whole).abs().max())
    q, k, v, mask, filled = inputs(4, 64, "float32", 1)  # row 1's one column is masked
    out["masked_row"] = float(decode_attention.launch(q, k, v, mask, filled, 0.125, **SMALL)[1].abs().max())
    out["self_check"] = {f"{d}-{g}-{dtype}": decode_attention.self_check(d, g, getattr(torch, dtype),
                                                                          torch.device("cpu"))
                         for d, g, dtype in ((128, 6, "bfloat16"), (64, 1, "float32"))}
    return out


def rollouts() -> dict:
    """The rollout with attention "sdpa" and "filled", and the compiled decode step."""
    from hybridcore import decode_attention
    from hybridcore.models import train_tokenizer
    from tests.hybridcore.test_actor import make_texts, with_likely_eos
    from tests.hybridcore.test_rollout import LENGTHS, gqa_model

    tok = train_tokenizer(make_texts(), 384)
    texts = make_texts(2 * len(LENGTHS), seed=7)
    prompts = [tok(texts[2 * i] + ". " + texts[2 * i + 1], add_special_tokens=False)["input_ids"][:n]
               for i, n in enumerate(LENGTHS[:PROMPTS])]
    model = with_likely_eos(gqa_model(tok, seed=1), tok, prompts, NEW_TOKENS)  # head_dim 32, 2 query heads a KV
    decode_attention.DEFAULTS["partials"].update(ROLLOUT_TILES)
    out = {attention: rollout(model, tok, prompts, attention) for attention in ("sdpa", "filled")}
    out["compiled_step"] = compiled_step(model)
    return out


def main() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    print(json.dumps({**kernels(), "rollouts": rollouts()}))


if __name__ == "__main__":
    main()
