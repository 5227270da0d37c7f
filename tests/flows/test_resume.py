"""Kill anywhere, resume exactly: SIGKILL at chosen steps of SFT, RM and PPO (and mid-checkpoint), run
again, and the final weights equal an uninterrupted run's bit for bit (fixed seeds, CPU, same thread
count: every input to every step is restored, so there is no tolerance to state). The stage processes run
single-threaded with MKL's strict reproducible mode: multi-threaded BLAS may split a reduction differently
from one process to the next, which is noise in the last bit, not a resume bug."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridcore.interrupts import FAULT_ENV
from tests.conftest import ROOT, run_cli

EVERY = {"sft": 3, "reward": 3, "ppo": 2}
SETS = ["sft.epochs=4", f"sft.checkpoint_every={EVERY['sft']}", "reward.epochs=4",
        f"reward.checkpoint_every={EVERY['reward']}", "ppo.iterations=6", f"ppo.checkpoint_every={EVERY['ppo']}"]
UPSTREAM = {"sft": [], "reward": ["sft"], "ppo": ["sft", "reward"]}


EXACT_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_DYNAMIC": "FALSE", "MKL_CBWR": "AUTO,STRICT"}


def run_stage(stage: str, artifacts: Path, fault: str | None = None, extra: tuple[str, ...] = ()
              ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **EXACT_ENV}
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    args = [sys.executable, "-m", "stages.runner", str(ROOT / "params" / "test.yaml"), stage,
            "--set", f"pipeline.artifacts_dir={artifacts}"]
    for s in (*SETS, *extra):
        args += ["--set", s]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def weights(artifact: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(artifact) / "model" / "model.safetensors"))


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Each stage run once without interruption: the results every resumed run must equal."""
    root = tmp_path_factory.mktemp("reference")
    out = {"root": root}
    for stage in ("sft", "reward", "ppo"):
        proc = run_stage(stage, root)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[stage] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


# Each stage is killed at these points in turn, every run resuming the one before it (a point must lie ahead of the
# checkpoint the previous kill left: ppo's checkpoint:4 before its plain step 4, which may already have saved step-4)
CHAINS = {"sft": ("sft:1", "sft:7", "sft:checkpoint:9", "sft:15"), "reward": ("reward:0", "reward:5", "reward:14"),
          "ppo": ("ppo:1", "ppo:checkpoint:4", "ppo:4")}


def checkpoints(artifacts: Path, stage: str) -> Path:
    """The checkpoints folder of the stage's unfinished (.partial) artifact."""
    return next((artifacts / stage).glob("*.partial")) / "checkpoints"


def newest_checkpoint(artifacts: Path, stage: str) -> int:
    done = sorted(int(p.name.split("-")[1]) for p in checkpoints(artifacts, stage).glob("step-*"))
    return done[-1] if done else 0


@pytest.mark.parametrize("stage", CHAINS)
def test_killed_again_and_again_resumes_exactly(stage, reference, tmp_path):
    """SIGKILL at each point of the chain in turn, each run resuming from the checkpoint the kill before left: at most
    one checkpoint interval of finished steps is lost each time (killed while writing step N: the previous checkpoint
    is the newest valid one), and the last run's final weights and loss history equal an uninterrupted run's. One
    chain a stage instead of a fresh run a point: the same points, ~half the steps, and resumes of resumed runs."""
    for dep in UPSTREAM[stage]:
        shutil.copytree(reference["root"] / dep, tmp_path / dep)
    newest = 0
    for fault in CHAINS[stage]:
        killed_at = int(fault.split(":")[-1])
        proc = run_stage(stage, tmp_path, fault)
        assert proc.returncode == -9, (fault, proc.returncode, proc.stderr[-2000:])
        if newest:  # printed (flushed) before the kill
            assert f"resuming from step-{newest}" in proc.stdout + proc.stderr, fault
        newest = newest_checkpoint(tmp_path, stage)
        if "checkpoint" in fault:
            assert newest == killed_at - EVERY[stage], fault
        else:
            assert killed_at - EVERY[stage] < newest <= killed_at, fault
    proc = run_stage(stage, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert f"resuming from step-{newest}" in proc.stdout + proc.stderr
    assert resumed["key"] == reference[stage]["key"]
    assert_same_weights(resumed["artifact"], reference[stage]["artifact"])
    assert resumed["metrics"]["train_loss"] == reference[stage]["metrics"]["train_loss"]
    assert not (Path(resumed["artifact"]) / "checkpoints").exists()


def test_corrupt_checkpoint_falls_back_to_previous(reference, tmp_path):
    """A truncated newest checkpoint is reported in one line and the one before it is used; the result is
    still exact."""
    proc = run_stage("sft", tmp_path, "sft:10")
    assert proc.returncode == -9
    ckpts = checkpoints(tmp_path, "sft")
    newest = ckpts / "step-9"
    blob = newest / "model.safetensors"
    blob.write_bytes(blob.read_bytes()[:100])
    proc = run_stage("sft", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [x for x in proc.stderr.splitlines() if "unusable" in x]
    assert len(warnings) == 1 and "step-9" in warnings[0] and "model.safetensors" in warnings[0], proc.stderr
    assert "resuming from step-6" in proc.stdout
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert_same_weights(resumed["artifact"], reference["sft"]["artifact"])


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [x for x in stderr.splitlines() if x.startswith("error:")]


def test_nan_loss_stops_naming_the_step_and_skip_resumes_past_it(reference, tmp_path):
    """An injected NaN loss stops SFT with one line naming the step (exit 1), the checkpoints before it kept;
    rerun with on_nonfinite=skip (same stage key) resumes there, reports and skips that batch, and finishes."""
    proc = run_stage("sft", tmp_path, "sft:nan:7")
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    [line] = error_lines(proc.stderr)
    assert "sft step 7" in line and "loss=nan" in line and "on_nonfinite: skip" in line, line
    assert (checkpoints(tmp_path, "sft") / "step-6").is_dir()
    proc = run_stage("sft", tmp_path, "sft:nan:7", extra=("sft.on_nonfinite=skip",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from step-6" in proc.stdout
    assert "sft step 7: loss=nan; skipping this batch" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["key"] == reference["sft"]["key"]
    assert result["metrics"]["steps"] == reference["sft"]["metrics"]["steps"] - 1
    assert all(torch.isfinite(w).all() for w in weights(result["artifact"]).values())


def test_nan_reward_in_ppo_is_skipped_when_asked(reference, tmp_path):
    """A NaN reward in one PPO rollout batch is reported with the iteration and that batch is skipped."""
    for dep in UPSTREAM["ppo"]:
        shutil.copytree(reference["root"] / dep, tmp_path / dep)
    proc = run_stage("ppo", tmp_path, "ppo:nan:2", extra=("ppo.on_nonfinite=skip",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ppo step 2: reward=nan" in proc.stdout and "skipping this batch" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["metrics"]["steps"] == reference["ppo"]["metrics"]["steps"] - 1


def test_disk_full_while_checkpointing_keeps_the_previous_checkpoint(reference, tmp_path):
    """The disk fills up halfway through writing step-6: one line says so and names the intact step-3 (exit 1);
    no half-written folder is left; the rerun resumes from step-3 and ends exact."""
    proc = run_stage("sft", tmp_path, "sft:enospc:6")
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    [line] = error_lines(proc.stderr)
    assert "could not write checkpoint step-6" in line and "No space left on device" in line, line
    assert "step-3 is intact" in line, line
    ckpts = checkpoints(tmp_path, "sft")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-3"]
    from hybridcore.checkpoint import Checkpointer
    assert Checkpointer(ckpts.parent, "sft", 3, 2).verify(ckpts / "step-3") is None
    proc = run_stage("sft", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from step-3" in proc.stdout
    assert_same_weights(json.loads(proc.stdout.strip().splitlines()[-1])["artifact"], reference["sft"]["artifact"])


def test_concurrent_runs_of_one_key_never_mix(reference, tmp_path):
    """Two processes start the same stage key at once: one trains, the other waits on the lock and then
    finds the finished artifact; the artifact verifies and equals the reference."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **EXACT_ENV}
    args = [sys.executable, "-m", "stages.runner", str(ROOT / "params" / "test.yaml"), "sft",
            "--set", f"pipeline.artifacts_dir={tmp_path}"] + [x for s in SETS for x in ("--set", s)]
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert sorted(r["cached"] for r in results) == [False, True]
    assert "waiting for it" in "".join(o[0] for o in outs)
    assert_same_weights(results[0]["artifact"], reference["sft"]["artifact"])
    from hybridcore.artifacts import read_verified
    assert read_verified(Path(results[0]["artifact"])) is not None


def _servers_of(prefect_home: Path) -> list[int]:
    """PIDs of live processes started with this PREFECT_HOME (our API servers included)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if f"PREFECT_HOME={prefect_home}".encode() in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


def test_kill_whole_flow_and_rerun(reference, tmp_path):
    """SIGKILL the CLI's whole flow mid-PPO: its Prefect server goes with it; the rerun resumes PPO (SFT and the RM
    are cache hits) and ends with the uninterrupted run's weights. (A kill in each stage, resumed through the
    stage runner, is test_killed_again_and_again_resumes_exactly's.)"""
    fault = "ppo:3"
    import time
    cli = ["run", str(ROOT / "params" / "test.yaml"), "--set", "tracking.enabled=false",
           "--set", "pipeline.stages=[sft,reward,ppo]", "--summary-json", "s.json"] + [x for s in SETS for x in ("--set", s)]
    env_fault = {**EXACT_ENV, FAULT_ENV: fault}
    proc = run_cli(cli, tmp_path, extra_env=env_fault)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-2000:])
    deadline = time.time() + 20
    while _servers_of(tmp_path / ".prefect") and time.time() < deadline:
        time.sleep(0.5)
    assert _servers_of(tmp_path / ".prefect") == []
    proc = run_cli(cli, tmp_path, extra_env=EXACT_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = json.loads((tmp_path / "s.json").read_text())["stages"]
    for name in ("sft", "reward", "ppo"):
        assert_same_weights(stages[name]["artifact"], reference[name]["artifact"])
    assert stages["sft"]["cached"] and stages["reward"]["cached"]
    assert not stages["ppo"]["cached"]


def test_sigterm_stops_gracefully_with_a_checkpoint(reference, tmp_path):
    """SIGTERM during SFT (as from an orchestrator): the current step finishes, a checkpoint is written
    even off the interval, exit code 130; the rerun resumes there and ends exact."""
    proc = run_stage("sft", tmp_path, "sft:term:4")
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-2000:])
    assert "interrupted: sft stopped after step 5" in proc.stderr
    assert (checkpoints(tmp_path, "sft") / "step-5").is_dir()
    proc = run_stage("sft", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from step-5" in proc.stdout
    assert_same_weights(json.loads(proc.stdout.strip().splitlines()[-1])["artifact"], reference["sft"]["artifact"])


def test_sigterm_through_the_flow(reference, tmp_path):
    """The same through the CLI and Prefect (whose own SIGTERM bridge is set aside while a stage trains):
    exit code 130 and one 'interrupted' line, then an exact resume."""
    cli = ["run", str(ROOT / "params" / "test.yaml"), "--set", "tracking.enabled=false",
           "--set", "pipeline.stages=[sft,reward,ppo]", "--summary-json", "s.json"] + [x for s in SETS for x in ("--set", s)]
    proc = run_cli(cli, tmp_path, extra_env={**EXACT_ENV, FAULT_ENV: "ppo:term:2"})
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-3000:])
    assert "interrupted: ppo stopped after step 3" in proc.stderr
    proc = run_cli(cli, tmp_path, extra_env=EXACT_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = json.loads((tmp_path / "s.json").read_text())["stages"]
    assert_same_weights(stages["ppo"]["artifact"], reference["ppo"]["artifact"])
