"""MLflow wiring: one parent run per pipeline run, one nested run per stage.

Uses MlflowClient with explicit run ids (never the fluent active-run stack, which is per thread while
Prefect may run tasks in other threads). A stage sees only a `Sink`; with tracking off it gets one
that drops everything, so stages run the same either way.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from stages.runner import NullSink, StageResult


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "."))
        else:
            out[name] = str(v)[:6000]
    return out


def _uri(uri: str) -> str:
    """sqlite:///relative/path.db -> an absolute path, with its folder created."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        path = Path(uri.removeprefix("sqlite:///")).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path}"
    return uri


class StageRun:
    """A nested MLflow run that a stage logs step metrics into (buffered, sent in batches)."""

    def __init__(self, client, run_id: str):
        self.client, self.run_id, self.buffer = client, run_id, []

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.buffer += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if len(self.buffer) >= 900:
            self.flush()

    def flush(self) -> None:
        for i in range(0, len(self.buffer), 900):
            self.client.log_batch(self.run_id, metrics=self.buffer[i:i + 900])
        self.buffer = []


class Tracker:
    def __init__(self, params, flow_run_id: Optional[str] = None):
        self.client = None
        if not params.tracking.enabled:
            return
        logging.getLogger("alembic").setLevel(logging.WARNING)
        from mlflow import MlflowClient
        t = params.tracking
        self.client = MlflowClient(tracking_uri=_uri(t.uri))
        exp = self.client.get_experiment_by_name(t.experiment)
        if exp is None:
            art = Path(t.artifacts).resolve()
            art.mkdir(parents=True, exist_ok=True)
            self.experiment_id = self.client.create_experiment(t.experiment, artifact_location=art.as_uri())
        else:
            self.experiment_id = exp.experiment_id
        tags = {"pipeline": params.pipeline.name, "prefect_flow_run_id": str(flow_run_id or "")}
        self.run_id = self.client.create_run(self.experiment_id, run_name=params.pipeline.name, tags=tags).info.run_id
        self._log_params(self.run_id, flatten(params.model_dump(mode="json")))

    def _log_params(self, run_id: str, flat: dict[str, str]) -> None:
        from mlflow.entities import Param
        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i:i + 100])

    def start_stage(self, stage: str, key: str, stage_params: dict):
        """A nested run for one stage, or a sink that drops everything when tracking is off."""
        if self.client is None:
            return NullSink()
        tags = {"mlflow.parentRunId": self.run_id, "stage": stage, "cache_key": key}
        run = self.client.create_run(self.experiment_id, run_name=stage, tags=tags)
        named = {stage if k == "stage" else k: v for k, v in stage_params.items()}  # ppo.kl_coef, not stage.kl_coef
        self._log_params(run.info.run_id, flatten(named))
        return StageRun(self.client, run.info.run_id)

    def end_stage(self, sink, result: Optional[StageResult], status: str = "FINISHED") -> None:
        if self.client is None or not isinstance(sink, StageRun):
            return
        if result is not None:
            if result.cached:  # headline metrics again, so that comparisons across runs stay complete
                sink.log(result.metrics, 0)
                self.client.set_tag(sink.run_id, "cache_hit", "true")
                self.client.set_tag(sink.run_id, "produced_by_run", result.produced_by or "unknown")
            else:
                self.client.set_tag(sink.run_id, "cache_hit", "false")
            for name in ("manifest.json", "samples.jsonl"):
                if (Path(result.artifact) / name).is_file():
                    self.client.log_artifact(sink.run_id, str(Path(result.artifact) / name))
            self.client.set_tag(sink.run_id, "artifact", result.artifact)
        sink.flush()
        self.client.set_terminated(sink.run_id, status)

    def finish(self, status: str = "FINISHED", summary: Optional[dict] = None) -> None:
        if self.client is None:
            return
        if summary:
            metrics = {f"{s}.{k}": v for s, r in summary.items() for k, v in r["metrics"].items()}
            run = StageRun(self.client, self.run_id)
            run.log(metrics, 0)
            run.flush()
        self.client.set_terminated(self.run_id, status)

    @property
    def parent_run_id(self) -> Optional[str]:
        return getattr(self, "run_id", None)
