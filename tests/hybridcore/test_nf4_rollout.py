"""The native rollout of a 4-bit + LoRA model with its decode linears through the fused NF4 kernel
(hybridcore/fused_decode.py) against bitsandbytes' own path, under Triton's interpreter (nf4_rollout_worker.py,
a process of its own: TRITON_INTERPRET only takes effect before triton is first imported)."""
from pathlib import Path

import pytest

from tests.hybridcore.interpreted import run_interpreted

WORKER = Path(__file__).with_name("nf4_rollout_worker.py")
DECODE_STEPS, NEW_TOKENS, PROMPTS = 5, 6, 3


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(WORKER)


def test_fused_greedy_tokens_equal_the_bitsandbytes_rollout(results):
    """Same greedy tokens, same log-probs to fp32 rounding, with the LoRA deltas of all seven projections applied
    around the fused base (a near-uniform random model: a wrong delta or a wrong weight flips its argmax)."""
    assert len(results["False"]) == PROMPTS and all(len(r) == NEW_TOKENS for r in results["False"])
    assert results["True"] == results["False"]
    for a, b in zip(results["logp_True"], results["logp_False"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5


def test_only_the_decode_steps_go_through_the_kernel_and_the_layers_come_back(results):
    """Every bitsandbytes Linear4bit once per decode step at the batch's rows, through its peft wrapper's forward
    with the adapter's delta (nf4.group_matmul's `loras`); the prefill stays on bitsandbytes; after the rollout the
    layers and wrappers have their own forwards again."""
    assert results["linear4bit"] == 14  # 2 layers x 7 projections
    assert results["fused_linears"] == results["linear4bit"] * DECODE_STEPS
    assert results["lora_calls"] == results["fused_linears"]  # each adapter's delta in the kernel's epilogue
    # per layer q/k/v in one launch and gate/up in one (fused_decode.PACKED), o_proj and down_proj alone: 4 launches
    # for 7 linears; their u = x @ A^T grouped the same way: q/k/v's and gate/up's in one product each (each member
    # asks the group), o_proj and down_proj their own
    assert results["fused_calls"] == 4 / 7 * results["fused_linears"] and results["members"] == [1, 2, 3]
    assert results["shared_calls"] == 5 / 7 * results["lora_calls"] and \
        results["shared_products"] * 5 == results["shared_calls"] * 2
    assert results["fused_rows"] == [PROMPTS]
    assert results["restored"] is True


def test_biased_projections_in_a_grouped_launch(results):
    """q/k/v (and o) with biases, as Qwen2's q/k/v have: the grouped launch's output sliced per member, each adding
    its own bias, gives bitsandbytes' greedy tokens."""
    assert results["biases"] == 8  # 2 layers x q/k/v/o
    assert results["bias_True"] == results["bias_False"] and len(results["bias_True"]) == PROMPTS


def test_a_lone_row_stays_on_bitsandbytes(results):
    """A one-prompt rollout decodes one row a step: bitsandbytes' own gemv kernel is faster there (bench/RESULTS.md
    2026-12-06), so the fused kernel takes no one-row call (its 4-token prefill may go either way), and the tokens
    are bitsandbytes' own."""
    assert results["one_row_fused_calls"] == 0
    assert results["one_True"] == results["one_False"] and len(results["one_True"][0]) == NEW_TOKENS


def test_the_fused_decode_step_compiles_to_one_graph(results):
    """torch.compile sees the kernel as one opaque op (hybridcore::nf4_matmul), so the whole 4-bit + LoRA step is
    one graph: a break inside each attention made dynamo recompile per decoder layer (layer_idx), past its limit,
    on the 8B shape. Through aot_eager (the op's fake shapes, functionalisation) the logits are the plain step's."""
    got = results["compiled_step"]
    assert (got["graphs"], got["breaks"]) == (1, 0), got
    assert got["max_diff"] < 1e-5, got


def test_a_second_rollout_does_not_recompile_the_step(results):
    """Each rollout's entry builds new forwards, adapter copies in the compute dtype and input groups: none of it is
    guarded on, so the compiled step of the first rollout serves the next (one compile over two rollouts of two
    steps each; a recompile of the 8B step would cost ~60 s a PPO iteration)."""
    assert results["compiles_across_rollouts"] == 1


def test_a_model_without_4bit_layers_is_refused(results):
    assert "has no bitsandbytes Linear4bit layer" in results["plain_model"]


@pytest.mark.parametrize("change, expected", [
    ({}, "actor"), ({"active_adapters": ["actor", "critic"]}, None), ({"active_adapters": []}, None),
    ({"merged": True}, None), ({"disable_adapters": True}, None), ({"lora_variant": {"actor": "dora"}}, None),
    ({"active_adapters": ["missing", "actor"]}, "actor")])
def test_only_a_lone_plain_adapter_goes_into_the_kernel(change, expected):
    """The kernel's LoRA epilogue computes base + (B(A(x))) * scaling: a peft wrapper whose forward does anything
    else (several adapters active, merged or disabled adapters, DoRA or another variant) keeps its own forward,
    around the fused base layer."""
    from types import SimpleNamespace

    from hybridcore.adapters import lora_adapter
    wrapper = SimpleNamespace(**{"active_adapters": ["actor"], "lora_A": {"actor": None, "critic": None},
                                 "merged": False, "disable_adapters": False, "lora_variant": {}, **change})
    assert lora_adapter(wrapper) == expected


def test_the_adapter_product_runs_in_the_compute_dtype(monkeypatch):
    """A bf16 layer's decode rows: u = x @ A^T in bf16 and B handed to the kernel in bf16 (copies made once, when
    the forward is built: peft keeps A and B in fp32), the delta's scale fp32; the op is stubbed here, the kernel's
    arithmetic is the interpreted tests' (fp32 layers)."""
    from types import SimpleNamespace

    import torch

    from hybridcore import fused_decode, nf4
    seen = {}

    class Wrapper(SimpleNamespace):
        def forward(self, x):
            raise AssertionError("4 rows: the patched forward, not the wrapper's own")

    def op(x, *args):  # the LoRA operands: one-entry lists, the op taking up to three weights' (group_matmul)
        seen.update(x=x.dtype, u=args[-3][0].dtype, b=args[-2][0].dtype, scale=args[-1][0].dtype,
                    u_value=args[-3][0])
        return x.new_zeros(*x.shape[:-1], 64)
    monkeypatch.setattr(fused_decode, "nf4_matmul", op)
    g = torch.Generator().manual_seed(0)
    a, b = torch.nn.Linear(32, 8, bias=False), torch.nn.Linear(8, 64, bias=False)
    base = SimpleNamespace(compute_dtype=torch.bfloat16, bias=None)
    wrapper = Wrapper(get_base_layer=lambda: base, lora_A={"actor": a}, lora_B={"actor": b},
                      lora_dropout={"actor": torch.nn.Identity()}, scaling={"actor": 2.0})
    packed = torch.zeros(64 * 32 // 2, dtype=torch.uint8)
    weight = nf4.NF4Weight(packed, torch.ones(32), torch.linspace(-1, 1, 16), (64, 32), 64)
    forward = fused_decode.fused_lora_forward(wrapper, "actor", weight, max_rows=16)
    x = torch.randn(4, 32, generator=g).bfloat16()
    assert forward(x).dtype == torch.bfloat16
    assert (seen["x"], seen["u"], seen["b"], seen["scale"]) == (torch.bfloat16,) * 3 + (torch.float32,)
    want = x.float() @ a.weight.detach().bfloat16().float().T
    assert torch.allclose(seen["u_value"].float(), want, rtol=1e-2, atol=1e-2)
    assert a.weight.dtype == b.weight.dtype == torch.float32  # the adapters themselves stay as training keeps them


@pytest.mark.parametrize("change, expected", [
    ({}, True), ({"rank": 4}, False), ({"k": 128}, False), ({"code": 0.5}, False), ({"nested": False}, False),
    ({"dtype": "float16"}, False)])
def test_only_alike_members_share_a_launch(change, expected):
    """fused_decode.packable: q/k/v (or gate/up) share one launch only where one input width and compute dtype,
    one LoRA rank and one K, block layout and NF4 code hold for all (a member that differs: each its own launch)."""
    from types import SimpleNamespace

    import torch

    from hybridcore import fused_decode, nf4
    code = torch.linspace(-1, 1, 16)

    def member(i: int, odd: dict):
        k, nested = odd.get("k", 64), odd.get("nested", True)
        base = SimpleNamespace(in_features=k, compute_dtype=getattr(torch, odd.get("dtype", "bfloat16")))
        second = (torch.ones(1), code, torch.zeros(1)) if nested else ()  # absmax2, code2, offset
        weight = nf4.NF4Weight(torch.zeros(32 * k // 2, dtype=torch.uint8), torch.zeros(32 * k // 64),
                               code * odd.get("code", 1.0), (32, k), 64, *second)
        lora_a = SimpleNamespace(weight=torch.zeros(odd.get("rank", 8), k))
        return SimpleNamespace(get_base_layer=lambda: base, lora_A={"actor": lora_a}), base, weight
    made = [member(i, change if i == 2 else {}) for i in range(3)]
    wrappers = {id(m): "actor" for m, _, _ in made}
    weights = {id(base): w for _, base, w in made}
    assert fused_decode.packable([m for m, _, _ in made], wrappers, weights) is expected