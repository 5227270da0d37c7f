"""MLflow wiring: one parent run per pipeline run, one nested run per stage.

Uses MlflowClient with explicit run ids (never the fluent active-run stack, which is per thread while
Prefect may run tasks in other threads). A stage sees only a `Sink`; with tracking off it gets one
that drops everything, so stages run the same either way. What stages do not report themselves (step
time, memory peaks, plots, the sample table, the model registry) is added here.
"""
from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Optional

from stages.runner import NullSink, StageResult

log = logging.getLogger(__name__)
PPO_PHASES = ("rollout", "scoring", "update")   # consecutive in stages/ppo.py, the last ending at sink.log
REGISTERED = {"policy": ("ppo", "dpo", "sft"), "reward": ("reward",)}   # role -> the stages it comes from, first present


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "."))
        else:
            out[name] = str(v)[:6000]
    return out


def params_hash(flat: dict[str, str]) -> str:
    """Short hash of all params: the parent run's name carries it, so equal names mean equal params."""
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:8]


def _uri(uri: str) -> str:
    """sqlite:///relative/path.db -> an absolute path, with its folder created."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        path = Path(uri.removeprefix("sqlite:///")).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path}"
    return uri


def _best_effort(what: str, fn, *args) -> None:
    """Plots and tables are for reading, not for the pipeline's result: a failure is a warning."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        log.warning("tracking: could not log %s: %s: %s", what, type(e).__name__, e)


class StageRun:
    """A nested MLflow run that a stage logs step metrics into (buffered, sent in batches).

    With `measure`, each training step (a log with tokens_per_s, as StepLog sends) also gets step_s and
    memory: resident memory, its peak in the step and, for PPO, in each phase; on GPU the allocator's."""

    def __init__(self, client, run_id: str, measure: bool = False):
        self.client, self.run_id, self.buffer = client, run_id, []
        self.watch = None
        if measure:
            from flows.memory import MemoryWatch
            self.watch = MemoryWatch()
        self.last_step: Optional[tuple[int, float]] = None   # (step, perf_counter) of the last training step
        self.max_step: Optional[int] = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        if self.watch is not None and "tokens_per_s" in metrics:
            metrics = {**metrics, **self._measure(metrics, step)}
        self.max_step = step if self.max_step is None else max(self.max_step, step)
        now = int(time.time() * 1000)
        self.buffer += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if len(self.buffer) >= 900:
            self.flush()

    def _measure(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        t = time.perf_counter()
        extra = {"step_s": t - self.last_step[1]} if self.last_step else {}  # step 0 would include loading
        phases = tuple((p, float(metrics[f"{p}_s"])) for p in PPO_PHASES if f"{p}_s" in metrics)
        extra.update(self.watch.step(phases if len(phases) == len(PPO_PHASES) else ()))
        self.last_step = (step, t)
        return extra

    def flush(self) -> None:
        for i in range(0, len(self.buffer), 900):
            self.client.log_batch(self.run_id, metrics=self.buffer[i:i + 900])
        self.buffer = []

    def close(self) -> None:
        """Flush, stop measuring, and log the stage's memory peaks at its last step (if it logged anything:
        a stage that found its artifact cached ran nothing worth measuring)."""
        if self.watch is not None:
            watch, self.watch = self.watch, None
            watch.stop()
            if self.max_step is not None:
                self.log({f"stage_peak_{k}_mib": v for k, v in watch.stage_peak.items() if v > 0}, self.max_step)
        self.flush()


class Tracker:
    def __init__(self, params, flow_run_id: Optional[str] = None):
        self.client = None
        self.stage_runs: dict[str, str] = {}
        if not params.tracking.enabled:
            return
        logging.getLogger("alembic").setLevel(logging.WARNING)
        from mlflow import MlflowClient
        t = params.tracking
        self.pipeline = params.pipeline.name
        self.client = MlflowClient(tracking_uri=_uri(t.uri))
        exp = self.client.get_experiment_by_name(t.experiment)
        if exp is None:
            art = Path(t.artifacts).resolve()
            art.mkdir(parents=True, exist_ok=True)
            self.experiment_id = self.client.create_experiment(t.experiment, artifact_location=art.as_uri())
        else:
            self.experiment_id = exp.experiment_id
        flat = flatten(params.model_dump(mode="json"))
        self.run_name = f"{self.pipeline}-{params_hash(flat)}"
        tags = {"pipeline": self.pipeline, "prefect_flow_run_id": str(flow_run_id or ""),
                "params_hash": params_hash(flat)}
        self.run_id = self.client.create_run(self.experiment_id, run_name=self.run_name, tags=tags).info.run_id
        self._log_params(self.run_id, flat)

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
        # named by stage and artifact key: two runs with the same name made or reused the same artifact
        run = self.client.create_run(self.experiment_id, run_name=f"{stage}-{key[:8]}", tags=tags)
        named = {stage if k == "stage" else k: v for k, v in stage_params.items()}  # ppo.kl_coef, not stage.kl_coef
        self._log_params(run.info.run_id, flatten(named))
        self.stage_runs[stage] = run.info.run_id
        return StageRun(self.client, run.info.run_id)

    def end_stage(self, sink, result: Optional[StageResult], status: str = "FINISHED") -> None:
        if self.client is None or not isinstance(sink, StageRun):
            return
        if result is not None:
            if result.cached:  # headline metrics again, so that comparisons across runs stay complete
                sink.log(result.metrics, 0)
                self._tag_producer(sink.run_id, result.produced_by)
            else:
                self.client.set_tag(sink.run_id, "cache_hit", "false")
            for name in ("manifest.json", "samples.jsonl"):
                if (Path(result.artifact) / name).is_file():
                    self.client.log_artifact(sink.run_id, str(Path(result.artifact) / name))
            if (Path(result.artifact) / "samples.jsonl").is_file():
                _best_effort("the sample table", self._log_samples, sink.run_id, Path(result.artifact))
            self.client.set_tag(sink.run_id, "artifact", result.artifact)
        sink.flush()
        if result is None or not result.cached:  # a cached stage's curves live in the run that produced it
            stage = next(s for s, r in self.stage_runs.items() if r == sink.run_id)
            _best_effort("plots", self._log_plots, sink.run_id, stage)
        self.client.set_terminated(sink.run_id, status)

    def _tag_producer(self, run_id: str, producer: Optional[str]) -> None:
        """A cache hit names the stage run that made the artifact and, when this store has it, its pipeline run."""
        from mlflow.exceptions import MlflowException
        tags = {"cache_hit": "true", "produced_by_run": producer or "unknown"}
        if producer:
            try:
                parent = self.client.get_run(producer).data.tags.get("mlflow.parentRunId")
                if parent:
                    tags["produced_by_pipeline_run"] = parent
            except MlflowException:  # made under another tracking store: the id is all we know
                pass
        for k, v in tags.items():
            self.client.set_tag(run_id, k, v)

    def _log_samples(self, run_id: str, artifact: Path) -> None:
        """evaluate's samples.jsonl as an MLflow table: prompt, the SFT and the trained policy's answers, rewards."""
        import pandas as pd
        rows = [json.loads(line) for line in (artifact / "samples.jsonl").read_text().splitlines() if line.strip()]
        df = pd.DataFrame(rows).drop(columns=["prompt"], errors="ignore")  # prompt_text: the same, as text
        first = [c for c in ("prompt_text", "answer", "sft_response", "ppo_response", "dpo_response", "sft_reward",
                             "ppo_reward", "dpo_reward") if c in df.columns]
        self.client.log_table(run_id, data=df[first + [c for c in df.columns if c not in first]],
                              artifact_file="samples_table.json")

    def _log_plots(self, run_id: str, stage: str) -> None:
        from flows.plots import stage_plots, wanted
        names = wanted(self.client.get_run(run_id).data.metrics)
        curves = {n: [(m.step, m.value) for m in self.client.get_metric_history(run_id, n)] for n in names}
        with tempfile.TemporaryDirectory() as tmp:
            if stage_plots(curves, stage, Path(tmp)):
                self.client.log_artifacts(run_id, tmp, "plots")

    def finish(self, status: str = "FINISHED", summary: Optional[dict] = None) -> None:
        if self.client is None:
            return
        if summary:
            metrics = {f"{s}.{k}": v for s, r in summary.items() for k, v in r["metrics"].items()}
            for stage, run_id in self.stage_runs.items():
                peak = self.client.get_run(run_id).data.metrics.get("stage_peak_rss_mib")
                if peak is not None and stage in summary and not summary[stage]["cached"]:
                    metrics[f"{stage}.peak_rss_mib"] = peak
            run = StageRun(self.client, self.run_id)
            run.log(metrics, 0)
            run.flush()
            if status == "FINISHED":
                _best_effort("the registered models", self._register, summary)
        self.client.set_terminated(self.run_id, status)

    def _register(self, summary: dict) -> None:
        """One registered model per pipeline and role, one version per artifact whose source is the artifact's
        model/ folder (the weights stay where the artifact store keeps them). A run whose stage was a cache hit
        points at the version its artifact already has instead of adding a duplicate."""
        from mlflow.exceptions import MlflowException
        for role, stages in REGISTERED.items():
            stage = next((s for s in stages if s in summary), None)
            if stage is None:
                continue
            r, name = summary[stage], f"{self.pipeline}-{role}"
            try:
                self.client.create_registered_model(name, tags={"pipeline": self.pipeline},
                                                    description=f"the {role} model of pipeline {self.pipeline!r}")
            except MlflowException as e:
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
            source = str(Path(r["artifact"]) / "model")
            version = next((v for v in self.client.search_model_versions(f"name='{name}'")
                            if v.source == source and v.tags.get("cache_key") == r["key"]), None)
            if version is None:
                tags = {"artifact": r["artifact"], "cache_key": r["key"], "stage": stage, "pipeline_run": self.run_id}
                version = self.client.create_model_version(
                    name, source=source, run_id=self.stage_runs.get(stage), tags=tags,
                    description=f"{stage} artifact {r['key']}", await_creation_for=0)
            self.client.set_tag(self.run_id, f"registered_{role}", f"{name}/{version.version}")

    @property
    def parent_run_id(self) -> Optional[str]:
        return getattr(self, "run_id", None)
