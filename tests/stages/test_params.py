"""Unit tests for stages.params: presets, validation messages, overrides, --set parsing, refusals."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from hybridcore.errors import InputError, NotYetSupported
from stages.params import (
    Overrides,
    Params,
    check_supported,
    deep_merge,
    load_params,
    parse_sets,
    resolve_preset,
    stage_list,
)

ROOT = Path(__file__).resolve().parents[2]


def _error(overrides: dict, preset: str = "test") -> str:
    """The InputError message load_params gives for `overrides` on `preset`."""
    with pytest.raises(InputError) as exc:
        load_params(preset, overrides)
    return str(exc.value)


# --- presets and defaults -------------------------------------------------------------------------


def test_tiny_preset_loads_with_defaults_filled_in():
    """tiny.yaml loads, keeps its own values and fills every other field with the schema default."""
    p = load_params("tiny")
    assert isinstance(p, Params)
    assert p.pipeline.name == "tiny"
    assert p.model.preset == "tiny"
    assert p.engine.precision == "fp32"
    assert p.sft.epochs == 6
    assert p.ppo.iterations == 40
    assert p.ppo.kl_coef == 0.2  # the file's own: the schema default (below) is 0.05
    # not in the file: schema defaults
    assert p.pipeline.artifacts_dir == "artifacts"
    assert p.pipeline.stages == ["sft", "reward", "ppo", "evaluate"]
    assert p.data.synthetic.n_sft == 4000
    assert p.data.synthetic.carry_error_rate == 0.6
    assert p.data.sft.path is None
    assert p.tracking.experiment == "hybrid-rlhf"
    assert Params().ppo.kl_coef == 0.05


def test_test_preset_loads_with_small_sizes():
    """test.yaml loads with its small sizes and the defaults for everything it leaves out."""
    p = load_params("test")
    assert p.pipeline.name == "test"
    assert p.model.preset == "micro"
    assert p.data.synthetic.n_sft == 64
    assert p.data.synthetic.n_heldout == 16
    assert (p.sft.batch_size, p.sft.micro_batch_size) == (16, 8)
    assert p.ppo.micro_batch_size == 4
    assert p.pipeline.artifacts_dir == "artifacts"
    assert p.data.heldout_fraction == 0.1


def test_default_preset_is_tiny():
    """load_params() with no argument is the tiny preset."""
    assert load_params() == load_params("tiny")


def test_resolve_preset_finds_named_preset():
    """A bare preset name resolves to params/<name>.yaml."""
    path = resolve_preset("tiny")
    assert path.name == "tiny.yaml"
    assert path.is_file()


# --- unknown keys ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, path", [
    ({"kl_coef": 0.1}, "kl_coef"),
    ({"ppo": {"kl_coeff": 0.1}}, "ppo.kl_coeff"),
    ({"data": {"synthetic": {"n_sfts": 3}}}, "data.synthetic.n_sfts"),
    ({"engine": {"roles": {"actor": {"quantisation": "4bit"}}}}, "engine.roles.actor.quantisation"),
])
def test_unknown_key_names_full_path(overrides, path):
    """An unknown key, top level or nested, is an InputError naming its full dotted path on one line."""
    msg = _error(overrides)
    assert "unknown key" in msg
    assert f"'{path}'" in msg
    assert "\n" not in msg


def test_unknown_key_message_names_the_file():
    """The validation message starts from the params file it came from."""
    msg = _error({"ppo": {"kl_coeff": 0.1}})
    assert "test.yaml" in msg


# --- wrong types and bad values -------------------------------------------------------------------


@pytest.mark.parametrize("overrides, path", [
    ({"sft": {"lr": "fast"}}, "sft.lr"),
    ({"ppo": {"iterations": 2.5}}, "ppo.iterations"),
    ({"ppo": {"iterations": "many"}}, "ppo.iterations"),
    ({"pipeline": {"stages": ["sft", "rm"]}}, "pipeline.stages"),
    ({"engine": {"precision": "fp16"}}, "engine.precision"),
    ({"ppo": {"kl_coef": [0.1]}}, "ppo.kl_coef"),
])
def test_wrong_type_names_field(overrides, path):
    """A value of the wrong type is an InputError naming the field path, on one line."""
    msg = _error(overrides)
    assert path in msg
    assert "\n" not in msg


def test_wrong_type_message_shows_the_value():
    """The message quotes the rejected value."""
    assert "'fast'" in _error({"sft": {"lr": "fast"}})


@pytest.mark.parametrize("overrides, path", [
    ({"sft": {"batch_size": 0}}, "sft.batch_size"),
    ({"ppo": {"iterations": -1}}, "ppo.iterations"),
    ({"reward": {"micro_batch_size": 0}}, "reward.micro_batch_size"),
    ({"data": {"synthetic": {"n_heldout": 0}}}, "data.synthetic.n_heldout"),
    ({"data": {"synthetic": {"carry_error_rate": 1.5}}}, "data.synthetic.carry_error_rate"),
    ({"data": {"heldout_fraction": 1.0}}, "data.heldout_fraction"),
])
def test_out_of_range_sizes_are_refused(overrides, path):
    """Zero/negative sizes and out-of-range fractions are refused naming the field."""
    msg = _error(overrides)
    assert path in msg
    assert "\n" not in msg


def test_batch_size_must_be_multiple_of_micro_batch_size():
    """sft.batch_size not a multiple of micro_batch_size is refused naming both."""
    msg = _error({"sft": {"batch_size": 12, "micro_batch_size": 8}})
    assert "batch_size (12)" in msg
    assert "micro_batch_size (8)" in msg
    assert "multiple" in msg
    assert "sft" in msg
    assert "\n" not in msg


def test_ppo_rollout_batch_must_be_multiple_of_minibatch():
    """ppo.rollout_batch_size not a multiple of minibatch_size is refused naming both."""
    msg = _error({"ppo": {"rollout_batch_size": 12, "minibatch_size": 8, "micro_batch_size": 4}})
    assert "rollout_batch_size (12)" in msg
    assert "minibatch_size (8)" in msg


def test_ppo_minibatch_must_be_multiple_of_micro_batch():
    """ppo.minibatch_size not a multiple of micro_batch_size is refused naming both."""
    msg = _error({"ppo": {"minibatch_size": 8, "micro_batch_size": 3}})
    assert "minibatch_size (8)" in msg
    assert "micro_batch_size (3)" in msg


@pytest.mark.parametrize("over, found", [({}, "the actor is none and the backend native"),
                                         ({"engine": {"roles": {"actor": {"quantization": "4bit", "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj"]}}},
                                                      "rollout": {"backend": "vllm"}}}, "backend vllm")])
def test_fused_4bit_decode_needs_a_4bit_actor_and_the_native_rollout(over, found):
    msg = _error({**over, "engine": {**over.get("engine", {}), "rollout": {
        **over.get("engine", {}).get("rollout", {}), "decode_4bit": "fused"}}})
    assert "engine.rollout.decode_4bit: fused" in msg and found in msg and "\n" not in msg


QLORA_ACTOR = {"quantization": "4bit", "lora": {"rank": 4, "alpha": 8, "targets": ["q_proj"]}}


@pytest.mark.parametrize("rollout, actor, device, fused", [
    ({}, QLORA_ACTOR, "cuda", True),                       # the default, auto: the fused kernel on a GPU
    ({}, QLORA_ACTOR, "cpu", False),                       # ... bitsandbytes on a CPU
    ({}, {}, "cuda", False),                               # ... and nothing to fuse without a 4-bit actor
    ({"backend": "vllm"}, QLORA_ACTOR, "cuda", False),     # ... or with vLLM rolling out
    ({"decode_4bit": "bitsandbytes"}, QLORA_ACTOR, "cuda", False),
    ({"decode_4bit": "fused"}, QLORA_ACTOR, "cpu", True),  # asked for: its transition names what it needs
])
def test_decode_4bit_auto_is_the_fused_kernel_on_a_gpu(rollout, actor, device, fused):
    import torch
    from stages.ppo import fused_decode
    p = load_params("test", {"engine": {"rollout": rollout, "roles": {"actor": actor}}})
    assert p.engine.rollout.decode_4bit == rollout.get("decode_4bit", "auto")
    assert fused_decode(p, torch.device(device)) is fused


def test_rollout_attention_reaches_the_native_backend_and_is_checked():
    """engine.rollout.attention (default auto) is the native backend's `attention` option; an unknown value, or
    filled with the vllm backend, is refused naming the field."""
    from stages.ppo import backend_options
    assert backend_options(load_params("test"), [[1, 2]], 4) == {"attention": "auto"}
    p = load_params("test", {"engine": {"rollout": {"attention": "sdpa"}}})
    assert backend_options(p, [[1, 2]], 4) == {"attention": "sdpa"}
    assert "engine.rollout.attention" in _error({"engine": {"rollout": {"attention": "flash"}}})
    msg = _error({"engine": {"rollout": {"attention": "filled", "backend": "vllm"}}})
    assert "engine.rollout.attention: filled" in msg and "backend is vllm" in msg and "\n" not in msg


def test_rollout_chunk_size_must_be_positive():
    msg = _error({"engine": {"rollout": {"chunk_size": 0}}})
    assert "engine.rollout.chunk_size" in msg


# --- overrides and deep_merge ---------------------------------------------------------------------


def test_overrides_deep_merge_onto_preset():
    """An override changes one ppo value and keeps tiny's other ppo (and other sections') values."""
    p = load_params("tiny", {"ppo": {"kl_coef": 0.2}})
    assert p.ppo.kl_coef == 0.2
    assert p.ppo.iterations == 40
    assert p.ppo.rollout_batch_size == 64
    assert p.ppo.ppo_epochs == 4
    assert p.sft.epochs == 6
    assert p.engine.precision == "fp32"


def test_overrides_of_nested_section_keep_siblings():
    """Overriding one synthetic field of test.yaml keeps its other synthetic fields."""
    p = load_params("test", {"data": {"synthetic": {"n_sft": 10}}})
    assert p.data.synthetic.n_sft == 10
    assert p.data.synthetic.n_preferences == 64
    assert p.data.synthetic.n_heldout == 16


def test_deep_merge_does_not_mutate_inputs():
    """deep_merge returns a new nested dict and leaves both inputs as they were."""
    base = {"a": {"x": 1, "y": 2}, "b": 3}
    over = {"a": {"y": 20, "z": 30}, "c": 4}
    out = deep_merge(base, over)
    assert out == {"a": {"x": 1, "y": 20, "z": 30}, "b": 3, "c": 4}
    assert base == {"a": {"x": 1, "y": 2}, "b": 3}
    assert over == {"a": {"y": 20, "z": 30}, "c": 4}


def test_deep_merge_non_dict_replaces():
    """A non-dict override replaces the base value whole (lists are not merged)."""
    assert deep_merge({"s": ["sft", "ppo"]}, {"s": ["sft"]}) == {"s": ["sft"]}
    assert deep_merge({"a": 1}, {"a": {"b": 2}}) == {"a": {"b": 2}}


# --- parse_sets -----------------------------------------------------------------------------------


def test_parse_sets_typed_scalars():
    """--set values are typed YAML: float, list, int, bool, string."""
    out = parse_sets(["ppo.kl_coef=0.2", "pipeline.stages=[sft]", "sft.epochs=3",
                      "engine.share_base=false", "pipeline.name=run1"])
    assert out == {"ppo": {"kl_coef": 0.2}, "pipeline": {"stages": ["sft"], "name": "run1"},
                   "sft": {"epochs": 3}, "engine": {"share_base": False}}
    assert isinstance(out["ppo"]["kl_coef"], float)
    assert isinstance(out["pipeline"]["stages"], list)
    assert isinstance(out["sft"]["epochs"], int)


def test_parse_sets_merges_siblings_and_keeps_equals_in_value():
    """Two keys of one section share a dict; only the first '=' splits key from value."""
    out = parse_sets(["ppo.kl_coef=0.2", "ppo.iterations=5", "pipeline.name=a=b"])
    assert out == {"ppo": {"kl_coef": 0.2, "iterations": 5}, "pipeline": {"name": "a=b"}}


def test_parse_sets_empty_value_is_none():
    """An empty value parses to None."""
    assert parse_sets(["ppo.missing_eos_penalty="]) == {"ppo": {"missing_eos_penalty": None}}


@pytest.mark.parametrize("item", ["ppo.kl_coef", "=0.2", " =1"])
def test_parse_sets_rejects_item_without_key_value(item):
    """An item without '=' or without a key is an InputError quoting it."""
    with pytest.raises(InputError) as exc:
        parse_sets([item])
    assert "expected key.path=value" in str(exc.value)
    assert repr(item) in str(exc.value)


def test_parse_sets_feed_load_params():
    """parse_sets output is a valid overrides dict for load_params."""
    p = load_params("test", parse_sets(["ppo.kl_coef=0.2", "pipeline.stages=[sft]"]))
    assert p.ppo.kl_coef == 0.2
    assert p.pipeline.stages == ["sft"]
    assert p.ppo.iterations == 2


def test_parse_sets_conflicting_items_are_input_error():
    """'ppo=1' followed by 'ppo.kl_coef=0.2' should be an InputError, not a crash."""
    with pytest.raises(InputError):
        parse_sets(["ppo=1", "ppo.kl_coef=0.2"])


# --- YAML files -----------------------------------------------------------------------------------


def test_yaml_file_by_path(tmp_path):
    """A YAML file given by path loads; fields it leaves out get schema defaults."""
    f = tmp_path / "mine.yaml"
    f.write_text("pipeline: {name: mine, seed: 3}\nppo: {kl_coef: 0.3}\n", encoding="utf-8")
    p = load_params(str(f))
    assert p.pipeline.name == "mine"
    assert p.pipeline.seed == 3
    assert p.ppo.kl_coef == 0.3
    assert p.ppo.iterations == 40  # schema default, not tiny's or test's
    assert p.model.preset == "tiny"


def test_yml_suffix_and_overrides_on_file(tmp_path):
    """A .yml file works too, and overrides merge onto it."""
    f = tmp_path / "mine.yml"
    f.write_text("ppo:\n  kl_coef: 0.3\n  iterations: 7\n", encoding="utf-8")
    p = load_params(str(f), {"ppo": {"kl_coef": 0.4}})
    assert p.ppo.kl_coef == 0.4
    assert p.ppo.iterations == 7


def test_empty_yaml_file_is_all_defaults(tmp_path):
    """An empty YAML file is the schema defaults."""
    f = tmp_path / "empty.yaml"
    f.write_text("", encoding="utf-8")
    assert load_params(str(f)) == Params()


def test_validation_error_names_user_file(tmp_path):
    """A validation error in a user file names that file and the field."""
    f = tmp_path / "bad.yaml"
    f.write_text("sft: {lr: fast}\n", encoding="utf-8")
    with pytest.raises(InputError) as exc:
        load_params(str(f))
    assert str(f) in str(exc.value)
    assert "sft.lr" in str(exc.value)


def test_missing_preset_lists_available_names():
    """An unknown preset name is an InputError listing the presets that exist."""
    with pytest.raises(InputError) as exc:
        load_params("no-such-preset")
    msg = str(exc.value)
    assert "no-such-preset" in msg
    assert "not found" in msg
    assert "tiny" in msg
    assert "test" in msg


def test_missing_yaml_path_is_input_error(tmp_path):
    """A .yaml path that does not exist is an InputError naming it."""
    missing = tmp_path / "nope.yaml"
    with pytest.raises(InputError) as exc:
        load_params(str(missing))
    assert str(missing) in str(exc.value)
    assert "not found" in str(exc.value)


def test_directory_path_is_input_error(tmp_path):
    """A path to a directory is an InputError, not a crash."""
    with pytest.raises(InputError, match="not found"):
        load_params(str(tmp_path))


def test_top_level_list_is_input_error(tmp_path):
    """A YAML file whose top level is a list is an InputError saying a mapping was expected."""
    f = tmp_path / "list.yaml"
    f.write_text("- pipeline\n- sft\n", encoding="utf-8")
    with pytest.raises(InputError) as exc:
        load_params(str(f))
    assert "expected a mapping" in str(exc.value)
    assert "list" in str(exc.value)


def test_invalid_yaml_is_input_error(tmp_path):
    """A file that is not valid YAML is a one-line InputError naming the file."""
    f = tmp_path / "broken.yaml"
    f.write_text("ppo: {kl_coef: [0.1\nsft: :\n", encoding="utf-8")
    with pytest.raises(InputError) as exc:
        load_params(str(f))
    msg = str(exc.value)
    assert "not valid YAML" in msg
    assert str(f) in msg
    assert "\n" not in msg


def test_non_utf8_yaml_is_input_error(tmp_path):
    """A file that is not UTF-8 is an InputError, not a UnicodeDecodeError."""
    f = tmp_path / "latin.yaml"
    f.write_bytes(b"pipeline: {name: caf\xe9}\n")
    with pytest.raises(InputError, match="not valid YAML"):
        load_params(str(f))


# --- Overrides model ------------------------------------------------------------------------------


def test_overrides_model_accepts_partial_values():
    """Overrides takes any subset of the schema; everything else is None."""
    o = Overrides.model_validate({"ppo": {"kl_coef": 0.1}})
    assert o.ppo.kl_coef == 0.1
    assert o.ppo.iterations is None
    assert o.sft is None
    assert o.model_dump(exclude_none=True) == {"ppo": {"kl_coef": 0.1}}


def test_overrides_model_dump_feeds_load_params():
    """Overrides dumped without Nones merge onto a preset like a plain dict."""
    o = Overrides.model_validate({"ppo": {"kl_coef": 0.1}, "pipeline": {"stages": ["sft"]}})
    p = load_params("tiny", o.model_dump(exclude_none=True))
    assert p.ppo.kl_coef == 0.1
    assert p.ppo.iterations == 40
    assert p.pipeline.stages == ["sft"]


@pytest.mark.parametrize("value", [{"ppo": {"kl_coeff": 0.1}}, {"kl_coef": 0.1}, {"engine": {"roles": {"x": {}}}}])
def test_overrides_model_rejects_unknown_key(value):
    """An unknown key, top level or nested, is a pydantic ValidationError in Overrides."""
    with pytest.raises(ValidationError):
        Overrides.model_validate(value)


@pytest.mark.parametrize("value", [{"ppo": {"kl_coef": "x"}}, {"pipeline": {"stages": ["rm"]}},
                                   {"sft": {"epochs": "many"}}])
def test_overrides_model_rejects_wrong_type(value):
    """A wrong type or literal is a pydantic ValidationError in Overrides."""
    with pytest.raises(ValidationError):
        Overrides.model_validate(value)


# --- check_supported ------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, names", [
    ({"engine": {"layout": {"dp": 2}, "roles": {"actor": {"lora": {"rank": 4, "alpha": 8, "targets": ["q_proj"]}}}}},
     "engine.layout.dp=2 with LoRA"),
    ({"engine": {"layout": {"tp": 2}, "roles": {"actor": {"lora": {"rank": 4, "alpha": 8, "targets": ["q_proj"]}}}}},
     "engine.layout.tp=2 with LoRA"),
    ({"engine": {"layout": {"zero_stage": 3, "offload_params": True}, "rollout": {"backend": "vllm"}}},
     "engine.layout.zero_stage=3 with engine.rollout.backend=vllm"),
    ({"engine": {"layout": {"zero_stage": 3}, "roles": {"actor": {"lora": {"rank": 4, "alpha": 8,
                                                                              "targets": ["q_proj"]}}}}},
     "engine.layout.zero_stage=3"),
    ({"engine": {"layout": {"tp": 2}, "rollout": {"backend": "vllm"}}}, "engine.layout.tp=2 with engine.rollout"),
])
def test_not_yet_supported_options_are_refused(overrides, names):
    """Engine options not built yet raise NotYetSupported (an InputError) naming the option."""
    with pytest.raises(NotYetSupported) as exc:
        load_params("test", overrides)
    assert isinstance(exc.value, InputError)
    assert "not supported yet" in str(exc.value)
    assert names in str(exc.value)


def test_check_supported_accepts_defaults_and_presets():
    """The schema defaults and both presets pass check_supported."""
    check_supported(Params())
    check_supported(load_params("tiny"))
    check_supported(load_params("test"))


def test_check_supported_on_a_params_object():
    """check_supported itself refuses an unsupported option set on a Params object."""
    p = Params.model_validate({"engine": {"layout": {"tp": 2}, "memory_budget_gib": 4}})
    with pytest.raises(NotYetSupported, match="not supported yet"):
        check_supported(p)


# --- stage_list -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stages, expected", [
    (["sft"], ["sft"]),
    (["sft", "reward"], ["sft", "reward"]),
    (["evaluate", "ppo", "sft"], ["sft", "ppo", "evaluate"]),
    (["sft", "dpo", "evaluate"], ["sft", "dpo", "evaluate"]),
    (["sft", "reward", "dpo", "evaluate"], ["sft", "reward", "dpo", "evaluate"]),
])
def test_stage_list_in_pipeline_order(stages, expected):
    """stage_list is the listed stages in pipeline order (a reward function stands in for a missing RM)."""
    p = load_params("test", {"pipeline": {"stages": stages}, "ppo": {"reward_function": __file__ + ":f",
                                                                 "critic_init": "sft"}})
    assert stage_list(p) == expected


@pytest.mark.parametrize("stages, ppo, says", [
    (["ppo"], {}, "ppo reads the sft stage's artifact, but sft is not listed"),
    (["reward", "ppo"], {}, "reward reads the sft stage's artifact"),
    (["sft", "dpo", "ppo", "evaluate"], {}, "both ppo and dpo listed"),
    (["sft", "reward", "evaluate"], {}, "neither ppo nor dpo is listed"),
    (["sft", "ppo", "evaluate"], {}, "ppo.reward_function: null, and pipeline.stages has no reward stage"),
    (["sft", "ppo", "evaluate"], {"reward_function": "f.py:g"}, "ppo.critic_init: reward, but pipeline.stages"),
    (["sft", "reward", "ppo"], {"reward_model_weight": 0}, "ppo.reward_model_weight: 0 with no"),
    (["sft", "sft"], {}, "names a stage twice"),
])
def test_stage_list_refused(stages, ppo, says):
    """A stage whose inputs are not listed, two policy stages, or PPO with nothing to learn from: one line."""
    msg = _error({"pipeline": {"stages": stages}, "ppo": ppo})
    assert says in msg and "\n" not in msg, msg


def test_critic_free_needs_groups():
    """grpo and rloo with one sample per prompt are refused naming the field; minibatches count sequences."""
    msg = _error({"ppo": {"estimator": "grpo"}})
    assert "ppo" in msg and "samples_per_prompt=1, expected at least 2" in msg, msg
    p = load_params("test", {"ppo": {"estimator": "rloo", "samples_per_prompt": 4, "rollout_batch_size": 8,
                                     "minibatch_size": 32, "micro_batch_size": 8}})
    assert p.ppo.samples_per_prompt == 4


def test_stage_list_default_is_every_stage():
    """With the default stages, every stage runs."""
    assert stage_list(load_params("tiny")) == ["sft", "reward", "ppo", "evaluate"]


def test_empty_stage_list_is_input_error():
    """pipeline.stages: [] should be refused as an InputError (by load_params or stage_list)."""
    try:
        p = load_params("test", {"pipeline": {"stages": []}})
    except InputError:
        return
    with pytest.raises(InputError):
        stage_list(p)


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "params").glob("*.yaml")))
def test_every_shipped_preset_validates_and_is_supported(preset):
    """Every preset in params/ loads and passes the up-front engine checks (a preset that names a local model
    folder still needs that folder, which only the run itself checks)."""
    check_supported(load_params(preset))


def test_writeup_preset_keeps_the_writeups_settings():
    """The verl write-up's recipe, as its readers will look for it: 4-bit, micro-batch 2 x accumulation 4,
    sequence 2048, memory-efficient attention, ZeRO-1 + CPU offload."""
    p = load_params("llama3-8b-writeup")
    assert {getattr(p.engine.roles, r).quantization for r in ("actor", "critic", "reference", "reward")} == {"4bit"}
    for stage in (p.sft, p.reward):
        assert (stage.micro_batch_size, stage.batch_size // stage.micro_batch_size, stage.max_seq_len) == (2, 4, 2048)
    assert (p.ppo.micro_batch_size, p.ppo.minibatch_size // p.ppo.micro_batch_size, p.ppo.max_new_tokens) == (2, 4, 1024)
    assert p.engine.attention == "sdpa" and p.engine.share_base
    assert (p.engine.layout.zero_stage, p.engine.layout.offload_optimizer) == (1, True)
