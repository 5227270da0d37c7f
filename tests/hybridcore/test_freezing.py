"""The autograd check: frozen parameters still tracked by autograd are found and named; the trained-only
state of a LoRA model round-trips through the checkpoint format."""
import pytest
import torch
from safetensors.torch import load_model, save_model

from hybridcore.freezing import FreezingError, TrainableState, assert_frozen, freeze, tracked_frozen
from hybridcore.optim import adamw


def two_models():
    torch.manual_seed(0)
    trained = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 1))
    ref = freeze(torch.nn.Sequential(torch.nn.Linear(32, 32)))
    return trained, ref


def test_clean_setup_has_nothing_tracked():
    """Trained parameters in the optimiser, the rest frozen: nothing to report."""
    trained, ref = two_models()
    opt = adamw(trained, 1e-3)
    assert tracked_frozen({"actor": trained, "reference": ref}, trained.parameters()) == []
    assert_frozen("ppo", {"actor": trained, "reference": ref}, [opt])


def test_planted_requires_grad_is_found_and_named():
    """A frozen model's weight left with requires_grad=True is reported by name, and assert_frozen raises."""
    trained, ref = two_models()
    opt = adamw(trained, 1e-3)
    ref[0].bias.requires_grad_(True)
    assert tracked_frozen({"actor": trained, "reference": ref}, trained.parameters()) == ["reference.0.bias"]
    with pytest.raises(FreezingError, match=r"^ppo: 1 parameter\(s\) no optimiser updates .*reference\.0\.bias"):
        assert_frozen("ppo", {"actor": trained, "reference": ref}, [opt])


def test_parameter_outside_the_optimiser_is_found():
    """A parameter that requires grad but was left out of the optimiser (half of a model) is found too, and so is
    a frozen one that still holds a .grad."""
    trained, ref = two_models()
    opt = torch.optim.AdamW(trained[1].parameters(), lr=1e-3)
    ref[0].weight.grad = torch.zeros_like(ref[0].weight)
    found = tracked_frozen({"actor": trained, "reference": ref},
                           [p for g in opt.param_groups for p in g["params"]])
    assert found == ["actor.0.weight", "actor.0.bias", "reference.0.weight"]


def test_trainable_state_round_trips_through_safetensors(tmp_path):
    """Checkpoints of a LoRA run hold only the trained parameters, and load back into them."""
    trained, _ = two_models()
    trained[0].requires_grad_(False)
    state = TrainableState.of(trained)
    assert list(state.state_dict()) == ["1.weight", "1.bias"]
    save_model(state, str(tmp_path / "actor.safetensors"))
    saved = {k: v.clone() for k, v in state.state_dict().items()}
    with torch.no_grad():
        trained[1].weight.add_(1.0)
    load_model(state, str(tmp_path / "actor.safetensors"))
    assert all(torch.equal(state.state_dict()[k], saved[k]) for k in saved)
    with pytest.raises(RuntimeError, match="Missing key"):
        load_model(TrainableState.of(torch.nn.Linear(32, 2)), str(tmp_path / "actor.safetensors"))
