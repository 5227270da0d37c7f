"""Two pipeline runs (tiny, and tiny with a PPO-only change) found through the MLflow server's REST API, as a
user's own tooling would: parents, nested stage runs, cache hits, metric histories, artifacts, the model
registry; then `hybrid-rlhf compare` on the same two runs, and `hybrid-rlhf ui` stopping on Ctrl-C."""
from __future__ import annotations

import json
import signal
import socket
import urllib.request
from urllib.parse import quote

import psutil
import pytest

from tests.conftest import run_cli
from tests.flows.conftest import api, free_port, start_ui, stop_tree, tree

STAGES = ("sft", "reward", "ppo", "evaluate")


def _search(server, experiment_id: str, filter_string: str) -> list[dict]:
    body = {"experiment_ids": [experiment_id], "filter": filter_string, "max_results": 1000}
    return api(server, "/api/2.0/mlflow/runs/search", body).get("runs", [])


def _kv(items: list[dict]) -> dict:
    return {t["key"]: t["value"] for t in items}


def _tags(run: dict) -> dict:
    return _kv(run["data"].get("tags", []))


def _params(run: dict) -> dict:
    return _kv(run["data"].get("params", []))


def _history(server, run_id: str, key: str) -> list[tuple[int, float]]:
    out = api(server, f"/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key={key}&max_results=25000")
    return sorted((int(m.get("step", 0)), m["value"]) for m in out.get("metrics", []))


def _artifacts(server, run_id: str, path: str = "") -> set[str]:
    out = api(server, f"/api/2.0/mlflow/artifacts/list?run_id={run_id}&path={quote(path)}")
    return {f["path"] for f in out.get("files", [])}


def _download(server, run_id: str, path: str) -> bytes:
    with urllib.request.urlopen(f"{server.url}/get-artifact?run_uuid={run_id}&path={quote(path)}", timeout=30) as r:
        return r.read()


@pytest.fixture(scope="module")
def found(mlflow_ui, two_runs) -> dict:
    """Both parent runs and their stage runs by stage, as the REST API returns them."""
    exp = api(mlflow_ui, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=hybrid-rlhf")["experiment"]
    parents = {r["info"]["run_id"]: r for r in _search(mlflow_ui, exp["experiment_id"], "tags.pipeline = 'tiny'")}
    out = {"experiment_id": exp["experiment_id"]}
    for name, summary in (("a", two_runs.a), ("b", two_runs.b)):
        run_id = summary["mlflow_run_id"]
        assert run_id in parents, f"run {name} ({run_id}) not found by runs/search"
        kids = _search(mlflow_ui, exp["experiment_id"], f"tags.mlflow.parentRunId = '{run_id}'")
        out[name] = {"parent": parents[run_id], "stages": {_tags(k)["stage"]: k for k in kids}}
    return out


def test_both_runs_with_params_and_nested_stage_runs(found, two_runs):
    """Each parent has its flattened params and one nested run per stage; the names tell the runs apart."""
    a, b = found["a"], found["b"]
    assert (_params(a["parent"])["ppo.iterations"], _params(b["parent"])["ppo.iterations"]) == ("40", "3")
    assert (_params(a["parent"])["ppo.kl_coef"], _params(b["parent"])["ppo.kl_coef"]) == ("0.2", "0.1")
    assert a["parent"]["info"]["run_name"] != b["parent"]["info"]["run_name"]
    assert a["parent"]["info"]["run_name"].startswith("tiny-")
    for run in (a, b):
        assert set(run["stages"]) == set(STAGES)
        assert all(s["info"]["status"] == "FINISHED" for s in run["stages"].values())
    assert _params(b["stages"]["ppo"])["ppo.iterations"] == "3"
    assert _tags(b["parent"])["registered_policy"].startswith("tiny-policy/")


def test_cache_hits_name_their_producer_and_keep_headline_metrics(found, two_runs):
    """Run B reused A's SFT and RM: tagged as cache hits naming A's stage runs, with A's headline metrics."""
    a, b = found["a"]["stages"], found["b"]["stages"]
    for stage in ("sft", "reward"):
        tags = _tags(b[stage])
        assert tags["cache_hit"] == "true", stage
        assert tags["produced_by_run"] == a[stage]["info"]["run_id"], stage
        assert tags["produced_by_pipeline_run"] == two_runs.a["mlflow_run_id"], stage
        metrics = {m["key"]: m["value"] for m in b[stage]["data"]["metrics"]}
        for k, v in two_runs.a["stages"][stage]["metrics"].items():
            assert metrics[k] == pytest.approx(v), (stage, k)
    for stage in ("ppo", "evaluate"):
        assert _tags(b[stage])["cache_hit"] == "false", stage
        assert _tags(b[stage])["cache_key"] == two_runs.b["stages"][stage]["key"]


def test_metric_histories_per_step(found, mlflow_ui, two_runs):
    """PPO logs every iteration's reward, KL, length, time split, step time and memory (per phase too)."""
    ppo = found["b"]["stages"]["ppo"]["info"]["run_id"]
    for key in ("reward", "kl", "response_length", "tokens_per_s", "rollout_s", "scoring_s", "update_s", "rss_mib",
                "peak_rss_mib", "peak_rss_rollout_mib", "peak_rss_scoring_mib", "peak_rss_update_mib"):
        assert [s for s, _ in _history(mlflow_ui, ppo, key)] == [0, 1, 2], key
    assert [s for s, _ in _history(mlflow_ui, ppo, "step_s")] == [1, 2]
    rss, peak = _history(mlflow_ui, ppo, "rss_mib"), _history(mlflow_ui, ppo, "peak_rss_mib")
    assert all(50 < r <= p for (_, r), (_, p) in zip(rss, peak))
    for _, t in _history(mlflow_ui, ppo, "step_s"):
        assert 0 < t < 120
    sft = found["a"]["stages"]["sft"]["info"]["run_id"]
    assert len(_history(mlflow_ui, sft, "loss")) == two_runs.a["stages"]["sft"]["metrics"]["steps"]
    assert len(_history(mlflow_ui, sft, "peak_rss_mib")) == two_runs.a["stages"]["sft"]["metrics"]["steps"]


def test_artifacts_plots_table_and_manifest(found, mlflow_ui, two_runs):
    """Plots as PNG, the sample table with both policies' answers and rewards, every stage's manifest."""
    ppo = found["b"]["stages"]["ppo"]["info"]["run_id"]
    plots = _artifacts(mlflow_ui, ppo, "plots")
    for name in ("loss", "reward", "kl", "response_length", "time_split", "memory"):
        assert f"plots/{name}.png" in plots, (name, plots)
    assert _download(mlflow_ui, ppo, "plots/reward.png")[:8] == b"\x89PNG\r\n\x1a\n"
    for run in (found["a"], found["b"]):
        for stage, r in run["stages"].items():
            assert "manifest.json" in _artifacts(mlflow_ui, r["info"]["run_id"]), stage
    ev = found["b"]["stages"]["evaluate"]["info"]["run_id"]
    table = json.loads(_download(mlflow_ui, ev, "samples_table.json"))
    assert {"prompt_text", "answer", "sft_response", "ppo_response", "sft_reward", "ppo_reward"} <= set(table["columns"])
    assert len(table["data"]) == 16   # evaluate.samples in params/tiny.yaml
    assert json.loads(_tags(found["b"]["stages"]["evaluate"])["mlflow.loggedArtifacts"])[0]["type"] == "table"


def test_models_registered_as_pointers_to_artifacts(mlflow_ui, found, two_runs):
    """One version of tiny-policy / tiny-reward per artifact, whose source is the artifact's model/ folder: the
    second run's PPO ran and adds a version; its reward stage was a cache hit and points at the first run's
    version. No weights are copied into mlruns/."""
    for role, stage in (("policy", "ppo"), ("reward", "reward")):
        name_filter = quote(f"name='tiny-{role}'")
        versions = api(mlflow_ui, f"/api/2.0/mlflow/model-versions/search?filter={name_filter}")["model_versions"]
        for run in ("a", "b"):
            summary = getattr(two_runs, run)
            r = summary["stages"][stage]
            mine = [v for v in versions if v["source"] == f"{r['artifact']}/model"]
            assert len(mine) == 1, (role, run)
            tags = _kv(mine[0]["tags"])
            assert (tags["artifact"], tags["cache_key"]) == (r["artifact"], r["key"])
            assert _tags(found[run]["parent"])[f"registered_{role}"] == f"tiny-{role}/{mine[0]['version']}"
            made_by = "a" if r["cached"] else run
            assert tags["pipeline_run"] == getattr(two_runs, made_by)["mlflow_run_id"], (role, run)
            assert mine[0]["run_id"] == found[made_by]["stages"][stage]["info"]["run_id"]
    assert two_runs.b["stages"]["reward"]["cached"] and not two_runs.b["stages"]["ppo"]["cached"]
    assert not list((two_runs.workdir / "mlruns").rglob("*.safetensors"))


def test_compare_cli_shows_differing_params_and_metrics(two_runs):
    """`hybrid-rlhf compare A B`: only the params that differ, stage cache status, headline metrics."""
    proc = run_cli(["compare", two_runs.a["mlflow_run_id"], two_runs.b["mlflow_run_id"]], two_runs.workdir,
                   timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    params = lines[lines.index(next(x for x in lines if x.startswith("params that differ"))):]
    params = params[:params.index("stages (artifact key):")]
    assert [x.split() for x in params[2:]] == [["ppo.iterations", "40", "3"], ["ppo.kl_coef", "0.2", "0.1"]]
    sft = next(x for x in lines if x.split()[:1] == ["sft"])
    assert "(ran)" in sft and "(cached)" in sft
    for key in ("sft.train_loss", "reward.heldout_accuracy", "ppo.reward_last", "evaluate.ppo_accuracy"):
        assert any(x.split()[:1] == [key] for x in lines), key
    assert "#/compare-runs?runs=" in proc.stdout


def test_compare_missing_run_is_input_error(two_runs):
    """An unknown run id: exit code 2 and one line naming it."""
    proc = run_cli(["compare", two_runs.a["mlflow_run_id"], "0" * 32], two_runs.workdir, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: run " + "0" * 32), proc.stderr


def test_ui_stops_cleanly_on_ctrl_c(two_runs):
    """SIGINT (Ctrl-C) ends `hybrid-rlhf ui` with code 0, its server processes gone and the port free."""
    server = start_ui(two_runs.workdir, free_port())
    try:
        procs = tree(server.proc.pid)
        assert len(procs) >= 3   # ui -> mlflow server -> uvicorn
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=30) == 0
        _, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive, alive
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", server.port)) != 0
    finally:
        stop_tree(server.proc)
