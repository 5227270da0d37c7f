"""Shared fixtures: the tiny pipeline runs once per test session, through the real CLI, and every test
that only reads its results (artifacts, summary, MLflow store) shares that run."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cli(args: list[str], cwd: Path, timeout: int = 1200, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """`hybrid-rlhf ARGS` in a fresh process, in `cwd` (where .prefect/, mlruns/ and artifacts/ go)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(extra_env or {})}
    env.pop("PREFECT_HOME", None)  # the CLI puts it under cwd
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


# For runs that overlap others: one thread each, so that N single-threaded runs share the cores instead of
# 2N OpenMP threads spinning against each other (on a busy 2-core machine that costs several times the run).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class Started:
    """`hybrid-rlhf ARGS` started in the background, in its own process group, its output going to files in `cwd`
    (NAME.stdout, NAME.stderr): start independent runs together, then result() each. stop() kills the group by its
    id if it is still running (a fixture's teardown calls it, so a failed test leaves nothing behind)."""

    def __init__(self, args: list[str], cwd: Path, name: str, extra_env: dict | None = None):
        env = {**os.environ, "PYTHONPATH": str(ROOT), **(extra_env or {})}
        env.pop("PREFECT_HOME", None)  # the CLI puts it under cwd
        self.files = cwd / f"{name}.stdout", cwd / f"{name}.stderr"
        with open(self.files[0], "w") as out, open(self.files[1], "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, stdout=out,
                                         stderr=err, start_new_session=True)
        self.t0 = time.time()
        self.seconds: float | None = None

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=max(1.0, timeout - (time.time() - self.t0)))
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        if self.seconds is None:
            self.seconds = time.time() - self.t0
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.files[0].read_text(),
                                           self.files[1].read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class PipelineRun:
    workdir: Path
    summary: dict
    stdout: str
    seconds: float


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> PipelineRun:
    """The README's default pipeline (params/tiny.yaml), run once for the whole session."""
    workdir = tmp_path_factory.mktemp("tiny")
    t0 = time.time()
    proc = run_cli(["run", str(ROOT / "params" / "tiny.yaml"), "--summary-json", "summary.json"], workdir)
    seconds = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    return PipelineRun(workdir, json.loads((workdir / "summary.json").read_text()), proc.stdout, seconds)


@pytest.fixture
def tiny_artifacts(tiny_run, tmp_path) -> Path:
    """A fresh artifacts folder holding copies of the session's tiny SFT and RM artifacts: a test that runs a later
    stage on the tiny preset (pipeline.artifacts_dir = this folder) finds them as cache hits instead of training
    SFT again (their keys do not depend on the later stages' params or on pipeline.stages)."""
    root = tmp_path / "artifacts"
    for stage in ("sft", "reward"):
        src = Path(tiny_run.summary["stages"][stage]["artifact"])
        shutil.copytree(src, root / stage / src.name)
    return root


def assert_learns(summary: dict) -> None:
    """The bars a tiny run must clear: RM held-out accuracy > 0.75; on >= 200 held-out prompts PPO beats SFT on
    RM reward and on task accuracy by >= 3 points."""
    s = summary["stages"]
    assert s["reward"]["metrics"]["heldout_accuracy"] > 0.75
    ev = s["evaluate"]["metrics"]
    assert ev["prompts"] >= 200
    assert ev["ppo_reward"] > ev["sft_reward"]
    assert ev["ppo_accuracy"] >= ev["sft_accuracy"] + 0.03, ev


@pytest.fixture
def watch_engine_steps(monkeypatch):
    """watch(record) -> a list that gets record(engine) at every training-engine step taken during the test (so a
    silently ignored layout cannot pass)."""
    def watch(record) -> list:
        from hybridcore.engine import TorchEngine
        from hybridcore.zero import DeepSpeedEngine
        seen: list = []
        for cls in (TorchEngine, DeepSpeedEngine):
            def spy(self, step=cls.step):
                seen.append(record(self))
                return step(self)
            monkeypatch.setattr(cls, "step", spy)
        return seen
    return watch
