"""Runs the one-pass sampler's kernel (hybridcore/sampling.py) under Triton's interpreter in a process of its own
(TRITON_INTERPRET must be set before anything imports triton): greedy tokens and log-probs against torch's, the
sampled frequencies against softmax(logits / T), the draws' independence and repeatability, then a tiny model's
greedy native rollout (which takes the kernel here) against the torch sampler's; prints JSON for
tests/hybridcore/test_sampling.py to judge. Importing this module imports no triton and sets nothing: main() does."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

BLOCK = 64  # lanes a program: vocabularies of several blocks, the last one partial, at the interpreter's pace
VOCABS = (5, 64, 200)  # under one block, exactly one, three and a bit
DRAWS, TEMPERATURE = 500, 0.7  # ~20 ms of interpreter a row
LEVELS = [0.0, 1.0, 2.0, -1.0, 0.5, 3.0, -2.0, 1.5]  # the logits the frequencies are drawn from


def greedy_cases(torch):
    """Random logits with the awkward rows: a tie for the largest (two columns, the later one in another block),
    every column -inf but one, every column -inf."""
    out = {}
    for vocab in VOCABS:
        g = torch.Generator().manual_seed(vocab)
        x = torch.randn(5, vocab, generator=g) * 4
        x[1, vocab // 3] = x[1, vocab - 1] = x[1].max() + 1
        x[2] = float("-inf")
        x[2, vocab // 2] = 0.5
        x[3] = float("-inf")
        for dtype in (torch.float32, torch.bfloat16):
            out[f"{vocab}-{str(dtype)[6:]}"] = x.to(dtype)
    return out


def kernel_results(torch, sampling) -> dict:
    res = {"greedy": {}, "logp_err": {}, "splits": {v: sampling.splits(5, v, torch.device("cpu")) for v in VOCABS}}
    for name, x in greedy_cases(torch).items():
        tok, lp = sampling.draw(x, greedy=True, fused=True)
        ref_tok, ref_lp = sampling.draw(x, greedy=True, fused=False)
        res["greedy"][name] = tok.tolist() == ref_tok.tolist()
        finite = torch.isfinite(ref_lp)  # the all--inf row: nan in torch's log_softmax
        res["logp_err"][name] = float((lp[finite] - ref_lp[finite]).abs().max())
        res.setdefault("all_inf_row", []).append([int(tok[3]), bool(torch.isnan(lp[3]) or torch.isinf(lp[3]))])
    levels = torch.tensor(LEVELS).repeat(DRAWS, 1)
    torch.manual_seed(0)
    tok, lp = sampling.draw(levels.bfloat16(), temperature=TEMPERATURE, fused=True)
    res["freq"] = (torch.bincount(tok, minlength=len(LEVELS)).float() / DRAWS).tolist()
    res["sampled_logp_err"] = float((lp - torch.log_softmax(levels.bfloat16().float(), -1)
                                     .gather(1, tok[:, None]).squeeze(1)).abs().max())
    few = levels[:40].bfloat16()  # the same seed draws the same tokens; the next call (a new seed) others
    torch.manual_seed(1)
    first, _ = sampling.draw(few, temperature=TEMPERATURE, fused=True)
    torch.manual_seed(1)
    again, _ = sampling.draw(few, temperature=TEMPERATURE, fused=True)
    nxt, _ = sampling.draw(few, temperature=TEMPERATURE, fused=True)
    res["repeats_under_seed"] = again.tolist() == first.tolist()
    res["next_call_differs"] = nxt.tolist() != first.tolist()
    res["rows_differ"] = len(set(first.tolist())) > 1  # rows of equal logits draw independently
    return res


def rollout_results(torch) -> dict:
    """A tiny Llama's greedy native rollout: the kernel picks each token here (TRITON_INTERPRET), against the same
    rollout with the torch sampler; tokens and the rollout's log-probs."""
    from unittest import mock

    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridcore import sampling
    from hybridcore.rollout import NativeRollout
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 200, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    out = {}
    for name, applies in (("fused", sampling.fused_applies), ("torch", lambda *a, **k: False)):
        r = NativeRollout(model, attention="sdpa")
        r.enter()
        with mock.patch.object(sampling, "fused_applies", applies), \
                mock.patch.object(sampling, "_fused", wraps=sampling._fused) as kernel:
            tokens = r.generate(ids, mask, 12, eos_id=None, pad_id=0, greedy=True)
        r.exit()
        out[name] = {"tokens": tokens.tolist(), "logp": r.last_logprobs.tolist(), "kernel_calls": kernel.call_count}
    return out


def main() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from hybridcore import sampling
    sampling.DEFAULTS["block"] = BLOCK
    print(json.dumps({"kernel": kernel_results(torch, sampling), "rollout": rollout_results(torch)}))


if __name__ == "__main__":
    main()
