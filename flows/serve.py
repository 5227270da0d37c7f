"""`hybrid-rlhf serve`: a Prefect server on 127.0.0.1 and one deployment of the `rlhf` flow per params
preset, so that a team runs the pipeline with `prefect deployment run 'rlhf/<preset>'`."""
from __future__ import annotations

import os
from pathlib import Path

from flows import server
from stages.params import PARAMS_DIR


def presets() -> list[str]:
    return sorted(p.stem for p in PARAMS_DIR.glob("*.yaml"))


def serve(port: int = 4200) -> int:
    """Blocks until SIGTERM or Ctrl-C; the server we started goes with us (also if we are killed)."""
    log = open(Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True) or
               Path(os.environ["PREFECT_HOME"]) / "server.log", "ab")
    proc, url = server.start(port=port, ui=True, ephemeral=False, log=log)
    os.environ["PREFECT_API_URL"] = url
    print(f"Prefect server: {url.removesuffix('/api')} (log: {log.name})", flush=True)
    try:
        from prefect import serve as prefect_serve

        from flows.pipeline import rlhf
        deployments = [rlhf.to_deployment(name=name, parameters={"preset": name}) for name in presets()]
        print("deployments: " + ", ".join(f"rlhf/{n}" for n in presets()), flush=True)
        print(f"run one with: PREFECT_API_URL={url} prefect deployment run 'rlhf/tiny' "
              f"--params '{{\"overrides\": {{\"ppo\": {{\"kl_coef\": 0.1}}}}}}' --watch", flush=True)
        prefect_serve(*deployments)
    finally:
        server.drain_clients()
        server.stop(proc)
        log.close()
    return 0
