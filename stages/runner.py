"""Run one stage against the artifact store: a verified artifact is a cache hit, otherwise the stage
runs into a staging folder that is published atomically with its manifest.

No Prefect here: tests, the flow's tasks and the CLI all call `run_stage`; a layout of several processes
runs the stage as a torchrun job from here (stages/launch.py).
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol

from hybridcore.artifacts import artifact_dir, publish, read_verified, stage_lock, staging_dir
from hybridcore.interrupts import graceful_stop
from stages import launch
from stages.keys import code_version, stage_params
from stages.params import STAGES, Params, stage_inputs


class Sink(Protocol):
    """Where a stage reports step metrics; the flow passes an MLflow-backed one."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...


class NullSink:
    def log(self, metrics: dict[str, float], step: int) -> None:
        pass


@dataclass
class StageResult:
    stage: str
    key: str
    artifact: str
    cached: bool
    metrics: dict = field(default_factory=dict)
    produced_by: Optional[str] = None     # the tracking run that made the artifact

    def as_dict(self) -> dict:
        return {"artifact": self.artifact, "key": self.key, "cached": self.cached, "metrics": self.metrics,
                "produced_by": self.produced_by}


def cached_result(params: Params, stage: str, key: str) -> Optional[StageResult]:
    folder = artifact_dir(params.pipeline.artifacts_dir, stage, key)
    manifest = read_verified(folder)
    if manifest is None or manifest.get("key") != key:
        return None
    return StageResult(stage, key, str(folder.resolve()), True, manifest.get("metrics", {}),
                       manifest.get("produced_by"))


def run_stage(params: Params, stage: str, keys: dict[str, str], sink: Optional[Sink] = None,
              run_id: Optional[str] = None, force: bool = False) -> StageResult:
    """Return the stage's verified artifact, running the stage first unless it is cached."""
    key = keys[stage]
    if not force and (hit := cached_result(params, stage, key)) is not None:
        return hit
    inputs = {}
    for dep in stage_inputs(params, stage):
        dep_hit = cached_result(params, dep, keys[dep])
        if dep_hit is None:
            raise RuntimeError(f"stage {stage} needs the {dep} artifact {keys[dep]}, which is missing or fails "
                               f"verification; run the pipeline up to {dep} first")
        inputs[dep] = Path(dep_hit.artifact)
    module = importlib.import_module(f"stages.{stage}")
    root = params.pipeline.artifacts_dir
    if launch.distributed(params, stage) and launch.Nodes.from_env().node_rank > 0:  # node 0 locks and publishes
        tmp = artifact_dir(root, stage, key).with_name(f"{key}.partial")
        return launch.run_other_node(params, stage, inputs, tmp, lambda: cached_result(params, stage, key))
    with stage_lock(root, stage, key, on_wait=lambda path: print(f"{stage}: another run is building {key}; "
                                                                   f"waiting for it (lock {path})", flush=True)):
        if not force and (hit := cached_result(params, stage, key)) is not None:
            return hit  # the run we waited for finished it
        tmp = staging_dir(root, stage, key)
        t0 = time.time()
        with graceful_stop():
            if launch.distributed(params, stage):  # several processes: a torchrun job, rank 0 reports
                metrics = launch.run_ranks(params, stage, inputs, tmp, sink or NullSink())
            else:
                metrics = module.run(params, inputs, tmp, sink or NullSink())
        metrics = {k: float(v) for k, v in metrics.items() if v is not None}
        manifest = {"stage": stage, "key": key, "params": stage_params(params, stage),
                    "inputs": {d: keys[d] for d in stage_inputs(params, stage)}, "code_version": code_version(stage),
                    "metrics": metrics, "produced_by": run_id, "seconds": round(time.time() - t0, 2)}
        final = publish(tmp, manifest)
    return StageResult(stage, key, str(final.resolve()), False, metrics, run_id)


def main(argv=None) -> int:
    """`python -m stages.runner PARAMS STAGE [--set k=v ...]`: one stage, no Prefect, no tracking; its
    inputs must already be in the artifact store. Prints the result as JSON. For tests and launchers."""
    import argparse
    import json

    from hybridcore.errors import InputError, TrainingFault, say
    from hybridcore.interrupts import Interrupted, install_handlers
    from stages.keys import stage_keys
    from stages.params import load_params, parse_sets

    ap = argparse.ArgumentParser(prog="python -m stages.runner")
    ap.add_argument("params")
    ap.add_argument("stage", choices=list(STAGES))
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args(argv)
    install_handlers()
    try:
        params = load_params(args.params, parse_sets(args.set))
        result = run_stage(params, args.stage, stage_keys(params))
    except InputError as e:
        say(f"error: {e}")
        return 2
    except Interrupted as e:
        say(f"interrupted: {e}")
        return 130
    except TrainingFault as e:
        say(f"error: {e}")
        return 1
    print(json.dumps(result.as_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
