"""hybridcore/qlora_linear.py: peft's 4-bit LoRA layers computing through one autograd function."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from hybridcore import qlora_linear
from hybridcore.adapters import LoraSpec, adapter_parameters, add_lora, lora_wrappers, mixed_precision, use_adapter
from hybridcore.batch import pack
from hybridcore.forward import response_logprobs
from hybridcore.models import load_causal_lm

from tests.hybridcore.test_adapters import TEXTS, folder, tok  # noqa: F401 -- the micro model's fixtures

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def batch(tok):
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS[:5]]
    return pack([x[:5 + i] for i, x in enumerate(ids)], [x[8:11 + i] for i, x in enumerate(ids)], tok.pad_token_id)


def qlora_model(folder, precision: str = "fp32"):
    """The micro model in 4-bit with a LoRA adapter on all seven linears, its B random (B = 0 is a no-op)."""
    model = add_lora(load_causal_lm(str(folder), quantization="4bit", precision=precision),
                     LoraSpec(8, 16.0, LINEARS), "engine.roles.actor", "actor").get_base_model()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapter_parameters(model, "actor").items():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.train()


def logprobs_and_grads(model, batch):
    with mixed_precision(model):
        lp = response_logprobs(model, batch)
    (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
    grads = {n: p.grad.clone() for n, p in adapter_parameters(model, "actor").items()}
    model.zero_grad(set_to_none=True)
    return lp.detach(), grads


class Ops(TorchDispatchMode):
    """aten ops by name, for those whose output has `width` columns and `rows` rows (a linear's output)."""

    def __init__(self, rows: int, widths: set[int]):
        super().__init__()
        self.rows, self.widths, self.seen = rows, widths, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[-1] in self.widths \
                and out.numel() // out.shape[-1] == self.rows:
            self.seen[func.overloadpacket.__name__] += 1
        return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_layers_give_peft_outputs_and_adapter_gradients(folder, batch, precision):
    """Log-probs and every adapter gradient of the fused layers equal peft's own forward's (fp32: to rounding;
    bf16 under autocast: to bf16's, one rounding fewer here), and the fused function is what ran."""
    fused = qlora_model(folder, precision)
    plain = copy.deepcopy(fused)
    assert qlora_linear.install(plain, fused=False) == len(LINEARS) * fused.config.num_hidden_layers
    assert all(type(m).forward is qlora_linear.qlora_forward for m in lora_wrappers(fused))
    calls = Counter()
    apply = qlora_linear.QLoraProduct.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qlora_linear.QLoraProduct, "apply", lambda *a: calls.update(["fused"]) or apply(*a))
        lp, grads = logprobs_and_grads(fused, batch)
        lp_peft, grads_peft = logprobs_and_grads(plain, batch)
    assert calls["fused"] == len(LINEARS) * fused.config.num_hidden_layers
    tol = {"fp32": dict(rtol=1e-5, atol=1e-5), "bf16": dict(rtol=0.05, atol=0.05)}[precision]
    assert_close(lp, lp_peft, **tol)
    for name, g in grads.items():
        assert g.dtype == torch.float32 and g.abs().sum() > 0, name
        if precision == "fp32":
            assert_close(g, grads_peft[name], rtol=1e-4, atol=1e-6)
        else:
            cos = torch.nn.functional.cosine_similarity(g.flatten(), grads_peft[name].flatten(), dim=0)
            assert cos > 0.99, (name, cos)


def test_one_layer_writes_its_output_once_forward_and_backward(folder):
    """Where peft clones the base output, scales the delta and adds it (and backward sums the input's two
    gradients), the fused layer makes its output and x's gradient by matrix products alone: no clone, multiply or
    add of a [tokens, out] or [tokens, in] tensor."""
    layer = lora_wrappers(qlora_model(folder))[0]
    x = torch.randn(2, 6, layer.in_features, requires_grad=True)
    grad = torch.randn(2, 6, layer.out_features)
    seen = {}
    for fused in (True, False):
        qlora_linear.install(layer, fused=fused)
        with Ops(12, {layer.in_features, layer.out_features}) as ops:
            layer(x).backward(grad)
        seen[fused] = ops.seen
    assert {"clone", "mul", "add"} <= set(seen[False]), seen[False]  # what peft does (the test can see it)
    assert not {"clone", "mul", "add", "copy_"} & set(seen[True]), seen[True]
    assert seen[True]["addmm_"] == 2, seen[True]


def test_fused_layers_under_activation_checkpointing(folder, batch):
    """Non-reentrant checkpointing re-runs the layers' forwards in backward: the same gradients as without it."""
    model = qlora_model(folder)
    _, grads = logprobs_and_grads(model, batch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, again = logprobs_and_grads(model, batch)
    for name, g in grads.items():
        assert_close(again[name], g, rtol=1e-5, atol=1e-7)


def test_what_falls_back_to_peft(folder, batch):
    """One row (bitsandbytes' inference kernel), adapters off (the reference), a merged adapter, an active dropout
    and another dtype without autocast take peft's forward, and give its outputs."""
    model = qlora_model(folder)
    calls = Counter()
    apply = qlora_linear.QLoraProduct.apply
    layer = lora_wrappers(model)[0]
    x = torch.randn(1, 1, layer.in_features)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qlora_linear.QLoraProduct, "apply", lambda *a: calls.update(["fused"]) or apply(*a))
        layer(x)
        with use_adapter(model, None), torch.no_grad():
            response_logprobs(model, batch)
        layer.lora_dropout["actor"] = torch.nn.Dropout(0.5)
        layer(torch.randn(3, layer.in_features))
        layer.lora_dropout["actor"] = torch.nn.Identity()
        layer(torch.randn(3, layer.in_features, dtype=torch.float64).to(torch.bfloat16))
        assert calls["fused"] == 0
        layer(torch.randn(3, layer.in_features))
        assert calls["fused"] == 1


def test_install_is_idempotent_and_keeps_peft_classes(folder):
    model = qlora_model(folder)
    from peft.tuners.lora.bnb import Linear4bit
    n = len(LINEARS) * model.config.num_hidden_layers
    assert qlora_linear.install(model) == 0  # add_lora installed it
    assert all(isinstance(m, Linear4bit) for m in lora_wrappers(model))
    assert qlora_linear.install(model, fused=False) == n and qlora_linear.install(model, fused=False) == 0
    assert all(type(m) is Linear4bit for m in lora_wrappers(model))
    assert qlora_linear.install(model) == n
