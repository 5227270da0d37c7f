"""`hybrid-rlhf compare RUN_A RUN_B`: what differs between two pipeline runs, read from the MLflow store.

Params that differ, which stages ran or came from the cache (by artifact key), and the headline metrics
side by side; the same two runs in the UI's comparison page are one link away.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from urllib.parse import quote

from hybridcore.errors import InputError


def client_for(store: Path):
    from mlflow import MlflowClient

    from flows.ui import store_db
    logging.getLogger("alembic").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=f"sqlite:///{store_db(store)}")


def pipeline_run(client, run_id: str, store: Path):
    """The parent run `run_id`; a missing id or a stage's run is the user's mistake."""
    from mlflow.exceptions import MlflowException
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise InputError(f"run {run_id}: no such MLflow run in {store}/mlflow.db (give pipeline run ids, as "
                         f"printed after 'MLflow run:' by hybrid-rlhf run)") from None
    parent = run.data.tags.get("mlflow.parentRunId")
    if parent:
        raise InputError(f"run {run_id} is the {run.data.tags.get('stage', 'stage')} run of pipeline run {parent}; "
                         f"give pipeline (parent) run ids")
    return run


def stage_runs(client, run) -> dict:
    kids = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    return {k.data.tags.get("stage", k.info.run_name): k for k in kids}


def table(rows: list[tuple[str, ...]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def compare_url(run_ids: list[str], experiment_ids: list[str], port: int = 5000) -> str:
    """The UI's comparison page for these runs (its route takes JSON lists in the hash's query)."""
    runs, exps = (quote(json.dumps(x, separators=(",", ":"))) for x in (run_ids, sorted(set(experiment_ids))))
    return f"http://127.0.0.1:{port}/#/compare-runs?runs={runs}&experiments={exps}"


def compare(store: Path, run_a: str, run_b: str, headline: dict[str, tuple[str, ...]], all_metrics: bool = False) -> str:
    client = client_for(store)
    a, b = pipeline_run(client, run_a, store), pipeline_run(client, run_b, store)
    out = table([("", "A", "B"), ("run", a.info.run_id, b.info.run_id), ("name", a.info.run_name, b.info.run_name)],
                indent="")
    pa, pb = a.data.params, b.data.params
    names = sorted(set(pa) | set(pb))
    differ = [(k, pa.get(k, "-"), pb.get(k, "-")) for k in names if pa.get(k) != pb.get(k)]
    out.append(f"params that differ ({len(differ)} of {len(names)}):")
    out += table([("param", "A", "B"), *differ]) if differ else ["  none"]
    sa, sb = stage_runs(client, a), stage_runs(client, b)
    rows = []
    for stage in [s for s in headline if s in sa or s in sb] + sorted((set(sa) | set(sb)) - set(headline)):
        cells = []
        for runs in (sa, sb):
            r = runs.get(stage)
            cells.append("-" if r is None else f"{r.data.tags.get('cache_key', '?')[:12]} "
                         f"({'cached' if r.data.tags.get('cache_hit') == 'true' else 'ran'})")
        rows.append((stage, *cells))
    out.append("stages (artifact key):")
    out += table([("stage", "A", "B"), *rows]) if rows else ["  none"]
    ma, mb = a.data.metrics, b.data.metrics
    keys = (sorted(set(ma) | set(mb)) if all_metrics
            else [f"{s}.{m}" for s, ms in headline.items() for m in (*ms, "peak_rss_mib")
                  if f"{s}.{m}" in ma or f"{s}.{m}" in mb])
    rows = [(k, fmt(ma.get(k)), fmt(mb.get(k)),
             fmt(mb[k] - ma[k]) if k in ma and k in mb else "-") for k in keys]
    out.append("metrics:" if all_metrics else "headline metrics:")
    out += table([("metric", "A", "B", "B - A"), *rows]) if rows else ["  none"]
    url = compare_url([a.info.run_id, b.info.run_id], [a.info.experiment_id, b.info.experiment_id])
    out.append(f"in the UI (hybrid-rlhf ui): {url}")
    return "\n".join(out)
