"""A training stage whose engine.layout spans several processes runs as a torchrun job; this is its parent side.

run_stage (stages/runner.py) calls `run_ranks` in place of the stage function, inside the same lock and staging
folder, so the flow, the CLI and the tests share one path: the parent writes the params to a job file, starts
`python -m torch.distributed.run ... --module stages.rank JOB` in its own process group on 127.0.0.1, forwards
rank 0's step metrics (a JSON-lines file) to its sink while the ranks train, and returns rank 0's final metrics.
A failed rank fails the stage with that rank's error as the one line; nothing the job started outlives it.

Several nodes: every node runs the same command with HYBRID_RLHF_NNODES, HYBRID_RLHF_NODE_RANK and
HYBRID_RLHF_MASTER_ADDR / _PORT (node 0's address), over an artifacts_dir on a shared file system; torchrun's
static rendezvous puts ranks 0.. on node 0, whose parent publishes. Untested: these machines have one node.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hybridcore.errors import InputError, TrainingFault
from hybridcore.interrupts import Interrupted, stop_requested

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTED = ("sft", "reward", "ppo")  # evaluation trains nothing: it stays one process
LAUNCH, LOGS = "launch", "logs"         # job files (dropped before publishing); per-rank stdout/stderr (kept)
STOP_GRACE_S = 300.0                    # after a stop request: time for the ranks to checkpoint before SIGKILL
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")


class RankFailed(TrainingFault):
    """A rank of a torchrun job failed with an error that is neither the user's input nor a stop request."""


def world_size(params) -> int:
    lay = params.engine.layout
    return lay.dp * lay.tp


def distributed(params, stage: str) -> bool:
    """True when `stage` runs as a torchrun job: a training stage whose layout has more than one process."""
    return stage in DISTRIBUTED and world_size(params) > 1


@dataclass(frozen=True)
class Nodes:
    """Where the job's processes live: one node (the default), or several through torchrun's static rendezvous."""
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None

    @classmethod
    def from_env(cls) -> "Nodes":
        def whole(name: str, default: Optional[int], low: int) -> Optional[int]:
            raw = os.environ.get(name)
            if raw in (None, ""):
                return default
            if not raw.isdigit() or int(raw) < low:
                raise InputError(f"environment variable {name}: found {raw!r}, expected a whole number >= {low}")
            return int(raw)
        nnodes = whole("HYBRID_RLHF_NNODES", 1, 1)
        node_rank = whole("HYBRID_RLHF_NODE_RANK", 0, 0)
        if node_rank >= nnodes:
            raise InputError(f"environment variable HYBRID_RLHF_NODE_RANK: found {node_rank}, expected below "
                             f"HYBRID_RLHF_NNODES={nnodes}")
        addr = os.environ.get("HYBRID_RLHF_MASTER_ADDR") or "127.0.0.1"
        port = whole("HYBRID_RLHF_MASTER_PORT", None, 1)
        if nnodes > 1 and (addr == "127.0.0.1" or port is None):
            raise InputError(f"HYBRID_RLHF_NNODES={nnodes}: expected HYBRID_RLHF_MASTER_ADDR (node 0's address, "
                             f"reachable from every node) and HYBRID_RLHF_MASTER_PORT to be set")
        return cls(nnodes, node_rank, addr, port)


def torchrun_command(world: int, job: Path, log_dir: Path, nodes: Nodes, port: int) -> list[str]:
    """torchrun over `world` ranks: rank 0's output on the console, every rank's in log_dir."""
    if world % nodes.nnodes:
        raise InputError(f"engine.layout: {world} processes do not split evenly over HYBRID_RLHF_NNODES="
                         f"{nodes.nnodes} nodes")
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes.nnodes),
            "--node-rank", str(nodes.node_rank), "--nproc-per-node", str(world // nodes.nnodes),
            "--master-addr", nodes.master_addr, "--master-port", str(nodes.master_port or port),
            "--max-restarts", "0", "--log-dir", str(log_dir), "--redirects", "3", "--tee", "3",
            "--local-ranks-filter", "0", "--module", "stages.rank", str(job)]


def check_devices(params, per_node: int) -> None:
    """The ranks talk over NCCL wherever torch sees a GPU (gloo otherwise), one GPU per rank."""
    import torch
    if not torch.cuda.is_available():
        return
    dp, tp = params.engine.layout.dp, params.engine.layout.tp
    if params.engine.device == "cpu":
        what = f"engine.layout.dp={dp}" if tp == 1 else f"engine.layout dp={dp} x tp={tp}"
        raise InputError(f"engine.device: cpu with {what} on a machine with GPUs: the ranks "
                         f"reduce over NCCL, which needs GPU tensors; expected auto or cuda")
    if per_node > torch.cuda.device_count():
        raise InputError(f"engine.layout: {per_node} ranks on this node but torch sees "
                         f"{torch.cuda.device_count()} GPUs; expected at most one rank per GPU")


def _stat_fields() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, process group, start time) of every live process (Linux /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":  # a zombie is already dead; its parent reaps it
                out[int(entry.name)] = (int(fields[1]), int(fields[2]), int(fields[19]))
    return out


def job_processes(pid: int, seen: frozenset = frozenset()) -> set[tuple[int, int]]:
    """(pid, start time) of torchrun (`pid`), everything in its process group, and all their descendants
    (torchrun starts each rank in a session of its own, so its process group alone does not hold the ranks),
    plus those of `seen` (found earlier) still alive, should torchrun already be gone and its ranks orphaned."""
    table = _stat_fields()
    found = {p for p, (_, pgid, _) in table.items() if pgid == pid}
    if pid in table:
        found.add(pid)
    found |= {p for p, start in seen if table.get(p, (0, 0, None))[2] == start}
    frontier = set(found)
    while frontier:
        frontier = {p for p, (ppid, _, _) in table.items() if ppid in frontier and p not in found}
        found |= frontier
    return {(p, table[p][2]) for p in found}


def kill_job(pid: int, seen: frozenset = frozenset()) -> None:
    """SIGKILL torchrun and every process of its job, until none is left (a rank may be mid-fork)."""
    for _ in range(50):
        procs = job_processes(pid, seen)
        if not procs:
            return
        for p, _ in procs:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


class _Forward:
    """Rank 0's metrics file, read as it grows and handed to the parent's sink line by line."""

    def __init__(self, path: Path, sink):
        self.path, self.sink, self.offset = path, sink, 0

    def __call__(self) -> None:
        if not self.path.is_file():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            while (line := f.readline()).endswith("\n"):
                self.offset = f.tell()
                row = json.loads(line)
                self.sink.log(row["metrics"], row["step"])


def _pump(stream, log_file: Path) -> None:
    """torchrun's console output to a file kept for failures; rank 0's lines (`[default0]:...`) also to our
    stderr, torchrun's own report of a failed job only to the file (the stage's error line says it all)."""
    with open(log_file, "w") as f:
        for line in stream:
            if line.startswith("[default"):
                sys.stderr.write(line)
            f.write(line)
            f.flush()


def run_ranks(params, stage: str, inputs: dict[str, Path], out: Path, sink, timeout_s: Optional[float] = None,
              nodes: Optional[Nodes] = None, job_dir: Optional[Path] = None) -> dict:
    """Run `stage` as a torchrun job writing into `out` (the staging folder); rank 0's final metrics."""
    from hybridcore.parallel import free_port

    nodes = nodes or Nodes.from_env()
    world = world_size(params)
    check_devices(params, world // nodes.nnodes)
    job_dir = job_dir or out / LAUNCH
    log_dir = (out / LOGS / f"node-{nodes.node_rank}" if nodes.nnodes > 1 else out / LOGS).resolve()
    for d in (job_dir, log_dir):
        d.mkdir(parents=True, exist_ok=True)
    job = write_job(job_dir, params, stage, inputs, out)
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default for several ranks, without its warning
    cmd = torchrun_command(world, job, log_dir, nodes, free_port())
    forward = _Forward(job_dir / "metrics.jsonl", sink)
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    pump = threading.Thread(target=_pump, args=(proc.stdout, job_dir / "torchrun.log"), daemon=True)
    pump.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    stop_sent, seen, scanned = None, frozenset(), 0.0
    try:
        while proc.poll() is None:
            forward()
            if time.monotonic() - scanned > 1.0:  # the job's processes, remembered in case torchrun dies first
                seen, scanned = seen | job_processes(proc.pid), time.monotonic()
            if stop_requested() and stop_sent is None:  # a graceful stop: each rank checkpoints, then exits
                stop_sent = time.monotonic()
                stop_ranks(proc.pid)
            if stop_sent is not None and time.monotonic() - stop_sent > STOP_GRACE_S:
                raise Interrupted(f"{stage}: the ranks did not stop within {STOP_GRACE_S:.0f} s of the stop request; "
                                  f"killed them (a rerun resumes from the newest checkpoint)")
            if deadline is not None and time.monotonic() > deadline:
                raise RankFailed(f"{stage}: the torchrun job ran past its {timeout_s:.0f} s limit; killed it "
                                 f"(per-rank logs in {log_dir})")
            time.sleep(0.2)
        forward()
    finally:  # whatever happened (a failure, a timeout, Ctrl-C): nothing the job started is left running
        kill_job(proc.pid, seen)
        proc.wait()
        pump.join(timeout=10)
    if proc.returncode != 0:
        raise failure(stage, job_dir, log_dir, proc.returncode)
    return {} if nodes.node_rank > 0 else rank0_result(stage, job_dir, log_dir)


def write_job(job_dir: Path, params, stage: str, inputs: dict[str, Path], out: Path) -> Path:
    """job.json: what every rank reads to run the stage (stages/rank.py)."""
    job = job_dir / "job.json"
    job.write_text(json.dumps({"stage": stage, "params": params.model_dump(mode="json"),
                               "inputs": {k: str(Path(v).resolve()) for k, v in inputs.items()},
                               "out": str(out.resolve())}))
    return job


def stop_ranks(torchrun_pid: int) -> None:
    """SIGTERM to every rank (torchrun's children, not their helpers): each checkpoints, then exits."""
    for pid, (ppid, _, _) in _stat_fields().items():
        if ppid == torchrun_pid:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def rank0_result(stage: str, job_dir: Path, log_dir: Path) -> dict:
    """Rank 0's final metrics from a job that exited cleanly; the job folder goes (the logs stay: they are part
    of the artifact)."""
    result = job_dir / "result.json"
    if not result.is_file():
        raise RankFailed(f"{stage}: the torchrun job ended without rank 0's result ({result}); per-rank logs in "
                         f"{log_dir}")
    metrics = json.loads(result.read_text())
    shutil.rmtree(job_dir, ignore_errors=True)
    return metrics


def exits(job_dir: Path) -> list[dict]:
    """Each failed rank in torchrun's summary: rank, exit code (as torchrun words it, and as a number) and when
    torchrun saw it (whole seconds); empty if torchrun printed none."""
    log = job_dir / "torchrun.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    if "Failures:" not in text:
        return []
    found = []
    for block in re.split(r"^\s*\[\d+\]:\s*$", text[text.index("Failures:"):], flags=re.M)[1:]:
        rank = re.search(r"^\s*rank\s*:\s*(\d+)", block, re.M)
        code = re.search(r"^\s*exitcode\s*:\s*(-?\d+)(.*?)\s*$", block, re.M)
        when = re.search(r"^\s*time\s*:\s*(\S+)", block, re.M)
        if rank is None or code is None:
            continue
        try:
            t = time.mktime(time.strptime(when.group(1), "%Y-%m-%d_%H:%M:%S")) if when else None
        except ValueError:
            t = None
        found.append({"rank": int(rank.group(1)), "code": int(code.group(1)),
                      "words": (code.group(1) + code.group(2)).strip(), "time": t})
    return found


def failure(stage: str, job_dir: Path, log_dir: Path, returncode: int) -> Exception:
    """The error of the rank that failed first, as the exception the one-process stage would have raised.

    A rank that fails reports its error (stages/rank.py); the others then fail too, reporting that their peer
    vanished, so the earliest report is the cause -- unless a rank died silently (a signal other than
    torchrun's own SIGTERM, e.g. SIGKILL or a crash) no later than that report: then that death is."""
    reports = {}
    for path in job_dir.glob("error-rank-*.json"):
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        reports[r["rank"]] = r
    first = min(reports.values(), key=lambda r: r["time"]) if reports else None
    for e in exits(job_dir):
        silent = e["rank"] not in reports and e["code"] != 0 and e["code"] != -signal.SIGTERM
        if silent and (first is None or e["time"] is None or e["time"] <= first["time"] + 1.0):
            return RankFailed(f"{stage}: rank {e['rank']} failed first without reporting an error (exit code "
                              f"{e['words']}); per-rank logs in {log_dir}")
    if first is None:
        return RankFailed(f"{stage}: the torchrun job failed (exit code {returncode}) and no rank reported an "
                          f"error; see {job_dir / 'torchrun.log'} and the per-rank logs in {log_dir}")
    line = f"{stage}: rank {first['rank']} of {first['world']}: {first['message']}"
    if first["kind"] == "input":
        return InputError(line)
    if first["kind"] == "interrupted":
        return Interrupted(line)
    if first["kind"] == "fault":
        return TrainingFault(line)
    return RankFailed(f"{stage}: rank {first['rank']} of {first['world']} failed: {first['type']}: "
                      f"{first['message']} (per-rank logs in {log_dir})")


def run_other_node(params, stage: str, inputs: dict[str, Path], tmp: Path, published, wait_s: float = 600.0):
    """A node other than node 0 of a multi-node job: run its ranks into the shared staging folder (no lock: node 0
    holds it), then wait for node 0 to publish; `published()` gives the verified result or None. Untested here."""
    class _Null:
        def log(self, metrics, step):
            pass
    job_dir = tmp.parent / f"{tmp.name.removesuffix('.partial')}.node-{Nodes.from_env().node_rank}"
    job_dir.mkdir(parents=True, exist_ok=True)  # outside the staging folder, which node 0 clears when it starts
    run_ranks(params, stage, inputs, tmp, _Null(), job_dir=job_dir)
    t0 = time.monotonic()
    while (hit := published()) is None:
        if time.monotonic() - t0 > wait_s:
            raise RankFailed(f"{stage}: this node's ranks finished but node 0 did not publish the artifact within "
                             f"{wait_s:.0f} s")
        time.sleep(2.0)
    return hit
