"""Critic-free RL: ppo.estimator grpo / rloo / reinforce_pp on a reward function, with no reward stage
(pipeline.stages [sft, ppo, evaluate]). GRPO and RLOO learn the built-in task on the tiny preset, REINFORCE++ raises
the reward, no critic exists anywhere in such a run, a killed GRPO run resumes bit for bit, and a reward function
that misbehaves stops the stage with one line naming it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridcore.errors import InputError
from hybridcore.interrupts import FAULT_ENV
from hybridcore.models import load_tokenizer
from stages import ppo
from stages.keys import stage_keys
from stages.params import load_params
from stages.rewards import RewardFunctionFault
from stages.runner import NullSink, run_stage
from tests.conftest import ROOT

CORRECT = '''
import re


def correct(prompts, responses, rows):
    """1 when the response's first integer is the row's answer (the built-in task's checker), else 0."""
    out = []
    for response, row in zip(responses, rows):
        m = re.search(r"-?\\d+", response)
        out.append(1.0 if m is not None and m.group(0) == str(row["answer"]) else 0.0)
    return out
'''

# settings that learn the tiny task in seconds of CPU: 32 prompts x 4 answers per iteration, two optimizer steps
# per epoch; a higher lr (2e-4) or fewer prompts (16 x 8) made the KL and the reward jump from batch to batch
LEARN = {"iterations": 12, "rollout_batch_size": 32, "samples_per_prompt": 4, "minibatch_size": 64,
         "micro_batch_size": 64, "ppo_epochs": 2, "actor_lr": 1.0e-4, "kl_coef": 0.05}


def reward_file(tmp_path: Path, body: str = CORRECT, name: str = "correct") -> str:
    path = tmp_path / f"reward_{name}.py"
    path.write_text(body)
    return f"{path}:{name}"


def tiny(artifacts: Path, ppo_section: dict):
    return load_params("tiny", {"pipeline": {"artifacts_dir": str(artifacts), "stages": ["sft", "ppo", "evaluate"]},
                                "ppo": ppo_section})


@pytest.mark.parametrize("estimator,extra", [("grpo", {"kl_in_loss": True}), ("rloo", {"loss_agg": "seq_mean"})])
def test_group_estimators_learn_the_task_from_a_reward_function(tiny_artifacts, tmp_path, estimator, extra):
    """No reward model anywhere: the function's 0/1 verdicts alone lift greedy accuracy on held-out prompts by 10
    points over SFT, and no critic was built, trained or checkpointed."""
    p = tiny(tiny_artifacts, {**LEARN, "estimator": estimator, "reward_function": reward_file(tmp_path), **extra})
    keys = stage_keys(p)
    trained = run_stage(p, "ppo", keys).metrics
    assert trained["reward_last"] > trained["reward_first"], trained
    assert not [k for k in trained if k.startswith(("critic_", "value_", "explained_variance", "mem_critic"))]
    ev = run_stage(p, "evaluate", keys).metrics
    assert not [k for k in ev if k.endswith("_reward")], ev  # no RM: nothing scores the answers but the checker
    assert ev["ppo_accuracy"] >= ev["sft_accuracy"] + 0.10, ev


def test_reinforce_pp_raises_the_reward(tiny_artifacts, tmp_path):
    p = tiny(tiny_artifacts, {**LEARN, "estimator": "reinforce_pp", "reward_function": reward_file(tmp_path)})
    m = run_stage(p, "ppo", stage_keys(p)).metrics
    assert m["reward_last"] > m["reward_first"], m


# ------------------------------------------------------------------------------------------- the micro preset

def micro(root: Path, tmp_path: Path, **ppo_section):
    section = {"estimator": "grpo", "samples_per_prompt": 4, "rollout_batch_size": 4, "minibatch_size": 8,
               **ppo_section}
    section.setdefault("reward_function", reward_file(tmp_path, LENGTH, "length"))
    return load_params("test", {"pipeline": {"artifacts_dir": str(root), "stages": ["sft", "ppo"]}, "ppo": section})


LENGTH = '''
def length(prompts, responses, rows):
    """A reward the untrained micro model's answers differ in: their length in characters."""
    return [float(len(r)) for r in responses]
'''


@pytest.fixture(scope="module")
def micro_sft(tmp_path_factory) -> Path:
    """The micro preset's SFT artifact, once for the module (its key does not depend on the ppo section)."""
    root = tmp_path_factory.mktemp("critic-free")
    p = load_params("test", {"pipeline": {"artifacts_dir": str(root), "stages": ["sft", "ppo"]},
                             "ppo": {"estimator": "reinforce_pp", "reward_function": reward_file(root)}})
    run_stage(p, "sft", stage_keys(p))
    return root


class ListSink:
    def __init__(self):
        self.rows: list[dict] = []

    def log(self, metrics, step):
        self.rows.append(dict(metrics))


def test_no_critic_exists_in_a_critic_free_run(micro_sft, tmp_path):
    """One model trains (the actor), its engine's optimizer states are the only ones the memory ledger finds, the
    weights it finds are the actor's and the reference's alone, and nothing critic-shaped is logged."""
    p = micro(micro_sft, tmp_path)
    keys = stage_keys(p)
    sft = Path(run_stage(p, "sft", keys).artifact)
    m = ppo.load_models(p, {"sft": sft}, load_tokenizer(str(sft / "model")))
    assert m.critic is None and m.critic_params is None and m.rm is None
    assert list(m.trained()) == ["actor"] and list(m.checkpoint) == ["actor"]
    sink = ListSink()
    got = run_stage(p, "ppo", keys, sink).metrics
    rows = [r for r in sink.rows if "policy_loss" in r]
    assert rows and not [k for r in rows for k in r if k.startswith(("critic", "value", "explained", "mem_critic"))]
    assert not [k for k in got if "critic" in k or k.startswith(("value_", "explained_variance"))]
    for phase in ("rollout", "scoring", "actor_update"):
        assert got[f"mem_{phase}_optimizer_mib"] == pytest.approx(got["actor_optimizer_cpu_mib"], abs=1e-9), phase
        assert got[f"mem_{phase}_weights_mib"] == pytest.approx(2 * got["actor_params_mib"], abs=1e-9), phase
    adam = sum(8 * q.numel() for q in m.policy.parameters())  # two fp32 moments per trained weight
    assert adam <= got["actor_optimizer_cpu_mib"] * 2**20 < adam + 4096  # + AdamW's step counters


def weights(artifact) -> dict[str, torch.Tensor]:
    return load_file(str(Path(artifact) / "model" / "model.safetensors"))


EXACT_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_DYNAMIC": "FALSE", "MKL_CBWR": "AUTO,STRICT"}


def runner(root: Path, sets: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    """`python -m stages.runner` on the micro preset's ppo stage, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **EXACT_ENV}
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    args = [sys.executable, "-m", "stages.runner", str(ROOT / "params" / "test.yaml"), "ppo",
            "--set", f"pipeline.artifacts_dir={root}"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def test_killed_grpo_run_resumes_exactly(micro_sft, tmp_path):
    """SIGKILL before iteration 3 (checkpoint at 2), run again: the final weights and loss history equal an
    uninterrupted run's bit for bit, and the checkpoint holds the actor alone."""
    p = micro(micro_sft, tmp_path)
    spec = p.ppo.reward_function
    sets = ["pipeline.stages=[sft, ppo]", "ppo.estimator=grpo", "ppo.samples_per_prompt=4", "ppo.kl_in_loss=true",
            "ppo.rollout_batch_size=4", "ppo.minibatch_size=8", "ppo.iterations=5", "ppo.checkpoint_every=2",
            f"ppo.reward_function={spec}"]
    roots = {}
    sft = Path(run_stage(p, "sft", stage_keys(p)).artifact)
    for name in ("whole", "killed"):
        roots[name] = tmp_path / name
        (roots[name] / "sft").mkdir(parents=True)
        os.symlink(sft, roots[name] / "sft" / sft.name)
    whole = runner(roots["whole"], sets)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = runner(roots["killed"], sets, "ppo:3")
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-2000:])
    partial = next((roots["killed"] / "ppo").glob("*.partial"))
    assert sorted(f.name for f in (partial / "checkpoints" / "step-2").iterdir() if "critic" in f.name) == []
    resumed = runner(roots["killed"], sets)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from step-2" in resumed.stdout
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (whole, resumed))
    assert a["key"] == b["key"] and a["metrics"]["train_loss"] == b["metrics"]["train_loss"]
    wa, wb = weights(a["artifact"]), weights(b["artifact"])
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("body,match", [
    ("def bad(prompts, responses, rows):\n    return [1.0] * (len(responses) - 1)\n",
     r"^ppo\.reward_function .*:bad returned 15 values for 16 responses at ppo iteration 0; expected a list of 16"),
    ("def bad(prompts, responses, rows):\n    return [float('nan')] + [0.0] * (len(responses) - 1)\n",
     r"^ppo\.reward_function .*:bad returned nan for response 0 \(.*\) at ppo iteration 0; expected a finite number"),
    ("def bad(prompts, responses, rows):\n    return ['yes'] * len(responses)\n",
     r"^ppo\.reward_function .*:bad returned 'yes' for response 0 .* expected a finite number"),
    ("def bad(prompts, responses, rows):\n    raise KeyError('score')\n",
     r"^ppo\.reward_function .*:bad raised KeyError at ppo iteration 0 \(reward_bad\.py line 2\): 'score'$"),
])
def test_a_misbehaving_reward_function_stops_with_one_line(micro_sft, tmp_path, body, match):
    p = micro(micro_sft, tmp_path, reward_function=reward_file(tmp_path, body, "bad"))
    with pytest.raises(RewardFunctionFault, match=match) as e:
        run_stage(p, "ppo", stage_keys(p))
    assert "\n" not in str(e.value)


def test_a_missing_function_name_is_an_input_error(micro_sft, tmp_path):
    """Found before any model loads (exit code 2 from the CLI), by the stage itself as by the pre-flight check."""
    spec = reward_file(tmp_path, CORRECT, "nope")
    with pytest.raises(InputError, match=r"^ppo\.reward_function: nope is not defined .*reward_nope\.py"):
        p = micro(micro_sft, tmp_path, reward_function=spec)
        ppo.run(p, {"sft": Path(run_stage(p, "sft", stage_keys(p)).artifact)}, tmp_path / "out", NullSink())


def test_share_base_without_a_critic(tmp_path):
    """engine.share_base with a critic-free estimator: the actor is the one adapter on the 4-bit SFT base and the
    reference is that base with it off; no critic adapter, no value head, in the roles or in the artifact."""
    p = load_params("test-qlora", {"pipeline": {"artifacts_dir": str(tmp_path), "stages": ["sft", "ppo"]},
                                   "ppo": {"estimator": "rloo", "samples_per_prompt": 2, "rollout_batch_size": 8,
                                           "reward_function": reward_file(tmp_path, LENGTH, "length")}})
    keys = stage_keys(p)
    sft = Path(run_stage(p, "sft", keys).artifact)
    m = ppo.load_models(p, {"sft": sft}, load_tokenizer(str(sft / "model")))
    assert m.critic is None and m.ref is m.policy and list(m.trained()) == ["actor"]
    assert list(m.peft.peft_config) == ["actor"]
    art = Path(run_stage(p, "ppo", keys).artifact)
    assert json.loads((art / "adapter" / "adapters.json").read_text()) == {"adapters": ["actor"], "extra": []}
    moved = [k for k, v in load_file(str(art / "adapter" / "actor" / "adapter_model.safetensors")).items()
             if "lora_B" in k and v.abs().max() > 0]
    assert moved  # B starts at zero: the adapter trained


def test_the_reward_model_and_a_function_mix(micro_sft, tmp_path):
    """reward = reward_model_weight x the RM's score + the function's value, each part logged beside the sum; gae's
    critic starts from the RM as before."""
    p = load_params("test", {"pipeline": {"artifacts_dir": str(micro_sft), "stages": ["sft", "reward", "ppo"]},
                             "ppo": {"reward_function": reward_file(tmp_path, LENGTH, "length"),
                                     "reward_model_weight": 0.5}})
    keys = stage_keys(p)
    run_stage(p, "reward", keys)
    sink = ListSink()
    got = run_stage(p, "ppo", keys, sink).metrics
    rows = [r for r in sink.rows if "reward" in r]
    assert len(rows) == p.ppo.iterations and "value_loss" in rows[0] and "critic_optimizer_cpu_mib" in got
    for r in rows:
        assert r["reward"] == pytest.approx(0.5 * r["rm_score"] + r["function_reward"], abs=1e-5)
        assert r["function_reward"] > 0  # characters of text


def test_dp2_critic_free_run_is_a_torchrun_job(tmp_path):
    """engine.layout.dp=2: each rank answers its half of the prompts (whole groups stay on one rank) and REINFORCE++
    whitens over both ranks' tokens; the job trains and exports one model, no critic."""
    p = load_params("test", {"pipeline": {"artifacts_dir": str(tmp_path), "stages": ["sft", "ppo"]},
                             "engine": {"layout": {"dp": 2}},
                             "ppo": {"estimator": "reinforce_pp", "samples_per_prompt": 2, "rollout_batch_size": 8,
                                     "reward_function": reward_file(tmp_path, LENGTH, "length")}})
    keys = stage_keys(p)
    run_stage(p, "sft", keys)
    got = run_stage(p, "ppo", keys).metrics
    assert got["steps"] == p.ppo.iterations and not [k for k in got if "critic" in k]
