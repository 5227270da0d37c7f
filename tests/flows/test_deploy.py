"""Deployments: `hybrid-rlhf serve` starts a Prefect server on loopback and serves one deployment per
preset; `prefect deployment run 'rlhf/tiny'` with an override completes; a wrongly typed override is
rejected before any run is created; stopping serve leaves no process behind."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

from flows.server import free_port
from tests.conftest import ROOT
from tests.flows.test_resume import _servers_of


def _api(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"}, method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_served_deployment_runs_with_override(tiny_run, tmp_path):
    """The tiny pipeline through a deployment (SFT and RM cached, PPO with the override), then a rejected
    bad override; SIGTERM stops serve and its server."""
    shutil.copytree(tiny_run.workdir / "artifacts", tmp_path / "artifacts")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_HOME", None)
    env.pop("PREFECT_API_URL", None)
    env["PREFECT_RUNNER_POLL_FREQUENCY"] = "1"  # serve picks the run up within a second (Prefect's default: 10 s)
    log = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--port", str(port)], cwd=tmp_path,
                             env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        names = []
        while time.time() < deadline and "tiny" not in names:
            time.sleep(1)
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                names = [d["name"] for d in _api(url, "/deployments/filter", {})]
            except OSError:
                pass
        assert "tiny" in names and "test" in names, names
        client_env = {**env, "PREFECT_API_URL": url, "PREFECT_HOME": str(tmp_path / ".prefect")}
        prefect = [sys.executable, "-m", "prefect", "deployment", "run", "rlhf/tiny", "--params"]
        good = subprocess.run(prefect + [json.dumps({"overrides": {"ppo": {"iterations": 3, "kl_coef": 0.1}}}),
                                         "--watch"], env=client_env, capture_output=True, text=True, timeout=400,
                              cwd=tmp_path)
        assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
        assert "Completed" in good.stdout
        runs = _api(url, "/flow_runs/filter", {})
        assert len(runs) == 1 and runs[0]["state"]["type"] == "COMPLETED"
        assert runs[0]["parameters"]["overrides"]["ppo"]["kl_coef"] == 0.1
        ppo_keys = [p.name for p in (tmp_path / "artifacts" / "ppo").iterdir() if p.is_dir()]
        assert len(ppo_keys) == 2  # the copied one and the overridden run's
        bad = subprocess.run(prefect + [json.dumps({"overrides": {"ppo": {"kl_coef": "lots"}}})],
                             env=client_env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert bad.returncode != 0
        assert "overrides.ppo.kl_coef" in bad.stdout + bad.stderr
        assert len(_api(url, "/flow_runs/filter", {})) == 1  # nothing was created for the bad override
    finally:
        os.kill(serve.pid, signal.SIGTERM)  # serve alone: it pauses its deployments, then stops its own server
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        log.close()
    assert serve.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    deadline = time.time() + 20
    while _servers_of(tmp_path / ".prefect") and time.time() < deadline:
        time.sleep(0.5)
    assert _servers_of(tmp_path / ".prefect") == []
