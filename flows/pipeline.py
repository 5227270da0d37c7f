"""The `rlhf` flow: one Prefect task per stage, cached by the stage's artifact key.

Prefect's task cache is keyed by the same key as the artifact store (`StageKey`), and the store stays
the truth: a Prefect cache hit whose artifact no longer verifies is run again with the cache refreshed,
and a task that runs finds a verified artifact before it trains anything.
"""
from __future__ import annotations

from typing import Optional

from prefect import flow, task
from prefect.cache_policies import CachePolicy
from prefect.context import get_run_context

from flows.tracking import StageRun, Tracker
from stages.checks import preflight
from stages.keys import stage_keys, stage_params
from stages.params import Overrides, Params, StageName, load_params, stage_list
from stages.runner import NullSink, StageResult, cached_result, run_stage


class StageKey(CachePolicy):
    """Cache key = the stage's artifact key (params, inputs' keys, code version); nothing else."""

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> Optional[str]:
        return f"{inputs['stage']}-{inputs['keys'][inputs['stage']]}"


def _sink(params: Params, run_id: Optional[str]):
    if run_id is None or not params.tracking.enabled:
        return NullSink()
    from mlflow import MlflowClient

    from flows.tracking import _uri
    return StageRun(MlflowClient(tracking_uri=_uri(params.tracking.uri)), run_id, measure=True)


@task(cache_policy=StageKey(), persist_result=True, result_serializer="json", task_run_name="{stage}")
def stage_task(stage: str, params: dict, keys: dict, tracking_run: Optional[str] = None, force: bool = False) -> dict:
    p = Params.model_validate(params)
    sink = _sink(p, tracking_run)
    try:
        result = run_stage(p, stage, keys, sink, run_id=tracking_run, force=force)
    finally:  # also for a failed or interrupted stage: its curves so far are kept
        if isinstance(sink, StageRun):
            sink.close()
    return result.as_dict()


def _run(stage: str, args: dict, params: Params, keys: dict) -> tuple[StageResult, bool]:
    task_fn = stage_task.with_options(refresh_cache=True) if args["force"] else stage_task
    state = task_fn(**args, return_state=True)
    out = state.result()
    hit = cached_result(params, stage, keys[stage])
    if hit is None:  # Prefect remembered a result whose artifact is gone or corrupt: rebuild it
        state = stage_task.with_options(refresh_cache=True)(**{**args, "force": True}, return_state=True)
        out = state.result()
        hit = cached_result(params, stage, keys[stage])
        if hit is None:
            raise RuntimeError(f"stage {stage}: artifact {keys[stage]} does not verify right after it was written")
    hit.cached = state.name == "Cached" or out["cached"]
    return hit, hit.cached


@flow(name="rlhf")
def rlhf(preset: str = "tiny", overrides: Optional[Overrides] = None,
         force: Optional[list[StageName]] = None) -> dict:
    """The stages pipeline.stages lists (by default SFT -> reward model -> PPO -> evaluation) on the params
    `preset` (a name in params/ or a YAML path) with `overrides` deep-merged onto it; stages named in `force` run
    even when cached. Returns the run summary (see --summary-json in the README)."""
    if isinstance(overrides, dict):
        overrides = Overrides.model_validate(overrides)
    params = load_params(preset, overrides.model_dump(exclude_none=True) if overrides else None)
    preflight(params)
    keys = stage_keys(params)
    flow_run_id = str(get_run_context().flow_run.id)
    tracker = Tracker(params, flow_run_id)
    summary: dict[str, dict] = {}
    sink = None
    try:
        for stage in stage_list(params):
            sink = tracker.start_stage(stage, keys[stage], stage_params(params, stage))
            args = dict(stage=stage, params=params.model_dump(mode="json"), keys=keys,
                        tracking_run=getattr(sink, "run_id", None), force=stage in (force or []))
            result, _ = _run(stage, args, params, keys)
            tracker.end_stage(sink, result)
            sink = None
            summary[stage] = result.as_dict()
    except BaseException:
        if sink is not None:
            tracker.end_stage(sink, None, "FAILED")
        tracker.finish("FAILED")
        raise
    tracker.finish("FINISHED", summary)
    return {"run_id": flow_run_id, "mlflow_run_id": tracker.parent_run_id, "stages": summary}
