"""Run one stage against the artifact store: a verified artifact is a cache hit, otherwise the stage
runs into a staging folder that is published atomically with its manifest.

No Prefect here: tests, the flow's tasks and (later) distributed launchers all call `run_stage`.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol

from hybridcore.artifacts import artifact_dir, publish, read_verified, staging_dir
from stages.keys import INPUTS, code_version, stage_params
from stages.params import Params


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
    for dep in INPUTS[stage]:
        dep_hit = cached_result(params, dep, keys[dep])
        if dep_hit is None:
            raise RuntimeError(f"stage {stage} needs the {dep} artifact {keys[dep]}, which is missing or fails "
                               f"verification; run the pipeline up to {dep} first")
        inputs[dep] = Path(dep_hit.artifact)
    module = importlib.import_module(f"stages.{stage}")
    tmp = staging_dir(params.pipeline.artifacts_dir, stage, key)
    t0 = time.time()
    metrics = module.run(params, inputs, tmp, sink or NullSink())
    metrics = {k: float(v) for k, v in metrics.items() if v is not None}
    manifest = {"stage": stage, "key": key, "params": stage_params(params, stage),
                "inputs": {d: keys[d] for d in INPUTS[stage]}, "code_version": code_version(stage),
                "metrics": metrics, "produced_by": run_id, "seconds": round(time.time() - t0, 2)}
    final = publish(tmp, manifest)
    return StageResult(stage, key, str(final.resolve()), False, metrics, run_id)
