"""Fixtures for the tracking tests: a second pipeline run beside the session's tiny run (a PPO-only change,
so SFT and the RM are cache hits, ~30 s), and `hybrid-rlhf ui` serving that store on a free loopback port.
Every process started here is stopped by PID in teardown, and every wait is bounded."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from flows.server import free_port, healthy
from tests.conftest import ROOT, run_cli

VARIANT = ["--set", "ppo.iterations=3", "--set", "ppo.kl_coef=0.1"]


@dataclass
class TwoRuns:
    workdir: Path
    a: dict   # the session's tiny run (params/tiny.yaml)
    b: dict   # the same with VARIANT: only PPO and evaluation run again


@dataclass
class Server:
    url: str
    port: int
    proc: subprocess.Popen


@pytest.fixture(scope="session")
def two_runs(tiny_run) -> TwoRuns:
    proc = run_cli(["run", str(ROOT / "params" / "tiny.yaml"), *VARIANT, "--summary-json", "variant.json"],
                   tiny_run.workdir, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return TwoRuns(tiny_run.workdir, tiny_run.summary, json.loads((tiny_run.workdir / "variant.json").read_text()))


def start_ui(workdir: Path, port: int, timeout: float = 120) -> Server:
    """`hybrid-rlhf ui --port PORT` in `workdir`, returned once /health answers."""
    log = open(workdir / f"ui-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--port", str(port)], cwd=workdir,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while not healthy(url):
        if proc.poll() is not None or time.time() - t0 > timeout:
            stop_tree(proc)
            pytest.fail(f"hybrid-rlhf ui did not come up: {(workdir / f'ui-{port}.log').read_text()[-3000:]}")
        time.sleep(0.3)
    return Server(url, port, proc)


def tree(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    return []


def stop_tree(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 30) -> list[psutil.Process]:
    """Signal `proc`, wait for it, then SIGKILL by PID whatever of its tree is still alive; returns those."""
    procs = tree(proc.pid)
    if proc.poll() is None:
        proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    _, alive = psutil.wait_procs(procs, timeout=5)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    if proc.poll() is None:
        proc.wait(timeout=10)
    return alive


@pytest.fixture(scope="session")
def mlflow_ui(two_runs) -> Server:
    server = start_ui(two_runs.workdir, free_port())
    try:
        yield server
    finally:
        stop_tree(server.proc)


def api(server: Server, path: str, body: dict | None = None) -> dict:
    """GET (or POST `body` as JSON) on the server's REST API."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{server.url}{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())
