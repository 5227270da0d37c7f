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
import threading
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


def group_args(nice: int) -> dict:
    """Popen arguments for a run in its own process group (stop() kills the group), at `nice`. A run that yields
    stays in this session: under autogrouping (Linux's default, and this machine's) every session gets its own
    share of the CPU whatever its processes' nice values, so a niced run in a new session would not yield."""
    if not nice:
        return {"start_new_session": True}
    return {"process_group": 0, "preexec_fn": lambda: os.nice(nice)}


class Started:
    """`hybrid-rlhf ARGS` started in the background, in its own process group, its output going to files in `cwd`
    (NAME.stdout, NAME.stderr): start independent runs together, then result() each. stop() kills the group by its
    id if it is still running (a fixture's teardown calls it, so a failed test leaves nothing behind)."""

    def __init__(self, args: list[str], cwd: Path, name: str, extra_env: dict | None = None, nice: int = 0):
        env = {**os.environ, "PYTHONPATH": str(ROOT), **(extra_env or {})}
        env.pop("PREFECT_HOME", None)  # the CLI puts it under cwd
        self.files = cwd / f"{name}.stdout", cwd / f"{name}.stderr"
        with open(self.files[0], "w") as out, open(self.files[1], "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, stdout=out,
                                         stderr=err, **group_args(nice))
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


# ------------------------------------------------------------------------------------------- background runs
# A CI run leaves about 30 % of its two cores idle (processes starting, servers coming up, single-threaded steps;
# `vmstat` over a whole run, 2026-12-06). The pipeline runs that only a few tests read start at the session's
# start instead, at nice 15 and one thread each, so they use that idle time and yield to the tests in the
# foreground; the tests that read them run last, when the runs are (mostly) done.
BACKGROUND = ("users_runs",)  # session fixtures that start background runs
# One thread each, and the waits that a starved process can outlast made long: the local Prefect server's start
# (90 s by default; at nice 19 one did not come up in that time while the tests in front kept both cores busy)
# and each request to it (60 s).
YIELDING = {**ONE_THREAD, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "1200",
            "PREFECT_API_REQUEST_TIMEOUT": "1200"}
_WANTED = pytest.StashKey[list]()


def pytest_collection_modifyitems(config, items) -> None:
    readers = {id(i) for i in items if set(getattr(i, "fixturenames", ())) & set(BACKGROUND)}
    config.stash[_WANTED] = sorted({f for i in items if id(i) in readers for f in i.fixturenames if f in BACKGROUND})
    items[:] = [i for i in items if id(i) not in readers] + [i for i in items if id(i) in readers]


@pytest.fixture(scope="session", autouse=True)
def _background_runs(request) -> None:
    """Starts the background runs the selected tests read (none when no selected test reads one)."""
    for name in request.config.stash.get(_WANTED, []):
        request.getfixturevalue(name)


USERS_RUNS = ("conversational", "count", "repeat")
COUNT_RECIPES = ("tiny-grpo", "tiny-dpo")


@pytest.fixture(scope="session")
def users_runs(tmp_path_factory):
    """tests/flows/test_users_data.py's runs on users' files with default params (params/tiny.yaml plus the data
    paths): the built-in task as conversations, and the held-out tasks `count` and `repeat` (tests/tasks.py), each
    in its own folder with its own keys and stores, {name: (folder, Started)}; and "count recipes": (a thread that
    starts them, {preset: Started}), the tiny-grpo and tiny-dpo presets on count's files and artifacts folder (a
    verifier of the user's own, exact match on the `answer` column, for GRPO), started once `count` ends well."""
    from stages import example_files
    from stages.params import load_params
    from tests import tasks
    folders = {name: tmp_path_factory.mktemp(name) for name in USERS_RUNS}
    files = {"conversational": example_files.write(folders["conversational"] / "data", load_params("tiny"),
                                                   conversational=True),
             "count": tasks.count_files(folders["count"] / "data"),
             "repeat": tasks.repeat_files(folders["repeat"] / "data")}
    runs: dict = {}
    for name in USERS_RUNS:
        sets = [x for kind, path in files[name].items() for x in ("--set", f"data.{kind}.path={path}")]
        runs[name] = folders[name], Started(["run", str(ROOT / "params" / "tiny.yaml"), *sets, "--summary-json",
                                             "summary.json"], folders[name], "run", extra_env=YIELDING, nice=15)
    # then, once `count` has ended well, its GRPO and DPO recipes over its artifacts (SFT a cache hit)
    count = folders["count"]
    (count / "exact.py").write_text("def exact(prompts, responses, rows):\n"
                                    "    return [float(' '.join(r.split()) == ' '.join(str(row['answer']).split()))\n"
                                    "            for r, row in zip(responses, rows)]\n")
    sets = [x for kind, path in files["count"].items() for x in ("--set", f"data.{kind}.path={path}")]
    sets += ["--set", f"pipeline.artifacts_dir={count / 'artifacts'}", "--set",
             f"ppo.reward_function={count / 'exact.py'}:exact"]
    recipes: dict[str, Started] = {}

    def after_count() -> None:
        if runs["count"][1].proc.wait() == 0:
            for preset in COUNT_RECIPES:
                (count / preset).mkdir()
                recipes[preset] = Started(["run", preset, *sets, "--summary-json", "summary.json"], count / preset,
                                          "run", extra_env=YIELDING, nice=15)

    runs["count recipes"] = threading.Thread(target=after_count, daemon=True), recipes
    runs["count recipes"][0].start()
    yield runs
    for name in USERS_RUNS:
        runs[name][1].stop()
    runs["count recipes"][0].join()
    for started in recipes.values():
        started.stop()


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
