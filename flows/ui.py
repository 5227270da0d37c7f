"""`hybrid-rlhf ui`: the MLflow UI over a folder's mlruns/, on 127.0.0.1 only, stopped cleanly by Ctrl-C or
SIGTERM (the server is told to stop and waited for; whatever is left of its process group is killed)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from flows.server import free_port, healthy
from hybridcore.errors import InputError

HOST = "127.0.0.1"


class _Stop(Exception):
    """Raised in the main thread by SIGINT/SIGTERM, so that cleanup runs in `finally`, not in a handler."""


def store_db(store: Path) -> Path:
    db = store / "mlflow.db"
    if not db.is_file():
        raise InputError(f"--store {store}: no MLflow store there (expected {db}); run the pipeline in this "
                         f"folder first, or point --store at the mlruns/ folder of one")
    return db.resolve()


def command(store: Path, port: int) -> list[str]:
    """`mlflow server` over the SQLite store, artifacts kept under mlruns/artifacts, one worker."""
    art = (store / "artifacts").resolve()
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store_db(store)}",
            "--artifacts-destination", art.as_uri(), "--host", HOST, "--port", str(port), "--workers", "1"]


def check_port(port: int) -> None:
    with contextlib.closing(socket.socket()) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a TIME_WAIT port is free
        try:
            s.bind((HOST, port))
        except OSError:
            raise InputError(f"--port {port}: already in use on {HOST}; pick another (e.g. --port 0 for any "
                             f"free one)") from None


def _die_with_parent() -> None:
    """In the child: the kernel sends it SIGTERM if this process dies, even by SIGKILL."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    os.setpgrp()  # its own process group: a terminal's Ctrl-C reaches only us, and we stop it once


def stop(proc: subprocess.Popen, grace: float = 15) -> None:
    """SIGTERM (mlflow forwards it to uvicorn), then SIGKILL to the group of whatever is left."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the group we created for it; gone already in the normal case
    proc.wait()


def serve(store: Path, port: int, ready_timeout: float = 120) -> int:
    """Run the server until a signal; 0 when stopped by Ctrl-C/SIGTERM."""
    port = port or free_port()
    cmd = command(store, port)
    check_port(port)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}

    def on_signal(signum, frame):
        raise _Stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    proc = None
    url = f"http://{HOST}:{port}"
    try:
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
        t0 = time.time()
        while not healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"the MLflow server exited with code {proc.returncode} while starting")
            if time.time() - t0 > ready_timeout:
                raise RuntimeError(f"the MLflow server at {url} was not healthy after {ready_timeout:.0f} s")
            time.sleep(0.3)
        print(f"MLflow UI: {url}  (store {store_db(store).parent}; Ctrl-C stops it)", flush=True)
        code = proc.wait()
        raise RuntimeError(f"the MLflow server exited with code {code}")
    except _Stop as e:
        print(f"MLflow UI: stopping ({e})", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if proc is not None:
            stop(proc)
        for s, h in previous.items():
            signal.signal(s, h)
