"""Stages as torchrun jobs (engine.layout.dp=2, gloo on CPU), through run_stage as the flow and CLI call it.

Each rank takes its share of every global batch and the loss is divided by the global token (pair) count, so a
dp=2 SFT ends where dp=1 ends up to float rounding of the gradient all-reduce (measured ~4e-9; asserted 1e-6). A
rank that fails fails the stage with that rank's error as the one line; a stop request, a time-out or a failure
leaves no process behind; a dp=2 ZeRO-2 stage stopped mid-way resumes from its collective checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridcore.artifacts import read_verified, staging_dir
from hybridcore.errors import InputError, NotYetSupported, TrainingFault
from hybridcore.interrupts import FAULT_ENV, FAULT_RANK_ENV, Interrupted
from stages import launch
from stages.keys import stage_keys
from stages.params import load_params
from stages.runner import run_stage
from tests.conftest import ROOT
from tests.stages.test_zero_stages import assert_close_weights

SFT = {"epochs": 2, "checkpoint_every": 2}  # 8 steps of 16 rows


def params(root: Path, layout: dict | None = None, **sections):
    return load_params("test", {"pipeline": {"artifacts_dir": str(root)}, "sft": SFT,
                                "engine": {"layout": layout or {}}, **sections})


def processes_naming(text: str) -> list[str]:
    """Command lines of live processes that mention `text` (a test's unique folder): none may outlive a job."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{entry.name}: {cmd}")
    return found


class Recorder:
    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))


@pytest.fixture(scope="module")
def dp1_sft(tmp_path_factory):
    p = params(tmp_path_factory.mktemp("dp1"))
    return run_stage(p, "sft", stage_keys(p))


@pytest.fixture(scope="module")
def dp2_pipeline(tmp_path_factory):
    """The micro pipeline with dp=2: SFT, RM and PPO as torchrun jobs, evaluation in this process."""
    root = tmp_path_factory.mktemp("dp2")
    p = params(root, {"dp": 2})
    keys = stage_keys(p)
    sinks = {s: Recorder() for s in ("sft", "reward", "ppo", "evaluate")}
    results = {s: run_stage(p, s, keys, sinks[s]) for s in sinks}
    return root, results, sinks


def test_dp2_pipeline_runs_end_to_end_and_its_sft_equals_dp1(dp2_pipeline, dp1_sft):
    root, results, sinks = dp2_pipeline
    for stage, r in results.items():
        assert not r.cached and read_verified(Path(r.artifact)) is not None, stage
    assert_close_weights(results["sft"].artifact, dp1_sft.artifact, atol=1e-6)
    # rank 0's metrics are global: the step losses (summed over ranks) equal dp=1's
    assert results["sft"].metrics["steps"] == dp1_sft.metrics["steps"] == 8
    assert results["sft"].metrics["train_loss"] == pytest.approx(dp1_sft.metrics["train_loss"], rel=1e-6)
    # the parent forwarded rank 0's step metrics to its sink, once per step
    sft_steps = [step for step, m in sinks["sft"].rows if "loss" in m]
    assert sft_steps == list(range(8))
    ppo_rows = [m for _, m in sinks["ppo"].rows if "reward" in m]
    assert len(ppo_rows) == 2 and all(torch.isfinite(torch.tensor(m["reward"])) for m in ppo_rows)
    assert results["reward"].metrics["steps"] == 4
    # each rank's output is kept with the artifact; the job's own files are not
    sft_dir = Path(results["sft"].artifact)
    rank_logs = sorted(p.parent.name for p in (sft_dir / "logs").rglob("stderr.log"))
    assert rank_logs == ["0", "1"]
    assert not (sft_dir / "launch").exists()
    assert processes_naming(str(root)) == []


def test_a_failing_rank_fails_the_stage_with_its_error_and_leaves_nothing(tmp_path):
    """Through the CLI (`python -m stages.runner`): exit code 1, rank 1's error as the last line of stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", FAULT_ENV: "sft:raise:1",
           FAULT_RANK_ENV: "1"}
    proc = subprocess.run([sys.executable, "-m", "stages.runner", "test", "sft", "--set", "engine.layout.dp=2",
                           "--set", f"pipeline.artifacts_dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: sft: rank 1 of 2 failed: InjectedFault: injected fault at sft step 1 (rank 1)")
    assert processes_naming(str(tmp_path)) == []
    logs = list(tmp_path.glob("sft/*.partial/logs/**/1/stderr.log"))
    assert len(logs) == 1 and "InjectedFault" in logs[0].read_text()


def test_a_job_past_its_time_limit_is_killed_whole(tmp_path):
    p = params(tmp_path, {"dp": 2})
    key = stage_keys(p)["sft"]
    out = staging_dir(tmp_path, "sft", key)
    with pytest.raises(launch.RankFailed, match=r"sft: the torchrun job ran past its 3 s limit; killed it"):
        launch.run_ranks(p, "sft", {}, out, Recorder(), timeout_s=3)
    assert processes_naming(str(tmp_path)) == []


def test_dp2_zero2_stops_on_one_ranks_request_then_a_killed_rank_and_resumes(tmp_path, dp1_sft, monkeypatch):
    """SIGTERM reaches rank 1 only, before step 3: both ranks stop after the same step (the stop is all-reduced),
    write one collective ZeRO-2 checkpoint (step-4, a shard per rank) and the stage ends Interrupted. The rerun
    resumes there; SIGKILL then ends rank 1 before step 6 (the stage names it) and a third run resumes from
    step-6 and ends where an uninterrupted dp=1 run ends."""
    p = params(tmp_path, {"dp": 2, "zero_stage": 2})
    keys = stage_keys(p)
    partial = tmp_path / "sft" / f"{keys['sft']}.partial"
    monkeypatch.setenv(FAULT_ENV, "sft:term:3")
    monkeypatch.setenv(FAULT_RANK_ENV, "1")
    with pytest.raises(Interrupted, match=r"^sft: rank \d of 2: sft stopped after step 4, checkpoint written"):
        run_stage(p, "sft", keys)
    assert processes_naming(str(tmp_path)) == []
    assert sorted(x.name for x in partial.glob("checkpoints/step-*")) == ["step-2", "step-4"]
    shards = sorted(x.name for x in partial.glob("checkpoints/step-4/engine/engine/*optim_states.pt"))
    assert len(shards) == 2, shards
    monkeypatch.setenv(FAULT_ENV, "sft:6")  # SIGKILL, rank 1 only
    with pytest.raises(launch.RankFailed, match=r"^sft: rank 1 failed first without reporting an error \(exit "
                                                r"code -9"):
        run_stage(p, "sft", keys)
    assert processes_naming(str(tmp_path)) == []
    assert "step-6" in [x.name for x in partial.glob("checkpoints/step-*")]
    monkeypatch.delenv(FAULT_ENV)
    result = run_stage(p, "sft", keys)
    rank0_out = "".join(x.read_text() for x in Path(result.artifact).glob("logs/**/0/stdout.log"))
    assert "sft: resuming from step-6" in rank0_out
    assert result.metrics["steps"] == 8
    assert_close_weights(result.artifact, dp1_sft.artifact, atol=2e-5)  # ZeRO-2's reductions vs plain AdamW


# ------------------------------------------------------------------------------------------- no processes
def _report(job_dir: Path, rank: int, kind: str, t: float, message: str, typ: str = "X") -> None:
    (job_dir / f"error-rank-{rank}.json").write_text(json.dumps(
        {"rank": rank, "world": 2, "kind": kind, "type": typ, "message": message, "time": t}))


@pytest.mark.parametrize("kind, cls", [("input", InputError), ("interrupted", Interrupted), ("fault", TrainingFault),
                                       ("other", launch.RankFailed)])
def test_the_first_failing_ranks_error_is_the_stages_error(tmp_path, kind, cls):
    _report(tmp_path, 1, kind, 1.0, "what went wrong")
    _report(tmp_path, 0, "other", 2.0, "Connection closed by peer")  # its echo on the other rank, later
    e = launch.failure("sft", tmp_path, tmp_path / "logs", 1)
    assert type(e) is cls and "rank 1 of 2" in str(e) and "what went wrong" in str(e) and "\n" not in str(e)


SUMMARY = """stages.rank FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-03_15:05:{killed}
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 23200)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 23200
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_15:05:07
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 23199)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""  # torchrun's own words, from a run where rank 1 was SIGKILLed; its "root cause" is merely who exited first


def test_a_rank_killed_without_a_report_is_named_from_torchruns_summary(tmp_path):
    """Rank 1 was SIGKILLed (no report); rank 0's report is only the echo (its peer vanished)."""
    import time
    t = time.mktime(time.strptime("2026-12-03_15:05:07", "%Y-%m-%d_%H:%M:%S"))
    (tmp_path / "torchrun.log").write_text(SUMMARY.format(killed="07"))
    _report(tmp_path, 0, "other", t + 0.5, "Connection closed by peer")
    e = launch.failure("ppo", tmp_path, tmp_path / "logs", 1)
    assert isinstance(e, launch.RankFailed) and "\n" not in str(e)
    assert str(e).startswith("ppo: rank 1 failed first without reporting an error (exit code -9 (pid: 23200)  "
                             "(SIGKILL))")
    # a rank SIGKILLed long after a report is torchrun ending a rank stuck past its grace period: the report wins
    (tmp_path / "torchrun.log").write_text(SUMMARY.format(killed="47"))
    assert str(launch.failure("ppo", tmp_path, tmp_path / "logs", 1)).startswith(
        "ppo: rank 0 of 2 failed: X: Connection closed by peer")


def test_multi_node_launch_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_RLHF_NNODES", "2")
    monkeypatch.setenv("HYBRID_RLHF_NODE_RANK", "1")
    monkeypatch.setenv("HYBRID_RLHF_MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("HYBRID_RLHF_MASTER_PORT", "29500")
    cmd = launch.torchrun_command(4, tmp_path / "job.json", tmp_path, launch.Nodes.from_env(), 1234)
    joined = " ".join(cmd)
    assert "--nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 10.0.0.1 --master-port 29500" in joined
    with pytest.raises(InputError, match=r"engine.layout: 3 processes do not split evenly over "
                                         r"HYBRID_RLHF_NNODES=2"):
        launch.torchrun_command(3, tmp_path / "job.json", tmp_path, launch.Nodes.from_env(), 1234)
    monkeypatch.delenv("HYBRID_RLHF_MASTER_ADDR")
    with pytest.raises(InputError, match=r"HYBRID_RLHF_NNODES=2: expected HYBRID_RLHF_MASTER_ADDR"):
        launch.Nodes.from_env()
    monkeypatch.setenv("HYBRID_RLHF_NODE_RANK", "x")
    with pytest.raises(InputError, match=r"HYBRID_RLHF_NODE_RANK: found 'x', expected a whole number >= 0"):
        launch.Nodes.from_env()


@pytest.mark.parametrize("overrides, cls, message", [
    ({"sft": {"batch_size": 15, "micro_batch_size": 5}}, InputError,
     r"sft.batch_size: found 15, expected a multiple of engine.layout.dp=2"),
    ({"ppo": {"rollout_batch_size": 15, "minibatch_size": 5, "micro_batch_size": 5}}, InputError,
     r"ppo.rollout_batch_size: found 15, expected a multiple of engine.layout.dp=2"),
    ({"engine": {"layout": {"dp": 2}, "rollout": {"backend": "vllm"}}}, NotYetSupported,
     r"engine.layout.dp=2 with engine.rollout.backend=vllm"),
    ({"engine": {"layout": {"dp": 2, "tp": 2}, "rollout": {"tp": 4}}}, InputError,
     r"engine.rollout.tp: found 4, expected a divisor of engine.layout.tp=2"),
    ({"engine": {"layout": {"dp": 2}, "memory_budget_gib": 4}}, NotYetSupported,
     r"engine.layout.dp=2 with engine.memory_budget_gib"),
])
def test_data_parallel_params_are_checked_up_front(overrides, cls, message):
    base = {"engine": {"layout": {"dp": 2}}}
    merged = {**base, **overrides}
    with pytest.raises(cls, match=message) as e:
        load_params("test", merged)
    assert "\n" not in str(e.value)


def test_one_process_layouts_do_not_launch():
    assert not launch.distributed(load_params("test"), "sft")
    assert not launch.distributed(load_params("test", {"engine": {"layout": {"dp": 2}}}), "evaluate")
    assert launch.distributed(load_params("test", {"engine": {"layout": {"dp": 2}}}), "ppo")


def test_ctrl_c_to_the_parent_stops_every_rank_with_a_checkpoint(tmp_path):
    """SIGINT to `python -m stages.runner` (Ctrl-C): the parent asks the ranks to stop, they checkpoint after the
    same step and end; exit code 130 and nothing of the job left running."""
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(FAULT_ENV, None)
    proc = subprocess.Popen([sys.executable, "-m", "stages.runner", "test", "sft", "--set", "engine.layout.dp=2",
                             "--set", "sft.epochs=200", "--set", "sft.checkpoint_every=1000",
                             "--set", f"pipeline.artifacts_dir={tmp_path}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not any(f.stat().st_size for f in tmp_path.glob("sft/*.partial/launch/metrics.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline, "the job never logged a step"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted: sft: rank" in err.strip().splitlines()[-1]
    assert processes_naming(str(tmp_path)) == []
    steps = [x.name for x in tmp_path.glob("sft/*.partial/checkpoints/step-*")]
    assert len(steps) == 1  # the stop's own checkpoint (the regular ones are every 1000 steps)


class _OtherHalf:
    """Stands in for the all-reduce over two ranks: adds what the other rank would contribute, call by call
    (count, sum, then squared deviations from the global mean that the first two calls give)."""

    def __init__(self, x, mask):
        self.x, self.mask, self.calls, self.n, self.total = x, mask, 0, None, None

    def __call__(self, t):
        from hybridcore import rl
        self.calls += 1
        if self.calls == 1:
            self.n = t + self.mask.sum()
            return self.n
        if self.calls == 2:
            self.total = t + rl.masked_sum(self.x, self.mask)
            return self.total
        mean = self.total / self.n
        return t + rl.masked_sum((self.x - mean) ** 2, self.mask)


def test_whitening_with_a_reduce_uses_the_global_batchs_statistics():
    from hybridcore import rl
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=g) > 0.3).to(torch.float64)
    whole = rl.masked_whiten(x, mask)
    first = rl.masked_whiten(x[:3], mask[:3], reduce=_OtherHalf(x[3:], mask[3:]))
    second = rl.masked_whiten(x[3:], mask[3:], reduce=_OtherHalf(x[:3], mask[:3]))
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=0, atol=1e-12)


def test_gpu_ranks_need_gpu_tensors_and_one_gpu_each(monkeypatch):
    """Checked in the parent before torchrun starts (a GPU machine is faked: these tests run on CPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    p = load_params("test", {"engine": {"layout": {"dp": 2}, "device": "cpu"}})
    with pytest.raises(InputError, match=r"engine.device: cpu with engine.layout.dp=2 on a machine with GPUs"):
        launch.check_devices(p, 2)
    p = load_params("test", {"engine": {"layout": {"dp": 2}, "device": "auto"}})
    with pytest.raises(InputError, match=r"engine.layout: 2 ranks on this node but torch sees 1 GPUs"):
        launch.check_devices(p, 2)
    launch.check_devices(p, 1)
