"""Corpus of bad params: each goes through load_params + preflight (the CLI's order), ends as one InputError
line naming the field, what was found and what was expected, and costs no artifact already built."""
from __future__ import annotations

import pickle
import shutil
from collections import namedtuple

import pytest

from hybridcore.artifacts import read_verified
from hybridcore.errors import InputError, NotYetSupported
from stages import checks
from stages.checks import preflight
from stages.params import deep_merge, load_params, parse_sets
from tests.inputs.helpers import check, params_for, refuse, write_jsonl

# overrides on params/test.yaml (micro preset: 256 positions; sft/reward batch 16 of micro 8; ppo rollout 16,
# minibatch 8, micro 4; 64 built-in examples of each kind) -> texts the one-line message must hold
OVERRIDES = {
    "unknown nested key": ({"engine": {"layout": {"dp_size": 2}}}, ["unknown key 'engine.layout.dp_size'"]),
    "unknown section": ({"trainer": {"lr": 1e-4}}, ["unknown key 'trainer'"]),
    "string for an integer": ({"sft": {"epochs": "three"}}, ["sft.epochs", "valid integer", "'three'"]),
    "boolean for an integer": ({"ppo": {"iterations": True}}, ["ppo.iterations", "not a boolean", "True"]),
    "scalar for a section": ({"ppo": 5}, ["ppo", "valid dictionary", "got 5"]),
    "unknown choice": ({"ppo": {"kl_estimator": "k4"}}, ["ppo.kl_estimator", "'k1', 'k2' or 'k3'", "'k4'"]),
    "negative size": ({"ppo": {"rollout_batch_size": -8}}, ["ppo.rollout_batch_size", "greater than 0", "-8"]),
    "zero max_seq_len": ({"sft": {"max_seq_len": 0}}, ["sft.max_seq_len", "greater than 0", "got 0"]),
    "zero evaluate.batch_size": ({"evaluate": {"batch_size": 0}}, ["evaluate.batch_size", "greater than 0"]),
    "infinite learning rate": ({"reward": {"lr": float("inf")}}, ["reward.lr", "finite number", "inf"]),
    "nan kl_coef": ({"ppo": {"kl_coef": float("nan")}}, ["ppo.kl_coef", "finite number", "nan"]),
    "empty stage list": ({"pipeline": {"stages": []}}, ["pipeline.stages", "at least 1 item", "got []"]),
    "empty artifacts_dir": ({"pipeline": {"artifacts_dir": ""}}, ["pipeline.artifacts_dir", "at least 1 character"]),
    "a NUL byte in artifacts_dir": ({"pipeline": {"artifacts_dir": "art\0facts"}},
                                    ["pipeline.artifacts_dir", "'art\\x00facts' is not a usable path", "NUL byte"]),
    "empty run name": ({"pipeline": {"name": ""}}, ["pipeline.name", "at least 1 character"]),
    "micro_batch_size > batch_size": ({"sft": {"micro_batch_size": 32}},
                                      ["sft", "micro_batch_size (32) is larger than batch_size (16)"]),
    "minibatch not dividing the rollout batch": (
        {"ppo": {"rollout_batch_size": 20, "minibatch_size": 8}},
        ["ppo", "rollout_batch_size (20) must be a multiple of minibatch_size (8)"]),
    "ppo micro batch > minibatch": ({"ppo": {"micro_batch_size": 16}},
                                    ["ppo", "micro_batch_size (16) is larger than minibatch_size (8)"]),
    "ppo.max_new_tokens fills the context": (
        {"ppo": {"max_new_tokens": 256}}, ["ppo.max_new_tokens (256)", "256 positions, preset micro",
                                           "expected fewer than 256"]),
    "evaluate.max_new_tokens past the context": (
        {"evaluate": {"max_new_tokens": 300}}, ["evaluate.max_new_tokens (300)", "256 positions"]),
    "sft.max_seq_len past the context": (
        {"sft": {"max_seq_len": 512}}, ["sft.max_seq_len (512)", "longer than the model's context",
                                        "expected at most 256"]),
    "fewer built-in examples than a batch": (
        {"data": {"synthetic": {"n_sft": 8}}}, ["data.synthetic.n_sft (8) is smaller than sft.batch_size (16)"]),
    "fewer built-in prompts than a rollout batch": (
        {"data": {"synthetic": {"n_prompts": 8}}},
        ["data.synthetic.n_prompts (8) is smaller than ppo.rollout_batch_size (16)"]),
    "an engine option not built yet": (
        {"engine": {"layout": {"tp": 2}, "rollout": {"backend": "vllm"}}},
        ["engine.layout.tp=2 with engine.rollout.backend=vllm", "not supported yet", "3D sharding issue"]),
    "a rollout tp that does not divide the training tp": (
        {"engine": {"layout": {"tp": 2}, "rollout": {"tp": 4}}},
        ["engine.rollout.tp: found 4", "expected a divisor of engine.layout.tp=2"]),
    "a tp that does not divide the model's heads": (
        {"engine": {"layout": {"tp": 4}}},
        ["engine.layout.tp=4", "num_attention_heads=2", "expected a tp that divides num_attention_heads (2)"]),
}


@pytest.mark.parametrize("case", list(OVERRIDES))
def test_bad_params_are_refused(case, built):
    """A bad or conflicting value is one InputError line naming the field; the built artifact survives."""
    overrides, expected = OVERRIDES[case]
    refuse(built, check(built, overrides), *expected)


YamlCase = namedtuple("YamlCase", "text expected")
YAML = {
    "a key holding a line break": YamlCase('"ppo\\nkl_coef": 0.1\n', ["unknown key", "'ppo\\nkl_coef'"]),
    "a non-string key": YamlCase("1: {}\n", ["Keys should be strings"]),
    "a top-level scalar": YamlCase("just some text\n", ["expected a mapping", "got str"]),
    "broken YAML": YamlCase("sft: {lr: 0.1\nppo: [\n", ["not valid YAML"]),
}


@pytest.mark.parametrize("case", list(YAML))
def test_bad_params_files_are_refused(case, built, tmp_path):
    """A params file the schema cannot read is one InputError line naming the file; the artifact survives."""
    f = tmp_path / "bad.yaml"
    f.write_text(YAML[case].text, encoding="utf-8")
    msg = refuse(built, lambda: preflight(load_params(str(f))), *YAML[case].expected)
    assert str(f) in msg


def test_set_value_that_is_not_yaml(built):
    """--set with a value YAML cannot parse is an InputError quoting the item, not a YAML traceback."""
    refuse(built, lambda: parse_sets(["ppo.kl_coef=[0.1"]), "--set 'ppo.kl_coef=[0.1'", "not a YAML scalar")


def test_artifacts_dir_that_is_a_file(built, tmp_path):
    """pipeline.artifacts_dir naming a file is refused before anything is written."""
    f = tmp_path / "not-a-folder"
    f.write_text("x")
    refuse(built, lambda: preflight(load_params("test", {"pipeline": {"artifacts_dir": str(f)}})),
           "pipeline.artifacts_dir", "is a file", "expected a folder")


def test_artifacts_dir_below_a_file(built, tmp_path):
    """An artifacts_dir that would have to be created inside a file is refused, naming that file."""
    f = tmp_path / "file"
    f.write_text("x")
    refuse(built, lambda: preflight(load_params("test", {"pipeline": {"artifacts_dir": str(f / "sub")}})),
           "pipeline.artifacts_dir", "cannot be created", str(f))


def _full_disk(monkeypatch, free: int) -> None:
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda path: usage._replace(free=free))


def test_disk_too_small_for_the_run(built, monkeypatch):
    """Less free space than the floor for a preset run is refused with the numbers and the field."""
    _full_disk(monkeypatch, 10 * 2**20)
    refuse(built, check(built, {"pipeline": {"stages": ["sft", "reward"]}}), "pipeline.artifacts_dir",
           "10 MiB free", "expected at least 256 MiB")


def test_full_disk_is_fine_when_every_stage_is_cached(built, monkeypatch):
    """A run whose stages are all in the store writes nothing, so a full disk does not stop it."""
    _full_disk(monkeypatch, 0)
    preflight(params_for(built, {"pipeline": {"stages": ["sft"]}}))
    assert read_verified(built.artifact) == built.manifest


def test_disk_estimate_scales_with_the_model(monkeypatch):
    """The estimate is 4 x the weights at the training precision, with a floor for tiny presets."""
    p = load_params("test")
    n = checks._param_count(p)
    weights = checks._weights_bytes(p, n)
    assert weights == 131392 * 4            # the micro preset in fp32
    assert checks._weights_bytes(load_params("test", {"engine": {"precision": "bf16"}}), n) == 131392 * 2
    _full_disk(monkeypatch, checks.DISK_FLOOR - 1)
    with pytest.raises(InputError, match="256 MiB"):
        checks._disk(p, checks._artifacts_root(p), n)


def test_small_synthetic_sets_pass_when_their_stage_does_not_run(built):
    """Few built-in prompts are fine when the run stops before PPO (the check follows the stage list)."""
    p = params_for(built, {"pipeline": {"stages": ["sft", "reward"]}, "data": {"synthetic": {"n_prompts": 1}}})
    preflight(p)
    assert p.data.synthetic.n_prompts == 1


def test_input_error_is_one_line_whatever_it_quotes():
    """An InputError built from text with line breaks escapes them instead of printing several lines."""
    msg = str(InputError("data.sft.path: bad value 'a\nb\r\nc\u2028d'"))
    assert len(msg.splitlines()) == 1
    assert "a\\nb\\r\\nc\\u2028d" in msg


def test_not_yet_supported_survives_pickling():
    """Prefect persists a failed task's exception: NotYetSupported must unpickle with its message intact."""
    err = NotYetSupported("engine.share_base=true", "the memory issue (#5)")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is NotYetSupported and str(back) == str(err)
    assert isinstance(back, InputError)


CRITIC_FREE = {"pipeline": {"stages": ["sft", "ppo", "evaluate"]},
               "ppo": {"estimator": "grpo", "samples_per_prompt": 2, "rollout_batch_size": 8}}


@pytest.mark.parametrize("spec, expected", [
    ("missing.py:score", ["ppo.reward_function", "missing.py not found", "expected FILE.py:NAME"]),
    ("{file}:nope", ["ppo.reward_function", "nope is not defined there"]),
    ("{file}", ["ppo.reward_function", "is not FILE.py:NAME"]),
])
def test_reward_function_that_does_not_load(built, tmp_path, spec, expected):
    """ppo.reward_function naming a missing file, a missing function or no function: one line before any stage."""
    f = tmp_path / "rewards.py"
    f.write_text("def score(prompts, responses, rows):\n    return [0.0] * len(responses)\n")
    refuse(built, check(built, deep_merge(CRITIC_FREE, {"ppo": {"reward_function": spec.format(file=f)}})),
           *expected)


def test_dpo_on_own_files_without_their_preferences(built, tmp_path):
    """DPO on a user's own SFT file with no preferences file would train on the built-in pairs: refused."""
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"{i} + 1 =", "response": f" {i + 1}"} for i in range(40)])
    refuse(built, check(built, {"pipeline": {"stages": ["sft", "dpo", "evaluate"]},
                                "data": {"sft": {"path": str(sft)}}}),
           "data.preferences.path: null, but dpo trains on preference pairs", "expected a preferences file")


def test_reward_on_own_files_without_their_preferences(built, tmp_path):
    """The reward stage on a user's own prompts (or SFT file) with no preferences file would train the RM on the
    built-in pairs: refused, pointing at a preferences file or PPO on a function; that run passes."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{i} + 1 =", "answer": f"{i + 1}"}
                                                       for i in range(40)])
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"{i} + 1 =", "response": f" {i + 1}"} for i in range(40)])
    for own in ({"prompts": {"path": str(prompts)}}, {"sft": {"path": str(sft)}}):
        kind = next(iter(own))
        refuse(built, check(built, {"data": own}),
               "data.preferences.path: null, but the reward stage trains the RM on preference pairs",
               f"your own data.{kind}.path", "expected a preferences file",
               "`reward` dropped from pipeline.stages and ppo.reward_function")
    f = tmp_path / "rewards.py"
    f.write_text("def score(prompts, responses, rows):\n    return [0.0] * len(responses)\n")
    check(built, deep_merge(CRITIC_FREE, {"data": {"prompts": {"path": str(prompts)}, "sft": {"path": str(sft)}},
                                          "ppo": {"reward_function": f"{f}:score"}}))()
