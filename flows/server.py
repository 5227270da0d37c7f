"""A Prefect API server on 127.0.0.1 that cannot outlive the process that started it.

Prefect's own ephemeral server is a child process that survives a SIGKILL of its parent. Ours is the
same uvicorn app, started with PR_SET_PDEATHSIG so the kernel sends it SIGTERM when its parent dies,
however it dies: a killed pipeline never leaves a server behind.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    """True when the server at `url` answers its /health route (Prefect's API and MLflow both have one)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with code {proc.returncode} while starting")
        if healthy(url):
            return
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"the Prefect server at {url} was not healthy after {timeout:.0f} s")


def start(port: int | None = None, ui: bool = False, ephemeral: bool = True, log=None, wait: bool = True
          ) -> tuple[subprocess.Popen, str]:
    """Start the Prefect API (and UI when asked) on 127.0.0.1; returns (process, API url). wait=False returns as
    soon as the process is started: call ready() before using the url."""
    port = port or free_port()
    app_dir = Path(importlib.util.find_spec("prefect").origin).parent.parent
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PREFECT_UI_ENABLED": "1" if ui else "0", "PREFECT_SERVER_API_HOST": "127.0.0.1",
                "PREFECT_SERVER_API_PORT": str(port)})
    if ephemeral:  # no background services (scheduler, late-run detection): a single pipeline run needs none
        env.update({"PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"})
    out = log if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--app-dir", str(app_dir), "--factory",
                             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "error", "--lifespan", "on"],
                            env=env, stdout=out, stderr=out, preexec_fn=_die_with_parent)
    url = f"http://127.0.0.1:{port}/api"
    if wait:
        ready(url, proc)
    return proc, url


def ready(url: str, proc: subprocess.Popen) -> None:
    """Wait until the server started by start() answers (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, 90)."""
    wait_healthy(url, proc, float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")))


def stop(proc: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM, then SIGKILL if it is still there after `grace` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def api_server(meanwhile: Callable[[], object] = lambda: None):
    """PREFECT_API_URL for the duration: the user's own server if set, else one of ours. `meanwhile()` runs while
    ours starts up (its ~4 s of imports and database set-up take the other core); if it raises, the server is
    stopped and the error goes on."""
    if os.environ.get("PREFECT_API_URL"):
        meanwhile()
        yield os.environ["PREFECT_API_URL"]
        return
    proc, url = start(wait=False)
    try:
        meanwhile()
        ready(url, proc)
    except BaseException:  # a server still starting finishes its start-up before a SIGTERM stops it (~8 s)
        stop(proc, grace=1)
        raise
    os.environ["PREFECT_API_URL"] = url
    try:
        yield url
    finally:
        drain_clients()
        os.environ.pop("PREFECT_API_URL", None)
        stop(proc)


def drain_clients(timeout: float = 15) -> None:
    """Send the logs and events Prefect still holds before their server goes; otherwise they retry against
    a closed port for a minute at exit."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout)
